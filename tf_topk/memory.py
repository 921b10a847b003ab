"""Memories: what a replica keeps between steps (error feedback, momentum correction for SGD or
Adam, or nothing).

A memory is one of the exchange's three parts (selector, memory, route). Per sparsified variable (a slot), it turns the gradient into
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

Without masking (the default) every gradient reaches the weights with the
whole weight momentum gives it, 1 / (1 - m), only later: with density 1 this
is exactly momentum SGD. DGC's masking stops a sent entry's velocity from
pushing the same direction again, and with it drops the rest of that
momentum, so entries sent often train with little momentum. "Sent" is what
this replica contributed: under the agreed-index exchange, its own non-zero
values at the leader's indices.

State changes only in `update`, which the exchange calls once every
replica's step is known to be finite: a step where some replica had a
non-finite gradient leaves all state as it was, at no cost (the new residual
was written to a separate buffer by the fused op, and is dropped).

A new memory subclasses `Memory` and defines `build`, `state_variables`,
`compensate(slot, grad)` (returning a `Compensation`: the tensor to select
from is its gradient + residual) and `update(slot, compensation, remaining,
values, indices)`, passed as `SparseExchange(..., memory=MyMemory())`. Which memory a config asks for
is `tf_topk.methods.memory_for`'s. The
exchange hands the sum and the selection to the fused op
(`tf_topk.error_feedback_topk`), so a memory never makes a pass of its own
over the accumulated gradient.
"""

import abc
import collections
import math

import tensorflow as tf

from tf_topk.config import check_beta_2, check_epsilon, check_momentum, check_warmup_steps


# Adam's momentum correction: sqrt(v) of the frozen second moment is at least this fraction of its
# mean over the variable, so that entries silent during the warm-up (v = 0) are not divided by epsilon.
PRECONDITIONER_FLOOR = 0.2


# What a memory's state means, named: an optimizer keeps its memory's index here beside that state
# (`method_code`), so that a checkpoint written under one method is not carried on by another (a
# residual of gradients read as a momentum in a DCT's space, say). 0: a memory of the user's, unchecked.
METHODS = ("a memory of its own", "error feedback", "error feedback rescaled by the learning rate",
           "momentum correction", "Adam's momentum correction", "decoupled momentum", "no memory")


def method_code(memory):
    """The index of `memory.method` in METHODS (0 where it names none)."""
    return METHODS.index(memory.method) if memory.method in METHODS else 0


def residual_dtype(variable_dtype):
    """Residuals accumulate many small entries: at least float32."""
    dtype = tf.as_dtype(variable_dtype)
    return dtype if dtype in (tf.float32, tf.float64) else tf.float32


def state_name(variable, suffix):
    """`<variable name>_<suffix>`, with the name's slashes made underscores."""
    base = getattr(variable, "path", None) or getattr(variable, "name", "variable").split(":")[0]
    return f"{base.replace('/', '_')}_{suffix}"


def make_state_variable(variable, dtype, suffix, replicated=False):
    """The default state factory: a zero, per-replica tf.Variable shaped like
    `variable` (call in the strategy's scope).

    State that differs per replica (residuals) is summed when read or saved
    as one value, so the total is kept when the replica count changes;
    `replicated` state holds the same value on every replica (dense-path
    velocities) and is read, and restored into another replica count, as
    that value (the first replica's)."""
    return tf.Variable(
        tf.zeros(variable.shape, dtype),
        trainable=False,
        name=state_name(variable, suffix),
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA if replicated else tf.VariableAggregation.SUM,
    )


Compensation = collections.namedtuple("Compensation", ["gradient", "residual", "state"])
Compensation.__doc__ = """What a memory makes of one slot's gradient: the tensor to select from is
gradient + residual (the exchange adds them inside the fused selection op,
`tf_topk.error_feedback_topk`), and `state` is whatever `update` will need
(None for plain error feedback)."""


def _flat(variable):
    return tf.reshape(variable, [-1])


class Memory(abc.ABC):
    """A memory's interface, and what every memory shares: no state on the
    dense path, nothing kept by default.

    `compensate(slot, grad)` returns a Compensation; once the exchange knows
    the step is kept (every replica finite), it calls `update(slot,
    compensation, remaining, values, indices)` with `remaining` = gradient +
    residual minus what this replica sent. A step that is not kept calls
    nothing, so state stays exactly as it was.

    keeps_unsent: whether what is not sent is kept (error feedback).
    residuals: the per-slot residual variables, if the memory has them.
    """

    keeps_unsent = False
    residuals = None
    # The method's name in METHODS (None: a memory of the user's).
    method = None
    # Whether some steps send every entry (k = n): `sends_every_entry()` says which.
    may_send_every_entry = False
    # Whether the summed sparse gradients the exchange returns are update
    # directions to apply by plain SGD (`variable -= lr * direction`).
    applies_update = False
    # Whether `begin_step` needs the step's learning rate (the wrappers then pass it).
    follows_learning_rate = False

    @abc.abstractmethod
    def build(self, variables, make_state):
        """Make the state of the sparsified `variables` with `make_state`."""

    @property
    @abc.abstractmethod
    def state_variables(self):
        """Every state variable, for checkpoints."""

    @abc.abstractmethod
    def compensate(self, slot, grad):
        """The Compensation of slot's gradient."""

    @abc.abstractmethod
    def update(self, slot, compensation, remaining, values, indices):
        """Keep what was not sent (called only on kept steps)."""

    def build_dense(self, variables, make_state):
        """State for the dense-path variables (none by default)."""
        return None

    def apply_dense(self, slot, summed, keep):
        """The summed gradient of dense-path variable `slot`, as the optimizer gets it."""
        return summed

    def apply_sparse(self, slot, summed, keep):
        """The summed gradient of sparsified variable `slot` (a dense tensor),
        as the optimizer gets it; `keep` says whether the step is kept."""
        return summed

    def sends_every_entry(self):
        """A boolean tensor, the same on every replica: whether this step sends
        every entry of every slot (None: never)."""
        return None

    def begin_step(self, learning_rate):
        """Called once per step before any `compensate`, with the inner
        optimizer's learning rate for the step (None where the caller gives
        none): a memory that follows the rate reads it here."""
        return None

    def residual(self, slot):
        """The residual that joins slot's gradient this step (a tensor)."""
        return tf.convert_to_tensor(self.residuals[slot])

    def finish_step(self):
        """Called once per kept step, after every slot's `update`: a memory
        with a phase of its own (Adam's warm-up) advances its own counter.

        A body beyond the docstring: AutoGraph cannot convert a function whose
        only statement is its docstring, and warns the user to report it."""
        return None


class ErrorFeedbackMemory(Memory):
    """A residual per slot: added to the next gradient, replaced by what was not sent.

    Args:
      residuals: optional ready-made residual variables, one per slot; else
        `build` makes them with the exchange's state factory.
    """

    method = "error feedback"
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
        """grad + residual (in the residual's dtype, the gradient cast by the op)."""
        return Compensation(grad, self.residual(slot), None)

    def update(self, slot, compensation, remaining, values, indices):
        """residual = remaining (the op's buffer is taken over: no copy)."""
        residual = self.residuals[slot]
        residual.assign(tf.reshape(remaining, residual.shape))


class RateScaledErrorFeedbackMemory(ErrorFeedbackMemory):
    """Error feedback whose residual keeps the displacement it stands for
    when the learning rate changes (`ExchangeConfig(rescale_residuals=True)`).

    A residual entry is gradient that waited; sent at step t it moves its
    variable by lr_t times it. Under a decaying rate, gradient that waited
    from a step of a larger rate then moves its variable less than it would
    have then, and at the end of a schedule hardly at all. Here the residual
    is multiplied, before each step, by the last kept step's rate over this
    step's, so that lr_t times it is what the steps it waited would have
    moved (EF-SGD's error in update space, Karimireddy et al. 2019, held in
    gradient units for the inner optimizer). One scalar of state, the same
    on every replica: the last kept step's rate (0 before the first, when
    nothing is rescaled; nor is it at a rate of 0).
    """

    method = "error feedback rescaled by the learning rate"
    follows_learning_rate = True

    def __init__(self, residuals=None):
        super().__init__(residuals)
        self.last_rate = None
        self._rate = self._ratio = None

    def build(self, variables, make_state):
        super().build(variables, make_state)
        self.last_rate = make_state(_Shaped(None, [], name="rescaled_residuals"), tf.float32, "last_rate",
                                    replicated=True)

    @property
    def state_variables(self):
        return super().state_variables + [self.last_rate]

    def begin_step(self, learning_rate):
        if learning_rate is None:
            raise ValueError("rescale_residuals=True follows the learning rate: call the exchange with "
                             "learning_rate=... (the inner optimizer's rate for the step; the Keras wrappers do)")
        rate = tf.cast(tf.convert_to_tensor(learning_rate), tf.float32)
        last = tf.convert_to_tensor(self.last_rate)
        both = tf.logical_and(rate > 0.0, last > 0.0)
        self._rate = rate
        self._ratio = tf.where(both, last / tf.where(both, rate, 1.0), 1.0)

    def residual(self, slot):
        residual = tf.convert_to_tensor(self.residuals[slot])
        if self._ratio is None:
            raise RuntimeError("RateScaledErrorFeedbackMemory.begin_step must run before the step's residuals")
        return residual * tf.cast(self._ratio, residual.dtype)

    def finish_step(self):
        if self._rate is not None:
            self.last_rate.assign(self._rate)


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
      masking: momentum factor masking (zero `u` where sent; default False).
    """

    method = "momentum correction"

    def __init__(self, momentum, nesterov=False, masking=False):
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
        # The same on every replica (computed from the summed gradient).
        self.dense_velocities = [make_state(v, residual_dtype(v.dtype), "momentum", replicated=True)
                                 for v in variables]

    @property
    def state_variables(self):
        return list(self.residuals or []) + list(self.velocities or []) + list(self.dense_velocities)

    def _step_velocity(self, velocity, grad):
        """(new velocity, what accumulates) for `grad`, flat."""
        grad = tf.reshape(tf.cast(grad, velocity.dtype), [-1])
        old = _flat(velocity)
        if self.nesterov:
            new = self.momentum * (old + grad)
            return new, new + grad
        new = self.momentum * old + grad
        return new, new

    def compensate(self, slot, grad):
        """v + u_new, u_new = u advanced with grad (kept for `update`)."""
        new, increment = self._step_velocity(self.velocities[slot], grad)
        return Compensation(increment, tf.convert_to_tensor(self.residuals[slot]), new)

    def update(self, slot, compensation, remaining, values, indices):
        super().update(slot, compensation, remaining, values, indices)
        velocity, new = self.velocities[slot], compensation.state
        if self.masking:
            # Zero where this replica sent (x - x); spare slots (value 0) subtract 0.
            sent = tf.cast(tf.not_equal(values, 0), new.dtype)
            new = tf.tensor_scatter_nd_sub(new, tf.expand_dims(indices, 1), tf.gather(new, indices) * sent)
        velocity.assign(tf.reshape(new, velocity.shape))

    def apply_dense(self, slot, summed, keep):
        velocity = self.dense_velocities[slot]
        new, increment = self._step_velocity(velocity, summed)
        velocity.assign(tf.reshape(tf.where(keep, new, _flat(velocity)), velocity.shape))
        return tf.reshape(tf.cast(increment, summed.dtype), tf.shape(summed))


class AdamMomentumCorrectionMemory(ErrorFeedbackMemory):
    """Momentum correction for Adam and AdamW: the principle of 1-bit Adam
    (Tang et al., ICML 2021) and 0/1 Adam (Lu et al., ICLR 2022).

    Adam's update m_hat / (sqrt(v_hat) + eps) is not linear in the gradient,
    so sparsifying the gradient in front of it (error-compensated top-k, then
    Adam on the sum) feeds both moments late, bursty entries: the first moment
    smears them, the second is inflated by them. Once the second moment is
    frozen, with the preconditioner p = (sqrt(v) + eps) / sqrt(1 - beta_2^W)
    fixed, Adam is momentum SGD on g / p:

        u <- beta_1 * u + (1 - beta_1) * g / p,     variable -= lr * u

    which is linear, so each replica keeps its own u of its own gradient
    (their sum is the global one), accumulates it in its residual and sends
    the top-k of that: DGC's momentum correction, on the preconditioned
    gradient. The exchanged sum is the update direction, applied by plain SGD
    (`applies_update`; TopKOptimizer adds the inner optimizer's decoupled
    weight decay). u is an average, not a sum, so it is not masked where sent:
    masking would shrink the step of an entry sent every step by 1 - beta_1.

    For the first `warmup_steps` steps the exchange sends every entry
    (`dense_steps`) and this memory runs Adam itself on the summed gradient,
    exactly as Keras's Adam does (epsilon included), with first and second
    moments that are the same on every replica. At step `warmup_steps` the
    second moment freezes and each replica's u starts from the first moment:
    m_hat / (replicas * p).

    The frozen second moment keeps its per-entry shape, but not its scale: a
    model trained towards zero loss has gradients far smaller than in the
    warm-up, and a frozen p would shrink every later step with them. So each replica
    tracks, per variable, s = an EMA (beta_2) of its mean squared gradient,
    and scales p by sqrt(s_hat / s_hat at the warm-up's end): no
    communication, since the applied step is the exchanged sum whatever p
    each replica used to make its part of it.

    The warm-up is counted by this memory (its kept steps, saved with its
    state), not by the optimizer's iterations: an inner Adam that already ran
    (a model trained densely, then wrapped; a checkpoint of another method
    restored into this one) still warms up before the freeze, where keying on
    the iterations would freeze a second moment of zeros.

    An entry that saw no gradient during the warm-up has v = 0: its p would
    be epsilon-sized and its first gradient would move it by orders of
    magnitude more than Adam would (embedding rows of tokens first seen
    later, image borders, a layer unfrozen later). So sqrt(v) is floored at
    PRECONDITIONER_FLOOR times its mean over the variable: such an entry
    moves about as an entry of typical scale would.

    Per sparsified variable: the residual, u (suffix "momentum") and s with
    its frozen value (suffix "grad_scale", 2 entries), per replica; the
    moments (suffixes "adam_m", "adam_v"), the same on every replica; one
    step counter (suffix "adam_steps"). Dense-path variables keep the inner
    optimizer's full Adam.

    Args:
      beta_1, beta_2, epsilon: the inner Adam's.
      warmup_steps: dense Adam steps before the second moment freezes (>= 1).
    """

    method = "Adam's momentum correction"
    applies_update = True
    may_send_every_entry = True

    def __init__(self, beta_1, beta_2, epsilon, warmup_steps):
        super().__init__()
        self.beta_1 = check_momentum(beta_1)
        self.beta_2 = check_beta_2(beta_2)
        self.epsilon = check_epsilon(epsilon)
        self.warmup_steps = check_warmup_steps(warmup_steps)
        self.velocities = None
        self.steps = None
        self.first_moments = None
        self.second_moments = None
        self.gradient_scales = None

    def build(self, variables, make_state):
        super().build(variables, make_state)
        self.velocities = [make_state(v, residual_dtype(v.dtype), "momentum") for v in variables]
        self.first_moments = [make_state(v, residual_dtype(v.dtype), "adam_m", replicated=True) for v in variables]
        self.second_moments = [make_state(v, residual_dtype(v.dtype), "adam_v", replicated=True)
                               for v in variables]
        self.gradient_scales = [make_state(_Shaped(v, [2]), tf.float32, "grad_scale") for v in variables]
        if variables:
            self.steps = make_state(_Shaped(None, [], name="adam_momentum_correction"), tf.int64, "adam_steps",
                                    replicated=True)

    @property
    def state_variables(self):
        return (list(self.residuals or []) + list(self.velocities or []) + list(self.first_moments or [])
                + list(self.second_moments or []) + list(self.gradient_scales or [])
                + ([self.steps] if self.steps is not None else []))

    def step(self):
        """This memory's kept steps so far (int64, the same on every replica)."""
        return tf.convert_to_tensor(self.steps)

    def _warming_up(self, step):
        return tf.less(step, self.warmup_steps)

    def sends_every_entry(self):
        return self._warming_up(self.step())

    def finish_step(self):
        if self.steps is not None:  # None: nothing is sparsified, so there is no warm-up to count
            self.steps.assign_add(1)

    def preconditioner(self, slot):
        """p of the frozen second moment (before its scale factor), flat; sqrt(v)
        floored at PRECONDITIONER_FLOOR times its mean over the variable."""
        root = tf.sqrt(_flat(self.second_moments[slot]))
        root = tf.maximum(root, PRECONDITIONER_FLOOR * tf.reduce_mean(root))
        return (root + self.epsilon) / math.sqrt(1.0 - self.beta_2 ** self.warmup_steps)

    def compensate(self, slot, grad):
        """Warming up: the gradient (sent whole). Then u advanced with g / p
        (kept for `update`), starting at the switch from the first moment."""
        step = self.step()
        velocity = self.velocities[slot]
        grad = tf.reshape(tf.cast(grad, velocity.dtype), [-1])
        scale, ratio = self._gradient_scale(slot, grad, step)
        preconditioner = self.preconditioner(slot) * tf.cast(ratio, velocity.dtype)
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        first = _flat(self.first_moments[slot]) / (1.0 - self.beta_1 ** self.warmup_steps)
        old = tf.where(tf.equal(step, self.warmup_steps), first / (replicas * preconditioner),
                       _flat(velocity))
        new = self.beta_1 * old + (1.0 - self.beta_1) * grad / preconditioner
        return Compensation(tf.where(self._warming_up(step), grad, new),
                            tf.convert_to_tensor(self.residuals[slot]), (new, scale))

    def _gradient_scale(self, slot, grad, step):
        """(s and its frozen value after this step, p's scale factor this step)."""
        state = self.gradient_scales[slot]
        t = tf.cast(step, tf.float32) + 1.0
        running = self.beta_2 * state[0] + (1.0 - self.beta_2) * tf.reduce_mean(tf.square(tf.cast(grad, tf.float32)))
        running_hat = running / (1.0 - self.beta_2 ** t)
        last_warmup = tf.equal(step, self.warmup_steps - 1)
        frozen = tf.where(last_warmup, running_hat, state[1])
        ratio = tf.where(self._warming_up(step) | tf.logical_not(frozen > 0), 1.0,
                         tf.sqrt(running_hat / tf.maximum(frozen, 1e-30)))
        return tf.stack([running, frozen]), ratio

    def update(self, slot, compensation, remaining, values, indices):
        super().update(slot, compensation, remaining, values, indices)
        velocity = self.velocities[slot]
        new, scale = compensation.state
        velocity.assign(tf.reshape(tf.where(self._warming_up(self.step()), tf.zeros_like(new), new),
                                   velocity.shape))
        self.gradient_scales[slot].assign(scale)

    def apply_sparse(self, slot, summed, keep):
        """Warming up: Adam's direction from the summed gradient (its moments
        advanced where `keep`). Then the sum itself: it is the direction."""
        step = self.step()
        first, second = self.first_moments[slot], self.second_moments[slot]

        def adam():
            grad = tf.cast(tf.reshape(summed, [-1]), first.dtype)
            new_first = self.beta_1 * _flat(first) + (1.0 - self.beta_1) * grad
            new_second = self.beta_2 * _flat(second) + (1.0 - self.beta_2) * tf.square(grad)
            first.assign(tf.reshape(tf.where(keep, new_first, _flat(first)), first.shape))
            second.assign(tf.reshape(tf.where(keep, new_second, _flat(second)), second.shape))
            t = tf.cast(step, first.dtype) + 1.0
            scale = tf.sqrt(1.0 - self.beta_2 ** t) / (1.0 - self.beta_1 ** t)
            direction = new_first * scale / (tf.sqrt(new_second) + self.epsilon)
            return tf.reshape(tf.cast(direction, summed.dtype), tf.shape(summed))

        return tf.cond(self._warming_up(step), adam, lambda: tf.identity(summed))


class _Shaped:
    """What a state factory needs of a variable (its name and a shape), for
    state of another shape than the variable's, or of no variable (`name`)."""

    def __init__(self, variable, shape, name=None):
        self.shape = tf.TensorShape(shape)
        self.name = name or getattr(variable, "name", "variable")
        self.path = None if name else getattr(variable, "path", None)


class NoMemory(Memory):
    """Nothing kept: unsent entries are dropped. Only for comparisons."""

    method = "no memory"

    def build(self, variables, make_state):
        pass

    @property
    def state_variables(self):
        return []

    def compensate(self, slot, grad):
        dtype = residual_dtype(grad.dtype)
        return Compensation(grad, tf.zeros(tf.shape(tf.reshape(grad, [-1])), dtype), None)

    def update(self, slot, compensation, remaining, values, indices):
        pass
