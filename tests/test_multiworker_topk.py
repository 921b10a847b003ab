"""TopKOptimizer with real worker processes: MultiWorkerMirroredStrategy over localhost.

Workers start through `tf_topk.launch.run_workers` (TF_CONFIG on free ports), which
stops every process it started before returning. The runs of examples/digits_fit.py
that tests compare are trained by one cluster per size (`two_workers`,
`three_workers`), one after the other, so TensorFlow starts once per worker.
"""

import json
import re
import subprocess

import numpy as np
import pytest

from multiworker import PYTHON, REPO_ROOT, WORKERS_DIR, assert_ok, run_script, run_workers, worker_env
from tensorflow_warnings import tensorflow_warnings

pytestmark = pytest.mark.slow

DIGITS_FIT = str(REPO_ROOT / "examples" / "digits_fit.py")
EPOCHS = "5"  # 225 steps
# The two-worker runs, trained one after the other by the same two worker processes (one TensorFlow
# start-up and one cluster for all): name -> examples/digits_fit.py's options. A fixed density warms up
# for 100 steps (a quarter of the default's 400, which tests/test_density_warmup.py pins).
SGD_MOMENTUM = "--momentum 0.9 --learning-rate 0.05"
TOPK = "--density 0.01 --density-warmup-steps 100"
TWO_WORKER_RUNS = {
    "dense": "--dense",
    "topk": TOPK,
    "autopilot": "--autopilot",
    "sparse": f"{TOPK} --momentum-correction --sparse-updates {SGD_MOMENTUM}",
    "adaptive": "--adaptive",
    "dense_momentum": f"--dense {SGD_MOMENTUM}",
    "mc": f"--density 0.001 --momentum-correction --warmup-epochs 2 {SGD_MOMENTUM}",
    "int8": "--density 0.02 --density-warmup-steps 100 --exchange-mode allgather_int8",
    "chunk": "--density 0.04 --density-warmup-steps 100 --exchange-mode allgather_chunk",
    "inside_warmup": "--density 0.01 --epochs 1",  # 45 steps of a 400-step warm-up: said by the chief only
    # Last: the mixed_float16 policy is global (each run sets its own).
    "mixed": "--density 0.01 --density-warmup-steps 20 --mixed-precision --epochs 3",
}


def fit_matrix(workers, out, runs):
    """Train every run of `runs` in one cluster of `workers` processes; name -> (reports, weights), and
    "outputs" -> each worker's output."""
    argv = [*PYTHON, str(WORKERS_DIR / "fit_matrix.py"), str(out),
            *(f"{name}=--epochs {EPOCHS} {options}" for name, options in runs.items())]
    result = run_workers(workers, argv, env=worker_env(), timeout=900)
    assert_ok(result)
    trained = {name: ([json.loads((out / name / f"worker{i}.json").read_text()) for i in range(workers)],
                      [np.load(out / name / f"worker{i}.npz") for i in range(workers)])
               for name in runs}
    return {**trained, "outputs": result.outputs}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    return fit_matrix(2, tmp_path_factory.mktemp("two_workers"), TWO_WORKER_RUNS)


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory):
    """Top-k alone: its dense reference is the two workers' (the same global batch, loss and learning
    rate, so the same dense gradient up to the order of its additions)."""
    return fit_matrix(3, tmp_path_factory.mktemp("three_workers"), {"topk": TOPK})


def assert_identical(archives):
    """The same arrays, bitwise, in every worker's .npz."""
    for other in archives[1:]:
        assert archives[0].files == other.files
        for name in archives[0].files:
            np.testing.assert_array_equal(archives[0][name], other[name])


@pytest.mark.parametrize("workers", [2, 3])
def test_topk_fit_matches_dense_accuracy_with_identical_weights(workers, two_workers, request):
    dense, dense_weights = two_workers["dense"]
    topk, topk_weights = request.getfixturevalue({2: "two_workers", 3: "three_workers"}[workers])["topk"]
    assert_identical(dense_weights)
    assert_identical(topk_weights)
    assert all(r["replicas"] == workers for r in topk)
    assert topk[0]["test_accuracy"] >= dense[0]["test_accuracy"] - 0.01, (topk[0], dense[0])
    assert topk[0]["test_accuracy"] > 0.9
    # Dense's bytes for this many workers (a ring all-reduce sends 2 (n - 1) / n of the gradient).
    assert topk[0]["bytes_per_step"] < topk[0]["dense_bytes_per_step"] / 10
    assert topk[0]["skipped_steps"] == 0


def test_autopilot_two_workers_measure_one_link_and_keep_identical_weights(two_workers):
    """density="autopilot": each worker times the collectives, both take the slower numbers, so both
    make the same choices every step and end with the same weights."""
    reports, weights = two_workers["autopilot"]
    assert_identical(weights)
    lines = [r["autopilot"] for r in reports]
    assert all(line.startswith("tf_topk autopilot: calibration (") for line in lines)
    # Each line opens with the worker's own calibration time; what was found and chosen is the same.
    assert lines[0].split("): ", 1)[1] == lines[1].split("): ", 1)[1]
    assert reports[0]["density"] == "autopilot" and reports[0]["test_accuracy"] > 0.9
    assert reports[0]["compression"]["exchange_mode"] == reports[1]["compression"]["exchange_mode"]


def test_pairs_in_32_bit_words_cross_real_workers_with_identical_weights(two_workers):
    """exchange_mode="allgather_int8" at twice top-k's density: the words cross the collective runtime
    between processes and decode to the same sum on both workers; the bytes those pairs take are top-k's
    at half the density, and the accuracy is dense's."""
    reports, weights = two_workers["int8"]
    topk, _ = two_workers["topk"]
    dense, _ = two_workers["dense"]
    assert_identical(weights)
    assert reports[0]["compression"]["exchange_mode"] == 4.0 and reports[0]["skipped_steps"] == 0
    assert reports[0]["compression"]["selected"] > 1.9 * topk[0]["compression"]["selected"]
    assert reports[0]["bytes_per_step"] < 1.1 * topk[0]["bytes_per_step"]
    assert reports[0]["test_accuracy"] >= dense[0]["test_accuracy"] - 0.01, (reports[0], dense[0])


def test_each_chunks_top_entries_in_14_bits_cross_real_workers_with_identical_weights(two_workers):
    """exchange_mode="allgather_chunk" at four times top-k's density: the bit fields cross the collective
    runtime between processes and decode to the same sum on both workers; four times the entries cost less
    than top-k's 8-byte pairs, and the accuracy is dense's."""
    reports, weights = two_workers["chunk"]
    topk, _ = two_workers["topk"]
    dense, _ = two_workers["dense"]
    assert_identical(weights)
    assert reports[0]["compression"]["exchange_mode"] == 5.0 and reports[0]["skipped_steps"] == 0
    assert reports[0]["compression"]["selected"] > 3.5 * topk[0]["compression"]["selected"]
    assert reports[0]["bytes_per_step"] < topk[0]["bytes_per_step"]
    assert reports[0]["test_accuracy"] >= dense[0]["test_accuracy"] - 0.01, (reports[0], dense[0])


def test_sparse_updates_with_momentum_correction_keep_workers_identical(two_workers):
    """Two workers, each applying every replica's pairs in place (sparse_updates):
    the same order of additions on both, so the same weights bitwise."""
    reports, weights = two_workers["sparse"]
    assert_identical(weights)
    assert reports[0]["test_accuracy"] > 0.9 and reports[0]["skipped_steps"] == 0


def test_adaptive_density_two_workers_agree_on_k_every_step(two_workers):
    """Each worker proposes a density from its own gradient; the mean travels
    in the step's collective, so both use the same k (identical weights). The
    entries each sends may differ under the default exchange ("auto": agreed
    indices at this density), where a worker can hold 0 at an index the other
    nominated; k cannot."""
    reports, weights = two_workers["adaptive"]
    assert_identical(weights)
    assert reports[0]["k_fractions"] == reports[1]["k_fractions"]
    assert len(set(reports[0]["k_fractions"])) > 1, reports[0]["k_fractions"]  # it moves
    assert reports[0]["test_accuracy"] > 0.9 and reports[0]["skipped_steps"] == 0


def test_fit_makes_tensorflow_warn_of_nothing(two_workers):
    """Eight `fit`s with the wrapper (every exchange mode the runs take, Adam and SGD, mixed precision):
    no worker's output holds a TensorFlow warning."""
    assert [tensorflow_warnings(output) for output in two_workers["outputs"]] == [[], []]


def test_the_chief_alone_says_what_the_autopilot_decided(two_workers):
    """One line from worker 0: the decision, the step times behind it, how to override it (the
    calibration's figures only with TF_TOPK_VERBOSE=1); nothing from worker 1."""
    chief, other = two_workers["outputs"]
    lines = [line for line in chief.splitlines() if line.startswith("tf_topk autopilot:")]
    assert len(lines) == 1 and re.search(r": a step (timed|predicted) .*; density=", lines[0]), lines
    assert "calibration (" not in chief and "tf_topk autopilot" not in other


def test_the_chief_alone_announces_the_warmup(two_workers):
    """The runs at a fixed density of 0.01 warm up; the line that says so comes from worker 0 only."""
    chief, other = two_workers["outputs"]
    assert "tf_topk: density 0.01 after a 100-step warm-up" in chief
    assert "warm-up" not in other


def test_two_logical_cpus_in_one_process_match_two_workers(two_workers, tmp_path):
    workers, _ = two_workers["topk"]
    out = tmp_path / "mirrored"
    env = worker_env()
    env.pop("TF_CONFIG", None)
    completed = subprocess.run([*PYTHON, DIGITS_FIT, "--epochs", EPOCHS, "--verbose", "0", "--out", str(out),
                                *TOPK.split(), "--logical-cpus", "2"],
                               env=env, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    mirrored = json.loads((out / "worker0.json").read_text())
    assert mirrored["replicas"] == 2
    assert mirrored["bytes_per_step"] == workers[0]["bytes_per_step"]
    assert abs(mirrored["test_accuracy"] - workers[0]["test_accuracy"]) <= 0.015
    assert abs(mirrored["loss"][-1] - workers[0]["loss"][-1]) <= 0.05


def test_checkpoint_restore_in_new_processes_gives_each_worker_its_residual(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    assert_ok(run_script("checkpoint_resume.py", "--phase", "save", "--ckpt", ckpt, "--out", out, timeout=240))
    assert_ok(run_script("checkpoint_resume.py", "--phase", "resume", "--ckpt", ckpt, "--out", out, timeout=240))
    saved = [np.load(out / f"save_worker{i}.npy") for i in range(2)]
    restored = [np.load(out / f"resume_worker{i}.npy") for i in range(2)]
    assert not np.array_equal(saved[0], saved[1])  # residuals are per replica
    assert float(np.abs(saved[0]).sum()) > 0
    # The checkpoint holds every worker's residual (tf_topk.replica_state): each gets its own back.
    for before, after in zip(saved, restored, strict=True):
        np.testing.assert_array_equal(after, before)
    before = json.loads((out / "save_worker0.json").read_text())
    after = json.loads((out / "resume_worker0.json").read_text())
    assert after["iterations_restored"] == before["iterations"] > 0
    assert after["loss"][0] < before["loss"][0]  # training resumed, not restarted


def test_mixed_float16_two_workers_train_with_identical_weights(two_workers):
    """compile wraps TopKOptimizer in LossScaleOptimizer; the exchange runs inside its branch."""
    reports, weights = two_workers["mixed"]
    assert reports[0]["test_accuracy"] > 0.85
    assert reports[0]["compression"]["bytes_sent"] < reports[0]["dense_bytes_per_step"] / 10
    assert_identical(weights)


def test_mixed_float16_overflow_on_one_worker_is_skipped_by_all(tmp_path):
    """Only worker 0 overflows at step 0: without a global finite check worker 1 waits forever."""
    result = run_script("loss_scale_overflow.py", tmp_path, timeout=150)
    assert_ok(result)
    reports = [np.load(tmp_path / f"worker{i}.npz") for i in range(2)]
    for report in reports:
        assert int(report["iterations"]) == 5  # 6 steps, step 0 skipped
        assert float(report["scale"]) == float(report["initial_scale"]) / 2
        assert int(report["skipped_by_topk"]) == 0  # LossScaleOptimizer skipped it before the exchange
    assert_identical(reports)


def test_momentum_correction_two_workers_keep_identical_weights_and_dense_accuracy(two_workers):
    """DGC at density 0.001 with its warm-up, against momentum SGD with the dense all-reduce."""
    dense, _ = two_workers["dense_momentum"]
    corrected, weights = two_workers["mc"]
    assert_identical(weights)
    assert corrected[0]["test_accuracy"] >= dense[0]["test_accuracy"] - 0.02, (corrected[0], dense[0])
    assert corrected[0]["bytes_per_step"] < dense[0]["bytes_per_step"] / 10


def test_a_fit_that_ends_inside_its_warm_up_is_told_by_the_chief_alone(two_workers):
    """The callback runs outside the strategy's scope: the chief is its model's strategy's chief."""
    said = [sum("this fit ends at step 45, inside the 400-step warm-up" in line for line in output.splitlines())
            for output in two_workers["outputs"]]
    assert said == [1, 0]
