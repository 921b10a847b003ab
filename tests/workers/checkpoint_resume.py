"""Worker: train with TopKOptimizer under MWMS, checkpoint, or restore and continue.

    --phase save:   train 2 epochs, save a checkpoint (the chief into --ckpt, the
                    others into their own folders: every worker must save, since
                    gathering every worker's residual into it is a collective)
    --phase resume: restore the chief's checkpoint, then train 1 more epoch
Each phase writes <out>/<phase>_worker<i>.json and this worker's local residual
as <out>/<phase>_worker<i>.npy (after training for save, right after restore
for resume).
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tf_topk  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--phase", choices=("save", "resume"), required=True)
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
x, y = load_digits(return_X_y=True)
x, y = (x[:512] / 16.0).astype("float32"), y[:512].astype("int32")
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.3), density=0.01)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizer.build(model.trainable_variables)
checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)


def local_residual():
    return strategy.experimental_local_results(optimizer.residuals[0].value)[0].numpy()


result = {}
if args.phase == "save":
    history = model.fit(x, y, epochs=2, batch_size=64, verbose=0, shuffle=False)
    result["loss"] = history.history["loss"]
    folder = args.ckpt if worker == 0 else os.path.join(args.out, f"worker{worker}_ckpt")
    result["path"] = checkpoint.save(os.path.join(folder, "ckpt"))
    residual = local_residual()
else:
    checkpoint.restore(tf.train.latest_checkpoint(args.ckpt)).assert_existing_objects_matched()
    residual = local_residual()
    result["iterations_restored"] = int(optimizer.iterations.numpy())
    history = model.fit(x, y, epochs=1, batch_size=64, verbose=0, shuffle=False)
    result["loss"] = history.history["loss"]
result["iterations"] = int(optimizer.iterations.numpy())
np.save(os.path.join(args.out, f"{args.phase}_worker{worker}.npy"), residual)
with open(os.path.join(args.out, f"{args.phase}_worker{worker}.json"), "w") as f:
    json.dump(result, f)
