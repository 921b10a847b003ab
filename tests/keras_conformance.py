"""A pytest plugin that runs Keras's own optimizer tests against TopKOptimizer. Not a test module.

`python -m pytest -p keras_conformance <keras's *_test.py files>` with this folder on sys.path and
TF_TOPK_CONFORMANCE set to the JSON of TopKOptimizer's options (e.g. {"density": 1.0}): before the
tests run, every Keras optimizer class a test module names (`Adam`, or `optimizers.SGD`) is replaced
by a stand-in that builds `TopKOptimizer(<that optimizer>, **options)`, so each test's assertions
run unchanged against the wrapper. LossScaleOptimizer and MultiOptimizer stay themselves (they go
outside; the optimizers inside them are wrapped).
"""

import json
import os
import types

import keras

OPTIONS = json.loads(os.environ.get("TF_TOPK_CONFORMANCE", "{}"))
_WRAPPED = {}


def _wrapping(cls):
    """A stand-in for optimizer class `cls`: calling it makes TopKOptimizer(cls(...), **OPTIONS)."""
    if cls not in _WRAPPED:
        import tf_topk

        def make(*args, **kwargs):
            return tf_topk.TopKOptimizer(cls(*args, **kwargs), **OPTIONS)

        _WRAPPED[cls] = type(cls.__name__, (), {"__new__": staticmethod(lambda _, *a, **k: make(*a, **k)),
                                                "wrapped": cls})
    return _WRAPPED[cls]


def _wraps(obj):
    import tf_topk

    return (isinstance(obj, type) and issubclass(obj, keras.optimizers.Optimizer)
            and not issubclass(obj, (keras.mixed_precision.LossScaleOptimizer, keras.optimizers.MultiOptimizer,
                                     tf_topk.TopKOptimizer))
            and obj is not keras.optimizers.Optimizer)


def _patch(module):
    for name, obj in list(vars(module).items()):
        if _wraps(obj):
            setattr(module, name, _wrapping(obj))
        elif isinstance(obj, types.ModuleType) and obj.__name__ in ("keras.src.optimizers", "keras.optimizers"):
            proxy = types.SimpleNamespace(**{n: _wrapping(o) if _wraps(o) else o for n, o in vars(obj).items()})
            setattr(module, name, proxy)


def pytest_collection_finish(session):
    patched = set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and module not in patched:
            _patch(module)
            patched.add(module)
