"""The CNN diagnosis and the trials (benchmarks/cnn_diagnosis.py, k_floor_trial.py, dense_warmup_trial.py)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from multiworker import PYTHON, subprocess_env

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


@pytest.mark.slow
def test_k_floor_trial_sends_at_least_the_floor_of_every_variable():
    env = subprocess_env()
    proc = subprocess.run([*PYTHON, str(REPO_ROOT / "benchmarks" / "k_floor_trial.py"), "--floor", "64",
                           "--dataset", "signals", "--densities", "0.001", "--methods", "topk_ef", "--seeds", "1",
                           "--epochs", "1", "--density-warmup-steps", "0", "--json"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(proc.stdout)["configs"][1]
    sizes = (10240, 20480, 131072)
    sent = sum(max(math.ceil(0.001 * n), 64) for n in sizes)
    assert row["sent_density"] == pytest.approx(sent / sum(sizes), abs=1e-5), row


@pytest.mark.slow
def test_k_floor_trial_names_a_bad_floor():
    env = subprocess_env()
    proc = subprocess.run([*PYTHON, str(REPO_ROOT / "benchmarks" / "k_floor_trial.py"), "--floor", "0"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--floor must be >= 1, got 0" in proc.stderr, proc.stderr[-2000:]


def test_dense_warmup_trial_sends_every_entry_then_the_density():
    """The trial's warm-up in place of DGC's: density 1 for its share of the warm-up's steps, then the final."""
    import dense_warmup_trial
    from tf_topk import schedule

    original = schedule.dgc_warmup
    try:
        dense_warmup_trial.install_dense_warmup(0.25)
        assert schedule.dgc_warmup(94, epochs=4, final=0.001) == [(0, 1.0), (94, 0.001)]
        assert schedule.DensitySchedule(schedule.dgc_warmup(94, epochs=4, final=0.001)).max_density() == 1.0
    finally:
        schedule.dgc_warmup = original


@pytest.mark.slow
def test_dense_warmup_trial_names_a_bad_fraction():
    env = subprocess_env()
    proc = subprocess.run([*PYTHON, str(REPO_ROOT / "benchmarks" / "dense_warmup_trial.py"),
                           "--warmup-fraction", "1.5"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--warmup-fraction must be in (0, 1], got 1.5" in proc.stderr, proc.stderr[-2000:]


def test_global_topk_trial_ranks_by_plain_magnitude():
    """--plain: one top-k of the bucket by magnitude alone, so a variable 1,000 times larger takes all of k
    (the library's ranking, on each variable's own scale, splits it)."""
    import global_topk_trial
    import tensorflow as tf
    from tf_topk import selector

    a, b = tf.range(1.0, 101.0), 1000.0 * tf.range(1.0, 101.0)
    exact = selector.TopKSelector("exact")
    assert [int(tf.size(i)) for _, i in selector.select_over_bucket(exact, [a, b], 10)] == [5, 5]
    original = selector._finite_rms
    try:
        global_topk_trial.install(plain=True)
        assert [int(tf.size(i)) for _, i in selector.select_over_bucket(exact, [a, b], 10)] == [0, 10]
    finally:
        selector._finite_rms = original


@pytest.mark.slow
def test_global_topk_trial_prints_what_each_variable_sent():
    env = subprocess_env()
    proc = subprocess.run([*PYTHON, str(REPO_ROOT / "benchmarks" / "global_topk_trial.py"), "--print-counts",
                           "--dataset", "shapes", "--densities", "0.001", "--methods", "topk_ef", "--seeds", "1",
                           "--epochs", "1", "--density-warmup-steps", "0", "--json"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout)["selection_scope"] == "bucket"
    counts = [line.split("] [")[1].strip("]\n ").split() for line in proc.stderr.splitlines()
              if line.startswith("counts")]
    assert len(counts) == 94  # one line a step: 3,000 images in batches of 32
    assert all(sum(map(int, c)) == 5 + 33 for c in counts)  # the bucket's k: ceil(0.001 n) of 4,608 and 32,768
