"""A trial of a dense warm-up in place of DGC's falling density, before building
it into the library: `python benchmarks/dense_warmup_trial.py CONVERGENCE_ARGS...`.

Runs `python -m tf_topk.bench convergence CONVERGENCE_ARGS` with `--warmup-epochs
E` meaning every entry sent for the first E epochs, then the density from step
E * steps_per_epoch on (`--warmup-fraction F`: F * E epochs instead). A dense
warm-up travels through the route of the final density (the memory's dense
steps' mechanism), where DGC's falling densities make "auto" route for the
largest of them. Measured on the CNNs at density 0.001 (benchmarks/RESULTS.md,
"Convolutional networks at 0.1% density").
"""

import argparse
import sys

from tf_topk import schedule
from tf_topk.bench import convergence


def install_dense_warmup(fraction):
    """Patch tf_topk.schedule.dgc_warmup for this process."""

    def dense_warmup(steps_per_epoch, epochs=4, final=0.001, initial=0.25):
        del initial
        steps = max(1, round(fraction * epochs * steps_per_epoch))
        return [(0, 1.0), (steps, final)]

    schedule.dgc_warmup = dense_warmup


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup-fraction", type=float, default=1.0,
                        help="the dense steps as a fraction of --warmup-epochs' steps")
    args, rest = parser.parse_known_args(argv)
    if not 0 < args.warmup_fraction <= 1:
        parser.error(f"--warmup-fraction must be in (0, 1], got {args.warmup_fraction}")
    install_dense_warmup(args.warmup_fraction)
    return convergence.main(rest)


if __name__ == "__main__":
    sys.exit(main())
