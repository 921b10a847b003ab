"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial on 2 logical CPUs, with
MNIST replaced by scikit-learn's digits upsampled to 28x28 (blank borders, as MNIST has): a small
CNN, Adam, MirroredStrategy, a custom loop. Run with each optimizer named on the command line:
`adam_journey.py OUT.json EPOCHS NAME...` with NAME in `adam` (the tutorial as published),
`topk` (the one-line change `tf_topk.TopKOptimizer(keras.optimizers.Adam())`: on one machine
the autopilot sends every entry), `topk_0.001` (a fixed density 0.001) and `topk_correction`
(`momentum_correction=True`, at its fixed 0.001 after a 100-step dense warm-up). Writes, per name, the largest
|weight| of each variable, the regularisation loss and the last epoch's training loss."""

import json
import sys

import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tf_topk  # noqa: E402

out, epochs, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
GLOBAL_BATCH = 64

x, y = load_digits(return_X_y=True)
images = (x.reshape(-1, 8, 8, 1) / 16.0).astype("float32")
images = tf.pad(tf.image.resize(images, (20, 20)), [[0, 0], [4, 4], [4, 4], [0, 0]]).numpy()  # 28x28, blank border
labels = y.astype("int64")
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def make_optimizer(name):
    if name == "adam":
        return keras.optimizers.Adam()
    if name == "topk":
        return tf_topk.TopKOptimizer(keras.optimizers.Adam())
    if name == "topk_0.001":
        return tf_topk.TopKOptimizer(keras.optimizers.Adam(), density=0.001)
    if name == "topk_correction":
        return tf_topk.TopKOptimizer(keras.optimizers.Adam(), momentum_correction=True)
    raise ValueError(f"unknown optimizer name {name!r}")


def run(name):
    keras.utils.set_random_seed(0)
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(2048, seed=0).batch(GLOBAL_BATCH)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-4)),
            keras.layers.Dense(10)])
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        optimizer = make_optimizer(name)
        optimizer.build(model.trainable_variables)  # as the tutorial's users are told to: measured here

    def train_step(inputs):
        features, target = inputs
        with tf.GradientTape() as tape:
            per_example = loss_object(target, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs):
        return strategy.reduce("SUM", strategy.run(train_step, args=(inputs,)), axis=None)

    losses = []
    for _ in range(epochs):
        total, batches = 0.0, 0
        for inputs in dist_dataset:
            total += float(distributed_train_step(inputs))
            batches += 1
        losses.append(total / batches)
    return {"largest": [float(np.abs(v.numpy()).max()) for v in model.trainable_variables],
            "names": [v.path for v in model.trainable_variables],
            "regularization": float(tf.add_n(model.losses)), "loss": losses,
            "steps": int(optimizer.iterations.numpy())}


with open(out, "w") as f:
    json.dump({name: run(name) for name in names}, f)
