"""AdamW's default (decoupled momentum at a fixed density of 0.01) trains under every precision a Keras user
sets: the mixed_float16 and mixed_bfloat16 policies (Keras's LossScaleOptimizer outside the wrapper) on one
device and on two replicas, and float16, bfloat16 and float64 variables, with Keras 3 and with tf_keras.

The DCT's matrices were constants made once, in the first graph that built them: Keras's
LossScaleOptimizer builds the wrapper inside its traced step, whose next trace could not reach them
(InaccessibleTensorError at the first step), and a float64 momentum met float32 matrices (TypeError).
"""

import contextlib
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from logical_cpus import mirrored_on_cpus, split_cpu

split_cpu(2)  # before TensorFlow starts

import tf_topk  # noqa: E402
import tf_topk.tf_keras  # noqa: E402
from tf_topk.decoupled_momentum import DecoupledMomentumMemory  # noqa: E402


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 13_000_000)


@contextlib.contextmanager
def precision(api, policy=None, floatx=None):
    """The global policy or float type of `api`'s Keras within the block, as before afterwards."""
    module = keras if api == "keras" else tf_keras
    policy_before, floatx_before = module.mixed_precision.global_policy(), module.backend.floatx()
    try:
        if floatx:  # variables of that dtype: the float type and the policy that layers read
            module.backend.set_floatx(floatx)
        module.mixed_precision.set_global_policy(policy or floatx)
        yield
    finally:
        module.mixed_precision.set_global_policy(policy_before)
        module.backend.set_floatx(floatx_before)


def fit(api, replicas, exchange_mode="auto"):
    """Three steps of a 64-128-10 MLP (its 64x128 kernel sparsified) under AdamW at density 0.01;
    (the losses, the TopKOptimizer, the model's first kernel)."""
    module = keras if api == "keras" else tf_keras
    strategy = two_replicas() if replicas == 2 else tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync != replicas:
        pytest.skip("TensorFlow started before this module made its logical CPUs")
    wrapper = tf_topk.TopKOptimizer if api == "keras" else tf_topk.tf_keras.TopKOptimizer
    with strategy.scope():
        model = module.Sequential([module.Input((64,)), module.layers.Dense(128, activation="relu"),
                                   module.layers.Dense(10)])
        optimizer = wrapper(module.optimizers.AdamW(1e-3), density=0.01, density_warmup_steps=0, min_size=1000,
                            exchange_mode=exchange_mode)
        model.compile(optimizer, module.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.random((96, 64)).astype(np.float32), rng.integers(0, 10, 96)
    before = np.array(model.layers[0].kernel.numpy() if api == "keras" else model.layers[0].kernel.numpy())
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0).history
    topk = tf_topk.adapter.find_topk_optimizer(model.optimizer)
    return history["loss"], topk, before, model.layers[0].kernel.numpy()


@pytest.mark.parametrize("api", ["keras", "tf_keras"])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("setting", [dict(policy="mixed_float16"), dict(policy="mixed_bfloat16"),
                                     dict(floatx="float16"), dict(floatx="float64")],
                         ids=lambda setting: next(iter(setting.values())))
def test_decoupled_momentum_trains_under_every_precision(api, replicas, setting):
    with precision(api, **setting):
        losses, topk, before, after = fit(api, replicas)
    assert all(np.isfinite(losses))
    assert isinstance(topk.exchange.memory, DecoupledMomentumMemory)
    assert topk.exchange.memory.residuals[0].dtype in (tf.float32, tf.float64)  # float16 momenta would drown
    moved = np.abs(after.astype(np.float64) - before.astype(np.float64))
    assert np.mean(moved > 0) > 0.9  # every entry of the kernel moved by the sign step, whatever its dtype
    assert after.dtype == np.dtype(setting.get("floatx", "float32"))  # under a mixed policy, float32 variables
    if setting.get("floatx") == "float64":
        assert topk.exchange.memory.residuals[0].dtype == tf.float64


@pytest.mark.parametrize("api", ["keras", "tf_keras"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_the_chunk_route_trains_under_mixed_precision(api, replicas):
    """exchange_mode="allgather_chunk" under the mixed_float16 policy (Keras's LossScaleOptimizer outside the
    wrapper), on one device and on two replicas: finite losses, every entry of the kernel moved."""
    with precision(api, policy="mixed_float16"):
        losses, topk, before, after = fit(api, replicas, exchange_mode="allgather_chunk")
    assert all(np.isfinite(losses))
    assert topk.compression_stats()["exchange_mode"] == 5.0
    assert np.mean(np.abs(after.astype(np.float64) - before.astype(np.float64)) > 0) > 0.9
