"""Where the default loses on a task of the suite, per layer:
`python benchmarks/suite_diagnosis.py --task ratings [--density 0.001] [--config default] [--seed 0]
[--epochs N] [--json]`.

Trains the suite's task (`tf_topk.bench.suite.TASKS`: its model, inner optimizer and recipe) with
`TopKOptimizer(inner, density=d)` and the suite's configuration `--config` (`suite.CONFIGS`; the
default: every other option at the library's default), in a loop of its own
that looks at each sparsified variable between steps. Printed per variable, over the steps after the
density warm-up:

  entries, k        k = ceil(d * entries)
  mass sent         the share of |gradient + residual| (L1) that the step's selection sent (mean over
                    sampled steps): how much of what is waiting leaves each step
  sent once         the share of entries sent at least once
  touched           the share of entries whose gradient was ever non-zero (an embedding's rows that
                    the data reached)
  age p50 / p90     steps since an entry was last sent (or since the warm-up ended), over touched
                    entries, at the end: how old the residual's oldest parts are
  residual / grad   the residual's norm against the gradient's (mean over sampled steps)
  lr left           where the age's median falls in the learning-rate schedule: the share of the
                    schedule's rate still to come when the median entry was last sent

Then the run's test accuracy. One seed; a diagnosis, not a decision.
"""

import argparse
import json
import math

import numpy as np


def diagnose(task, density, seed=0, every=25, config="default", log=print, epochs=None):
    import keras
    import tensorflow as tf

    import tf_topk
    from tf_topk.bench import convergence, suite

    args = suite.task_args(task, epochs)
    x_train, y_train, x_test, y_test = convergence.load_data(args.dataset)
    steps_per_epoch = -(-len(x_train) // args.batch_size)
    steps = steps_per_epoch * args.epochs
    classes = int(max(y_train.max(), y_test.max())) + 1
    keras.utils.set_random_seed(seed)
    model = convergence.make_model(keras, x_train.shape[1], args.hidden, classes, args.model)
    optimizer = tf_topk.TopKOptimizer(convergence.make_inner(keras, args, steps),
                                      **suite.CONFIGS[config].options(density, steps, steps_per_epoch))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    optimizer.build(variables)
    exchange = optimizer._exchange_object
    slots = {position: exchange._slot[position] for position in exchange.sparse_positions}
    residuals = {p: exchange.memory.residuals[slot] for p, slot in slots.items()}
    warmup = exchange.config.density_warmup_taken
    age = {p: tf.Variable(tf.zeros(variables[p].shape, tf.int32)) for p in slots}
    sends = {p: tf.Variable(tf.zeros(variables[p].shape, tf.int32)) for p in slots}
    touched = {p: tf.Variable(tf.zeros(variables[p].shape, tf.bool)) for p in slots}
    counting = tf.Variable(False)

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        waiting = {p: grads[p] + tf.cast(residuals[p], grads[p].dtype) for p in slots}
        out = {}
        optimizer.apply(grads, variables)
        for p in slots:
            sent = tf.logical_and(tf.equal(residuals[p], 0.0), tf.not_equal(waiting[p], 0.0))
            if counting:
                sends[p].assign_add(tf.cast(sent, tf.int32))
                age[p].assign(tf.where(sent, 0, age[p] + 1))
                touched[p].assign(tf.logical_or(touched[p], tf.not_equal(grads[p], 0.0)))
            total = tf.reduce_sum(tf.abs(waiting[p]))
            out[p] = (tf.math.divide_no_nan(tf.reduce_sum(tf.abs(tf.where(sent, waiting[p], 0.0))), total),
                      tf.math.divide_no_nan(tf.norm(residuals[p]), tf.norm(grads[p])))
        return out

    samples = {p: [] for p in slots}
    rng = np.random.default_rng(seed)
    step = 0
    for _ in range(args.epochs):
        order = rng.permutation(len(x_train))
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            counting.assign(step >= warmup)
            out = step_fn(x_train[batch], y_train[batch])
            if step >= warmup and step % every == 0:
                for p in slots:
                    samples[p].append([float(v) for v in out[p]])
            step += 1
    predictions = np.argmax(model.predict(x_test, batch_size=512, verbose=0), axis=1)
    accuracy = float(np.mean(predictions == y_test))
    rate = convergence.make_inner(keras, args, steps).learning_rate
    schedule = rate if callable(rate) else (lambda s: rate)
    rates = np.array([float(schedule(s)) for s in range(0, steps, max(1, steps // 200))])
    rows = []
    for p in slots:
        entries = int(np.prod(variables[p].shape))
        reached = touched[p].numpy().ravel()
        ages = age[p].numpy().ravel()[reached] if reached.any() else np.zeros(1)
        median = float(np.percentile(ages, 50))
        last_sent = max(0.0, (steps - median) / steps)
        rows.append({
            "variable": variables[p].path.split("/", 1)[-1], "entries": entries, "k": max(1, math.ceil(density * entries)),
            "mass_sent": float(np.mean([s[0] for s in samples[p]])),
            "sent_once": float(np.mean(sends[p].numpy() > 0)), "touched": float(np.mean(reached)),
            "age_p50": median, "age_p90": float(np.percentile(ages, 90)),
            "residual_over_grad": float(np.mean([s[1] for s in samples[p]])),
            "lr_left": float(rates[int(last_sent * (len(rates) - 1)):].sum() / rates.sum()),
        })
    log(f"{task}, {config}, density {density}, seed {seed}: {step} steps ({steps_per_epoch} an epoch), warm-up {warmup}: "
        f"test accuracy {accuracy:.4f}")
    return {"task": task, "config": config, "density": density, "seed": seed, "steps": step, "warmup": warmup,
            "test_accuracy": accuracy, "variables": rows}


def main(argv=None):
    from tf_topk.bench import suite

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=tuple(suite.TASKS), required=True)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--config", choices=tuple(suite.CONFIGS), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=25, help="steps between samples of mass sent (default 25)")
    parser.add_argument("--epochs", type=int, default=None, help="override the task's epochs (a quick look)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.every < 1:
        parser.error(f"--every must be >= 1, got {args.every}")
    result = diagnose(args.task, args.density, args.seed, args.every, args.config,
                      log=(lambda m: None) if args.json else print, epochs=args.epochs)
    if args.json:
        print(json.dumps(result))
        return 0
    print("| variable | entries | k | mass sent | sent once | touched | age p50 | age p90 | residual / grad | lr left |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in result["variables"]:
        print(f"| `{r['variable']}` | {r['entries']} | {r['k']} | {r['mass_sent']:.3f} | {r['sent_once']:.2f} | "
              f"{r['touched']:.2f} | {r['age_p50']:.0f} | {r['age_p90']:.0f} | {r['residual_over_grad']:.1f} | "
              f"{r['lr_left']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
