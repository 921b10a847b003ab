"""The CNN diagnosis (benchmarks/cnn_diagnosis.py)."""

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


@pytest.mark.slow
def test_diagnosis_counts_what_each_variable_sent_after_the_warmup():
    """Five epochs, the last after the 4-epoch warm-up: each sparsified variable sent k entries in each of
    those steps, so sends per entry is k * steps / entries (entries sent twice are counted twice)."""
    from cnn_diagnosis import diagnose

    accuracy, rows = diagnose("signals", correction=False, density=0.001, learning_rate=0.02, epochs=5, every=25,
                              log=lambda message: None)
    steps_after_warmup = 94  # 3,000 training sequences in batches of 32: one epoch
    assert 0.3 < accuracy <= 1.0
    assert [(r["entries"], r["k"]) for r in rows] == [(10240, 11), (20480, 21), (131072, 132)]
    for r in rows:
        assert r["count_over_k"] == pytest.approx(1.0, abs=0.05), r  # the gaussian selection's count is k
        assert 0.0 < r["recall"] <= 1.0 and 0.5 < r["energy"] <= 1.0 + 1e-6, r
        assert r["sends_per_entry"] == pytest.approx(r["k"] * steps_after_warmup / r["entries"], rel=0.02), r
        assert r["residual_over_grad"] > 1.0, r  # error feedback holds more than one gradient back
