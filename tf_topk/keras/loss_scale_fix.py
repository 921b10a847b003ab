"""LossScaleOptimizer around TopKOptimizer: decide "finite" across replicas, not per replica.

Keras 3's `LossScaleOptimizer.apply` runs the inner optimizer's `apply` only
when `check_finite(grads)` holds, and `check_finite` looks at this replica's
local gradients (its comment assumes they were all-reduced already, which
was true in Keras 2; in Keras 3 the all-reduce happens inside the inner
`apply`). When one worker's float16 gradients overflow and another's do not,
the first skips the step while the second enters TopKOptimizer's exchange
and waits in its collectives forever. Common at the start of mixed-precision
training, when the loss scale is still too large.

The fix wraps `LossScaleOptimizer.check_finite`: for a LossScaleOptimizer
whose inner optimizer is a TopKOptimizer, with more than one replica, the
local verdict is summed over replicas with one scalar all-reduce, so every
replica skips the step together and halves its loss scale together. Every
other LossScaleOptimizer takes the original code. Applied by TopKOptimizer's
constructor; idempotent.

Guarded: on a Keras other than 3.x, or one whose LossScaleOptimizer has no
`check_finite`, it patches nothing and logs why once (multi-worker mixed
precision then keeps Keras's per-replica check).
"""

import functools
import logging
import threading

import keras
import tensorflow as tf

from tf_topk.adapter import TopKWrapper

_lock = threading.Lock()
_logger = logging.getLogger(__name__)
_skip_reason = None


def _wraps_topk(loss_scale_optimizer):
    return isinstance(getattr(loss_scale_optimizer, "inner_optimizer", None), TopKWrapper)


def _globally_finite(original):
    @functools.wraps(original)
    def check_finite(self, grads):
        finite = original(self, grads)
        context = tf.distribute.get_replica_context()
        if not _wraps_topk(self) or context is None or context.num_replicas_in_sync == 1:
            return finite
        non_finite_replicas = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                                 tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(non_finite_replicas, 0.0)

    check_finite.__tf_topk_original__ = original
    return check_finite


def _unfit_reason():
    """Why the patch does not fit this Keras, or None."""
    if not keras.__version__.startswith("3."):
        return f"Keras {keras.__version__} is not Keras 3"
    if not hasattr(keras.optimizers, "LossScaleOptimizer"):
        return f"Keras {keras.__version__} has no keras.optimizers.LossScaleOptimizer"
    if not callable(getattr(keras.optimizers.LossScaleOptimizer, "check_finite", None)):
        return f"Keras {keras.__version__}'s LossScaleOptimizer has no check_finite"
    return None


def apply_loss_scale_fix():
    """Make LossScaleOptimizer's finite check global when it wraps a TopKOptimizer.

    Returns True when the fix is in place, False when this Keras does not
    fit it (the reason is logged once).
    """
    global _skip_reason
    with _lock:
        reason = _unfit_reason()
        if reason is not None:
            if reason != _skip_reason:
                _logger.warning("tf_topk: LossScaleOptimizer fix not applied: %s; with several workers, a "
                                "step where only some overflow can hang.", reason)
                _skip_reason = reason
            return False
        current = keras.optimizers.LossScaleOptimizer.check_finite
        if not hasattr(current, "__tf_topk_original__"):
            keras.optimizers.LossScaleOptimizer.check_finite = _globally_finite(current)
        return True
