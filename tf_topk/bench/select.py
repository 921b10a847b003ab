"""Selection-op benchmark: `python -m tf_topk.bench select --json`.

On one tensor, in one process: median seconds of tf_topk's gaussian and exact
selection, of `tf.math.top_k(|x|)` and of a one-pass reduction (`tf.reduce_sum`,
the memory-bandwidth yardstick); the gaussian method's count of non-zero
outputs and its recall against the exact top-k set. With `--profile-depths`,
also the fused error-feedback op without and with the adaptive density's
magnitude profile at each depth (`profile_density`: the share of entries,
from the largest down, that must be profiled exactly), as ratios to it.
"""

import argparse
import json
import math
import sys

import numpy as np
import tensorflow as tf

import tf_topk
from tf_topk.bench.timing import median_seconds


def make_data(n, dist, seed):
    rng = np.random.default_rng(seed)
    if dist == "normal":
        data = rng.standard_normal(n, dtype=np.float32)
    elif dist == "student_t":
        data = rng.standard_t(3, size=n).astype(np.float32)
    else:
        raise ValueError(f"--dist must be normal or student_t, got {dist!r}")
    return data


def recall(selected_indices, exact_indices):
    """Fraction of the exact top-k set that the selection returned."""
    exact = set(exact_indices.tolist())
    if not exact:
        return 1.0
    return len(exact.intersection(selected_indices.tolist())) / len(exact)


def profile_costs(x, k, depths, repeats):
    """{"fused_error_feedback": seconds of the fused op on x (residual 0) selecting k,
    "profile": {depth: seconds with the magnitude profile that deep}, "profile_over_fused": ratios}."""
    residual = tf.zeros_like(x)

    def fused(**profile):
        return lambda: tf_topk.error_feedback_topk(x, residual, k, **profile).remaining[:1].numpy()

    base = median_seconds(fused(), repeats)
    seconds = {depth: median_seconds(fused(with_profile=True, profile_density=depth), repeats) for depth in depths}
    return {"fused_error_feedback": round(base, 9), "profile": {str(d): round(s, 9) for d, s in seconds.items()},
            "profile_over_fused": {str(d): round(s / base, 2) for d, s in seconds.items()}}


def run(n, density, dist="normal", device="cpu", repeats=7, seed=0, profile_depths=()):
    """Measure one configuration; returns a dict (the JSON printed)."""
    k = max(1, int(math.ceil(density * n)))
    device_name = {"cpu": "/CPU:0", "gpu": "/GPU:0"}[device]
    if device == "gpu" and not tf.config.list_physical_devices("GPU"):
        raise SystemExit("--device gpu: TensorFlow sees no GPU on this machine")
    with tf.device(device_name):
        x = tf.constant(make_data(n, dist, seed))

        def gaussian():
            return tf_topk.approx_topk(x, k, method="gaussian")

        def exact():
            return tf_topk.approx_topk(x, k, method="exact")

        def math_top_k():
            return tf.math.top_k(tf.abs(x), k=k, sorted=False)

        def one_pass():
            return tf.reduce_sum(x)

        timings = {}
        for label, fn in (("tf_topk_gaussian", gaussian), ("tf_topk_exact", exact),
                          ("tf_math_top_k", math_top_k), ("one_pass", one_pass)):
            timings[label] = median_seconds(lambda: tf.nest.map_structure(lambda t: t.numpy(), fn()),
                                            repeats)
        g_values, g_indices = gaussian()
        _, e_indices = exact()
        profiles = profile_costs(x, k, profile_depths, repeats) if profile_depths else {}
    g_values, g_indices, e_indices = g_values.numpy(), g_indices.numpy(), e_indices.numpy()
    result = {
        "n": n, "k": k, "density": density, "dist": dist, "device": device,
        "threads": tf.config.threading.get_intra_op_parallelism_threads() or None,
        **{label: round(seconds, 6) for label, seconds in timings.items()},
        "count": int(np.count_nonzero(g_values)),
        "recall": round(recall(g_indices[g_values != 0], e_indices), 5),
        "speedup_gaussian_vs_top_k": round(timings["tf_math_top_k"] / timings["tf_topk_gaussian"], 2),
        "speedup_exact_vs_top_k": round(timings["tf_math_top_k"] / timings["tf_topk_exact"], 2),
        "gaussian_over_one_pass": round(timings["tf_topk_gaussian"] / timings["one_pass"], 2),
        **profiles,
    }
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tf_topk.bench select", description=__doc__)
    parser.add_argument("--n", type=int, default=25_000_000, help="number of entries")
    parser.add_argument("--density", type=float, default=0.001, help="k / n")
    parser.add_argument("--dist", choices=("normal", "student_t"), default="normal")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-depths", default="",
                        help="comma-separated profile depths in (0, 1]: also time the fused error-feedback op "
                             "with the magnitude profile that deep (e.g. 0.01,0.03,0.15,1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args(argv)
    try:
        depths = [float(d) for d in args.profile_depths.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--profile-depths must be comma-separated numbers, got {args.profile_depths!r}")
    if any(not 0 < d <= 1 for d in depths):
        parser.error(f"--profile-depths must be in (0, 1], got {args.profile_depths!r}")
    if args.n <= 0:
        parser.error(f"--n must be positive, got {args.n}")
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    result = run(args.n, args.density, args.dist, args.device, args.repeats, args.seed, depths)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
