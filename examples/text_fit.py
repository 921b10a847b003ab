"""AdamW on a byte-level transformer with TopKOptimizer, in one process or on several workers.

The text task of the convergence benchmark (`tf_topk.bench.text`: next-byte
prediction on the Python standard library's own source) in a custom training
loop, with `TopKOptimizer(AdamW, density=...)` as it is by default at a fixed
density of 0.01 or less: decoupled momentum (DeMo, `tf_topk.decoupled_momentum`),
each replica's momentum in the space of a blockwise DCT, its top-k coefficients
sent, the sign of their sum applied. `--momentum-correction` takes Adam's
momentum correction instead: dense AdamW for `--warmup` steps, then the second
moment frozen and each replica's momentum of the preconditioned gradient sent.

One process (one replica, the whole batch):
    python examples/text_fit.py --steps 600 --density 0.01
One process split into two logical CPUs (MirroredStrategy, two replicas, each
half of every global batch: the same algorithm as two workers):
    python examples/text_fit.py --steps 600 --density 0.01 --logical-cpus 2
Two local workers (MultiWorkerMirroredStrategy through TF_CONFIG), each half
of every global batch:
    python -m tf_topk.launch --workers 2 examples/text_fit.py --steps 600 --density 0.01

Prints one line `RESULT {...}` per process: the validation loss (nats per
byte), the steps taken and the sha256 of the final weights, so that workers
can be checked to hold bitwise the same model.
"""

import argparse
import hashlib
import json
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--momentum-correction", action="store_true",
                        help="Adam's momentum correction instead of the default (decoupled momentum)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="with --momentum-correction: dense AdamW steps before the second moment freezes "
                             "(default: 10%% of --steps)")
    parser.add_argument("--density", type=float, default=0.01, help="fraction of each large variable sent per step")
    parser.add_argument("--dense", action="store_true", help="plain AdamW with the dense all-reduce")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (split over the workers)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logical-cpus", type=int, default=0,
                        help="split this process's CPU into N replicas (MirroredStrategy); 0: one replica")
    args = parser.parse_args(argv)
    if args.logical_cpus and "TF_CONFIG" in os.environ:
        parser.error("--logical-cpus is for single-process runs; under the launcher each worker has one replica")
    if args.logical_cpus < 0:
        parser.error(f"--logical-cpus must be >= 0, got {args.logical_cpus}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.warmup is not None and not args.momentum_correction:
        parser.error("--warmup is the dense warm-up of --momentum-correction")
    args.warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
    if args.warmup < 1:
        parser.error(f"--warmup must be >= 1, got {args.warmup}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_topk
    from tf_topk.bench import text

    if "TF_CONFIG" in os.environ:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    elif args.logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.logical_cpus)
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.logical_cpus)])
    else:
        strategy = tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    worker = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    if args.batch_size % replicas:
        raise SystemExit(f"--batch-size ({args.batch_size}) must divide among {replicas} replicas")
    local = args.batch_size // replicas
    x, y, x_val, y_val = text.load_text()
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = text.make_transformer(keras, args.layers, args.width, context=x.shape[1])
        inner = keras.optimizers.AdamW(1e-3, weight_decay=0.01)
        if args.dense:
            optimizer = inner
        elif args.momentum_correction:
            optimizer = tf_topk.TopKOptimizer(inner, density=args.density, momentum_correction=True,
                                              variance_warmup_steps=args.warmup)
        else:  # the default: decoupled momentum at a fixed density of 0.01 or less
            optimizer = tf_topk.TopKOptimizer(inner, density=args.density)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(xb, yb):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                per_window = tf.reduce_mean(loss_fn(yb, model(xb, training=True)), axis=1)
                loss = tf.nn.compute_average_loss(per_window, global_batch_size=args.batch_size)
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)

    def shards(array, rows):
        """Each replica's part of the global batch `rows` (replica i: the i-th `local` rows)."""
        return strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(array[rows[context.replica_id_in_sync_group * local:][:local]]))

    order = np.random.default_rng(args.seed).permutation(len(x))
    started = time.monotonic()
    for step in range(args.steps):
        rows = order[(step * args.batch_size) % len(x):][:args.batch_size]
        loss = train_step(shards(x, rows), shards(y, rows))
        if (step + 1) % max(1, args.steps // 10) == 0:
            print(f"step {step + 1}/{args.steps} training loss {float(loss):.4f}", file=sys.stderr, flush=True)
    val_loss = float(tf.reduce_mean(loss_fn(y_val, model.predict(x_val, batch_size=256, verbose=0))))
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()
    print("RESULT " + json.dumps({"worker": worker, "replicas": replicas, "steps": int(optimizer.iterations.numpy()),
                                  "density": None if args.dense else args.density,
                                  "method": "dense" if args.dense else "momentum_correction"
                                  if args.momentum_correction else
                                  "decoupled_momentum" if optimizer.decoupled_momentum else "topk",
                                  "val_loss": round(val_loss, 4), "weights_sha256": digest,
                                  "seconds": round(time.monotonic() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
