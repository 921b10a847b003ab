"""A trial of one top-k over a bucket by plain magnitude (gTop-k's ranking), beside the library's:
`python benchmarks/global_topk_trial.py [--plain] [--print-counts] CONVERGENCE_ARGS...`.

Runs `python -m tf_topk.bench convergence --exchange-mode allgather
--selection-scope bucket CONVERGENCE_ARGS`: each bucket's k (the sum of its
variables' k) chosen by one selection over all its variables. The library
ranks each entry by its magnitude over its variable's root mean square
(`tf_topk.selector.select_over_bucket`); `--plain` ranks by magnitude alone,
so a layer with larger gradients takes more of k whether or not its entries
stand out. `--print-counts` prints, every step, the bucket's sizes and how
many entries each variable sent (to stderr, lines starting "counts").
Measured on the CNNs at density 0.001 (benchmarks/RESULTS.md, "Convolutional
networks at 0.1% density").
"""

import argparse
import sys

import tensorflow as tf

from tf_topk import exchange, selector
from tf_topk.bench import convergence


def install(plain=False, print_counts=False):
    """Patch the bucket's ranking and reporting (`tf_topk.selector`, as the
    exchange calls it) for this process."""
    if plain:  # every variable's root mean square taken as 1: magnitude alone
        selector._finite_rms = lambda flat: tf.ones([], flat.dtype)
    if print_counts:
        select_over_bucket = exchange.select_over_bucket

        def counting(chosen_by, accumulated, k):
            chosen = select_over_bucket(chosen_by, accumulated, k)
            tf.print("counts", [int(a.shape[0]) for a in accumulated],
                     tf.stack([tf.math.count_nonzero(values, dtype=tf.int32) for values, _ in chosen]),
                     output_stream=sys.stderr, summarize=-1)
            return chosen

        exchange.select_over_bucket = counting


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", action="store_true", help="rank by magnitude alone (gTop-k)")
    parser.add_argument("--print-counts", action="store_true",
                        help="print each step's entries sent per variable to stderr")
    args, rest = parser.parse_known_args(argv)
    install(args.plain, args.print_counts)
    return convergence.main(["--exchange-mode", "allgather", "--selection-scope", "bucket", *rest])


if __name__ == "__main__":
    sys.exit(main())
