"""Worker: model.fit on digits with Keras 2 (tf_keras through TF_USE_LEGACY_KERAS=1) and TopKOptimizer.

One process (MirroredStrategy with --logical-cpus N, else no strategy) or a
worker of MultiWorkerMirroredStrategy (TF_CONFIG, as the launcher sets it).
Deterministic: fixed seed, shuffle=False. Trains on the first 1440 digits,
tests on the rest.

Options:
  --dense                 the inner SGD alone (dense all-reduce)
  --density D, --momentum M, --momentum-correction, --learning-rate L
  --mixed-precision       mixed_float16 (compile wraps the optimizer in LossScaleOptimizer)
  --epochs E
  --out DIR               worker{i}.json (test accuracy, losses, replicas, iterations,
                          skipped steps, compression statistics) and worker{i}.npz (weights)
  --backup-dir DIR        tf_keras.callbacks.BackupAndRestore(DIR), the same for every worker;
                          each attempt writes attempt{a}_worker{i}.json: pid, epochs begun,
                          the summed residuals' L1 norm right after the restore
  --pause-at E:B          worker 1, attempt 0 only ($TF_TOPK_RESTART): before batch B of
                          epoch E, write DIR/paused (its pid) and sleep, to be killed
  --checkpoint DIR --phase save|resume
                          save: train, then tf.train.Checkpoint (the chief into DIR, the
                          others into temporary folders); resume: restore DIR's latest
                          first. Both write <phase>_worker{i}.npz: this replica's first residual
                          and velocity (after training for save, after restoring for resume)
  --logical-cpus N        N logical CPUs and MirroredStrategy in this one process
"""

import argparse
import json
import os
import time

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow: tf.keras is tf_keras (Keras 2)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tf_topk.cli import DENSITY_WARMUP_HELP, density_warmup_steps  # noqa: E402  (standard library only)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tf_topk  # noqa: E402

TRAIN, BATCH = 1440, 32


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dense", action="store_true")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--density-warmup-steps", type=density_warmup_steps, default="auto", help=DENSITY_WARMUP_HELP)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--momentum-correction", action="store_true")
    parser.add_argument("--learning-rate", type=float, default=0.3)
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backup-dir", default=None)
    parser.add_argument("--pause-at", default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--phase", choices=("save", "resume"), default=None)
    parser.add_argument("--logical-cpus", type=int, default=0)
    return parser.parse_args()


def make_strategy(logical_cpus):
    if "TF_CONFIG" in os.environ:
        return tf.distribute.MultiWorkerMirroredStrategy()
    if logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus)
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(logical_cpus)])
    return tf.distribute.get_strategy()


def replica_state(strategy, topk):
    """This worker's first replica's first residual and velocity (zeros(0) without momentum correction)."""
    def local(variables):
        return strategy.experimental_local_results(variables[0])[0].numpy() if variables else np.zeros(0)

    return {"residual": local(topk.residuals), "velocity": local(topk.velocities),
            "iterations": int(topk.iterations.numpy())}


class Attempt(tf.keras.callbacks.Callback):
    """Writes what this attempt did (after BackupAndRestore restored), and pauses where asked."""

    def __init__(self, out, attempt, worker, pause_at):
        super().__init__()
        self.path = os.path.join(out, f"attempt{attempt}_worker{worker}.json")
        self.pause = pause_at if attempt == 0 and worker == 1 else None
        self.out, self.state = out, {"pid": os.getpid(), "epochs": []}

    def save(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.state, f)
        os.replace(self.path + ".tmp", self.path)

    def on_train_begin(self, logs=None):
        topk = tf_topk.adapter.find_topk_optimizer(self.model.optimizer)
        residuals = topk.residuals if topk is not None else []
        self.state["restored_residual_l1"] = float(sum(np.abs(r.numpy()).sum() for r in residuals))  # a collective
        self.save()

    def on_epoch_begin(self, epoch, logs=None):
        self.state["epochs"].append(epoch)
        self.save()

    def on_train_batch_begin(self, batch, logs=None):
        if self.pause == (self.state["epochs"][-1], batch):
            with open(os.path.join(self.out, "paused.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(self.out, "paused.tmp"), os.path.join(self.out, "paused"))
            time.sleep(600)


def main():
    args = parse_args()
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    worker = config.get("task", {}).get("index", 0)
    attempt = int(os.environ.get(tf_topk.launch.RESTART_ENV, "0"))
    strategy = make_strategy(args.logical_cpus)
    keras = tf.keras
    assert keras.__name__.startswith("tf_keras."), keras.__name__  # Keras 2, not Keras 3
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_float16")

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10, dtype="float32")])
        inner = keras.optimizers.SGD(args.learning_rate, momentum=args.momentum)
        optimizer = inner if args.dense else tf_topk.tf_keras.TopKOptimizer(
            inner, density=args.density, momentum_correction=args.momentum_correction,
            density_warmup_steps=args.density_warmup_steps)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        topk = tf_topk.adapter.find_topk_optimizer(model.optimizer)
        if topk is not None:
            topk.build(model.trainable_variables)

    callbacks = [] if args.dense else [tf_topk.tf_keras.CompressionStats()]
    if args.backup_dir:
        pause = tuple(map(int, args.pause_at.split(":"))) if args.pause_at else None
        callbacks = [keras.callbacks.BackupAndRestore(args.backup_dir),
                     Attempt(args.out, attempt, worker, pause)] + callbacks
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer) if args.checkpoint else None
    if args.phase == "resume":
        checkpoint.restore(tf.train.latest_checkpoint(args.checkpoint)).assert_existing_objects_matched()
        np.savez(os.path.join(args.out, f"resume_worker{worker}.npz"), **replica_state(strategy, topk))

    history = model.fit(x[:TRAIN], y[:TRAIN], batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0,
                        callbacks=callbacks)

    if args.phase == "save":  # every worker saves: reading per-replica state is a collective
        folder = args.checkpoint if worker == 0 else os.path.join(args.out, f"worker{worker}_ckpt")
        checkpoint.save(os.path.join(folder, "ckpt"))
        np.savez(os.path.join(args.out, f"save_worker{worker}.npz"), **replica_state(strategy, topk))
    logits = model(x[TRAIN:], training=False).numpy()
    report = {
        "keras": keras.__name__,
        "replicas": strategy.num_replicas_in_sync,
        "loss": [float(v) for v in history.history["loss"]],
        "test_accuracy": float(np.mean(np.argmax(logits, axis=1) == y[TRAIN:])),
        "iterations": int(model.optimizer.iterations.numpy()),
        "loss_scale_optimizer": type(model.optimizer).__name__,
    }
    if topk is not None:
        report.update(skipped_steps=int(topk.skipped_steps.numpy()), compression=topk.compression_stats(),
                      inner_momentum_slots=sum(v.name.startswith("m/") for v in topk.inner_optimizer.variables))
    with open(os.path.join(args.out, f"worker{worker}.json"), "w") as f:
        json.dump(report, f)
    np.savez(os.path.join(args.out, f"worker{worker}.npz"), *model.get_weights())
    print(f"worker {worker}: {report}", flush=True)


if __name__ == "__main__":
    main()
