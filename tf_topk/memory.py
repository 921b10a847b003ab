"""Memories: what a replica keeps between steps (error feedback, momentum correction, or nothing).

A memory is one of the exchange's three parts (selector, memory,
communicator). Per sparsified variable (a slot), it turns the gradient into
the tensor the selector sees (`compensate`) and, once k entries are
selected, keeps what was not sent (`update`). Variables on the dense path
(smaller than the exchange's `min_size`) pass through `apply_dense` once
summed over replicas. State is made through a factory the exchange passes to
`build`, so the Keras wrapper can make tracked Keras variables while custom
loops get plain `tf.Variable`s.

Error feedback: what a replica did not send stays in its residual and is
added to its next gradient, so nothing is lost, only delayed. Residuals
differ per replica, so they are per-replica state:
`tf.VariableSynchronization.ON_READ` variables with SUM aggregation. The
exchange makes checkpoints hold every replica's own state
(`tf_topk.replica_state`), so a resumed run gets each replica's residual back
exactly; only when the number of replicas changed does each get
sum / num_replicas (TensorFlow's rule for ON_READ state: the total gradient
mass held back is kept, not how it was split).

Momentum correction (Deep Gradient Compression, Lin et al., ICLR 2018):
momentum applied by the inner optimizer to the exchanged sum acts on entries
that arrive late and in bursts, and most of what momentum brings is lost at
0.1% density. So each replica keeps its own velocity and accumulates it, and
the exchanged sum is applied by plain SGD:

    u <- m * u + g            (Nesterov: u <- m * (u + g))
    v <- v + u                (Nesterov: v <- v + u + g)
    send top-k of v; v <- 0 and, with momentum factor masking, u <- 0 where sent.

Masking stops a sent entry's stale velocity from pushing the same direction
again. "Sent" is what this replica contributed: under the agreed-index
exchange, its own non-zero values at the leader's indices. With density 1 and no masking this is exactly momentum SGD.

Every state update is conditional on `keep` (false on a step where some
replica had a non-finite gradient): such a step leaves all state as it was.

A new memory subclasses `Memory` and defines `build`, `state_variables`,
`compensate(slot, grad, keep)` and `update(slot, accumulated, values, indices,
keep)`, passed as `SparseExchange(..., memory=MyMemory())`.
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


def _assign_flat(variable, flat, keep):
    """variable = flat (reshaped) where `keep`, else unchanged; returns the new flat value."""
    new = tf.where(keep, flat, tf.reshape(variable, [-1]))
    variable.assign(tf.reshape(new, variable.shape))
    return new


class Memory:
    """What every memory shares: no state on the dense path, nothing kept by default."""

    keeps_unsent = False

    def build_dense(self, variables, make_state):
        """State for the dense-path variables (none by default)."""

    def apply_dense(self, slot, summed, keep):
        """The summed gradient of dense-path variable `slot`, as the optimizer gets it."""
        return summed


class ErrorFeedbackMemory(Memory):
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

    def compensate(self, slot, grad, keep):
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
        return _assign_flat(residual, new, keep)


def check_momentum(momentum):
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 < momentum < 1.0:
        raise ValueError(f"momentum must be a float in (0, 1), got {momentum!r}")
    return float(momentum)


class MomentumCorrectionMemory(ErrorFeedbackMemory):
    """Error feedback of a per-replica velocity (DGC's momentum correction).

    Per sparsified variable, two per-replica states: the velocity `u`
    (suffix "momentum") and the residual `v` (suffix "residual"). The
    exchanged sum must then be applied by plain SGD (`TopKOptimizer` does
    that with `momentum_correction=True`).

    Dense-path variables are summed over replicas first and given ordinary
    momentum there (`U <- m*U + G`, or Nesterov's `U <- m*(U + G)`, applied
    as `G + U`), which equals the sum of per-replica velocities; U is the same
    on every replica.

    Args:
      momentum: m in (0, 1), e.g. the inner SGD's 0.9.
      nesterov: DGC's Nesterov variant.
      masking: momentum factor masking (zero `u` where sent; default True).
    """

    def __init__(self, momentum, nesterov=False, masking=True):
        super().__init__()
        self.momentum = check_momentum(momentum)
        self.nesterov = bool(nesterov)
        self.masking = bool(masking)
        self.velocities = None
        self.dense_velocities = []

    def build(self, variables, make_state):
        super().build(variables, make_state)
        self.velocities = [make_state(v, residual_dtype(v.dtype), "momentum") for v in variables]

    def build_dense(self, variables, make_state):
        self.dense_velocities = [make_state(v, residual_dtype(v.dtype), "momentum") for v in variables]

    @property
    def state_variables(self):
        return list(self.residuals or []) + list(self.velocities or []) + list(self.dense_velocities)

    def _step_velocity(self, velocity, grad, keep):
        """Advances `velocity` with `grad` where keep; returns (new velocity, what accumulates)."""
        grad = tf.reshape(tf.cast(grad, velocity.dtype), [-1])
        old = tf.reshape(velocity, [-1])
        if self.nesterov:
            new = self.momentum * (old + grad)
            increment = new + grad
        else:
            new = self.momentum * old + grad
            increment = new
        _assign_flat(velocity, new, keep)
        return new, increment

    def compensate(self, slot, grad, keep):
        """v + u_new (u advanced with grad where keep)."""
        _, increment = self._step_velocity(self.velocities[slot], grad, keep)
        return tf.reshape(self.residuals[slot], [-1]) + increment

    def update(self, slot, accumulated, values, indices, keep):
        remaining = super().update(slot, accumulated, values, indices, keep)
        if self.masking:
            velocity = self.velocities[slot]
            sent = _scatter_selected(accumulated, tf.cast(tf.not_equal(values, 0), tf.float32), indices,
                                     velocity.dtype)
            # Spare slots (value 0 at index 0) are not sent, so they mask nothing.
            _assign_flat(velocity, tf.where(sent > 0, tf.zeros_like(sent), tf.reshape(velocity, [-1])), keep)
        return remaining

    def apply_dense(self, slot, summed, keep):
        velocity = self.dense_velocities[slot]
        _, increment = self._step_velocity(velocity, summed, keep)
        return tf.reshape(tf.cast(increment, summed.dtype), tf.shape(summed))


class NoMemory(Memory):
    """Nothing kept: unsent entries are dropped. Only for comparisons."""

    def build(self, variables, make_state):
        pass

    @property
    def state_variables(self):
        return []

    def compensate(self, slot, grad, keep):
        return tf.reshape(tf.cast(grad, tf.float32), [-1])

    def update(self, slot, accumulated, values, indices, keep):
        return accumulated - _scatter_selected(accumulated, values, indices, accumulated.dtype)
