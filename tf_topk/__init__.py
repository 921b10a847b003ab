"""tf_topk: top-k gradient sparsification with error feedback for TensorFlow/Keras.

Public names:
  approx_topk      the selection op (CPU and CUDA kernels)
  error_feedback_topk  gradient + residual, selection and what remains, in one op
  SparseExchange   error-compensated top-k exchange for any tf.distribute replica context
  ExchangeResult   what an exchange returns
  DensitySchedule  constant or scheduled density (k per variable)
  TopKOptimizer    the Keras optimizer wrapper (tf_topk.keras); for tf_keras (Keras 2): tf_topk.tf_keras
  configure_coordination  MWMS's heartbeat timeout, set before the strategy is built (tf_topk.distribute)
  launch           `python -m tf_topk.launch --workers N script.py`: local multi-worker runs

The names are loaded on first use, so submodules that need no TensorFlow
(`tf_topk.launch`, `tf_topk.bench.netns`, `tf_topk.distribute`) import without it; the first of
the other names to be used loads TensorFlow and the selection op library once
(`configure_coordination` imports TensorFlow only when it is called).
Imported after TensorFlow (`import tensorflow as tf; import tf_topk`), the
package registers the selection op at once; `import tf_topk.ops` registers it
in any order. A SavedModel that uses the op needs it registered before
`tf.saved_model.load`.
"""

import importlib
import importlib.util
import sys

__version__ = "0.1.0"

_LAZY = {
    "approx_topk": "tf_topk.ops",
    "error_feedback_topk": "tf_topk.ops",
    "DensitySchedule": "tf_topk.schedule",
    "ExchangeResult": "tf_topk.exchange",
    "SparseExchange": "tf_topk.exchange",
    "TopKOptimizer": "tf_topk.keras",
    "configure_coordination": "tf_topk.distribute",
}

# Subpackages and modules reachable as attributes after `import tf_topk`
# (`tf_topk.keras.CompressionStats`), also loaded on first use.
_SUBMODULES = ("adapter", "bench", "communicator", "distribute", "exchange", "keras", "launch", "memory", "ops",
               "schedule", "selector", "tf_keras")

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


class _RegisterWithTfKeras:
    """Registers tf_topk.tf_keras.TopKOptimizer with tf_keras as soon as
    tf_keras is imported (by `import tf_keras`, or by `tf.keras` under
    TF_USE_LEGACY_KERAS=1), so that a SavedModel compiled with it loads after
    `import tf_topk` in any order, while `import tf_topk` imports no Keras.
    A meta path finder that acts once, for the name "tf_keras" only."""

    def find_spec(self, name, path=None, target=None):
        if name != "tf_keras" or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # find the real spec without this finder, then take it back
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register_with_tf_keras()

        spec.loader.exec_module = exec_then_register
        return spec


def _register_with_tf_keras():
    try:
        importlib.import_module("tf_topk.tf_keras")
    except Exception as error:  # never break an import of tf_keras or of tf_topk
        import warnings

        warnings.warn(f"tf_topk: could not register TopKOptimizer with tf_keras: {error}")


if sys.modules.get("tf_keras") is not None:
    _register_with_tf_keras()
elif not any(isinstance(finder, _RegisterWithTfKeras) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithTfKeras())

if "tensorflow" in sys.modules:
    importlib.import_module("tf_topk.ops")
