"""benchmarks/rescaled_correction_trial.py, which RESULTS' trial of rescaled momentum correction rests
on: a numpy reference of the update under a decaying rate on one and two replicas, and at a constant
rate the library's momentum correction exactly."""

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
import rescaled_correction_trial  # noqa: E402

ENTRIES, K, MOMENTUM, RATE, DECAY, STEPS = 40, 3, 0.9, 0.1, 0.7, 6


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 8_500_000)


def gradient(step, replica):
    return np.random.default_rng(10 * step + replica).normal(0.0, 1.0, ENTRIES).astype(np.float32)


def reference(replicas, decay):
    """The variable after STEPS steps at rate RATE * decay**t: per replica u and v multiplied by the last
    rate over this one's (not at the first step), u = m*u + g, v += u, the k largest of v sent and
    cleared there; the sum applied by plain SGD at the step's rate."""
    variable = np.zeros(ENTRIES)
    velocities = [np.zeros(ENTRIES) for _ in range(replicas)]
    residuals = [np.zeros(ENTRIES) for _ in range(replicas)]
    for step in range(STEPS):
        rate = RATE * decay ** step
        ratio = 1.0 if step == 0 else (RATE * decay ** (step - 1)) / rate
        summed = np.zeros(ENTRIES)
        for replica in range(replicas):
            velocities[replica] = MOMENTUM * velocities[replica] * ratio + gradient(step, replica)
            residuals[replica] = residuals[replica] * ratio + velocities[replica]
            chosen = np.argsort(-np.abs(residuals[replica]), kind="stable")[:K]
            summed[chosen] += residuals[replica][chosen]
            residuals[replica][chosen] = 0.0
        variable -= rate * summed
    return variable


def make_optimizer(decay):
    rate = RATE if decay == 1.0 else keras.optimizers.schedules.ExponentialDecay(RATE, 1, decay)
    return tf_topk.TopKOptimizer(keras.optimizers.SGD(rate, momentum=MOMENTUM), density=K / ENTRIES,
                                 density_warmup_steps=0, min_size=1, method="exact", exchange_mode="allgather",
                                 momentum_correction=True)


def train(replicas, decay):
    strategy = strategy_for(replicas, two_replicas)
    return train_variable(strategy, lambda: make_optimizer(decay), gradient, replicas, ENTRIES, STEPS)[-1]


@pytest.fixture
def installed():
    made = rescaled_correction_trial.exchange.memory_for
    rescaled_correction_trial.install()
    yield
    rescaled_correction_trial.exchange.memory_for = made


@pytest.mark.parametrize("replicas", [1, 2], ids=["one device", "two replicas"])
def test_the_update_under_a_decaying_rate_is_the_numpy_reference(installed, replicas):
    np.testing.assert_allclose(train(replicas, DECAY), reference(replicas, DECAY), rtol=1e-5, atol=1e-5)
    # The rescaling did something: unscaled (ratio 1), the reference differs.
    assert not np.allclose(reference(replicas, DECAY), reference_unscaled(replicas), atol=1e-3)


def test_at_a_constant_rate_it_is_the_librarys_momentum_correction(installed):
    trained = train(1, 1.0)
    rescaled_correction_trial.exchange.memory_for = rescaled_correction_trial.memory.memory_for
    np.testing.assert_allclose(trained, train(1, 1.0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(trained, reference(1, 1.0), rtol=1e-5, atol=1e-5)


def reference_unscaled(replicas):
    """The library's momentum correction under the same decaying rate (no rescaling)."""
    variable = np.zeros(ENTRIES)
    velocities = [np.zeros(ENTRIES) for _ in range(replicas)]
    residuals = [np.zeros(ENTRIES) for _ in range(replicas)]
    for step in range(STEPS):
        summed = np.zeros(ENTRIES)
        for replica in range(replicas):
            velocities[replica] = MOMENTUM * velocities[replica] + gradient(step, replica)
            residuals[replica] = residuals[replica] + velocities[replica]
            chosen = np.argsort(-np.abs(residuals[replica]), kind="stable")[:K]
            summed[chosen] += residuals[replica][chosen]
            residuals[replica][chosen] = 0.0
        variable -= RATE * DECAY ** step * summed
    return variable


def test_the_eight_bit_configuration_is_the_recipe_at_twice_the_pairs_for_the_same_bytes(installed):
    options = rescaled_correction_trial.suite.CONFIGS["mlp-recipe-rescaled-int8"].options(0.001, 400, 10)
    recipe = rescaled_correction_trial.suite.CONFIGS["mlp-recipe-rescaled"].options(0.001, 400, 10)
    assert options["exchange_mode"] == "allgather_int8" and options["momentum_correction"] is True
    assert options["density"][-1] == (40, pytest.approx(0.002)) and recipe["density"][-1] == (40, pytest.approx(0.001))
    assert "exchange_mode" not in recipe
