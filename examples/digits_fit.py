"""Keras `model.fit` with TopKOptimizer: the one-line change, on scikit-learn's digits.

Single process:
    python examples/digits_fit.py --density 0.01 --epochs 5
Two logical CPUs in one process (MirroredStrategy, 2 replicas):
    python examples/digits_fit.py --logical-cpus 2
Two local workers (MultiWorkerMirroredStrategy through TF_CONFIG):
    python -m tf_topk.launch --workers 2 examples/digits_fit.py --density 0.01 --epochs 5
The dense baseline (the inner optimizer alone, dense all-reduce):
    python -m tf_topk.launch --workers 2 examples/digits_fit.py --dense
Resume after a failure: back up every epoch, restart all workers when one dies:
    python -m tf_topk.launch --workers 2 --restarts 3 examples/digits_fit.py --backup-dir /tmp/digits_backup
Momentum SGD at density 0.001 with momentum correction (DGC) and its warm-up:
    python -m tf_topk.launch --workers 2 examples/digits_fit.py --momentum 0.9 --momentum-correction \
        --density 0.001 --warmup-epochs 4

Prints per-epoch progress, the test accuracy, the bytes each worker sends per
step and the median step time. `--out DIR` writes worker<i>.json (results) and
worker<i>.npz (final weights) for comparisons.
"""

import argparse
import json
import os
import statistics
import sys

from tf_topk.cli import DENSITY_WARMUP_HELP, density_warmup_steps
from tf_topk.config import EXCHANGE_MODES


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.01, help="fraction of entries sent per step")
    parser.add_argument("--density-warmup-steps", type=density_warmup_steps, default="auto",
                        help=DENSITY_WARMUP_HELP)
    parser.add_argument("--adaptive", action="store_true",
                        help="choose the density every step (tf_topk.schedule.AdaptiveDensity); --density is ignored")
    parser.add_argument("--autopilot", action="store_true",
                        help="density=\"autopilot\": measure the cluster, then route and choose the density by "
                             "predicted time (tf_topk.autopilot); --density is ignored")
    parser.add_argument("--method", choices=("gaussian", "exact"), default="gaussian")
    parser.add_argument("--exchange-mode", default="auto", choices=EXCHANGE_MODES,
                        help="how the pairs travel (allgather_int8: values in 8 bits, a pair in 4 bytes)")
    parser.add_argument("--dense", action="store_true", help="train with the plain optimizer (dense all-reduce)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="SGD momentum (0 by default: without --momentum-correction, momentum delays "
                             "sparsified updates further, see README)")
    parser.add_argument("--momentum-correction", action="store_true",
                        help="DGC's momentum correction: the exchange applies --momentum per replica")
    parser.add_argument("--sparse-updates", action="store_true",
                        help="update only the entries sent (plain SGD, or --momentum-correction)")
    parser.add_argument("--warmup-epochs", type=int, default=0,
                        help="DGC density warm-up over this many epochs, down to --density")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: 0.3 for sgd, 0.002 for adam")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--dataset", choices=("digits", "mnist", "cifar10"), default="digits")
    parser.add_argument("--logical-cpus", type=int, default=0,
                        help="split the CPU into this many logical devices and use MirroredStrategy")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="mixed_float16 policy (Keras wraps the optimizer in LossScaleOptimizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for worker<i>.json and worker<i>.npz")
    parser.add_argument("--backup-dir", default=None,
                        help="back up each epoch there with tf_topk.keras.BackupAndRestore (the same folder "
                             "for every worker); a restarted run resumes from it")
    parser.add_argument("--verbose", type=int, default=2, help="Keras verbosity on the chief (0, 1, 2)")
    args = parser.parse_args(argv)
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    if args.momentum_correction and (args.optimizer != "sgd" or args.momentum <= 0):
        parser.error("--momentum-correction needs --optimizer sgd and --momentum > 0")
    if args.warmup_epochs < 0:
        parser.error(f"--warmup-epochs must be >= 0, got {args.warmup_epochs}")
    if args.logical_cpus and "TF_CONFIG" in os.environ:
        parser.error("--logical-cpus is for single-process runs; under the launcher each worker has one replica")
    return args


def make_strategy(args):
    """MultiWorkerMirroredStrategy under TF_CONFIG, or in a Slurm job step of several tasks (Slurm
    describes the cluster: `SlurmClusterResolver`), MirroredStrategy over --logical-cpus, else the default.

    Made once per process (TensorFlow's collectives are configured at start-up); `train` can then run
    several times under it.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import tf_topk

    if args.logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.logical_cpus)
    if "TF_CONFIG" in os.environ:
        tf_topk.keras.apply_mwms_fix()  # keras#20585, also for the dense baseline
        return tf.distribute.MultiWorkerMirroredStrategy()
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_NODELIST" in os.environ:  # srun of N tasks
        tf_topk.keras.apply_mwms_fix()
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=12345)
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    if args.logical_cpus:
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.logical_cpus)])
    return tf.distribute.get_strategy()


def main(argv=None):
    args = parse_args(argv)
    train(args, make_strategy(args))
    return 0


def train(args, strategy):
    """Train, test and report as the module's docstring says; returns the result written to --out."""
    import keras
    import numpy as np

    import tf_topk
    from tf_topk.bench.data import load_data

    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    worker = int(task.get("index", 0))
    chief = worker == 0
    replicas = strategy.num_replicas_in_sync

    keras.mixed_precision.set_global_policy("mixed_float16" if args.mixed_precision else "float32")
    x_train, y_train, x_test, y_test = load_data(args.dataset, args.seed)
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((x_train.shape[1],)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(int(y_train.max()) + 1, dtype="float32"),  # float32 logits
        ])
        if args.optimizer == "sgd":
            inner = keras.optimizers.SGD(args.learning_rate or 0.3, momentum=args.momentum)
        else:
            inner = keras.optimizers.Adam(args.learning_rate or 0.002)
        density = "adaptive" if args.adaptive else "autopilot" if args.autopilot else args.density
        if args.warmup_epochs and not (args.adaptive or args.autopilot):
            steps_per_epoch = -(-len(x_train) // args.batch_size)
            density = tf_topk.schedule.dgc_warmup(steps_per_epoch, epochs=args.warmup_epochs, final=args.density)
        fixed = {} if density is not args.density else {"density_warmup_steps": args.density_warmup_steps}
        optimizer = inner if args.dense else tf_topk.TopKOptimizer(
            inner, density=density, method=args.method, momentum_correction=args.momentum_correction,
            sparse_updates=args.sparse_updates, exchange_mode=args.exchange_mode, **fixed)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"],
                      jit_compile=False)  # the selection op has no XLA kernel (Keras's default on a GPU)
    timer = tf_topk.keras.StepTimer()
    epoch_stats = []  # the exchange's statistics at each epoch's end (its last step), for the report
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: epoch_stats.append(optimizer.compression_stats()))
    callbacks = [timer] if args.dense else [timer, tf_topk.keras.CompressionStats(), record]
    backup = tf_topk.keras.BackupAndRestore(args.backup_dir) if args.backup_dir else None
    if backup is not None:
        callbacks.insert(0, backup)  # restores before the other callbacks start
    if chief:
        mode = "dense all-reduce" if args.dense else (
            f"TopK density {density if isinstance(density, str) else args.density} ({args.method}"
            + (", momentum correction)" if args.momentum_correction else ")"))
        print(f"{args.dataset}: {len(x_train)} train / {len(x_test)} test, {model.count_params()} parameters, "
              f"{replicas} replica(s), {mode}", flush=True)
    history = model.fit(x_train, y_train, epochs=args.epochs, batch_size=args.batch_size,
                        verbose=args.verbose if chief else 0, callbacks=callbacks)
    if chief and backup is not None and backup.restored_epoch is not None:
        print(f"resumed from the backup in {args.backup_dir} at epoch {backup.restored_epoch + 1}", flush=True)
    test_loss, test_accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)

    params = model.count_params()
    dense_bytes = tf_topk.routes.ring_all_reduce_bytes(4.0 * params, replicas)
    stats = {} if args.dense else optimizer.compression_stats()  # TopKOptimizer, also inside LSO
    bytes_per_step = dense_bytes if args.dense else stats["bytes_sent"]
    step_time = statistics.median(timer.times[len(timer.times) // 5:]) if timer.times else float("nan")
    result = {
        "worker": worker, "replicas": replicas, "dense": args.dense,
        "density": None if args.dense else density if isinstance(density, str) else args.density,
        "params": int(params),
        "autopilot": None if args.dense or optimizer.exchange.autopilot_plan is None else
        optimizer.exchange.autopilot_plan.describe(),
        "autopilot_decision": None if args.dense or optimizer.exchange.autopilot_plan is None else
        optimizer.exchange.autopilot_plan.decision(),
        # Per epoch (its last step): the entries this worker sent, and k (the slots every worker fills;
        # with agreed indices a worker may hold 0 at an index another worker nominated).
        "densities": [end["density"] for end in epoch_stats],
        "k_fractions": [1.0 - end["random_k_bound"] for end in epoch_stats],
        "test_accuracy": float(test_accuracy), "test_loss": float(test_loss),
        "loss": [float(v) for v in history.history["loss"]],
        "bytes_per_step": float(bytes_per_step), "dense_bytes_per_step": float(dense_bytes),
        "median_step_seconds": step_time, "steps": int(optimizer.iterations.numpy()),
        "skipped_steps": 0 if args.dense else int(optimizer.skipped_steps.numpy()),
        "compression": stats,
    }
    if chief:
        fewer = dense_bytes / bytes_per_step if bytes_per_step and not args.dense else None
        ratio = "" if fewer is None else f" ({fewer:.0f}x fewer than dense)" if fewer >= 1.05 else \
            f" ({1 / fewer:.1f}x more than dense)" if fewer <= 1 / 1.05 else " (about as many as dense)"
        print(f"test accuracy: {test_accuracy:.4f}", flush=True)
        print(f"bytes sent per worker per step: {bytes_per_step:,.0f}{ratio}; dense all-reduce: {dense_bytes:,.0f}",
              flush=True)
        print(f"median step time: {step_time * 1000:.1f} ms", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"worker{worker}.json"), "w") as f:
            json.dump(result, f, indent=1)
        np.savez(os.path.join(args.out, f"worker{worker}.npz"), *[w for w in model.get_weights()])
    return result


if __name__ == "__main__":
    sys.exit(main())
