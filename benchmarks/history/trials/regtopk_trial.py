"""A trial of RegTop-k's selection (Bereyhi, Liang, Boudreau and Afana, "Regularized Top-k: A Bayesian
Framework for Gradient Sparsification", arXiv 2501.05633) in front of error feedback:
`python benchmarks/regtopk_trial.py [--mu 5] SUITE_ARGS...`.

Why: with plain top-k an entry whose gradient stays large is sent step after step while a third of
a layer waits for the whole run (the suite's diagnosis at density 0.001). RegTop-k ranks each entry
of the accumulated gradient a (gradient + residual) by |a| times a weight from the last step:
where this replica sent s at the last step and the replicas' sum there was S,

    score = |tanh(S / (mu * s))| * |a|        (an entry this replica did not send: |a|)

so an entry whose last contribution the others cancelled (S near 0) waits, and with one replica
(S = s) an entry sent at the last step is ranked at tanh(1 / mu) = 0.2 of its magnitude (mu = 5, the
paper's): the selection rotates over more entries. The values sent are a's, and what is not sent
stays in the residual, as with the default.

Runs `python -m tf_topk.bench suite SUITE_ARGS` with one more configuration, `regtopk` (the default
with this selection, `exchange_mode="allgather"`, k per variable). Measured on both halves at density
0.001 (benchmarks/RESULTS.md, "Three trials"): no different from the default.
"""

import argparse
import sys
import threading

import tensorflow as tf

from tf_topk.bench import suite
from tf_topk.memory import ErrorFeedbackMemory, residual_dtype
from tf_topk.selector import Selector

DEFAULT_MU = 5.0


class LastStepMemory(ErrorFeedbackMemory):
    """Error feedback that also keeps, per sparsified variable, what this replica sent at the last kept
    step (suffix "last_sent", per replica, zero where it sent nothing) and the replicas' sum then
    (suffix "last_summed", the same on every replica); `compensate` queues each slot's RegTop-k weights
    for the selector, in the order the exchange selects (a queue per thread: MirroredStrategy runs each
    replica's step in a thread of its own)."""

    def __init__(self, mu=DEFAULT_MU):
        super().__init__()
        if not mu > 0:
            raise ValueError(f"mu must be > 0, got {mu!r}")
        self.mu = float(mu)
        self.last_sent = self.last_summed = None
        self.queues = {}

    def build(self, variables, make_state):
        super().build(variables, make_state)
        self.last_sent = [make_state(v, residual_dtype(v.dtype), "last_sent") for v in variables]
        self.last_summed = [make_state(v, residual_dtype(v.dtype), "last_summed", replicated=True)
                            for v in variables]

    @property
    def state_variables(self):
        return super().state_variables + list(self.last_sent or []) + list(self.last_summed or [])

    @property
    def queued(self):
        """This replica's weights, in the order of its `compensate` calls this step."""
        return self.queues.setdefault(threading.get_ident(), [])

    def begin_step(self, learning_rate):
        self.queues[threading.get_ident()] = []

    def weights(self, slot):
        sent = tf.reshape(tf.convert_to_tensor(self.last_sent[slot]), [-1])
        summed = tf.reshape(tf.convert_to_tensor(self.last_summed[slot]), [-1])
        ratio = tf.math.divide_no_nan(summed, self.mu * sent)
        return tf.where(tf.not_equal(sent, 0.0), tf.abs(tf.tanh(ratio)), tf.ones_like(sent))

    def compensate(self, slot, grad):
        self.queued.append(self.weights(slot))
        return super().compensate(slot, grad)

    def update(self, slot, compensation, remaining, values, indices):
        super().update(slot, compensation, remaining, values, indices)
        last = self.last_sent[slot]
        sent = tf.scatter_nd(tf.expand_dims(tf.cast(indices, tf.int32), 1), tf.cast(values, last.dtype),
                             [last.shape.num_elements()])
        last.assign(tf.reshape(sent, last.shape))

    def apply_sparse(self, slot, summed, keep):
        last = self.last_summed[slot]
        flat = tf.reshape(tf.cast(summed, last.dtype), [-1])
        last.assign(tf.reshape(tf.where(keep, flat, tf.reshape(tf.convert_to_tensor(last), [-1])), last.shape))
        return summed


class RegTopKSelector(Selector):
    """The k largest of |weight * accumulated| (exact), the weights the memory queued for this slot;
    the values sent are the accumulated ones."""

    def __init__(self, memory):
        self.memory = memory

    def select(self, accumulated, k):
        weights = self.memory.queued.pop(0)
        _, indices = tf.math.top_k(tf.abs(accumulated) * tf.cast(weights, accumulated.dtype), k)
        return tf.gather(accumulated, indices), indices


def regtopk_options(density, mu=DEFAULT_MU):
    memory = LastStepMemory(mu)
    return {"density": density, "exchange_mode": "allgather", "memory": memory,
            "selector": RegTopKSelector(memory)}


def install(mu=DEFAULT_MU):
    """The trial's configuration, in the suite's `CONFIGS` for this process."""
    suite.CONFIGS["regtopk"] = suite.Config(
        f"the default with RegTop-k's selection (mu {mu:g}, exchange_mode='allgather')",
        lambda d, steps, epoch: regtopk_options(d, mu))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mu", type=float, default=DEFAULT_MU, help="RegTop-k's mu (default 5)")
    known, rest = parser.parse_known_args()
    if not known.mu > 0:
        parser.error(f"--mu must be > 0, got {known.mu}")
    install(known.mu)
    sys.exit(suite.main(rest))
