"""benchmarks/suite_solution.py, RESULTS' look at the solutions of the task suite: a short paired run,
the measures it keeps, the resumed file, sharpness's arithmetic and the arguments it refuses."""

import json
import subprocess
import sys

import numpy as np
import pytest

from multiworker import PYTHON, REPO_ROOT, subprocess_env

SCRIPT = str(REPO_ROOT / "benchmarks" / "suite_solution.py")


def _solution(argv):
    return subprocess.run([*PYTHON, SCRIPT, *argv], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_a_short_paired_run_keeps_each_solution_and_resumes(tmp_path):
    out = tmp_path / "solution.jsonl"
    argv = ["--task", "digits", "--density", "0.01", "--seeds", "2", "--epochs", "1", "--min-size", "5000",
            "--out", str(out)]
    proc = _solution(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["config"], r["seed"]) for r in records] == [
        ("dense", 0), ("default min_size=5000", 0), ("dense", 1), ("default min_size=5000", 1)]
    for record in records:
        assert 0.0 < record["test_accuracy"] <= 1.0 and record["train_loss"] > 0 and 0.05 < record["confidence"] <= 1
        # digits' MLP 64-256-256-10: kernels and biases, each moved from its start (biases start at 0).
        assert [v["entries"] for v in record["variables"]] == [16384, 256, 65536, 256, 2560, 10]
        for variable in record["variables"]:
            assert variable["moved"] > 0 and variable["norm"] > 0
        assert [v["norm"] for v in record["variables"]][1] == pytest.approx(record["variables"][1]["moved"])
    assert "default min_size=5000 against dense, 2 seeds paired" in proc.stdout
    again = _solution(argv)  # everything is in the file already: nothing is trained again
    assert again.returncode == 0 and len(out.read_text().splitlines()) == 4 and "test accuracy" not in again.stderr


def test_sharpness_is_the_mean_loss_increase_and_restores_the_weights():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import keras

    import suite_solution

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    before = [v.numpy() for v in model.trainable_variables]
    seen = []

    def squared_norm():  # a "loss" whose increase under a move of rho times each norm is known
        value = sum(float(np.sum(v.numpy() ** 2)) for v in model.trainable_variables)
        seen.append(value)
        return value

    rho = 0.1
    found = suite_solution.sharpness(model, squared_norm, rho, np.random.default_rng(0), directions=3)
    assert len(seen) == 4 and found == pytest.approx(np.mean(seen[1:]) - seen[0])
    # |w + rho |w| u|^2 - |w|^2 = rho^2 |w|^2 + 2 rho |w| <w, u> per variable (u a unit vector): bounded.
    norms = [np.linalg.norm(v) for v in before]
    assert abs(found) <= sum(rho ** 2 * n ** 2 + 2 * rho * n ** 2 for n in norms) + 1e-6
    for variable, value in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


@pytest.mark.parametrize("argv, message", [
    (["--task", "colors", "--configs", "default,bogus", "--out", "x"], "--configs must name configurations of"),
    (["--task", "colors", "--density", "0", "--out", "x"], "--density must be in (0, 1], got 0.0"),
    (["--task", "colors", "--seeds", "0", "--out", "x"], "--seeds must be >= 1, got 0"),
    (["--task", "colors", "--min-size", "0", "--out", "x"], "--min-size must be >= 1, got 0"),
    (["--task", "imagenet", "--out", "x"], "invalid choice: 'imagenet'"),
])
def test_bad_arguments_are_named(argv, message):
    proc = _solution(argv)
    assert proc.returncode == 2 and message in proc.stderr
