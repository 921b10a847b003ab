"""Per-replica state (residuals, velocities) through checkpoints: each replica gets its own back.

In this process (one replica, no strategy): checkpoints are what they were
(the value under the variable's key) and restore exactly; the rows a
multi-replica run saved restore as their sum; a saved value of another shape
is refused with a message naming the variable.

tests/workers/replica_state_local.py (one process, MirroredStrategy over
logical CPUs, ~25 s): tf.train.Checkpoint and Keras weights files give each
of 2 replicas its own state bitwise, and 3 replicas or none sum / replicas;
old checkpoints restore by the sum rule; a SavedModel holds the sum and loads.

Two workers (tests/workers/checkpoint_loop.py, a custom training loop with
SparseExchange and tf.train.CheckpointManager, slow): worker 1 is killed with
SIGKILL mid-run, both are restarted and resume from the last checkpoint, and
end with the weights and each worker's residuals and velocities of an
uninterrupted run, bitwise. A checkpoint of 2 workers restored by one process
gives it the sum (the total is kept), and the dense-path velocity, the same
on both workers, as it was.
"""

import concurrent.futures
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow as tf

from multiworker import (PYTHON, REPO_ROOT, WORKERS_DIR, assert_ok, kill_recorded_workers, load_json, load_weights, run_script,
                         worker_env)

keras = pytest.importorskip("keras")

import tf_topk  # noqa: E402
from tf_topk.replica_state import keep_replica_values, keeps_replica_values, restore_value, saved_value  # noqa: E402


def make_exchange():
    keras.utils.set_random_seed(0)
    weights = [tf.Variable(tf.random.normal([64, 80])), tf.Variable(tf.zeros([80]))]
    return weights, tf_topk.SparseExchange(weights, density=0.05)


def train(weights, exchange, steps=3):
    for step in range(steps):
        exchange([tf.random.stateless_normal(w.shape, [step, 1]) for w in weights])


# -- one replica, in this process ---------------------------------------------------------------


def test_one_replica_checkpoints_hold_the_value_and_restore_it_exactly(tmp_path):
    weights, exchange = make_exchange()
    train(weights, exchange)
    assert all(keeps_replica_values(v) for v in exchange.memory_state)
    residual = exchange.residuals[0].numpy()
    assert np.abs(residual).sum() > 0
    path = tf.train.Checkpoint(exchange=exchange).save(str(tmp_path / "ckpt"))
    assert dict(tf.train.list_variables(path))["exchange/memory_state/0/.ATTRIBUTES/VARIABLE_VALUE"] == [64, 80]
    np.testing.assert_array_equal(tf.train.load_variable(path, "exchange/memory_state/0/.ATTRIBUTES/VARIABLE_VALUE"),
                                  residual)

    _, restored = make_exchange()
    tf.train.Checkpoint(exchange=restored).restore(path).assert_consumed()
    np.testing.assert_array_equal(restored.residuals[0].numpy(), residual)


def test_rows_of_several_replicas_restore_into_one_as_their_sum(tmp_path):
    rows = np.random.default_rng(0).normal(size=(2, 64, 80)).astype("float32")
    saved_by_two = tf.Module()  # what a 2-replica run writes under the residual's key
    saved_by_two.memory_state = [tf.Variable(rows)]
    path = tf.train.Checkpoint(exchange=saved_by_two).save(str(tmp_path / "ckpt"))

    _, exchange = make_exchange()
    tf.train.Checkpoint(exchange=exchange).restore(path).assert_consumed()
    np.testing.assert_array_equal(exchange.residuals[0].numpy(), rows[0] + rows[1])


def test_keras_weights_file_rows_restore_into_one_replica_as_their_sum():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(80)])
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.05)
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    store = {str(i): v.numpy() for i, v in enumerate(optimizer.variables)}  # what save_own_variables writes
    position = next(i for i, v in enumerate(optimizer.variables) if v is optimizer.residuals[0])
    rows = np.random.default_rng(1).normal(size=(2, 64, 80)).astype("float32")
    store[str(position)] = rows  # as two replicas saved it
    optimizer.load_own_variables(store)
    np.testing.assert_array_equal(optimizer.residuals[0].numpy(), rows[0] + rows[1])


def test_a_saved_value_of_another_shape_is_refused():
    variable = keep_replica_values(tf.Variable(tf.zeros([3, 4]), name="residual_x",
                                               synchronization=tf.VariableSynchronization.ON_READ,
                                               aggregation=tf.VariableAggregation.SUM))
    with pytest.raises(ValueError, match=r"the saved value of residual_x:0 has shape \(4, 3\); expected \(3, 4\)"):
        restore_value(variable, np.zeros((4, 3), "float32"))
    restore_value(variable, np.ones((5, 3, 4), "float32"))  # 5 replicas' rows: their sum
    np.testing.assert_array_equal(variable.numpy(), np.full((3, 4), 5.0))
    np.testing.assert_array_equal(saved_value(variable).numpy(), np.full((3, 4), 5.0))
    assert keep_replica_values(variable) is variable  # idempotent


# -- several replicas in one process ------------------------------------------------------------


@pytest.mark.slow  # one TensorFlow process, 3 logical CPUs: ~25 s
def test_several_replicas_in_one_process(tmp_path):
    env = {**os.environ, **worker_env()}
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([*PYTHON, str(WORKERS_DIR / "replica_state_local.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-5000:]
    shapes = load_json(tmp_path / "report.json")["checkpoint_shapes"]
    assert shapes["exchange/memory_state/0/.ATTRIBUTES/VARIABLE_VALUE"] == [2, 64, 80]  # one row per replica


# -- two workers --------------------------------------------------------------------------------

STEPS, SAVE_EVERY, PAUSE_AT = 24, 4, 10  # killed before step 10: resumes from the checkpoint of step 8


def _run(ckpt, out, *options, **kwargs):
    return run_script("checkpoint_loop.py", "--ckpt", ckpt, "--out", out, "--steps", STEPS, "--save-every",
                      SAVE_EVERY, *options, **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two workers, STEPS steps without a failure: (checkpoint folder, output folder). The resumed run
    must end as this one; its last checkpoint (step STEPS) is what one process restores."""
    ckpt, out = tmp_path_factory.mktemp("uninterrupted") / "ckpt", tmp_path_factory.mktemp("uninterrupted_out")
    assert_ok(_run(ckpt, out, timeout=110))
    return ckpt, out


@pytest.mark.slow  # 2 TensorFlow workers, twice (killed, restarted), and the uninterrupted run
def test_custom_loop_killed_and_restarted_resumes_bitwise_with_each_workers_state(uninterrupted, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(_run, ckpt, out, "--pause-at", PAUSE_AT, restarts=1, timeout=110)
        try:
            deadline = time.monotonic() + 100
            # Killed once worker 1 waits before step 10 and the chief has committed step 8's checkpoint.
            while not ((out / "paused.json").exists() and (ckpt / "checkpoint").exists()
                       and f"ckpt-{PAUSE_AT - PAUSE_AT % SAVE_EVERY}\"" in (ckpt / "checkpoint").read_text()):
                assert not future.done() and time.monotonic() < deadline, "worker 1 never reached its pause"
                time.sleep(0.05)
            os.kill(load_json(out / "paused.json")["pid"], signal.SIGKILL)
            result = future.result(timeout=110)
        finally:
            kill_recorded_workers(out)
    assert_ok(result)
    assert result.attempts == 2 and result.earlier[0].returncodes[1] == -signal.SIGKILL
    for worker in (0, 1):
        assert load_json(out / f"attempt0_worker{worker}.json")["restored_step"] is None
        assert load_json(out / f"attempt1_worker{worker}.json")["restored_step"] == 8

    reference_out = uninterrupted[1]
    for worker in (0, 1):
        for name in (f"worker{worker}.npz", f"worker{worker}_state.npz"):
            resumed, reference = load_weights(out / name), load_weights(reference_out / name)
            for a, b in zip(resumed, reference, strict=True):
                np.testing.assert_array_equal(a, b)
    states = [load_weights(out / f"worker{worker}_state.npz") for worker in (0, 1)]
    assert len(states[0]) == 5  # residual and velocity of the kernel, velocities of the 3 small variables
    assert not np.array_equal(states[0][0], states[1][0])  # each worker had its own residual


@pytest.mark.slow  # one process, from the uninterrupted run's checkpoint: ~10 s on 2 cores
def test_a_checkpoint_of_two_workers_restored_by_one_process_keeps_the_total(uninterrupted, tmp_path):
    ckpt, out = uninterrupted
    single = tmp_path / "single"
    single.mkdir()
    env = {**os.environ, **worker_env()}
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([*PYTHON, str(WORKERS_DIR / "checkpoint_loop.py"), "--ckpt", str(ckpt), "--out",
                           str(single), "--restore-only"], env=env, capture_output=True, text=True, timeout=110,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert load_json(single / "attempt0_worker0.json")["restored_step"] == STEPS
    workers = [load_weights(out / f"worker{worker}_state.npz") for worker in (0, 1)]
    restored = load_weights(single / "worker0_state.npz")
    # Per-worker state (residual, velocity) differs; the dense-path velocity is the same on both.
    same = [np.array_equal(first, second) for first, second in zip(*workers, strict=True)]
    assert not same[0] and any(same), same
    for first, second, one, replicated in zip(*workers, restored, same, strict=True):
        # sum / 1 replica keeps the total; state the same on every worker comes back as it was
        np.testing.assert_array_equal(one, first if replicated else first + second)
    for a, b in zip(load_weights(out / "worker0.npz"), load_weights(single / "worker0.npz"), strict=True):
        np.testing.assert_array_equal(a, b)
