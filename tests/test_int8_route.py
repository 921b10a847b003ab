"""`exchange_mode="allgather_int8"` (`tf_topk.routes.Int8AllGatherRoute`): pairs in one 32-bit word each.

The 8-bit grid (its exponent exact, its own fixed point, float32's extremes), the words' round trip,
a numpy reference of the update on one and two replicas, the bytes counted, the default for AdamW
(decoupled momentum) on two replicas with the variables the same on both, and what it refuses by
name. The matrix of modes x outputs x memories x layouts is in tests/test_exchange_matrix.py.
"""

import functools
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from logical_cpus import mirrored_on_cpus, split_cpu, strategy_for, summed_over_replicas, train_variable
from selection_reference import on_grid

split_cpu()  # before TensorFlow starts: the two-replica tests skip without it

import tf_topk  # noqa: E402
from tf_topk.routes import Bucket, Int8AllGatherRoute, packed  # noqa: E402

ENTRIES, DENSITY, STEPS = 300, 0.02, 4  # k = 6


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 8_600_000)


def gradient(step, replica):
    return np.random.default_rng(20 * step + replica).normal(0.0, 1.0, ENTRIES).astype(np.float32)


def reference(replicas, k, rounded=True):
    """The variable after STEPS steps of SGD(1.0): per replica, gradient + residual, its k largest
    magnitudes rounded to their grid and sent, the rest (and the rounding error) kept."""
    variable = np.zeros(ENTRIES, np.float32)
    residuals = [np.zeros(ENTRIES, np.float32) for _ in range(replicas)]
    for step in range(STEPS):
        total = np.zeros(ENTRIES, np.float32)
        for replica in range(replicas):
            waiting = gradient(step, replica) + residuals[replica]
            chosen = np.argsort(-np.abs(waiting))[:k]
            sent = on_grid(waiting[chosen]) if rounded else waiting[chosen]
            total[chosen] += sent
            residuals[replica] = waiting
            residuals[replica][chosen] -= sent
        variable -= total
    return variable


def make_optimizer(exchange_mode="allgather_int8"):
    return tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), density=DENSITY, density_warmup_steps=0, min_size=1,
                                 method="exact", exchange_mode=exchange_mode)


@pytest.mark.parametrize("replicas", [1, 2], ids=["one device", "two replicas"])
def test_the_update_is_the_numpy_reference_of_rounded_values(replicas):
    optimizer = make_optimizer()
    strategy = strategy_for(replicas, two_replicas)
    trained = train_variable(strategy, lambda: optimizer, gradient, replicas, ENTRIES, STEPS)[-1]
    k = int(np.ceil(DENSITY * ENTRIES))
    np.testing.assert_allclose(trained, reference(replicas, k), rtol=0, atol=1e-6)
    # The rounding did something, and it stayed in the residuals: nothing computed was lost.
    assert not np.allclose(reference(replicas, k), reference(replicas, k, rounded=False), atol=1e-4)
    kept = summed_over_replicas(strategy, optimizer.residuals[0])
    total = sum(gradient(step, r) for step in range(STEPS) for r in range(replicas))
    np.testing.assert_allclose(kept - trained, total, atol=1e-4)


def test_it_sends_half_the_bytes_of_all_gather_for_the_same_pairs():
    stats = {}
    for mode in ("allgather", "allgather_int8"):
        optimizer = make_optimizer(mode)
        train_variable(strategy_for(2, two_replicas), lambda: optimizer, gradient, 2, ENTRIES, 1)
        stats[mode] = optimizer.compression_stats()
    pairs = stats["allgather"]["selected"]
    assert stats["allgather_int8"]["selected"] == pairs == 6
    # (P - 1) * 8k against (P - 1) * (4k + 4 per member), beside the same carried scalars.
    assert stats["allgather"]["bytes_sent"] - stats["allgather_int8"]["bytes_sent"] == 8 * pairs - (4 * pairs + 4)
    assert stats["allgather_int8"]["exchange_mode"] == Int8AllGatherRoute.code


@pytest.mark.parametrize("scale", [1.0, 1e-3, 3e4, 1e-38, 1e-44, 1e37])
def test_the_grid_is_exact_and_its_own_fixed_point(scale):
    values = tf.constant((np.random.default_rng(1).normal(size=64) * scale).astype(np.float32))
    rounded = packed.rounded_to_grid(values)
    if scale > 1e-37:  # TensorFlow's CPU kernels flush float32's subnormals to zero, numpy does not
        np.testing.assert_array_equal(rounded.numpy(), on_grid(values.numpy()))
    np.testing.assert_array_equal(packed.rounded_to_grid(rounded).numpy(), rounded.numpy())
    exponent = packed.value_exponent(values)
    codes = packed.value_codes(values, exponent).numpy()
    assert np.max(np.abs(codes)) <= 127
    if scale > 1e-37:  # the smallest step that still needs all 8 bits of the largest value
        assert np.max(np.abs(codes)) >= 64
    np.testing.assert_array_equal(packed.decoded(codes, exponent).numpy(), rounded.numpy())


def test_zeros_and_non_finite_values():
    assert int(packed.value_exponent(tf.zeros([5]))) == 0
    np.testing.assert_array_equal(packed.rounded_to_grid(tf.zeros([5])).numpy(), np.zeros(5))
    values = tf.constant([np.nan, 1.0, -np.inf, 0.5], tf.float32)
    rounded = packed.rounded_to_grid(values).numpy()
    assert np.isnan(rounded[0]) and rounded[2] == -np.inf  # the step is skipped on every replica
    np.testing.assert_array_equal(rounded[[1, 3]], [1.0, 0.5])  # the finite ones' grid ignores the others


def test_the_words_round_trip_every_index_and_code():
    indices = tf.constant([0, 1, 255, 256, (1 << 23) + 5, (1 << 24) - 1], tf.int32)
    codes = tf.constant([-127, -1, 0, 1, 64, 127], tf.int32)
    back_indices, back_codes = packed.unpack(packed.pack(indices, codes))
    np.testing.assert_array_equal(back_indices.numpy(), indices.numpy())
    np.testing.assert_array_equal(back_codes.numpy(), codes.numpy())


def test_a_bucket_beyond_24_bits_of_index_is_refused_by_name():
    size = (1 << 24) + 1
    bucket = Bucket(positions=[0], slots=[0], sizes=[size], offsets=[0], size=size, ks=[17], shapes=[[size]],
                    dtypes=[tf.float32], max_pairs=17)
    with pytest.raises(ValueError, match=r"exchange_mode='allgather_int8' packs an index in 24 bits.*"
                                         r"holds 16,777,217 .*lower bucket_bytes"):
        Int8AllGatherRoute().select(bucket, None, None, None, None)


def test_buckets_split_at_24_bits_of_index_and_a_larger_variable_takes_8_byte_pairs(capsys):
    """Two variables of 9M entries (the docs' embedding recipe) fill two buckets by themselves, where one
    bucket failed at the first step; a variable beyond 2**24 entries travels alone as 8-byte pairs, and
    the chief says so."""
    halves = [tf.Variable(tf.zeros([9_000_000]), name=f"table_{i}") for i in range(2)]
    exchange = tf_topk.SparseExchange(halves, density=0.002, exchange_mode="allgather_int8", density_warmup_steps=0)
    assert exchange.num_buckets == 2
    rng = np.random.default_rng(0)
    result = exchange([tf.constant(rng.normal(size=9_000_000).astype(np.float32)) for _ in halves])
    assert int(np.count_nonzero(result.grads[0].numpy())) == 18_000
    assert float(result.stats["exchange_mode"]) == Int8AllGatherRoute.code
    large = tf.Variable(tf.zeros([(1 << 24) + 1]), name="large")
    small = tf.Variable(tf.zeros([5000]), name="small")
    exchange = tf_topk.SparseExchange([small, large], density=0.002, exchange_mode="allgather_int8",
                                      density_warmup_steps=0)
    assert exchange.num_buckets == 2
    assert "large has 16,777,217 entries, more than exchange_mode='allgather_int8' indexes in 24 bits" in \
        capsys.readouterr().err
    result = exchange([tf.constant(rng.normal(size=5000).astype(np.float32)),
                       tf.constant(rng.normal(size=(1 << 24) + 1).astype(np.float32))])
    assert int(np.count_nonzero(result.grads[1].numpy())) == math.ceil(0.002 * ((1 << 24) + 1))
    assert float(result.stats["exchange_mode"]) == (Int8AllGatherRoute.code + 1.0) / 2  # int8 and all_gather


def test_adams_momentum_correction_is_refused_by_name():
    with pytest.raises(ValueError, match=r"exchange_mode='allgather_int8' rounds what is sent to 8 bits.*"
                                         r"momentum correction \(beta_2"):
        tf_topk.ExchangeConfig(density=0.01, momentum=0.9, beta_2=0.999, exchange_mode="allgather_int8")


def test_the_mode_round_trips_through_the_optimizers_config():
    restored = tf_topk.TopKOptimizer.from_config(make_optimizer().get_config())
    assert restored.exchange_mode == "allgather_int8"


def fit_on_two_replicas(exchange_mode):
    """(the optimizer, the loss of each epoch, the model) of a linear fit by AdamW's default at 0.002 (decoupled
    momentum) on two replicas."""
    strategy = strategy_for(2, two_replicas)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 32)).astype(np.float32)
    y = (x @ rng.normal(size=(32, 200))).astype(np.float32)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(200)])  # a 6,400-entry kernel
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.05), density=0.002, min_size=1000,
                                          density_warmup_steps=0, exchange_mode=exchange_mode)
        model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=64, epochs=12, verbose=0)
    return optimizer, history.history["loss"], model


def test_adamws_default_method_trains_on_two_replicas_as_all_gather_does_with_the_variables_the_same():
    optimizer, losses, model = fit_on_two_replicas("allgather_int8")
    _, gathered, _ = fit_on_two_replicas("allgather")
    assert type(optimizer.exchange.memory).__name__ == "DecoupledMomentumMemory"
    assert losses[-1] < 0.8 * losses[0] and gathered[-1] < 0.8 * gathered[0]
    assert abs(losses[-1] - gathered[-1]) < 0.1 * gathered[-1]
    for variable in model.trainable_variables:
        first, second = (local.numpy() for local in two_replicas().experimental_local_results(variable.value))
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("exchange_mode, density, chosen", [
    ("allgather_int8", 0.02, True),   # the bytes of 0.01 in 8-byte pairs: the thresholds' own
    ("allgather_int8", 0.03, False),
    ("allgather", 0.02, False),
    ("allgather", 0.01, True),
])
def test_the_auto_thresholds_are_held_in_8_byte_pairs_bytes(exchange_mode, density, chosen):
    """Decoupled momentum for AdamW and the density warm-up, both "auto", at DECOUPLED_UP_TO_DENSITY and
    WARMUP_UP_TO_DENSITY (0.01) of 8-byte pairs: twice the density where a pair takes 4 bytes."""
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), density=density, min_size=100,
                                      exchange_mode=exchange_mode)
    optimizer.build([keras.Variable(np.zeros((20, 20), np.float32))])
    assert optimizer.decoupled_momentum is chosen
    assert optimizer.exchange_config.density_warmup_taken == (400 if chosen else 0)


@pytest.mark.parametrize("units", [4, 300], ids=["every variable below min_size", "a sparsified kernel"])
def test_no_density_given_takes_the_fixed_default_on_two_replicas(units):
    """exchange_mode other than "auto" and no density: the fixed 0.001 (decoupled momentum for AdamW), on a
    model whose variables are all on the dense path as on one with a kernel on this route."""
    strategy = strategy_for(2, two_replicas)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(64, units)).astype(np.float32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(units)])
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), exchange_mode="allgather_int8")
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert optimizer.exchange_config.schedule.settled_density() == 0.001
    assert optimizer.decoupled_momentum is True  # as a stated density=0.001 takes it
    assert optimizer.compression_stats()["exchange_mode"] == (Int8AllGatherRoute.code if units == 300 else 0.0)
    for variable in model.trainable_variables:
        first, second = (local.numpy() for local in strategy.experimental_local_results(variable.value))
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("dtype", [tf.float64, tf.float16, tf.bfloat16])
def test_variables_of_other_float_dtypes_send_their_grid(dtype):
    """A sparsified float64, float16 or bfloat16 variable: its k largest, rounded to their grid, come back in
    its dtype, and the rest with the rounding error stays in its residual."""
    variable = tf.Variable(tf.zeros([ENTRIES], dtype))
    exchange = tf_topk.SparseExchange([variable], density=DENSITY, min_size=1, method="exact",
                                      exchange_mode="allgather_int8", density_warmup_steps=0)
    grad = tf.cast(gradient(0, 0), dtype)
    sent = exchange([grad]).grads[0]
    flat = grad.numpy().astype(np.float32)
    chosen = np.argsort(-np.abs(flat))[:6]
    expected = np.zeros(ENTRIES, np.float32)
    expected[chosen] = on_grid(flat[chosen])
    assert sent.dtype == dtype
    np.testing.assert_array_equal(sent.numpy().astype(np.float32), expected)
    np.testing.assert_allclose(exchange.residuals[0].numpy().astype(np.float32), flat - expected, atol=1e-2)
