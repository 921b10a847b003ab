"""Load a model saved with TopKOptimizer's default under MirroredStrategy over N logical CPUs, in
a fresh process: `autopilot_load.py MODEL.keras N`. Loading builds the optimizer, and with it the
autopilot's plan. Prints the plan's line as JSON on the last line of stdout."""

import json
import sys

import tensorflow as tf

replicas = int(sys.argv[2])
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * replicas)
import keras  # noqa: E402

import tf_topk  # noqa: E402,F401  (registers TopKOptimizer for loading)

strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
with strategy.scope():
    model = keras.models.load_model(sys.argv[1])
optimizer = model.optimizer
if optimizer.exchange is None:  # not built by loading: as fit would build it
    with strategy.scope():
        optimizer.build(model.trainable_variables)
plan = optimizer.exchange.autopilot_plan
print(json.dumps({"describe": plan.describe(), "measured_here": "calibration (" in plan.describe()
                  and "saved with the model" not in plan.describe(), "replicas": plan.model.replicas}))
