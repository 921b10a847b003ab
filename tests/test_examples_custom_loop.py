"""examples/custom_loop.py run as real processes: one process, two logical CPUs, two workers.

Each run is a few epochs of a few steps on scikit-learn's digits (offline).
Subprocesses are killed at their timeout; `run_workers` stops every worker
before returning.
"""

import io
import os
import subprocess

import pytest

from multiworker import PYTHON, REPO_ROOT, assert_ok, load_json, run_workers, worker_env
from tensorflow_warnings import tensorflow_warnings

EXAMPLE = str(REPO_ROOT / "examples" / "custom_loop.py")
TIMEOUT_S = 180  # a run takes ~10 s; generous for a loaded 2-core machine


def example_env(env=None):
    full_env = {**os.environ, **worker_env(**(env or {}))}
    full_env.pop("TF_CONFIG", None)  # one process, unless a test sets it
    return full_env


def run_example(*args, env=None, timeout=TIMEOUT_S):
    """Run the example in one process; subprocess.run kills it at the timeout."""
    return subprocess.run([*PYTHON, EXAMPLE, *map(str, args)], cwd=REPO_ROOT, env=example_env(env),
                          capture_output=True, text=True, timeout=timeout)


def run_examples_in_parallel(*arg_lists, timeout=TIMEOUT_S):
    """Run several single-process runs side by side; all are killed if one overruns."""
    procs = [subprocess.Popen([*PYTHON, EXAMPLE, *map(str, args)], cwd=REPO_ROOT, env=example_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in arg_lists]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def check_ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    """One run with two replicas in one process; a NaN gradient on replica 0 at step 3; the density
    (0.01) from the first step."""
    path = tmp_path_factory.mktemp("custom_loop") / "summary.json"
    proc = run_example("--logical-cpus", 2, "--check-replicas", "--epochs", 4, "--nan-at-step", 3,
                       "--density-warmup-steps", 0, "--summary-json", path)
    check_ok(proc)
    return proc, load_json(path)


@pytest.mark.slow
def test_two_replicas_learn(two_replicas):
    proc, summary = two_replicas
    stdout = proc.stdout
    assert summary["replicas"] == 2
    losses = [epoch["loss"] for epoch in summary["epochs"]]
    assert len(losses) == 4
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert summary["test_accuracy"] > 0.75, summary  # chance is 0.1
    assert "test accuracy:" in stdout and "epoch 4/4:" in stdout


def test_two_replicas_hold_identical_weights(two_replicas):
    proc, summary = two_replicas
    stdout = proc.stdout
    checksums = summary["checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums
    assert f"replica 0 weights sha256 {checksums[0]}" in stdout
    assert f"replica 1 weights sha256 {checksums[1]}" in stdout


def test_non_finite_step_is_skipped(two_replicas):
    proc, summary = two_replicas
    stdout = proc.stdout
    assert summary["skipped_steps"] == [3]
    assert "step 3: non-finite gradient on some replica: update skipped" in stdout
    assert summary["weights_finite"]


def test_the_loop_makes_tensorflow_warn_of_nothing(two_replicas):
    """The exchange's code in a custom loop (traced by AutoGraph) gives TensorFlow nothing to warn of."""
    proc, _ = two_replicas
    assert tensorflow_warnings(proc.stderr + proc.stdout) == []


def test_sparse_exchange_sends_less(two_replicas):
    proc, summary = two_replicas
    stdout = proc.stdout
    assert 0 < summary["bytes_sent"] < 0.1 * summary["bytes_dense"], summary
    assert "bytes sent per step and replica:" in stdout


@pytest.mark.slow
def test_two_replicas_match_one_at_full_density(tmp_path):
    # At density 1 everything is sent, so two replicas summing half-batch
    # gradients must train like one replica on the whole batch. A second
    # all-reduce inside the Keras optimizer would double the SGD step here.
    common = ["--density", 1.0, "--epochs", 2, "--steps", 8]
    one, two = run_examples_in_parallel(
        [*common, "--summary-json", tmp_path / "one.json"],
        [*common, "--logical-cpus", 2, "--summary-json", tmp_path / "two.json"])
    check_ok(one)
    check_ok(two)
    one, two = load_json(tmp_path / "one.json"), load_json(tmp_path / "two.json")
    assert (one["replicas"], two["replicas"]) == (1, 2)
    for a, b in zip(one["epochs"], two["epochs"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (one["epochs"], two["epochs"])
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=0.02)


@pytest.mark.slow
def test_one_replica_with_adam():
    proc = run_example("--optimizer", "adam", "--epochs", 3, "--steps", 10)
    check_ok(proc)
    assert tensorflow_warnings(proc.stderr) == []
    assert "no strategy" in proc.stdout and "1 replica(s)" in proc.stdout
    assert "one replica: nothing is exchanged" in proc.stdout
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in proc.stdout.splitlines()
              if line.startswith("epoch ")]
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout


@pytest.mark.slow
def test_two_workers_through_the_launcher(tmp_path):
    argv = [*PYTHON, EXAMPLE, "--epochs", 2, "--steps", 8, "--check-replicas",
            "--summary-json", tmp_path / "summary_{worker}.json"]
    result = run_workers(2, list(map(str, argv)), env=worker_env(), timeout=TIMEOUT_S, cwd=str(REPO_ROOT),
                         stream=io.StringIO())
    assert_ok(result)
    chief, other = (load_json(tmp_path / f"summary_{i}.json") for i in range(2))
    assert chief["strategy"].startswith("MultiWorkerMirroredStrategy") and chief["replicas"] == 2
    assert chief["checksums"] == other["checksums"] and len(chief["checksums"]) == 1
    assert chief["epochs"][0]["loss"] == other["epochs"][0]["loss"]  # reduced over both workers
    assert chief["epochs"][-1]["loss"] < chief["epochs"][0]["loss"]
    assert 0 < chief["bytes_sent"] < chief["bytes_dense"]
    # Only the chief prints the summary; each worker prints its own replica's checksum.
    assert "test accuracy:" in result.outputs[0] and "test accuracy:" not in result.outputs[1]
    assert "epoch 1/2" not in result.outputs[1]
    assert f"replica 1 weights sha256 {other['checksums'][0]}" in result.outputs[1]


@pytest.mark.parametrize("args, message", [
    (["--density", "0"], "argument --density: must be in (0, 1], got 0"),
    (["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    (["--logical-cpus", "2", "--batch-size", "63"], "must be divisible by the 2 replicas"),
])
def test_argument_errors(args, message):
    proc = run_example(*args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_logical_cpus_refused_under_tf_config():
    full_env = {**os.environ, **worker_env(), "TF_CONFIG": '{"cluster": {"worker": ["localhost:1"]}, '
                                                          '"task": {"type": "worker", "index": 0}}'}
    proc = subprocess.run([*PYTHON, EXAMPLE, "--logical-cpus", "2"], cwd=REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--logical-cpus is for single-process runs" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_failed_download_says_so(tmp_path):
    # A proxy on a closed port makes the download fail at once, with or without internet.
    proxy = "http://127.0.0.1:9"
    proc = run_example("--dataset", "mnist", timeout=120,
                       env={"KERAS_HOME": str(tmp_path), "https_proxy": proxy, "HTTPS_PROXY": proxy,
                            "no_proxy": "", "NO_PROXY": ""})
    assert proc.returncode == 1, proc.stderr
    assert "could not download mnist through keras.datasets" in proc.stderr
    assert "--dataset digits works offline" in proc.stderr
    assert "Traceback" not in proc.stderr
