"""A pytest plugin that runs Keras's own optimizer tests against TopKOptimizer. Not a test module.

`python -m pytest -p keras_conformance <keras's *_test.py files>` with this folder on sys.path and
TF_TOPK_CONFORMANCE set to the JSON of TopKOptimizer's options (e.g. {"density": 1.0}): every Keras
optimizer class a test builds is replaced by a stand-in that builds `TopKOptimizer(<that optimizer>,
**options)`, however the test reaches the class:

- names a test module holds (`Adam`, `optimizers.SGD`), replaced after collection;
- classes captured while a test module is imported (`TEST_CASES = [{"optimizer_class":
  optimizers.Adam}]`, parametrizations): Keras's optimizer namespaces hold the stand-ins while each
  test module is imported, and their own classes again afterwards; a class the module defines
  itself is replaced in each parametrized case's parameters after collection;
- `optimizers.get(...)`, which returns the wrapper around what Keras's `get` returns.

A stand-in passes `isinstance` for the wrapper around its class. LossScaleOptimizer and
MultiOptimizer stay themselves (they go outside; the optimizers inside them are wrapped).

With TF_TOPK_CONFORMANCE_BUILT set to a path, the plugin writes there, per test case, how many
TopKOptimizers it built: a case that builds none ran against Keras alone, so it cannot count as one
that the wrapper passed.
"""

import contextlib
import json
import os
import types

import keras
import pytest

import tf_topk

OPTIONS = json.loads(os.environ.get("TF_TOPK_CONFORMANCE", "{}"))
_WRAPPED = {}
_BUILT = {"count": 0}
_PER_CASE = {}
# Keras's optimizer namespaces whose classes the stand-ins replace while a test module is imported.
_NAMESPACES = (keras.optimizers, keras.src.optimizers)


class _StandInType(type):
    """isinstance(x, stand-in for C): x is a C, or a TopKOptimizer around one."""

    def __instancecheck__(cls, instance):
        if isinstance(instance, tf_topk.TopKOptimizer):
            instance = instance.inner_optimizer
        return isinstance(instance, cls.wrapped)


def _wrapping(cls):
    """A stand-in for optimizer class `cls`: calling it makes TopKOptimizer(cls(...), **OPTIONS)."""
    if cls not in _WRAPPED:
        def make(*args, **kwargs):
            return tf_topk.TopKOptimizer(cls(*args, **kwargs), **OPTIONS)

        _WRAPPED[cls] = _StandInType(cls.__name__, (), {"__new__": staticmethod(lambda _, *a, **k: make(*a, **k)),
                                                        "wrapped": cls})
    return _WRAPPED[cls]


def _wrapping_get(get):
    """Keras's `optimizers.get`, with what it returns wrapped (a plain optimizer; None and errors as Keras)."""
    if getattr(get, "wrapped", None) is not None:
        return get

    def wrapped_get(identifier, *args, **kwargs):
        optimizer = get(identifier, *args, **kwargs)
        return tf_topk.TopKOptimizer(optimizer, **OPTIONS) if _wraps(type(optimizer)) else optimizer

    wrapped_get.wrapped = get
    return wrapped_get


def _wraps(obj):
    return (isinstance(obj, type) and not isinstance(obj, _StandInType)
            and issubclass(obj, keras.optimizers.Optimizer)
            and not issubclass(obj, (keras.mixed_precision.LossScaleOptimizer, keras.optimizers.MultiOptimizer,
                                     tf_topk.TopKOptimizer))
            and obj is not keras.optimizers.Optimizer)


def _stand_in(name, obj):
    if _wraps(obj):
        return _wrapping(obj)
    if name == "get" and callable(obj):
        return _wrapping_get(obj)
    return obj


def _patch(module):
    for name, obj in list(vars(module).items()):
        if _wraps(obj):
            setattr(module, name, _wrapping(obj))
        elif isinstance(obj, types.ModuleType) and obj.__name__ in ("keras.src.optimizers", "keras.optimizers"):
            proxy = types.SimpleNamespace(**{n: _stand_in(n, o) for n, o in vars(obj).items()})
            setattr(module, name, proxy)


@contextlib.contextmanager
def _stand_ins_in_keras():
    """Keras's optimizer namespaces hold the stand-ins (and the wrapping `get`) within the block."""
    saved = []
    for namespace in _NAMESPACES:
        for name, obj in list(vars(namespace).items()):
            replacement = _stand_in(name, obj)
            if replacement is not obj:
                saved.append((namespace, name, obj))
                setattr(namespace, name, replacement)
    try:
        yield
    finally:
        for namespace, name, obj in reversed(saved):
            setattr(namespace, name, obj)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test module is imported while it is collected: with the stand-ins in Keras's namespaces, so
    that what it captures at import (TEST_CASES, parametrizations) is wrapped too."""
    if isinstance(collector, pytest.Module):
        with _stand_ins_in_keras():
            yield
    else:
        yield


def _patch_parameters(item):
    """absl's parametrized case holds its own copy of its parameters (a dict in the closure of the
    method it generates): a class the test module defines itself is replaced there."""
    function = getattr(getattr(item, "obj", None), "__func__", None)
    for cell in getattr(function, "__closure__", None) or ():
        parameters = cell.cell_contents
        if isinstance(parameters, dict):
            parameters.update({key: _wrapping(value) for key, value in parameters.items() if _wraps(value)})


def pytest_collection_finish(session):
    patched = set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and module not in patched:
            _patch(module)
            patched.add(module)
        _patch_parameters(item)


def _counting_init(init):
    def counted(self, *args, **kwargs):
        _BUILT["count"] += 1
        return init(self, *args, **kwargs)

    return counted


tf_topk.TopKOptimizer.__init__ = _counting_init(tf_topk.TopKOptimizer.__init__)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = _BUILT["count"]
    try:
        yield
    finally:
        _PER_CASE[item.nodeid] = _BUILT["count"] - before


def pytest_sessionfinish(session):
    path = os.environ.get("TF_TOPK_CONFORMANCE_BUILT")
    if path:
        with open(path, "w") as f:
            json.dump(_PER_CASE, f, indent=0, sort_keys=True)
