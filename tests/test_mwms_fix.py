"""Tests of tf_topk.keras.mwms_fix (keras#20585) with real 2-worker MWMS runs.

The multi-worker tests start two processes through tf_topk.launch, with
TensorFlow's collective runtime on free localhost ports (~7-17 s each on a
2-core machine; marked `slow`).
"""

import logging

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

from multiworker import assert_ok, load_json, load_weights, run_script

from tf_topk.keras import mwms_fix  # noqa: E402

ERROR_EXIT_CODE = 17  # tests/workers/fit_digits.py: fit or evaluate raised


def _numpy_logits(weights):
    """Logits of the Dense(32, relu) -> Dense(10) model in fit_digits.py, in numpy."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    hidden = np.maximum(x @ weights[0] + weights[1], 0.0)
    return hidden @ weights[2] + weights[3], y


@pytest.mark.slow  # TensorFlow in 2 processes: ~7-17 s on 2 cores
def test_fit_evaluate_predict_under_mwms_with_fix(tmp_path):
    result = run_script(
        "fit_digits.py", "--out", tmp_path, "--fix", "--epochs", "3", "--evaluate", "--predict", workers=2
    )
    assert_ok(result)
    r0, r1 = (load_json(tmp_path / f"result_{i}.json") for i in range(2))
    assert r0["fix_applied"] == mwms_fix._is_known_broken(r0["keras"])

    # It trains: the epoch loss goes down, and the same on both workers.
    losses = r0["loss"]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
    assert losses[2] < 0.8 * losses[0], losses
    assert r1["loss"] == losses

    # Synchronous data parallelism: bitwise-identical weights on both workers.
    w0, w1 = (load_weights(tmp_path / f"weights_{i}.npz") for i in range(2))
    assert [w.shape for w in w0] == [(64, 32), (32,), (32, 10), (10,)]
    for a, b in zip(w0, w1):
        assert a.dtype == b.dtype and np.array_equal(a, b)

    # evaluate() reports the loss and accuracy of the final weights on the whole
    # data set (mean of the two workers' halves, hence the tolerance).
    logits, y = _numpy_logits(w0)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    expected_loss = float(-log_probs[np.arange(len(y)), y].mean())
    expected_accuracy = float((logits.argmax(axis=1) == y).mean())
    assert r0["evaluate"] == r1["evaluate"]
    assert r0["evaluate"]["loss"] == pytest.approx(expected_loss, abs=1e-3)
    assert r0["evaluate"]["accuracy"] == pytest.approx(expected_accuracy, abs=2e-3)

    # predict() (not patched) returns every sample, in order, on each worker.
    for i in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"predict_{i}.npy"), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # TensorFlow in 2 processes: ~7-17 s on 2 cores
def test_unpatched_fit_under_mwms_still_fails(tmp_path):
    """Shows keras#20585 without the fix; fails loudly once upstream fixes it."""
    result = run_script("fit_digits.py", "--out", tmp_path, "--no-fix", "--epochs", "1", workers=2)
    if result.ok:
        version = load_json(tmp_path / "result_0.json")["keras"]
        pytest.fail(
            f"keras#20585 looks FIXED upstream: an unpatched 2-worker MWMS fit trains with Keras "
            f"{version}. Check {mwms_fix.ISSUE_URL}; narrow mwms_fix._KNOWN_BROKEN to the versions "
            f"that still fail and update this test."
        )
    assert result.returncode == ERROR_EXIT_CODE, "expected fit to raise:\n" + result.format_failure()
    errors = [load_json(p) for p in sorted(tmp_path.glob("error_*.json"))]
    assert errors, result.format_failure()
    # The first of the two known failure points: Strategy.reduce on the nested batch.
    assert errors[0]["type"] == "ValueError", errors[0]
    assert "PerReplica" in errors[0]["message"], errors[0]


@pytest.mark.slow  # one TensorFlow process training 4 models: ~10-16 s
def test_fix_changes_nothing_for_other_strategies():
    """No strategy and MirroredStrategy: bitwise-identical training before and after the fix."""
    result = run_script("local_strategies.py", workers=1)
    assert_ok(result)
    assert "OK" in result.outputs[0].splitlines()


@pytest.mark.parametrize(
    "version, broken",
    [
        ("3.0.0", True), ("3.8.0", True), ("3.15.1", True), ("3.15.9.dev2026", True),
        ("3.16.0", False), ("3.16.0.dev2026010100", False), ("4.0.0", False), ("2.15.0", False),
        ("garbage", False),
    ],
)
def test_version_guard(version, broken):
    assert mwms_fix._is_known_broken(version) is broken


def test_unknown_version_patches_nothing_and_says_so(monkeypatch, caplog):
    from keras.src.backend.tensorflow import trainer as trainer_module

    monkeypatch.setattr(keras, "__version__", "3.16.0")
    monkeypatch.setattr(mwms_fix, "_applied", False)
    monkeypatch.setattr(mwms_fix, "_skip_reason", None)
    before = (trainer_module.TensorFlowTrainer._maybe_symbolic_build, trainer_module.reduce_per_replica)
    with caplog.at_level(logging.WARNING, logger=mwms_fix.__name__):
        assert mwms_fix.apply_mwms_fix() is False
        assert mwms_fix.apply_mwms_fix() is False  # decided once, logged once
    after = (trainer_module.TensorFlowTrainer._maybe_symbolic_build, trainer_module.reduce_per_replica)
    assert after == before
    assert not mwms_fix.is_mwms_fix_applied()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "Keras 3.16.0" in messages[0] and "20585" in messages[0], messages
