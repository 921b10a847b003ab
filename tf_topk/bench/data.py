"""The data sets of the examples and benchmarks, loaded one way everywhere.

digits (scikit-learn, ships with it), synthetic (scikit-learn's
make_classification: 2500 samples, 64 features, 10 classes) and shapes
(generated here: 16x16 images of 10 glyphs, see `make_shapes`), signals
(generated here: 1-D waveforms of 10 kinds, see `make_signals`), text
(next-byte prediction on the Python standard library's source) and prose (on
the English docstrings of numpy and scikit-learn; both `tf_topk.bench.text`)
work offline; mnist and cifar10 download through
keras.datasets and fail with a message that says so.

colors, sequences and ratings (generated here: `make_colors`, `make_sequences`,
`make_ratings`) are the validation half of the task suite (`tf_topk.bench.suite`):
kinds of model the development tasks above do not have (colour images in 20
classes, a recurrent classifier, an embedding model), on which nothing is tuned.
"""

import sys

DATASETS = ("digits", "synthetic", "shapes", "signals", "colors", "sequences", "ratings", "text", "prose",
            "reference", "mnist", "cifar10")
# The generated tasks of the suite's validation half (`make_colors`, `make_sequences`, `make_ratings`).
VALIDATION_DATASETS = ("colors", "sequences", "ratings")

# The shapes task's glyphs, one per class, drawn at scale 1 or 2.
GLYPHS = (
    ("..#..", "..#..", "#####", "..#..", "..#.."),  # plus
    ("#...#", ".#.#.", "..#..", ".#.#.", "#...#"),  # cross
    ("#####", "#...#", "#...#", "#...#", "#####"),  # square outline
    ("#####", "#####", "#####", "#####", "#####"),  # filled square
    ("#....", "#....", "#....", "#....", "#####"),  # L
    ("#####", "..#..", "..#..", "..#..", "..#.."),  # T
    (".###.", "#...#", "#...#", "#...#", ".###."),  # ring
    ("..#..", ".#.#.", "#...#", "#...#", "#####"),  # triangle
    ("#####", ".....", "#####", ".....", "#####"),  # three bars
    ("#.#.#", "#.#.#", "#.#.#", "#.#.#", "#.#.#"),  # three columns
)
SHAPES_SIZE = 16


def make_shapes(samples, seed):
    """A translation task where an MLP is not enough: (x [samples, 256] float32, y int32).

    Each 16x16 image holds one of 10 glyphs (`GLYPHS`) at a random position,
    scale (1 or 2) and brightness, in Gaussian noise (sigma 0.35), and in 70%
    of the images a short distractor stroke. A class is a shape wherever it
    sits, which convolutions share across positions and a dense layer must
    learn position by position.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    glyphs = [np.array([[c == "#" for c in row] for row in glyph], np.float32) for glyph in GLYPHS]
    x = rng.normal(0.0, 0.35, (samples, SHAPES_SIZE, SHAPES_SIZE)).astype(np.float32)
    y = rng.integers(0, len(GLYPHS), samples).astype(np.int32)
    for i in range(samples):
        scale = int(rng.integers(1, 3))
        glyph = np.kron(glyphs[y[i]], np.ones((scale, scale), np.float32))
        side = glyph.shape[0]
        row, col = rng.integers(0, SHAPES_SIZE - side + 1, 2)
        x[i, row:row + side, col:col + side] += glyph * rng.uniform(0.7, 1.3)
        if rng.random() < 0.7:
            row, col = rng.integers(0, SHAPES_SIZE, 2)
            length = int(rng.integers(2, 5))
            if rng.random() < 0.5:
                x[i, row, col:col + length] += 0.8
            else:
                x[i, row:row + length, col] += 0.8
    return x.reshape(samples, -1), y


SIGNAL_LENGTH = 64


def _signal_motifs(count):
    """A waveform maker (length -> array) for each of `count` kinds (`make_signals`' classes):
    sines of three frequencies, a square wave, a sawtooth, rising and falling chirps, a damped
    pulse, a double spike and a step."""
    import numpy as np

    def t(length):
        return np.linspace(0.0, 1.0, length, dtype=np.float32)

    def chirp(length, up):
        phase = np.cumsum(np.linspace(1.0, 4.0, length) if up else np.linspace(4.0, 1.0, length))
        return np.sin(2 * np.pi * phase / length * 2).astype(np.float32)

    shapes = [
        lambda n: np.sin(2 * np.pi * 1.0 * t(n)),
        lambda n: np.sin(2 * np.pi * 2.0 * t(n)),
        lambda n: np.sin(2 * np.pi * 3.0 * t(n)),
        lambda n: np.sign(np.sin(2 * np.pi * 2.0 * t(n)) + 1e-6),
        lambda n: 2.0 * (2.0 * t(n) % 1.0) - 1.0,
        lambda n: chirp(n, up=True),
        lambda n: chirp(n, up=False),
        lambda n: np.exp(-4.0 * t(n)) * np.sin(2 * np.pi * 4.0 * t(n)),
        lambda n: np.where((np.abs(t(n) - 0.25) < 0.08) | (np.abs(t(n) - 0.75) < 0.08), 1.0, 0.0),
        lambda n: np.where(t(n) < 0.5, -0.6, 0.6),
    ]
    return shapes[:count]


def make_signals(samples, seed):
    """A 1-D task for a 1-D CNN: (x [samples, 64] float32, y int32).

    Each sequence holds one of 10 waveforms (`_signal_motifs`) of random
    length (14 to 18), position and amplitude (0.6 to 1.4), in Gaussian noise
    (sigma 0.3), and in 70% of the sequences a distractor: a Gaussian bump
    of either sign. As with `shapes`, a class is a waveform
    wherever it sits, which convolutions share across positions.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    motifs = _signal_motifs(10)
    x = rng.normal(0.0, 0.3, (samples, SIGNAL_LENGTH)).astype(np.float32)
    y = rng.integers(0, len(motifs), samples).astype(np.int32)
    positions = np.arange(SIGNAL_LENGTH, dtype=np.float32)
    for i in range(samples):
        length = int(rng.integers(14, 19))
        start = int(rng.integers(0, SIGNAL_LENGTH - length + 1))
        x[i, start:start + length] += rng.uniform(0.6, 1.4) * motifs[y[i]](length)
        if rng.random() < 0.7:
            center, width = rng.uniform(0, SIGNAL_LENGTH), rng.uniform(1.0, 4.0)
            x[i] += rng.choice((-0.8, 0.8)) * np.exp(-0.5 * ((positions - center) / width) ** 2)
    return x, y


COLORS_CHANNELS = 3
# The colors task's two palettes (red, green, blue weights of a glyph's stroke): near enough that the
# colour alone, under each image's jitter, does not tell them apart everywhere.
PALETTES = ((0.9, 0.55, 0.25), (0.55, 0.9, 0.25))


def make_colors(samples, seed):
    """A colour image task of 20 classes: (x [samples, 16 * 16 * 3] float32, y int32).

    Each 16x16 RGB image holds one of `GLYPHS` at a random position, scale (1 or 2) and brightness,
    stroked in one of two `PALETTES` (class = glyph * 2 + palette), each channel's weight jittered
    by +-0.15, over noise correlated across channels (sigma 0.3, plus 0.2 shared), and in 70% of
    the images a distractor stroke in a random colour. The classes need the shape (as in
    `shapes`) and the colour together, across channels, which the development tasks never ask.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    glyphs = [np.array([[c == "#" for c in row] for row in glyph], np.float32) for glyph in GLYPHS]
    side = SHAPES_SIZE
    x = rng.normal(0.0, 0.3, (samples, side, side, COLORS_CHANNELS)) + \
        rng.normal(0.0, 0.2, (samples, side, side, 1))
    x = x.astype(np.float32)
    y = rng.integers(0, 2 * len(GLYPHS), samples).astype(np.int32)
    for i in range(samples):
        glyph_index, palette = divmod(int(y[i]), 2)
        scale = int(rng.integers(1, 3))
        glyph = np.kron(glyphs[glyph_index], np.ones((scale, scale), np.float32))
        extent = glyph.shape[0]
        row, col = rng.integers(0, side - extent + 1, 2)
        colour = np.asarray(PALETTES[palette]) + rng.uniform(-0.15, 0.15, COLORS_CHANNELS)
        x[i, row:row + extent, col:col + extent] += glyph[..., None] * colour * rng.uniform(0.7, 1.3)
        if rng.random() < 0.7:
            row, col = rng.integers(0, side, 2)
            length = int(rng.integers(2, 5))
            stroke = rng.uniform(0.2, 1.0, COLORS_CHANNELS)
            if rng.random() < 0.5:
                x[i, row, col:col + length] += stroke
            else:
                x[i, row:row + length, col] += stroke
    return x.reshape(samples, -1), y


SEQUENCE_TOKENS = 12
SEQUENCE_LENGTH = 30
SEQUENCE_CLASSES = 8


def sequence_chains():
    """The sequences task's transition matrices [classes, tokens, tokens] (rows sum to 1): a shared
    Dirichlet draw mixed half and half with each class's own; the task's, the same for every seed."""
    import numpy as np

    chains = np.random.default_rng(1234)
    shared = chains.dirichlet(np.full(SEQUENCE_TOKENS, 0.5), SEQUENCE_TOKENS)
    own = chains.dirichlet(np.full(SEQUENCE_TOKENS, 0.5), (SEQUENCE_CLASSES, SEQUENCE_TOKENS))
    return 0.5 * shared[None] + 0.5 * own


def make_sequences(samples, seed):
    """A sequence task for a recurrent network: (x [samples, 30] float32 token ids, y int32).

    Each class is a first-order Markov chain over 12 tokens whose transition matrix is a shared one
    (a Dirichlet draw, fixed by the task, not by `seed`) mixed half and half with its own: a class shows in
    which transitions are more frequent along the whole sequence, not in any one token, so the model
    must carry counts through time. The first token is uniform. Ids are stored as float32 like the
    other tasks' features (the model's embedding casts them).
    """
    import numpy as np

    cumulative = np.cumsum(sequence_chains(), axis=-1)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, SEQUENCE_CLASSES, samples).astype(np.int32)
    x = np.empty((samples, SEQUENCE_LENGTH), np.int64)
    x[:, 0] = rng.integers(0, SEQUENCE_TOKENS, samples)
    draws = rng.random((samples, SEQUENCE_LENGTH))
    for t in range(1, SEQUENCE_LENGTH):
        rows = cumulative[y, x[:, t - 1]]
        x[:, t] = np.minimum((rows < draws[:, t, None]).sum(axis=1), SEQUENCE_TOKENS - 1)
    return x.astype(np.float32), y


RATINGS_USERS = 400
RATINGS_ITEMS = 250
RATINGS_CLASSES = 5


def make_ratings(samples, seed):
    """A recommendation-style task, embedding-heavy with sparse rows: (x [samples, 2] float32
    (user id, item id), y int32 rating 0-4).

    Users and items have latent vectors of 4 (the task's, fixed; not by `seed`) and biases; a
    rating is the quintile of u.v + b_u + b_i + noise (sigma 0.5) over the task's pairs. Users are
    drawn uniformly and items by popularity (Zipf-like, exponent 0.8), so each batch's gradient
    touches few rows of the item and user tables, most rows rarely: what an embedding's gradient
    (IndexedSlices) looks like in recommendation models.
    """
    import numpy as np

    task = np.random.default_rng(4321)
    users = task.normal(0.0, 1.0, (RATINGS_USERS, 4)) / np.sqrt(4)
    items = task.normal(0.0, 1.0, (RATINGS_ITEMS, 4))
    user_bias, item_bias = task.normal(0.0, 0.5, RATINGS_USERS), task.normal(0.0, 0.5, RATINGS_ITEMS)
    popularity = 1.0 / np.arange(1, RATINGS_ITEMS + 1) ** 0.8
    rng = np.random.default_rng(seed)
    u = rng.integers(0, RATINGS_USERS, samples)
    i = rng.choice(RATINGS_ITEMS, samples, p=popularity / popularity.sum())
    score = np.einsum("nd,nd->n", users[u], items[i]) + user_bias[u] + item_bias[i] + rng.normal(0.0, 0.5, samples)
    edges = np.quantile(score, [0.2, 0.4, 0.6, 0.8])
    y = np.searchsorted(edges, score).astype(np.int32)
    return np.stack([u, i], axis=1).astype(np.float32), y


def load_data(name, seed=0):
    """(x_train, y_train, x_test, y_test): flat float32 features, int32 labels.

    digits, synthetic, shapes, signals, colors, sequences and ratings get a
    fixed stratified split (20% test, `seed`); mnist and cifar10 their published split, features scaled to [0, 1].
    shapes are 16x16 images, flattened (reshape to (16, 16, 1) for a CNN);
    signals are sequences of 64 (reshape to (64, 1) for a 1-D CNN); colors are
    16x16x3 images, flattened; sequences 30 token ids and ratings (user, item)
    ids, as float32.
    text (Python source), prose (English docstrings) and reference (pydoc's
    topics of the Python Language Reference, a small corpus) give int32 byte windows
    [n, 64] and their next-byte targets [n, 64]: training windows drawn at random
    (`seed`) before the held-out tail, the test set fixed windows in it
    (`tf_topk.bench.text.load_text`).
    """
    if name in ("text", "prose", "reference"):
        from tf_topk.bench.text import load_text

        return load_text(seed, corpus=name)
    import numpy as np

    if name in ("digits", "synthetic", "shapes", "signals", *VALIDATION_DATASETS):
        from sklearn.model_selection import train_test_split

        if name == "digits":
            from sklearn.datasets import load_digits

            x, y = load_digits(return_X_y=True)
            x = x / 16.0
        elif name == "shapes":
            x, y = make_shapes(3750, seed)
        elif name == "signals":
            x, y = make_signals(3750, seed)
        elif name == "colors":
            x, y = make_colors(5000, seed)
        elif name == "sequences":
            x, y = make_sequences(4000, seed)
        elif name == "ratings":
            x, y = make_ratings(30000, seed)
        else:
            from sklearn.datasets import make_classification

            x, y = make_classification(n_samples=2500, n_features=64, n_informative=32, n_redundant=8,
                                       n_classes=10, n_clusters_per_class=2, class_sep=1.5, random_state=seed)
            x = (x - x.mean(0)) / x.std(0)
        x_train, x_test, y_train, y_test = train_test_split(x.astype(np.float32), y.astype(np.int32),
                                                            test_size=0.2, stratify=y, random_state=seed)
        return x_train, y_train, x_test, y_test
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    import keras

    loader = {"mnist": keras.datasets.mnist, "cifar10": keras.datasets.cifar10}[name]
    try:
        (x_train, y_train), (x_test, y_test) = loader.load_data()
    except Exception as error:  # urllib/ssl/OS errors: all mean "no download"
        sys.exit(f"error: could not download {name} through keras.datasets ({type(error).__name__}: {error}).\n"
                 f"It needs internet access, or the file already in the Keras cache (~/.keras/datasets by "
                 f"default). The default --dataset digits works offline.")

    def flat(a):
        return (a.reshape(len(a), -1) / 255.0).astype(np.float32)

    return flat(x_train), y_train.reshape(-1).astype(np.int32), flat(x_test), y_test.reshape(-1).astype(np.int32)
