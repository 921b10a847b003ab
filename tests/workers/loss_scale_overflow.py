"""Two workers, mixed_float16: at step 0 only worker 0's gradients overflow.

LossScaleOptimizer(TopKOptimizer(SGD)) in a custom training loop under
MultiWorkerMirroredStrategy. Every worker must skip step 0 together (nothing
applied, loss scale halved) and then train in step. Writes this worker's
iterations, loss scale and weights to <out>/worker<i>.npz.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tf_topk

STEPS, BATCH = 6, 32

out_dir = sys.argv[1]
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
keras.mixed_precision.set_global_policy("mixed_float16")
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10, dtype="float32")])
    optimizer = keras.optimizers.LossScaleOptimizer(
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.05, min_size=1000))
    optimizer.build(model.trainable_variables)
initial_scale = float(optimizer.dynamic_scale.numpy())

x, y = load_digits(return_X_y=True)
x, y = (x / 16.0).astype("float32"), y.astype("int32")


@tf.function
def train_step(x, y):
    def replica_fn(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH * strategy.num_replicas_in_sync)
            scaled_loss = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(scaled_loss, model.trainable_variables), model.trainable_variables)
        return loss

    return strategy.run(replica_fn, args=(x, y))


for step in range(STEPS):
    rows = slice((2 * step + task) * BATCH, (2 * step + task + 1) * BATCH)
    x_batch = x[rows] * (1e4 if step == 0 and task == 0 else 1.0)  # float16 overflows on worker 0 only
    train_step(tf.constant(x_batch), tf.constant(y[rows]))
    print(f"worker {task} step {step}: iterations {int(optimizer.iterations.numpy())}", flush=True)

np.savez(os.path.join(out_dir, f"worker{task}.npz"), iterations=int(optimizer.iterations.numpy()),
         initial_scale=initial_scale, scale=float(optimizer.dynamic_scale.numpy()),
         skipped_by_topk=int(optimizer.inner_optimizer.skipped_steps.numpy()),
         **{f"weight{i}": w for i, w in enumerate(model.get_weights())})
