"""tf_topk: top-k gradient sparsification with error feedback for TensorFlow/Keras.

Public names:
  approx_topk      the selection op (CPU and CUDA kernels)
  error_feedback_topk  gradient + residual, selection and what remains, in one op
  SparseExchange   error-compensated top-k exchange for any tf.distribute replica context
  ExchangeConfig   every option of the exchange, checked once (also taken by TopKOptimizer)
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

Loading a model saved with TopKOptimizer (`keras.models.load_model`,
`tf.keras.models.load_model`, `tf_keras.models.load_model`) needs the class
registered with that Keras, which importing its module does. `import tf_topk`
does that at once for a Keras already imported, and otherwise when that Keras
is imported (an import hook, `_RegisterOnImport`), so a saved model loads after
`import tf_topk` in any import order while `import tf_topk` itself imports
neither Keras nor TensorFlow.
"""

import importlib
import importlib.util
import sys

__version__ = "0.1.0"

_LAZY = {
    "approx_topk": "tf_topk.ops",
    "error_feedback_topk": "tf_topk.ops",
    "DensitySchedule": "tf_topk.schedule",
    "ExchangeConfig": "tf_topk.config",
    "ExchangeResult": "tf_topk.exchange",
    "SparseExchange": "tf_topk.exchange",
    "TopKOptimizer": "tf_topk.keras",
    "configure_coordination": "tf_topk.distribute",
}

# Subpackages and modules reachable as attributes after `import tf_topk`
# (`tf_topk.keras.CompressionStats`), also loaded on first use.
_SUBMODULES = ("adapter", "autopilot", "bench", "calibrate", "config", "cost", "distribute", "exchange", "keras",
               "launch", "memory", "ops", "routes", "schedule", "selector", "sparse_gradient", "tf_keras")

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


# Each Keras package -> the tf_topk module whose import registers TopKOptimizer with it
# (`register_keras_serializable(package="tf_topk")`), which loading a saved model needs.
_REGISTERING_MODULES = {"keras": "tf_topk.keras", "tf_keras": "tf_topk.tf_keras"}


class _RegisterOnImport:
    """Registers TopKOptimizer with a Keras package as soon as that package is
    imported (`import keras`, `import tf_keras`, or TensorFlow importing one of
    them for `tf.keras`), so that a saved model compiled with it loads after
    `import tf_topk` in any order, while `import tf_topk` imports no Keras.
    A meta path finder for the names in `_REGISTERING_MODULES` and for
    tf_topk's own modules: a Keras imported while a tf_topk module is still
    being imported (`from tf_topk.routes import ...` importing TensorFlow,
    which imports Keras) is registered once that module is done, since the
    registering module needs it whole. It leaves sys.meta_path when no Keras
    is left to register."""

    def __init__(self, names):
        self.pending = set(names)
        self.deferred = []

    def find_spec(self, name, path=None, target=None):
        own = name.startswith("tf_topk.")
        if (name not in self.pending and not own) or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # find the real spec without this finder, then take it back
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module  # this spec's own loader: patching it touches no other import

        def exec_then_register(module):
            exec_module(module)
            if not own:
                self.pending.discard(name)
                self.deferred.append(name)
            if _tf_topk_importing(besides=name):
                return
            while self.deferred:
                _register_with(self.deferred.pop(0))
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_then_register
        return spec


def _tf_topk_importing(besides):
    """Whether a tf_topk module other than `besides` is still being imported."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items())
               if name != besides and (name == "tf_topk" or name.startswith("tf_topk.")))


def _register_with(keras_name):
    """Import the module that registers TopKOptimizer with `keras_name`; warn on failure."""
    try:
        keras_module = sys.modules[keras_name]
        if keras_name == "keras" and keras_module.config.backend() != "tensorflow":
            return  # TopKOptimizer needs TensorFlow: nothing to load, and no TensorFlow to import for it
        importlib.import_module(_REGISTERING_MODULES[keras_name])
    except Exception as error:  # never break an import of Keras or of tf_topk
        import warnings

        warnings.warn(f"tf_topk: could not register TopKOptimizer with {keras_name}: {error}")


_unregistered = []
for _name in _REGISTERING_MODULES:
    if sys.modules.get(_name) is not None:
        _register_with(_name)
    else:
        _unregistered.append(_name)
if _unregistered and not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnImport(_unregistered))
del _name, _unregistered

if "tensorflow" in sys.modules:
    importlib.import_module("tf_topk.ops")
