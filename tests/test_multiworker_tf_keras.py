"""tf_topk.tf_keras.TopKOptimizer with Keras 2's own model.fit across real worker processes.

Every worker runs tests/workers/tf_keras_fit.py, which sets TF_USE_LEGACY_KERAS=1
before importing TensorFlow (tf.keras is then tf_keras), under
MultiWorkerMirroredStrategy through `tf_topk.launch` (TF_CONFIG on free ports;
every process is stopped before a test returns), or under MirroredStrategy
with two logical CPUs in one process. Digits: 1440 training samples, global
batch 32, 45 steps an epoch.
"""

import json
import os
import signal
import subprocess

import numpy as np
import pytest

from multiworker import (FORKSERVER, KERAS_2, LAUNCH_CLI, PYTHON, REPO_ROOT, WORKERS_DIR, assert_ok,
                         kill_when_written, load_json, load_weights, run_script, subprocess_env, worker_env)

pytestmark = pytest.mark.slow

SCRIPT = "tf_keras_fit.py"
EPOCHS = 5
STEPS_PER_EPOCH = 1440 // 32


def fit(out, *args, workers=2):
    """Run the worker script on `workers` workers; returns (reports, weights) per worker."""
    out.mkdir(parents=True)
    assert_ok(run_script(SCRIPT, "--out", out, *args, workers=workers, env=KERAS_2))
    return ([load_json(out / f"worker{i}.json") for i in range(workers)],
            [load_weights(out / f"worker{i}.npz") for i in range(workers)])


def assert_identical(weights):
    """Every worker holds bitwise the same weights."""
    for other in weights[1:]:
        for a, b in zip(weights[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def two_workers_topk(tmp_path_factory):
    # 0.01 after a 20-step warm-up (the default's, shortened): the last step's statistics are 0.01's.
    return fit(tmp_path_factory.mktemp("tf_keras") / "topk", "--density", "0.01", "--density-warmup-steps", "20",
               "--epochs", EPOCHS)


def test_fit_reaches_dense_accuracy_with_identical_weights_on_both_workers(two_workers_topk, tmp_path):
    dense, dense_weights = fit(tmp_path / "dense", "--dense", "--epochs", EPOCHS)
    topk, topk_weights = two_workers_topk
    assert_identical(dense_weights)
    assert_identical(topk_weights)
    for report in topk:
        assert report["keras"].startswith("tf_keras") and report["replicas"] == 2
        assert report["iterations"] == EPOCHS * STEPS_PER_EPOCH and report["skipped_steps"] == 0
    assert topk[0]["test_accuracy"] >= dense[0]["test_accuracy"] - 0.01, (topk[0], dense[0])
    assert topk[0]["test_accuracy"] > 0.85
    stats = topk[0]["compression"]
    assert stats["density"] == pytest.approx(82 / 8192)  # the 64x128 kernel; the rest is below min_size
    assert 0 < stats["bytes_sent"] < stats["bytes_dense"] / 5


def test_mirrored_strategy_on_two_logical_cpus_trains_as_two_workers(two_workers_topk, tmp_path):
    out = tmp_path / "mirrored"
    out.mkdir()
    completed = subprocess.run([*PYTHON, str(WORKERS_DIR / SCRIPT), "--out", str(out), "--density", "0.01",
                                "--density-warmup-steps", "20", "--epochs", str(EPOCHS), "--logical-cpus", "2"],
                               env=subprocess_env(**KERAS_2), capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    mirrored, workers = load_json(out / "worker0.json"), two_workers_topk[0][0]
    assert mirrored["replicas"] == 2
    assert mirrored["compression"]["bytes_sent"] == workers["compression"]["bytes_sent"]
    np.testing.assert_allclose(mirrored["loss"], workers["loss"], rtol=1e-3)
    assert abs(mirrored["test_accuracy"] - workers["test_accuracy"]) <= 0.01


def test_checkpoint_restored_in_new_processes_keeps_residuals_and_velocities(tmp_path):
    """Momentum correction: both residuals and velocities are per-replica state. What the
    replicas held together comes back: each replica its own value where the checkpoint
    keeps every replica's, else sum / 2 (a checkpoint that keeps their sum)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    common = ("--momentum", "0.9", "--momentum-correction", "--learning-rate", "0.05", "--epochs", "2",
              "--checkpoint", ckpt, "--out", out)
    out.mkdir()
    assert_ok(run_script(SCRIPT, "--phase", "save", *common, env=KERAS_2))
    assert_ok(run_script(SCRIPT, "--phase", "resume", *common, env=KERAS_2))
    saved = [np.load(out / f"save_worker{i}.npz") for i in range(2)]
    restored = [np.load(out / f"resume_worker{i}.npz") for i in range(2)]
    for name in ("residual", "velocity"):
        assert not np.array_equal(saved[0][name], saved[1][name])  # per replica
        assert float(np.abs(saved[0][name]).sum()) > 0
        total = saved[0][name] + saved[1][name]
        np.testing.assert_allclose(restored[0][name] + restored[1][name], total, rtol=1e-6, atol=1e-6)
        own = all(np.array_equal(restored[i][name], saved[i][name]) for i in (0, 1))
        halves = all(np.allclose(restored[i][name], total / 2, rtol=1e-6, atol=1e-7) for i in (0, 1))
        assert own or halves, name
    assert int(restored[0]["iterations"]) == int(saved[0]["iterations"]) == 2 * STEPS_PER_EPOCH
    before, after = load_json(out / "worker0.json"), load_weights(out / "worker0.npz")
    assert before["iterations"] == 4 * STEPS_PER_EPOCH  # 2 epochs more after the restore
    assert before["inner_momentum_slots"] == 0  # the velocity is the exchange's, not the inner SGD's
    assert_identical([after, load_weights(out / "worker1.npz")])


def test_worker_killed_mid_training_resumes_from_the_shared_backup(tmp_path):
    """tf_keras.callbacks.BackupAndRestore, one directory for both workers. Worker 1 is
    SIGKILLed before batch 4 of epoch 3 (index 2); the launcher (--restarts 1) starts both
    again, and they resume after epoch 2 with the residuals from the backup."""
    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    launcher = subprocess.Popen(
        [*LAUNCH_CLI, "--workers", "2", "--restarts", "1", "--timeout", "110", str(FORKSERVER), str(WORKERS_DIR / SCRIPT),
         "--epochs", "6", "--backup-dir", str(backup), "--pause-at", "2:4", "--out", str(out)],
        cwd=REPO_ROOT, env={**os.environ, **worker_env(**KERAS_2)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        kill_when_written(launcher, out / "paused")
        output, _ = launcher.communicate(timeout=110)
    finally:
        if launcher.poll() is None:  # SIGTERM: the launcher stops every worker and never restarts
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.communicate(timeout=30)
    assert launcher.returncode == 0, output[-5000:]
    assert "[launch] worker 1 exited with -9 (SIGKILL); restarting all workers, attempt 2 of 2" in output
    for worker in (0, 1):
        first, second = (load_json(out / f"attempt{a}_worker{worker}.json") for a in (0, 1))
        assert first["epochs"] == [0, 1, 2] and first["restored_residual_l1"] == 0.0
        assert second["epochs"] == [2, 3, 4, 5]  # the 2 epochs backed up are not trained again
        assert second["restored_residual_l1"] > 0  # the residuals came back with the backup
        assert load_json(out / f"worker{worker}.json")["iterations"] == 6 * STEPS_PER_EPOCH
    assert_identical([load_weights(out / f"worker{i}.npz") for i in (0, 1)])
    assert load_json(out / "worker0.json")["test_accuracy"] > 0.85
    assert os.listdir(backup) == []  # the backup is deleted when fit ends


def test_mixed_precision_two_workers_train_with_identical_weights(tmp_path):
    """compile wraps TopKOptimizer in tf_keras's LossScaleOptimizer, which calls the exchange
    (aggregate_gradients) and skips on its sums, the same on every replica."""
    reports, weights = fit(tmp_path / "mixed", "--mixed-precision", "--density", "0.01", "--density-warmup-steps", "20",
                           "--epochs", "3")
    assert reports[0]["loss_scale_optimizer"] == "LossScaleOptimizerV3"
    assert reports[0]["test_accuracy"] > 0.8
    assert reports[0]["compression"]["bytes_sent"] < reports[0]["compression"]["bytes_dense"] / 5
    assert_identical(weights)
    assert json.dumps(reports[0]["loss"]) == json.dumps(reports[1]["loss"])
