"""`exchange_mode="allgather_chunk"` (`tf_topk.routes.ChunkAllGatherRoute`): each chunk's top entries in 14 bits.

The bit fields' round trip, the per-chunk grid (its own fixed point at every value width, the offset's
reach), a numpy reference of the update on one and two replicas with the rounding kept in the
residuals, the bytes counted, a scheduled density's warm-up, a variable beyond 2**24 entries, the
default for AdamW (decoupled momentum) on two replicas with the variables the same on both, other
float dtypes, and what it refuses by name. The matrix of modes x outputs x memories x layouts is in
tests/test_exchange_matrix.py.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from logical_cpus import mirrored_on_cpus, split_cpu, strategy_for, summed_over_replicas, train_variable
from selection_reference import chunk_sent

split_cpu()  # before TensorFlow starts: the two-replica tests skip without it

import tf_topk  # noqa: E402
from tf_topk.routes import ChunkAllGatherRoute, bitfields, chunked  # noqa: E402
from tf_topk.routes.base import Bucket  # noqa: E402

ENTRIES, DENSITY, STEPS = 9_000, 0.01, 4  # 3 chunks (4096, 4096, 808), k = 90: 30 a chunk


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 8_700_000)


def gradient(step, replica):
    return np.random.default_rng(20 * step + replica).normal(0.0, 1.0, ENTRIES).astype(np.float32)


def reference(replicas, rounded=True):
    """The variable after STEPS steps of SGD(1.0): per replica, gradient + residual, each chunk's top 30
    rounded on the chunk's grid and sent, the rest (and the rounding error) kept."""
    variable = np.zeros(ENTRIES, np.float32)
    residuals = [np.zeros(ENTRIES, np.float32) for _ in range(replicas)]
    k = int(np.ceil(DENSITY * ENTRIES))
    for step in range(STEPS):
        total = np.zeros(ENTRIES, np.float32)
        for replica in range(replicas):
            waiting = gradient(step, replica) + residuals[replica]
            sent = chunk_sent(waiting, k, value_bits=2 if rounded else None)
            total += sent
            residuals[replica] = waiting - sent
        variable -= total
    return variable


def make_optimizer(exchange_mode="allgather_chunk", density=DENSITY):
    return tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), density=density, density_warmup_steps=0, min_size=1,
                                 method="exact", exchange_mode=exchange_mode)


def test_bit_fields_round_trip_across_word_boundaries():
    rng = np.random.default_rng(0)
    for _ in range(10):
        groups = [(int(rng.integers(0, 40)), int(rng.integers(1, bitfields.MAX_WIDTH + 1))) for _ in range(3)]
        fields = [(tf.constant(rng.integers(0, 1 << width, size), tf.int64), width) for size, width in groups]
        words = bitfields.pack(fields)
        assert int(tf.size(words)) == int(bitfields.word_count(groups)) == -(-sum(s * w for s, w in groups) // 32)
        for (values, _), back in zip(fields, bitfields.unpack(tf.stack([words, words]), groups)):
            np.testing.assert_array_equal(back.numpy(), np.stack([values.numpy()] * 2))
    with pytest.raises(ValueError, match=r"a field's width must be 1 to 24 bits, got 25"):
        bitfields.pack([(tf.constant([1]), 25)])


@pytest.mark.parametrize("replicas", [1, 2], ids=["one device", "two replicas"])
def test_the_update_is_the_numpy_reference_of_each_chunks_rounded_top_entries(replicas):
    optimizer = make_optimizer()
    strategy = strategy_for(replicas, two_replicas)
    trained = train_variable(strategy, lambda: optimizer, gradient, replicas, ENTRIES, STEPS)[-1]
    np.testing.assert_allclose(trained, reference(replicas), rtol=0, atol=1e-5)
    # Every chunk sent its share, the last (shorter) one too.
    assert np.count_nonzero(reference(1)[8192:]) > 0
    # The rounding did something, and it stayed in the residuals: nothing computed was lost.
    assert not np.allclose(reference(replicas), reference(replicas, rounded=False), atol=1e-3)
    kept = summed_over_replicas(strategy, optimizer.residuals[0])
    total = sum(gradient(step, r) for step in range(STEPS) for r in range(replicas))
    np.testing.assert_allclose(kept - trained, total, atol=1e-4)


def test_it_sends_14_bits_an_entry_and_4_bits_a_chunk():
    stats = {}
    for mode in ("allgather", "allgather_chunk"):
        optimizer = make_optimizer(mode)
        train_variable(strategy_for(2, two_replicas), lambda: optimizer, gradient, 2, ENTRIES, 1)
        stats[mode] = optimizer.compression_stats()
    assert stats["allgather"]["selected"] == stats["allgather_chunk"]["selected"] == 90
    # (P - 1) * 8k against (P - 1) * (14k / 8 + 4 bits per chunk + 4 bytes per member), beside the same carry.
    assert stats["allgather"]["bytes_sent"] - stats["allgather_chunk"]["bytes_sent"] == \
        8 * 90 - (14 * 90 / 8 + 3 * 4 / 8 + 4)
    assert stats["allgather_chunk"]["exchange_mode"] == ChunkAllGatherRoute.code


@pytest.mark.parametrize("value_bits", chunked.VALUE_BITS)
@pytest.mark.parametrize("scale", [1.0, 1e-3, 3e4, 1e-30, 1e37])
def test_the_chunk_grid_is_its_own_fixed_point(value_bits, scale):
    """Rounded values give back their exponents and codes (what `send` rebuilds from `select`'s values),
    codes within the width's levels, and the numpy reference's values."""
    rng = np.random.default_rng(value_bits)
    values = (rng.normal(size=(3, 40)) * scale).astype(np.float32)
    values[1] *= 1e-3  # a chunk well below the member's largest: its own grid, through the offset
    levels = 2 ** (value_bits - 1) - 1
    member, offsets, codes = chunked.grid(tf.constant(values), levels)
    rounded = chunked.decoded(codes, tf.expand_dims(member - offsets, 1))
    again = chunked.grid(rounded, levels)
    np.testing.assert_array_equal(again[2].numpy(), codes.numpy())
    assert int(again[0]) == int(member)
    np.testing.assert_array_equal(again[1].numpy(), offsets.numpy())
    assert np.abs(codes.numpy()).max() <= levels and 0 < offsets.numpy()[1] <= chunked.MAX_OFFSET
    np.testing.assert_array_equal(rounded.numpy().reshape(-1),
                                  chunk_sent(values.reshape(-1), values.size, value_bits, chunk=40))


def test_a_chunk_far_below_its_member_is_rounded_on_the_coarsest_grid_and_stays_in_the_residual():
    values = tf.constant([[1.0, -0.9, 0.8], [2.0**-20, 2.0**-21, -2.0**-19]], tf.float32)
    member, offsets, codes = chunked.grid(values, 1)
    assert int(member) == 0 and offsets.numpy().tolist() == [0, chunked.MAX_OFFSET]
    np.testing.assert_array_equal(codes.numpy()[1], [0, 0, 0])  # 2**-19 rounds to 0 on 2**-15: kept, not sent


def test_zeros_and_non_finite_values():
    member, offsets, codes = chunked.grid(tf.zeros([2, 4]), 1)
    assert int(member) == chunked.MIN_EXPONENT and not np.any(codes.numpy())
    values = tf.constant([[np.nan, 1.0, -np.inf, 0.5]], tf.float32)
    member, offsets, codes = chunked.grid(values, 7)
    assert codes.numpy().tolist() == [[0, 4, 0, 2]]  # 1 fits 7 steps of 2**-2: the finite ones' grid


def test_the_density_is_the_share_of_entries_each_chunk_sends():
    assert int(chunked.chunk_k(90, 9_000)) == 30
    assert int(chunked.chunk_k(12_583, 12_582_912)) == 4  # 0.001 of 3,072 chunks: 4 of each 4,096
    assert int(chunked.chunk_k(1, 100_000)) == 1  # at least one a chunk
    assert int(chunked.chunk_k(5_000, 300)) == 300  # at most a chunk's length
    assert chunked.chunks_of(300) == (300, 1) and chunked.chunks_of(8193) == (4096, 3)


def test_a_scheduled_density_sends_each_chunk_its_share_at_every_step():
    """The density warm-up (k a tensor): each step's k spread over the chunks, through one traced step."""
    variable = tf.Variable(tf.zeros([ENTRIES]))
    exchange = tf_topk.SparseExchange([variable], density=0.01, density_warmup_steps=8, min_size=1,
                                      exchange_mode="allgather_chunk")
    step = tf.function(lambda g, s: exchange([g], step=s).grads[0])
    rng = np.random.default_rng(3)
    counts = []
    for s in (0, 7, 8):
        sent = step(tf.constant(rng.normal(size=ENTRIES).astype(np.float32)), tf.constant(s, tf.int64)).numpy()
        counts.append([np.count_nonzero(sent[i:i + 4096]) for i in (0, 4096, 8192)])
    # 0.25 of every chunk at first (1,024 slots; the last chunk has only 808 entries), 0.01 (41 slots)
    # after the warm-up; the 2-bit grid keeps in the residual what is below half the chunk's typical size.
    assert counts[0][0] > 600 and counts[0][2] > 100 and counts[1][0] < 0.03 * 4096
    assert all(15 <= c <= 30 for c in counts[2]), counts


def test_a_variable_beyond_2_to_the_24_entries_takes_it():
    size = (1 << 24) + 5_000
    variable = tf.Variable(tf.zeros([size]), name="large")
    exchange = tf_topk.SparseExchange([variable], density=0.001, exchange_mode="allgather_chunk",
                                      density_warmup_steps=0)
    grad = np.random.default_rng(0).normal(size=size).astype(np.float32)
    grad[-3:] = 50.0  # the last chunk's largest, far beyond 2**24: sent at their own index
    sent = exchange([tf.constant(grad)]).grads[0].numpy()
    assert float(exchange.config.schedule.settled_density()) == 0.001
    assert np.all(sent[-3:] > 0) and 4_000 <= np.count_nonzero(sent) <= 4 * 4_098
    assert float(exchange([tf.constant(grad)]).stats["exchange_mode"]) == ChunkAllGatherRoute.code


def test_bad_value_bits_adams_momentum_correction_and_an_adaptive_density_are_refused_by_name():
    with pytest.raises(ValueError, match=r"value_bits must be one of \(2, 3, 4, 8\), got 5"):
        ChunkAllGatherRoute(value_bits=5)
    with pytest.raises(ValueError, match=r"exchange_mode='allgather_chunk' rounds what is sent to a few bits.*"
                                         r"momentum correction \(beta_2"):
        tf_topk.ExchangeConfig(density=0.01, momentum=0.9, beta_2=0.999, exchange_mode="allgather_chunk")
    with pytest.raises(ValueError, match=r"exchange_mode='allgather_chunk' selects a share of every chunk, and an "
                                         r"adaptive density"):
        tf_topk.ExchangeConfig(density=tf_topk.schedule.AdaptiveDensity(bandwidth_bytes_per_s=1.25e7),
                               exchange_mode="allgather_chunk")


def test_the_mode_round_trips_through_the_optimizers_config():
    restored = tf_topk.TopKOptimizer.from_config(make_optimizer().get_config())
    assert restored.exchange_mode == "allgather_chunk"


def fit_on_two_replicas(exchange_mode, density):
    """(the optimizer, the loss of each epoch, the model) of a linear fit by AdamW's default (decoupled
    momentum) on two replicas."""
    strategy = strategy_for(2, two_replicas)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 32)).astype(np.float32)
    y = (x @ rng.normal(size=(32, 200))).astype(np.float32)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(200)])  # a 6,400-entry kernel
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.05), density=density, min_size=1000,
                                          density_warmup_steps=0, exchange_mode=exchange_mode)
        model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=64, epochs=12, verbose=0)
    return optimizer, history.history["loss"], model


def test_adamws_default_method_trains_on_two_replicas_at_all_gathers_bytes_with_the_variables_the_same():
    optimizer, losses, model = fit_on_two_replicas("allgather_chunk", 0.01)
    _, gathered, _ = fit_on_two_replicas("allgather", 0.002)
    assert type(optimizer.exchange.memory).__name__ == "DecoupledMomentumMemory"
    assert losses[-1] < 0.8 * losses[0] and gathered[-1] < 0.8 * gathered[0]
    assert losses[-1] < 1.1 * gathered[-1]
    for variable in model.trainable_variables:
        first, second = (local.numpy() for local in two_replicas().experimental_local_results(variable.value))
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("clipping", [{}, {"global_clipnorm": 1.0}], ids=["unclipped", "global_clipnorm"])
def test_no_density_given_gives_adamw_decoupled_momentum_at_the_fixed_default_on_two_replicas(clipping):
    """A fixed route and no density runs FIXED_DEFAULT_DENSITY (0.001), and AdamW takes there what a stated
    density=0.001 takes: decoupled momentum, not top-k in front of it (clipped or not)."""
    strategy = strategy_for(2, two_replicas)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(64, 300)).astype(np.float32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(300)])
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3, **clipping), min_size=1000,
                                          exchange_mode="allgather_chunk")
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert optimizer.exchange_config.schedule.settled_density() == 0.001
    assert optimizer.decoupled_momentum is True
    assert type(optimizer.exchange.memory).__name__ == "DecoupledMomentumMemory"
    for variable in model.trainable_variables:
        first, second = (local.numpy() for local in two_replicas().experimental_local_results(variable.value))
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("density, chosen", [(0.045, True), (0.05, False)])
def test_the_auto_thresholds_are_held_in_8_byte_pairs_bytes(density, chosen):
    """Decoupled momentum for AdamW and the density warm-up, both "auto", up to 0.01 of 8-byte pairs'
    bytes: 0.01 * 64 / 14 (0.0457) of 14-bit entries."""
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), density=density, min_size=100,
                                      exchange_mode="allgather_chunk")
    optimizer.build([keras.Variable(np.zeros((20, 20), np.float32))])
    assert optimizer.decoupled_momentum is chosen
    assert optimizer.exchange_config.density_warmup_taken == (400 if chosen else 0)


@pytest.mark.parametrize("dtype", [tf.float64, tf.float16, tf.bfloat16])
def test_variables_of_other_float_dtypes_send_their_grid(dtype):
    """A sparsified float64, float16 or bfloat16 variable: each chunk's top entries, rounded on the chunk's
    grid, come back in its dtype, and the rest with the rounding error stays in its residual."""
    variable = tf.Variable(tf.zeros([ENTRIES], dtype))
    exchange = tf_topk.SparseExchange([variable], density=DENSITY, min_size=1, exchange_mode="allgather_chunk",
                                      density_warmup_steps=0)
    grad = tf.cast(gradient(0, 0), dtype)
    sent = exchange([grad]).grads[0]
    flat = grad.numpy().astype(np.float32)
    expected = chunk_sent(flat, 90)
    assert sent.dtype == dtype
    np.testing.assert_array_equal(sent.numpy().astype(np.float32), expected)
    np.testing.assert_allclose(exchange.residuals[0].numpy().astype(np.float32), flat - expected, atol=1e-2)


def test_the_graph_selection_for_gpus_matches_the_cpu_op():
    """Where the selection runs on a GPU (here: a GPU device scope, which soft placement runs on the CPU),
    TensorFlow's top_k over the chunks selects: the same sum and residual as the CPU's op."""
    results = []
    for device in (None, "/device:GPU:0"):
        variable = tf.Variable(tf.zeros([ENTRIES]))
        exchange = tf_topk.SparseExchange([variable], density=DENSITY, min_size=1, exchange_mode="allgather_chunk",
                                          density_warmup_steps=0)

        @tf.function
        def step(grad):
            if device is None:
                return exchange([grad]).grads[0]
            with tf.device(device):
                assert not chunked._selects_on_cpu()
                return exchange([grad]).grads[0]

        sent = [step(tf.constant(gradient(s, 0))).numpy() for s in range(2)]
        results.append((sent, exchange.residuals[0].numpy()))
    for first, second in zip(results[0][0] + [results[0][1]], results[1][0] + [results[1][1]]):
        np.testing.assert_array_equal(first, second)
    assert chunked._selects_on_cpu()


@pytest.mark.parametrize("value_bits", chunked.VALUE_BITS)
def test_the_cpus_wire_ops_write_and_read_the_graphs_words(value_bits):
    """`send` on a CPU packs and unpacks in two ops (`ops.chunk_pack`, `ops.chunk_unpack`), on a GPU in the
    graph (`_words`, `_read`): the same words bit for bit, read back the same from three replicas' rows."""
    from test_ops import rounded_bucket

    route = ChunkAllGatherRoute(value_bits)
    rows = []
    for replica in range(3):
        values, indices, lengths, sizes, starts = rounded_bucket(value_bits, seed=replica)
        bucket = Bucket(positions=None, slots=None, sizes=sizes, offsets=starts, size=sum(sizes), ks=None,
                        shapes=None, dtypes=None, max_pairs=None)
        layout = dict(sizes=sizes, starts=starts, chunk=chunked.CHUNK, value_bits=value_bits)
        words = tf_topk.ops.chunk_pack(values, indices, lengths, **layout)
        np.testing.assert_array_equal(tf.bitcast(words, tf.int32).numpy(),
                                      tf.bitcast(route._words(bucket, values, indices, lengths), tf.int32).numpy())
        rows.append(words)
    rows = tf.stack(rows)
    for from_ops, from_graph in zip(tf_topk.ops.chunk_unpack(rows, lengths, **layout),
                                    route._read(bucket, rows, lengths)):
        np.testing.assert_array_equal(from_ops.numpy(), from_graph.numpy())


def test_the_graphs_grid_stops_at_float32s_largest_power_of_two():
    """As the op's (tests/test_ops.py): a mean magnitude beyond 2**127.5 takes the grid 2**127."""
    assert chunked.chunk_exponents(tf.constant([[3.0e38, 3.0e38], [1.0, 3.0]], tf.float64), 1).numpy().tolist() \
        == [127, 1]
