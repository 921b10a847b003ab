"""A trial of a per-variable floor on k, before building it into the library:
`python benchmarks/k_floor_trial.py --floor 64 CONVERGENCE_ARGS...`.

Runs `python -m tf_topk.bench convergence CONVERGENCE_ARGS` with every sparsified
variable sending at least `--floor` entries a step (at most all of them): k =
max(ceil(density * n), min(n, floor)), and buckets sized for it. Measured on the
CNNs at density 0.001 (benchmarks/RESULTS.md, "Convolutional networks at 0.1%
density").
"""

import argparse
import sys

import tensorflow as tf

from tf_topk import config, schedule
from tf_topk.bench import convergence


def install_floor(floor):
    """Patch DensitySchedule.k and ExchangeConfig.max_pairs for this process."""
    scheduled_k = schedule.DensitySchedule.k
    max_pairs = config.ExchangeConfig.max_pairs

    def k(self, size, step=None):
        base = scheduled_k(self, size, step)
        return max(base, min(size, floor)) if isinstance(base, int) else tf.maximum(base, min(size, floor))

    schedule.DensitySchedule.k = k
    config.ExchangeConfig.max_pairs = lambda self, size: max(max_pairs(self, size), min(size, floor))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", type=int, required=True, help="the fewest entries a variable sends a step")
    args, rest = parser.parse_known_args(argv)
    if args.floor < 1:
        parser.error(f"--floor must be >= 1, got {args.floor}")
    install_floor(args.floor)
    return convergence.main(rest)


if __name__ == "__main__":
    sys.exit(main())
