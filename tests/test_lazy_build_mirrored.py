"""TopKOptimizer built by its first update inside `strategy.run` in a tf.function (MirroredStrategy over
two logical CPUs, Keras 3 and tf_keras): the same training as building it in advance.

Each case runs in a fresh process: logical devices must be set before TensorFlow initialises.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from multiworker import REPO_ROOT, worker_env

TRAIN = r"""
import json, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_topk

keras_name = sys.argv[1]
if keras_name == "keras":
    import keras
    TopKOptimizer = tf_topk.TopKOptimizer
else:
    import tf_keras as keras
    import tf_topk.tf_keras
    TopKOptimizer = tf_topk.tf_keras.TopKOptimizer
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")


def train(build_first):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
        # Adam's momentum correction: one dense step, then sparse.
        optimizer = TopKOptimizer(keras.optimizers.Adam(0.01), density=0.25, min_size=100, momentum_correction=True,
                                  variance_warmup_steps=1)
        if build_first:
            optimizer.build(model.trainable_variables)

    @tf.function
    def step():
        def replica_step():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            xs = tf.gather(tf.constant(x), tf.stack([2 * r, 2 * r + 1]))  # each replica its own rows
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(tf.reduce_sum(model(xs) ** 2, axis=1), global_batch_size=4)
            grads = tape.gradient(loss, model.trainable_variables)
            if keras_name == "keras":
                optimizer.apply(grads, model.trainable_variables)
            else:
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step)

    step()
    step()
    residual = optimizer.residuals[0]
    residual = residual.value if keras_name == "keras" else residual  # the tf.Variable
    return dict(iterations=int(optimizer.iterations.numpy()), weights=[w.tolist() for w in model.get_weights()],
                residual_per_replica=[t.numpy().tolist() for t in strategy.experimental_local_results(residual)])


report = {}
for mode in ("built_first", "lazy"):
    try:
        report[mode] = train(build_first=mode == "built_first")
    except Exception as error:
        report[mode] = {"error": f"{type(error).__name__}: {error}"[-3000:]}
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
def test_lazy_build_in_strategy_run_trains_as_building_first(keras_name):
    env = worker_env(CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    # subprocess.run kills the process if it runs past the timeout.
    proc = subprocess.run([sys.executable, "-c", TRAIN, keras_name], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))[7:])
    built_first, lazy = report["built_first"], report["lazy"]
    assert "error" not in built_first, built_first["error"]
    assert "error" not in lazy, lazy["error"]
    assert built_first["iterations"] == lazy["iterations"] == 2
    for a, b in zip(built_first["weights"], lazy["weights"], strict=True):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-6, atol=1e-7)
    # Per-replica state: a residual on each replica, different (each replica had its own rows), the same
    # whichever way the optimizer was built.
    first, second = (np.array(r) for r in lazy["residual_per_replica"])
    assert np.abs(first).sum() > 0 and np.abs(second).sum() > 0 and not np.array_equal(first, second)
    for a, b in zip(built_first["residual_per_replica"], lazy["residual_per_replica"], strict=True):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-6, atol=1e-7)
