"""What the autopilot would do: `python -m tf_topk.bench advise`.

Predicts, per step, what exchanging a model's gradients costs by the dense
all-reduce, the 16-bit (bfloat16) dense all-reduce, and all_gather and
agreed indices at a few densities, the fastest route at each fixed density,
and what the autopilot would do there: the same plan (`tf_topk.autopilot.Plan`)
an optimizer makes from the same measured model. Two sources for the numbers:

  a cluster one describes (no TensorFlow needed):
    python -m tf_topk.bench advise --params 12609546 --workers 8 --link 100mbit
    python -m tf_topk.bench advise --params 470784 --workers 2 --link 100mbit --optimizer adamw
  the cluster this runs on, measured (`tf_topk.calibrate`): under TF_CONFIG
  (`python -m tf_topk.launch --workers 4 -m tf_topk.bench advise --params 12609546 --calibrate`),
  MultiWorkerMirroredStrategy;
  otherwise MirroredStrategy over --workers logical CPUs of this process:
    python -m tf_topk.bench advise --params 12609546 --workers 2 --calibrate

Predictions cover the exchange only (the model's own compute is the same on
every route); the selection's compute is part of the sparse routes' time.
"""

import argparse
import json
import os
import sys

from tf_topk.autopilot import ADVISE_DENSITIES, advise, format_advice
from tf_topk.cost import DEFAULT_ROUNDING_S_PER_ENTRY, DEFAULT_SELECTION_S_PER_ENTRY, CostModel, LinkModel


def _densities(text):
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"densities must be comma-separated numbers in (0, 1], got {text!r}")
    return values


def measured_model(args):
    """(CostModel, one-line description) from calibrating the cluster this process is part of."""
    import tensorflow as tf

    if os.environ.get("TF_CONFIG"):
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                                   [tf.config.LogicalDeviceConfiguration()] * args.workers)
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.workers)])
    from tf_topk.calibrate import calibrate

    found = calibrate(strategy, entries=args.params, budget_s=args.budget)
    return found.model, found.describe()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tf_topk.bench advise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, required=True, help="gradient entries the model exchanges")
    parser.add_argument("--workers", type=int, default=4, help="workers (replicas) of the cluster (default 4)")
    parser.add_argument("--link", default="1gbit", help="link rate of a described cluster: 100mbit, 1gbit, 10gbit")
    parser.add_argument("--latency-ms", type=float, default=0.5, help="per-collective latency of a described "
                        "cluster, in ms (default 0.5)")
    parser.add_argument("--calibrate", action="store_true", help="measure this cluster instead of --link")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds the calibration may take (default 2)")
    parser.add_argument("--densities", type=_densities, default=list(ADVISE_DENSITIES),
                        help="comma-separated densities to predict (default 0.1,0.01,0.001,0.0001)")
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw", "other"), default="sgd",
                        help="the inner optimizer: adam or adamw take decoupled momentum at a fixed density where "
                             "the plan sparsifies, the others top-k with error feedback at an adaptive density "
                             "(default sgd)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args(argv)
    if args.params < 1:
        parser.error(f"--params must be >= 1, got {args.params}")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if not args.latency_ms >= 0:
        parser.error(f"--latency-ms must be >= 0, got {args.latency_ms}")
    if args.calibrate:
        model, source = measured_model(args)
    else:
        try:
            link = LinkModel.from_rate(args.link, latency_s=args.latency_ms / 1e3)
        except ValueError as error:
            parser.error(f"--link: {error}")
        model = CostModel(args.workers, link, link, DEFAULT_SELECTION_S_PER_ENTRY, DEFAULT_ROUNDING_S_PER_ENTRY)
        source = f"described: {args.workers} workers, {args.link}, {args.latency_ms:g} ms per collective"
    advice = advise(model, args.params, args.densities, decoupled=args.optimizer in ("adam", "adamw"))
    if args.json:
        print(json.dumps({"source": source, "params": args.params, "replicas": model.replicas,
                          "model": {"all_reduce": vars(model.all_reduce), "all_gather": vars(model.all_gather),
                                    "selection_s_per_entry": model.selection_s_per_entry,
                                    "rounding_s_per_entry": model.rounding_s_per_entry},
                          "rows": advice["rows"], "choices": {f"{d:g}": r for d, r in advice["choices"].items()},
                          "dense_end": advice["dense_end"], "autopilot": advice["autopilot"],
                          "method": advice["method"], "autopilot_density": advice["autopilot_density"],
                          "autopilot_range": advice["autopilot_range"]}))
    else:
        print(source)
        print(format_advice(model, args.params, advice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
