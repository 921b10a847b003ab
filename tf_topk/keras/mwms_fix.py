"""A narrowly scoped fix so Keras 3 `fit`/`evaluate` run under MultiWorkerMirroredStrategy.

The bug: https://github.com/keras-team/keras/issues/20585 (open since TF 2.16,
the first TensorFlow with Keras 3). With the TensorFlow backend, `model.fit`
and `model.evaluate` under `tf.distribute.MultiWorkerMirroredStrategy` (MWMS)
with two or more workers fail in two places of
`keras/src/backend/tensorflow/trainer.py`:

1. `TensorFlowTrainer._maybe_symbolic_build` takes the first distributed
   batch, only to build the model symbolically (shapes and dtypes), and
   averages it across all replicas with
   `strategy.reduce("MEAN", batch, axis=None)`. In multi-worker mode that
   reduce does not accept the nested (x, y) structure (`Strategy.reduce` has
   a TODO for nests) and raises `ValueError: Attempt to convert a value
   (PerReplica:{...}) with an unsupported type (...PerReplica...) to a
   Tensor.` A cross-worker mean of the data (integer labels included) is of
   no use for building anyway. Fix: build from this worker's first local
   replica's batch, which has the same structure, shapes and dtypes.
2. `reduce_per_replica(outputs, strategy, "auto"/"mean")`, which turns each
   train/test step's per-replica logs (loss and metric results: scalars)
   into one value, calls `strategy.reduce("MEAN", v, axis=0)` in
   multi-worker mode; `axis=0` is out of range for a scalar and tracing the
   step raises `ValueError: Invalid reduction dimension 0 for input with 0
   dimensions.` Fix: reduce scalars with `axis=None` (the mean over
   replicas), which is what the single-worker branch of the same function
   computes with `tf.reduce_mean(local_results, axis=0)`.

Both patches wrap the Keras functions and change nothing unless the strategy
is an MWMS in multi-worker mode (`strategy.extended._in_multi_worker_mode()`,
the test Keras itself uses); every other strategy, and MWMS with one worker,
takes the original code. Non-scalar outputs of `reduce_per_replica` are left
to the original code too, and `predict` (reduction "concat") already works
under MWMS. Each wrapper keeps the Keras original as `__tf_topk_original__`.

`apply_mwms_fix()` is idempotent, and patches only Keras 3.0 to 3.15.x with the
TensorFlow backend (the versions known broken; 3.15.1 was checked). On any
other version it patches nothing and logs why: if a newer Keras still fails,
check the issue and widen `_KNOWN_BROKEN` after verifying the patch there.

Usage (before `model.fit`, in every worker)::

    from tf_topk.keras import apply_mwms_fix
    apply_mwms_fix()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
"""

from __future__ import annotations

import functools
import logging
import re
import threading

ISSUE_URL = "https://github.com/keras-team/keras/issues/20585"

# (major, minor) ranges, inclusive, of the Keras versions known to have the bug.
_KNOWN_BROKEN = ((3, 0), (3, 15))

_logger = logging.getLogger(__name__)
_lock = threading.Lock()
_applied = False
_skip_reason = None  # why apply_mwms_fix() patched nothing, once decided

__all__ = ["apply_mwms_fix", "is_mwms_fix_applied", "ISSUE_URL"]


def _parse_version(version: str):
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _is_known_broken(version: str) -> bool:
    """True for Keras 3.0 to 3.15.x, released or dev/rc builds of them."""
    v = _parse_version(version)
    return v is not None and _KNOWN_BROKEN[0] <= v <= _KNOWN_BROKEN[1]


def _is_multi_worker_mwms(strategy) -> bool:
    """MWMS spanning more than one worker: the only case the patches act on."""
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        strategy.extended._in_multi_worker_mode()
    )


def _first_local(value, strategy):
    """This worker's first replica's component of `value` (unchanged if not distributed)."""
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def _is_scalar(value, strategy) -> bool:
    import tensorflow as tf

    local = _first_local(value, strategy)
    return isinstance(local, (tf.Tensor, tf.Variable)) and local.shape.rank == 0


def _patch_maybe_symbolic_build(trainer_module):
    original = trainer_module.TensorFlowTrainer._maybe_symbolic_build
    tree = trainer_module.tree

    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is not None and strategy is not None and _is_multi_worker_mwms(strategy):
            # Same as upstream (first batch only), minus the cross-worker reduce.
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tree.map_structure(lambda v: _first_local(v, strategy), batch)
                break
            iterator = None
        return original(self, iterator=iterator, data_batch=data_batch)

    _maybe_symbolic_build.__tf_topk_original__ = original
    trainer_module.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


def _patch_reduce_per_replica(trainer_module):
    original = trainer_module.reduce_per_replica
    tree = trainer_module.tree

    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        # "auto" means "mean" for every strategy but TPUStrategy (see upstream).
        if reduction in ("auto", "mean") and _is_multi_worker_mwms(strategy):

            def _reduce(v):
                if _is_scalar(v, strategy):
                    return strategy.reduce("MEAN", v, axis=None)
                return original(v, strategy, reduction)

            return tree.map_structure(_reduce, values)
        return original(values, strategy, reduction)

    reduce_per_replica.__tf_topk_original__ = original
    # `_make_function` and `make_predict_function` look the name up in the
    # module at trace time, so rebinding the module attribute is enough.
    trainer_module.reduce_per_replica = reduce_per_replica


def apply_mwms_fix() -> bool:
    """Patch Keras for keras#20585 if this Keras needs it; idempotent.

    Returns True if the fix is in place (now or from an earlier call), False
    if nothing was patched (Keras version not known broken, or another
    backend); the reason is logged once.
    """
    global _applied, _skip_reason
    with _lock:
        if _applied:
            return True
        if _skip_reason is not None:
            return False

        import keras

        version = keras.__version__
        backend = keras.backend.backend()
        if backend != "tensorflow":
            _skip_reason = f"Keras backend is {backend!r}, not 'tensorflow'"
        elif not _is_known_broken(version):
            _skip_reason = (
                f"Keras {version} is not among the versions known to have {ISSUE_URL} "
                f"(3.0 to 3.15.x); check whether it is fixed upstream"
            )
        if _skip_reason is not None:
            _logger.warning("tf_topk: MWMS fix not applied: %s.", _skip_reason)
            return False

        from keras.src.backend.tensorflow import trainer as trainer_module

        missing = [
            name
            for name, obj in (
                ("TensorFlowTrainer._maybe_symbolic_build", trainer_module.TensorFlowTrainer),
                ("reduce_per_replica", trainer_module),
            )
            if not hasattr(obj, name.split(".")[-1])
        ]
        if missing:
            _skip_reason = f"Keras {version} lacks {', '.join(missing)}; the patch does not fit it"
            _logger.warning("tf_topk: MWMS fix not applied: %s.", _skip_reason)
            return False

        _patch_maybe_symbolic_build(trainer_module)
        _patch_reduce_per_replica(trainer_module)
        _applied = True
        _logger.info("tf_topk: applied the MWMS fix for %s to Keras %s.", ISSUE_URL, version)
        return True


def is_mwms_fix_applied() -> bool:
    """True once `apply_mwms_fix()` has patched Keras in this process."""
    return _applied
