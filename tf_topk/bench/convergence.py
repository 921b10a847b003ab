"""Convergence benchmark: `python -m tf_topk.bench convergence --json --plot out.png`.

Does sparsification cost accuracy, and what do error feedback and momentum
correction buy? On scikit-learn's digits (or `--dataset synthetic`, or
`--dataset shapes`: generated images, with a small CNN; `--dataset signals`:
generated 1-D waveforms, with a 1-D CNN), trains the same model
with the same inner optimizer, budget (epochs) and seeds:

    dense       the inner optimizer alone
    topk_ef     tf_topk.TopKOptimizer(inner, density=d, momentum_correction=False,
                decoupled_momentum=False) (error-compensated top-k in front of the
                inner optimizer)
    topk_mc     tf_topk.TopKOptimizer(inner, density=d, momentum_correction=True)
                (SGD with momentum: DGC's momentum correction, without its momentum
                factor masking unless --masking; Adam and
                AdamW: Adam's, its second moment frozen after a dense warm-up over the
                first 10% of the steps, `variance_warmup_steps`)
    topk_noef   tf_topk.TopKOptimizer(inner, density=d, error_feedback=False)
    randk_ef    k entries chosen uniformly at random, same error feedback  (a BENCHMARK BASELINE,
                tf_topk.selector.RandomKSelector in the library exchange)
    demo        tf_topk.TopKOptimizer(inner, density=d, decoupled_momentum=True) (Adam and
                AdamW: DeMo's decoupled momentum, `tf_topk.decoupled_momentum`; the
                library's default for them at a fixed density of 0.01 or less)

at each density, over `--seeds` seeds, and reports the final test accuracy
(mean and std over seeds) per configuration; `--plot` draws the test-accuracy
and training-loss curves (mean over seeds) to a PNG. `--adaptive` adds

    adaptive    tf_topk.TopKOptimizer(inner, density=AdaptiveDensity(replicas=--workers)),
                the density chosen every step
    adaptive_mc the same with momentum_correction=True (when --methods has topk_mc)

and `--bytes-plot` draws test accuracy against the cumulative bytes a worker
would send in a cluster of `--workers` workers (all_gather of the pairs
actually selected, plus the ring all-reduce of the small variables; dense:
the ring all-reduce of everything), with the adaptive rule's density per epoch.

A language model, where adaptive optimizers and attention make the gradients
unlike an MLP's:

    python -m tf_topk.bench convergence --dataset text --model transformer \\
        --optimizer adamw --steps 800 --methods topk_ef,topk_noef --plot text.png

trains a small causal transformer (`tf_topk.bench.text`: `--layers` pre-norm
blocks of width `--width`, 64-byte context) to predict the next byte of the
Python standard library's own source (`--dataset prose`: of the English
docstrings of numpy and scikit-learn, the task that confirms what was chosen
on `text`, never tuned on), for `--steps` optimizer steps with the
held-out loss measured every `--eval-every` steps, and reports the final
validation loss in nats per byte (ln 256 = 5.545 is a uniform guess) where
the other data sets report accuracy: `val_loss_mean`, `val_loss_std`,
`val_loss_per_seed` and `vs_dense_nats` (the method's loss minus dense's).
There an epoch is one evaluation interval, for `--warmup-epochs` too.

One process. With one replica (the default) selection and error feedback
act exactly as they do per replica in multi-worker training, and every
exchange mode is the same algorithm. `--replicas P` trains with
MirroredStrategy over P logical CPUs: each replica takes its shard of the
batch (global batch `--batch-size`) and keeps its own residuals, and the
pairs travel by `--exchange-mode` as they do across machines, so all_gather,
agreed indices and "auto" differ as they would on a cluster. Variables
smaller than the library's `min_size` (biases, the 2,560-entry output layer)
stay dense, as in the library.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from tf_topk.bench import text, time_to_accuracy
from tf_topk.bench.data import VALIDATION_DATASETS, load_data
from tf_topk import cli

# Each generated task's model (`make_model`'s kind) where --model is not given; the validation tasks'
# is their only one.
DATASET_MODELS = {"shapes": "cnn", "signals": "cnn1d", "colors": "cnn_rgb", "sequences": "gru",
                  "ratings": "embedding"}
MODELS_OF = {model: dataset for dataset, model in DATASET_MODELS.items()}
METHODS = ("topk_ef", "topk_mc", "topk_noef", "randk_ef", "demo")
DEFAULT_METHODS = ("topk_ef", "topk_noef", "randk_ef")
LABELS = {"dense": "dense", "topk_ef": "top-k + EF", "topk_mc": "top-k + EF + MC", "topk_noef": "top-k, no EF",
          "randk_ef": "random-k + EF", "demo": "DeMo", "adaptive": "adaptive", "adaptive_mc": "adaptive + MC",
          "autopilot": "autopilot"}
COLORS = {"dense": "black", "topk_ef": "tab:blue", "topk_mc": "tab:purple", "topk_noef": "tab:red",
          "randk_ef": "tab:green", "demo": "tab:olive", "adaptive": "tab:orange", "adaptive_mc": "tab:brown", "autopilot": "tab:cyan"}


# -- the random-k baseline (benchmark only) ------------------------------------------------

def random_k_optimizer(inner, **options):
    """BENCHMARK BASELINE: TopKOptimizer whose exchange selects k entries uniformly at random
    (RandomKSelector), not the top k. Everything else is the library's code and the same options:
    the same error-feedback memory and residuals, the same k per variable, packing and statistics."""
    import tf_topk
    from tf_topk.selector import RandomKSelector

    return tf_topk.TopKOptimizer(inner, selector=RandomKSelector(), **options)


# -- data and model ---------------------------------------------------------------------------

def make_model(keras, inputs, hidden, classes, kind="mlp"):
    """An MLP with `hidden` widths, the small CNN for square images (`kind="cnn"`; `"cnn_rgb"`: the
    same on three channels), the 1-D CNN for sequences (`kind="cnn1d"`: conv 32-64-64, kernels of 5,
    then dense 256), a recurrent classifier of token ids (`kind="gru"`: embedding 16, GRU 96) or an
    embedding model of (user, item) ids (`kind="embedding"`: two tables of 32, dense 64)."""
    if kind == "embedding":
        from tf_topk.bench.data import RATINGS_ITEMS, RATINGS_USERS

        ids = keras.Input((2,))
        user = keras.layers.Embedding(RATINGS_USERS, 32)(ids[:, 0])
        item = keras.layers.Embedding(RATINGS_ITEMS, 32)(ids[:, 1])
        features = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()([user, item, user * item]))
        return keras.Model(ids, keras.layers.Dense(classes)(features))
    layers = [keras.Input((inputs,))]
    if kind == "gru":
        from tf_topk.bench.data import SEQUENCE_TOKENS

        layers += [keras.layers.Embedding(SEQUENCE_TOKENS, 16), keras.layers.GRU(96)]
    elif kind == "cnn_rgb":
        side = int(round((inputs / 3) ** 0.5))
        layers += [keras.layers.Reshape((side, side, 3)),
                   keras.layers.Conv2D(16, 3, activation="relu", padding="same"), keras.layers.MaxPooling2D(),
                   keras.layers.Conv2D(32, 3, activation="relu", padding="same"), keras.layers.MaxPooling2D(),
                   keras.layers.Flatten(), keras.layers.Dense(64, activation="relu")]
    elif kind == "cnn1d":
        layers.append(keras.layers.Reshape((inputs, 1)))
        for filters in (32, 64, 64):
            layers += [keras.layers.Conv1D(filters, 5, activation="relu", padding="same"),
                       keras.layers.MaxPooling1D()]
        layers += [keras.layers.Flatten(), keras.layers.Dense(256, activation="relu")]
    elif kind == "cnn":
        side = int(round(inputs ** 0.5))
        layers += [keras.layers.Reshape((side, side, 1)),
                   keras.layers.Conv2D(16, 3, activation="relu", padding="same"), keras.layers.MaxPooling2D(),
                   keras.layers.Conv2D(32, 3, activation="relu", padding="same"), keras.layers.MaxPooling2D(),
                   keras.layers.Flatten(), keras.layers.Dense(64, activation="relu")]
    else:
        layers += [keras.layers.Dense(h, activation="relu") for h in hidden]
    layers.append(keras.layers.Dense(classes))
    return keras.Sequential(layers)


def model_name(args, inputs):
    if args.model == "transformer":
        return f"transformer {args.layers}x{args.width}, context {inputs}"
    if args.model == "cnn":
        return "CNN conv16-conv32-64-10"
    if args.model == "cnn1d":
        return "1-D CNN conv32-conv64-conv64-256-10"
    if args.model == "cnn_rgb":
        return "CNN on RGB conv16-conv32-64-20"
    if args.model == "gru":
        return "GRU embedding16-gru96-8"
    if args.model == "embedding":
        return "embeddings user32+item32-64-5"
    return f"MLP {inputs}-" + "-".join(map(str, args.hidden)) + "-10"


def make_inner(keras, args, steps=None):
    """The inner optimizer; with `--schedule cosine`, its learning rate decays to 0 over `steps` (the
    run's optimizer steps) by Keras's CosineDecay."""
    rate = args.learning_rate
    if getattr(args, "schedule", "constant") == "cosine":
        if not steps:
            raise ValueError("--schedule cosine needs the run's steps")
        rate = keras.optimizers.schedules.CosineDecay(args.learning_rate, decay_steps=steps)
    clipping = {"global_clipnorm": args.global_clipnorm} if getattr(args, "global_clipnorm", None) else {}
    if args.optimizer == "adam":
        return keras.optimizers.Adam(rate, **clipping)
    if args.optimizer == "adamw":
        return keras.optimizers.AdamW(rate, weight_decay=args.weight_decay, **clipping)
    return keras.optimizers.SGD(rate, momentum=args.momentum, nesterov=args.nesterov, **clipping)


def optimizer_name(args):
    rate = f"CosineDecay({args.learning_rate})" if getattr(args, "schedule", "constant") == "cosine" else \
        f"{args.learning_rate}"
    clipping = f", global_clipnorm={args.global_clipnorm}" if getattr(args, "global_clipnorm", None) else ""
    if args.optimizer == "adam":
        return f"Adam(learning_rate={rate}{clipping})"
    if args.optimizer == "adamw":
        return f"AdamW(learning_rate={rate}, weight_decay={args.weight_decay}{clipping})"
    return f"SGD(learning_rate={rate}, momentum={args.momentum}" + (", nesterov=True" if args.nesterov else "") + \
        f"{clipping})"


def make_optimizer(keras, method, density, args, steps_per_epoch, sparse_entries=None):
    import tf_topk

    cosine = getattr(args, "schedule", "constant") == "cosine"
    inner = make_inner(keras, args, steps_per_epoch * args.epochs if cosine else None)
    if method == "dense":
        return inner
    common = dict(method=args.method, min_size=args.min_size, exchange_mode=args.exchange_mode,
                  local_clipnorm=args.local_clipnorm, selection_scope=args.selection_scope)
    if args.agreement != "nominated" or args.agreed_slots != 1:
        from tf_topk.routes import AgreedIndexRoute, FixedRouter

        common.pop("exchange_mode")
        common["router"] = FixedRouter(AgreedIndexRoute(args.agreement, args.agreed_slots))
    if args.masking and method in ("topk_mc", "adaptive_mc"):
        common["config"] = tf_topk.ExchangeConfig(momentum_masking=True)
    # Momentum correction only where the method names it (TopKOptimizer's default is without).
    common["momentum_correction"] = method in ("topk_mc", "adaptive_mc")
    # Decoupled momentum only where the method names it (the library's "auto" takes it for Adam and AdamW
    # at a fixed density of 0.01 or less: here each method says what it runs).
    common["decoupled_momentum"] = method == "demo"
    if method == "topk_mc" and args.optimizer in ("adam", "adamw"):
        common["variance_warmup_steps"] = variance_warmup_steps(args, steps_per_epoch)
    if method in ("adaptive", "adaptive_mc"):
        return tf_topk.TopKOptimizer(inner, density=tf_topk.schedule.AdaptiveDensity(replicas=args.workers),
                                     **common)
    if method == "autopilot":  # `density` is the stated link: the plan the autopilot makes for that cluster
        from tf_topk.autopilot import Plan

        plan = Plan(time_to_accuracy.cost_model(density, args.workers, args.latency_ms), None, sparse_entries)
        common.pop("exchange_mode", None)
        common.pop("router", None)
        return tf_topk.TopKOptimizer(inner, density=plan.density(replicas=args.workers), router=plan.router(),
                                     **common)
    if args.warmup_epochs:
        density = tf_topk.schedule.dgc_warmup(steps_per_epoch, epochs=args.warmup_epochs, final=density)
    else:  # a fixed density: the library's warm-up of it ("auto", the default), or as asked
        common["density_warmup_steps"] = getattr(args, "density_warmup_steps", "auto")
    if method in ("topk_ef", "topk_mc", "demo"):
        return tf_topk.TopKOptimizer(inner, density=density, **common)
    if method == "topk_noef":
        return tf_topk.TopKOptimizer(inner, density=density, error_feedback=False, **common)
    if method == "randk_ef":
        return random_k_optimizer(inner, density=density, **common)
    raise ValueError(f"unknown method {method!r}")


def variance_warmup_steps(args, steps_per_epoch):
    """Adam's momentum correction warms up dense over the first 10% of the steps."""
    return max(1, steps_per_epoch * args.epochs // 10)


def _bytes_callback(keras, optimizer, model, workers):
    """A callback that adds up, per epoch, the bytes one of `workers` workers
    would send: for a TopKOptimizer, the pairs it selected each step by the
    route the step took (all_gather unless the run has several replicas and
    another exchange mode) plus the ring all-reduce of the small variables
    and the non-finite count; for the inner optimizer alone, the ring
    all-reduce of every gradient. Also keeps the density of each epoch's
    steps."""
    from tf_topk.routes import MODE_CODES, mode_bytes, ring_all_reduce_bytes

    route_of_code = {code: name for name, code in MODE_CODES.items()}

    class Bytes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.total, self.per_epoch, self.densities, self._epoch_densities = 0.0, [], [], []
            self.steps, self.epoch_ends, self.step_seconds = [], [], []  # for --time-links

        def on_train_batch_begin(self, batch, logs=None):
            self._began = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.step_seconds.append(time.perf_counter() - self._began)
            if not hasattr(optimizer, "compression_stats"):
                params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
                self.total += ring_all_reduce_bytes(4.0 * params, workers)
                self.steps.append({"selected": 0.0, "density": 1.0, "mode": None})
                return
            stats = optimizer.compression_stats()
            sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
            small = sum(n for n in sizes if n < optimizer.min_size) + 1  # the dense path and the count
            route = route_of_code.get(round(stats["exchange_mode"]), "allgather")
            sparse = sum(n for n in sizes if n >= optimizer.min_size)
            self.total += mode_bytes(route, stats["selected"], sparse, workers) + \
                ring_all_reduce_bytes(4.0 * small, workers)
            self._epoch_densities.append(stats["density"])
            self.steps.append({"selected": stats["selected"], "density": stats["density"],
                               "mode": round(stats["exchange_mode"])})

        def on_epoch_end(self, epoch, logs=None):
            self.per_epoch.append(self.total)
            self.epoch_ends.append(len(self.steps))
            if self._epoch_densities:
                self.densities.append(statistics.fmean(self._epoch_densities))
            self._epoch_densities = []

    return Bytes()


def replica_strategy(replicas):
    """MirroredStrategy over `replicas` logical CPUs (made by `main` before
    TensorFlow starts), or the default strategy for one replica."""
    import tensorflow as tf

    if replicas == 1:
        return tf.distribute.get_strategy()
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def split_cpu(replicas):
    """Make `replicas` logical CPUs; must run before TensorFlow starts its devices."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)


def replica_training_set(x, y, batch_size, seed):
    """The training split as one repeated, shuffled tf.data pipeline without tf.data's autotuning,
    for several replicas (`fit` then takes `steps_per_epoch`).

    `model.fit` on arrays makes new autotuned iterators every epoch, and under MirroredStrategy each
    destroyed one waits for its replicas' threads, which left 8-replica runs idle most of the time. One
    repeated iterator serves the whole `fit` instead."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed, reshuffle_each_iteration=True) \
        .batch(batch_size).repeat().with_options(options)


def _test_callback(keras, x_test, y_test):
    """Tests the model at each epoch's end on one device, outside the replicas, and logs `val_loss` and
    `val_accuracy` as `fit`'s own validation would. With several replicas `fit`'s validation makes and
    destroys a distributed iterator every epoch (the wait above), and its last batch can leave a replica
    no sample (shapes' 750 test samples end in 14, over 8), which TensorFlow's oneDNN convolution refuses
    ("input depth must be evenly divisible by filter depth: 1 vs 16")."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    class Test(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logits = self.model(x_test, training=False)
            logs["val_loss"] = float(loss(y_test, logits))
            logs["val_accuracy"] = float(np.mean(np.argmax(np.asarray(logits), axis=1) == y_test))

    return Test()


def train_one(method, density, seed, data, args, strategy, optimizer_for=None):
    """Train one configuration and seed; returns per-epoch curves and the optimizer's last stats.
    `optimizer_for(keras, args)`, if given, makes the optimizer instead of `method` (a trial's variant,
    `benchmarks/adamw_candidates.py`); `method` then only says whether it is dense."""
    import keras

    x_train, y_train, x_test, y_test = data
    keras.utils.set_random_seed(seed)
    lm = args.dataset in text.LANGUAGE_DATASETS
    with strategy.scope():
        if lm:
            model = text.make_transformer(keras, args.layers, args.width, context=x_train.shape[1])
        else:
            model = make_model(keras, x_train.shape[1], args.hidden, int(max(y_train.max(), y_test.max())) + 1,
                               args.model)
        steps_per_epoch = args.eval_every if lm else -(-len(x_train) // args.batch_size)
        optimizer = optimizer_for(keras, args) if optimizer_for else make_optimizer(
            keras, method, density, args, steps_per_epoch, sparse_entries=entry_counts(model, args.min_size)[0])
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[] if lm else ["accuracy"], jit_compile=False)  # the selection op has no XLA kernel
    counter = _bytes_callback(keras, optimizer, model, args.workers)
    if lm:
        history = model.fit(text.batches(x_train, y_train, args.batch_size, seed), steps_per_epoch=steps_per_epoch,
                            epochs=args.epochs, validation_data=(x_test, y_test), validation_batch_size=256,
                            shuffle=False, verbose=0, callbacks=[counter])  # the batches come shuffled
    elif args.replicas > 1:
        history = model.fit(replica_training_set(x_train, y_train, args.batch_size, seed), epochs=args.epochs,
                            steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0,
                            callbacks=[counter, _test_callback(keras, x_test, y_test)])
    else:
        history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                            validation_data=(x_test, y_test), shuffle=True, verbose=0, callbacks=[counter])
    stats = optimizer.compression_stats() if method != "dense" else {}
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    return {
        "loss": [float(v) for v in history.history["loss"]],
        "accuracy": [float(v) for v in history.history.get("accuracy", [])],
        "val_loss": [float(v) for v in history.history["val_loss"]],
        "val_accuracy": [float(v) for v in history.history.get("val_accuracy", [])],
        "stats": stats,
        "params": params,
        "bytes": counter.per_epoch,
        "densities": counter.densities,
        "steps": counter.steps, "epoch_ends": counter.epoch_ends, "step_seconds": counter.step_seconds,
        "entries": entry_counts(model, args.min_size),
    }


def entry_counts(model, min_size):
    """(sparsified entries, small entries) of the model's variables at `min_size`."""
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    return sum(n for n in sizes if n >= min_size), sum(n for n in sizes if n < min_size)


# What a configuration is judged by (its row's `KEY_mean`, `KEY_std`, `KEY_per_seed` and curve `KEY`), from
# which Keras history entry: a language model's validation loss in nats per byte, a classifier's test accuracy.
HISTORY_KEYS = {"test_accuracy": "val_accuracy", "val_loss": "val_loss"}
SCORE_NAMES = {"test_accuracy": "test accuracy", "val_loss": "validation loss (nats/byte)"}


def score_key(dataset):
    return "val_loss" if dataset in text.LANGUAGE_DATASETS else "test_accuracy"


def _mean_curve(runs, key):
    return [round(statistics.fmean(values), 5) for values in zip(*(r[key] for r in runs))]


def charge_time(rows, args, key):
    """Per row and stated link: the time curve (mean over seeds of each epoch's end, in seconds, with each
    step charged the dense run's median compute on this machine plus its predicted exchange at
    `args.workers` workers) and the time to reach dense's final score minus `args.target_margin` points;
    then, per link, the autopilot's time against the best fixed density's."""
    if key != "test_accuracy":
        raise ValueError("--time-links is for the accuracy data sets")
    dense = rows[0]
    compute_s = statistics.median(t for r in dense["_runs"] for t in r["step_seconds"][1:])  # the first traces
    target = dense["test_accuracy_mean"] - args.target_margin / 100.0
    summary = {"compute_s_per_step": round(compute_s, 6), "target_accuracy": round(target, 5),
               "workers": args.workers, "latency_ms": args.latency_ms, "links": {}}
    for link in args.time_links:
        model = time_to_accuracy.cost_model(link, args.workers, args.latency_ms)
        per_link = {}
        for row in rows:
            if row["link"] not in (None, link):
                continue  # another link's autopilot
            chooser = "timed" if row["method"] == "autopilot" else \
                ("auto" if args.exchange_mode == "auto" else args.exchange_mode)
            curves = [time_to_accuracy.epoch_times(r["steps"], r["epoch_ends"], model, compute_s, *r["entries"],
                                                   chooser) for r in row["_runs"]]
            times = [statistics.fmean(t[i] for t in curves) for i in range(len(curves[0]))]
            reached = time_to_accuracy.time_to_target(row["curves"]["test_accuracy"], times, target)
            name = row["method"] if row["density"] is None else f"{row['method']}:{row['density']:g}"
            row.setdefault("time_s", {})[link] = [round(t, 4) for t in times]
            per_link[name] = None if reached is None else round(reached, 4)
        fixed = [t for name, t in per_link.items() if ":" in name and name.startswith("topk_ef") and t is not None]
        pilot = per_link.get("autopilot")
        summary["links"][link] = {"time_to_target_s": per_link,
                                  "autopilot_vs_best_fixed": None if pilot is None or not fixed else
                                  round(pilot / min(fixed), 3)}
    return summary


def _std(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


def run(args, log=None):
    data = load_data(args.dataset)
    strategy = replica_strategy(args.replicas)
    configs = [("dense", None)] + [(m, d) for d in args.densities for m in args.methods]
    if args.adaptive:
        configs.append(("adaptive", None))
        if "topk_mc" in args.methods:
            configs.append(("adaptive_mc", None))
    if args.autopilot:
        configs += [("autopilot", link) for link in args.time_links]
    rows, params = [], None
    key = score_key(args.dataset)
    started = time.monotonic()
    for method, density in configs:
        runs = []
        t0 = time.monotonic()
        for seed in range(args.seeds):
            runs.append(train_one(method, density, seed, data, args, strategy))
        params = runs[0]["params"]
        final = [r[HISTORY_KEYS[key]][-1] for r in runs]
        link = density if method == "autopilot" else None
        density = None if method == "autopilot" else density
        row = {
            "method": method,
            "label": LABELS[method] + (f" ({link})" if link else ""),
            "density": density,
            "link": link,
            f"{key}_mean": round(statistics.fmean(final), 5),
            f"{key}_std": round(_std(final), 5),
            f"{key}_per_seed": [round(a, 5) for a in final],
            "train_loss_mean": round(statistics.fmean(r["loss"][-1] for r in runs), 5),
            "curves": {"train_loss": _mean_curve(runs, "loss"), key: _mean_curve(runs, HISTORY_KEYS[key]),
                       "bytes_per_worker": _mean_curve(runs, "bytes")},
            "bytes_per_worker_total": round(statistics.fmean(r["bytes"][-1] for r in runs)),
            "seconds": round(time.monotonic() - t0, 1),
        }
        if method != "dense":
            # Last step's contraction ||acc - sent||^2 / ||acc||^2 (mean over seeds) and 1 - k/d.
            row["contraction"] = round(statistics.fmean(r["stats"].get("contraction", float("nan")) for r in runs), 5)
            row["random_k_bound"] = round(statistics.fmean(r["stats"].get("random_k_bound", float("nan"))
                                                           for r in runs), 5)
            row["sent_density"] = round(statistics.fmean(r["stats"].get("density", float("nan")) for r in runs), 6)
            # The last step's route (0 dense, 1 all_gather, 2 agreed indices; tf_topk.routes.MODE_CODES).
            row["exchange_mode_code"] = statistics.fmean(r["stats"].get("exchange_mode", float("nan")) for r in runs)
        if method in ("adaptive", "adaptive_mc", "autopilot"):
            row["curves"]["density"] = _mean_curve(runs, "densities")
        row["_runs"] = [{name: r[name] for name in ("steps", "epoch_ends", "step_seconds", "entries")} for r in runs]
        rows.append(row)
        if log:
            log(f"{row['label']:<14} density {density if density is not None else '-':<6} {SCORE_NAMES[key]} "
                f"{row[key + '_mean']:.4f} +- {row[key + '_std']:.4f} ({row['seconds']:.0f} s)")
    dense = rows[0]
    for row in rows:
        if key == "val_loss":
            row["vs_dense_nats"] = round(row["val_loss_mean"] - dense["val_loss_mean"], 5)
        else:
            row["vs_dense_points"] = round(100 * (row["test_accuracy_mean"] - dense["test_accuracy_mean"]), 2)
    targets = adaptive_targets(rows) if args.adaptive else None
    timing = charge_time(rows, args, key) if args.time_links else None
    for row in rows:
        del row["_runs"]
    budget = {"steps": args.steps, "eval_every": args.eval_every, "corpus": text.describe_corpus(args.dataset)} \
        if key == "val_loss" else {}
    import keras
    import tensorflow as tf

    return {
        "benchmark": "convergence",
        "dataset": args.dataset,
        "train_samples": int(len(data[0])), "test_samples": int(len(data[2])),
        "model": model_name(args, data[0].shape[1]), "params": params,
        "optimizer": optimizer_name(args),
        "selection_method": args.method, "min_size": args.min_size, "warmup_epochs": args.warmup_epochs,
        "density_warmup_steps": getattr(args, "density_warmup_steps", "auto"),
        "local_clipnorm": args.local_clipnorm, "selection_scope": args.selection_scope,
        "momentum_masking": args.masking,
        "epochs": args.epochs, "batch_size": args.batch_size, "seeds": args.seeds,
        **budget,
        "replicas": args.replicas, "exchange_mode": args.exchange_mode, "agreement": args.agreement,
        "agreed_slots": args.agreed_slots,
        "densities": args.densities, "methods": ["dense", *args.methods],
        "configs": rows,
        "workers_for_bytes": args.workers,
        "adaptive_targets": targets,
        "time_to_accuracy": timing,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"nproc": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "tf_version": tf.__version__, "keras_version": keras.__version__},
        "command": "python -m tf_topk.bench convergence " + " ".join(args.argv),
        "duration_s": round(time.monotonic() - started, 1),
    }


def adaptive_targets(rows, within_points=0.5):
    """The adaptive rule's target: within `within_points` of dense accuracy,
    with no more bytes than the best fixed density that also gets there."""
    dense = rows[0]
    adaptive = next(r for r in rows if r["method"] == "adaptive")
    reaching = [r for r in rows if r["density"] is not None and r["vs_dense_points"] >= -within_points]
    best = min(reaching, key=lambda r: r["bytes_per_worker_total"]) if reaching else None
    accurate = adaptive["vs_dense_points"] >= -within_points
    return {
        "adaptive_vs_dense_points": adaptive["vs_dense_points"],
        "adaptive_bytes": adaptive["bytes_per_worker_total"],
        "best_fixed_reaching": None if best is None else {"method": best["method"], "density": best["density"],
                                                         "bytes": best["bytes_per_worker_total"],
                                                         "vs_dense_points": best["vs_dense_points"]},
        "dense_bytes": dense["bytes_per_worker_total"],
        "met": bool(accurate and (best is None or adaptive["bytes_per_worker_total"] <= best["bytes_per_worker_total"])),
        "density_per_epoch": adaptive["curves"].get("density"),
    }


def plot_bytes(result, path):
    """Test accuracy (text: validation loss) against cumulative bytes per
    worker (left), and the adaptive rule's density per epoch (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["configs"]
    key = score_key(result["dataset"])
    fig, (ax, side) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [2, 1]})
    styles = {0.1: ":", 0.01: "-.", 0.001: "--"}
    link_styles = {}  # the autopilot's plans, one line style per stated link
    for row in rows:
        label = row["label"] if row["density"] is None else f"{row['label']} d={row['density']:g}"
        style = styles.get(row["density"], "-") if row.get("link") is None else \
            link_styles.setdefault(row["link"], ("-", "--", ":", "-.")[len(link_styles) % 4])
        ax.plot(row["curves"]["bytes_per_worker"], row["curves"][key], color=COLORS[row["method"]],
                linestyle=style, marker="o" if row["method"] in ("adaptive", "adaptive_mc", "autopilot") else None,
                markersize=3, label=f"{label} ({row[key + '_mean']:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel(f"cumulative bytes sent per worker ({result['workers_for_bytes']} workers)")
    ax.set_ylabel(SCORE_NAMES[key])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right" if key == "val_loss" else "lower right")
    chosen = [r for r in rows if r["curves"].get("density")]  # adaptive and the autopilot: the density they chose
    if not chosen:
        side.set_visible(False)
    for adaptive in chosen:
        epochs = np.arange(1, len(adaptive["curves"]["density"]) + 1)
        side.plot(epochs, adaptive["curves"]["density"], color=COLORS[adaptive["method"]], marker="o", markersize=3,
                  linestyle=link_styles.get(adaptive.get("link"), "-"), label=adaptive["label"])
        side.set_yscale("log")
        side.legend(fontsize=7)
        side.set_xlabel("epoch")
        side.set_ylabel("density chosen (mean over the epoch's steps)")
        side.grid(alpha=0.3)
    fig.suptitle(f"{result['dataset']}: {result['model']}, {result['optimizer']}, mean of {result['seeds']} seeds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_time(result, path):
    """Test accuracy against the charged time of --time-links, one panel per link (the
    autopilot planned for that link), with the target (dense's final accuracy minus the margin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timing = result["time_to_accuracy"]
    links = list(timing["links"])
    fig, axes = plt.subplots(1, len(links), figsize=(5.2 * len(links), 4.4), squeeze=False, sharey="row")
    styles = {0.1: ":", 0.01: "-.", 0.001: "--"}
    for ax, link in zip(axes[0], links):
        for row in (r for r in result["configs"] if link in r.get("time_s", {})):
            label = row["label"] if row["density"] is None else f"{row['label']} d={row['density']:g}"
            reached = timing["links"][link]["time_to_target_s"].get(
                row["method"] if row["density"] is None else f"{row['method']}:{row['density']:g}")
            ax.plot(row["time_s"][link], row["curves"]["test_accuracy"], color=COLORS[row["method"]],
                    linestyle=styles.get(row["density"], "-"), marker="o" if row["method"] == "autopilot" else None,
                    markersize=3, label=f"{label} ({'not reached' if reached is None else f'{reached:,.1f} s'})")
        ax.axhline(timing["target_accuracy"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel(f"time charged at {link}, {timing['workers']} workers (s)")
        ax.set_title(f"{link}: time to {timing['target_accuracy']:.4f}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("test accuracy")
    fig.suptitle(f"{result['dataset']}: {result['model']}, {result['optimizer']}, mean of {result['seeds']} seeds; "
                 f"each step charged {timing['compute_s_per_step'] * 1e3:.2f} ms of compute plus its predicted "
                 f"exchange", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(result):
    densities = result["densities"]
    rows = result["configs"]
    dense = rows[0]
    key = score_key(result["dataset"])
    budget = f"{result['steps']} steps" if "steps" in result else f"{result['epochs']} epochs"
    head = f"{'method':<16}" + "".join(f"{'d=' + format(d, 'g'):>18}" for d in densities)
    lines = [f"convergence: {result['dataset']}, {result['model']} ({result['params']:,} parameters), "
             f"{result['optimizer']}, {budget}, batch {result['batch_size']}, "
             f"{result['seeds']} seeds; final {SCORE_NAMES[key]}, mean +- std",
             head, "-" * len(head),
             f"{'dense':<16}" + f"{dense[key + '_mean']:.4f} +- {dense[key + '_std']:.4f}".rjust(18)
             * len(densities)]
    for method in result["methods"][1:]:
        cells = []
        for d in densities:
            row = next(r for r in rows if r["method"] == method and r["density"] == d)
            cells.append(f"{row[key + '_mean']:.4f} +- {row[key + '_std']:.4f}".rjust(18))
        lines.append(f"{LABELS[method]:<16}" + "".join(cells))
    for adaptive in (r for r in rows if r["method"] == "adaptive"):
        lines.append(f"{'adaptive':<16}{adaptive['test_accuracy_mean']:.4f} +- {adaptive['test_accuracy_std']:.4f}"
                     f"  ({adaptive['bytes_per_worker_total']:,} bytes per worker; target met: "
                     f"{result['adaptive_targets']['met']})")
    return "\n".join(lines)


def plot(result, path):
    """Test accuracy (text: validation loss) on top and training loss below, per epoch (text: per
    evaluation, against steps), one column per density."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    densities = result["densities"]
    rows = result["configs"]
    dense = rows[0]
    fig, axes = plt.subplots(2, len(densities), figsize=(max(4.2 * len(densities), 6.3), 7), squeeze=False, sharey="row")
    score = score_key(result["dataset"])
    epochs = np.arange(1, result["epochs"] + 1) * result.get("eval_every", 1)
    for column, d in enumerate(densities):
        for row_index, key in enumerate((score, "train_loss")):
            ax = axes[row_index][column]
            for row in [dense] + [r for r in rows if r["density"] == d]:
                ax.plot(epochs, row["curves"][key], color=COLORS[row["method"]],
                        linestyle="--" if row["method"] == "dense" else "-",
                        label=f"{row['label']} ({row[score + '_mean']:.3f})" if key == score
                        else row["label"])
            ax.grid(alpha=0.3)
            if key == "train_loss":
                ax.set_yscale("log")
                ax.set_xlabel("step" if "eval_every" in result else "epoch")
            else:
                ax.set_title(f"density {d:g}")
                ax.legend(fontsize=8, loc="upper right" if score == "val_loss" else "lower right")
            if column == 0:
                ax.set_ylabel(SCORE_NAMES[score] if key == score else "training loss")
    warmup = f", density warm-up {result['warmup_epochs']} epochs" if result.get("warmup_epochs") else ""
    fig.suptitle(f"{result['dataset']}: {result['model']}, {result['optimizer']}{warmup},\n"
                 f"mean of {result['seeds']} seeds (final {SCORE_NAMES[score]} in the legend)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluation_interval(steps, points=16):
    """The divisor of `steps` whose number of evaluations (steps / divisor) is nearest `points`."""
    return min((d for d in range(1, steps + 1) if steps % d == 0), key=lambda d: abs(steps // d - points))


def _links(text):
    from tf_topk.bench.netns import parse_rate

    values = [v.strip() for v in text.split(",") if v.strip()]
    try:
        if not values or any(parse_rate(v) is None for v in values):
            raise ValueError(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"links must be comma-separated rates such as 100mbit,1gbit, got {text!r}")
    return values


def parse_args(argv=None):
    """The command line's arguments, checked and completed with their defaults (a bad one exits with
    argparse's usage error, before anything trains)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m tf_topk.bench convergence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("digits", "synthetic", "shapes", "signals", *VALIDATION_DATASETS,
                                              *text.LANGUAGE_DATASETS),
                        default="digits",
                        help="shapes: 16x16 images, signals: 1-D waveforms (both generated); colors, sequences, "
                             "ratings: the task suite's validation half (generated; tf_topk.bench.data); text: next-byte "
                             "prediction on the Python standard library's source; prose: on the English docstrings "
                             "of numpy and scikit-learn; reference: on pydoc's topics of the Python Language Reference, "
                             "a small corpus read for several passes (prose and reference to confirm on, not to tune "
                             "on)")
    parser.add_argument("--model", choices=(*MODELS_OF, "mlp", "transformer"), default=None,
                        help="default: cnn for shapes, cnn1d for signals, cnn_rgb for colors, gru for sequences, "
                             "embedding for ratings (the only model for those three), transformer for text, "
                             "prose and reference (the only model for them), mlp otherwise")
    parser.add_argument("--densities", type=cli.densities, default=[0.1, 0.01, 0.001])
    parser.add_argument("--methods", type=cli.names_among("methods", METHODS), default=list(DEFAULT_METHODS),
                        help=f"comma-separated, among {','.join(METHODS)} (dense always runs)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=None, help="default 30 (not with --dataset text, prose or reference)")
    parser.add_argument("--steps", type=int, default=None,
                        help="--dataset text, prose or reference: optimizer steps in all (default 800)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="--dataset text, prose or reference: steps between validation losses, a divisor of --steps "
                             "(default: the one nearest 16 evaluations)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=lambda t: [int(v) for v in t.split(",")], default=[256, 256],
                        help="hidden layer widths (default 256,256)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--width", type=int, default=128,
                        help="transformer width, a multiple of its 4 heads (default 128)")
    parser.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=None,
                        help="the inner optimizer (default: adamw for text, sgd otherwise)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="default: 0.05 for sgd, 0.001 for adam and adamw")
    parser.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                        help="the learning rate: constant (default), or cosine decay to 0 over the run's steps")
    parser.add_argument("--weight-decay", type=float, default=None, help="AdamW's weight decay (default 0.01)")
    parser.add_argument("--global-clipnorm", type=float, default=None,
                        help="the inner optimizer's global_clipnorm (the transformer recipe's 1.0; default none)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--nesterov", action="store_true", help="SGD with Nesterov momentum")
    parser.add_argument("--warmup-epochs", type=int, default=0,
                        help="DGC density warm-up over this many epochs for the sparse methods "
                             "(tf_topk.schedule.dgc_warmup; --dataset text, prose or reference: evaluation intervals); "
                             "0: the density from the first step")
    parser.add_argument("--density-warmup-steps", type=cli.density_warmup_steps, default="auto",
                        help="without --warmup-epochs, " + cli.DENSITY_WARMUP_HELP)
    parser.add_argument("--method", choices=("gaussian", "exact"), default="gaussian",
                        help="tf_topk selection method")
    parser.add_argument("--local-clipnorm", type=float, default=None,
                        help="the sparse methods' local_clipnorm (DGC's local gradient clipping; default off)")
    parser.add_argument("--selection-scope", choices=("variable", "bucket"), default="variable",
                        help="the sparse methods' selection_scope: k per variable (default), or one selection "
                             "over the bucket (needs --exchange-mode allgather)")
    parser.add_argument("--masking", action="store_true",
                        help="topk_mc with DGC's momentum factor masking (ExchangeConfig.momentum_masking=True; "
                             "default off)")
    parser.add_argument("--min-size", type=int, default=None,
                        help="variables with fewer entries stay dense (default: the library's, 4096)")
    parser.add_argument("--adaptive", action="store_true",
                        help="also train with the adaptive density (tf_topk.schedule.AdaptiveDensity)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="train with MirroredStrategy over this many logical CPUs, each its shard of the "
                             "batch and its own residuals (default 1)")
    parser.add_argument("--exchange-mode", choices=("allgather", "allreduce", "auto"), default="auto",
                        help="how the sparse methods' pairs travel between replicas (with --replicas > 1)")
    parser.add_argument("--agreement", choices=("nominated", "leader"), default="nominated",
                        help="with --exchange-mode allreduce: how replicas agree on the indices "
                             "(tf_topk.routes.AgreedIndexRoute; 'leader' is ScaleCom's rule)")
    parser.add_argument("--agreed-slots", type=int, default=1,
                        help="with --exchange-mode allreduce: agreed indices per variable as a multiple of k "
                             "(tf_topk.routes.AgreedIndexRoute's slots; default 1)")
    parser.add_argument("--time-links", type=_links, default=None,
                        help="comma-separated link rates (100mbit,1gbit,10gbit): charge every step the dense "
                             "run's compute plus its predicted exchange at --workers workers on each, and report "
                             "the time to reach dense's final accuracy minus --target-margin points")
    parser.add_argument("--latency-ms", type=float, default=0.5, help="per-collective latency of those links (ms)")
    parser.add_argument("--target-margin", type=float, default=0.5,
                        help="points below dense's final accuracy that count as reached (default 0.5)")
    parser.add_argument("--autopilot", action="store_true",
                        help="with --time-links: also train with the autopilot's plan for each link "
                             "(tf_topk.autopilot.Plan over the stated cluster)")
    parser.add_argument("--workers", type=int, default=4,
                        help="the cluster size bytes are counted for, and the adaptive rule's cost model assumes")
    parser.add_argument("--plot", metavar="PNG", help="draw the curves to this file (needs matplotlib)")
    parser.add_argument("--bytes-plot", metavar="PNG",
                        help="draw test accuracy (text: validation loss) against bytes sent per worker "
                             "(needs matplotlib)")
    parser.add_argument("--time-plot", metavar="PNG",
                        help="with --time-links: draw test accuracy against the charged time, a panel per link "
                             "(needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.min_size is None:
        from tf_topk.config import DEFAULT_MIN_SIZE

        args.min_size = DEFAULT_MIN_SIZE
    if args.dataset in text.LANGUAGE_DATASETS:
        if args.epochs is not None:
            parser.error(f"--dataset {args.dataset} trains for --steps, not --epochs")
        if args.adaptive:
            parser.error(f"--adaptive is judged against dense accuracy: not with --dataset {args.dataset}")
        args.steps = 800 if args.steps is None else args.steps
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        if args.eval_every is None:
            args.eval_every = evaluation_interval(args.steps)
        if args.eval_every < 1 or args.steps % args.eval_every:
            parser.error(f"--eval-every must be >= 1 and divide --steps ({args.steps}), got {args.eval_every}")
        args.epochs = args.steps // args.eval_every
    elif args.steps is not None or args.eval_every is not None:
        parser.error("--steps and --eval-every are for --dataset text and prose; the others train for --epochs")
    elif args.epochs is None:
        args.epochs = 30
    if args.seeds < 1 or args.epochs < 1 or args.batch_size < 1:
        parser.error("--seeds, --epochs and --batch-size must be >= 1")
    if args.workers < 2:
        parser.error(f"--workers must be >= 2 (bytes are what a worker sends to the others), got {args.workers}")
    if args.selection_scope == "bucket" and args.exchange_mode != "allgather":
        parser.error(f"--selection-scope bucket needs --exchange-mode allgather, got {args.exchange_mode}")
    if args.agreement != "nominated" and args.exchange_mode != "allreduce":
        parser.error(f"--agreement {args.agreement} needs --exchange-mode allreduce, got {args.exchange_mode}")
    if args.agreed_slots != 1 and args.exchange_mode != "allreduce":
        parser.error(f"--agreed-slots {args.agreed_slots} needs --exchange-mode allreduce, got {args.exchange_mode}")
    if args.autopilot and not args.time_links:
        parser.error("--autopilot plans for a stated link: give --time-links")
    if args.time_plot and not args.time_links:
        parser.error("--time-plot draws the charged time: give --time-links")
    if args.latency_ms < 0:
        parser.error(f"--latency-ms must be >= 0, got {args.latency_ms}")
    if args.agreed_slots < 1:
        parser.error(f"--agreed-slots must be >= 1, got {args.agreed_slots}")
    if args.replicas < 1 or args.batch_size % args.replicas:
        parser.error(f"--replicas must be >= 1 and divide --batch-size ({args.batch_size}), got {args.replicas}")
    if args.warmup_epochs < 0:
        parser.error(f"--warmup-epochs must be >= 0, got {args.warmup_epochs}")
    if args.warmup_epochs and args.density_warmup_steps != "auto":
        parser.error("--density-warmup-steps warms up a fixed density; --warmup-epochs gives a schedule instead: "
                     "pass one of them")
    if args.model is None:
        args.model = "transformer" if args.dataset in text.LANGUAGE_DATASETS else \
            DATASET_MODELS.get(args.dataset, "mlp")
    if args.dataset in VALIDATION_DATASETS and args.model != DATASET_MODELS[args.dataset]:
        parser.error(f"--dataset {args.dataset} has one model, {DATASET_MODELS[args.dataset]}, got --model {args.model}")
    if args.model in ("cnn_rgb", "gru", "embedding") and DATASET_MODELS.get(args.dataset) != args.model:
        parser.error(f"--model {args.model} is --dataset {MODELS_OF[args.model]}'s, got --dataset {args.dataset}")
    if (args.model == "transformer") != (args.dataset in text.LANGUAGE_DATASETS):
        parser.error(f"--model transformer goes with --dataset text, prose or reference and only with them, "
                     f"got --model {args.model} --dataset {args.dataset}")
    if args.layers < 1 or args.width < 4 or args.width % 4:
        parser.error(f"--layers must be >= 1 and --width a multiple of 4, got {args.layers} and {args.width}")
    if args.optimizer is None:
        args.optimizer = "adamw" if args.dataset in text.LANGUAGE_DATASETS else "sgd"
    if args.learning_rate is None:
        args.learning_rate = 0.001 if args.optimizer in ("adam", "adamw") else 0.05
    if args.weight_decay is not None and args.optimizer != "adamw":
        parser.error(f"--weight-decay is AdamW's, got --optimizer {args.optimizer}")
    args.weight_decay = 0.01 if args.weight_decay is None else args.weight_decay
    if args.global_clipnorm is not None and not args.global_clipnorm > 0:
        parser.error(f"--global-clipnorm must be > 0, got {args.global_clipnorm}")
    if "demo" in args.methods and args.optimizer == "sgd":
        parser.error("demo (decoupled momentum) is for --optimizer adam or adamw, got --optimizer sgd")
    if "topk_mc" in args.methods and args.optimizer == "sgd" and args.momentum <= 0:
        parser.error("topk_mc (momentum correction) needs --momentum > 0 with --optimizer sgd")
    return args


def main(argv=None):
    args = parse_args(argv)

    def log(message):
        print(f"[convergence] {message}", file=sys.stderr, flush=True)

    if args.replicas > 1:
        split_cpu(args.replicas)

    result = run(args, log=log)
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    if args.bytes_plot:
        plot_bytes(result, args.bytes_plot)
        result["bytes_plot"] = args.bytes_plot
    if args.time_plot:
        plot_time(result, args.time_plot)
        result["time_plot"] = args.time_plot
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
