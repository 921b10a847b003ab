"""How far TopKOptimizer in front of Adam moves an entry, against Keras's Adam on the same data:
`python benchmarks/adam_safety.py [--floors 0,0.1,0.2,0.3,0.5,1.0]`.

Two cases from tests/test_adam_safety.py, run for each configuration there (the default, a fixed
density 0.01, Adam's momentum correction) and for the correction at each preconditioner floor
(`tf_topk.memory.PRECONDITIONER_FLOOR`, set here for the run): embedding rows first seen after 110
steps (their largest move over the next 20), and a model trained 30 steps by plain Adam and then
wrapped (the largest move of its first wrapped step). Prints one row per case and configuration:
the move, Keras's Adam's, and their ratio.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import keras  # noqa: E402

import tf_topk  # noqa: E402
import tf_topk.memory  # noqa: E402
from test_adam_safety import CONFIGS, CORRECTION, dense_then_wrapped, rows_first_seen_after  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floors", default="0,0.1,0.2,0.3,0.5,1.0",
                        help="preconditioner floors to run Adam's momentum correction at (comma-separated)")
    args = parser.parse_args(argv)
    adam = rows_first_seen_after(keras.optimizers.Adam(0.001))
    runs = [(name, CONFIGS[name], None) for name in CONFIGS]
    runs += [(f"momentum correction, floor {floor}", CORRECTION, float(floor)) for floor in args.floors.split(",")]
    default_floor = tf_topk.memory.PRECONDITIONER_FLOOR
    print("| configuration | rows first seen late: move (Adam's) | ratio | wrapped after dense training: move "
          "(Adam's) | ratio |\n|---|---|---|---|---|")
    for name, config, floor in runs:
        tf_topk.memory.PRECONDITIONER_FLOOR = default_floor if floor is None else floor
        rows = rows_first_seen_after(tf_topk.TopKOptimizer(keras.optimizers.Adam(0.001), **config))
        plain, wrapped = dense_then_wrapped(config)
        print(f"| {name} | {rows:.4g} ({adam:.4g}) | {rows / adam:.3g} | {wrapped:.4g} ({plain:.4g}) | "
              f"{wrapped / plain:.3g} |", flush=True)


if __name__ == "__main__":
    main()
