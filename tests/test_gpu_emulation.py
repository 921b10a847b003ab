"""The CUDA selection's algorithm, emulated on the CPU from the shared header.

cc/emulation/gpu_emulation.cc follows the kernels of cc/kernels/approx_topk.cuh
step by step with the arithmetic they share (topk_common.h): histogram,
plan, compaction counters, finish. These tests run it over the inputs that
break selection kernels, on machines without a GPU, and check what the op
promises on every device: exactly min(k, qualifying) entries, only finite
non-zero ones, every entry above the threshold bin, and (exact) the k largest.
benchmarks/gpu_check.py checks the same promises on a GPU.
"""

import ctypes
import os
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(REPO, "cc", "emulation", "gpu_emulation.cc")
DTYPES = {"float32": (np.float32, 0), "float16": (np.float16, 1),
          "bfloat16": (ml_dtypes.bfloat16, 2)}
METHODS = {"gaussian": 0, "exact": 1}
BIN_SHIFT = 20  # kBinShift in topk_common.h


@pytest.fixture(scope="module")
def emulation(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.fail("g++ is needed to build the GPU emulation (it builds the op library too)")
    library = str(tmp_path_factory.mktemp("emulation") / "libgpu_emulation.so")
    subprocess.run([compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-I",
                    os.path.join(REPO, "cc", "kernels"), SOURCE, "-o", library], check=True)
    lib = ctypes.CDLL(library)
    fn = lib.tf_topk_emulate_gpu_select
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
                   ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    lib.tf_topk_sample_index.restype = ctypes.c_longlong
    lib.tf_topk_sample_index.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
    return lib


def select(emulation, x, k, method, capacity=-1):
    """(values as x's dtype, indices, state dict) from the emulation;
    capacity -1: the kernels' candidate capacity, 0: no prefilter."""
    x = np.ascontiguousarray(x)
    code = next(c for t, c in DTYPES.values() if x.dtype == np.dtype(t))
    values = np.zeros(k, np.uint32)
    indices = np.full(k, -7, np.int32)
    state = np.zeros(14, np.int64)
    rc = emulation.tf_topk_emulate_gpu_select(
        x.ctypes.data, code, x.size, k, METHODS[method], capacity, values.ctypes.data,
        indices.ctypes.data, state.ctypes.data)
    assert rc == 0
    names = ("above", "need", "sure", "ties", "fills", "filled", "error", "bin", "tie_low",
             "sure_above", "prefilter_key", "candidates", "use_candidates", "fallback")
    raw = values.astype(np.uint32 if x.itemsize == 4 else np.uint16)
    return raw.view(x.dtype), indices, dict(zip(names, state.tolist()))


def key_bits(magnitudes):
    """float32 magnitude bits, the kernels' key."""
    return np.abs(np.asarray(magnitudes, np.float32)).view(np.uint32)


def make(kind, n, dtype, seed):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        data = rng.standard_normal(n)
    elif kind == "student_t":
        data = rng.standard_t(3, size=n)
    elif kind == "constant":  # one magnitude everywhere, both signs
        data = np.where(rng.random(n) < 0.5, -0.75, 0.75)
    elif kind == "quarters":  # normal rounded to 1/4: a few magnitudes, many ties
        data = np.round(rng.standard_normal(n) * 4) / 4
    elif kind == "ties":
        data = rng.integers(-3, 4, n) * 0.5
    elif kind == "specials":  # NaN, +-Inf and zeros between normal entries
        data = rng.standard_normal(n)
        pick = rng.random(n)
        data[pick < 0.01] = np.nan
        data[(pick >= 0.01) & (pick < 0.02)] = np.inf
        data[(pick >= 0.02) & (pick < 0.03)] = -np.inf
        data[(pick >= 0.03) & (pick < 0.10)] = 0.0
    elif kind == "top_bin":  # next to the largest finite value of the dtype
        top = 65000.0 if dtype == np.float16 else 3.3e38
        data = np.where(rng.random(n) < 0.5, -top, top) * (1 - 0.001 * rng.random(n))
    elif kind == "sparse":  # fewer non-zeros than a large k
        data = np.zeros(n)
        where = rng.integers(0, n, n // 1000 + 1)
        data[where] = rng.standard_normal(where.size)
    elif kind == "tiny":  # subnormal in the dtype
        scale = {np.float32: 1e-41, np.float16: 1e-6}.get(dtype, 1e-39)
        data = rng.standard_normal(n) * scale
    else:
        raise ValueError(kind)
    with np.errstate(over="ignore", invalid="ignore"):
        return data.astype(np.float32).astype(dtype)


def check(x, k, method, values, indices, state):
    """The promises of both methods, and the exact method's magnitudes."""
    wide = x.astype(np.float64)
    qualifying = np.isfinite(wide) & (wide != 0)
    expected = min(k, int(qualifying.sum()))
    assert state["error"] == 0
    assert state["filled"] == expected, (state, expected)
    chosen = indices[:expected]
    assert np.all(values[expected:].astype(np.float64) == 0) and np.all(indices[expected:] == 0)
    assert np.array_equal(values[:expected].view(np.uint8), x[chosen].view(np.uint8))
    assert len(set(chosen.tolist())) == expected, "an entry was selected twice"
    assert np.all(qualifying[chosen])
    # Every entry above the threshold bin is selected (sure entries).
    assert state["sure"] == state["above"]
    if expected == 0:
        return
    magnitudes = np.sort(np.abs(wide[qualifying]))[::-1]
    if method == "exact":
        np.testing.assert_array_equal(np.sort(np.abs(wide[chosen]))[::-1], magnitudes[:expected])
    else:
        # Nothing from below the exact k-th magnitude's bin.
        kth_bin_low = int(key_bits(magnitudes[expected - 1])) >> BIN_SHIFT << BIN_SHIFT
        assert key_bits(np.abs(wide[chosen])).min() >= kth_bin_low


KINDS = ["normal", "student_t", "constant", "quarters", "ties", "specials", "top_bin", "sparse",
         "tiny"]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_fills_min_k_qualifying(emulation, kind, dtype, method):
    n = 20_011
    x = make(kind, n, DTYPES[dtype][0], seed=len(kind) * 7 + DTYPES[dtype][1])
    for k in (1, 10, 20, 200, 2001, n):
        values, indices, state = select(emulation, x, k, method)
        check(x, k, method, values, indices, state)


@pytest.mark.parametrize("kind,dtype", [("constant", "float32"), ("quarters", "float32"),
                                        ("normal", "bfloat16"), ("normal", "float32")])
def test_gaussian_fills_below_its_threshold_when_the_fit_leaves_slots(emulation, kind, dtype):
    """n = 2^20, k = 1048: the normal fit's threshold leaves slots empty on
    data with few distinct magnitudes (constant: none qualify above it);
    the rest of the threshold bin fills them."""
    n, k = 2 ** 20, 1048
    x = make(kind, n, DTYPES[dtype][0], seed=3)
    values, indices, state = select(emulation, x, k, "gaussian")
    check(x, k, "gaussian", values, indices, state)
    preferred = min(state["ties"], state["need"])
    if kind == "constant":
        assert preferred == 0 and state["fills"] >= state["need"] > 0, state
    assert state["above"] + preferred + min(state["fills"], state["need"] - preferred) == k


def test_gaussian_threshold_in_the_top_bin_is_finite(emulation):
    """The top finite bin ends at +Inf; the fit must not compute Inf - Inf
    (which pinned the threshold to the bin's top, so nothing was preferred)."""
    n, k = 50_000, 2
    rng = np.random.default_rng(0)
    # Magnitudes spread over the whole top bin of float32: [2^127 * 1.875, max].
    low = np.float32(2.0 ** 127 * 1.875)
    data = low + (np.finfo(np.float32).max - low) * rng.random(n)
    x = np.where(rng.random(n) < 0.5, -data, data).astype(np.float32)
    values, indices, state = select(emulation, x, k, "gaussian")
    check(x, k, "gaussian", values, indices, state)
    assert state["bin"] == 0x7F7FFFFF >> BIN_SHIFT
    assert state["tie_low"] < state["sure_above"]
    assert state["ties"] >= 1, state  # the fit's threshold leaves entries above it


# n >= kMinPrefilterSize (262144) and k <= about n/16: the one-pass path.
PREFILTER_N = 300_007


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["normal", "student_t", "specials", "quarters", "top_bin", "tiny"])
def test_prefilter_path_selects_as_promised(emulation, kind, dtype, method):
    x = make(kind, PREFILTER_N, DTYPES[dtype][0], seed=11)
    for k in (1, 300, 3000):
        values, indices, state = select(emulation, x, k, method)
        check(x, k, method, values, indices, state)
        if kind in ("normal", "student_t", "specials"):
            # The sample's threshold held: the plan came from the candidates.
            assert state["use_candidates"] == 1 and state["fallback"] == 0, state
            assert k <= state["candidates"] < PREFILTER_N // 8, state


@pytest.mark.parametrize("method", list(METHODS))
def test_prefilter_agrees_with_the_two_pass_path(emulation, method):
    """Exact selects the same magnitudes either way; gaussian keeps every
    entry above the threshold bin either way (its fit uses the sample's
    moments on the one-pass path, so its threshold inside the bin may move)."""
    x = make("normal", PREFILTER_N, np.float32, seed=5)
    k = 1000
    one_values, one_indices, one = select(emulation, x, k, method)
    two_values, two_indices, two = select(emulation, x, k, method, capacity=0)
    assert one["use_candidates"] == 1 and two["use_candidates"] == 0
    assert (one["bin"], one["above"]) == (two["bin"], two["above"])
    if method == "exact":
        np.testing.assert_array_equal(np.sort(np.abs(one_values)), np.sort(np.abs(two_values)))
    else:
        sure = np.abs(x).view(np.uint32) > one["sure_above"]
        assert set(np.flatnonzero(sure)) <= set(one_indices) & set(two_indices)


@pytest.mark.parametrize("method", list(METHODS))
def test_too_many_candidates_fall_back_to_two_passes(emulation, method):
    x = make("normal", PREFILTER_N, np.float32, seed=6)
    k = 200
    values, indices, state = select(emulation, x, k, method, capacity=k + 10)
    assert state["candidates"] > k + 10 and state["fallback"] == 1
    assert state["use_candidates"] == 0
    check(x, k, method, values, indices, state)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_misleading_sample_falls_back_to_two_passes(emulation, method):
    """Large values exactly where the sample looks and nowhere else: the
    threshold admits only the sampled entries, fewer than k."""
    n, k = 4 * 2 ** 20, 40_000
    x = make("normal", n, np.float32, seed=8)
    sampled = [emulation.tf_topk_sample_index(s, n) for s in range(32768)]
    x[sampled] = 100.0
    values, indices, state = select(emulation, x, k, method)
    assert state["prefilter_key"] != 0 and state["candidates"] == len(set(sampled)) < k
    assert state["fallback"] == 1 and state["use_candidates"] == 0
    check(x, k, method, values, indices, state)


def test_a_sample_with_too_few_qualifying_entries_falls_back(emulation):
    """Mostly zeros: the sample holds fewer qualifying entries than the rank
    it needs, so there is no threshold, the prefilter's pass collects
    nothing and the fallback pass counts all of x."""
    x = make("sparse", PREFILTER_N, np.float32, seed=9)
    values, indices, state = select(emulation, x, 2000, "gaussian")
    assert state["prefilter_key"] == 0 and state["candidates"] == 0
    assert state["use_candidates"] == 0 and state["fallback"] == 1
    check(x, 2000, "gaussian", values, indices, state)


def test_bad_arguments_are_refused(emulation):
    x = np.ones(4, np.float32)
    out = np.zeros(16, np.int64)
    for n, k, method, capacity in ((4, 0, 0, -1), (4, 5, 0, -1), (0, 1, 0, -1), (4, 1, 2, -1),
                                   (4, 1, 0, -2)):
        assert emulation.tf_topk_emulate_gpu_select(
            x.ctypes.data, 0, n, k, method, capacity, out.ctypes.data, out.ctypes.data,
            out.ctypes.data) == -1
