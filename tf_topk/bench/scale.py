"""Bytes per worker as the number of workers grows: `python -m tf_topk.bench scale --workers 2,4,8 --json`.

For each P, P replicas (logical CPUs of a fresh process, MirroredStrategy) run a
few exchange steps of random gradients for a model of `--size` sparsified
entries plus `--small` entries on the dense path, once per exchange mode
("allgather", "allreduce", "auto"), and report the bytes each worker sends
per step as the exchange's own `bytes_sent` statistic says (the volume of
its ring collectives: bytes do not depend on CPU speed), with the dense
all-reduce's (`bytes_dense`). The same formulas (`tf_topk.routes.mode_bytes`)
then project P = 16 ... 1024.
"""

import argparse
import json
import math
import os
import subprocess
import sys

from tf_topk.routes import AUTO_ROUTES, MODE_CODES, choose_mode, dense_path_bytes, mode_bytes, ring_all_reduce_bytes

MODES = ("allgather", "allreduce", "auto")
PROJECTED = (16, 32, 64, 128, 256, 512, 1024)
MIN_SIZE = 4096


def _workers(text):
    try:
        workers = sorted({int(p) for p in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"workers must be comma-separated ints, got {text!r}") from None
    if not workers or workers[0] < 2:
        raise argparse.ArgumentTypeError(f"workers must be ints >= 2, got {text!r}")
    return workers


def _shapes(size, small):
    """Two sparsified variables of size/2 entries and one dense-path variable of `small`."""
    half = size // 2
    return [(half,), (size - half,), (small,)]


def measure(replicas, size, small, density, steps):
    """Runs the exchanges over `replicas` logical CPUs of this process (TensorFlow
    not yet started); returns the row of this P."""
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    import tf_topk

    shapes = _shapes(size, small)
    rng = np.random.default_rng(0)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    row = {"workers": replicas, "source": "measured"}
    for mode in MODES:
        with strategy.scope():
            variables = [tf.Variable(tf.zeros(shape)) for shape in shapes]
            exchange = tf_topk.SparseExchange(variables, density=density, min_size=MIN_SIZE, exchange_mode=mode,
                                              density_warmup_steps=0)  # the density's own steps

        @tf.function
        def step(grads, exchange=exchange):
            def replica_fn():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                return exchange([tf.gather(g, replica) for g in grads]).stats

            return strategy.run(replica_fn)

        sent = []
        for _ in range(steps):
            grads = [tf.constant(rng.standard_normal((replicas, *shape)).astype(np.float32)) for shape in shapes]
            stats = step(grads)
            sent.append(float(strategy.experimental_local_results(stats["bytes_sent"])[0]))
        row[mode] = sum(sent) / len(sent)
        row["dense"] = float(strategy.experimental_local_results(stats["bytes_dense"])[0])
        if mode == "auto":
            code = float(strategy.experimental_local_results(stats["exchange_mode"])[0])
            row["auto_mode"] = next(m for m, c in MODE_CODES.items() if c == code)
    return [row]


def small_bytes(mode, small, replicas):
    """Bytes of the dense-path entries and the non-finite count beside a
    bucket of `mode` (`tf_topk.routes.dense_path_bytes`)."""
    return dense_path_bytes(mode, small + 1, replicas)


def projection(replicas, size, small, density):
    """The formula row for P = replicas."""
    shapes = _shapes(size, small)
    sparse = [math.prod(s) for s in shapes if math.prod(s) >= MIN_SIZE]
    entries, pairs = sum(sparse), sum(max(1, math.ceil(density * n)) for n in sparse)
    row = {"workers": replicas, "source": "formula",
           "dense": ring_all_reduce_bytes(4.0 * (size + small), replicas)}
    for mode in ("allgather", "allreduce"):
        row[mode] = mode_bytes(mode, pairs, entries, replicas) + small_bytes(mode, small, replicas)
    auto = choose_mode(replicas, pairs, entries)
    row["auto"] = AUTO_ROUTES[auto].bytes_for_k(pairs, entries, replicas) + small_bytes(auto, small, replicas)
    row["auto_mode"] = auto
    return row


def targets(rows, size, small, density):
    """The issue's targets, each with its figure: the agreed indices' pairs
    (without the small variables) below 16 bytes a pair at every P, measured
    and projected; how all_gather and the agreed indices grow from the
    smallest to the largest P measured."""
    by_p = {r["workers"]: r for r in rows if r["source"] == "measured"}
    low, high = min(by_p), max(by_p)
    pairs = sum(max(1, math.ceil(density * n)) for n in (size // 2, size - size // 2))

    def sparse(row, mode):  # without the small variables and the non-finite count
        return row[mode] - small_bytes(mode, small, row["workers"])

    agreed = {r["workers"]: sparse(r, "allreduce") for r in rows}
    return {
        "pairs": pairs,
        "allreduce_pair_bytes_by_P": agreed,
        "allreduce_below_16_bytes_a_pair_every_P": all(v < 16 * pairs for v in agreed.values()),
        f"allgather_growth_P{low}_to_P{high}": round(by_p[high]["allgather"] / by_p[low]["allgather"], 3),
        f"allreduce_sparse_growth_P{low}_to_P{high}": round(sparse(by_p[high], "allreduce")
                                                            / sparse(by_p[low], "allreduce"), 3),
        f"allgather_sparse_growth_P{low}_to_P{high}": round(sparse(by_p[high], "allgather")
                                                            / sparse(by_p[low], "allgather"), 3),
    }


def _table(rows):
    lines = [f"{'P':>5} {'source':>9} {'dense':>12} {'allgather':>12} {'allreduce':>12} {'auto':>12}  auto picks"]
    for r in rows:
        lines.append(f"{r['workers']:>5} {r['source']:>9} {r['dense']:>12,.0f} {r['allgather']:>12,.0f} "
                     f"{r['allreduce']:>12,.0f} {r['auto']:>12,.0f}  {r['auto_mode']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tf_topk.bench scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=_workers, default=[2, 4, 8], help="P values to run, e.g. 2,4,8")
    parser.add_argument("--size", type=int, default=1_000_000, help="sparsified entries (two variables)")
    parser.add_argument("--small", type=int, default=2_000, help="entries on the dense path (one variable)")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=2, help="exchange steps per P and mode")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.size < 2 * MIN_SIZE:
        parser.error(f"--size must be >= {2 * MIN_SIZE} (two sparsified variables), got {args.size}")
    if not 0 < args.small < MIN_SIZE:
        parser.error(f"--small must be in [1, {MIN_SIZE}) to take the dense path, got {args.small}")
    if not 0.0 < args.density <= 1.0:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.measure:
        print(json.dumps(measure(args.workers[0], args.size, args.small, args.density, args.steps)))
        return 0
    # Logical CPUs must be set before TensorFlow starts, and one process holds
    # one group of replicas: measure each P in a fresh process.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    rows = []
    for replicas in args.workers:
        child = [sys.executable, "-m", "tf_topk.bench.scale", "--measure", "--workers", str(replicas),
                 "--size", str(args.size), "--small", str(args.small), "--density", str(args.density),
                 "--steps", str(args.steps)]
        proc = subprocess.run(child, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        rows += json.loads(proc.stdout.strip().splitlines()[-1])
    rows += [projection(p, args.size, args.small, args.density) for p in PROJECTED if p > max(args.workers)]
    result = {"size": args.size, "small": args.small, "density": args.density, "steps": args.steps,
              "rows": rows, "targets": targets(rows, args.size, args.small, args.density)}
    if args.json:
        print(json.dumps(result))
    else:
        print(_table(rows))
        for name, value in result["targets"].items():
            print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
