"""Entry point: `python -m tf_topk.bench SUBCOMMAND [options]` (`--help` lists what each measures)."""

import argparse
import importlib
import sys

# Subcommand -> (module, what it measures in one line).
SUBCOMMANDS = {
    "select": ("tf_topk.bench.select", "the selection op against tf.math.top_k and one read pass, with its recall"),
    "e2e": ("tf_topk.bench.e2e", "step time and bytes of real workers on rate-limited links (network namespaces)"),
    "convergence": ("tf_topk.bench.convergence", "accuracy or loss against dense training, per method and density"),
    "suite": ("tf_topk.bench.suite", "the default against dense on the development and the validation tasks, paired"),
    "scale": ("tf_topk.bench.scale", "bytes per worker as the number of workers grows, per exchange mode"),
    "overhead": ("tf_topk.bench.overhead", "what the exchange costs beyond the selection (fused op, collectives)"),
    "advise": ("tf_topk.bench.advise", "predicted step time of every route and density, and the autopilot's choice"),
    "gather": ("tf_topk.bench.gather", "the all_gather route's one collective against TensorFlow's all_gather"),
    "trace": ("tf_topk.bench.trace", "a custom loop's first traced steps, the exchange converted by AutoGraph or not"),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        parser = argparse.ArgumentParser(
            prog="python -m tf_topk.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
            description="tf_topk's benchmarks; `python -m tf_topk.bench SUBCOMMAND --help` for one's options.",
            epilog="subcommands:\n" + "\n".join(f"  {name:<12} {text}" for name, (_, text) in SUBCOMMANDS.items()))
        parser.add_argument("subcommand", choices=list(SUBCOMMANDS))
        parser.parse_args(argv[:1])  # prints usage (and, with --help, each subcommand's line) and exits
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
