"""The agreed-index all-reduce (exchange_mode="allreduce") and the "auto" choice.

Three replicas run tests/workers/agreed_replicas.py twice: as logical CPUs of
one process (MirroredStrategy) and as three real worker processes
(MultiWorkerMirroredStrategy). Both are compared with the algorithm written
in numpy here: the agreed indices are the replicas' nominations (slot j of a
variable's k goes to replica j mod 3, which names its (j // 3)-th largest
entry; an index named twice counts once), or with ScaleCom's rule the exact
top-k of the leader t mod 3; every replica sends its own accumulated values
there and keeps the rest (on 2k slots with AgreedIndexRoute(slots=2) and
under "auto"). Then the volume formulas behind exchange_mode="auto", the
argument in both Keras wrappers, and a Keras fit on three replicas under "auto".
"""

import json
import math
import os
import subprocess
import textwrap

import numpy as np
import pytest

from multiworker import PYTHON, REPO_ROOT, WORKERS_DIR, assert_ok, run_script, subprocess_env, worker_env
from selection_reference import nominated_indices, top_k_indices
from tf_topk.routes import (ALLGATHER_SHARE, AUTO_AGREED_SLOTS, AUTO_ROUTES, MODE_CODES, choose_mode, mode_bytes,
                            ring_all_reduce_bytes)

SHAPES = [(40, 50), (300,), (3000,), (25, 80)]  # 2000, 300 (dense: below min_size), 3000, 2000 entries
MIN_SIZE, DENSITY, FIRST_DENSITY, REPLICAS, STEPS, NAN_STEP, MOMENTUM = 1000, 0.01, 0.6, 3, 4, 2, 0.9
CONFIG = dict(shapes=SHAPES, replicas=REPLICAS, steps=STEPS, density=DENSITY, nan_step=NAN_STEP, min_size=MIN_SIZE,
              momentum=MOMENTUM, first_density=FIRST_DENSITY)
SPARSE = [v for v, shape in enumerate(SHAPES) if math.prod(shape) >= MIN_SIZE]
DENSE = [v for v in range(len(SHAPES)) if v not in SPARSE]
RUNS = ("ef", "ef_leader", "ef_slots2", "ef_same", "ef_buckets", "dgc", "auto_schedule")
NAN_RUNS = ("ef", "ef_leader")  # the others get the non-finite entry as 0
CLOSE = dict(rtol=2e-5, atol=2e-5)


def agreed_slots(label):
    """Agreed indices per k of a run: twice with AgreedIndexRoute(slots=2) and with "auto"."""
    return 2 if label == "ef_slots2" else AUTO_AGREED_SLOTS if label == "auto_schedule" else 1


def reference(data, label):
    """Per step: (all_finite, summed gradients, residuals[r][slot], velocities[r][slot], agreed indices,
    dense step)."""
    sizes = [math.prod(shape) for shape in SHAPES]
    residuals = [[np.zeros(sizes[v], np.float32) for v in SPARSE] for _ in range(REPLICAS)]
    velocities = [[np.zeros(sizes[v], np.float32) for v in SPARSE] for _ in range(REPLICAS)]
    dense_velocities = [np.zeros(sizes[v], np.float32) for v in DENSE]
    steps = []
    for s in range(STEPS):
        grads = [[data[f"input/step{s}/grad{v}"][r].reshape(-1) for v in range(len(SHAPES))]
                 for r in range(REPLICAS)]
        if s == NAN_STEP and label not in NAN_RUNS:
            grads = [[np.nan_to_num(g) for g in gs] for gs in grads]
        if label == "ef_same":
            grads = [grads[0]] * REPLICAS
        finite = all(np.isfinite(g).all() for gs in grads for g in gs)
        density = FIRST_DENSITY if (label == "auto_schedule" and s == 0) else DENSITY
        dense_step = label == "auto_schedule" and s == 0
        summed = [np.zeros(size, np.float32) for size in sizes]
        leader_indices = []
        if not finite:
            steps.append((False, None, [list(x) for x in residuals], None, None, dense_step))
            continue
        accumulated = [[None] * len(SPARSE) for _ in range(REPLICAS)]
        us = [[None] * len(SPARSE) for _ in range(REPLICAS)]
        for r in range(REPLICAS):
            for slot, v in enumerate(SPARSE):
                if label == "dgc":
                    us[r][slot] = MOMENTUM * velocities[r][slot] + grads[r][v]
                    accumulated[r][slot] = residuals[r][slot] + us[r][slot]
                else:
                    accumulated[r][slot] = grads[r][v] + residuals[r][slot]
        leader = s % REPLICAS
        for slot, v in enumerate(SPARSE):
            n = sizes[v]
            k = max(1, math.ceil(density * n))
            if dense_step:
                indices = np.arange(n)
            elif label == "ef_leader":
                indices = top_k_indices(accumulated[leader][slot], k)
            else:
                indices = nominated_indices([accumulated[r][slot] for r in range(REPLICAS)], agreed_slots(label) * k)
            leader_indices.append(indices)
            for r in range(REPLICAS):
                sent = np.zeros(n, np.float32)
                sent[indices] = accumulated[r][slot][indices]
                residuals[r][slot] = accumulated[r][slot] - sent
                if label == "dgc":
                    velocities[r][slot] = np.where(sent != 0, 0.0, us[r][slot]).astype(np.float32)
                summed[v] += sent
        for slot, v in enumerate(DENSE):
            summed[v] = sum(grads[r][v] for r in range(REPLICAS))
            if label == "dgc":
                dense_velocities[slot] = MOMENTUM * dense_velocities[slot] + summed[v]
                summed[v] = dense_velocities[slot].copy()
        steps.append((True, summed, [list(x) for x in residuals], [list(x) for x in velocities], leader_indices,
                      dense_step))
    return steps


def expected_bytes(dense_step, slots=1):
    sparse_entries = sum(math.prod(SHAPES[v]) for v in SPARSE)
    dense_entries = sum(math.prod(SHAPES[v]) for v in DENSE)
    small = ring_all_reduce_bytes(4.0 * (dense_entries + 1), REPLICAS)  # with the non-finite count
    if dense_step:
        return small + ring_all_reduce_bytes(4.0 * sparse_entries, REPLICAS)
    pairs = slots * sum(math.ceil(DENSITY * math.prod(SHAPES[v])) for v in SPARSE)
    return small + 2 * ring_all_reduce_bytes(4.0 * pairs, REPLICAS)


def check_against_reference(results):
    """`results[r]`: what replica r wrote (a dict of arrays)."""
    for label in RUNS:
        for s, (finite, summed, residuals, velocities, leader_indices, dense_step) in enumerate(
                reference(results[0], label)):
            for r in range(REPLICAS):
                data, prefix = results[r], f"{label}/step{s}/replica{r}"
                assert bool(data[f"{prefix}/all_finite"]) == finite, prefix
                for slot in range(len(SPARSE)):
                    np.testing.assert_allclose(data[f"{prefix}/residual{slot}"].reshape(-1), residuals[r][slot],
                                               **CLOSE, err_msg=f"{prefix} residual {slot}")
                if not finite:
                    continue
                for v in range(len(SHAPES)):
                    np.testing.assert_allclose(data[f"{prefix}/grad{v}"].reshape(-1), summed[v], **CLOSE,
                                               err_msg=f"{prefix} variable {v}")
                if label == "dgc":
                    for slot in range(len(SPARSE)):
                        np.testing.assert_allclose(data[f"{prefix}/velocity{slot}"].reshape(-1),
                                                   velocities[r][slot], **CLOSE)
                # Index agreement: every replica's residual is zero exactly at the agreed indices.
                for slot, indices in enumerate(leader_indices):
                    zero = np.flatnonzero(data[f"{prefix}/residual{slot}"].reshape(-1) == 0)
                    np.testing.assert_array_equal(zero, np.sort(indices))
                mode = "dense" if dense_step else "allreduce"
                assert float(data[f"{prefix}/exchange_mode"]) == MODE_CODES[mode]
                assert float(data[f"{prefix}/bytes_sent"]) == pytest.approx(
                    expected_bytes(dense_step, agreed_slots(label)), rel=1e-6)
    # The leader rotates: the agreed index sets of consecutive steps differ.
    first, second = reference(results[0], "ef_leader")[:2]
    assert not np.array_equal(np.sort(first[4][0]), np.sort(second[4][0]))
    # Nominations are not the leader's choice; where every replica names the same entries, each
    # counts once (the sums above hold 3x, not 9x, the accumulated value) and the rest are spare slots.
    nominated, led = reference(results[0], "ef")[0][4], reference(results[0], "ef_leader")[0][4]
    assert any(not np.array_equal(np.sort(a), np.sort(b)) for a, b in zip(nominated, led))
    # Twice the slots: about twice the distinct indices, each replica's own top 2k/3 named.
    doubled = reference(results[0], "ef_slots2")[0][4]
    assert all(len(d) > 1.5 * len(n) for d, n in zip(doubled, nominated))
    same = reference(results[0], "ef_same")[0][4]
    assert [len(i) for i in same] == [math.ceil(len(i) / REPLICAS) for i in led]


def check_bitwise_identical(results):
    for label in RUNS:
        for s in range(STEPS):
            for v in range(len(SHAPES)):
                first = results[0][f"{label}/step{s}/replica0/grad{v}"]
                for r in range(1, REPLICAS):
                    np.testing.assert_array_equal(results[r][f"{label}/step{s}/replica{r}/grad{v}"], first)


@pytest.fixture(scope="module")
def local_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("agreed_local")
    env = {**os.environ, **worker_env()}
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([*PYTHON, str(WORKERS_DIR / "agreed_replicas.py"), str(out), json.dumps(CONFIG)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(out / "local.npz") as saved:
        data = dict(saved)
    return [data] * REPLICAS


@pytest.mark.slow
def test_three_replicas_in_one_process_match_numpy(local_results):
    check_against_reference(local_results)
    check_bitwise_identical(local_results)


@pytest.mark.slow
def test_three_worker_processes_match_numpy_and_agree_bitwise(tmp_path):
    result = run_script("agreed_replicas.py", tmp_path, json.dumps(CONFIG), workers=REPLICAS, timeout=110)
    assert_ok(result)
    results = []
    for r in range(REPLICAS):
        with np.load(tmp_path / f"worker{r}.npz") as saved:
            results.append(dict(saved))
    check_against_reference(results)
    check_bitwise_identical(results)


# -- the volume formulas and the "auto" choice ----------------------------------------------

def test_mode_bytes_follow_the_ring_and_all_gather_formulas():
    assert mode_bytes("dense", 10, 1000, 4) == 2 * 3 / 4 * 4000
    assert mode_bytes("allgather", 10, 1000, 4) == 3 * 8 * 10
    assert mode_bytes("allreduce", 10, 1000, 4) == 2 * (2 * 3 / 4 * 40)
    for replicas in (2, 8, 1024):  # agreed indices stay below 16k bytes; all_gather grows with P
        assert mode_bytes("allreduce", 10, 1000, replicas) < 16 * 10
    assert mode_bytes("allgather", 10, 1000, 1024) == 1023 * 80
    with pytest.raises(ValueError, match="mode must be one of .*'ring'"):
        mode_bytes("ring", 1, 1, 2)


@pytest.mark.parametrize("replicas, pairs, entries, expected", [
    (2, 10, 10_000, "allgather"),     # equal bytes at P = 2: each replica's own top-k wins the tie
    (2, 5_000, 10_000, "allgather"),  # k = n/P: all_gather equals dense, still sparse
    (2, 5_001, 10_000, "dense"),      # above 1/P at P = 2
    (3, 10, 10_000, "allgather"),     # P * k = n / 333: all_gather, more bytes than agreed indices
    (4, 156, 10_000, "allgather"),    # P * k = 624 <= n / 16 = 625
    (4, 157, 10_000, "allgather"),    # above n / 16, but agreed indices on 2k send as much at P = 4: the tie
    (5, 157, 10_000, "allreduce"),    # 32k * 4/5 against all_gather's 32k: the fewest bytes
    (8, 1_000, 10_000, "allreduce"),  # all_gather would send 7x its pairs, more than dense
    (8, 2_500, 10_000, "allreduce"),  # k = n/4: agreed indices on 2k send what dense does
    (8, 2_501, 10_000, "dense"),      # the agreed indices and values cost more than the values: dense
    (1024, 1, 10_000_000, "allgather"),
    (1024, 1_000, 10_000_000, "allreduce"),  # P * k = n / 9.8
])
def test_auto_keeps_allgather_while_small_beside_dense_then_picks_the_fewest_bytes(replicas, pairs, entries,
                                                                                  expected):
    mode = choose_mode(replicas, pairs, entries)
    assert mode == expected
    bytes_of = {m: AUTO_ROUTES[m].bytes_for_k(pairs, entries, replicas) for m in ("dense", "allgather", "allreduce")}
    assert bytes_of["allreduce"] == 2 * mode_bytes("allreduce", pairs, entries, replicas)  # 2k agreed slots
    if replicas * pairs <= entries * ALLGATHER_SHARE:
        assert mode == "allgather" and bytes_of[mode] <= bytes_of["dense"] / 16
    else:
        assert bytes_of[mode] == min(bytes_of.values()) <= bytes_of["dense"]


def test_auto_takes_agreed_indices_on_twice_k_slots_from_five_replicas():
    import tensorflow as tf

    from tf_topk.routes import AgreedIndexRoute, AgreedOrDenseRoute, AutoRouter, Bucket

    def bucket(k, size):
        return Bucket(positions=[0], slots=[0], sizes=[size], offsets=[0], size=size, ks=[k], shapes=[(size,)],
                      dtypes=[tf.float32], max_pairs=k if isinstance(k, int) else size)

    router = AutoRouter()
    for replicas, expected in ((4, "allgather"), (5, "allreduce"), (8, "allreduce")):
        route = router.route(bucket(2_000, 100_000), replicas)  # P * k > n / 16 from 4 replicas on
        assert route.name == expected
    assert isinstance(route, AgreedIndexRoute) and route.slots == AUTO_AGREED_SLOTS == 2
    switch = router.route(bucket(tf.constant(1_000), 100_000), 8)  # a k tensor that may reach dense
    assert isinstance(switch, AgreedOrDenseRoute) and switch.slots == 2 and not bool(switch.dense_when)
    assert router.sparse_route(bucket(tf.constant(1_000), 100_000), 8).slots == 2


def test_auto_never_sends_more_than_dense():
    for replicas in (2, 3, 4, 8, 16, 64, 1024):
        for entries in (1, 100, 4096, 1_000_000):
            for pairs in sorted({1, entries // 1000 or 1, entries // replicas or 1, entries // 2 or 1, entries}):
                mode = choose_mode(replicas, pairs, entries)
                assert AUTO_ROUTES[mode].bytes_for_k(pairs, entries, replicas) <= \
                    mode_bytes("dense", pairs, entries, replicas)
    assert choose_mode(4, 10, 1000, modes=("allgather", "dense")) == "allgather"


def test_exchange_and_optimizer_take_the_mode_and_refuse_a_wrong_one():
    import keras
    import tensorflow as tf

    import tf_topk

    with pytest.raises(ValueError, match="exchange_mode must be one of .*'ring'"):
        tf_topk.SparseExchange([tf.Variable(tf.zeros([10]))], exchange_mode="ring")
    with pytest.raises(TypeError, match=r"communicator=\.\.\. was replaced by routes"):
        tf_topk.SparseExchange([tf.Variable(tf.zeros([10]))], exchange_mode="allreduce",
                               communicator=object())
    with pytest.raises(ValueError, match="exchange_mode must be one of"):
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), exchange_mode="ring")
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), exchange_mode="allreduce")
    config = optimizer.get_config()
    assert config["exchange_mode"] == "allreduce"
    assert type(optimizer).from_config(config).exchange_mode == "allreduce"
    assert tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1)).get_config()["exchange_mode"] == "auto"
    assert tf_topk.SparseExchange([tf.Variable(tf.zeros([10]))]).config.exchange_mode == "auto"
    import tf_keras

    import tf_topk.tf_keras

    legacy = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1), exchange_mode="allgather")
    assert type(legacy).from_config(legacy.get_config()).exchange_mode == "allgather"
    assert tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1)).exchange_mode == "auto"
    with pytest.raises(ValueError, match="exchange_mode must be one of .*'ring'"):
        tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1), exchange_mode="ring")


def test_agreed_index_route_names_its_rule_and_refuses_an_unknown_one():
    from tf_topk.routes import ROUTES, AgreedIndexRoute, AutoRouter, FixedRouter

    assert ROUTES["allreduce"].agreement == "nominated" and not ROUTES["allreduce"].uses_leader
    assert AgreedIndexRoute("leader").uses_leader and FixedRouter(AgreedIndexRoute("leader")).uses_leader
    assert not AutoRouter().uses_leader  # no call counter for "auto"
    with pytest.raises(ValueError, match=r"agreement must be one of \('nominated', 'leader'\), got 'sum'"):
        AgreedIndexRoute("sum")
    for slots in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"slots must be an int >= 1 .*got {slots!r}"):
            AgreedIndexRoute(slots=slots)
    assert AgreedIndexRoute(slots=3).bytes_for_k(10, 1000, 4) == pytest.approx(2 * 2 * 3 / 4 * 4 * 30)


def test_one_replica_sends_nothing_and_keeps_the_residual():
    import tensorflow as tf

    import tf_topk

    variable = tf.Variable(tf.zeros([5000]))
    grad = tf.constant(np.random.default_rng(3).standard_normal(5000).astype(np.float32))
    for mode in ("allgather", "allreduce", "auto"):
        exchange = tf_topk.SparseExchange([variable], density=0.01, min_size=16, method="exact",
                                          exchange_mode=mode, density_warmup_steps=0)
        result = exchange([grad])
        sent = result.grads[0].numpy()
        assert np.count_nonzero(sent) == 50 and float(result.stats["bytes_sent"]) == 0.0
        np.testing.assert_array_equal(exchange.residuals[0].numpy() + sent, grad.numpy())


@pytest.mark.slow
def test_keras_fit_on_three_replicas_switches_from_dense_to_agreed_indices(tmp_path):
    """TopKOptimizer with exchange_mode="auto" under model.fit: a warm-up density above
    1/2 goes dense, then agreed indices, with momentum correction; the
    replicas' weights stay bitwise identical."""
    code = textwrap.dedent("""
        import json
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
        import keras, tf_topk
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(80), keras.layers.Dense(1)])
            optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), density=[(0, 0.6), (2, 0.01)],
                                              min_size=1000, momentum_correction=True, exchange_mode="auto")
            model.compile(optimizer=optimizer, loss="mse")
        x = np.random.default_rng(0).normal(size=(96, 64)).astype("float32")
        modes = []
        callback = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: modes.append(optimizer.compression_stats()["exchange_mode"]))
        history = model.fit(x, x[:, :1], batch_size=24, epochs=2, verbose=0, callbacks=[callback])
        kernels = [v.numpy() for v in model.layers[0].kernel.value.values]
        print("RESULT " + json.dumps(dict(modes=modes, losses=history.history["loss"],
                                          identical=all(np.array_equal(kernels[0], k) for k in kernels))))
    """)
    proc = subprocess.run([*PYTHON, "-c", code], cwd=str(tmp_path), env=subprocess_env(), capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["identical"], result
    assert result["modes"] == [0.0, 0.0] + [2.0] * 6, result  # 4 batches an epoch: steps 0, 1 dense
    assert all(math.isfinite(loss) for loss in result["losses"]), result
