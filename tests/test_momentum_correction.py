"""Momentum correction (DGC) in one process: the memory's rule, the Keras wrapper, its state.

The rule across two replicas, with masking, Nesterov and local clipping, is
pinned against numpy in tests/test_exchange.py; two real workers in
tests/test_multiworker_topk.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from digits_models import digits, mlp

import tf_topk
from tf_topk.memory import MomentumCorrectionMemory, make_state_variable


def compile_fit(model, optimizer, x, y, epochs=2):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model.fit(x, y, epochs=epochs, batch_size=64, verbose=0, shuffle=False)


# -- the memory -------------------------------------------------------------------------------

@pytest.mark.parametrize("masking", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_memory_follows_dgc_and_a_step_not_kept_changes_nothing(nesterov, masking):
    memory = MomentumCorrectionMemory(0.8, nesterov=nesterov, masking=masking)
    memory.build([tf.Variable(tf.zeros([200]))], make_state_variable)
    (residual,), (velocity,) = memory.residuals, memory.velocities
    rng = np.random.default_rng(3)
    u, v, k = np.zeros(200, np.float32), np.zeros(200, np.float32), 10
    for step in range(5):
        grad = rng.standard_normal(200).astype(np.float32)
        keep = step != 3  # step 3: as if a replica had a NaN
        before = velocity.numpy().copy(), residual.numpy().copy()
        compensation = memory.compensate(0, tf.constant(grad))
        selection = tf_topk.error_feedback_topk(compensation.gradient, compensation.residual, k, method="exact")
        accumulated = compensation.gradient + compensation.residual
        if keep:  # the exchange updates the memory only on a kept step
            memory.update(0, compensation, selection.remaining, selection.values, selection.indices)
        else:
            np.testing.assert_array_equal(velocity.numpy(), before[0])
            np.testing.assert_array_equal(residual.numpy(), before[1])
            continue
        u_new = 0.8 * (u + grad) if nesterov else 0.8 * u + grad
        acc = v + u_new + (grad if nesterov else 0.0)
        np.testing.assert_allclose(accumulated.numpy(), acc, rtol=1e-6, atol=1e-6)
        sent = np.zeros(200, bool)
        sent[np.argsort(-np.abs(acc), kind="stable")[:k]] = True
        v = np.where(sent, 0.0, acc).astype(np.float32)
        u = np.where(sent, 0.0, u_new).astype(np.float32) if masking else u_new
        np.testing.assert_allclose(residual.numpy(), v, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(velocity.numpy(), u, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_with_the_default_no_masking_is_keras_momentum_sgd(nesterov):
    """Everything sent and no masking (the default): momentum correction reduces to
    momentum SGD, the exchange's velocity (gradient units) against Keras's
    (learning-rate units)."""
    shapes = [(64, 80), (10,)]  # one sparsified, one on the dense path
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(6)]
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    keras_vars = [keras.Variable(w) for w in start]
    reference = keras.optimizers.SGD(0.05, momentum=0.9, nesterov=nesterov)
    ours_vars = [tf.Variable(w) for w in start]
    exchange = tf_topk.SparseExchange(ours_vars, density=1.0, method="exact", min_size=1000, momentum=0.9,
                                      nesterov=nesterov)
    assert exchange.config.momentum_masking is False
    plain = keras.optimizers.SGD(0.05)
    for step_grads in grads:
        reference.apply([tf.constant(g) for g in step_grads], keras_vars)
        result = exchange([tf.constant(g) for g in step_grads])
        plain.apply(result.grads, ours_vars)
    for a, b in zip(keras_vars, ours_vars):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5)
    assert exchange.sparse_positions == [0] and exchange.dense_positions == [1]


def test_masking_leaves_an_entry_sent_every_step_no_momentum():
    """Why masking is off by default: DGC's momentum factor masking zeroes the velocity
    wherever an entry is sent, so an entry sent every step trains by plain SGD."""
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(2000).astype(np.float32) for _ in range(4)]
    finals = {}
    for masking in (False, True):
        variable = tf.Variable(tf.zeros([2000]))
        exchange = tf_topk.SparseExchange([variable], density=1.0, method="exact", min_size=1000, momentum=0.9,
                                          momentum_masking=masking)
        for grad in grads:
            variable.assign_sub(0.1 * exchange([tf.constant(grad)]).grads[0])
        finals[masking] = variable.numpy()
    np.testing.assert_allclose(finals[True], -0.1 * sum(grads), rtol=1e-5, atol=1e-5)  # no momentum at all
    velocity, with_momentum = np.zeros(2000, np.float32), np.zeros(2000, np.float32)
    for grad in grads:
        velocity = 0.9 * velocity + grad
        with_momentum -= 0.1 * velocity
    np.testing.assert_allclose(finals[False], with_momentum, rtol=1e-5, atol=1e-5)


def test_local_clipping_scales_the_gradients_to_the_norm():
    variable = tf.Variable(tf.zeros([5000]))
    exchange = tf_topk.SparseExchange([variable], density=1.0, method="exact", min_size=16, local_clipnorm=2.0)
    grad = np.full(5000, 0.1, np.float32)  # norm 7.07
    sent = exchange([tf.constant(grad)]).grads[0].numpy()
    np.testing.assert_allclose(np.linalg.norm(sent), 2.0, rtol=1e-5)
    small = exchange([tf.constant(grad / 100)]).grads[0].numpy()
    np.testing.assert_allclose(small, grad / 100, rtol=1e-6)  # under the norm: untouched


@pytest.mark.parametrize("kwargs,message", [
    (dict(momentum=1.0), r"momentum must be a float in \(0, 1\), got 1.0"),
    (dict(momentum="0.9"), r"momentum must be a float in \(0, 1\), got '0.9'"),
    (dict(momentum=0.9, error_feedback=False), "needs error_feedback=True"),
    (dict(nesterov=True), "nesterov=True needs momentum"),
    (dict(local_clipnorm=0.0), r"local_clipnorm must be None or a finite float > 0, got 0.0"),
    (dict(local_clipnorm=float("inf")), "local_clipnorm must be None or a finite float > 0, got inf"),
])
def test_exchange_refuses_bad_momentum_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tf_topk.SparseExchange([tf.Variable(tf.zeros([5000]))], min_size=16, **kwargs)


# -- the Keras wrapper ------------------------------------------------------------------------

@pytest.mark.parametrize("inner,message", [
    (lambda: keras.optimizers.RMSprop(0.01), "needs a keras.optimizers.SGD with momentum > 0, Adam or AdamW .*got RMSprop"),
    (lambda: keras.optimizers.SGD(0.1), "got SGD with momentum=0.0"),
])
def test_momentum_correction_refuses_an_inner_optimizer_without_momentum(inner, message):
    with pytest.raises(ValueError, match=message):
        tf_topk.TopKOptimizer(inner(), density=0.01, momentum_correction=True)


def test_momentum_correction_refuses_no_error_feedback_and_a_bad_clipnorm():
    with pytest.raises(ValueError, match="needs error_feedback=True"):
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), momentum_correction=True,
                              error_feedback=False)
    with pytest.raises(ValueError, match="local_clipnorm must be None or a finite float > 0, got -1"):
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), local_clipnorm=-1)


def test_dense_path_only_equals_keras_momentum_sgd_so_the_inner_applies_no_second_momentum():
    """All variables below min_size: the exchange gives them momentum, the inner SGD must not."""
    x, y = digits()
    dense, ours = mlp(), mlp()
    compile_fit(dense, keras.optimizers.SGD(0.05, momentum=0.9), x, y)
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=0.01, min_size=10**6,
                                momentum_correction=True)
    compile_fit(ours, opt, x, y)
    for a, b in zip(dense.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_inner_sgd_is_left_as_given_and_velocities_are_optimizer_state():
    x, y = digits(256)
    inner = keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)
    opt = tf_topk.TopKOptimizer(inner, density=0.01, min_size=2000, momentum_correction=True)
    compile_fit(mlp(), opt, x, y, epochs=1)
    assert inner.momentum == 0.9 and inner.nesterov is True
    assert inner.momentums == []  # no momentum slots: the exchange holds the velocity
    assert opt.exchange.memory.nesterov and opt.exchange.memory.momentum == 0.9
    # 64x128 kernel sparsified; the 128x10 kernel and both biases on the dense path.
    assert len(opt.residuals) == 1 and len(opt.velocities) == 4
    assert all(v.path in {w.path for w in opt.variables} for v in opt.velocities)
    assert float(np.abs(opt.velocities[0].numpy()).sum()) > 0


def test_keras_file_and_checkpoint_restore_velocities(tmp_path):
    x, y = digits(256)
    model = mlp()
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=0.01, min_size=1000,
                                momentum_correction=True, local_clipnorm=5.0)
    compile_fit(model, opt, x, y, epochs=1)
    config = opt.get_config()
    assert config["momentum_correction"] is True and config["local_clipnorm"] == 5.0
    assert tf_topk.TopKOptimizer.from_config(config).get_config() == config
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.momentum_correction and loaded.optimizer.local_clipnorm == 5.0
    for a, b in zip(loaded.optimizer.velocities + loaded.optimizer.residuals, opt.velocities + opt.residuals):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    saved = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
    other = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=0.01, min_size=1000,
                                  momentum_correction=True)
    other.build(mlp(seed=3).trainable_variables)
    tf.train.Checkpoint(optimizer=other).restore(saved).assert_existing_objects_matched()
    for a, b in zip(other.velocities, opt.velocities):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.slow
def test_non_finite_step_leaves_velocities_as_they_were():
    x, y = digits(256)
    model = mlp()
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=0.01, min_size=1000,
                                momentum_correction=True)
    compile_fit(model, opt, x, y, epochs=1)
    before = [v.numpy().copy() for v in opt.velocities + opt.residuals]
    grads = [tf.fill(v.shape, np.nan) for v in model.trainable_variables]
    tf.function(lambda: opt.apply(grads, model.trainable_variables))()
    for b, v in zip(before, opt.velocities + opt.residuals):
        np.testing.assert_array_equal(v.numpy(), b)
    assert int(opt.skipped_steps.numpy()) == 1


@pytest.mark.slow
def test_mixed_precision_trains_with_momentum_correction():
    x, y = digits(256)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=0.05,
                                    momentum_correction=True)
        history = compile_fit(mlp(), opt, x, y, epochs=6)
        assert history.history["loss"][-1] < 0.75 * history.history["loss"][0]
        assert all(v.dtype == "float32" for v in opt.velocities)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
def test_momentum_correction_with_a_dgc_warmup_schedule_trains_better_than_plain_topk():
    """At density 0.001 with momentum 0.9, correction recovers what plain top-k loses."""
    x, y = digits(1024)
    steps_per_epoch = 1024 // 64
    losses = {}
    for name, correction in (("plain", False), ("corrected", True)):
        opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                    density=tf_topk.schedule.dgc_warmup(steps_per_epoch, epochs=2, final=0.001),
                                    min_size=1000, momentum_correction=correction)
        losses[name] = compile_fit(mlp(), opt, x, y, epochs=8).history["loss"][-1]
    assert losses["corrected"] < losses["plain"], losses
