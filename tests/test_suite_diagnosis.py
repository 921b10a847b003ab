"""benchmarks/suite_diagnosis.py, RESULTS' per-layer diagnosis of the task suite: one short run of a
task, what it reports per sparsified variable, and the arguments it refuses."""

import json
import subprocess

import pytest

from multiworker import PYTHON, REPO_ROOT, subprocess_env

SCRIPT = str(REPO_ROOT / "benchmarks" / "suite_diagnosis.py")


def _diagnosis(argv):
    return subprocess.run([*PYTHON, SCRIPT, *argv], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_a_short_run_reports_each_sparsified_variable_of_the_task():
    # Two epochs of 375 steps with a warm-up of a tenth: 675 steps counted after it.
    proc = _diagnosis(["--task", "ratings", "--density", "0.01", "--config", "warmup-tenth", "--epochs", "2",
                       "--every", "50", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["steps"] == 750 and result["warmup"] == 75 and 0.0 < result["test_accuracy"] <= 1.0
    rows = {row["entries"]: row for row in result["variables"]}
    assert sorted(rows) == [6144, 8000, 12800]  # the dense kernel, item and user embeddings
    for entries, row in rows.items():
        assert row["k"] == -(-entries // 100)
        assert 0.0 < row["mass_sent"] < 1.0 and 0.0 < row["sent_once"] <= row["touched"] <= 1.0
        assert 0 <= row["age_p50"] <= row["age_p90"] <= 675 and 0.0 <= row["lr_left"] <= 1.0


@pytest.mark.parametrize("argv, message", [
    (["--task", "ratings", "--density", "0"], "--density must be in (0, 1], got 0.0"),
    (["--task", "ratings", "--every", "0"], "--every must be >= 1, got 0"),
    (["--task", "ratings", "--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--task", "imagenet"], "invalid choice: 'imagenet'"),
])
def test_bad_arguments_are_named(argv, message):
    proc = _diagnosis(argv)
    assert proc.returncode == 2 and message in proc.stderr
