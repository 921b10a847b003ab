"""Several runs of examples/digits_fit.py in one cluster: `fit_matrix.py OUT NAME=ARGS [NAME=ARGS ...]`.

Each NAME=ARGS is one run (ARGS: digits_fit's options, space-separated); its results go to OUT/NAME as
digits_fit's --out writes them. The workers start TensorFlow and form the cluster once, then train
every run in turn under the one MultiWorkerMirroredStrategy, as a process that trains several models
would.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import digits_fit  # noqa: E402


def main(out, *runs):
    strategy = None
    for run in runs:
        name, _, options = run.partition("=")
        args = digits_fit.parse_args([*options.split(), "--verbose", "0", "--out", str(Path(out) / name)])
        strategy = strategy or digits_fit.make_strategy(args)
        digits_fit.train(args, strategy)


if __name__ == "__main__":
    main(*sys.argv[1:])
