"""benchmarks/estimate_feedback_trial.py's MomentumEstimateMemory (EF21-SGDM), which RESULTS' trial of it
rests on: a numpy reference of the update on one and two replicas (all_gather and agreed indices),
Keras's momentum SGD exactly when every entry is sent, and the state kept where a replica's gradient
is not finite."""

import functools
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from logical_cpus import mirrored_on_cpus, split_cpu, strategy_for, train_variable

split_cpu()  # before TensorFlow starts: the two-replica tests skip without it

import tf_topk  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from estimate_feedback_trial import MomentumEstimateMemory  # noqa: E402

ENTRIES, K, MOMENTUM, RATE, STEPS = 60, 3, 0.9, 0.1, 6


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 8_300_000)


def gradient(step, replica):
    return np.random.default_rng(10 * step + replica).normal(0.0, 1.0, ENTRIES).astype(np.float32)


def reference(replicas, k, agreed=False):
    """The variable after each step: per replica u = m*u + g, the k largest of u - e sent (with agreed
    indices, the nominated ones: slot j is replica j mod P's (j // P)-th largest, an index already
    taken left spare; every replica sends its own values there), e += sent; E += the sum sent;
    variable -= lr * E."""
    variable = np.zeros(ENTRIES, np.float64)
    velocities = [np.zeros(ENTRIES) for _ in range(replicas)]
    estimates = [np.zeros(ENTRIES) for _ in range(replicas)]
    summed = np.zeros(ENTRIES)
    after = []
    for step in range(STEPS):
        differences = []
        for replica in range(replicas):
            velocities[replica] = MOMENTUM * velocities[replica] + gradient(step, replica)
            differences.append(velocities[replica] - estimates[replica])
        ranked = [np.argsort(-np.abs(d), kind="stable") for d in differences]
        nominated = list(dict.fromkeys(int(ranked[j % replicas][j // replicas]) for j in range(k)))
        for replica in range(replicas):
            chosen = nominated if agreed else ranked[replica][:k]
            estimates[replica][chosen] += differences[replica][chosen]
            summed[chosen] += differences[replica][chosen]
        variable -= RATE * summed
        after.append(variable.copy())
    return after


def make_optimizer(density, exchange_mode="allgather"):
    return tf_topk.TopKOptimizer(keras.optimizers.SGD(RATE, momentum=MOMENTUM), density=density,
                                 density_warmup_steps=0, min_size=1, method="exact", exchange_mode=exchange_mode,
                                 memory=MomentumEstimateMemory(MOMENTUM))


def train(replicas, make, gradients=gradient):
    strategy = strategy_for(replicas, two_replicas)
    return train_variable(strategy, make, gradients, replicas, ENTRIES, STEPS)


@pytest.mark.parametrize("replicas", [1, 2], ids=["one device", "two replicas"])
def test_the_update_is_the_numpy_reference(replicas):
    trained = train(replicas, lambda: make_optimizer(K / ENTRIES))
    for step, (got, want) in enumerate(zip(trained, reference(replicas, K))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
    # Every entry moves once its estimate is not zero: after the first steps, more than k a replica.
    assert np.count_nonzero(trained[-1] - trained[-2]) > replicas * K


def test_agreed_indices_send_the_nominated_entries_from_every_replica():
    trained = train(2, lambda: make_optimizer(K / ENTRIES, exchange_mode="allreduce"))
    np.testing.assert_allclose(trained[-1], reference(2, K, agreed=True)[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("replicas", [1, 2], ids=["one device", "two replicas"])
def test_every_entry_sent_is_keras_momentum_sgd(replicas):
    trained = train(replicas, lambda: make_optimizer(1.0))[-1]
    np.testing.assert_allclose(trained, reference(replicas, ENTRIES)[-1], rtol=1e-5, atol=1e-5)
    # Keras's own momentum SGD on the summed gradient.
    variable = keras.Variable(np.zeros(ENTRIES, np.float32))
    keras_sgd = keras.optimizers.SGD(RATE, momentum=MOMENTUM)
    for step in range(STEPS):
        keras_sgd.apply([tf.constant(sum(gradient(step, r) for r in range(replicas)))], [variable])
    np.testing.assert_allclose(trained, variable.numpy(), rtol=1e-5, atol=1e-5)


def test_a_step_with_a_non_finite_gradient_changes_nothing():
    def gradients(step, replica):
        values = gradient(step, replica)
        if step == 3 and replica == 1:
            values[7] = np.nan
        return values

    trained = train(2, lambda: make_optimizer(K / ENTRIES), gradients)
    np.testing.assert_array_equal(trained[3], trained[2])
    # The step skipped, the state is as it was: the next steps are the reference's without step 3.
    want = reference_without(2, K, skipped=3)
    np.testing.assert_allclose(trained[-1], want, rtol=1e-5, atol=1e-5)


def reference_without(replicas, k, skipped):
    """The reference's last variable with step `skipped` left out (its gradients never seen)."""
    variable = np.zeros(ENTRIES)
    velocities = [np.zeros(ENTRIES) for _ in range(replicas)]
    estimates = [np.zeros(ENTRIES) for _ in range(replicas)]
    summed = np.zeros(ENTRIES)
    for step in (s for s in range(STEPS) if s != skipped):
        for replica in range(replicas):
            velocities[replica] = MOMENTUM * velocities[replica] + gradient(step, replica)
            difference = velocities[replica] - estimates[replica]
            chosen = np.argsort(-np.abs(difference), kind="stable")[:k]
            estimates[replica][chosen] += difference[chosen]
            summed[chosen] += difference[chosen]
        variable -= RATE * summed
    return variable


@pytest.mark.parametrize("decay", [0.0, 1.5, -0.1, True, "0.9"])
def test_a_bad_decay_is_named(decay):
    with pytest.raises(ValueError, match=r"decay must be a float in \(0, 1\], got"):
        MomentumEstimateMemory(MOMENTUM, decay)


def test_a_bad_momentum_is_named():
    with pytest.raises(ValueError, match="momentum must be a float in"):
        MomentumEstimateMemory(1.0)
