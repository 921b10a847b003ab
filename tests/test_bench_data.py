"""tf_topk.bench.data: the one loader of the examples and benchmarks."""

import numpy as np
import pytest

from tf_topk.bench.data import load_data


@pytest.mark.parametrize("name,features", [("digits", 64), ("synthetic", 64), ("shapes", 256), ("signals", 64)])
def test_offline_data_sets_split_and_types(name, features):
    x_train, y_train, x_test, y_test = load_data(name, seed=3)
    assert x_train.dtype == x_test.dtype == np.float32 and y_train.dtype == y_test.dtype == np.int32
    assert x_train.shape[1] == x_test.shape[1] == features
    total = len(x_train) + len(x_test)
    assert len(x_test) == pytest.approx(0.2 * total, abs=1)
    assert set(np.unique(y_train)) == set(np.unique(y_test)) == set(range(10))  # stratified
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
