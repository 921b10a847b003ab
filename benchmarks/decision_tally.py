"""How often the default (the autopilot) decides the same way: the same two-worker run N times, one
line each with the decision the chief printed, then the tally.

    python benchmarks/decision_tally.py --runs 10                 # examples/digits_fit.py --autopilot
    python benchmarks/decision_tally.py --runs 10 --model wide    # Adam, three 512-wide layers
    python benchmarks/decision_tally.py --runs 10 --busy          # with a busy loop on every core

Each run is `python -m tf_topk.launch --workers 2 --chief-only --no-prefix ...`; `--busy` starts one
spinning process per core for the runs' duration (stopped on exit, also on failure)."""

import argparse
import collections
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The wide model: Adam on scikit-learn's digits, three 512-wide hidden layers, one epoch, the default.
WIDE = """
import keras, tensorflow as tf, tf_topk
from sklearn.datasets import load_digits
strategy = tf.distribute.MultiWorkerMirroredStrategy()
x, y = load_digits(return_X_y=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), *(keras.layers.Dense(512, activation="relu") for _ in range(3)),
                              keras.layers.Dense(10)])
    model.compile(tf_topk.TopKOptimizer(keras.optimizers.Adam(1e-3)),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit((x / 16.0).astype("float32"), y, batch_size=64, epochs=1, verbose=0)
"""


def spin():
    while True:
        pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--model", choices=("digits", "wide"), default="digits")
    parser.add_argument("--busy", action="store_true", help="a busy loop on every core meanwhile")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    script = [str(REPO / "examples" / "digits_fit.py"), "--autopilot", "--epochs", "1", "--verbose", "0"]
    folder = tempfile.TemporaryDirectory()
    if args.model == "wide":
        script = [str(Path(folder.name) / "wide_adam.py")]
        Path(script[0]).write_text(WIDE)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(os.cpu_count() if args.busy else 0)]
    for process in spinners:
        process.start()
    decisions = collections.Counter()
    try:
        for run in range(1, args.runs + 1):
            # The launcher's own --timeout stops its workers; the outer one is only a backstop.
            proc = subprocess.run([sys.executable, "-m", "tf_topk.launch", "--workers", "2", "--timeout", "540",
                                   "--chief-only", "--no-prefix", *script], cwd=REPO, capture_output=True, text=True,
                                  timeout=600,
                                  env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_TOPK_VERBOSE": "1"})
            output = proc.stdout + proc.stderr
            lines = [line for line in output.splitlines() if line.startswith("tf_topk autopilot:")]
            line = lines[0] if lines else f"no decision line (exit {proc.returncode})"
            rounds = re.search(r"; (\d+) rounds\)", output)  # the calibration's line (TF_TOPK_VERBOSE=1)
            if rounds:
                line += f" [trial of {rounds.group(1)} rounds]"
            decisions[line.split(":", 2)[1].split(",")[0].strip() if lines else "failed"] += 1  # the route
            print(f"run {run}: {line}", flush=True)
    finally:
        for process in spinners:
            process.terminate()
        folder.cleanup()
    print("tally: " + ", ".join(f"{count} {decision}" for decision, count in decisions.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
