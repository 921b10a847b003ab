"""The first traced steps of a custom training loop: `python -m tf_topk.bench trace --json`.

A custom loop calls the exchange inside its own `tf.function`, which AutoGraph converts, and with it
everything the function calls unless told not to. The exchange is written with `tf.cond` wherever a
branch depends on a tensor, so `SparseExchange.__call__` is marked
`tf.autograph.experimental.do_not_convert`. This measures what that saves: in a new process each (a
process converts a function once), the same loop over 2 logical CPUs (MirroredStrategy) traces
`--loops` exchanges of a small model in turn, timing each one's first call (trace and first step)
with the exchange as it is (`unconverted`) and with AutoGraph converting it (`converted`: the
decorator taken off in that process). The ratio of the first loop's times is the first step a user
waits for; the later loops' ratio is what each further trace costs (a new model, a new strategy).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(converted, loops):
    """In a new process: each loop's first-call seconds, as JSON on stdout."""
    import tensorflow as tf

    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 2)
    import tf_topk

    if converted:  # the exchange as AutoGraph converts it: the decorator's target
        tf_topk.SparseExchange.__call__ = tf_topk.SparseExchange.__call__.__wrapped__
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    shapes = [(100, 50), (300,), (3,)]
    seconds = []
    for loop in range(loops):
        start = time.perf_counter()
        with strategy.scope():
            variables = [tf.Variable(tf.zeros(shape)) for shape in shapes]
            exchange = tf_topk.SparseExchange(variables, density=0.1, min_size=10, density_warmup_steps=0,
                                              momentum=0.9 if loop % 2 else None,
                                              exchange_mode=("allgather", "allreduce")[loop // 2 % 2])

        @tf.function
        def step():
            return strategy.run(lambda: exchange([tf.ones(shape) for shape in shapes]).grads[0])

        strategy.experimental_local_results(step())[0].numpy()
        seconds.append(time.perf_counter() - start)
    print(json.dumps(seconds))


def measure(loops):
    """Both variants' first-call seconds per loop, and the ratios (converted over unconverted)."""
    times = {}
    for name in ("unconverted", "converted"):
        proc = subprocess.run([sys.executable, "-m", "tf_topk.bench.trace", "--child", name, "--loops", str(loops)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")})
        if proc.returncode != 0:
            raise RuntimeError(f"the {name} run failed:\n{proc.stderr[-3000:]}")
        times[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    later = {name: statistics.median(seconds[1:]) if len(seconds) > 1 else None for name, seconds in times.items()}
    return {
        "loops": loops, "replicas": 2,
        **{f"{name}_s": [round(s, 3) for s in seconds] for name, seconds in times.items()},
        "first_ratio": round(times["converted"][0] / times["unconverted"][0], 2),
        "later_ratio": round(later["converted"] / later["unconverted"], 2) if later["converted"] else None,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tf_topk.bench trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loops", type=int, default=4, help="exchanges traced one after the other (>= 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--child", choices=("converted", "unconverted"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loops < 1:
        parser.error(f"--loops must be >= 1, got {args.loops}")
    if args.child:
        _child(args.child == "converted", args.loops)
        return 0
    if not args.json:
        print(f"timing {args.loops} traced exchanges in two new processes ...", file=sys.stderr, flush=True)
    result = measure(args.loops)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
