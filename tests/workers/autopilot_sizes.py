"""TopKOptimizer's default (the autopilot) on models of every size, 2 logical CPUs:
`autopilot_sizes.py OUT_DIR`. Writes OUT_DIR/sizes.json: per model, the sparsifiable entries the
plan saw, whether it measured, its router, its lines and the training losses; a second optimizer for
the same model sizes on the same strategy ("one variable, again") reuses the first one's measurement."""

import contextlib
import io
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
rng = np.random.default_rng(0)
MODELS = {  # (inputs, hidden units): the sparsifiable entries are the kernels of 4096 entries or more
    "tiny": (8, 16),            # 161 parameters, nothing to sparsify
    "one variable": (64, 64),   # one kernel of exactly min_size (4096)
    "4M entries": (2000, 2000),  # one kernel of 4,000,000
    "tiny, Adam": (8, 16),      # the same 161 parameters with Adam, the other optimizer most users bring
    "one variable, AdamW": (64, 64),
}


def plan_facts(plan, line):
    return {"entries": plan.entries, "measured": plan.calibration is not None, "line": line.strip()}


found, plans = {}, {}
for name, (inputs, hidden) in [*MODELS.items(), ("one variable, again", MODELS["one variable"])]:
    x = (rng.standard_normal((64, inputs)) / np.sqrt(inputs)).astype("float32")
    y = rng.standard_normal((64, 1)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(hidden, activation="relu"),
                                  keras.layers.Dense(1)])
        inner = keras.optimizers.AdamW(0.01) if "AdamW" in name else \
            keras.optimizers.Adam(0.01) if "Adam" in name else keras.optimizers.SGD(0.01)
        optimizer = tf_topk.TopKOptimizer(inner)
        model.compile(optimizer, "mse", jit_compile=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    plan = plans[name] = optimizer.exchange.autopilot_plan
    lines = [line for line in err.getvalue().splitlines() if line.startswith("tf_topk autopilot:")]
    found[name] = dict(plan_facts(plan, lines[-1]), router=type(optimizer.exchange.router).__name__,
                       loss=history.history["loss"], lines=lines)
    print(lines[0], file=sys.stderr)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    one = tf_topk.autopilot.plan(1, strategy=strategy, budget_s=0.5)
found["plan of one entry"] = plan_facts(one, err.getvalue())
found["one variable, again"]["same calibration"] = \
    plans["one variable, again"].calibration is plans["one variable"].calibration
with open(os.path.join(out, "sizes.json"), "w") as f:
    json.dump(found, f)
