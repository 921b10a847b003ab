"""Worker: tf_topk.configure_coordination before MWMS, then train with model.fit.

    --heartbeat S   the heartbeat timeout given to configure_coordination
                    (0: do not call it, MWMS configures its 10 s default)
    --stop-at E     worker 1, at the start of epoch E: write <out>/stop_me
                    (its pid), then wait for <out>/go before training on, so
                    the test can SIGSTOP the whole process (heartbeat thread
                    included) for as long as it likes
    --out DIR       worker<i>.json: the config in effect before and after
                    the strategy was built, what a late call says, the losses;
                    worker<i>.npz: final weights
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tf_topk  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--heartbeat", type=float, required=True)
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--out", required=True)
args = parser.parse_args()
worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def describe(config):
    if config is None:
        return None
    return {"heartbeat_timeout_in_ms": config.heartbeat_timeout_in_ms, "service_leader": config.service_leader,
            "jobs": {job.name: job.num_tasks for job in config.coordinated_job_list}}


result = {}
if args.heartbeat:
    result["returned"] = describe(tf_topk.configure_coordination(heartbeat_timeout_s=args.heartbeat))
strategy = tf.distribute.MultiWorkerMirroredStrategy()
result["after_strategy"] = describe(context.context().coordination_service)
try:  # too late now: a different value is refused, the same one returns the config in effect
    tf_topk.configure_coordination(heartbeat_timeout_s=args.heartbeat + 1)
except RuntimeError as e:
    result["late_call_error"] = str(e)
if args.heartbeat:
    result["same_value_again"] = describe(tf_topk.configure_coordination(heartbeat_timeout_s=args.heartbeat))

import keras  # noqa: E402


class StopHere(keras.callbacks.Callback):
    """Worker 1 hands itself to the test at the start of epoch --stop-at."""

    def on_epoch_begin(self, epoch, logs=None):
        if worker == 1 and epoch == args.stop_at:
            with open(os.path.join(args.out, "stop_me.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(args.out, "stop_me.tmp"), os.path.join(args.out, "stop_me"))
            while not os.path.exists(os.path.join(args.out, "go")):
                time.sleep(0.05)


x, y = load_digits(return_X_y=True)
x, y = (x[:512] / 16.0).astype("float32"), y[:512].astype("int32")
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.3), density=0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(x, y, epochs=args.epochs, batch_size=64, verbose=0, shuffle=False, callbacks=[StopHere()])
result["loss"] = history.history["loss"]
with open(os.path.join(args.out, f"worker{worker}.json"), "w") as f:
    json.dump(result, f)
np.savez(os.path.join(args.out, f"worker{worker}.npz"), *model.get_weights())
print(f"worker {worker} done", flush=True)
