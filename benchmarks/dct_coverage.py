"""What share of a variable's entries decoupled momentum moves in one step, by shape:
`python benchmarks/dct_coverage.py [--density 0.01] [--shapes 97x97,4099,...] [--json]`.

One step of `TopKOptimizer(AdamW(0.01, weight_decay=0), density=D)` (decoupled momentum, no warm-up,
every variable sparsified) on a gradient of independent normal entries, for each shape twice: as a
kernel (2-D blocks of the DCT) and, for a 2-D shape, as an embedding table (named `embeddings`: its
rows apart, a DCT along each row). Prints the share of entries that moved (`benchmarks/RESULTS.md`,
"AdamW on every path").
"""

import argparse
import json
import sys

DEFAULT_SHAPES = "97x97,96x97,128x100,4099,1000x97,50257x4,4x50257,3x3x64x97,64x64,4096"


def shapes(text):
    try:
        parsed = [tuple(int(d) for d in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        parsed = []
    if not parsed or any(d < 1 for shape in parsed for d in shape):
        raise argparse.ArgumentTypeError(f"shapes must be like 97x97,4099 (positive sides), got {text!r}")
    return parsed


def moved_share(shape, density, name):
    """The share of a zero variable's entries that one step moves."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_topk

    variable = keras.Variable(np.zeros(shape, np.float32), name=name)
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.0), density=density,
                                      density_warmup_steps=0, min_size=1)
    gradient = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    optimizer.apply([tf.constant(gradient)], [variable])
    return float(np.mean(variable.numpy() != 0))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--shapes", type=shapes, default=shapes(DEFAULT_SHAPES))
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args(argv)
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    rows = []
    for shape in args.shapes:
        row = {"shape": "x".join(map(str, shape)), "kernel": moved_share(shape, args.density, "kernel")}
        if len(shape) == 2:
            row["embedding_table"] = moved_share(shape, args.density, "embeddings")
        rows.append(row)
        if not args.json:
            table = f", as an embedding table {row['embedding_table']:.3f}" if "embedding_table" in row else ""
            print(f"{row['shape']}: {row['kernel']:.3f} of the entries moved{table}", flush=True)
    if args.json:
        print(json.dumps({"density": args.density, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
