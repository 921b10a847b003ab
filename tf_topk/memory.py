"""Memories: what a replica keeps between steps (error feedback, or nothing).

A memory is one of the exchange's three parts (selector, memory,
communicator). Per sparsified variable (a slot), it turns the gradient into
the tensor the selector sees (`compensate`) and, once k entries are
selected, keeps what was not sent (`update`). State is made through a
factory the exchange passes to `build`, so the Keras wrapper can make
tracked Keras variables while custom loops get plain `tf.Variable`s.

Error feedback: what a replica did not send stays in its residual and is
added to its next gradient, so nothing is lost, only delayed. Residuals
differ per replica, so they are per-replica state:
`tf.VariableSynchronization.ON_READ` variables with SUM aggregation. A
checkpoint saves the sum over replicas; restoring gives each replica
sum / num_replicas. So the total gradient mass held back is kept exactly
across save and restore, but not how it was split among replicas.

A new memory is a class with `keeps_unsent`, `build(variables, make_state)`,
`state_variables`, `compensate(slot, grad)` and `update(slot, accumulated,
values, indices, keep)`, passed as `SparseExchange(..., memory=MyMemory())`.
"""

import tensorflow as tf


def residual_dtype(variable_dtype):
    """Residuals accumulate many small entries: at least float32."""
    dtype = tf.as_dtype(variable_dtype)
    return dtype if dtype in (tf.float32, tf.float64) else tf.float32


def state_name(variable, suffix):
    """`<variable name>_<suffix>`, with the name's slashes made underscores."""
    base = getattr(variable, "path", None) or getattr(variable, "name", "variable").split(":")[0]
    return f"{base.replace('/', '_')}_{suffix}"


def make_state_variable(variable, dtype, suffix):
    """The default state factory: a zero, per-replica tf.Variable shaped like
    `variable` (call in the strategy's scope)."""
    return tf.Variable(
        tf.zeros(variable.shape, dtype),
        trainable=False,
        name=state_name(variable, suffix),
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )


def _scatter_selected(accumulated, values, indices, dtype):
    """The selected entries as a dense flat tensor (spare slots add 0)."""
    return tf.scatter_nd(tf.expand_dims(indices, 1), tf.cast(values, dtype),
                         tf.shape(accumulated, out_type=tf.int32))


class ErrorFeedbackMemory:
    """A residual per slot; compensate before, update after selection.

    Args:
      residuals: optional ready-made residual variables, one per slot; else
        `build` makes them with the exchange's state factory.
    """

    keeps_unsent = True

    def __init__(self, residuals=None):
        self.residuals = None if residuals is None else list(residuals)

    def build(self, variables, make_state):
        if self.residuals is None:
            self.residuals = [make_state(v, residual_dtype(v.dtype), "residual") for v in variables]
        elif len(self.residuals) != len(variables):
            raise ValueError(f"residuals must hold one variable per sparsified variable ({len(variables)}), "
                             f"got {len(self.residuals)}")

    @property
    def state_variables(self):
        return list(self.residuals or [])

    def compensate(self, slot, grad):
        """grad + residual, flat, in the residual's dtype."""
        residual = self.residuals[slot]
        return tf.reshape(tf.cast(grad, residual.dtype), [-1]) + tf.reshape(residual, [-1])

    def update(self, slot, accumulated, values, indices, keep):
        """residual = accumulated - selected (scattered back), where `keep`.

        Returns what remains. Spare slots (value 0 at index 0) subtract
        nothing. Where `keep` is false (a step with non-finite gradients) the
        residual is unchanged.
        """
        residual = self.residuals[slot]
        new = accumulated - _scatter_selected(accumulated, values, indices, residual.dtype)
        new = tf.where(keep, new, tf.reshape(residual, [-1]))
        residual.assign(tf.reshape(new, residual.shape))
        return new


class NoMemory:
    """Nothing kept: unsent entries are dropped. Only for comparisons."""

    keeps_unsent = False

    def build(self, variables, make_state):
        pass

    @property
    def state_variables(self):
        return []

    def compensate(self, slot, grad):
        return tf.reshape(tf.cast(grad, tf.float32), [-1])

    def update(self, slot, accumulated, values, indices, keep):
        return accumulated - _scatter_selected(accumulated, values, indices, accumulated.dtype)
