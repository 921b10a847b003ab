"""tf_topk: top-k gradient sparsification with error feedback for TensorFlow/Keras.

Public names:
  approx_topk      the selection op (CPU and CUDA kernels)
  SparseExchange   error-compensated top-k exchange for any tf.distribute replica context
  ExchangeResult   what an exchange returns
  DensitySchedule  constant or scheduled density (k per variable)
  TopKOptimizer    the Keras optimizer wrapper (tf_topk.keras)
  launch           `python -m tf_topk.launch --workers N script.py`: local multi-worker runs

The names are loaded on first use, so submodules that need no TensorFlow
(`tf_topk.launch`, `tf_topk.bench.netns`) import without it; the first of
these names to be used loads TensorFlow and the selection op library once.
Imported after TensorFlow (`import tensorflow as tf; import tf_topk`), the
package registers the selection op at once; `import tf_topk.ops` registers it
in any order. A SavedModel that uses the op needs it registered before
`tf.saved_model.load`.
"""

import importlib
import sys

__version__ = "0.1.0"

_LAZY = {
    "approx_topk": "tf_topk.ops",
    "DensitySchedule": "tf_topk.schedule",
    "ExchangeResult": "tf_topk.exchange",
    "SparseExchange": "tf_topk.exchange",
    "TopKOptimizer": "tf_topk.keras",
}

# Subpackages and modules reachable as attributes after `import tf_topk`
# (`tf_topk.keras.CompressionStats`), also loaded on first use.
_SUBMODULES = ("bench", "communicator", "exchange", "keras", "launch", "memory", "ops", "schedule", "selector")

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"tf_topk.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tf_topk' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


if "tensorflow" in sys.modules:
    importlib.import_module("tf_topk.ops")
