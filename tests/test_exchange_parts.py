"""The exchange's three parts, each on its own: selector, memory, route.

And the promise of the split: a new selector or memory is a small class
passed to SparseExchange, with no change to the exchange.
"""

import os
import subprocess
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from multiworker import PYTHON, subprocess_env
import tf_topk
from tf_topk.memory import Compensation, ErrorFeedbackMemory, NoMemory, make_state_variable
from tf_topk.routes import (DENSE_CARRY_BYTES, AllGatherRoute, Bucket, carry_in_gather, gather_bytes,
                            ring_all_reduce_bytes)
from tf_topk.selector import ChunkTopKSelector, RandomKSelector, Selector, TopKSelector

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def numpy_top_k(flat, k):
    """`flat` with all but its k largest |x| zeroed."""
    kept = np.zeros_like(flat)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    kept[keep] = flat[keep]
    return kept


def scatter(values, indices, size):
    dense = np.zeros(size, np.asarray(values).dtype)
    np.add.at(dense, np.asarray(indices), np.asarray(values))
    return dense


# -- selector -------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 17, 500, 4000])
def test_top_k_selector_exact_matches_numpy(k):
    flat = np.random.default_rng(k).standard_normal(4000).astype(np.float32)
    values, indices = TopKSelector("exact").select(tf.constant(flat), k)
    np.testing.assert_array_equal(scatter(values.numpy(), indices.numpy(), flat.size), numpy_top_k(flat, k))


def test_top_k_selector_refuses_an_unknown_method():
    with pytest.raises(ValueError, match=r"method must be one of .*'median'"):
        TopKSelector("median")


def test_random_k_selector_picks_k_distinct_entries_spread_over_the_tensor():
    n, k = 10_000, 100
    flat = tf.range(1, n + 1, dtype=tf.float32)  # the top k would be the last k
    tf.random.set_seed(0)
    values, indices = RandomKSelector().select(flat, k)
    chosen = indices.numpy()
    assert len(set(chosen.tolist())) == k
    np.testing.assert_array_equal(values.numpy(), flat.numpy()[chosen])
    assert chosen.min() < n - k and 0.25 * n < np.median(chosen) < 0.75 * n


def test_chunk_top_k_selector_takes_the_largest_of_each_chunks_largest():
    n, k, chunk = 10_000, 10, 1000  # ten chunks, one entry each
    flat = tf.range(1, n + 1, dtype=tf.float32) * tf.where(tf.range(n) % 2 == 0, 1.0, -1.0)
    values, indices = ChunkTopKSelector(chunk).select(flat, tf.constant(k))
    chosen = np.sort(indices.numpy())
    np.testing.assert_array_equal(chosen, np.arange(chunk - 1, n, chunk))  # each chunk's largest magnitude
    np.testing.assert_array_equal(np.sort(np.abs(values.numpy())), np.abs(flat.numpy()[chosen]))
    # k above the chunks: ceil(k / chunks) offered per chunk, the k largest of them sent, each entry once.
    values, indices = ChunkTopKSelector(chunk).select(flat, 15)
    assert len(set(indices.numpy().tolist())) == 15 and np.all(np.abs(values.numpy()) >= 998)
    # A last chunk shorter than the others is padded with zeros that are never sent over a real entry.
    values, indices = ChunkTopKSelector(3).select(tf.constant([1.0, 5.0, 2.0, -4.0]), 2)
    assert sorted(indices.numpy().tolist()) == [1, 3] and sorted(values.numpy().tolist()) == [-4.0, 5.0]


@pytest.mark.parametrize("chunk", [0, -4, 2.5, True, "1024"])
def test_chunk_top_k_selector_refuses_a_bad_chunk(chunk):
    with pytest.raises(ValueError, match=f"chunk must be an int >= 1, got {chunk!r}"):
        ChunkTopKSelector(chunk)


def test_chunk_top_k_selector_in_the_exchange_keeps_what_it_does_not_send():
    variable = tf.Variable(tf.zeros([4000]))
    exchange = tf_topk.SparseExchange([variable], density=0.001, min_size=1, density_warmup_steps=0,
                                      selector=ChunkTopKSelector(1000))
    grad = tf.random.stateless_normal([4000], seed=[1, 2])
    result = exchange([grad])
    sent = tf.math.count_nonzero(result.grads[0]).numpy()
    assert sent == 4 and sorted(set(np.flatnonzero(result.grads[0].numpy()) // 1000)) == [0, 1, 2, 3]
    np.testing.assert_allclose(exchange.memory.residuals[0].numpy() + result.grads[0].numpy(), grad.numpy(), rtol=1e-6)


# -- memory ---------------------------------------------------------------------------------

def test_error_feedback_memory_over_several_steps():
    """Residual = what was not sent, carried from step to step; a step that
    is not kept (non-finite) leaves it as it was."""
    variable = tf.Variable(tf.zeros([6, 50]))
    memory = ErrorFeedbackMemory()
    memory.build([variable], make_state_variable)
    (residual,) = memory.state_variables
    assert residual.dtype == tf.float32 and residual.shape == variable.shape
    rng = np.random.default_rng(1)
    expected = np.zeros(300, np.float32)
    k = 30
    for step in range(4):
        grad = rng.standard_normal((6, 50)).astype(np.float32)
        compensation = memory.compensate(0, tf.constant(grad))
        selection = tf_topk.error_feedback_topk(compensation.gradient, compensation.residual, k, method="exact")
        accumulated = grad.reshape(-1) + expected
        np.testing.assert_allclose(selection.remaining.numpy(), accumulated - numpy_top_k(accumulated, k),
                                   rtol=1e-6)
        if step != 2:  # step 2: as if a replica had a NaN: the exchange does not call update
            memory.update(0, compensation, selection.remaining, selection.values, selection.indices)
            expected = accumulated - numpy_top_k(accumulated, k)
        np.testing.assert_allclose(residual.numpy().reshape(-1), expected, rtol=1e-6)


def test_error_feedback_memory_keeps_float64_and_refuses_a_wrong_residual_count():
    memory = ErrorFeedbackMemory()
    memory.build([tf.Variable(tf.zeros([8], tf.float64)), tf.Variable(tf.zeros([8], tf.float16))],
                 make_state_variable)
    assert [r.dtype for r in memory.state_variables] == [tf.float64, tf.float32]
    with pytest.raises(ValueError, match="one variable per sparsified variable"):
        ErrorFeedbackMemory([tf.Variable(tf.zeros([8]))]).build([], make_state_variable)


def test_no_memory_keeps_nothing():
    memory = NoMemory()
    memory.build([tf.Variable(tf.zeros([10]))], make_state_variable)
    assert memory.state_variables == [] and not memory.keeps_unsent
    compensation = memory.compensate(0, tf.constant(np.arange(10, dtype=np.float32)))
    np.testing.assert_array_equal(compensation.residual.numpy(), np.zeros(10, np.float32))
    selection = tf_topk.error_feedback_topk(compensation.gradient, compensation.residual, 1)
    np.testing.assert_array_equal(selection.remaining.numpy(), np.r_[np.arange(9), 0].astype(np.float32))
    memory.update(0, compensation, selection.remaining, selection.values, selection.indices)  # keeps nothing
    assert memory.state_variables == []


# -- route ------------------------------------------------------------------------------------

def one_variable_bucket(size, k):
    return Bucket([0], [0], [size], [0], size, [k], [tf.TensorShape([size])], [tf.float32], k)


def test_all_gather_route_with_one_replica_scatters_locally():
    context = tf.distribute.get_replica_context()
    (dense,), carried = AllGatherRoute().send(context, one_variable_bucket(6, 3), tf.constant([2.0, 0.0, -1.0]),
                                              tf.constant([4, 0, 1]), [tf.constant(3)], None, sparse_output=False)
    np.testing.assert_array_equal(dense.numpy(), [0, -1, 0, 0, 2, 0])
    assert carried is None
    assert ring_all_reduce_bytes(4000.0, 4) == 2 * 3 / 4 * 4000
    assert gather_bytes(1000, 4) == 3 * 4 * 1000 and gather_bytes(1000, 1) == 0


def test_dense_gradients_ride_in_the_all_gather_while_the_extra_bytes_are_small():
    assert carry_in_gather(10**9, 2)  # P = 2: gathering sends what the ring all-reduce sends
    assert carry_in_gather(4096, 4)  # 16 KiB more than a ring all-reduce of 4,096 entries
    assert not carry_in_gather(100_000, 4)  # 200 KB more: a separate all-reduce is cheaper
    assert carry_in_gather(DENSE_CARRY_BYTES // 4, 3) and not carry_in_gather(DENSE_CARRY_BYTES, 3)


@pytest.mark.slow
def test_all_gather_route_with_two_replicas_sums_pairs_and_dense_tensors(tmp_path):
    """Two replicas (MirroredStrategy over two logical CPUs, in a fresh process):
    each sends its own pairs; both get the same dense sum, and the carried
    tensor summed."""
    code = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from tf_topk.routes import AllGatherRoute, Bucket, all_reduce_dense
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        bucket = Bucket([0], [0], [8], [0], 8, [3], [tf.TensorShape([8])], [tf.float32], 3)

        def replica_fn():
            context = tf.distribute.get_replica_context()
            r = tf.cast(context.replica_id_in_sync_group, tf.float32)
            values = tf.stack([1.0 + r, 10.0 * (1.0 + r), 0.0])
            indices = tf.stack([tf.cast(r, tf.int32), 5, 0])  # index 5 from both; a spare slot
            (pairs,), carried = AllGatherRoute().send(context, bucket, values, indices, [tf.constant(3)],
                                                      tf.fill([2], r + 1.0), sparse_output=False)
            dense = all_reduce_dense(context, [tf.fill([3], r + 1.0), r, tf.fill([2], tf.cast(r, tf.float64))])
            return pairs, dense[0], dense[1], dense[2], carried

        pairs, dense, flag, wide, carried = tf.function(lambda: strategy.run(replica_fn))()
        for name, result in (("pairs", pairs), ("dense", dense), ("flag", flag), ("wide", wide), ("carried", carried)):
            for local in strategy.experimental_local_results(result):
                print(name, local.numpy().tolist())
    """)
    proc = subprocess.run([*PYTHON, "-c", code], cwd=str(tmp_path), env=subprocess_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines()
             if line.split(" ")[0] in ("pairs", "dense", "flag", "wide", "carried")]
    expected_pairs = [1.0, 2.0, 0.0, 0.0, 0.0, 30.0, 0.0, 0.0]
    assert lines == ([f"pairs {expected_pairs}"] * 2 + ["dense [3.0, 3.0, 3.0]"] * 2 + ["flag 1.0"] * 2
                     + ["wide [1.0, 1.0]"] * 2 + ["carried [3.0, 3.0]"] * 2)  # float64 beside float32: summed too


# -- new parts plug in without touching the exchange ---------------------------------------

class LargestPositiveSelector(Selector):
    """A selector in a few lines: the k largest entries by signed value."""

    def select(self, accumulated, k):
        values, indices = tf.math.top_k(accumulated, k)
        return values, indices


class DecayingMemory(ErrorFeedbackMemory):
    """A memory in a few lines: error feedback whose residual decays by half each step."""

    def compensate(self, slot, grad):
        return Compensation(grad, 0.5 * tf.convert_to_tensor(self.residuals[slot]), None)


def test_a_new_selector_and_memory_plug_into_the_exchange():
    variable = tf.Variable(tf.zeros([5000]))
    exchange = tf_topk.SparseExchange([variable], density=0.001, min_size=16, density_warmup_steps=0,
                                      selector=LargestPositiveSelector(), memory=DecayingMemory())
    grad = np.linspace(-10.0, 5.0, 5000).astype(np.float32)  # the largest magnitudes are negative
    sent = exchange([tf.constant(grad)]).grads[0].numpy()
    k = 5
    np.testing.assert_array_equal(np.flatnonzero(sent), np.arange(5000 - k, 5000))
    residual = exchange.residuals[0].numpy()
    np.testing.assert_array_equal(residual + sent, grad)
    second = exchange([tf.zeros([5000])]).grads[0].numpy()
    np.testing.assert_allclose(second[np.flatnonzero(second)], 0.5 * grad[5000 - 2 * k:5000 - k])


def test_random_k_exchange_sends_k_random_entries_with_error_feedback():
    """The convergence benchmark's baseline: the library's exchange with RandomKSelector."""
    n, density = 10_000, 0.01
    k = int(n * density)
    exchange = tf_topk.SparseExchange([tf.Variable(tf.zeros([n]))], density=density, min_size=16,
                                      selector=RandomKSelector(), density_warmup_steps=0)
    grad = tf.range(1, n + 1, dtype=tf.float32)
    tf.random.set_seed(0)
    result = exchange([grad])
    sent = result.grads[0].numpy()
    chosen = np.flatnonzero(sent)
    assert len(chosen) == k and chosen.min() < n - k
    np.testing.assert_array_equal(sent[chosen], grad.numpy()[chosen])
    np.testing.assert_array_equal(exchange.residuals[0].numpy() + sent, grad.numpy())
    second = exchange([tf.zeros([n])]).grads[0].numpy()
    chosen2 = np.flatnonzero(second)
    # Random picks may hit an entry already sent (now 0 in the residual): at most k non-zeros.
    assert k - 10 <= len(chosen2) <= k and not set(chosen2) & set(chosen)
    assert abs(float(result.stats["contraction"]) - (1 - k / n)) < 0.05


@pytest.mark.slow
def test_a_new_route_plugs_into_the_exchange(tmp_path):
    """A route in a few lines (each replica applies its own top-k, sending
    nothing), two replicas: each gets its own selection back, while the
    dense-path variable is still summed (the route refuses to carry it)."""
    code = textwrap.dedent("""
        import math
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import tf_topk
        from tf_topk.routes import FixedRouter, Route
        from tf_topk.routes.base import split_dense

        class LocalRoute(Route):
            name, code = "local", 3.0

            def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
                dense = tf.scatter_nd(tf.expand_dims(indices, 1), values, [bucket.size])
                return split_dense(bucket, dense), None

            def bytes(self, pairs, entries, replicas):
                return 0.0

            def extra_carry_bytes(self, entries, replicas):
                return math.inf

        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            exchange = tf_topk.SparseExchange([tf.Variable(tf.zeros(3000)), tf.Variable(tf.zeros(50))], density=0.001,
                                              min_size=1000, method="exact", router=FixedRouter(LocalRoute()),
                                              density_warmup_steps=0)

        def replica_fn():
            r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            big = tf.one_hot(tf.cast(r, tf.int32) * 7, 3000) * 5.0 + tf.linspace(0.0, 1.0, 3000)
            result = exchange([big, tf.fill([50], r + 1.0)])
            return result.grads[0], result.grads[1], result.stats["exchange_mode"]

        big, small, mode = tf.function(lambda: strategy.run(replica_fn))()
        for r in range(2):
            print("big", np.flatnonzero(strategy.experimental_local_results(big)[r].numpy()).tolist())
            print("small", float(strategy.experimental_local_results(small)[r].numpy()[0]))
            print("mode", float(strategy.experimental_local_results(mode)[r].numpy()))
    """)
    proc = subprocess.run([*PYTHON, "-c", code], cwd=str(tmp_path), env=subprocess_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.split(" ")[0] in ("big", "small", "mode")]
    # k = 3: each replica its own largest entries (replica 1's spike at 7), nothing from the other.
    assert lines == ["big [0, 2998, 2999]", "small 3.0", "mode 3.0", "big [7, 2998, 2999]", "small 3.0", "mode 3.0"]


def test_parts_that_do_not_implement_their_interface_are_refused():
    class Duck:
        def select(self, accumulated, k):
            return tf.math.top_k(accumulated, k)

    for name in ("selector", "memory", "router"):
        with pytest.raises(TypeError, match=f"{name} must be a tf_topk.*subclass it.*Duck"):
            tf_topk.SparseExchange([tf.Variable(tf.zeros([5000]))], min_size=16, **{name: Duck()})


def test_residuals_passed_next_to_a_memory_are_refused():
    with pytest.raises(ValueError, match="pass residuals to the memory"):
        tf_topk.SparseExchange([tf.Variable(tf.zeros([5000]))], min_size=16, memory=NoMemory(),
                               residuals=[tf.Variable(tf.zeros([5000]))])


def test_the_exchange_asks_its_step_density_for_k_and_what_to_gather():
    """The kind of density lives in one part (tf_topk.step_density): a schedule gathers nothing and
    gives k from the step; the adaptive rule gathers one vote per candidate and keeps the agreed
    density, which no checkpoint holds (the rule restarts from its initial density)."""
    from tf_topk.step_density import AgreedAdaptiveDensity, ScheduledDensity

    variables = [tf.Variable(tf.zeros([5000]))]
    scheduled = tf_topk.SparseExchange(variables, density=[(0, 0.01), (10, 0.001)], min_size=1000)
    assert isinstance(scheduled.step_density, ScheduledDensity)
    assert int(scheduled.step_density.k(5000, tf.constant(3))) == 50
    assert int(scheduled.step_density.k(5000, tf.constant(10))) == 5
    assert scheduled.step_density.votes([], [], 1) is None and scheduled.adaptive_density is None

    adaptive = tf_topk.SparseExchange(variables, density="adaptive", min_size=1000)
    assert isinstance(adaptive.step_density, AgreedAdaptiveDensity)
    assert float(adaptive.adaptive_density) == adaptive.step_density.rule.initial_density
    result = adaptive([tf.random.stateless_normal([5000], seed=[1, 2])])
    assert result.stats["selected"] > 0
    chosen = float(adaptive.adaptive_density)
    assert chosen in [pytest.approx(c) for c in adaptive.step_density.rule.candidates(5000)]
    names = [v.name for v in adaptive.variables]  # what a checkpoint of the exchange holds
    assert names and not any("adaptive_density" in name for name in names), names


def test_all_gather_or_dense_refuses_sparse_output():
    """A dense step returns every entry: the switch of the warm-up has no sparse output to give."""
    from tf_topk.routes import AllGatherOrDenseRoute

    route = AllGatherOrDenseRoute(tf.constant(False))
    with pytest.raises(ValueError, match="sparse_output must be False"):
        route.send(tf.distribute.get_replica_context(), None, tf.ones([2]), tf.constant([0, 1]), [2], None, True)
