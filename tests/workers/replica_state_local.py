"""Single process, 3 logical CPUs: per-replica state through checkpoints, files and SavedModels.

Trains a SparseExchange (momentum correction: residuals and velocities) and
a TopKOptimizer under MirroredStrategy over 2 devices, saves them, and
restores into 2 replicas (each its own state, bitwise), 3 replicas and no
strategy (sum / replicas, total kept); restores a checkpoint of the old form
(the sum) by the sum rule; checks that a SavedModel holds the sum, as
TensorFlow writes it, and loads. Writes <out>/report.json; a failed check
raises (non-zero exit).
"""

import json
import os
import sys

os.environ.pop("TF_CONFIG", None)  # the launcher sets one; this script is not multi-worker

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)

import keras  # noqa: E402

import tf_topk  # noqa: E402

out = sys.argv[1]
TWO = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
THREE = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
NONE = tf.distribute.get_strategy()
report = {}


def local(variable, strategy):
    return [c.numpy() for c in strategy.experimental_local_results(variable)]


def restored_elsewhere(before, replicas):
    """What each replica of another replica count gets from the saved rows:
    the value itself for state that is the same on every replica (dense-path
    velocities), else sum / replicas (the total is kept)."""
    if all(np.array_equal(before[0], row) for row in before[1:]):
        return before[0]
    return sum(before) / replicas


# -- SparseExchange and tf.train.Checkpoint --------------------------------------------------------


def make_exchange(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        weights = [tf.Variable(tf.random.normal([64, 80])), tf.Variable(tf.zeros([80]))]
        exchange = tf_topk.SparseExchange(weights, density=0.05, momentum=0.9)
    return weights, exchange


weights, exchange = make_exchange(TWO)


@tf.function
def steps():
    def replica_step():
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        grads = [tf.random.stateless_normal(w.shape, [7, 0]) * (replica + 1.0) for w in weights]
        exchange(grads, step=tf.constant(0, tf.int64))

    for _ in range(3):
        TWO.run(replica_step)


steps()
saved = [local(v, TWO) for v in exchange.memory_state]
assert len(saved) == 3  # residual and velocity of the kernel, velocity of the bias
assert not np.array_equal(*saved[0]) and not np.array_equal(*saved[1])  # per replica
np.testing.assert_array_equal(*saved[2])  # the dense-path velocity is the same on every replica
assert np.abs(saved[2][0]).sum() > 0
assert [v.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA for v in exchange.memory_state] == \
    [False, False, True]
path = tf.train.Checkpoint(exchange=exchange).save(os.path.join(out, "exchange", "ckpt"))
report["checkpoint_shapes"] = {name: shape for name, shape in tf.train.list_variables(path)}

_, same = make_exchange(TWO)
tf.train.Checkpoint(exchange=same).restore(path).assert_consumed()
for before, variable in zip(saved, same.memory_state):
    for a, b in zip(before, local(variable, TWO)):
        np.testing.assert_array_equal(a, b)  # each replica its own row, bitwise

for strategy in (THREE, NONE):
    _, other = make_exchange(strategy)
    tf.train.Checkpoint(exchange=other).restore(path).assert_consumed()
    replicas = strategy.num_replicas_in_sync
    for before, variable in zip(saved, other.memory_state):
        for value in local(variable, strategy):
            np.testing.assert_allclose(value, restored_elsewhere(before, replicas), rtol=1e-6, atol=1e-7)

# A checkpoint of the old form (one value under the same key) restores by the
# sum rule, and state that is the same on every replica as that value.
old = tf.Module()
old.memory_state = [tf.Variable(before[0] + before[1]) for before in saved]
old_path = tf.train.Checkpoint(exchange=old).save(os.path.join(out, "old", "ckpt"))
_, from_old = make_exchange(TWO)
tf.train.Checkpoint(exchange=from_old).restore(old_path).assert_consumed()
for before, variable in zip(saved, from_old.memory_state):
    for value in local(variable, TWO):
        expected = before[0] + before[1] if variable is from_old.memory_state[2] else (before[0] + before[1]) / 2
        np.testing.assert_array_equal(value, expected)

# A SavedModel holds the sum (what TensorFlow writes) and loads into plain variables.
module = tf.Module()
module.exchange = exchange
module.residual_sum = tf.function(lambda: tf.identity(exchange.residuals[0]), input_signature=[])
tf.saved_model.save(module, os.path.join(out, "saved_model"))
loaded = tf.saved_model.load(os.path.join(out, "saved_model"))
np.testing.assert_array_equal(loaded.exchange.residuals[0].numpy(), saved[0][0] + saved[0][1])

# -- TopKOptimizer and Keras weights files ---------------------------------------------------------

x = np.random.default_rng(0).normal(size=(128, 64)).astype("float32")
y = (np.arange(128) % 10).astype("int32")


def make_model(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(80), keras.layers.Dense(10)])
        model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=0.05,
                                                      momentum_correction=True),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    return model


def state_variables(model):
    return [v.value for v in model.optimizer.residuals + model.optimizer.velocities]


def state(model, strategy):
    return [local(v, strategy) for v in state_variables(model)]


model = make_model(TWO)
model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
weights_file = os.path.join(out, "model.weights.h5")
model.save_weights(weights_file)
saved = state(model, TWO)
assert not np.array_equal(*saved[0])
# Residual and velocity of the sparsified kernel differ per replica; the
# dense-path velocities (bias, small kernel, bias) are the same on each.
assert [all(np.array_equal(rows[0], row) for row in rows) for rows in saved] == [False, False, True, True, True]
for strategy in (TWO, THREE):
    restored = make_model(strategy)
    restored.load_weights(weights_file)
    for before, variable, after in zip(saved, state_variables(restored), state(restored, strategy)):
        if strategy is TWO:
            for a, b in zip(before, after):
                np.testing.assert_array_equal(a, b)
        else:
            for value in after:
                np.testing.assert_allclose(value, restored_elsewhere(before, 3), rtol=1e-6, atol=1e-7)

# A .keras file: the same rules, read back into three replicas.
keras_file = os.path.join(out, "model.keras")
model.save(keras_file)
with THREE.scope():
    reloaded = keras.models.load_model(keras_file)
for before, variable, after in zip(saved, state_variables(reloaded), state(reloaded, THREE)):
    for value in after:
        np.testing.assert_allclose(value, restored_elsewhere(before, 3), rtol=1e-6, atol=1e-7)

with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("replica state checks passed", flush=True)
