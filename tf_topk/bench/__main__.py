"""Entry point: `python -m tf_topk.bench SUBCOMMAND [options]`."""

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "select": "tf_topk.bench.select",
    "e2e": "tf_topk.bench.e2e",
    "convergence": "tf_topk.bench.convergence",
    "scale": "tf_topk.bench.scale",
    "overhead": "tf_topk.bench.overhead",
    "advise": "tf_topk.bench.advise",
    "gather": "tf_topk.bench.gather",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        parser = argparse.ArgumentParser(prog="python -m tf_topk.bench")
        parser.add_argument("subcommand", choices=sorted(SUBCOMMANDS))
        parser.parse_args(argv[:1])  # prints usage and exits
    module = importlib.import_module(SUBCOMMANDS[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
