"""Single process, one logical CPU per replica: Adam's momentum correction under MirroredStrategy.

Usage: adam_replicas.py OUT.npz CONFIG_JSON, the configuration coming from
tests/test_adam_momentum_correction.py: variable shapes, min_size, density,
replicas, steps, warm-up steps, learning rate, weight decay, the step on
which one replica's gradient is NaN, and the runs (wrapper/exchange_mode). Each replica gets its own gradients,
applied through `TopKOptimizer(AdamW)` of Keras 3 or of tf_keras, with an
exchange mode. Writes, per run and step, every replica's variables and its
memory state (residuals, velocities, moments), plus the inputs and the
starting values; the test compares them with a numpy reference.
"""

import json
import os
import sys

os.environ.pop("TF_CONFIG", None)

import numpy as np
import tensorflow as tf

out_path, config = sys.argv[1], json.loads(sys.argv[2])
SHAPES = [tuple(shape) for shape in config["shapes"]]
REPLICAS, STEPS, NAN_STEP = config["replicas"], config["steps"], config["nan_step"]
cpu = tf.config.list_physical_devices("CPU")[0]  # one logical CPU per replica, before TensorFlow starts
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import keras  # noqa: E402
import tf_keras  # noqa: E402

import tf_topk  # noqa: E402
import tf_topk.tf_keras  # noqa: E402

rng = np.random.default_rng(11)
# grads[step][replica][variable]; continuous values, so the exact top-k has no ties.
grads = [[[rng.standard_normal(shape).astype(np.float32) for shape in SHAPES] for _ in range(REPLICAS)]
         for _ in range(STEPS)]
grads[NAN_STEP][REPLICAS - 1][0][0, 0] = np.nan  # that step is skipped on every replica
start = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
options = dict(density=config["density"], method="exact", min_size=config["min_size"], momentum_correction=True,
               variance_warmup_steps=config["warmup_steps"])


def make(api, mode):
    """(variables, optimizer, apply(grads)) of one wrapper, in the strategy's scope."""
    with strategy.scope():
        if api == "keras":
            variables = [keras.Variable(w) for w in start]
            inner = keras.optimizers.AdamW(config["learning_rate"], weight_decay=config["weight_decay"])
            optimizer = tf_topk.TopKOptimizer(inner, exchange_mode=mode, **options)
            return variables, optimizer, lambda g: optimizer.apply(g, variables)
        variables = [tf.Variable(w) for w in start]
        inner = tf_keras.optimizers.AdamW(config["learning_rate"], weight_decay=config["weight_decay"])
        optimizer = tf_topk.tf_keras.TopKOptimizer(inner, exchange_mode=mode, **options)
        return variables, optimizer, lambda g: optimizer.apply_gradients(zip(g, variables))


saved = {}
for label in config["runs"]:
    api, mode = label.split("/")
    variables, optimizer, apply = make(api, mode)

    @tf.function
    def step(step_grads):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            apply([tf.gather(g, replica) for g in step_grads])

        strategy.run(replica_fn)

    for s in range(STEPS):
        step([tf.constant(np.stack([grads[s][r][v] for r in range(REPLICAS)])) for v in range(len(SHAPES))])
        memory = optimizer.exchange.memory
        states = {"residual": memory.residuals, "velocity": memory.velocities, "first": memory.first_moments,
                  "second": memory.second_moments, "scale": memory.gradient_scales}
        for r in range(REPLICAS):
            prefix = f"{label}/step{s}/replica{r}"
            for v, variable in enumerate(variables):
                value = variable.value if api == "keras" else variable
                saved[f"{prefix}/variable{v}"] = strategy.experimental_local_results(value)[r].numpy()
            for name, state in states.items():
                for slot, variable in enumerate(state):
                    saved[f"{prefix}/{name}{slot}"] = variable.values[r].numpy()
    saved[f"{label}/skipped"] = np.array(int(optimizer.skipped_steps.numpy()))
    saved[f"{label}/iterations"] = np.array(int(optimizer.iterations.numpy()))
for s in range(STEPS):
    for r in range(REPLICAS):
        for v in range(len(SHAPES)):
            saved[f"input/step{s}/replica{r}/grad{v}"] = grads[s][r][v]
for v, w in enumerate(start):
    saved[f"input/start{v}"] = w
np.savez(out_path, **saved)
print("OK")
