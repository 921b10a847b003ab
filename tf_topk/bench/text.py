"""The convergence benchmark's language-model tasks: next-byte prediction on three corpora of other kinds.

`text` (the development task, on which methods are chosen) is Python source:
the standard library's own `.py` files, which ship with every Python, so the
task works offline and needs no download: the files under
`sysconfig.get_paths()["stdlib"]` in sorted order of their relative paths,
concatenated and cut at `CORPUS_BYTES`. Left out, so that the corpus is the
same bytes for a given Python version wherever it is installed, and is code
rather than tables: third-party packages (site-packages, dist-packages), the
test suites and the packages some distributions ship separately (`SPLIT_OFF`),
generated files (the codec tables in `encodings`, `pydoc_data`) and the files
written by the build (`_sysconfigdata_*`, `config-*`).

`prose` (a task kept to confirm what was chosen on `text`, never to tune on)
is English prose: the docstrings of the installed numpy, scikit-learn and
Keras (`PROSE_PACKAGES`, the project's own requirements), read from their
sources with `ast` (nothing is imported), package by package and file by file
in sorted order, without their test suites, examples run as doctests
(`>>>` lines and the output under them) or fenced code blocks.

`reference` (a second task to confirm on) is small, so a run sees it for
several passes: the Python Language Reference's topics as `help()` shows
them (the `pydoc_data.topics` module of the standard library, about 466 KB
of English with grammar rules and short examples), topic after topic in
sorted order of their names, whole (`CORPUS_LIMITS`). 2,000 steps of 32
windows read about nine times its bytes.

Of each corpus the last `HELD_OUT` is held out for validation;
`describe_corpus` gives its hash and where it came from. A sample is
`CONTEXT` bytes (token ids 0..255) and its target the same window shifted by
one byte, so the loss is the cross-entropy of each next byte in nats (ln 256 =
5.545 for a uniform guess).
"""

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
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
# The corpora, by the name `--dataset` gives them: `text` to develop on, `prose` and `reference` to confirm on.
LANGUAGE_DATASETS = ("text", "prose", "reference")
# The bytes each corpus gives a task: its first CORPUS_BYTES, or all of it (None) for the small one.
CORPUS_LIMITS = {"text": CORPUS_BYTES, "prose": CORPUS_BYTES, "reference": None}
# (import name, distribution name) of the packages whose docstrings make `prose`.
PROSE_PACKAGES = (("numpy", "numpy"), ("sklearn", "scikit-learn"), ("keras", "keras"))
PROSE_SKIPPED = frozenset(("tests", "test", "testing", "__pycache__", "_vendor", "externals", "_build_utils"))


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


def package_sources(package):
    """An installed package's `.py` files but its tests and vendored code, sorted by their relative paths."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        raise RuntimeError(f"the prose corpus reads the docstrings of {package}, which is not installed")
    root = os.path.dirname(spec.origin)
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in PROSE_SKIPPED]
        found += [os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/")
                  for f in files if f.endswith(".py") and not f.startswith("test_")]
    return [os.path.join(root, *path.split("/")) for path in sorted(found)]


def docstring_prose(source):
    """The docstrings of one module's source (module, classes, functions, in the order `ast.walk` meets
    them), each without doctest examples and fenced code, one blank line between them."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    kept = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        if not docstring:
            continue
        lines, in_example, in_fence = [], False, False
        for line in docstring.splitlines():
            stripped = line.strip()
            if stripped.startswith("```"):
                in_fence = not in_fence
                continue
            if stripped.startswith(">>>"):
                in_example = True
            elif not stripped:
                in_example = False
            if not (in_example or in_fence or (not stripped and lines and not lines[-1])):
                lines.append(line.rstrip())  # one blank line where an example stood between two
        text = "\n".join(lines).strip()
        if text:
            kept.append(text)
    return "\n\n".join(kept)


def _corpus_files(corpus):
    """The corpus's pieces in order: (the package it is from, its path, a function reading its bytes)."""
    if corpus == "text":
        return [("the standard library", path, _read_bytes) for path in stdlib_sources()]
    if corpus == "prose":
        return [(package, path, _read_prose) for package, _ in PROSE_PACKAGES for path in package_sources(package)]
    if corpus == "reference":
        return [("pydoc_data", REFERENCE_MODULE, _read_reference)]
    raise ValueError(f"corpus must be one of {LANGUAGE_DATASETS}, got {corpus!r}")


def _read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def _read_prose(path):
    prose = docstring_prose(_read_bytes(path)).encode("utf-8")
    return prose + b"\n\n" if prose else b""


REFERENCE_MODULE = "pydoc_data.topics"


def _read_reference(module):
    """The topics of `module` (pydoc's dict of topic name to text) in sorted order of their names."""
    topics = importlib.import_module(module).topics
    return "".join(topics[name] for name in sorted(topics)).encode("utf-8")


def load_corpus(corpus="text", limit="task"):
    """The first `limit` bytes of `corpus` ("text": the standard library's sources; "prose": the docstrings
    of `PROSE_PACKAGES`; "reference": pydoc's topics), as a read-only uint8 array, read once per process.
    limit "task": the task's (`CORPUS_LIMITS`); None: the whole corpus."""
    if corpus not in LANGUAGE_DATASETS:
        raise ValueError(f"corpus must be one of {LANGUAGE_DATASETS}, got {corpus!r}")
    return _read_corpus(corpus, CORPUS_LIMITS[corpus] if limit == "task" else limit)[0]


@functools.lru_cache(maxsize=3)
def _read_corpus(corpus, limit):
    """(the corpus's bytes, the packages they came from); limit None: all of them."""
    chunks, packages, size = [], {}, 0
    for package, path, read in _corpus_files(corpus):
        chunks.append(read(path) if limit is None else read(path)[:limit - size])
        packages[package] = True
        size += len(chunks[-1])
        if limit is not None and size >= limit:
            break
    if limit is not None and size < limit:
        raise RuntimeError(f"the {corpus} corpus has {size:,} bytes, fewer than the task's {limit:,}")
    data = np.frombuffer(b"".join(chunks), np.uint8)
    data.flags.writeable = False
    return data, tuple(packages)


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


def load_text(seed=0, corpus="text"):
    """(x_train, y_train, x_val, y_val) of a language task (`LANGUAGE_DATASETS`), as
    `tf_topk.bench.data.load_data` returns them."""
    corpus = load_corpus(corpus)
    return (*windows(corpus, train_starts(corpus, seed=seed)), *windows(corpus, validation_starts(corpus)))


def describe_corpus(corpus="text"):
    """What the corpus is, for a benchmark's record: its size and hash, and what it came from."""
    data = load_corpus(corpus)
    if corpus == "text":
        origin = {"source": "the Python standard library's .py files in sorted order (tf_topk.bench.text)",
                  "python": platform.python_version()}
    elif corpus == "reference":
        origin = {"source": f"the Python Language Reference's topics ({REFERENCE_MODULE}) in sorted order of their "
                            "names (tf_topk.bench.text)",
                  "python": platform.python_version()}
    else:
        read = _read_corpus(corpus, CORPUS_LIMITS[corpus])[1]
        used = [(name, dist) for name, dist in PROSE_PACKAGES if name in read]
        origin = {"source": "the docstrings of " + ", ".join(name for name, _ in used)
                            + " without doctests or code blocks (tf_topk.bench.text)",
                  "packages": {dist: importlib.metadata.version(dist) for _, dist in used}}
    return {**origin, "bytes": int(len(data)), "validation_bytes": int(len(data) - split_point(data)),
            "sha256": hashlib.sha256(data.tobytes()).hexdigest()}


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
