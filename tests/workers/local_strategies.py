"""Single process: apply_mwms_fix() changes nothing outside multi-worker MWMS.

Trains the same model with no strategy and with MirroredStrategy over two
logical CPUs, once before and once after apply_mwms_fix(), and checks the
weights and losses are bitwise identical. Also checks idempotence. Exits 0 on
success; a failed check raises (non-zero exit).
"""

import os
import sys

os.environ.pop("TF_CONFIG", None)  # the launcher sets one; this script is not multi-worker

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras
from keras.src.backend.tensorflow import trainer as trainer_module
from sklearn.datasets import load_digits

from tf_topk.keras import mwms_fix  # noqa: E402

x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")[:640]
y = y.astype("int32")[:640]


def train(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    return model.get_weights(), history.history, evaluation


strategies = {
    "default": tf.distribute.get_strategy(),
    "mirrored": tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
}
assert strategies["mirrored"].num_replicas_in_sync == 2

before = {name: train(s) for name, s in strategies.items()}

assert not mwms_fix.is_mwms_fix_applied()
assert mwms_fix.apply_mwms_fix() is True
patched = (trainer_module.TensorFlowTrainer._maybe_symbolic_build, trainer_module.reduce_per_replica)
assert mwms_fix.apply_mwms_fix() is True  # idempotent: no second wrapping
assert (trainer_module.TensorFlowTrainer._maybe_symbolic_build, trainer_module.reduce_per_replica) == patched
assert patched[1].__tf_topk_original__.__module__ == trainer_module.__name__
assert mwms_fix.is_mwms_fix_applied()

after = {name: train(s) for name, s in strategies.items()}

for name in strategies:
    (w0, h0, e0), (w1, h1, e1) = before[name], after[name]
    assert len(w0) == len(w1) == 4, name
    for a, b in zip(w0, w1):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{name}: weights differ after the fix"
    assert h0 == h1, f"{name}: history differs after the fix: {h0} vs {h1}"
    assert e0 == e1, f"{name}: evaluate differs after the fix: {e0} vs {e1}"
    assert h0["loss"][1] < h0["loss"][0], f"{name}: did not train: {h0}"
    print(f"{name}: unchanged by the fix, loss {h0['loss']}, evaluate {e0}")
print("OK")
