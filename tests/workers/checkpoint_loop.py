"""Worker: a custom training loop with SparseExchange and tf.train.CheckpointManager, resumable.

MWMS under TF_CONFIG (one replica per worker), else one process. Deterministic:
digits, fixed seed, no shuffle; the batch of step s is a function of s alone,
so a resumed run trains on exactly the batches an uninterrupted one would.
The exchange uses momentum correction (residuals and velocities per replica)
and the update is plain SGD.

  --ckpt DIR        the chief's CheckpointManager directory (the other workers
                    save into temporary directories, deleted at once); at
                    start every worker restores the latest checkpoint in it
  --out DIR         attempt{a}_worker{i}.json (pid, restored step), and when done
                    worker{i}.npz (weights), worker{i}_state.npz (this worker's
                    exchange state, in exchange.memory_state order)
  --steps N         train until step N (default 24: 3 epochs of 8 batches)
  --save-every K    save after every K steps (default 4)
  --pause-at S      worker 1, attempt 0 only ($TF_TOPK_RESTART): before step S,
                    write <out>/paused (its pid) and sleep, to be killed
  --restore-only    restore, write the outputs, do not train
"""

import argparse
import json
import os
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tf_topk  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--pause-at", type=int, default=None)
parser.add_argument("--restore-only", action="store_true")
args = parser.parse_args()

GLOBAL_BATCH, SAMPLES = 64, 512
config = json.loads(os.environ.get("TF_CONFIG", "{}"))
worker = config.get("task", {}).get("index", 0)
attempt = int(os.environ.get("TF_TOPK_RESTART", "0"))
strategy = tf.distribute.MultiWorkerMirroredStrategy() if config else tf.distribute.get_strategy()
replicas = strategy.num_replicas_in_sync

x, y = load_digits(return_X_y=True)
x, y = (x[:SAMPLES] / 16.0).astype("float32"), y[:SAMPLES].astype("int32")
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(96, activation="relu"), keras.layers.Dense(10)])
    optimizer = tf_topk.keras.disable_dense_all_reduce(keras.optimizers.SGD(0.05))
    optimizer.build(model.trainable_variables)
    exchange = tf_topk.SparseExchange(model.trainable_variables, density=0.05, momentum=0.9)
variables = model.trainable_variables
checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, exchange=exchange)


def batch_of_replica(context):
    """Replica r's share of the global batch of the current step."""
    step = int(optimizer.iterations.numpy())
    start = (step % (SAMPLES // GLOBAL_BATCH)) * GLOBAL_BATCH
    per_replica = GLOBAL_BATCH // replicas
    first = start + context.replica_id_in_sync_group * per_replica
    return x[first:first + per_replica], y[first:first + per_replica]


@tf.function
def train_step(batch):
    def replica_step(features, labels):
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.nn.compute_average_loss(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True),
                global_batch_size=GLOBAL_BATCH)
        result = exchange(tape.gradient(loss, variables), step=optimizer.iterations)
        optimizer.apply(result.grads, variables)

    strategy.run(replica_step, args=batch)


def is_chief():
    return worker == 0


def save(step):
    """Every worker saves (reading per-replica state is a collective); only the chief's is kept."""
    directory = args.ckpt if is_chief() else tempfile.mkdtemp(prefix=f"checkpoint_loop_worker{worker}_")
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    manager.save(checkpoint_number=step)
    if not is_chief():
        shutil.rmtree(directory, ignore_errors=True)


def write_json(name, content):
    path = os.path.join(args.out, name)
    with open(path + ".tmp", "w") as f:
        json.dump(content, f)
    os.replace(path + ".tmp", path)


latest = tf.train.latest_checkpoint(args.ckpt)
if latest:
    checkpoint.restore(latest).assert_existing_objects_matched()
restored_step = int(optimizer.iterations.numpy()) if latest else None
write_json(f"attempt{attempt}_worker{worker}.json", {"pid": os.getpid(), "restored_step": restored_step})

while not args.restore_only and int(optimizer.iterations.numpy()) < args.steps:
    step = int(optimizer.iterations.numpy())
    if attempt == 0 and worker == 1 and step == args.pause_at:
        write_json("paused.json", {"pid": os.getpid()})
        time.sleep(600)
    train_step(strategy.experimental_distribute_values_from_function(batch_of_replica))
    if (step + 1) % args.save_every == 0:
        save(step + 1)

np.savez(os.path.join(args.out, f"worker{worker}.npz"), *[v.numpy() for v in variables])
np.savez(os.path.join(args.out, f"worker{worker}_state.npz"),
         *[strategy.experimental_local_results(v)[0].numpy() for v in exchange.memory_state])
print(f"worker {worker} done at step {int(optimizer.iterations.numpy())}, restored from {restored_step}", flush=True)
