"""Error-feedback memory: the residual each replica keeps per variable.

What a replica did not send stays in its residual and is added to its next
gradient, so nothing is lost, only delayed. Residuals differ per replica, so
they are per-replica state: `tf.VariableSynchronization.ON_READ` variables with
SUM aggregation. A checkpoint saves the sum over replicas; restoring gives each
replica sum / num_replicas. So the total gradient mass held back is kept
exactly across save and restore, but not how it was split among replicas.
"""

import tensorflow as tf


def residual_dtype(variable_dtype):
    """Residuals accumulate many small entries: at least float32."""
    dtype = tf.as_dtype(variable_dtype)
    return dtype if dtype in (tf.float32, tf.float64) else tf.float32


def make_residual(variable, name=None):
    """A zero, per-replica residual shaped like `variable` (call in strategy scope)."""
    base = getattr(variable, "name", "variable").split(":")[0].replace("/", "_")
    return tf.Variable(
        tf.zeros(variable.shape, residual_dtype(variable.dtype)),
        trainable=False,
        name=name or f"{base}_residual",
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )


class ErrorFeedbackMemory:
    """Residuals for a list of variables; compensate before, update after selection."""

    def __init__(self, residuals):
        self.residuals = list(residuals)

    def compensate(self, position, grad):
        """grad + residual, flat, in the residual's dtype."""
        residual = self.residuals[position]
        return tf.reshape(tf.cast(grad, residual.dtype), [-1]) + tf.reshape(residual, [-1])

    def update(self, position, accumulated, values, indices, keep):
        """residual = accumulated - selected (scattered back), where `keep`.

        Spare slots (value 0 at index 0) subtract nothing. Where `keep` is
        false (a step with non-finite gradients) the residual is unchanged.
        """
        residual = self.residuals[position]
        selected = tf.scatter_nd(tf.expand_dims(indices, 1), tf.cast(values, residual.dtype),
                                 tf.shape(accumulated, out_type=tf.int32))
        new = accumulated - selected
        new = tf.where(keep, new, tf.reshape(residual, [-1]))
        residual.assign(tf.reshape(new, residual.shape))
        return new
