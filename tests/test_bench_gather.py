"""`python -m tf_topk.bench gather`: both ways of gathering timed on real workers, and its argument errors."""

import pytest
import json
import subprocess
import sys

from multiworker import REPO_ROOT, subprocess_env


def _bench(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "tf_topk.bench", "gather", *args], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_gather_bench_times_both_ways_on_two_workers():
    proc = _bench("--workers", "2", "--lengths", "100,3000", "--rounds", "3", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["one_collective"] and out["workers"] == 2 and out["rounds"] == 3
    assert [row["length"] for row in out["rows"]] == [100, 3000]
    assert [row["bytes_per_worker"] for row in out["rows"]] == [400, 12_000]  # (P-1) * 4 bytes * length
    for row in out["rows"]:
        assert row["tensorflow_ms"] > 0 and row["one_gather_ms"] > 0
        assert row["speedup"] == row["tensorflow_ms"] / row["one_gather_ms"]


def test_gather_bench_refuses_bad_arguments():
    for args, message in ((["--workers", "1"], "--workers must be >= 2 (a gather needs two), got 1"),
                          (["--lengths", "10,x"], "--lengths must be comma-separated integers, got '10,x'"),
                          (["--lengths", "0"], "--lengths must all be >= 1, got [0]"),
                          (["--rounds", "0"], "--rounds must be >= 1, got 0")):
        proc = _bench(*args, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr[-500:])
