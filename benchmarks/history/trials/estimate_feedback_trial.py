"""A trial of error feedback of a momentum estimate in place of the residual (EF21-SGDM: Fatkhullin,
Tyurin and Richtarik, "Momentum Provably Improves Error Feedback!", NeurIPS 2023; EF21: Richtarik,
Sokolov and Fatkhullin 2021).

Why: with error feedback in front of the inner optimizer, what is sent moves its variable once (times
the momentum's 1 / (1 - m)) and an entry not sent does not move at all. At a density of 0.001 most
entries wait hundreds of steps, so training lags dense training step for step. Here every replica
keeps an estimate of its own momentum that every replica knows, and sends only the top-k of where its
momentum moved away from it: a slowly changing direction is sent once and then applied every step, and
every entry moves every step with its last known momentum.

    u <- m * u + g                      (per replica: its momentum, sum form as Keras's SGD)
    c = top-k of (u - e);  e <- e + c   (per replica: e, the estimate of u the others know)
    E <- E + sum of every replica's c   (the same on every replica: the sum of the e's)
    variable -= lr * E                  (the exchange's direction, applied by plain SGD)

With every entry sent (the density warm-up's first steps) e = u and E is the momentum of the summed
gradient: Keras's momentum SGD exactly.

`python benchmarks/estimate_feedback_trial.py SUITE_ARGS...` runs `python -m tf_topk.bench suite SUITE_ARGS`
with two more configurations: `estimate` (MomentumEstimateMemory(0.9): every task's SGD momentum) and
`estimate-0.99` (the estimates decayed by 0.99 a step, between EF21's 1 and the momentum's 0.9, where
the difference u - e is a residual decayed by m). Measured on both halves at density 0.001
(benchmarks/RESULTS.md, "Three trials"): far below the default, so not in the library.
"""

import sys

import tensorflow as tf

from tf_topk.bench import suite
from tf_topk.config import check_momentum
from tf_topk.memory import Compensation, Memory, residual_dtype


def _flat(tensor):
    return tf.reshape(tf.convert_to_tensor(tensor), [-1])


class MomentumEstimateMemory(Memory):
    """Per sparsified variable: the replica's momentum u (suffix "momentum") and its estimate e
    (suffix "estimate"), per replica; the sum of every replica's estimate E (suffix
    "summed_estimate"), the same on every replica. Dense-path variables keep the inner optimizer.

    Args:
      momentum: m in (0, 1), the inner SGD's momentum (0.9 as in `SGD(momentum=0.9)`).
      decay: rho, the estimates' decay a step (1: EF21-SGDM); with rho the selector sees m * u - rho * e
        + g, and e and E are decayed by rho before what was sent is added.

    `TopKOptimizer(SGD(lr, momentum=0.9), density=d, memory=MomentumEstimateMemory(0.9))`.
    """

    keeps_unsent = True
    applies_update = True

    def __init__(self, momentum, decay=1.0):
        self.momentum = check_momentum(momentum)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be a float in (0, 1], got {decay!r}")
        self.decay = float(decay)
        self.velocities = self.estimates = self.summed_estimates = None

    def describe(self):
        """The line the chief prints when the exchange is made."""
        return (f"tf_topk: momentum estimates (EF21-SGDM) for the sparsified variables: each replica sends the "
                f"top-k of its momentum (m={self.momentum:g}) minus the estimate every replica holds of it, and "
                "the sum of the estimates is applied at the learning rate every step")

    def build(self, variables, make_state):
        dtypes = [residual_dtype(v.dtype) for v in variables]
        self.velocities = [make_state(v, d, "momentum") for v, d in zip(variables, dtypes)]
        self.estimates = [make_state(v, d, "estimate") for v, d in zip(variables, dtypes)]
        self.summed_estimates = [make_state(v, d, "summed_estimate", replicated=True)
                                 for v, d in zip(variables, dtypes)]

    @property
    def state_variables(self):
        return list(self.velocities or []) + list(self.estimates or []) + list(self.summed_estimates or [])

    def compensate(self, slot, grad):
        """The selector sees g + m * u - e = u_new - e."""
        velocity, estimate = self.velocities[slot], self.estimates[slot]
        return Compensation(grad, self.momentum * _flat(velocity) - self.decay * _flat(estimate), None)

    def update(self, slot, compensation, remaining, values, indices):
        """e += what this replica sent; u_new = remaining + e (remaining is u_new - e - sent)."""
        estimate, velocity = self.estimates[slot], self.velocities[slot]
        sent = tf.cast(values, estimate.dtype)
        new_estimate = tf.tensor_scatter_nd_add(self.decay * _flat(estimate), tf.expand_dims(tf.cast(indices, tf.int32), 1), sent)
        estimate.assign(tf.reshape(new_estimate, estimate.shape))
        velocity.assign(tf.reshape(tf.cast(_flat(remaining), velocity.dtype) + new_estimate, velocity.shape))

    def apply_sparse(self, slot, summed, keep):
        """E + the exchanged sum: the direction (E advanced where `keep`)."""
        summed_estimate = self.summed_estimates[slot]
        new = self.decay * _flat(summed_estimate) + tf.cast(_flat(summed), summed_estimate.dtype)
        summed_estimate.assign(tf.reshape(tf.where(keep, new, _flat(summed_estimate)), summed_estimate.shape))
        return tf.reshape(tf.cast(new, summed.dtype), tf.shape(summed))


def install():
    """The trial's configurations, in the suite's `CONFIGS` for this process."""
    for name, decay in (("estimate", 1.0), ("estimate-0.99", 0.99)):
        suite.CONFIGS[name] = suite.Config(
            f"the default with momentum estimates in place of error feedback (MomentumEstimateMemory(0.9, "
            f"decay={decay:g}), EF21-SGDM)",
            lambda d, steps, epoch, decay=decay: {"density": d, "memory": MomentumEstimateMemory(0.9, decay)})


if __name__ == "__main__":
    install()
    sys.exit(suite.main(sys.argv[1:]))
