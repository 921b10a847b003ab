"""`ExchangeConfig(rescale_residuals=True)`: error feedback whose residual follows the learning rate.
A numpy reference of its update on one and two replicas, the arithmetic of the default where the rate
is constant, a skipped step that changes nothing, its state in a checkpoint, and what it refuses."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from logical_cpus import apply_step, mirrored_on_cpus, split_cpu, strategy_for

split_cpu()  # before TensorFlow starts: the two-replica tests skip without it

import tf_topk  # noqa: E402

ENTRIES, K, STEPS = 200, 2, 6
RATES = (1.0, 1.0, 0.5, 0.5, 0.1, 0.1)  # PiecewiseConstantDecay([1, 3], [1.0, 0.5, 0.1])


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 8_000_000)


def gradient(step, replica):
    return np.random.default_rng(10 * step + replica).normal(0.0, 1.0, ENTRIES).astype(np.float32)


def reference(replicas, rescale):
    """The variable after STEPS steps: per replica, gradient + (rescaled) residual, its K largest
    magnitudes sent, the rest kept; the sum of what was sent applied by plain SGD at the step's rate."""
    variable = np.zeros(ENTRIES, np.float64)
    residuals = [np.zeros(ENTRIES, np.float64) for _ in range(replicas)]
    last = 0.0
    for step, rate in enumerate(RATES):
        ratio = last / rate if rescale and last > 0 else 1.0
        summed = np.zeros(ENTRIES)
        for replica in range(replicas):
            waiting = gradient(step, replica) + residuals[replica] * ratio
            sent = np.zeros(ENTRIES)
            chosen = np.argsort(-np.abs(waiting))[:K]
            sent[chosen] = waiting[chosen]
            residuals[replica] = waiting - sent
            summed += sent
        variable -= rate * summed
        last = rate
    return variable


def make_optimizer(rescale):
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1, 3], [1.0, 0.5, 0.1])
    return tf_topk.TopKOptimizer(keras.optimizers.SGD(schedule), density=K / ENTRIES, density_warmup_steps=0,
                                 min_size=1, method="exact", exchange_mode="allgather",
                                 config=tf_topk.ExchangeConfig(rescale_residuals=rescale))


def train(replicas, rescale):
    strategy = strategy_for(replicas, two_replicas)
    with strategy.scope() if strategy is not None else tf.init_scope():
        variable = keras.Variable(np.zeros(ENTRIES, np.float32))
        optimizer = make_optimizer(rescale)
        optimizer.build([variable])
    for step in range(STEPS):
        apply_step(optimizer, variable, np.stack([gradient(step, r) for r in range(replicas)]), strategy)
    return variable.numpy(), optimizer


@pytest.mark.parametrize("replicas", [1, 2], ids=["one device", "two replicas"])
@pytest.mark.parametrize("rescale", [True, False], ids=["rescaled", "plain"])
def test_the_update_is_the_numpy_reference(replicas, rescale):
    trained, optimizer = train(replicas, rescale)
    np.testing.assert_allclose(trained, reference(replicas, rescale), rtol=1e-5, atol=1e-5)
    memory = optimizer._exchange_object.memory
    assert memory.follows_learning_rate is rescale
    if rescale:
        assert float(memory.last_rate.values[0] if replicas == 2 else memory.last_rate) == pytest.approx(0.1)


def test_rescaling_moves_a_waiting_entry_as_far_as_the_rate_it_waited_under():
    # The two references differ where entries waited across a fall of the rate: the option does something.
    assert not np.allclose(reference(1, True), reference(1, False), atol=1e-3)


def test_at_a_constant_rate_it_is_the_default_exactly():
    results = []
    for rescale in (True, False):
        variable = keras.Variable(np.zeros(ENTRIES, np.float32))
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.3, momentum=0.9), density=0.01,
                                          density_warmup_steps=0, min_size=1,
                                          config=tf_topk.ExchangeConfig(rescale_residuals=rescale))
        for step in range(4):
            optimizer.apply([tf.constant(gradient(step, 0))], [variable])
        results.append(variable.numpy())
    np.testing.assert_array_equal(*results)


def test_a_non_finite_step_keeps_the_rate_and_the_residuals_as_they_were():
    variable = keras.Variable(np.zeros(ENTRIES, np.float32))
    optimizer = make_optimizer(True)
    optimizer.apply([tf.constant(gradient(0, 0))], [variable])
    memory = optimizer._exchange_object.memory
    before = (memory.last_rate.numpy(), memory.residuals[0].numpy().copy(), variable.numpy().copy())
    bad = gradient(1, 0)
    bad[3] = np.nan
    optimizer.apply([tf.constant(bad)], [variable])
    after = (memory.last_rate.numpy(), memory.residuals[0].numpy(), variable.numpy())
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_the_last_rate_is_saved_and_restored_with_the_residuals(tmp_path):
    variable = keras.Variable(np.zeros(ENTRIES, np.float32))
    optimizer = make_optimizer(True)
    for step in range(3):
        optimizer.apply([tf.constant(gradient(step, 0))], [variable])
    path = tf.train.Checkpoint(optimizer=optimizer, variable=variable).write(str(tmp_path / "ckpt"))
    restored_variable = keras.Variable(np.zeros(ENTRIES, np.float32))
    restored = make_optimizer(True)
    restored.build([restored_variable])
    tf.train.Checkpoint(optimizer=restored, variable=restored_variable).read(path).assert_consumed()
    memory = restored._exchange_object.memory
    assert float(memory.last_rate.numpy()) == 0.5
    for step in range(3, STEPS):  # the run and its resumed copy go on identically
        optimizer.apply([tf.constant(gradient(step, 0))], [variable])
        restored.apply([tf.constant(gradient(step, 0))], [restored_variable])
    np.testing.assert_array_equal(variable.numpy(), restored_variable.numpy())
    np.testing.assert_allclose(variable.numpy(), reference(1, True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"rescale_residuals": "yes"}, "rescale_residuals must be True or False, got 'yes'"),
    ({"rescale_residuals": True, "error_feedback": False}, "rescale_residuals=True rescales the residual"),
    ({"rescale_residuals": True, "momentum": 0.9}, r"rescale_residuals=True is for plain error feedback; momentum"),
    ({"rescale_residuals": True, "decoupled_momentum": True, "density": 0.01},
     "rescale_residuals=True is for plain error feedback; decoupled_momentum"),
])
def test_what_it_cannot_go_with_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tf_topk.ExchangeConfig(**kwargs)


@pytest.mark.parametrize("inner", [keras.optimizers.Adam, keras.optimizers.AdamW])
def test_with_adam_it_keeps_plain_error_feedback_in_place_of_the_decoupled_default(inner):
    variable = keras.Variable(np.zeros(ENTRIES, np.float32))
    optimizer = tf_topk.TopKOptimizer(inner(1e-3), density=0.01, min_size=1,
                                      config=tf_topk.ExchangeConfig(rescale_residuals=True))
    assert optimizer.exchange_config.decoupled_momentum is False
    optimizer.apply([tf.constant(gradient(0, 0))], [variable])
    assert optimizer._exchange_object.memory.follows_learning_rate and np.any(variable.numpy() != 0)


def test_an_exchange_called_without_the_rate_says_what_it_needs():
    variable = tf.Variable(tf.zeros([ENTRIES]))
    exchange = tf_topk.SparseExchange([variable], density=0.01, min_size=1, density_warmup_steps=0,
                                      config=tf_topk.ExchangeConfig(rescale_residuals=True))
    with pytest.raises(ValueError, match=r"rescale_residuals=True follows the learning rate: .*learning_rate="):
        exchange([tf.ones([ENTRIES])])
    result = exchange([tf.ones([ENTRIES])], learning_rate=0.1)
    assert int(tf.math.count_nonzero(result.grads[0])) == 2


def test_the_config_round_trips_and_an_older_one_loads_without_it():
    config = tf_topk.ExchangeConfig(density=0.01, rescale_residuals=True)
    assert tf_topk.ExchangeConfig.from_config(config.get_config()) == config
    older = config.get_config()
    del older["rescale_residuals"]
    assert tf_topk.ExchangeConfig.from_config(older).rescale_residuals is False
