"""SparseExchange across two replicas (MirroredStrategy, two logical CPUs) against numpy.

Plain error feedback (two bucketings) and momentum correction (DGC: plain,
and Nesterov with local clipping) over several steps.

The exchange runs in a subprocess (logical devices must be set before
TensorFlow starts): tests/workers/exchange_replicas.py writes what every
replica returned; here it is compared with the algorithm written in numpy.
"""

import json
import math
import os
import subprocess

import numpy as np
import pytest

from multiworker import PYTHON, REPO_ROOT, WORKERS_DIR, worker_env

SHAPES = [(40, 50), (300,), (3000,), (25, 80)]  # 2000, 300 (dense: below min_size), 3000, 2000 entries
MIN_SIZE, DENSITY, REPLICAS, STEPS = 1000, 0.01, 2, 3
MOMENTUM = 0.9
# A replica's gradients (standard normal, 7300 entries) have a norm of about 85:
# clipped to 60 / sqrt(2) they are clipped at every step.
LOCAL_CLIPNORM = 60.0
PLAIN_RUNS = ("one_bucket", "per_variable")
DGC_RUNS = {"dgc": dict(nesterov=False, clipnorm=None, masking=True),
            "dgc_nesterov_clip": dict(nesterov=True, clipnorm=LOCAL_CLIPNORM, masking=True),
            "momentum_unmasked": dict(nesterov=False, clipnorm=None, masking=False)}
SPARSE = [v for v, shape in enumerate(SHAPES) if math.prod(shape) >= MIN_SIZE]


def top_k_magnitude(flat, k):
    """The numpy reference of exact selection: `flat` with all but its k largest |x| zeroed."""
    selected = np.zeros_like(flat)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    selected[keep] = flat[keep]
    return selected


def reference(data):
    """Per step: the summed gradient of each variable, and each replica's residuals after it."""
    residuals = [[np.zeros(math.prod(SHAPES[v]), np.float32) for v in SPARSE] for _ in range(REPLICAS)]
    steps = []
    for s in range(STEPS):
        summed = [np.zeros(math.prod(shape), np.float32) for shape in SHAPES]
        for r in range(REPLICAS):
            for v in range(len(SHAPES)):
                grad = data[f"input/step{s}/replica{r}/grad{v}"].reshape(-1)
                if v in SPARSE:
                    slot = SPARSE.index(v)
                    accumulated = grad + residuals[r][slot]
                    sent = top_k_magnitude(accumulated, math.ceil(DENSITY * accumulated.size))
                    residuals[r][slot] = accumulated - sent
                    summed[v] += sent
                else:
                    summed[v] += grad
        steps.append((summed, [list(rs) for rs in residuals]))
    return steps


def dgc_reference(data, nesterov, clipnorm, masking):
    """Momentum correction, with masking as Lin et al. (DGC) define it or without.

    Per step: the summed gradients, and each replica's residuals, velocities
    and dense-path velocities after it.
    """
    sizes = [math.prod(shape) for shape in SHAPES]
    residuals = [[np.zeros(sizes[v], np.float32) for v in SPARSE] for _ in range(REPLICAS)]
    velocities = [[np.zeros(sizes[v], np.float32) for v in SPARSE] for _ in range(REPLICAS)]
    dense = [v for v in range(len(SHAPES)) if v not in SPARSE]
    dense_velocities = [np.zeros(sizes[v], np.float32) for v in dense]
    steps = []
    for s in range(STEPS):
        summed = [np.zeros(size, np.float32) for size in sizes]
        for r in range(REPLICAS):
            grads = [data[f"input/step{s}/replica{r}/grad{v}"].reshape(-1) for v in range(len(SHAPES))]
            if clipnorm is not None:
                limit = clipnorm / math.sqrt(REPLICAS)
                norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
                grads = [g * limit / max(norm, limit) for g in grads]
            for v in range(len(SHAPES)):
                if v not in SPARSE:
                    summed[v] += grads[v]
                    continue
                slot = SPARSE.index(v)
                u = velocities[r][slot]
                if nesterov:
                    u = MOMENTUM * (u + grads[v])
                    accumulated = residuals[r][slot] + u + grads[v]
                else:
                    u = MOMENTUM * u + grads[v]
                    accumulated = residuals[r][slot] + u
                sent = top_k_magnitude(accumulated, math.ceil(DENSITY * accumulated.size))
                residuals[r][slot] = accumulated - sent
                velocities[r][slot] = np.where(sent != 0, 0.0, u).astype(np.float32) if masking else u
                summed[v] += sent
        for slot, v in enumerate(dense):
            if nesterov:
                dense_velocities[slot] = MOMENTUM * (dense_velocities[slot] + summed[v])
                summed[v] = dense_velocities[slot] + summed[v]
            else:
                dense_velocities[slot] = MOMENTUM * dense_velocities[slot] + summed[v]
                summed[v] = dense_velocities[slot].copy()
        steps.append((summed, [list(rs) for rs in residuals], [list(us) for us in velocities],
                      [u.copy() for u in dense_velocities]))
    return steps


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Everything the worker script wrote, by name."""
    path = tmp_path_factory.mktemp("exchange") / "replicas.npz"
    env = {**os.environ, **worker_env()}
    config = json.dumps(dict(shapes=SHAPES, min_size=MIN_SIZE, density=DENSITY, replicas=REPLICAS, steps=STEPS,
                             momentum=MOMENTUM, local_clipnorm=LOCAL_CLIPNORM))
    proc = subprocess.run([*PYTHON, str(WORKERS_DIR / "exchange_replicas.py"), str(path), config],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(path) as saved:
        return dict(saved)


@pytest.mark.slow
@pytest.mark.parametrize("label, buckets", [("one_bucket", 1), ("per_variable", len(SPARSE))])
def test_bucket_count(data, label, buckets):
    assert int(data[f"{label}/num_buckets"]) == buckets


@pytest.mark.parametrize("label", PLAIN_RUNS)
def test_sum_over_replicas_and_residuals_match_numpy(data, label):
    for s, (summed, residuals) in enumerate(reference(data)):
        for r in range(REPLICAS):
            for v, shape in enumerate(SHAPES):
                got = data[f"{label}/step{s}/replica{r}/grad{v}"]
                assert got.shape == shape
                np.testing.assert_allclose(got.reshape(-1), summed[v], rtol=1e-6, atol=1e-6,
                                           err_msg=f"step {s} replica {r} variable {v}")
            for slot in range(len(SPARSE)):
                np.testing.assert_allclose(data[f"{label}/step{s}/replica{r}/residual{slot}"].reshape(-1),
                                           residuals[r][slot], rtol=1e-6, atol=1e-6)
    # Error feedback is visible: the second step sends entries the first step kept back.
    assert np.abs(residuals[0][0]).sum() > 0


@pytest.mark.parametrize("label", list(DGC_RUNS))
def test_momentum_correction_matches_numpy_over_several_steps(data, label):
    close = dict(rtol=2e-5, atol=2e-5)
    for s, (summed, residuals, velocities, dense_velocities) in enumerate(dgc_reference(data, **DGC_RUNS[label])):
        for r in range(REPLICAS):
            prefix = f"{label}/step{s}/replica{r}"
            for v in range(len(SHAPES)):
                np.testing.assert_allclose(data[f"{prefix}/grad{v}"].reshape(-1), summed[v], **close,
                                           err_msg=f"step {s} replica {r} variable {v}")
            for slot in range(len(SPARSE)):
                np.testing.assert_allclose(data[f"{prefix}/residual{slot}"].reshape(-1), residuals[r][slot], **close)
                np.testing.assert_allclose(data[f"{prefix}/velocity{slot}"].reshape(-1), velocities[r][slot], **close)
            for slot, velocity in enumerate(dense_velocities):
                np.testing.assert_allclose(data[f"{prefix}/dense_velocity{slot}"].reshape(-1), velocity, **close)
    # Masking is visible: with it sent entries have no velocity left, the others keep it; without it
    # sent entries keep theirs.
    sent = data[f"{label}/step{STEPS - 1}/replica0/residual0"] == 0
    velocity = data[f"{label}/step{STEPS - 1}/replica0/velocity0"]
    assert np.count_nonzero(velocity[~sent]) > 0.9 * np.count_nonzero(~sent)
    if DGC_RUNS[label]["masking"]:
        assert np.all(velocity[sent] == 0)
    else:
        assert np.count_nonzero(velocity[sent]) > 0.9 * np.count_nonzero(sent)


def test_momentum_correction_differs_from_plain_error_feedback(data):
    """The reference could not pass by accident: with momentum the sums are not EF's."""
    last = STEPS - 1
    assert not np.allclose(data[f"dgc/step{last}/replica0/grad0"], data[f"one_bucket/step{last}/replica0/grad0"])


def test_every_replica_and_every_bucketing_get_bitwise_the_same_sum(data):
    for s in range(STEPS):
        for v in range(len(SHAPES)):
            for label in (*PLAIN_RUNS, *DGC_RUNS):
                first = data[f"{label}/step{s}/replica0/grad{v}"]
                for r in range(1, REPLICAS):
                    np.testing.assert_array_equal(data[f"{label}/step{s}/replica{r}/grad{v}"], first)
            np.testing.assert_array_equal(data[f"per_variable/step{s}/replica0/grad{v}"],
                                          data[f"one_bucket/step{s}/replica0/grad{v}"])


def test_replicas_keep_their_own_residuals(data):
    assert not np.array_equal(data["one_bucket/step0/replica0/residual0"], data["one_bucket/step0/replica1/residual0"])


# -- sparse output, and the non-finite skip with one collective per step -------------------------

def test_sparse_output_sums_to_the_dense_output_in_every_mode():
    import tensorflow as tf

    import tf_topk
    from tf_topk.exchange import SparseGradient, apply_sparse_sgd, to_dense

    rng = np.random.default_rng(0)
    variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]
    for kwargs in (dict(), dict(bucket_bytes=8), dict(exchange_mode="allreduce"), dict(density=0.9)):
        kwargs = dict(dict(density=DENSITY, min_size=MIN_SIZE, density_warmup_steps=0), **kwargs)
        dense = tf_topk.SparseExchange(variables, **kwargs)
        sparse = tf_topk.SparseExchange(variables, sparse_output=True, **kwargs)
        for _ in range(2):
            grads = [tf.constant(rng.standard_normal(shape).astype(np.float32)) for shape in SHAPES]
            for d, s, shape in zip(dense(grads).grads, sparse(grads).grads, SHAPES):
                assert isinstance(s, SparseGradient) == (math.prod(shape) >= MIN_SIZE), kwargs
                np.testing.assert_array_equal(to_dense(s, shape).numpy() if isinstance(s, SparseGradient)
                                              else s.numpy(), d.numpy())
        target = tf.Variable(tf.ones(SHAPES[0]))
        result = sparse(grads).grads[0]
        reference = 1.0 - 0.5 * to_dense(result, SHAPES[0]).numpy()
        apply_sparse_sgd(target, result, 0.5)
        np.testing.assert_allclose(target.numpy(), reference, rtol=1e-6)


NAN_CODE = """
import json, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
import tf_topk
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
shapes = [(3000,), (50,)]
with strategy.scope():
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    exchange = tf_topk.SparseExchange(variables, density=0.01, min_size=1000, sparse_output=sys.argv[1] == "1",
                                      density_warmup_steps=0)

@tf.function
def step(grads):
    def replica_fn():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        result = exchange([tf.gather(g, r) for g in grads])
        return result.all_finite
    return strategy.run(replica_fn)

rng = np.random.default_rng(0)
report = []
for index in range(3):
    grads = [rng.standard_normal((3, *s)).astype(np.float32) for s in shapes]
    if index == 1:
        grads[0][2, 17] = np.nan  # replica 2 only; replicas 0 and 1 are finite
    finite = [bool(f) for f in strategy.experimental_local_results(step([tf.constant(g) for g in grads]))]
    residuals = [r.numpy().tolist() for r in strategy.experimental_local_results(exchange.residuals[0])]
    report.append({"finite": finite, "residuals": residuals})
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.parametrize("sparse_output", [False, True])
def test_a_non_finite_replica_makes_every_replica_keep_its_residual(sparse_output, tmp_path):
    """The finite flag travels with the pairs: the finite replicas learn about
    the NaN after selecting, and must still leave their residuals as they were."""
    proc = subprocess.run([*PYTHON, "-c", NAN_CODE, "1" if sparse_output else "0"], cwd=str(tmp_path),
                          env=worker_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, skipped, third = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["finite"] == [True] * 3 and skipped["finite"] == [False] * 3 and third["finite"] == [True] * 3
    assert skipped["residuals"] == first["residuals"]  # every replica, bitwise
    assert third["residuals"] != first["residuals"]
    assert all(np.count_nonzero(r) > 0 for r in first["residuals"])


THREE_REPLICAS_CODE = """
import json
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
import tf_topk
from tf_topk.exchange import to_dense
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
report = {}

# Replica order: at entry 5 the replicas send 1e8, 1 and -1e8; (1e8 + 1) - 1e8 = 0 in float32.
grads = np.tile(np.linspace(1e-3, 2e-3, 2000, dtype=np.float32), (3, 1))
grads[:, 5] = [1e8, 1.0, -1e8]
grads[:, 9] = [0.5, 0.25, 0.125]
for sparse_output in (False, True):
    with strategy.scope():
        exchange = tf_topk.SparseExchange([tf.Variable(tf.zeros(2000))], density=0.001, min_size=1000,
                                          density_warmup_steps=0,
                                          sparse_output=sparse_output, exchange_mode="allgather")

    @tf.function
    def order_step():
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            grad = exchange([tf.gather(tf.constant(grads), r)]).grads[0]
            return to_dense(grad, [2000]) if sparse_output else grad
        return strategy.run(replica_fn)

    report[f"order_sparse{int(sparse_output)}"] = [
        d.numpy()[[5, 9]].tolist() for d in strategy.experimental_local_results(order_step())]

# Byte statistics of float64 variables: 8 bytes per dense entry.
for mode in ("allgather", "allreduce"):
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(3000, tf.float64)), tf.Variable(tf.zeros(50, tf.float64))]
        exchange = tf_topk.SparseExchange(variables, density=0.01, min_size=1000, exchange_mode=mode,
                                          density_warmup_steps=0)

    @tf.function
    def bytes_step():
        def replica_fn():
            stats = exchange([tf.ones(3000, tf.float64), tf.ones(50, tf.float64)]).stats
            return stats["bytes_sent"], stats["bytes_dense"]
        return strategy.run(replica_fn)

    sent, dense = bytes_step()
    report[f"bytes_{mode}"] = [float(strategy.experimental_local_results(sent)[0]),
                               float(strategy.experimental_local_results(dense)[0])]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def three_replicas(tmp_path_factory):
    """THREE_REPLICAS_CODE's report (one process, 3 logical CPUs)."""
    proc = subprocess.run([*PYTHON, "-c", THREE_REPLICAS_CODE], cwd=str(tmp_path_factory.mktemp("three")),
                          env=worker_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("sparse_output", [False, True])
def test_densification_sums_the_replicas_in_replica_order(three_replicas, sparse_output):
    """Every replica sums the gathered pairs one replica at a time, replica 0
    first (bitwise the same on every device: no scatter sums repeated
    indices): (1e8 + 1) - 1e8 is 0 in float32, any other order is not."""
    assert three_replicas[f"order_sparse{int(sparse_output)}"] == [[0.0, 0.875]] * 3


def test_byte_statistics_count_float64_entries_at_eight_bytes(three_replicas):
    ring = 2 * 2 / 3  # a ring all-reduce over 3 workers sends 2(P-1)/P of the buffer
    for mode, pairs in (("allgather", 2 * 8 * 30), ("allreduce", 2 * ring * 4 * 30)):
        sent, dense = three_replicas[f"bytes_{mode}"]
        assert dense == pytest.approx(ring * 8 * 3050, rel=1e-6)
        # all_gather of 30 pairs to 2 others, or the ring all-reduces of 30 indices and
        # 30 values; the float64 dense variable and the non-finite count in their own
        # all-reduce (float64 does not ride the float32 buffers).
        assert sent == pytest.approx(pairs + ring * (8 * 50 + 4), rel=1e-6), mode


def test_sparse_gradient_rows_are_summed_in_row_order():
    """Densifying and applying go one row (one replica's pairs) at a time, in
    order, so the float sum is the same on every replica and device: here the
    order decides the result ((1e8 + 1) - 1e8 = 0, not 1)."""
    import tensorflow as tf

    from tf_topk.exchange import SparseGradient, apply_sparse_sgd, to_dense

    gradient = SparseGradient(tf.constant([[1e8, 0.0], [1.0, 0.0], [-1e8, 0.0]]), tf.constant([[2, 0], [2, 0], [2, 0]]))
    np.testing.assert_array_equal(to_dense(gradient, [2, 2]).numpy(), [[0.0, 0.0], [0.0, 0.0]])
    variable = tf.Variable([[5.0, 5.0], [0.0, 5.0]])
    apply_sparse_sgd(variable, gradient, 1.0)
    np.testing.assert_array_equal(variable.numpy(), [[5.0, 5.0], [0.0, 5.0]])  # ((0 - 1e8) - 1) + 1e8


def test_apply_sparse_sgd_updates_a_scalar_variable():
    import tensorflow as tf

    import tf_topk
    from tf_topk.exchange import apply_sparse_sgd

    variable = tf.Variable(3.0)
    exchange = tf_topk.SparseExchange([variable], density=1.0, min_size=1, sparse_output=True)
    result = exchange([tf.constant(2.0)])
    apply_sparse_sgd(variable, result.grads[0], 0.5)
    assert variable.numpy() == 2.0


def test_bad_sparse_gradient_rows_are_refused():
    import tensorflow as tf

    from tf_topk.exchange import SparseGradient, to_dense

    with pytest.raises(ValueError, match=r"SparseGradient values must be \[m\] or \[rows, m\].*shape \(1, 1, 1\)"):
        to_dense(SparseGradient(tf.zeros([1, 1, 1]), tf.zeros([1, 1, 1], tf.int32)), [4])
