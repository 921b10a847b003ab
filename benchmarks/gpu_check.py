#!/usr/bin/env python3
"""Check and time the op's CUDA kernels against torch.topk on a real GPU.

Runs on the device machine (CUDA toolkit with nvcc, PyTorch; no TensorFlow):

    python benchmarks/gpu_check.py                 # full check + timings
    python benchmarks/gpu_check.py --quick         # smaller sizes, fewer runs
    python benchmarks/gpu_check.py --json out.json # also write the results
    python benchmarks/gpu_check.py --compile-only  # only build the harness (no GPU needed)
    compute-sanitizer --tool racecheck python benchmarks/gpu_check.py --sanitize
                                                   # small sizes only, for the sanitizers
    ncu -k regex:Kernel python benchmarks/gpu_check.py --profile-once
                                                   # one call of each method, for a profiler

It compiles benchmarks/gpu/harness.cu (which includes cc/kernels/approx_topk.cuh,
the same kernels the TensorFlow op launches) with nvcc into a temporary folder,
loads it with ctypes and calls it on PyTorch tensors, on a PyTorch stream.

Correctness (exit status 1 on any failure):
  both methods: values == x[indices] bit for bit, indices distinct and in
    range, only finite non-zero entries selected, spare slots hold value 0 and
    index 0 (outputs are pre-filled with garbage to prove the kernel zeroes
    them), no device-side invariant violation, every entry above the plan's
    sure threshold got a slot (sure_counter == above);
  both methods: the count is min(k, qualifying);
  exact: the sorted magnitudes equal those of torch.topk over the qualifying
    entries;
  gaussian: no selected magnitude lies below the lower edge of the exact k-th
    magnitude's bin; recall against the exact k-th magnitude is reported (not
    a failure);
  runs repeated on the same input: exact selects the same set each time when
    the magnitudes are distinct; how often gaussian's set changes is reported.
The correctness runs use a harness built with -DTF_TOPK_DEBUG_CHECKS, which
also compares the parallel plan with the serial PlanFromHistogram on device.

Timing (CUDA events, median after warm-up; the GPU is kept busy with a sleep
kernel while each call is enqueued so launch overhead is not counted): the two
methods, torch.topk(x.abs(), k), and a one-pass yardstick (torch.sum and a
device-to-device copy) at n = 25M and 100M, density 0.001 and 0.01, normal and
Student-t (3 degrees of freedom) float32 data. "passes" is a method's time over
the time of one read of the input (half the copy, which reads and writes).
"""

import argparse
import collections
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HARNESS_SOURCE = os.path.join(HERE, "gpu", "harness.cu")
KERNEL_DIR = os.path.join(ROOT, "cc", "kernels")

GAUSSIAN = 0  # tf_topk::Method::kGaussian
EXACT = 1     # tf_topk::Method::kExact
METHOD_NAMES = {GAUSSIAN: "gaussian", EXACT: "exact"}
STATE_FIELDS = ("sure_above", "tie_low", "bin_low", "above", "need", "done", "error", "count",
                "sure_counter", "tie_counter", "fill_counter", "prefix", "planned_from",
                "prefilter_key", "candidate_count", "use_candidates", "fallback")
BIN_SHIFT = 20  # kBinShift in topk_common.h: a bin is the top 11 magnitude bits
DEVICE_ERRORS = {1: "exact radix level lost the rank", 2: "sure slot >= k",
                 3: "parallel plan != serial PlanFromHistogram"}


def log(message):
    print(message, flush=True)


# ---------------------------------------------------------------------------
# Building and loading the harness (no torch needed here).

def find_nvcc():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        for candidate in ("/usr/local/cuda/bin/nvcc",):
            if os.path.exists(candidate):
                nvcc = candidate
    if nvcc is None:
        raise SystemExit("nvcc not found on PATH or in /usr/local/cuda/bin")
    return nvcc


def build_harness(out_dir, arch, debug_checks=False, ptxas_verbose=False):
    """Compile the harness to a shared library in out_dir; returns its path."""
    name = "libtf_topk_harness_debug.so" if debug_checks else "libtf_topk_harness.so"
    output = os.path.join(out_dir, name)
    command = [find_nvcc(), "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
               f"-arch=sm_{arch}", "-I", KERNEL_DIR]
    if debug_checks:
        command.append("-DTF_TOPK_DEBUG_CHECKS=1")
    if ptxas_verbose:
        command += ["-Xptxas", "-v"]
    command += [HARNESS_SOURCE, "-o", output]
    log("$ " + " ".join(command))
    started = time.time()
    subprocess.run(command, check=True)
    log(f"  built {output} in {time.time() - started:.1f} s")
    return output


class Harness:
    """ctypes view of benchmarks/gpu/harness.cu."""

    def __init__(self, path):
        lib = ctypes.CDLL(path)  # RTLD_LOCAL: two builds can live side by side
        lib.tf_topk_scratch_bytes.restype = ctypes.c_size_t
        lib.tf_topk_scratch_bytes.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
        lib.tf_topk_sample_index.restype = ctypes.c_longlong
        lib.tf_topk_sample_index.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
        lib.tf_topk_debug_checks.restype = ctypes.c_int
        lib.tf_topk_debug_checks.argtypes = []
        select_args = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.select_fns = {}
        for suffix in ("f32", "f16", "bf16"):
            fn = getattr(lib, f"tf_topk_select_{suffix}")
            fn.restype = ctypes.c_int
            fn.argtypes = select_args
            self.select_fns[suffix] = fn
        lib.tf_topk_read_state.restype = ctypes.c_int
        lib.tf_topk_read_state.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_longlong),
                                           ctypes.c_void_p]
        lib.tf_topk_error_string.restype = ctypes.c_char_p
        lib.tf_topk_error_string.argtypes = [ctypes.c_int]
        self.lib = lib
        self.debug_checks = bool(lib.tf_topk_debug_checks())

    def scratch_bytes(self, n, k):
        return int(self.lib.tf_topk_scratch_bytes(n, k))

    def scratch(self, n, k):
        import torch

        return torch.empty(self.scratch_bytes(n, k), dtype=torch.uint8, device="cuda")

    def sample_indices(self, n):
        return [int(self.lib.tf_topk_sample_index(s, n)) for s in range(32768)]

    def error_string(self, code):
        return self.lib.tf_topk_error_string(code).decode()

    def select(self, x, k, method, values, indices, scratch, stream_handle):
        """Enqueue one selection (no synchronisation)."""
        suffix = DTYPE_SUFFIX[str(x.dtype)]
        rc = self.select_fns[suffix](ctypes.c_void_p(x.data_ptr()), x.numel(), k, method,
                                     ctypes.c_void_p(values.data_ptr()),
                                     ctypes.c_void_p(indices.data_ptr()),
                                     ctypes.c_void_p(scratch.data_ptr()),
                                     ctypes.c_void_p(stream_handle))
        if rc != 0:
            raise RuntimeError(f"tf_topk_select_{suffix} failed: {rc} ({self.error_string(rc)})")

    def read_state(self, scratch, stream_handle):
        out = (ctypes.c_longlong * len(STATE_FIELDS))()
        rc = self.lib.tf_topk_read_state(ctypes.c_void_p(scratch.data_ptr()), out,
                                         ctypes.c_void_p(stream_handle))
        if rc != 0:
            raise RuntimeError(f"tf_topk_read_state failed: {rc} ({self.error_string(rc)})")
        return dict(zip(STATE_FIELDS, list(out)))


DTYPE_SUFFIX = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}


# ---------------------------------------------------------------------------
# Inputs.

def make_input(kind, n, dtype, seed, offset=0):
    """A CUDA tensor of n entries; offset > 0 returns a view starting `offset`
    entries into a larger buffer (a pointer not aligned to 16 bytes)."""
    import torch

    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    total = n + offset

    def randn(count):
        return torch.randn(count, generator=g, device="cuda", dtype=torch.float32)

    if kind == "normal":
        base = randn(total)
    elif kind == "shifted":  # non-zero mean: exercises the two-sided tail
        base = randn(total) * 0.5 + 2.0
    elif kind == "student_t":  # 3 degrees of freedom: heavy tails
        chi2 = randn(total) ** 2 + randn(total) ** 2 + randn(total) ** 2
        base = randn(total) / torch.sqrt(chi2 / 3.0)
    elif kind == "specials":  # NaN, +-Inf and zeros sprinkled in
        base = randn(total)
        pick = torch.rand(total, generator=g, device="cuda")
        base[pick < 0.01] = float("nan")
        base[(pick >= 0.01) & (pick < 0.02)] = float("inf")
        base[(pick >= 0.02) & (pick < 0.03)] = float("-inf")
        base[(pick >= 0.03) & (pick < 0.10)] = 0.0
    elif kind == "zeros":
        base = torch.zeros(total, device="cuda")
    elif kind == "neg_zeros":  # -0.0 does not qualify either
        base = torch.full((total,), -0.0, device="cuda")
    elif kind == "ties":  # a handful of distinct magnitudes
        base = torch.randint(-3, 4, (total,), generator=g, device="cuda").float() * 0.5
    elif kind == "constant":  # one magnitude everywhere, both signs
        sign = torch.randint(0, 2, (total,), generator=g, device="cuda").float() * 2 - 1
        base = sign * 0.75
    elif kind == "top_bin":  # magnitudes in the top finite bin, next to +Inf
        top = {torch.float32: 3.3e38, torch.float16: 65000.0, torch.bfloat16: 3.3e38}[dtype]
        base = torch.where(randn(total) > 0, top, -top) * (1.0 - 0.001 * torch.rand(
            total, generator=g, device="cuda"))
    elif kind == "quarters":  # normal data rounded to 1/4: many ties in every bin
        base = torch.round(randn(total) * 4.0) / 4.0
    elif kind == "sparse":  # about n/1000 + 1 non-zeros: fewer than k for dense k
        base = torch.zeros(total, device="cuda")
        nnz = total // 1000 + 1
        where = torch.randint(0, total, (nnz,), generator=g, device="cuda")
        base[where] = randn(nnz)
    elif kind == "tiny":  # subnormal in the target dtype: exercises the low bits
        scale = {torch.float32: 1e-41, torch.float16: 1e-6, torch.bfloat16: 1e-39}[dtype]
        base = randn(total) * scale
    else:
        raise ValueError(kind)
    base = base.to(dtype)
    return base[offset:offset + n] if offset else base


def k_values(n):
    ks = {1, min(n, 10), max(1, round(0.001 * n)), max(1, round(0.01 * n)), n}
    return sorted(ks)


def bits_view(t):
    import torch

    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


# ---------------------------------------------------------------------------
# Correctness.

def reference(x, k):
    """(sorted descending magnitudes of the k largest qualifying entries,
    zero-padded; number of qualifying entries)."""
    import torch

    xf = x.float()
    qual = torch.isfinite(xf) & (xf != 0)
    mag = torch.where(qual, xf.abs(), torch.zeros_like(xf))
    top = torch.topk(mag, k, sorted=True).values
    return top, int(qual.sum().item())


def run_select(h, x, k, method, scratch, stream):
    """One selection into outputs pre-filled with garbage (the launch must
    zero them); returns (values, indices, device state)."""
    import torch

    values = torch.empty(k, dtype=x.dtype, device="cuda")
    indices = torch.empty(k, dtype=torch.int32, device="cuda")
    values.fill_(3.0)
    indices.fill_(123456789)
    h.select(x, k, method, values, indices, scratch, stream.cuda_stream)
    state = h.read_state(scratch, stream.cuda_stream)  # synchronises the stream
    torch.cuda.synchronize()
    return values, indices, state


def check_one(h, x, k, method, ref_mag, n_qual, scratch, stream):
    """Run one selection and return (problems, info)."""
    import torch

    n = x.numel()
    values, indices, state = run_select(h, x, k, method, scratch, stream)

    problems = []
    if state["error"] != 0:
        problems.append(f"device error {state['error']}: {DEVICE_ERRORS.get(state['error'], '?')}")
    if not state["use_candidates"] and state["planned_from"] != n_qual:
        problems.append(f"histogram counted {state['planned_from']} qualifying, torch {n_qual}")
    if state["sure_counter"] != state["above"]:
        problems.append(f"sure_counter {state['sure_counter']} != above {state['above']}")

    vbits = bits_view(values)
    selected = vbits != 0
    count = int(selected.sum().item())
    idx = indices.long()
    spare = ~selected
    if bool((idx[spare] != 0).any()):
        problems.append("a spare slot has a non-zero index")
    if bool(((idx < 0) | (idx >= n)).any()):
        problems.append("index out of range")
    else:
        sel_idx = idx[selected]
        if not torch.equal(bits_view(x)[sel_idx], vbits[selected]):
            problems.append("values != x[indices]")
        if torch.unique(sel_idx).numel() != count:
            problems.append("duplicate indices")
        sel_vals = values[selected].float()
        if not bool(torch.isfinite(sel_vals).all()) or bool((sel_vals == 0).any()):
            problems.append("selected a non-qualifying entry")
    expected = min(k, n_qual)
    info = {"count": count, "expected_count": expected,
            "path": ("one-pass" if state["use_candidates"] else
                     "fallback" if state["fallback"] else "two-pass")}
    if count != expected:
        problems.append(f"count {count} != min(k, qualifying) {expected}")

    if method == EXACT:
        got = torch.sort(values.float().abs(), descending=True).values
        if not torch.equal(got, ref_mag):
            diff = int((got != ref_mag).sum().item())
            problems.append(f"magnitudes differ from torch.topk in {diff} of {k} slots")
        if state["tie_counter"] < state["need"]:
            problems.append(f"tie_counter {state['tie_counter']} < need {state['need']}")
    else:
        if expected > 0 and count > 0:
            kth = ref_mag[expected - 1]
            bin_low = int(kth.float().view(torch.int32).item()) & ~((1 << BIN_SHIFT) - 1)
            lowest = values[selected].float().abs().min()
            if int(lowest.view(torch.int32).item()) < bin_low:
                problems.append(f"selected magnitude {lowest.item()!r} lies below the k-th "
                                f"magnitude's bin ({kth.item()!r})")
            hits = int((values.float().abs() >= kth).sum().item())
            info["recall"] = hits / expected
            info["count_ratio"] = count / expected
            info["fill_counter"] = state["fill_counter"]
        else:
            info["recall"] = 1.0
            info["count_ratio"] = 1.0
    return problems, info


def correctness(h, quick, sanitize=False):
    import torch

    special_kinds = ["specials", "zeros", "neg_zeros", "ties", "constant", "sparse", "shifted",
                     "tiny", "student_t", "top_bin", "quarters", "sampled_spikes"]
    if sanitize:  # the sanitizers run each kernel 10-100x slower
        # 300_007 >= kMinPrefilterSize: the one-pass kernels and the fallback.
        sizes, special_sizes = [1, 7, 1000, 300_007], (1000, 300_007)
        special_kinds = ["specials", "constant", "ties", "sparse", "top_bin", "quarters",
                         "sampled_spikes"]
    else:
        sizes = [1, 7, 1000, 2 ** 20 + 3, 25_000_000] + ([] if quick else [100_000_000])
        special_sizes = (7, 1000, 2 ** 20 + 3)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    cases = []  # (kind, n, dtype, offset)
    for n in sizes:
        for dtype in dtypes:
            if quick and n >= 25_000_000 and dtype != torch.float32:
                continue
            cases.append(("normal", n, dtype, 0))
    for n in special_sizes:
        for dtype in dtypes:
            for kind in special_kinds:
                cases.append((kind, n, dtype, 0))
            for offset in (1, 3):  # unaligned start: head entries before the vector body
                cases.append(("normal", n, dtype, offset))

    stream = torch.cuda.Stream()
    results, failures = [], []
    seed = 0
    with torch.cuda.stream(stream):
        for kind, n, dtype, offset in cases:
            seed += 1
            x = make_input("normal" if kind == "sampled_spikes" else kind, n, dtype, seed, offset)
            if kind == "sampled_spikes":  # large exactly where the prefilter's sample looks
                if n < 8 * 32768:
                    continue
                x[torch.tensor(h.sample_indices(n), device="cuda")] = 100.0
            for k in k_values(n):
                ref_mag, n_qual = reference(x, k)
                scratch = h.scratch(n, k)
                for method in (EXACT, GAUSSIAN):
                    label = (f"{METHOD_NAMES[method]:8s} {kind:9s} n={n:<10d} k={k:<10d} "
                             f"{str(dtype).replace('torch.', ''):8s} offset={offset}")
                    try:
                        problems, info = check_one(h, x, k, method, ref_mag, n_qual, scratch, stream)
                    except Exception as e:  # a launch error is a failure, keep going
                        problems, info = [f"exception: {e}"], {}
                    record = {"method": METHOD_NAMES[method], "kind": kind, "n": n, "k": k,
                              "dtype": str(dtype).replace("torch.", ""), "offset": offset,
                              "qualifying": n_qual, "problems": problems, **info}
                    results.append(record)
                    if problems:
                        failures.append(record)
                        log(f"FAIL {label}: {'; '.join(problems)}")
                    elif (method == GAUSSIAN and kind in ("normal", "student_t", "shifted")
                          and n >= 2 ** 20 and 1 < k < n):
                        log(f"ok   {label} recall={info['recall']:.4f}")
            del x
    torch.cuda.empty_cache()
    log(f"correctness: {len(results)} runs, {len(failures)} failures")
    paths = collections.Counter(r.get("path", "?") for r in results)
    log("paths: " + ", ".join(f"{path} {count}" for path, count in sorted(paths.items())))
    gauss = [r for r in results if r["method"] == "gaussian" and "recall" in r
             and r["kind"] in ("normal", "student_t", "shifted") and r["n"] >= 2 ** 20]
    if gauss:
        log("gaussian on n >= 2^20 (normal, student_t, shifted): "
            f"min recall {min(r['recall'] for r in gauss):.4f}, "
            f"median recall {statistics.median(r['recall'] for r in gauss):.4f}")
    return results, failures


def repeatability(h, n, runs=5):
    """The same input selected `runs` times by each method: how many distinct
    index sets came out. Exact must give one (normal float32 data: the
    magnitudes are distinct); gaussian's is reported."""
    import torch

    stream = torch.cuda.Stream()
    rows, problems = [], []
    with torch.cuda.stream(stream):
        x = make_input("normal", n, torch.float32, seed=4242)
        for density in (0.001, 0.01):
            k = max(1, round(density * n))
            scratch = h.scratch(n, k)
            for method in (EXACT, GAUSSIAN):
                sets = set()
                for _ in range(runs):
                    _, indices, _ = run_select(h, x, k, method, scratch, stream)
                    sets.add(hash(torch.sort(indices).values.cpu().numpy().tobytes()))
                row = {"method": METHOD_NAMES[method], "n": n, "k": k, "runs": runs,
                       "distinct_sets": len(sets)}
                rows.append(row)
                log(f"repeat {row['method']:8s} n={n} k={k}: {len(sets)} distinct index set(s) "
                    f"in {runs} runs")
                if method == EXACT and len(sets) != 1:
                    problems.append(row)
        del x
    torch.cuda.empty_cache()
    return rows, problems


# ---------------------------------------------------------------------------
# Timing.

def time_gpu(fn, stream, warmup, runs):
    """Median milliseconds of fn() on `stream`, measured with CUDA events. A
    sleep kernel keeps the GPU busy while each call is enqueued, so the events
    time the GPU work rather than the host's launch overhead."""
    import torch

    sleep = getattr(torch.cuda, "_sleep", None)
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        times = []
        for _ in range(runs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            if sleep is not None:
                sleep(2_000_000)  # about 1 ms at ~2 GHz: longer than enqueuing fn
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def timing(h, quick):
    import torch

    runs, warmup = (10, 3) if quick else (30, 5)
    stream = torch.cuda.Stream()
    rows = []
    for n in (25_000_000, 100_000_000):
        for kind in ("normal", "student_t"):
            with torch.cuda.stream(stream):
                x = make_input(kind, n, torch.float32, seed=1000 + n % 997)
                dst = torch.empty_like(x)
            stream.synchronize()
            copy_ms = time_gpu(lambda: dst.copy_(x), stream, warmup, runs)
            sum_ms = time_gpu(lambda: torch.sum(x), stream, warmup, runs)
            for density in (0.001, 0.01):
                k = max(1, round(density * n))
                with torch.cuda.stream(stream):
                    values = torch.empty(k, dtype=x.dtype, device="cuda")
                    indices = torch.empty(k, dtype=torch.int32, device="cuda")
                    scratch = h.scratch(n, k)
                stream.synchronize()
                handle = stream.cuda_stream
                row = {"n": n, "k": k, "density": density, "kind": kind, "dtype": "float32",
                       "copy_ms": copy_ms, "sum_ms": sum_ms}
                for method in (GAUSSIAN, EXACT):
                    row[f"{METHOD_NAMES[method]}_ms"] = time_gpu(
                        lambda: h.select(x, k, method, values, indices, scratch, handle),
                        stream, warmup, runs)
                row["torch_topk_ms"] = time_gpu(lambda: torch.topk(x.abs(), k), stream, warmup, runs)
                nbytes = x.numel() * x.element_size()
                read_ms = copy_ms / 2  # the copy reads and writes every byte once
                row["copy_GBps"] = 2 * nbytes / (copy_ms * 1e-3) / 1e9
                row["torch_over_gaussian"] = row["torch_topk_ms"] / row["gaussian_ms"]
                row["torch_over_exact"] = row["torch_topk_ms"] / row["exact_ms"]
                row["gaussian_passes"] = row["gaussian_ms"] / read_ms
                row["exact_passes"] = row["exact_ms"] / read_ms
                rows.append(row)
                del values, indices, scratch
            del x, dst
            torch.cuda.empty_cache()

    header = (f"{'n':>11s} {'data':>9s} {'k':>8s} {'gauss ms':>9s} {'exact ms':>9s} {'topk ms':>9s} "
              f"{'copy ms':>8s} {'copy GB/s':>9s} {'topk/gs':>8s} {'topk/ex':>8s} "
              f"{'gs pass':>7s} {'ex pass':>7s}")
    log(header)
    for r in rows:
        log(f"{r['n']:>11d} {r['kind']:>9s} {r['k']:>8d} {r['gaussian_ms']:>9.3f} {r['exact_ms']:>9.3f} "
            f"{r['torch_topk_ms']:>9.3f} {r['copy_ms']:>8.3f} {r['copy_GBps']:>9.0f} "
            f"{r['torch_over_gaussian']:>8.1f} {r['torch_over_exact']:>8.1f} "
            f"{r['gaussian_passes']:>7.2f} {r['exact_passes']:>7.2f}")
    return rows


# ---------------------------------------------------------------------------

def profile_once(h, n=25_000_000, density=0.001):
    """One warm-up and one profiled call of each method (a profiler sees every
    kernel of both)."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = make_input("normal", n, torch.float32, seed=7)
        k = round(density * n)
        scratch = h.scratch(n, k)
        for method in (GAUSSIAN, EXACT, GAUSSIAN, EXACT):
            run_select(h, x, k, method, scratch, stream)
    log(f"profiled n={n} k={k}")


def local_arch():
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}{minor}"
    except ImportError:
        pass
    return "90"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer timing runs")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--compile-only", action="store_true",
                        help="only compile the harness (both builds); needs nvcc, no GPU, no torch")
    parser.add_argument("--arch", help="compute capability digits for -arch=sm_XX "
                        "(default: the local GPU's, else 90)")
    parser.add_argument("--ptxas-verbose", action="store_true", help="pass -Xptxas -v to nvcc")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--profile-once", action="store_true",
                        help="one call of each method at n = 25M, density 0.001, for a profiler")
    parser.add_argument("--sanitize", action="store_true",
                        help="small sizes only and no timing: for runs under compute-sanitizer")
    args = parser.parse_args(argv)

    build_dir = tempfile.mkdtemp(prefix="tf_topk_harness_")
    try:
        if args.compile_only:
            arch = args.arch or "90"
            build_harness(build_dir, arch, debug_checks=False, ptxas_verbose=args.ptxas_verbose)
            build_harness(build_dir, arch, debug_checks=True, ptxas_verbose=args.ptxas_verbose)
            for debug in (False, True):
                name = "libtf_topk_harness_debug.so" if debug else "libtf_topk_harness.so"
                h = Harness(os.path.join(build_dir, name))  # loads without a GPU
                log(f"  {name}: scratch for n = 25M, k = 25K: {h.scratch_bytes(25_000_000, 25_000)} bytes, debug checks {h.debug_checks}")
            log("compile-only: ok")
            return 0

        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible to PyTorch (use --compile-only to only build)")
        arch = args.arch or local_arch()
        device = torch.cuda.get_device_name()
        log(f"device: {device} (sm_{arch}), torch {torch.__version__}, CUDA {torch.version.cuda}")
        report = {"device": device, "arch": f"sm_{arch}", "torch": torch.__version__,
                  "torch_cuda": torch.version.cuda, "quick": args.quick}
        failures = []
        if args.profile_once:
            profile_once(Harness(build_harness(build_dir, arch)))
            return 0
        if not args.skip_correctness:
            checked = Harness(build_harness(build_dir, arch, debug_checks=True,
                                            ptxas_verbose=args.ptxas_verbose))
            results, failures = correctness(checked, args.quick, sanitize=args.sanitize)
            report["correctness"] = results
            report["failures"] = failures
            if not args.sanitize:
                report["repeatability"], unstable = repeatability(
                    checked, 2 ** 20 + 3 if args.quick else 25_000_000)
                failures = failures + unstable
        if not args.skip_timing and not args.sanitize:
            fast = Harness(build_harness(build_dir, arch, debug_checks=False,
                                         ptxas_verbose=args.ptxas_verbose))
            report["timing"] = timing(fast, args.quick)
        log(f"device: {device}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            log(f"wrote {args.json}")
        if failures:
            log(f"FAILED: {len(failures)} correctness failures")
            return 1
        log("all checks passed" if not args.skip_correctness else "done")
        return 0
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
