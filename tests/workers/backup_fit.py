"""Worker: model.fit with tf_topk.keras.BackupAndRestore, one process or MWMS (TF_CONFIG).

Deterministic: digits, shuffle=False, fixed seed. Options:
  --backup-dir DIR    the BackupAndRestore directory (the same for every worker)
  --backup-dir-worker1 DIR  another one for worker 1 (a directory it does not share)
  --out DIR           attempt{a}_worker{i}.json, rewritten at train begin, each
                      epoch begin and train end: pid, restored_epoch/batch, epochs
                      begun, iterations at the end; worker{i}.json (losses,
                      iterations),
                      worker{i}.npz (final weights) and worker{i}_state.npz
                      (this worker's residuals, then velocities) when fit returns
  --dense             the plain SGD instead of TopKOptimizer
  --no-error-feedback TopKOptimizer(error_feedback=False): no residuals
  --momentum-correction  TopKOptimizer(SGD(0.05, momentum=0.9), momentum_correction=True)
  --save-freq F       "epoch" or a number of batches
  --keep              delete_checkpoint=False
  --pause-at E:B      worker 1, attempt 0 only ($TF_TOPK_RESTART): before batch B
                      of epoch E, write <out>/paused (its pid) and sleep, to be killed
  --fail-at E:B       raise before batch B of epoch E on attempt 0 (one process)
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tf_topk  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--backup-dir", required=True)
parser.add_argument("--backup-dir-worker1", default=None)
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--dense", action="store_true")
parser.add_argument("--no-error-feedback", action="store_true")
parser.add_argument("--momentum-correction", action="store_true")
parser.add_argument("--save-freq", default="epoch")
parser.add_argument("--keep", action="store_true")
parser.add_argument("--pause-at", default=None)
parser.add_argument("--fail-at", default=None)
args = parser.parse_args()

config = json.loads(os.environ.get("TF_CONFIG", "{}"))
worker = config.get("task", {}).get("index", 0)
attempt = int(os.environ.get("TF_TOPK_RESTART", "0"))
if config:
    tf_topk.keras.apply_mwms_fix()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    strategy = tf.distribute.get_strategy()


def at(option):
    return tuple(map(int, option.split(":"))) if option else None


class Record(keras.callbacks.Callback):
    """Writes what this attempt did, and pauses or fails where asked."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup
        self.state = {"pid": os.getpid(), "epochs": []}
        self.epoch = None

    def write(self):
        path = os.path.join(args.out, f"attempt{attempt}_worker{worker}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.state, f)
        os.replace(path + ".tmp", path)

    def on_train_begin(self, logs=None):
        self.state.update(restored_epoch=self.backup.restored_epoch, restored_batch=self.backup.restored_batch)
        self.write()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.state["epochs"].append(epoch)
        self.write()

    def on_train_batch_begin(self, batch, logs=None):
        if attempt == 0 and worker == 1 and at(args.pause_at) == (self.epoch, batch):
            with open(os.path.join(args.out, "paused.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(args.out, "paused.tmp"), os.path.join(args.out, "paused"))
            time.sleep(600)
        if attempt == 0 and at(args.fail_at) == (self.epoch, batch):
            raise RuntimeError(f"failing on purpose before batch {batch} of epoch {self.epoch}")

    def on_train_end(self, logs=None):
        self.state["iterations"] = int(self.model.optimizer.iterations.numpy())
        self.write()


x, y = load_digits(return_X_y=True)
x, y = (x[:512] / 16.0).astype("float32"), y[:512].astype("int32")
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    sgd = keras.optimizers.SGD(0.05, momentum=0.9) if args.momentum_correction else keras.optimizers.SGD(0.3)
    optimizer = sgd if args.dense else tf_topk.TopKOptimizer(sgd, density=0.05,
                                                             error_feedback=not args.no_error_feedback,
                                                             momentum_correction=args.momentum_correction)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
backup_dir = args.backup_dir_worker1 if worker == 1 and args.backup_dir_worker1 else args.backup_dir
backup = tf_topk.keras.BackupAndRestore(backup_dir, save_freq=save_freq, delete_checkpoint=not args.keep)
history = model.fit(x, y, epochs=args.epochs, batch_size=64, verbose=0, shuffle=False,
                    callbacks=[backup, Record(backup)])
result = {"loss": history.history["loss"], "iterations": int(model.optimizer.iterations.numpy()),
          "restored_epoch": backup.restored_epoch}
with open(os.path.join(args.out, f"worker{worker}.json"), "w") as f:
    json.dump(result, f)
np.savez(os.path.join(args.out, f"worker{worker}.npz"), *model.get_weights())
if not args.dense:  # this worker's own copy of each per-replica state variable (one replica per worker)
    np.savez(os.path.join(args.out, f"worker{worker}_state.npz"),
             *[strategy.experimental_local_results(v.value)[0].numpy()
               for v in model.optimizer.residuals + model.optimizer.velocities])
print(f"worker {worker} done, restored_epoch={backup.restored_epoch}", flush=True)
