"""A tf.distribute custom training loop with top-k sparsified, error-compensated gradients.

`tf_topk.SparseExchange` replaces the dense gradient all-reduce inside
`strategy.run`; any Keras optimizer then applies the summed gradients.

    python examples/custom_loop.py                         # one process, the local devices
    python examples/custom_loop.py --logical-cpus 2        # two replicas in one process
    python -m tf_topk.launch --workers 2 examples/custom_loop.py --epochs 3   # two workers (MWMS)

Data: scikit-learn's digits (offline) by default; `--dataset mnist|cifar10`
downloads through keras.datasets. The model is a small MLP on flattened inputs.
"""

import argparse
import hashlib
import json
import os
import sys
import time

from tf_topk.bench.data import load_data
from tf_topk.cli import DENSITY_WARMUP_HELP, density, density_warmup_steps, positive_int

DATASETS = ("digits", "mnist", "cifar10")
DEFAULT_LEARNING_RATES = {"sgd": 0.05, "adam": 1e-3}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Custom training loop (strategy.run) with tf_topk.SparseExchange and a Keras optimizer.")
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits (scikit-learn, offline; default), mnist or cifar10 (downloaded by keras.datasets)")
    parser.add_argument("--optimizer", choices=sorted(DEFAULT_LEARNING_RATES), default="sgd",
                        help="Keras optimizer applying the exchanged gradients (default: sgd, momentum 0.9)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="default: 0.05 for sgd, 0.001 for adam")
    parser.add_argument("--density", type=density, default=0.01,
                        help="fraction of each large variable's gradient entries sent per step (default 0.01)")
    parser.add_argument("--density-warmup-steps", type=density_warmup_steps, default="auto", help=DENSITY_WARMUP_HELP)
    parser.add_argument("--method", choices=("gaussian", "exact"), default="gaussian",
                        help="selection method of tf_topk.approx_topk (default gaussian)")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="at most this many steps per epoch (default: the whole training set)")
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="global batch size, split evenly over the replicas (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logical-cpus", type=positive_int, default=None, metavar="N",
                        help="split the CPU into N logical devices and mirror over them (N replicas in one process)")
    parser.add_argument("--check-replicas", action="store_true",
                        help="print a checksum of the weights on every local replica (they must be identical)")
    parser.add_argument("--nan-at-step", type=int, default=None, metavar="S",
                        help="make replica 0's gradient NaN at global step S, to show that the step is skipped")
    parser.add_argument("--summary-json", default=None, metavar="PATH",
                        help="also write the numbers printed as JSON; '{worker}' in PATH is replaced by the "
                             "worker index (without it, only the chief writes)")
    args = parser.parse_args(argv)
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATES[args.optimizer]
    elif args.learning_rate <= 0:
        parser.error(f"--learning-rate must be positive, got {args.learning_rate}")
    if args.logical_cpus is not None and os.environ.get("TF_CONFIG"):
        parser.error("--logical-cpus is for single-process runs; TF_CONFIG is set (multi-worker run), "
                     "where each worker contributes one replica")
    replicas_hint = args.logical_cpus or 1
    if args.batch_size % replicas_hint:
        parser.error(f"--batch-size {args.batch_size} must be divisible by the {replicas_hint} replicas")
    return args


def make_strategy(args):
    """(strategy, description, worker index, is chief): MWMS under TF_CONFIG, else
    MirroredStrategy over several local devices, else the default strategy.

    Must run before any other TensorFlow work: both the logical device split
    and MWMS configure the runtime, which is fixed once it starts.
    """
    import tensorflow as tf

    if os.environ.get("TF_CONFIG"):
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        resolver = strategy.cluster_resolver
        is_chief = resolver.task_type == "chief" or (
            resolver.task_type == "worker" and resolver.task_id == 0
            and "chief" not in resolver.cluster_spec().as_dict())
        workers = len(resolver.cluster_spec().as_dict().get("worker", []))
        return strategy, f"MultiWorkerMirroredStrategy over {workers} workers", resolver.task_id, is_chief
    if args.logical_cpus and args.logical_cpus > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.logical_cpus)
        devices = [f"/cpu:{i}" for i in range(args.logical_cpus)]
        return tf.distribute.MirroredStrategy(devices), f"MirroredStrategy over {', '.join(devices)}", 0, True
    if len(tf.config.list_physical_devices("GPU")) > 1:
        return tf.distribute.MirroredStrategy(), "MirroredStrategy over the local GPUs", 0, True
    return tf.distribute.get_strategy(), "no strategy (the default one)", 0, True


def make_model(features, classes):
    import keras

    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(classes),
    ])


def make_optimizer(name, learning_rate):
    import keras

    if name == "sgd":
        return keras.optimizers.SGD(learning_rate, momentum=0.9)
    return keras.optimizers.Adam(learning_rate)


def skip_keras_all_reduce(optimizer):
    """The exchange already sums over replicas: Keras must not all-reduce again."""
    import tf_topk.keras

    return tf_topk.keras.disable_dense_all_reduce(optimizer)


def replica_checksums(strategy, variables):
    """sha256 of the weights held by each local replica, in replica order."""
    per_replica = [strategy.experimental_local_results(getattr(v, "value", v)) for v in variables]
    sums = []
    for copies in zip(*per_replica):
        digest = hashlib.sha256()
        for copy in copies:
            digest.update(copy.numpy().tobytes())
        sums.append(digest.hexdigest()[:16])
    return sums


def chief_printer(is_chief):
    """A print that only the chief executes: every worker runs this script, and the log needs each line once."""
    def say(*parts):
        if is_chief:
            print(*parts, flush=True)

    return say


def build_training(strategy, args, features, classes):
    """(model, optimizer, exchange), all created in the strategy's scope so that
    their variables (the optimizer's slots and the exchange's residuals too)
    exist on every replica."""
    import tf_topk

    with strategy.scope():
        model = make_model(features, classes)
        optimizer = skip_keras_all_reduce(make_optimizer(args.optimizer, args.learning_rate))
        optimizer.build(model.trainable_variables)  # its slots are created here, in the scope
        exchange = tf_topk.SparseExchange(model.trainable_variables, density=args.density, method=args.method,
                                          density_warmup_steps=args.density_warmup_steps)
    return model, optimizer, exchange


def print_setup(say, args, description, replicas, train_examples, test_examples, exchange):
    """The two header lines: what runs where, and what the exchange sends, before the first (slow, traced) step."""
    say(f"{description}: {replicas} replica(s); {args.dataset}: {train_examples} train / "
        f"{test_examples} test examples; {args.optimizer} lr {args.learning_rate:g}")
    say(f"exchange: {len(exchange.sparse_positions)} variable(s) sparsified at density {args.density:g} "
        f"({args.method}), {len(exchange.dense_positions)} small one(s) all-reduced densely, "
        f"{exchange.num_buckets} all_gather(s) per step")


def distribute_dataset(strategy, args, x_train, y_train):
    """(distributed dataset, steps per epoch).

    Each worker builds the same shuffled global batches and takes its shard;
    drop_remainder keeps every replica's batch the same size.
    """
    import tensorflow as tf

    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True)
               .batch(args.batch_size, drop_remainder=True))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dist_dataset = strategy.experimental_distribute_dataset(dataset.with_options(options))
    steps_per_epoch = len(x_train) // args.batch_size
    if args.steps:
        steps_per_epoch = min(steps_per_epoch, args.steps)
    return dist_dataset, steps_per_epoch


def make_train_step(strategy, model, optimizer, exchange, variables, global_batch_size):
    """The tf.function of one training step on every replica, where the exchange
    replaces the dense all-reduce: (summed loss, summed correct, applied,
    bytes sent, dense bytes). A step with a non-finite gradient is not applied."""
    import keras
    import tensorflow as tf

    def replica_step(x, y, poison):
        """Forward, backward and exchange on one replica; returns what the update needs."""
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            # Scaled by the GLOBAL batch: the exchange sums over replicas.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
            replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
            scale = tf.where(tf.logical_and(poison, tf.equal(replica_id, 0)), float("nan"), 1.0)
            grad_loss = loss * scale  # --nan-at-step: a broken gradient on one replica only
        grads = tape.gradient(grad_loss, variables)
        result = exchange(grads, step=optimizer.iterations)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.float32))
        return loss, correct, result.grads, result.all_finite, result.stats

    @tf.function
    def train_step(batch, poison):
        x, y = batch
        loss, correct, grads, all_finite, stats = strategy.run(replica_step, args=(x, y, poison))

        def first(value):  # a value every replica computed alike
            return strategy.experimental_local_results(value)[0]

        def apply():
            strategy.run(lambda g: optimizer.apply(g, variables), args=(grads,))
            return tf.constant(True)

        # all_finite is the same on every replica. The branch is taken here, in
        # cross-replica context: a tf.cond inside strategy.run whose branch
        # calls optimizer.apply (a merge_call) is not supported.
        applied = tf.cond(first(all_finite), apply, lambda: tf.constant(False))
        return (strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
                strategy.reduce(tf.distribute.ReduceOp.SUM, correct, axis=None),
                applied, first(stats["bytes_sent"]), first(stats["bytes_dense"]))

    return train_step


def train(args, dist_dataset, steps_per_epoch, train_step, summary, say):
    """Runs the epochs, one printed line each, recording them and the skipped
    steps in `summary`; returns the last step's (bytes sent, dense bytes), as
    the byte counts are the same every step."""
    import tensorflow as tf

    global_step = 0
    for epoch in range(args.epochs):
        start = time.time()
        total_loss = total_correct = 0.0
        steps = 0
        iterator = iter(dist_dataset)
        for _ in range(steps_per_epoch):
            poison = tf.constant(global_step == args.nan_at_step)
            loss, correct, applied, bytes_sent, bytes_dense = train_step(next(iterator), poison)
            if not bool(applied):
                summary["skipped_steps"].append(global_step)
                say(f"step {global_step}: non-finite gradient on some replica: update skipped on every "
                    f"replica, residuals kept")
            total_loss += float(loss)
            total_correct += float(correct)
            steps += 1
            global_step += 1
        record = {"loss": total_loss / steps, "accuracy": total_correct / (steps * args.batch_size),
                  "seconds": time.time() - start}
        summary["epochs"].append(record)
        say(f"epoch {epoch + 1}/{args.epochs}: loss {record['loss']:.4f}, accuracy {record['accuracy']:.4f} "
            f"({steps} steps, {record['seconds']:.1f}s)")
    return bytes_sent, bytes_dense


def evaluate(model, x_test, y_test):
    """Test accuracy, predicted in one graph call over the whole test set (the same on every worker)."""
    import numpy as np
    import tensorflow as tf

    @tf.function
    def predict(x):
        return tf.argmax(model(x, training=False), -1, output_type=tf.int32)

    return float(np.mean(predict(tf.constant(x_test)).numpy() == y_test))


def weights_finite(variables):
    """Whether every weight is finite: a skipped NaN step must leave none behind."""
    import numpy as np

    return all(bool(np.all(np.isfinite(v.numpy()))) for v in variables)


def report(say, summary):
    """The chief's closing lines: test accuracy, bytes per step against the dense all-reduce, skipped steps."""
    say(f"test accuracy: {summary['test_accuracy']:.4f}")
    if summary["replicas"] > 1:
        say(f"bytes sent per step and replica: {summary['bytes_sent']:,.0f} (dense all-reduce: "
            f"{summary['bytes_dense']:,.0f}, {100.0 * summary['bytes_sent'] / summary['bytes_dense']:.1f}%)")
    else:
        say("one replica: nothing is exchanged (selection and error feedback still run)")
    if summary["skipped_steps"]:
        say(f"skipped steps (non-finite gradients): {summary['skipped_steps']}")


def check_replicas(strategy, variables, worker, is_chief, summary):
    """--check-replicas: every worker prints a checksum of each of its replicas'
    weights (and records them in `summary`), to show that they stay identical."""
    checksums = replica_checksums(strategy, variables)
    summary["checksums"] = checksums
    first_id = worker * len(checksums)
    for i, checksum in enumerate(checksums):  # every worker prints its own replicas
        print(f"replica {first_id + i} weights sha256 {checksum}", flush=True)
    if is_chief and len(set(checksums)) == 1 and len(checksums) > 1:
        print(f"all {len(checksums)} local replicas hold identical weights", flush=True)


def write_summary(path, summary, worker, is_chief):
    """--summary-json: the printed numbers as JSON, from the chief, or from every
    worker when '{worker}' in the path gives each its own file."""
    if is_chief or "{worker}" in path:
        with open(path.replace("{worker}", str(worker)), "w") as f:
            json.dump(summary, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    x_train, y_train, x_test, y_test = load_data(args.dataset, args.seed)

    strategy, description, worker, is_chief = make_strategy(args)
    # Loaded here, after make_strategy has configured the runtime, and in this
    # order (tf_topk registers its op once TensorFlow is loaded); the functions
    # above import them again where they use them.
    import keras
    import numpy as np  # noqa: F401
    import tensorflow as tf  # noqa: F401

    import tf_topk  # noqa: F401

    say = chief_printer(is_chief)
    replicas = strategy.num_replicas_in_sync
    if args.batch_size % replicas:
        sys.exit(f"error: --batch-size {args.batch_size} must be divisible by the {replicas} replicas")
    keras.utils.set_random_seed(args.seed)  # same initial weights on every worker

    model, optimizer, exchange = build_training(strategy, args, x_train.shape[1], int(y_train.max()) + 1)
    variables = model.trainable_variables
    print_setup(say, args, description, replicas, len(x_train), len(x_test), exchange)
    dist_dataset, steps_per_epoch = distribute_dataset(strategy, args, x_train, y_train)
    exchange.say_if_run_ends_in_warmup(args.epochs * steps_per_epoch)  # as fit says it
    train_step = make_train_step(strategy, model, optimizer, exchange, variables, args.batch_size)

    summary = {"strategy": description, "replicas": replicas, "worker": worker,
               "epochs": [], "skipped_steps": []}
    bytes_sent, bytes_dense = train(args, dist_dataset, steps_per_epoch, train_step, summary, say)
    summary.update(test_accuracy=evaluate(model, x_test, y_test), bytes_sent=float(bytes_sent),
                   bytes_dense=float(bytes_dense), weights_finite=weights_finite(variables))
    report(say, summary)
    if args.check_replicas:
        check_replicas(strategy, variables, worker, is_chief, summary)
    if args.summary_json:
        write_summary(args.summary_json, summary, worker, is_chief)
    return 0


if __name__ == "__main__":
    sys.exit(main())
