"""The fused error-feedback selection op against a numpy reference.

`tf_topk.error_feedback_topk(gradient, residual, k)` must give exactly what
the unfused steps give: accumulated = gradient + residual (in the residual's
dtype), the selection `approx_topk` makes on it, remaining = accumulated with
the selected entries zeroed, and the statistics of both, for every dtype,
method, k, non-finite pattern and residual state; on both CPU paths (the
one-pass prefilter for large inputs, the two-pass fallback for small ones).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tf_topk

REPO_ROOT = Path(__file__).resolve().parents[1]

SMALL, LARGE = 1003, 300_001  # the two-pass path; the prefilter path (>= 262,144 entries), odd lengths
DTYPES = {"float32": (tf.float32, np.float32), "float16": (tf.float16, np.float32),
          "bfloat16": (tf.bfloat16, np.float32), "float64": (tf.float64, np.float64)}


def make(n, dtype, residual_state, pattern, seed=0):
    """A gradient of `dtype` and a residual (its numpy value and dtype)."""
    tf_dtype, residual_np = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal(n)
    grad[rng.random(n) < 0.1] = 0.0  # zeros are never selected
    if residual_state == "zeros":
        residual = np.zeros(n)
    elif residual_state == "random":
        residual = 0.5 * rng.standard_normal(n)
    else:  # "heavy": a few residual entries that dominate the accumulation
        residual = np.zeros(n)
        residual[rng.choice(n, 7, replace=False)] = 100.0 * rng.standard_normal(7)
    if pattern == "nan":
        grad[[3, n // 2]] = np.nan
    elif pattern == "inf":
        grad[5] = np.inf
        residual[n - 2] = -np.inf
    elif pattern == "overflow":  # finite parts whose sum is not
        big = 3e38 if residual_np is np.float32 else 1.7e308
        grad[7], residual[7] = big if dtype in ("float32", "float64") else 6e4, big
    grad_tensor = tf.cast(tf.constant(grad, tf.float64), tf_dtype)
    return grad_tensor, residual.astype(residual_np)


def reference(grad_tensor, residual, k, method):
    """accumulated, the op's selection per approx_topk, remaining, stats (numpy)."""
    grad = tf.cast(grad_tensor, residual.dtype).numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        accumulated = (grad + residual).astype(residual.dtype)
    values, indices = tf_topk.approx_topk(tf.constant(accumulated), k, method=method)
    values, indices = values.numpy(), indices.numpy()
    remaining = accumulated.copy()
    remaining[indices[values != 0]] = 0
    finite = np.isfinite(accumulated)
    stats = [np.sum(accumulated[finite].astype(np.float64) ** 2), np.sum(remaining[finite].astype(np.float64) ** 2),
             float(np.count_nonzero(~finite))]
    return accumulated, values, indices, remaining, stats


def check(n, dtype, residual_state, pattern, k, method):
    grad, residual = make(n, dtype, residual_state, pattern)
    accumulated, values, indices, remaining, stats = reference(grad, residual, k, method)
    out = tf_topk.error_feedback_topk(grad, tf.constant(residual), k, method=method)
    assert out.values.dtype == residual.dtype and out.remaining.dtype == residual.dtype
    assert out.values.shape == (k,) and out.indices.shape == (k,) and out.remaining.shape == (n,)
    np.testing.assert_array_equal(out.values.numpy(), values)  # the same selection, in the same order
    np.testing.assert_array_equal(out.indices.numpy(), indices)
    np.testing.assert_array_equal(out.remaining.numpy(), remaining)  # NaN where accumulated is NaN
    np.testing.assert_allclose(out.stats.numpy(), stats, rtol=2e-5)
    chosen = values != 0
    np.testing.assert_array_equal(values[chosen], accumulated[indices[chosen]])
    qualifying = np.count_nonzero(np.isfinite(accumulated) & (accumulated != 0))
    assert np.count_nonzero(chosen) == min(k, qualifying)
    if method == "exact":  # the k largest magnitudes
        finite = np.abs(np.where(np.isfinite(accumulated), accumulated, 0))
        np.testing.assert_allclose(np.sort(np.abs(values[chosen]))[::-1], np.sort(finite)[::-1][:len(values[chosen])])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("method", ["gaussian", "exact"])
@pytest.mark.parametrize("pattern", ["finite", "nan", "inf", "overflow"])
def test_every_dtype_method_and_non_finite_pattern(dtype, method, pattern):
    check(SMALL, dtype, "random", pattern, 17, method)
    check(LARGE, dtype, "random", pattern, 300, method)


@pytest.mark.parametrize("residual_state", ["zeros", "random", "heavy"])
@pytest.mark.parametrize("n,k", [(SMALL, 0), (SMALL, 1), (SMALL, 500), (SMALL, SMALL), (LARGE, 1), (LARGE, 3000),
                                 (LARGE, 40_000)])
def test_every_k_and_residual_state(residual_state, n, k):
    check(n, "float32", residual_state, "finite", k, "gaussian")
    check(n, "float32", residual_state, "nan", k, "exact")


def test_the_residual_input_is_never_written_and_held_outputs_never_change():
    """Outputs come from buffers the kernel recycles: one still held (by a
    tensor or a variable) must never be handed out again."""
    rng = np.random.default_rng(1)
    residual = tf.Variable(rng.standard_normal(LARGE).astype(np.float32))
    before = residual.numpy().copy()
    held = []
    for step in range(5):
        grad = tf.constant(rng.standard_normal(LARGE).astype(np.float32))
        out = tf_topk.error_feedback_topk(grad, residual, 100)
        held.append((out.remaining, out.remaining.numpy().copy()))
    np.testing.assert_array_equal(residual.numpy(), before)
    for tensor, copy in held:
        np.testing.assert_array_equal(tensor.numpy(), copy)

    @tf.function
    def step(grad):
        out = tf_topk.error_feedback_topk(grad, residual, 100)
        residual.assign(out.remaining)  # takes the buffer over
        return out.values

    expected = residual.numpy()
    for _ in range(4):
        grad = rng.standard_normal(LARGE).astype(np.float32)
        _, _, _, expected, _ = reference(tf.constant(grad), expected, 100, "gaussian")
        step(tf.constant(grad))
        np.testing.assert_array_equal(residual.numpy(), expected)


def test_bad_arguments_name_the_argument_and_the_value():
    grad = tf.zeros([10])
    with pytest.raises(tf.errors.InvalidArgumentError, match="residual must be float32 for a float32 gradient"):
        tf_topk.error_feedback_topk(grad, tf.zeros([10], tf.float64), 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"residual must have as many entries as gradient \(10\)"):
        tf_topk.error_feedback_topk(grad, tf.zeros([9]), 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be <= the number of entries of gradient \(10\)"):
        tf_topk.error_feedback_topk(grad, tf.zeros([10]), 11)
    with pytest.raises(tf.errors.InvalidArgumentError, match="k must be >= 0, got k = -1"):
        tf_topk.error_feedback_topk(grad, tf.zeros([10]), -1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="gradient must be float32, float16, bfloat16 or float64"):
        tf_topk.error_feedback_topk(tf.zeros([10], tf.int32), tf.zeros([10]), 1)
    with pytest.raises(ValueError, match="method must be one of"):
        tf_topk.error_feedback_topk(grad, tf.zeros([10]), 1, method="median")

    @tf.function(input_signature=[tf.TensorSpec([None]), tf.TensorSpec([], tf.int32)])
    def dynamic(residual, k):  # sizes and k known only at run time: the kernel checks
        return tf_topk.error_feedback_topk(grad, residual, k).values

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"residual must have as many entries as gradient"):
        dynamic(tf.zeros([7]), tf.constant(1))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be <= the number of entries of gradient"):
        dynamic(tf.zeros([10]), tf.constant(12))


@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_profile_counts_and_energies_per_magnitude_bin(n, dtype):
    """The adaptive rule's input: per 1/8-octave bin of |gradient + residual|
    (the float32 bits >> 20), the count and the sum of squares of the finite
    non-zero entries."""
    grad, residual = make(n, dtype, "random", "inf")
    accumulated, *_ = reference(grad, residual, 5, "gaussian")
    out = tf_topk.error_feedback_topk(grad, tf.constant(residual), 5, with_profile=True)
    assert out.profile.shape == (2, tf_topk.ops.PROFILE_BINS)
    finite = accumulated[np.isfinite(accumulated) & (accumulated != 0)]
    bins = (np.abs(finite.astype(np.float32)).view(np.uint32) >> 20).astype(np.int64)
    counts = np.bincount(bins, minlength=2048)
    energies = np.bincount(bins, weights=finite.astype(np.float64) ** 2, minlength=2048)
    np.testing.assert_array_equal(out.profile.numpy()[0], counts)
    np.testing.assert_allclose(out.profile.numpy()[1], energies, rtol=1e-9)
    assert tf_topk.error_feedback_topk(grad, tf.constant(residual), 5).profile.shape == (2, 0)


def test_an_empty_gradient_gives_empty_outputs_and_zero_statistics():
    out = tf_topk.error_feedback_topk(tf.zeros([0, 3]), tf.zeros([0]), 0, with_profile=True)
    assert out.values.shape == (0,) and out.remaining.shape == (0,)
    np.testing.assert_array_equal(out.stats.numpy(), [0, 0, 0])
    np.testing.assert_array_equal(out.profile.numpy(), np.zeros((2, 2048)))


@pytest.mark.parametrize("depth", [0.01, 0.3])  # few groups of 16 above the floor; nearly all of them
def test_a_profile_for_the_top_entries_is_exact_down_to_their_rank(depth):
    """profile_density=d: exact for the largest magnitudes down to rank d * n
    (the kernel skips entries well below that, from its sample)."""
    grad, residual = make(LARGE, "float32", "random", "nan")
    accumulated, *_ = reference(grad, residual, 5, "gaussian")
    full = tf_topk.error_feedback_topk(grad, tf.constant(residual), 5, with_profile=True).profile.numpy()
    top = tf_topk.error_feedback_topk(grad, tf.constant(residual), 5, with_profile=True,
                                      profile_density=depth).profile.numpy()
    rank = int(np.ceil(depth * LARGE))
    threshold = np.sort(np.abs(accumulated[np.isfinite(accumulated)]))[::-1][rank]
    exact_from = (np.float32(threshold).view(np.uint32) >> 20) + 1  # bins wholly above the rank's magnitude
    np.testing.assert_array_equal(top[:, exact_from:], full[:, exact_from:])
    assert top[0].sum() >= rank and top[0].sum() < 0.75 * full[0].sum()  # fewer entries profiled
    with pytest.raises(ValueError, match=r"profile_density must be a float in \(0, 1\], got 0"):
        tf_topk.error_feedback_topk(grad, tf.constant(residual), 5, with_profile=True, profile_density=0)


# Runs in a fresh process with TensorFlow's BFC allocator on the CPU: its
# statistics count the bytes live tensors and kernels hold (the default CPU
# allocator keeps none), and the environment variable must be set before
# TensorFlow starts.
RESIDENT_SCRIPT = r"""
import json
import tensorflow as tf
import tf_topk

def in_use():
    return tf.config.experimental.get_memory_info("CPU:0")["current"]

def allocated_by(step):  # bytes in use at the step's peak beyond those before it
    before = in_use()
    tf.config.experimental.reset_memory_stats("CPU:0")
    step()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before

result = {}
base = in_use()
for n in (20_000_000, 30_000_000, 25_000_000):  # one eager kernel serves them all
    tf_topk.error_feedback_topk(tf.random.normal([n], seed=n), tf.zeros([n]), 100)
result["kept_after_distinct_sizes"] = in_use() - base

N = 22_000_000
grad = tf.random.normal([N], seed=1)
base = in_use()
residual = tf.Variable(tf.zeros([N]))

def eager_step():
    out = tf_topk.error_feedback_topk(grad, residual, 100)
    residual.assign(out.remaining)

for _ in range(3):
    eager_step()
result["eager_step_allocates"] = max(allocated_by(eager_step) for _ in range(3))
del residual
result["kept_after_eager_steps"] = in_use() - base
tf_topk.error_feedback_topk(tf.zeros([5]), tf.zeros([5]), 1)  # another size
result["kept_after_another_size"] = in_use() - base

residual = tf.Variable(tf.zeros([N]))

@tf.function
def graph_step():
    out = tf_topk.error_feedback_topk(grad, residual, 100)
    residual.assign(out.remaining)

for _ in range(3):
    graph_step()
result["graph_step_allocates"] = max(allocated_by(graph_step) for _ in range(3))
print(json.dumps(result))
"""


@pytest.mark.slow
def test_kept_buffers_are_bounded_and_a_repeated_step_allocates_none():
    """The kernel recycles `remaining` for a step repeated at one size, and
    keeps nothing once the size changes: eager calls of several sizes (one
    kernel serves them all) leave no buffer behind."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", RESIDENT_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    buffer = 4 * 22_000_000  # one float32 residual of the steps, 88 MB
    small = buffer // 8  # far below any residual-sized buffer; the small outputs fit many times
    # A buffer kept per size would hold 300 MB here (20M + 30M + 25M entries).
    assert result["kept_after_distinct_sizes"] < small, result
    # Buffers kept from other sizes must not stop the step's own reuse.
    assert result["eager_step_allocates"] < small, result
    assert result["graph_step_allocates"] < small, result
    # The repeated step's buffers (the variable's last one, the spare) stay
    # until a call of another size lets them go.
    assert result["kept_after_eager_steps"] >= buffer, result
    assert result["kept_after_another_size"] < small, result
