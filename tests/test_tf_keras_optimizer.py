"""tf_topk.tf_keras: TopKOptimizer and CompressionStats for Keras 2 (tf_keras), in one process.

Multi-worker runs (MultiWorkerMirroredStrategy, MirroredStrategy, BackupAndRestore,
mixed precision) are in tests/test_multiworker_tf_keras.py.
"""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from sklearn.datasets import load_digits

from tf_topk.config import ExchangeConfig
from tf_topk.selector import RandomKSelector
from tf_topk.tf_keras import CompressionStats, TopKOptimizer, restore_optimizer_variables

from multiworker import KERAS_2, PYTHON, REPO_ROOT, WORKERS_DIR, worker_env

X, Y = load_digits(return_X_y=True)
X, Y = (X[:512] / 16.0).astype("float32"), Y[:512].astype("int32")


def model_and_fit(optimizer, epochs=2, seed=0, **fit_kwargs):
    """A 64-128-10 MLP, compiled with `optimizer` and trained on 512 digits (8 steps an epoch)."""
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential([tf_keras.Input((64,)), tf_keras.layers.Dense(128, activation="relu"),
                                 tf_keras.layers.Dense(10, dtype="float32")])
    model.compile(optimizer=optimizer, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(X, Y, epochs=epochs, batch_size=64, verbose=0, shuffle=False, **fit_kwargs)
    return model, history.history


def assert_same(arrays, others, **tolerance):
    for a, b in zip(arrays, others, strict=True):
        if tolerance:
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), **tolerance)
        else:
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def run_python(code, **env):
    """Run `code` in a new Python process (this checkout importable; the interpreter itself, not a fork:
    what its imports load is tested); returns its stdout."""
    completed = subprocess.run([sys.executable, "-c", code], env={**os.environ, **worker_env(), **env}, cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed.stdout


@pytest.mark.timing
def test_the_default_measures_when_built_before_fit_and_says_so_when_fit_builds_it():
    """No density: the autopilot. tf_keras's fit builds the optimizer in its first traced step, where
    nothing can be timed: the plan assumes a link and its line says to build first; built under the
    strategy's scope before fit, it measures the two replicas. Both train."""
    completed = subprocess.run([*PYTHON, str(WORKERS_DIR / "tf_keras_default_fit.py")],
                               env={**os.environ, **worker_env(**KERAS_2), "TF_TOPK_VERBOSE": "1"}, cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert not report["built_by_fit"]["measured"] and report["built_before_fit"]["measured"]
    assert re.search(r"^tf_topk autopilot: [^\n]*: a step (timed|predicted) [^\n]*; density=", completed.stderr, re.M)
    assert "tf_topk autopilot: nothing measured" in completed.stderr
    assert "build the optimizer under strategy.scope() before training" in completed.stderr
    assert "tf_topk autopilot: calibration (" in completed.stderr and "2 workers" in completed.stderr
    for way in report.values():
        assert way["loss"][-1] < way["loss"][0]


@pytest.mark.slow
@pytest.mark.parametrize("inner", [lambda: tf_keras.optimizers.SGD(0.1), lambda: tf_keras.optimizers.Adam(0.01)],
                         ids=["sgd", "adam"])
def test_density_one_reproduces_the_inner_optimizer(inner):
    """Everything selected: the inner optimizer's own updates, no residual left."""
    dense, _ = model_and_fit(inner())
    optimizer = TopKOptimizer(inner(), density=1.0, method="exact", min_size=1)
    sparse, _ = model_and_fit(optimizer)
    assert_same(dense.get_weights(), sparse.get_weights(), rtol=1e-6, atol=1e-7)
    assert all(float(np.abs(r.numpy()).max()) == 0.0 for r in optimizer.residuals)
    assert int(optimizer.iterations.numpy()) == 16


@pytest.mark.slow
def test_sparse_training_learns_and_compression_stats_are_logged(tmp_path):
    optimizer = TopKOptimizer(tf_keras.optimizers.SGD(0.3), density=0.01, density_warmup_steps=0)  # 0.01 throughout
    _, history = model_and_fit(optimizer, epochs=6, callbacks=[CompressionStats(log_dir=str(tmp_path), update_freq=4,
                                                                          logs="all")])
    assert history["loss"][-1] < 0.6 * history["loss"][0]
    k, d = math.ceil(0.01 * 64 * 128), 64 * 128
    assert history["topk_density"][-1] == pytest.approx(k / d)
    assert 0 < history["topk_contraction"][-1] < history["topk_random_k_bound"][-1] == pytest.approx(1 - k / d)
    assert history["topk_residual_norm"][-1] > 0  # what was not sent is kept
    assert len(optimizer.residuals) == 1  # the 64x128 kernel; the rest is below min_size
    events = tf.io.gfile.glob(f"{tmp_path}/events.out.tfevents.*")
    tags = {value.tag for path in events for event in tf.compat.v1.train.summary_iterator(path)
            for value in event.summary.value}
    assert "topk/density" in tags and "topk/residual_norm" in tags


@pytest.mark.slow
def test_non_finite_step_is_skipped_without_touching_residuals_or_weights():
    model, _ = model_and_fit(TopKOptimizer(tf_keras.optimizers.SGD(0.1), density=0.05, min_size=100), epochs=1)
    optimizer, variables = model.optimizer, model.trainable_variables
    before = [v.numpy().copy() for v in variables + optimizer.residuals]
    iterations = int(optimizer.iterations.numpy())
    bad = [tf.fill(v.shape, np.nan) if i == 0 else tf.ones(v.shape) for i, v in enumerate(variables)]
    tf.function(lambda: optimizer.apply_gradients(zip(bad, variables)))()
    assert int(optimizer.skipped_steps.numpy()) == 1 and int(optimizer.iterations.numpy()) == iterations
    assert_same(before, [v.numpy() for v in variables + optimizer.residuals])
    tf.function(lambda: optimizer.apply_gradients(zip([tf.ones(v.shape) for v in variables], variables)))()
    assert int(optimizer.iterations.numpy()) == iterations + 1


@pytest.mark.parametrize("make, message", [
    (lambda: TopKOptimizer("sgd"), "inner_optimizer must be a tf_keras.optimizers.Optimizer instance, got 'sgd'"),
    (lambda: TopKOptimizer(tf_keras.optimizers.legacy.SGD(0.1)),
     r"does not wrap legacy optimizers \(got tf_keras.optimizers.legacy.SGD\)"),
    (lambda: TopKOptimizer(tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(0.1))),
     r"does not take a LossScaleOptimizer .*Put the LossScaleOptimizer outside: "
     r"tf_keras.mixed_precision.LossScaleOptimizer\(tf_topk.tf_keras.TopKOptimizer\(tf_keras.optimizers.SGD"),
    (lambda: TopKOptimizer(TopKOptimizer(tf_keras.optimizers.SGD(0.1))), "already a TopKOptimizer"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), clipnorm=1.0),
     r"does not take `clipnorm` \(got 1.0\): set it on the inner optimizer"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), foo=1), "unexpected arguments: foo"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), min_size=0), "min_size must be an int >= 1, got 0"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), method="median"), "method must be one of .*got 'median'"),
    (lambda: TopKOptimizer(tf_keras.optimizers.RMSprop(0.1), momentum_correction=True),
     "needs a tf_keras.optimizers.SGD with momentum > 0, Adam or AdamW .*got RMSprop"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), momentum_correction=True), "got SGD with momentum=0.0"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), local_clipnorm=-1),
     "local_clipnorm must be None or a finite float > 0, got -1"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), sparse_updates=True),
     r"sparse_updates=True is available with Keras 3 .* not with tf_keras"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), config=ExchangeConfig(sparse_output=True)),
     r"sparse_updates=True is available with Keras 3 .* not with tf_keras"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), exchange_mode="ring"),
     r"exchange_mode must be one of \('auto', 'allgather', 'allreduce', 'dense_bf16', 'allgather_int8', 'allgather_chunk'\), got 'ring'"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1), config=ExchangeConfig(), density=0.0),
     r"density must be in \(0, 1\], got 0.0"),
    (lambda: TopKOptimizer(tf_keras.optimizers.SGD(0.1, momentum=0.9), config=ExchangeConfig(momentum=0.8)),
     r"config has momentum=0.8, nesterov=False, but the inner SGD has momentum=0.9"),
    (lambda: TopKOptimizer.from_config({**TopKOptimizer(tf_keras.optimizers.SGD(0.1)).get_config(), "min_size": 0}),
     "min_size must be an int >= 1, got 0"),
])
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_exchange_config_round_trips_and_an_earlier_versions_config_loads():
    config = ExchangeConfig(density=[(0, 0.1), (4, 0.01)], method="exact", min_size=1000, momentum_masking=True,
                            local_clipnorm=5.0, exchange_mode="auto", bucket_bytes=1 << 16)
    # Arguments given replace config's fields (method="gaussian" too, though the default); the rest is config's.
    optimizer = TopKOptimizer(tf_keras.optimizers.SGD(0.05, momentum=0.9), config=config, method="gaussian",
                              momentum_correction=True)
    assert optimizer.exchange_config == config.replace(method="gaussian", momentum=0.9, decoupled_momentum=False)
    assert (optimizer.method, optimizer.exchange_mode, optimizer.momentum_correction) == ("gaussian", "auto", True)
    written = optimizer.get_config()
    assert written["momentum_masking"] is True and written["momentum_correction"] is True
    clone = TopKOptimizer.from_config(json.loads(json.dumps(written)))
    assert clone.exchange_config == optimizer.exchange_config and clone.get_config() == written
    # An earlier version's config: flat keys, no momentum_masking (it masked, and resumes masking), no
    # density_warmup_steps (it ran none, and resumes without one), no decoupled_step_scale (1.0).
    old = {"name": "TopKOptimizer", "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
           "clipvalue": None, "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
           "jit_compile": False, "is_legacy_optimizer": False,
           "inner_optimizer": tf_keras.optimizers.serialize(tf_keras.optimizers.SGD(0.05, momentum=0.9)),
           "density": [[0, 0.1], [4, 0.01]], "method": "exact", "min_size": 1000, "bucket_bytes": None,
           "error_feedback": True, "momentum_correction": True, "local_clipnorm": 5.0, "exchange_mode": "allreduce",
           "sparse_updates": False}
    loaded = TopKOptimizer.from_config(json.loads(json.dumps(old)))
    assert loaded.exchange_config == ExchangeConfig(density=[(0, 0.1), (4, 0.01)], method="exact", min_size=1000,
                                                    momentum=0.9, local_clipnorm=5.0, exchange_mode="allreduce",
                                                    momentum_masking=True, density_warmup_steps=0,
                                                    decoupled_momentum=False, decoupled_step_scale=1.0)
    rewritten = loaded.get_config()
    assert {name: rewritten[name] for name in old} == old and rewritten["momentum_masking"] is True


@pytest.mark.slow
def test_parts_reach_the_exchange_and_get_config_refuses_them():
    selector = RandomKSelector()
    optimizer = TopKOptimizer(tf_keras.optimizers.SGD(0.1), density=0.05, min_size=1000, exchange_mode="auto",
                              selector=selector)
    model, history = model_and_fit(optimizer, epochs=1)
    assert optimizer.exchange.selector is selector
    assert optimizer.exchange.config == optimizer.exchange_config
    assert len(optimizer.residuals) == 2 and float(np.abs(optimizer.residuals[0].numpy()).sum()) > 0
    with pytest.raises(NotImplementedError, match=r"cannot describe the exchange parts given to it "
                                                  r"\(selector=RandomKSelector\(\)\)"):
        optimizer.get_config()


@pytest.mark.slow
def test_momentum_correction_moves_the_momentum_and_leaves_the_inner_sgd_as_given():
    """All variables below min_size: the exchange gives them momentum, the inner SGD applies none
    and makes no momentum slots, so the result is tf_keras's momentum SGD."""
    reference, _ = model_and_fit(tf_keras.optimizers.SGD(0.05, momentum=0.9))
    inner = tf_keras.optimizers.SGD(0.05, momentum=0.9)
    optimizer = TopKOptimizer(inner, density=0.01, min_size=10**6, momentum_correction=True)
    model, _ = model_and_fit(optimizer)
    assert_same(reference.get_weights(), model.get_weights(), rtol=1e-4, atol=1e-5)
    assert inner.momentum == 0.9 and inner.nesterov is False
    assert not [v.name for v in inner.variables if v.name.startswith("m/")]  # no momentum slots
    assert len(optimizer.velocities) == 4 and optimizer.exchange.memory.momentum == 0.9


@pytest.mark.slow
def test_checkpoint_restores_residuals_and_velocities(tmp_path):
    def make():
        return TopKOptimizer(tf_keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), density=0.01,
                             min_size=1000, momentum_correction=True, local_clipnorm=5.0)

    model, _ = model_and_fit(make(), epochs=1)
    saved = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    state = [v.numpy() for v in model.optimizer.residuals + model.optimizer.velocities]
    assert len(state) == 6 and all(np.abs(s).sum() > 0 for s in state)  # 2 kernels sparsified, 2 biases dense
    other = make()
    other.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=other).restore(saved).assert_existing_objects_matched()
    assert_same(state, [v.numpy() for v in other.residuals + other.velocities])
    assert int(other.iterations.numpy()) == 8


@pytest.mark.slow
def test_saved_model_loads_in_a_new_process_after_import_tf_topk(tmp_path):
    """model.save(save_format="tf"), then in a new process with TF_USE_LEGACY_KERAS=1:
    import tf_topk (no Keras imported), tf.keras.models.load_model, restore the optimizer's
    variables, train on."""
    optimizer = TopKOptimizer(tf_keras.optimizers.SGD(0.05, momentum=0.9), density=[(0, 0.1), (4, 0.01)],
                              method="exact", min_size=1000, momentum_correction=True)
    model, _ = model_and_fit(optimizer, epochs=1)
    config = optimizer.get_config()
    assert TopKOptimizer.from_config(config).get_config() == config
    assert config["density"] == [[0, 0.1], [4, 0.01]] and config["momentum_correction"] is True
    path = str(tmp_path / "saved_model")
    model.save(path, save_format="tf")
    np.savez(tmp_path / "before.npz", *[v.numpy() for v in optimizer.residuals + optimizer.velocities])
    code = f"""
import json, sys
import tf_topk
imported = sorted(m for m in ("keras", "tf_keras", "tensorflow") if m in sys.modules)
import numpy as np
import tensorflow as tf
model = tf.keras.models.load_model({path!r})
optimizer = model.optimizer
restore_optimizer = tf_topk.tf_keras.restore_optimizer_variables(model, {path!r})
state = [v.numpy() for v in optimizer.residuals + optimizer.velocities]
np.savez({str(tmp_path / "after.npz")!r}, *state)
iterations = int(optimizer.iterations.numpy())
x, y = np.random.default_rng(0).random((64, 64), dtype=np.float32), np.zeros(64, np.int32)
model.fit(x, y, batch_size=64, verbose=0)
print(json.dumps({{"imported": imported, "type": type(optimizer).__module__ + "." + type(optimizer).__name__,
                  "density": optimizer.density, "iterations": iterations,
                  "iterations_after": int(optimizer.iterations.numpy())}}))
"""
    report = json.loads(run_python(code, **KERAS_2).strip().splitlines()[-1])
    assert report["imported"] == []  # import tf_topk imports neither Keras nor TensorFlow
    assert report["type"] == "tf_topk.tf_keras.optimizer.TopKOptimizer"
    assert report["density"] == [[0, 0.1], [4, 0.01]] and report["iterations"] == 8
    assert report["iterations_after"] == 9
    with np.load(tmp_path / "before.npz") as before, np.load(tmp_path / "after.npz") as after:
        assert len(before.files) == 6
        assert_same([before[k] for k in before.files], [after[k] for k in after.files])


@pytest.mark.slow
def test_restore_optimizer_variables_needs_a_saved_optimizer(tmp_path):
    model, _ = model_and_fit(tf_keras.optimizers.SGD(0.1), epochs=1)
    model.save(str(tmp_path), save_format="tf", include_optimizer=False)
    with pytest.raises(ValueError, match=f"the SavedModel at '{tmp_path}' holds no optimizer variables"):
        restore_optimizer_variables(model, str(tmp_path))


@pytest.mark.slow
def test_mixed_precision_trains_and_a_non_finite_step_lowers_the_scale():
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, history = model_and_fit(TopKOptimizer(tf_keras.optimizers.SGD(0.3), density=0.05), epochs=6)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    loss_scale = model.optimizer
    assert isinstance(loss_scale, tf_keras.mixed_precision.LossScaleOptimizer)  # compile put it outside
    assert history["loss"][-1] < 0.6 * history["loss"][0]
    topk, variables = loss_scale.inner_optimizer, model.trainable_variables
    assert all(r.dtype == tf.float32 for r in topk.residuals)
    before, scale = [v.numpy().copy() for v in variables + topk.residuals], float(loss_scale.loss_scale.numpy())
    bad = [tf.fill(v.shape, np.inf) if i == 0 else tf.ones(v.shape) for i, v in enumerate(variables)]
    tf.function(lambda: loss_scale.apply_gradients(zip(bad, variables)))()
    assert float(loss_scale.loss_scale.numpy()) == scale / 2  # the LossScaleOptimizer skipped the step
    assert_same(before, [v.numpy() for v in variables + topk.residuals])


@pytest.mark.slow
def test_tf_keras_stays_optional():
    """`import tf_topk` imports no tf_keras, Keras 3 stays the default, and the adapter
    without tf_keras says what to install."""
    code = """
import sys
import tf_topk
assert "tf_keras" not in sys.modules
import keras
assert tf_topk.TopKOptimizer.__module__ == "tf_topk.keras.optimizer" and "tf_keras" not in sys.modules
sys.modules["tf_keras"] = None  # as if it were not installed
try:
    import tf_topk.tf_keras
except ImportError as error:
    print(error)
"""
    message = run_python(code)
    assert "tf_topk.tf_keras is the adapter for Keras 2 and needs the tf_keras package" in message
    assert f"pip install 'tf_keras=={'.'.join(tf.__version__.split('.')[:2])}.*'" in message
