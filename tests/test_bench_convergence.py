"""`python -m tf_topk.bench convergence`: the random-k baseline, and a tiny run with a plot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["digits", "synthetic"])
def test_tiny_run_json_and_plot(tmp_path, dataset):
    png = tmp_path / "curves.png"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = [sys.executable, "-m", "tf_topk.bench", "convergence", "--dataset", dataset, "--seeds", "2",
            "--epochs", "2", "--densities", "0.1,0.01", "--hidden", "128", "--json", "--plot", str(png)]
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["dataset"] == dataset and result["seeds"] == 2 and result["epochs"] == 2
    rows = result["configs"]
    assert [(r["method"], r["density"]) for r in rows] == [
        ("dense", None),
        ("topk_ef", 0.1), ("topk_noef", 0.1), ("randk_ef", 0.1),
        ("topk_ef", 0.01), ("topk_noef", 0.01), ("randk_ef", 0.01),
    ]
    for row in rows:
        assert 0.0 <= row["test_accuracy_mean"] <= 1.0 and row["test_accuracy_std"] >= 0.0
        assert len(row["test_accuracy_per_seed"]) == 2
        assert len(row["curves"]["train_loss"]) == len(row["curves"]["test_accuracy"]) == 2
    assert rows[0]["test_accuracy_mean"] > 0.5  # dense learns something in 2 epochs
    for row in rows[1:]:
        # Top-k keeps at least the energy random-k keeps in expectation.
        assert 0.0 <= row["contraction"] <= 1.0
        if row["method"].startswith("topk"):
            assert row["contraction"] <= row["random_k_bound"] + 1e-6
        else:
            assert abs(row["contraction"] - row["random_k_bound"]) < 0.1
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
