"""tf_topk.tf_keras.TopKOptimizer's default (no density: the autopilot) under MirroredStrategy over 2
logical CPUs: `tf_keras_default_fit.py`. tf_keras's fit builds the optimizer inside its first traced
step, where nothing can be timed; built before fit under the strategy's scope, it measures. Prints
one JSON line: for each way, whether the plan measured, and the loss per epoch."""

import json

import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_keras  # noqa: E402

import tf_topk  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
x, y = rng.standard_normal((256, 64)).astype("float32"), rng.integers(0, 10, 256)
report = {}
for way in ("built_by_fit", "built_before_fit"):
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.layers.Input((64,)), tf_keras.layers.Dense(256, activation="relu"),
                                     tf_keras.layers.Dense(10)])
        optimizer = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.05))
        model.compile(optimizer, tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if way == "built_before_fit":
            optimizer.build(model.trainable_variables)
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    report[way] = {"measured": optimizer.exchange.autopilot_plan.calibration is not None,
                   "loss": history.history["loss"]}
print(json.dumps(report))
