"""The all_gather route's collective: `python -m tf_topk.bench gather --workers 4 --json`.

Starts `--workers` local worker processes (MultiWorkerMirroredStrategy from
TF_CONFIG on localhost ports, TensorFlow's gRPC collectives) and times, per
row length, two ways of gathering one float32 row of that length from every
worker:

  tensorflow   `ReplicaContext.all_gather`: a gather of the shapes, then the
               padded rows, then each worker's part sliced out;
  one_gather   `tf_topk.gather.all_gather_rows`: the rows alone, in one
               collective (what the all_gather route and the calibration use).

The two take turns within every round, so a burst of load on the machine
falls on both; each reports the median over the rounds of the slowest
worker's call, and `speedup` is tensorflow / one_gather. Row lengths are what
one worker's all_gather carries: 2k floats (values and indices) plus the small
variables (e.g. the e2e CNN at density 0.001: 2 x 210 + 3,018).
"""

import argparse
import json
import os
import sys
import time

DEFAULT_LENGTHS = "3438,7206,45000,252000"  # the e2e CNN at densities 0.001 and 0.01, the wide MLP at 0.001 and 0.01


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m tf_topk.bench gather",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated row lengths (floats per worker)")
    parser.add_argument("--rounds", type=int, default=60, help="timed calls of each way per length")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error(f"--workers must be >= 2 (a gather needs two), got {args.workers}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if any(n < 1 for n in args.lengths):
        parser.error(f"--lengths must all be >= 1, got {args.lengths}")
    return args


def _worker(args):
    """One worker: time both ways per length, the slowest worker's time per call."""
    import tensorflow as tf

    from tf_topk.calibrate import interleaved_medians, slowest
    from tf_topk.gather import all_gather_rows, gathers_in_one_collective

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def gather_by(way):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def run(row):
            def replica_fn():
                context = tf.distribute.get_replica_context()
                local = tf.identity(row)
                gathered = all_gather_rows(context, local) if way == "one_gather" else \
                    context.all_gather(local, axis=0)
                return gathered[:1]

            return strategy.run(replica_fn)

        return run

    ways = {"tensorflow": gather_by("tensorflow"), "one_gather": gather_by("one_gather")}
    rows = []
    for length in args.lengths:
        row = tf.ones([length], tf.float32)
        calls = [lambda fn=fn: fn(row) for fn in ways.values()]
        tensorflow_s, one_gather_s = slowest(strategy, interleaved_medians(calls, args.rounds))
        rows.append({"length": length, "bytes_per_worker": (args.workers - 1) * 4 * length,
                     "tensorflow_ms": tensorflow_s * 1e3, "one_gather_ms": one_gather_s * 1e3,
                     "speedup": tensorflow_s / one_gather_s})
    print("GATHER " + json.dumps({"rows": rows, "one_collective": gathers_in_one_collective(strategy)}), flush=True)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        _worker(args)
        return 0
    from tf_topk.launch import run_workers

    argv = [sys.executable, "-m", "tf_topk.bench", "gather", "--worker", "--workers", str(args.workers),
            "--lengths", ",".join(map(str, args.lengths)), "--rounds", str(args.rounds)]
    print(f"[gather] {args.workers} workers on localhost, lengths {args.lengths}, {args.rounds} rounds",
          file=sys.stderr, flush=True)
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    result = run_workers(args.workers, argv, env=env, timeout=args.timeout, stream=sys.stderr,
                         cwd=os.getcwd())
    if not result.ok:
        print(result.format_failure(), file=sys.stderr)
        return 1
    line = next(line for line in result.outputs[0].splitlines() if "GATHER " in line)
    found = json.loads(line.split("GATHER ", 1)[1])
    found.update(workers=args.workers, rounds=args.rounds, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if args.json:
        print(json.dumps(found))
    else:
        print(f"{'row length':>10} {'MB/worker':>10} {'tensorflow ms':>14} {'one gather ms':>14} {'speedup':>8}")
        for r in found["rows"]:
            print(f"{r['length']:>10,} {r['bytes_per_worker'] / 1e6:>10.3f} {r['tensorflow_ms']:>14.2f} "
                  f"{r['one_gather_ms']:>14.2f} {r['speedup']:>7.2f}x")
    return 0
