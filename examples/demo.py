"""The main job (`make demo`): two local workers, dense all-reduce vs TopK vs the autopilot, side by side.

Runs examples/digits_fit.py three times through the launcher (MultiWorkerMirroredStrategy
over localhost, TF_CONFIG on free ports): dense, TopK at --density, and the
autopilot, TopKOptimizer's default when no density is given (it measures
localhost and chooses). Prints test accuracy,
bytes each worker sends per step and median step time for each, what the
autopilot found and chose, and in one paragraph what `python -m tf_topk.bench
advise` predicts for this model on a 1 Gbit/s and a 100 Mbit/s cluster of as
many workers.

    python examples/demo.py [--workers 2] [--density 0.01] [--epochs 10]
"""

import argparse
import json
import os
import sys
import tempfile
import textwrap

from tf_topk.autopilot import advise
from tf_topk.cost import CostModel
from tf_topk.launch import run_workers, shown_lines

ROUTE_NAMES = {0: "dense", 1: "all_gather", 2: "agreed indices", 3: "dense_bf16"}

HERE = os.path.dirname(os.path.abspath(__file__))

def run(label, workers, epochs, extra, folder):
    out = os.path.join(folder, label)
    print(f"== {label}: {workers} workers, {epochs} epochs", flush=True)
    argv = [sys.executable, os.path.join(HERE, "digits_fit.py"), "--epochs", str(epochs), "--verbose", "0",
            "--out", out, *extra]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    # shown_lines(): the workers' lines without TensorFlow's start-up log (a failure still shows them all).
    result = run_workers(workers, argv, env=env, timeout=900, show=shown_lines())
    if not result.ok:
        raise SystemExit(f"{label} failed: {result.format_failure()}")
    with open(os.path.join(out, "worker0.json")) as f:
        return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tf_topk_demo_") as folder:
        rows = [("dense all-reduce", run("dense", args.workers, args.epochs, ["--dense"], folder)),
                (f"TopK density {args.density}",
                 # The density's own steps (a run's after its warm-up): what its step time is compared on.
                 run("topk", args.workers, args.epochs, ["--density", str(args.density), "--density-warmup-steps", "0"],
                     folder)),
                ("autopilot (default)", run("autopilot", args.workers, args.epochs, ["--autopilot"], folder))]
    print()
    print(format_table(rows))
    print("\nOn localhost the network is free, so step times show the selection's cost, not its benefit;"
          "\n`python -m tf_topk.bench e2e` measures training over a bandwidth-limited network.")
    autopilot = rows[2][1]
    print(f"\nWhat the autopilot chose on localhost, and why:\n  {autopilot['autopilot_decision']}")
    print(f"  (its calibration: {autopilot['autopilot'].removeprefix('tf_topk autopilot: ')})")
    print(f"  (last step: density {autopilot['compression'].get('density', float('nan')):.4f}, route "
          f"{ROUTE_NAMES.get(round(autopilot['compression'].get('exchange_mode', -1)), '?')})")
    print("\n" + advice_paragraph(rows[0][1]["params"], args.workers, args.density))
    return 0


def format_table(rows):
    """The three runs side by side: (label, worker 0's report) each, dense first. Two ratios, each
    named for what it compares: the bytes dense sends over the run's, and dense's step time over it."""
    dense = rows[0][1]
    lines = [f"{'configuration':<24} {'test accuracy':>13} {'bytes/step/worker':>18} {'bytes: x fewer':>15} "
             f"{'median step':>12} {'speed vs dense':>15}"]
    for label, report in rows:
        fewer = dense["bytes_per_step"] / report["bytes_per_step"] if report["bytes_per_step"] else float("nan")
        speed = dense["median_step_seconds"] / report["median_step_seconds"]
        lines.append(f"{label:<24} {report['test_accuracy']:>13.4f} {report['bytes_per_step']:>18,.0f} "
                     f"{fewer:>14.1f}x {report['median_step_seconds'] * 1e3:>10.1f}ms {speed:>14.2f}x")
    return "\n".join(lines)


def advice_paragraph(params, workers, density, links=("1gbit", "100mbit")):
    """What `python -m tf_topk.bench advise` predicts for this model on `workers` workers over each
    link, one sentence a link: dense's step, `density`'s on its fastest route, the autopilot's choice."""
    sentences = []
    for link in links:
        model = CostModel.from_link(workers, link)
        advice = advise(model, params, densities=(density,))
        dense = next(r["seconds"] for r in advice["rows"] if r["route"] == "dense")
        route = advice["choices"][density]
        fixed = next(r["seconds"] for r in advice["rows"] if r["density"] in (density, None) and r["route"] == route)
        span = advice["autopilot_range"]
        choice = f"every entry, {advice['autopilot']}" if span is None else \
            f"{advice['autopilot']} at densities {span[0]:g} to {span[1]:.2g}"
        sentences.append(f"at {link} a step's exchange is predicted {dense * 1e3:,.1f} ms dense and "
                         f"{fixed * 1e3:,.1f} ms at density {density:g} ({route}), and the autopilot would "
                         f"send {choice}")
    return textwrap.fill(f"On a cluster of {workers} workers (`python -m tf_topk.bench advise --params {params} "
                         f"--workers {workers} --link LINK` for the whole table): " + "; ".join(sentences) + ".",
                         width=100)


if __name__ == "__main__":
    sys.exit(main())
