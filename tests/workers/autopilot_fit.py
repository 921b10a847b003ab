"""Train a small model with TopKOptimizer's default (no density: the autopilot) on 2 logical CPUs,
then save it: `autopilot_fit.py OUT_DIR`. Writes OUT_DIR/fit.json (the plan, the last step's
statistics, and whether a plan made in a traced function measured anything) and OUT_DIR/model.keras."""

import dataclasses
import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402

import tf_topk  # noqa: E402

out = sys.argv[1]
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05))
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
rng = np.random.default_rng(0)
x, y = rng.standard_normal((256, 64)).astype("float32"), rng.integers(0, 10, 256)
history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
plan = optimizer.exchange.autopilot_plan
traced = []
with strategy.scope():  # in a traced function nothing can be timed: the typed-in link, said on stderr
    tf.function(lambda: traced.append(tf_topk.autopilot.plan(100_000)) or tf.constant(0))()
model.save(os.path.join(out, "model.keras"))
with open(os.path.join(out, "fit.json"), "w") as f:
    json.dump({"measured": plan.calibration is not None, "trial": plan.calibration and plan.calibration.trial(),
               "model": dataclasses.asdict(plan.model), "describe": plan.describe(), "decision": plan.decision(),
               "router": type(optimizer.exchange.router).__name__, "stats": optimizer.compression_stats(),
               "density_config": optimizer.get_config()["density"], "loss": history.history["loss"],
               "traced_measured": traced[0].calibration is not None, "traced_replicas": traced[0].model.replicas}, f)
