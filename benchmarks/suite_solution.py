"""What solution a configuration ends at on a task of the suite, against dense's:
`python benchmarks/suite_solution.py --task colors --density 0.001 --configs default --seeds 16 --out F
[--min-size N] [--epochs N] [--table-only]`.

Where a configuration fits the training set as dense does and still tests worse (the suite's colors at
0.001), the gap is in which solution training found, not in how fast. Each run trains as the suite does
(`tf_topk.bench.suite.TASKS`' model and recipe, `suite.CONFIGS`' options, the same seed for every
configuration: paired), then measures, on the weights it ended with:

  train loss, test loss, test accuracy   over the whole sets
  confidence                             the mean largest softmax probability on the test set
  sharpness at rho (0.05, 0.1)           the training loss's mean increase when every variable moves
                                         by rho times its norm in a random direction (4 directions)
  per variable: norm, moved              its norm, and its distance from its initial value

`--min-size N` gives the configurations' TopKOptimizer `min_size=N` (variables under N entries go the
dense path: which layer's selection a gap comes from). Prints, per configuration, the paired
difference to dense with its 95% t-interval. Every run is appended to `--out` as it ends, and runs
already there are not run again.
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np

RHOS = (0.05, 0.1)
DIRECTIONS = 4
SUMMARY_KEYS = ("test_accuracy", "test_loss", "train_loss", "confidence", "sharpness_0.05", "sharpness_0.1")


def config_name(config, min_size):
    return config if min_size is None or config == "dense" else f"{config} min_size={min_size}"


def sharpness(model, evaluate, rho, rng, directions=DIRECTIONS):
    """The training loss's mean increase over `directions` random moves of every variable by `rho`
    times its norm (the weights restored after)."""
    weights = [v.numpy() for v in model.trainable_variables]
    base = evaluate()
    increases = []
    try:
        for _ in range(directions):
            for variable, value in zip(model.trainable_variables, weights):
                noise = rng.standard_normal(value.shape).astype(value.dtype)
                variable.assign(value + rho * np.linalg.norm(value) * noise / max(np.linalg.norm(noise), 1e-12))
            increases.append(evaluate() - base)
    finally:
        for variable, value in zip(model.trainable_variables, weights):
            variable.assign(value)
    return float(np.mean(increases))


def train_and_look(task, config, density, seed, min_size=None, epochs=None):
    """One run of the suite's `task` with `config` at `density` (dense: the inner optimizer alone),
    and what its solution is."""
    import keras
    import tensorflow as tf

    import tf_topk
    from tf_topk.bench import convergence, suite

    args = suite.task_args(task, epochs)
    x_train, y_train, x_test, y_test = convergence.load_data(args.dataset)
    steps_per_epoch = -(-len(x_train) // args.batch_size)
    steps = steps_per_epoch * args.epochs
    started = time.monotonic()
    keras.utils.set_random_seed(seed)
    model = convergence.make_model(keras, x_train.shape[1], args.hidden, int(max(y_train.max(), y_test.max())) + 1,
                                   args.model)
    inner = convergence.make_inner(keras, args, steps)
    if config == "dense":
        optimizer = inner
    else:
        options = suite.CONFIGS[config].options(density, steps, steps_per_epoch)
        optimizer = tf_topk.TopKOptimizer(inner, **options, **({} if min_size is None else {"min_size": min_size}))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"], jit_compile=False)
    initial = [v.numpy() for v in model.trainable_variables]
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=0)

    def evaluate(x, y):
        return model.evaluate(x, y, batch_size=512, verbose=0, return_dict=True)

    train, test = evaluate(x_train, y_train), evaluate(x_test, y_test)
    probabilities = tf.nn.softmax(model.predict(x_test, batch_size=512, verbose=0)).numpy()
    rng = np.random.default_rng(1000 + seed)
    record = {"task": task, "config": config_name(config, min_size), "density": None if config == "dense" else density,
              "seed": seed, "epochs": args.epochs, "test_accuracy": test["accuracy"], "test_loss": test["loss"],
              "train_loss": train["loss"], "train_accuracy": train["accuracy"],
              "confidence": float(probabilities.max(axis=1).mean())}
    for rho in RHOS:
        record[f"sharpness_{rho:g}"] = sharpness(model, lambda: evaluate(x_train, y_train)["loss"], rho, rng)
    record["variables"] = [{"variable": v.path, "entries": int(np.prod(v.shape)),
                            "norm": float(np.linalg.norm(v.numpy())),
                            "moved": float(np.linalg.norm(v.numpy() - start))}
                           for v, start in zip(model.trainable_variables, initial)]
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def paired(records, config, key, variable=None):
    """Per seed (paired with dense's run), `config`'s value of `key` minus dense's."""
    def value(record):
        return record["variables"][variable][key] if variable is not None else record[key]

    dense = {r["seed"]: r for r in records if r["config"] == "dense"}
    return [value(r) - value(dense[r["seed"]]) for r in records if r["config"] == config and r["seed"] in dense]


def format_table(records):
    """Per configuration: each measure's dense mean and the paired difference (95% t-interval)."""
    from tf_topk.bench.suite import paired_interval

    lines = []
    dense = [r for r in records if r["config"] == "dense"]
    for config in dict.fromkeys(r["config"] for r in records if r["config"] != "dense"):
        differences = paired(records, config, "test_accuracy")
        if not differences:
            continue
        lines += [f"{config} against dense, {len(differences)} seeds paired",
                  "| measure | dense | difference (95% interval) |", "|---|---|---|"]
        rows = [(key, key, None) for key in SUMMARY_KEYS]
        rows += [(f"variable {i} ({v['entries']:,} entries) {key}", key, i)
                 for i, v in enumerate(dense[0]["variables"]) for key in ("norm", "moved")]
        for label, key, variable in rows:
            mean, low, high = paired_interval(paired(records, config, key, variable))
            base = statistics.fmean(r["variables"][variable][key] if variable is not None else r[key] for r in dense)
            lines.append(f"| {label} | {base:.4g} | {mean:+.4g} ({low:+.4g} to {high:+.4g}) |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    from tf_topk.bench import suite

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=tuple(suite.TASKS), required=True)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--configs", default="default", help="comma-separated suite configurations (dense runs too)")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--min-size", type=int, default=None, help="the configurations' min_size (default: theirs)")
    parser.add_argument("--epochs", type=int, default=None, help="override the task's epochs (a quick look)")
    parser.add_argument("--out", required=True, help="JSON lines, appended to and resumed from")
    parser.add_argument("--table-only", action="store_true", help="print the table of --out, train nothing")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in suite.CONFIGS]
    if unknown or not configs:
        parser.error(f"--configs must name configurations of {sorted(suite.CONFIGS)}, got {args.configs!r}")
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    for name in ("seeds", "epochs", "min_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.table_only:
        done = {(r["config"], r["density"], r["seed"]) for r in suite.read_records(args.out)}
        for seed in range(args.seeds):
            for config in ["dense", *configs]:
                density = None if config == "dense" else args.density
                if (config_name(config, args.min_size), density, seed) in done:
                    continue
                record = train_and_look(args.task, config, args.density, seed, args.min_size, args.epochs)
                with open(args.out, "a") as lines:
                    lines.write(json.dumps(record) + "\n")
                print(f"{args.task} seed {seed} {record['config']}: test accuracy {record['test_accuracy']:.4f}, "
                      f"train loss {record['train_loss']:.4f} ({record['seconds']:.0f} s)", file=sys.stderr)
    records = [r for r in suite.read_records(args.out) if r["task"] == args.task and
               r["density"] in (None, args.density)]
    print(format_table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
