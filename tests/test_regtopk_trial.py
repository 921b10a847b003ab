"""benchmarks/regtopk_trial.py, which RESULTS' trial of RegTop-k's selection rests on: a numpy
reference of the selection and the error feedback on one and two replicas, and an entry sent at the
last step giving way to one that waited."""

import functools
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from logical_cpus import mirrored_on_cpus, split_cpu, strategy_for, train_variable

split_cpu()  # before TensorFlow starts: the two-replica test skips without it

import tf_topk  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from regtopk_trial import regtopk_options  # noqa: E402

ENTRIES, K, MU, STEPS = 50, 2, 5.0, 6


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 8_400_000)


def gradient(step, replica):
    return np.random.default_rng(10 * step + replica).normal(0.0, 1.0, ENTRIES).astype(np.float32)


def reference(replicas, steps=STEPS):
    """The variable after `steps` steps of SGD(1.0): per replica a = gradient + residual, the k largest of
    |tanh(S / (mu * s))| * |a| sent (weight 1 where it sent nothing at the last step: s = 0), the rest kept."""
    variable = np.zeros(ENTRIES)
    residuals = [np.zeros(ENTRIES) for _ in range(replicas)]
    last_sent = [np.zeros(ENTRIES) for _ in range(replicas)]
    last_summed = np.zeros(ENTRIES)
    for step in range(steps):
        summed = np.zeros(ENTRIES)
        for replica in range(replicas):
            accumulated = gradient(step, replica) + residuals[replica]
            sent = last_sent[replica]
            weights = np.where(sent != 0, np.abs(np.tanh(np.divide(last_summed, MU * np.where(sent != 0, sent, 1.0)))),
                               1.0)
            chosen = np.argsort(-np.abs(accumulated) * weights, kind="stable")[:K]
            last_sent[replica] = np.zeros(ENTRIES)
            last_sent[replica][chosen] = accumulated[chosen]
            summed[chosen] += accumulated[chosen]
            residuals[replica] = accumulated
            residuals[replica][chosen] = 0.0
        last_summed = summed
        variable -= summed
    return variable


def train(replicas, make, gradients=gradient, steps=STEPS):
    strategy = strategy_for(replicas, two_replicas)
    return train_variable(strategy, make, gradients, replicas, ENTRIES, steps)


def make_optimizer():
    return tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), density_warmup_steps=0, min_size=1,
                                 **regtopk_options(K / ENTRIES, MU))


@pytest.mark.parametrize("replicas", [1, 2], ids=["one device", "two replicas"])
def test_the_update_is_the_numpy_reference(replicas):
    np.testing.assert_allclose(train(replicas, make_optimizer)[-1], reference(replicas), rtol=1e-5, atol=1e-5)


def test_an_entry_sent_at_the_last_step_gives_way():
    """Entry 5's gradient is 10 a step, entry 7's 2: plain top-k of 1 sends entry 5 until 7's residual
    passes 10; RegTop-k ranks 5 at 0.2 * 10 the step after it was sent, so 7 (waiting 4) goes."""
    constant = np.ones(ENTRIES, np.float32)
    constant[5], constant[7] = 10.0, 2.0

    def moved(make):
        after = train(1, make, lambda step, replica: constant, steps=3)
        return [int(np.flatnonzero(b - a)[0]) for a, b in zip([np.zeros(ENTRIES)] + after[:-1], after)]

    def plain():
        return tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), density=1 / ENTRIES, density_warmup_steps=0,
                                     min_size=1, method="exact", exchange_mode="allgather")

    def regtopk():
        return tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), density_warmup_steps=0, min_size=1,
                                     **regtopk_options(1 / ENTRIES, MU))

    assert moved(plain) == [5, 5, 5]
    assert moved(regtopk) == [5, 7, 5]
