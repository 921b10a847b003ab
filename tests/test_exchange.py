"""SparseExchange across two replicas (MirroredStrategy, two logical CPUs) against numpy.

The exchange runs in a subprocess (logical devices must be set before
TensorFlow starts): tests/workers/exchange_replicas.py writes what every
replica returned; here it is compared with the algorithm written in numpy.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from multiworker import REPO_ROOT, WORKERS_DIR, worker_env

SHAPES = [(40, 50), (300,), (3000,), (25, 80)]  # 2000, 300 (dense: below min_size), 3000, 2000 entries
MIN_SIZE, DENSITY, REPLICAS, STEPS = 1000, 0.01, 2, 2
SPARSE = [v for v, shape in enumerate(SHAPES) if math.prod(shape) >= MIN_SIZE]


def top_k_magnitude(flat, k):
    """The numpy reference of exact selection: `flat` with all but its k largest |x| zeroed."""
    selected = np.zeros_like(flat)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    selected[keep] = flat[keep]
    return selected


def reference(data):
    """Per step: the summed gradient of each variable, and each replica's residuals after it."""
    residuals = [[np.zeros(math.prod(SHAPES[v]), np.float32) for v in SPARSE] for _ in range(REPLICAS)]
    steps = []
    for s in range(STEPS):
        summed = [np.zeros(math.prod(shape), np.float32) for shape in SHAPES]
        for r in range(REPLICAS):
            for v in range(len(SHAPES)):
                grad = data[f"input/step{s}/replica{r}/grad{v}"].reshape(-1)
                if v in SPARSE:
                    slot = SPARSE.index(v)
                    accumulated = grad + residuals[r][slot]
                    sent = top_k_magnitude(accumulated, math.ceil(DENSITY * accumulated.size))
                    residuals[r][slot] = accumulated - sent
                    summed[v] += sent
                else:
                    summed[v] += grad
        steps.append((summed, [list(rs) for rs in residuals]))
    return steps


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Everything the worker script wrote, by name."""
    path = tmp_path_factory.mktemp("exchange") / "replicas.npz"
    env = {**os.environ, **worker_env()}
    config = json.dumps(dict(shapes=SHAPES, min_size=MIN_SIZE, density=DENSITY, replicas=REPLICAS, steps=STEPS))
    proc = subprocess.run([sys.executable, str(WORKERS_DIR / "exchange_replicas.py"), str(path), config],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(path) as saved:
        return dict(saved)


@pytest.mark.parametrize("label, buckets", [("one_bucket", 1), ("per_variable", len(SPARSE))])
def test_bucket_count(data, label, buckets):
    assert int(data[f"{label}/num_buckets"]) == buckets


@pytest.mark.parametrize("label", ["one_bucket", "per_variable"])
def test_sum_over_replicas_and_residuals_match_numpy(data, label):
    for s, (summed, residuals) in enumerate(reference(data)):
        for r in range(REPLICAS):
            for v, shape in enumerate(SHAPES):
                got = data[f"{label}/step{s}/replica{r}/grad{v}"]
                assert got.shape == shape
                np.testing.assert_allclose(got.reshape(-1), summed[v], rtol=1e-6, atol=1e-6,
                                           err_msg=f"step {s} replica {r} variable {v}")
            for slot in range(len(SPARSE)):
                np.testing.assert_allclose(data[f"{label}/step{s}/replica{r}/residual{slot}"].reshape(-1),
                                           residuals[r][slot], rtol=1e-6, atol=1e-6)
    # Error feedback is visible: the second step sends entries the first step kept back.
    assert np.abs(residuals[0][0]).sum() > 0


def test_every_replica_and_every_bucketing_get_bitwise_the_same_sum(data):
    for s in range(STEPS):
        for v in range(len(SHAPES)):
            first = data[f"one_bucket/step{s}/replica0/grad{v}"]
            for label in ("one_bucket", "per_variable"):
                for r in range(REPLICAS):
                    np.testing.assert_array_equal(data[f"{label}/step{s}/replica{r}/grad{v}"], first)


def test_replicas_keep_their_own_residuals(data):
    assert not np.array_equal(data["one_bucket/step0/replica0/residual0"], data["one_bucket/step0/replica1/residual0"])
