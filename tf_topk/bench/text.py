"""The convergence benchmark's language-model task: next-byte prediction on Python source.

The corpus is the standard library's own `.py` files, which ship with every
Python, so the task works offline and needs no download: the files under
`sysconfig.get_paths()["stdlib"]` in sorted order of their relative paths,
concatenated and cut at `CORPUS_BYTES`. Left out, so that the corpus is the
same bytes for a given Python version wherever it is installed, and is code
rather than tables: third-party packages (site-packages, dist-packages), the
test suites and the packages some distributions ship separately (`SPLIT_OFF`),
generated files (the codec tables in `encodings`, `pydoc_data`) and the files
written by the build (`_sysconfigdata_*`, `config-*`). The last `HELD_OUT`
of the corpus is held out for validation. `describe_corpus` gives its hash.

A sample is `CONTEXT` bytes (token ids 0..255) and its target the same
window shifted by one byte, so the loss is the cross-entropy of each next
byte in nats (ln 256 = 5.545 for a uniform guess).
"""

import functools
import hashlib
import os
import platform
import sysconfig

import numpy as np

CONTEXT = 64
VOCAB = 256
CORPUS_BYTES = 4 << 20
HELD_OUT = 0.05
TRAIN_WINDOWS = 1 << 16
VAL_WINDOWS = 256
SPLIT_OFF = ("test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip")
SKIPPED = frozenset(("site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data") + SPLIT_OFF)
BUILD_PREFIXES = ("_sysconfigdata", "config-")


def _kept(name):
    return name not in SKIPPED and not name.startswith(BUILD_PREFIXES)


def stdlib_sources(root=None):
    """The standard library's `.py` files that make the corpus, sorted by their paths relative to `root`."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if _kept(d)]
        found += [os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/")
                  for f in files if f.endswith(".py") and _kept(f)]
    return [os.path.join(root, *path.split("/")) for path in sorted(found)]


@functools.lru_cache(maxsize=1)
def load_corpus(limit=CORPUS_BYTES):
    """The first `limit` bytes of the concatenated sources, as a uint8 array (read once per process)."""
    chunks, size = [], 0
    for path in stdlib_sources():
        with open(path, "rb") as f:
            chunks.append(f.read(limit - size))
        size += len(chunks[-1])
        if size >= limit:
            break
    corpus = np.frombuffer(b"".join(chunks), np.uint8)
    corpus.flags.writeable = False
    return corpus


def split_point(corpus):
    """Where validation starts: bytes before it train, bytes from it on validate."""
    return int(len(corpus) * (1 - HELD_OUT))


def windows(corpus, starts):
    """(inputs, targets) int32 [len(starts), CONTEXT]: the bytes at each start and the next byte of each."""
    spans = corpus[np.asarray(starts)[:, None] + np.arange(CONTEXT + 1)].astype(np.int32)
    return spans[:, :-1], spans[:, 1:]


def train_starts(corpus, count=TRAIN_WINDOWS, seed=0):
    """`count` window starts drawn uniformly (with `seed`) from the training part, whole windows inside it."""
    return np.random.default_rng(seed).integers(0, split_point(corpus) - CONTEXT, count)


def validation_starts(corpus, count=VAL_WINDOWS):
    """`count` evenly spaced window starts in the held-out tail: the same windows every run."""
    return np.linspace(split_point(corpus), len(corpus) - CONTEXT - 1, count).astype(np.int64)


def load_text(seed=0):
    """(x_train, y_train, x_val, y_val) of the text task, as `tf_topk.bench.data.load_data` returns them."""
    corpus = load_corpus()
    return (*windows(corpus, train_starts(corpus, seed=seed)), *windows(corpus, validation_starts(corpus)))


def describe_corpus():
    """What the corpus is, for a benchmark's record: its size and hash, and the Python it came from."""
    corpus = load_corpus()
    return {"source": "the Python standard library's .py files in sorted order (tf_topk.bench.text)",
            "python": platform.python_version(), "bytes": int(len(corpus)),
            "validation_bytes": int(len(corpus) - split_point(corpus)),
            "sha256": hashlib.sha256(corpus.tobytes()).hexdigest()}


def make_transformer(keras, layers=2, width=128, heads=4, context=CONTEXT):
    """A small causal transformer LM over bytes: logits [batch, context, 256] for the next byte.

    Token and learned position embeddings, `layers` pre-norm blocks of causal
    multi-head attention and a GELU MLP (4x width), a final LayerNorm and a
    Dense(256) read-out. Positions come from the input itself so the model is
    one functional graph that MirroredStrategy can replicate.
    """
    tokens = keras.Input((context,), dtype="int32")
    positions = keras.ops.zeros_like(tokens) + keras.ops.arange(context, dtype="int32")
    x = keras.layers.Embedding(VOCAB, width)(tokens) + keras.layers.Embedding(context, width)(positions)
    for _ in range(layers):
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.MultiHeadAttention(heads, width // heads)(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.Dense(width)(keras.layers.Dense(4 * width, activation="gelu")(h))
    logits = keras.layers.Dense(VOCAB)(keras.layers.LayerNormalization()(x))
    return keras.Model(tokens, logits)


def batches(x, y, batch_size, seed):
    """The training windows as an endless tf.data stream of shuffled batches: a step budget, not epochs,
    decides how many are taken, and each `seed` sees them in its own order."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed).repeat().batch(batch_size)
