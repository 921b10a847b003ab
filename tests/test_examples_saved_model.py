"""examples/saved_model_training.py: train, save, resume in new processes, and the missing-import error.

The runs: `train` 30 steps; `resume` 10 steps twice (each a new process that
loads what the previous one saved); an uninterrupted `train` of 50 steps as
the reference, started alongside the first; and `resume --no-import`.
"""

import os
import subprocess

import numpy as np
import pytest

from multiworker import PYTHON, REPO_ROOT, load_json, worker_env
from tensorflow_warnings import tensorflow_warnings

EXAMPLE = str(REPO_ROOT / "examples" / "saved_model_training.py")
TIMEOUT_S = 180  # a run takes ~6 s; generous for a loaded 2-core machine
TRAIN_STEPS, RESUME_STEPS = 30, 10


def start(*args):
    env = {**os.environ, **worker_env()}
    env.pop("TF_CONFIG", None)
    return subprocess.Popen([*PYTHON, EXAMPLE, *map(str, args)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=TIMEOUT_S):
    """(returncode, stdout, stderr); the process is killed if it overruns."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} timed out after {timeout}s\n{out}\n{err[-4000:]}")
    return proc.returncode, out, err


def run_ok(*args):
    """(stdout, stderr) of a run that must exit 0."""
    code, out, err = finish(start(*args))
    assert code == 0, f"{args}: exit {code}\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
    return out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saved_model")
    export = tmp / "model"
    procs = [start("train", "--steps", TRAIN_STEPS, "--export", export, "--summary-json", tmp / "train.json"),
             start("train", "--steps", TRAIN_STEPS + 2 * RESUME_STEPS, "--export", tmp / "reference",
                   "--summary-json", tmp / "reference.json")]
    try:
        results = [finish(p) for p in procs]
    finally:
        for p in procs:  # a failed or timed-out sibling must not outlive the fixture
            if p.poll() is None:
                p.kill()
                p.wait()
    for (code, out, err), p in zip(results, procs):
        assert code == 0, f"{p.args}: exit {code}\n{out}\n{err[-4000:]}"
    stdout, stderr = {"train": results[0][1]}, {"train": results[0][2]}
    for i in (1, 2):
        stdout[f"resume{i}"], stderr[f"resume{i}"] = run_ok("resume", "--steps", RESUME_STEPS, "--export", export,
                                                            "--summary-json", tmp / f"resume{i}.json")
    summaries = {name: load_json(tmp / f"{name}.json") for name in ("train", "reference", "resume1", "resume2")}
    return export, stdout, summaries, stderr


@pytest.mark.slow
def test_resume_restores_weights_step_and_residuals(runs):
    export, stdout, s, _ = runs
    train, resume1 = s["train"], s["resume1"]
    assert resume1["restored_step"] == train["step"] == TRAIN_STEPS
    assert train["residual_norm"] > 0
    assert resume1["restored_residual_norm"] == train["residual_norm"]  # the residuals came back
    assert resume1["restored_dataset_loss"] == train["dataset_loss"]  # so did the weights
    assert f"residual norm {train['residual_norm']:.9g}" in stdout["resume1"]
    # The re-saved model is the one the second resume starts from.
    assert s["resume2"]["restored_step"] == TRAIN_STEPS + RESUME_STEPS
    assert s["resume2"]["restored_residual_norm"] == resume1["residual_norm"]


def test_loss_continues_from_where_it_was(runs):
    _, _, s, _ = runs
    initial, last_saved = s["train"]["losses"][0], s["train"]["losses"][-1]
    first_resumed = s["resume1"]["losses"][0]
    assert last_saved < 0.5 * initial, s["train"]["losses"]
    assert first_resumed < 0.5 * initial, "resumed training started over"
    assert abs(first_resumed - last_saved) < 0.5 * (initial - last_saved)
    # Exactly the losses of an uninterrupted run: weights, momentum, residuals
    # and step all came back, across two save/load round trips.
    resumed = s["resume1"]["losses"] + s["resume2"]["losses"]
    np.testing.assert_allclose(resumed, s["reference"]["losses"][TRAIN_STEPS:], rtol=1e-5, atol=1e-6)


def test_loss_keeps_decreasing(runs):
    _, _, s, _ = runs
    assert s["resume1"]["dataset_loss"] < s["resume1"]["restored_dataset_loss"]
    assert s["resume2"]["dataset_loss"] < s["resume2"]["restored_dataset_loss"]
    assert s["resume2"]["dataset_loss"] < s["train"]["dataset_loss"]


def test_training_saving_and_loading_make_tensorflow_warn_of_nothing(runs):
    """The SavedModel's traced train_step, its export and its load in new processes: no TensorFlow warning."""
    stderr = runs[3]
    assert {name: tensorflow_warnings(text) for name, text in stderr.items()} == {name: [] for name in stderr}


@pytest.mark.slow
def test_load_without_import_explains(runs):
    export = runs[0]
    code, out, err = finish(start("resume", "--steps", 1, "--export", export, "--no-import"))
    assert code == 1, err
    assert "ImportTfTopk>" in err
    assert "Run `import tf_topk.ops` before tf.saved_model.load(...)" in err
    assert "Traceback" not in err


def test_argument_errors():
    code, _, err = finish(start("train", "--steps", 0, "--export", "x"), timeout=60)
    assert code == 2 and "argument --steps: must be an integer >= 1, got 0" in err
    code, _, err = finish(start("resume", "--steps", 1), timeout=60)
    assert code == 2 and "--export" in err
