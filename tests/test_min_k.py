"""`ExchangeConfig(min_k=...)`: a floor under each sparsified variable's k. A numpy reference of the
update on one and two replicas (all_gather), the floor under a warm-up's schedule and on the agreed-index
route, a floor beyond the variable's size, the pairs buckets are sized for, what it refuses, and the floor
with the options it meets (decoupled momentum, sparse updates, the bucket's selection, momentum correction)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from logical_cpus import mirrored_on_cpus, split_cpu, strategy_for, train_variable

split_cpu()  # before TensorFlow starts: the two-replica tests skip without it

import tf_topk  # noqa: E402

ENTRIES, DENSITY, MIN_K, STEPS = 200, 0.005, 3, 4  # k = ceil(0.005 * 200) = 1, floored to 3


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 8_100_000)


def gradient(step, replica):
    return np.random.default_rng(10 * step + replica).normal(0.0, 1.0, ENTRIES).astype(np.float32)


def reference(replicas, k):
    """The variable after STEPS steps of SGD(1.0): per replica, gradient + residual, its k largest
    magnitudes sent, the rest kept; the sum of what was sent applied."""
    variable = np.zeros(ENTRIES, np.float64)
    residuals = [np.zeros(ENTRIES, np.float64) for _ in range(replicas)]
    for step in range(STEPS):
        for replica in range(replicas):
            waiting = gradient(step, replica) + residuals[replica]
            chosen = np.argsort(-np.abs(waiting))[:k]
            variable[chosen] -= waiting[chosen]
            residuals[replica] = waiting
            residuals[replica][chosen] = 0.0
    return variable


def make_optimizer(min_k, density=DENSITY, exchange_mode="allgather"):
    return tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), density=density, density_warmup_steps=0,
                                 min_size=1, method="exact", exchange_mode=exchange_mode,
                                 config=tf_topk.ExchangeConfig(min_k=min_k))


def train(replicas, optimizer, steps=STEPS):
    """The variable after each step (a list of arrays), trained by `optimizer` on `replicas`."""
    strategy = strategy_for(replicas, two_replicas)
    return train_variable(strategy, lambda: optimizer, gradient, replicas, ENTRIES, steps)


def entries_moved(after):
    """How many entries each step moved."""
    before = [np.zeros(ENTRIES, np.float32)] + after[:-1]
    return [int(np.count_nonzero(a != b)) for a, b in zip(after, before)]


@pytest.mark.parametrize("replicas", [1, 2], ids=["one device", "two replicas"])
def test_the_update_is_the_numpy_reference_with_k_floored(replicas):
    trained = train(replicas, make_optimizer(MIN_K))[-1]
    np.testing.assert_allclose(trained, reference(replicas, MIN_K), rtol=1e-5, atol=1e-5)
    # The floor did something: without it each replica sends one entry a step.
    assert not np.allclose(reference(replicas, MIN_K), reference(replicas, 1), atol=1e-3)
    np.testing.assert_allclose(train(replicas, make_optimizer(1))[-1], reference(replicas, 1), rtol=1e-5, atol=1e-5)


def test_the_agreed_index_route_sends_the_floor_on_two_replicas():
    optimizer = make_optimizer(MIN_K, exchange_mode="allreduce")
    assert entries_moved(train(2, optimizer)) == [MIN_K] * STEPS


def test_a_schedule_above_the_floor_keeps_its_k_and_below_it_takes_the_floor():
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), density=[(0, 0.25), (2, DENSITY)], min_size=1,
                                      method="exact", config=tf_topk.ExchangeConfig(min_k=MIN_K))
    assert entries_moved(train(1, optimizer)) == [50, 50, MIN_K, MIN_K]


def test_a_floor_beyond_the_size_sends_every_entry():
    after = train(1, make_optimizer(10**6), steps=1)
    np.testing.assert_allclose(after[0], -gradient(0, 0), rtol=1e-6)


def test_buckets_are_sized_for_the_floor():
    config = tf_topk.ExchangeConfig(density=0.001, min_k=32, density_warmup_steps=0)
    assert (config.max_pairs(6400), config.settled_pairs(6400), config.max_pairs(20)) == (32, 32, 20)
    assert config.replace(density=0.01).max_pairs(6400) == 64
    assert config.replace(min_k=1).max_pairs(6400) == 7
    warming = config.replace(density_warmup_steps=400)  # the warm-up's 0.25 sizes the buckets, its end settles
    assert (warming.max_pairs(6400), warming.settled_pairs(6400)) == (1600, 32)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "4", None])
def test_a_bad_floor_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=f"min_k must be an int >= 1, got {bad!r}"):
        tf_topk.ExchangeConfig(min_k=bad)


def test_an_adaptive_density_or_the_autopilot_is_refused_when_the_exchange_is_made():
    variable = tf.Variable(tf.zeros([ENTRIES]))
    with pytest.raises(ValueError, match=r"min_k=4 is a floor under a scheduled density's k; an adaptive density"):
        tf_topk.SparseExchange([variable], density="adaptive", min_size=1,
                               config=tf_topk.ExchangeConfig(min_k=4))
    model_variable = keras.Variable(np.zeros(ENTRIES, np.float32))
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), min_size=1,  # no density: the autopilot
                                      config=tf_topk.ExchangeConfig(min_k=4))
    with pytest.raises(ValueError, match=r"min_k=4 is a floor .* the autopilot \(the default density\)"):
        optimizer.build([model_variable])


def test_the_config_round_trips_through_the_optimizer_and_an_older_one_loads_without_it():
    optimizer = make_optimizer(MIN_K)
    restored = tf_topk.TopKOptimizer.from_config(optimizer.get_config())
    assert restored.exchange_config.min_k == MIN_K
    older = tf_topk.ExchangeConfig(density=0.01, min_k=8).get_config()
    del older["min_k"]
    assert tf_topk.ExchangeConfig.from_config(older).min_k == 1


@pytest.mark.parametrize("inner, options", [
    (lambda: keras.optimizers.AdamW(1e-3), {}),  # Adam's default at 0.001: decoupled momentum
    (lambda: keras.optimizers.SGD(0.1), {"sparse_updates": True}),
    (lambda: keras.optimizers.SGD(0.1), {"exchange_mode": "allgather", "selection_scope": "bucket"}),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), {"momentum_correction": True}),
], ids=["adamw decoupled momentum", "sparse updates", "selection over the bucket", "momentum correction"])
def test_the_floor_holds_with_the_options_it_meets(inner, options):
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(100)])  # a 6,400-entry kernel, k = 7
    optimizer = tf_topk.TopKOptimizer(inner(), density=0.001, density_warmup_steps=0, min_size=1000,
                                      config=tf_topk.ExchangeConfig(min_k=32), **options)
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.random((16, 64)), rng.random((16, 100)), batch_size=16, verbose=0)
    assert optimizer.compression_stats()["selected"] == 32
