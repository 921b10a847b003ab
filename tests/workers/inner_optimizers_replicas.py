"""Density 1.0 is the inner optimizer with two replicas: `inner_optimizers_replicas.py SPEC...`, each
SPEC a name of tests/test_keras_optimizer_matrix.py's INNER_OPTIMIZERS, or NAME+OPTION with an option of its
OPTIONS_ONE_AT_A_TIME turned on. For each, the digits MLP is trained 48
steps with model.fit under MirroredStrategy over 2 logical CPUs, by the optimizer alone and wrapped
in TopKOptimizer(density=1.0). Prints one JSON line: spec -> the largest weight difference (a NaN in
one only is infinitely different), or, where fit raised, {"alone": ..., "wrapped": ...} with each error
("trained" where none)."""

import json
import sys
from pathlib import Path

import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_topk  # noqa: E402
from digits_models import digits, mlp  # noqa: E402
from test_keras_optimizer_matrix import INNER_OPTIMIZERS, with_option  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x, y = digits(512)
differences = {}


def train(spec, wrap):
    """The weights after 48 steps, or the error fit raised (its type and message)."""
    name, _, option = spec.partition("+")
    with strategy.scope():
        model = mlp()
        inner = with_option(name, option) if option else INNER_OPTIMIZERS[name]()
        model.compile(optimizer=tf_topk.TopKOptimizer(inner, density=1.0) if wrap else inner,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    try:
        model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return model.get_weights()


for spec in sys.argv[1:]:
    alone, wrapped = train(spec, False), train(spec, True)
    if isinstance(alone, str) or isinstance(wrapped, str):
        differences[spec] = {"alone": alone if isinstance(alone, str) else "trained",
                             "wrapped": wrapped if isinstance(wrapped, str) else "trained"}
        continue
    # The largest difference; a NaN anywhere is infinitely different (NaN weights would make the wrapper skip
    # every later step, where Keras goes on: INNER_OPTIMIZERS' Adafactor has an epsilon_1 that avoids them).
    differences[spec] = max(float(np.max(np.abs(a - b), initial=0.0)) if not (np.isnan(a) | np.isnan(b)).any()
                            else float("inf") for a, b in zip(alone, wrapped))
print(json.dumps(differences))
