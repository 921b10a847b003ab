"""tf_topk.bench.data: the one loader of the examples and benchmarks."""

import numpy as np
import pytest

from tf_topk.bench.data import load_data


@pytest.mark.parametrize("name,features,classes", [("digits", 64, 10), ("synthetic", 64, 10), ("shapes", 256, 10),
                                                   ("signals", 64, 10), ("colors", 768, 20), ("sequences", 30, 8),
                                                   ("ratings", 2, 5)])
def test_offline_data_sets_split_and_types(name, features, classes):
    x_train, y_train, x_test, y_test = load_data(name, seed=3)
    assert x_train.dtype == x_test.dtype == np.float32 and y_train.dtype == y_test.dtype == np.int32
    assert x_train.shape[1] == x_test.shape[1] == features
    total = len(x_train) + len(x_test)
    assert len(x_test) == pytest.approx(0.2 * total, abs=1)
    assert set(np.unique(y_train)) == set(np.unique(y_test)) == set(range(classes))  # stratified
    again = load_data(name, seed=3)
    np.testing.assert_array_equal(again[0], x_train)
    other = load_data(name, seed=4)
    assert not np.array_equal(other[0], x_train)
    if name == "digits":
        assert 0.0 <= x_train.min() and x_train.max() <= 1.0


def test_unknown_data_set_is_named():
    with pytest.raises(ValueError, match=r"dataset must be one of .*'imagenet'"):
        load_data("imagenet")


def test_shapes_draw_each_class_glyph_somewhere_in_the_image():
    """Averaged over its images, a class's glyph stands out of the noise (about 0 on average)."""
    from tf_topk.bench.data import SHAPES_SIZE, make_shapes

    x, y = make_shapes(2000, seed=0)
    assert x.shape == (2000, SHAPES_SIZE * SHAPES_SIZE)
    images = x.reshape(-1, SHAPES_SIZE, SHAPES_SIZE)
    totals = [images[y == c].sum(axis=(1, 2)).mean() for c in range(10)]
    # The filled square (class 3) has the most ink, the cross (class 1) among the least.
    assert int(np.argmax(totals)) == 3 and totals[3] > 2 * totals[1] > 0


def test_signals_hold_their_class_waveform_somewhere_in_the_sequence():
    """Each sequence holds its class's waveform: its best match (the largest correlation with the waveform
    at any position) is higher for its own class's waveform than for the other classes', for most sequences."""
    from tf_topk.bench.data import SIGNAL_LENGTH, _signal_motifs, make_signals

    x, y = make_signals(500, seed=0)
    assert x.shape == (500, SIGNAL_LENGTH) and np.bincount(y, minlength=10).min() > 20
    motifs = [motif(16) for motif in _signal_motifs(10)]
    motifs = [(m - m.mean()) / np.linalg.norm(m - m.mean()) for m in motifs]
    best = np.array([[np.correlate(row, m, mode="valid").max() for m in motifs] for row in x])
    assert np.mean(np.argmax(best, axis=1) == y) > 0.5  # chance: 0.1


def test_colors_classes_are_a_glyph_and_a_palette():
    """Class 2g + p: glyph g of GLYPHS in palette p; palette 0 strokes redder than green, 1 greener."""
    from tf_topk.bench.data import GLYPHS, PALETTES, make_colors

    x, y = make_colors(600, seed=0)
    assert x.shape == (600, 16 * 16 * 3) and set(np.unique(y)) == set(range(2 * len(GLYPHS)))
    assert PALETTES[0][0] > PALETTES[0][1] and PALETTES[1][1] > PALETTES[1][0]
    red_minus_green = (x.reshape(-1, 16, 16, 3)[..., 0] - x.reshape(-1, 16, 16, 3)[..., 1]).sum(axis=(1, 2))
    assert red_minus_green[y % 2 == 0].mean() > 2.0 > -2.0 > red_minus_green[y % 2 == 1].mean()


def test_sequences_follow_their_class_chain_closely_enough_to_classify():
    """The class shows in the transitions: the likelihood under each class's chain picks it in most
    sequences (the Bayes rule the GRU can approach)."""
    from tf_topk.bench.data import SEQUENCE_CLASSES, SEQUENCE_TOKENS, make_sequences, sequence_chains

    chains = sequence_chains()
    assert chains.shape == (SEQUENCE_CLASSES, SEQUENCE_TOKENS, SEQUENCE_TOKENS)
    np.testing.assert_allclose(chains.sum(-1), 1.0)
    x, y = make_sequences(2000, seed=1)
    tokens = x.astype(int)
    assert x.dtype == np.float32 and tokens.min() == 0 and tokens.max() == SEQUENCE_TOKENS - 1
    likelihood = np.stack([np.log(chains[c][tokens[:, :-1], tokens[:, 1:]]).sum(1) for c in range(SEQUENCE_CLASSES)], 1)
    assert np.mean(likelihood.argmax(1) == y) > 0.85
    rows = np.arange(len(y))
    assert np.mean(likelihood[rows, (y + 1) % SEQUENCE_CLASSES] < likelihood[rows, y]) > 0.85  # another chain: worse


def test_ratings_are_quintiles_with_popular_items_and_ids_in_their_tables():
    from tf_topk.bench.data import RATINGS_ITEMS, RATINGS_USERS, make_ratings

    x, y = make_ratings(20_000, seed=2)
    users, items = x[:, 0].astype(int), x[:, 1].astype(int)
    assert 0 <= users.min() and users.max() < RATINGS_USERS and 0 <= items.min() and items.max() < RATINGS_ITEMS
    np.testing.assert_allclose(np.bincount(y, minlength=5) / len(y), 0.2, atol=0.01)
    counts = np.bincount(items, minlength=RATINGS_ITEMS)
    assert counts.max() > 20 * np.median(counts)  # a batch touches the popular rows, most rows rarely
