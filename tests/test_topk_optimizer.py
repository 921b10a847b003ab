"""TopKOptimizer and SparseExchange in one process (one replica): algorithm, state, serialization."""

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from digits_models import digits, mlp
from multiworker import PYTHON, subprocess_env

import tf_topk
from tf_topk.config import ExchangeConfig
from tf_topk.keras.callbacks import CompressionStats
from tf_topk.memory import ErrorFeedbackMemory
from tf_topk.selector import RandomKSelector


def compile_fit(model, optimizer, x, y, epochs=2, **fit_kwargs):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model.fit(x, y, epochs=epochs, batch_size=64, verbose=0, shuffle=False, **fit_kwargs)


@pytest.mark.slow
def test_density_one_reproduces_the_inner_optimizer():
    """All entries selected: no residual, the same updates as the plain optimizer."""
    x, y = digits()
    dense, sparse = mlp(), mlp()
    compile_fit(dense, keras.optimizers.SGD(0.1), x, y)
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=1.0, method="exact", min_size=1)
    compile_fit(sparse, opt, x, y)
    for a, b in zip(dense.get_weights(), sparse.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert all(float(tf.reduce_max(tf.abs(r.value))) == 0.0 for r in opt.residuals)


@pytest.mark.slow
def test_embedding_gradients_indexed_slices_match_dense_at_density_one():
    keras.utils.set_random_seed(1)
    tokens = np.random.default_rng(0).integers(0, 500, size=(256, 8)).astype("int32")
    labels = (tokens[:, 0] % 2).astype("int32")

    def model():
        keras.utils.set_random_seed(2)
        return keras.Sequential([keras.Input((8,), dtype="int32"), keras.layers.Embedding(500, 16),
                                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])

    dense, sparse = model(), model()
    compile_fit(dense, keras.optimizers.SGD(0.5), tokens, labels)
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.5), density=1.0, method="exact", min_size=1)
    compile_fit(sparse, opt, tokens, labels)
    for a, b in zip(dense.get_weights(), sparse.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_sparse_training_learns_and_error_feedback_keeps_the_rest():
    x, y = digits()
    model = mlp()
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.3), density=0.01, density_warmup_steps=0)  # 0.01 throughout
    history = compile_fit(model, opt, x, y, epochs=6, callbacks=[CompressionStats(logs="all")])
    assert history.history["loss"][-1] < 0.6 * history.history["loss"][0]
    stats = opt.compression_stats()
    assert stats["density"] == pytest.approx(math.ceil(0.01 * 64 * 128) / (64 * 128), rel=1e-6)
    assert 0 < stats["contraction"] < stats["random_k_bound"] < 1
    assert history.history["topk_residual_norm"][-1] > 0  # what was not sent is kept
    assert len(opt.residuals) == 1  # the 64x128 kernel; the 128x10 kernel and biases are below min_size


@pytest.mark.slow
def test_non_finite_step_is_skipped_without_touching_residuals_or_weights():
    model = mlp()
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.05, min_size=100)
    x, y = digits(128)
    compile_fit(model, opt, x, y, epochs=1)
    weights = [w.numpy().copy() for w in model.trainable_variables]
    residuals = [r.numpy().copy() for r in opt.residuals]
    iterations = int(opt.iterations.numpy())
    bad = [tf.fill(v.shape, np.nan) if i == 0 else tf.ones(v.shape) for i, v in enumerate(model.trainable_variables)]
    tf.function(lambda: opt.apply(bad, model.trainable_variables))()
    assert int(opt.skipped_steps.numpy()) == 1
    assert int(opt.iterations.numpy()) == iterations
    for before, variable in zip(weights, model.trainable_variables):
        np.testing.assert_array_equal(before, variable.numpy())
    for before, residual in zip(residuals, opt.residuals):
        np.testing.assert_array_equal(before, residual.numpy())
    good = [tf.ones(v.shape) for v in model.trainable_variables]
    tf.function(lambda: opt.apply(good, model.trainable_variables))()
    assert int(opt.iterations.numpy()) == iterations + 1
    assert np.all(np.isfinite(opt.residuals[0].numpy()))


def test_variables_without_gradient_are_skipped():
    inputs = keras.Input((64,))
    used = keras.layers.Dense(10, name="used")(inputs)
    unused = keras.layers.Dense(5000, name="unused")  # built but not on the path to the loss
    unused.build((None, 64))
    model = keras.Model(inputs, used)
    variables = model.trainable_variables + unused.trainable_variables
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.1, min_size=10)
    x, y = digits(64)
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x))
    grads = tape.gradient(loss, variables)
    assert grads[-1] is None
    before = unused.kernel.numpy().copy()
    opt.apply(grads, variables)
    np.testing.assert_array_equal(before, unused.kernel.numpy())
    assert int(opt.iterations.numpy()) == 1


@pytest.mark.slow
def test_density_schedule_changes_k_with_the_step():
    x, y = digits(128)
    model = mlp()
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=[(0, 0.5), (2, 0.01)])
    densities = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: densities.append(opt.compression_stats()["density"]))
    compile_fit(model, opt, x, y, epochs=2, callbacks=[callback])
    assert densities[0] == pytest.approx(0.5) and densities[1] == pytest.approx(0.5)
    assert densities[2] == pytest.approx(math.ceil(0.01 * 8192) / 8192)


@pytest.mark.slow
def test_config_round_trip_and_keras_file_restores_residuals(tmp_path):
    x, y = digits(256)
    model = mlp()
    opt = tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), density=[(0, 0.1), (10, 0.01)],
                                method="exact", min_size=500, bucket_bytes=4096, momentum_correction=True,
                                variance_warmup_steps=2)
    compile_fit(model, opt, x, y)
    assert opt.momentum_correction  # Adam's, asked for
    config = opt.get_config()
    clone = tf_topk.TopKOptimizer.from_config(config)
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    assert clone.get_config() == config
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, tf_topk.TopKOptimizer)
    assert loaded.optimizer.density == [(0, 0.1), (10, 0.01)] and loaded.optimizer.method == "exact"
    np.testing.assert_array_equal(loaded.optimizer.residuals[0].numpy(), opt.residuals[0].numpy())
    assert float(np.abs(opt.residuals[0].numpy()).sum()) > 0
    loaded.fit(x, y, epochs=1, batch_size=64, verbose=0)  # and training continues


@pytest.mark.slow
def test_checkpoint_restores_residuals(tmp_path):
    x, y = digits(256)
    model = mlp()
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01)
    compile_fit(model, opt, x, y, epochs=1)
    saved = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    other = mlp(seed=5)
    other_opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01)
    other_opt.build(other.trainable_variables)
    tf.train.Checkpoint(model=other, optimizer=other_opt).restore(saved).assert_existing_objects_matched()
    np.testing.assert_array_equal(other_opt.residuals[0].numpy(), opt.residuals[0].numpy())


@pytest.mark.parametrize("kwargs,message", [
    (dict(density=0.0), r"density must be in \(0, 1\], got 0.0"),
    (dict(density=1.5), r"density must be in \(0, 1\], got 1.5"),
    (dict(density="high"), r"density must be a float"),
    (dict(density=[(5, 0.1)]), r"must start at step 0"),
    (dict(density=[(0, 0.1), (0, 0.01)]), r"steps must increase"),
    (dict(method="median"), r"method must be one of \('gaussian', 'exact'\), got 'median'"),
    (dict(min_size=0), r"min_size must be an int >= 1, got 0"),
    (dict(bucket_bytes=3), r"bucket_bytes must be None or an int >= 8, got 3"),
    (dict(exchange_mode="ring"),
     r"exchange_mode must be one of \('auto', 'allgather', 'allreduce', 'dense_bf16', 'allgather_int8', 'allgather_chunk'\), got 'ring'"),
    (dict(local_clipnorm=0.0), r"local_clipnorm must be None or a finite float > 0, got 0.0"),
    (dict(config=ExchangeConfig(density=0.01), density=2.0), r"density must be in \(0, 1\], got 2.0"),
])
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    # The same checks, ExchangeConfig's, when a saved config carries the bad value.
    config = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1)).get_config()
    config.update({name: value for name, value in kwargs.items() if name != "config"})
    with pytest.raises(ValueError, match=message):
        tf_topk.TopKOptimizer.from_config(config)


# -- the exchange config -----------------------------------------------------------------------------


def test_exchange_config_round_trips_through_get_config_json_and_from_config():
    config = ExchangeConfig(density=[(0, 0.1), (10, 0.01)], method="exact", min_size=500, bucket_bytes=4096,
                            momentum_masking=True, local_clipnorm=5.0, exchange_mode="auto")
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), config=config,
                                momentum_correction=True)
    # The wrapper resolves decoupled_momentum="auto" from the inner optimizer (SGD: off).
    assert opt.exchange_config == config.replace(momentum=0.9, nesterov=True, decoupled_momentum=False)
    written = opt.get_config()
    # Flat keys, as earlier versions wrote them, plus the field they had no key for;
    # momentum and nesterov are the inner SGD's, so only momentum_correction is written.
    assert written["density"] == [[0, 0.1], [10, 0.01]] and written["exchange_mode"] == "auto"
    assert written["momentum_correction"] is True and written["sparse_updates"] is False
    assert written["momentum_masking"] is True  # not the default: a loaded config keeps it
    assert not {"momentum", "nesterov", "sparse_output", "config"} & set(written)
    clone = tf_topk.TopKOptimizer.from_config(json.loads(json.dumps(written)))
    assert clone.exchange_config == opt.exchange_config
    assert clone.get_config() == written
    assert isinstance(clone.inner_optimizer, keras.optimizers.SGD) and clone.inner_optimizer.nesterov is True


@pytest.mark.parametrize("new_keys", [True, False], ids=["flat_keys", "before_exchange_mode"])
def test_config_written_by_an_earlier_version_still_loads(new_keys):
    """Earlier versions wrote each option as a flat key (no momentum_masking: they
    masked, and resume masking; no density_warmup_steps: they ran no warm-up, and
    resume without one; no decoupled_step_scale: a sign step of the rate), and
    before that also without exchange_mode and sparse_updates."""
    old = {"name": "topk_optimizer", "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
           "clipvalue": None, "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
           "loss_scale_factor": None, "gradient_accumulation_steps": None,
           "inner_optimizer": keras.saving.serialize_keras_object(keras.optimizers.SGD(0.05, momentum=0.9)),
           "density": [[0, 0.1], [10, 0.01]], "method": "exact", "min_size": 500, "bucket_bytes": 4096,
           "error_feedback": True, "momentum_correction": True, "local_clipnorm": 5.0}
    if new_keys:
        old.update(exchange_mode="auto", sparse_updates=True)
    opt = tf_topk.TopKOptimizer.from_config(json.loads(json.dumps(old)))
    assert opt.exchange_config == ExchangeConfig(
        density=[(0, 0.1), (10, 0.01)], method="exact", min_size=500, bucket_bytes=4096, momentum=0.9,
        local_clipnorm=5.0, exchange_mode="auto" if new_keys else "allgather", sparse_output=new_keys,
        momentum_masking=True, density_warmup_steps=0, decoupled_momentum=False, decoupled_step_scale=1.0)
    assert opt.momentum_correction and opt.sparse_updates is new_keys and opt.density == [(0, 0.1), (10, 0.01)]
    written = opt.get_config()
    assert {name: written[name] for name in old} == old and written["momentum_masking"] is True


def test_arguments_given_replace_config_fields_and_the_rest_come_from_config():
    config = ExchangeConfig(density=0.01, method="exact", min_size=100, exchange_mode="auto", sparse_output=True)
    # method="gaussian" is the default value, but given: it replaces config's "exact".
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), config=config, density=0.05, method="gaussian",
                                sparse_updates=False)
    assert opt.exchange_config == ExchangeConfig(density=0.05, method="gaussian", min_size=100, exchange_mode="auto",
                                                 decoupled_momentum=False)  # "auto" resolved: SGD
    assert (opt.density, opt.method, opt.min_size, opt.exchange_mode, opt.sparse_updates) == (
        0.05, "gaussian", 100, "auto", False)
    assert config.density == 0.01 and config.sparse_output  # the given config is left as it was
    plain = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), config=config)
    assert plain.exchange_config == config.replace(decoupled_momentum=False) and plain.sparse_updates is True
    with pytest.raises(AttributeError):
        plain.density = 0.5  # read-only: the exchange is made from exchange_config


def test_momentum_in_the_config_is_the_inner_sgds():
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    implied = tf_topk.TopKOptimizer(inner, config=ExchangeConfig(momentum=0.9))
    assert implied.momentum_correction and implied._inner_overrides["momentum"] == 0.0
    cleared = tf_topk.TopKOptimizer(inner, config=ExchangeConfig(momentum=0.9), momentum_correction=False)
    assert cleared.exchange_config.momentum is None and "momentum" not in cleared._inner_overrides
    for config, kwargs in [(ExchangeConfig(momentum=0.5), {}),
                           (ExchangeConfig(momentum=0.5), dict(momentum_correction=True)),
                           (ExchangeConfig(momentum=0.9, nesterov=True), {})]:
        with pytest.raises(ValueError, match=r"but the inner SGD has momentum=0.9, nesterov=False: .* takes the "
                                             r"inner SGD's momentum"):
            tf_topk.TopKOptimizer(inner, config=config, **kwargs)
    with pytest.raises(ValueError, match=r"needs a keras.optimizers.SGD with momentum > 0, Adam or AdamW .*got RMSprop"):
        tf_topk.TopKOptimizer(keras.optimizers.RMSprop(0.1), config=ExchangeConfig(momentum=0.9))
    with pytest.raises(ValueError, match=r"config has momentum=0.9, nesterov=False, beta_2=None, epsilon=1e-07, "
                                         r"but the inner Adam has momentum=0.9, nesterov=False, beta_2=0.999, "
                                         r"epsilon=1e-07: .* takes the inner Adam's"):
        tf_topk.TopKOptimizer(keras.optimizers.Adam(0.1), config=ExchangeConfig(momentum=0.9))
    with pytest.raises(ValueError, match=r"needs error_feedback=True"):
        tf_topk.TopKOptimizer(inner, config=ExchangeConfig(error_feedback=False), momentum_correction=True)
    with pytest.raises(TypeError, match=r"config must be a tf_topk.ExchangeConfig, got \{'density': 0.01\}"):
        tf_topk.TopKOptimizer(inner, config={"density": 0.01})


@pytest.mark.slow
def test_parts_reach_the_exchange_and_are_not_serialized():
    x, y = digits(128)
    model = mlp()
    selector, memory = RandomKSelector(), ErrorFeedbackMemory()
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.05, method="exact", min_size=100,
                                exchange_mode="auto", local_clipnorm=5.0, selector=selector, memory=memory)
    compile_fit(model, opt, x, y, epochs=1)
    assert opt.exchange.selector is selector and opt.exchange.memory is memory
    assert opt.exchange.config == opt.exchange_config  # every option reached the exchange with the parts
    # The memory's residuals are this optimizer's variables (saved with it), and hold what was not sent.
    assert opt.residuals and all(any(r is v for v in opt.variables) for r in opt.residuals)
    assert float(np.abs(opt.residuals[0].numpy()).sum()) > 0
    with pytest.raises(NotImplementedError, match=r"cannot describe the exchange parts given to it \(selector="
                                                  r"RandomKSelector\(\), memory=.*save weights or a checkpoint"):
        opt.get_config()
    with pytest.raises(ValueError, match=r"memory=.* would replace: pass one or the other"):
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), momentum_correction=True,
                              memory=ErrorFeedbackMemory())


def test_a_router_reaches_the_exchange():
    router = tf_topk.routes.AutoRouter()
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.1, min_size=100, router=router)
    opt.build(mlp().trainable_variables)
    assert opt.exchange.router is router


@pytest.mark.parametrize("argument", [dict(clipnorm=1.0), dict(weight_decay=0.01), dict(use_ema=True),
                                      dict(gradient_accumulation_steps=4)])
def test_arguments_of_the_inner_optimizer_are_refused_not_ignored(argument):
    (name, value), = argument.items()
    with pytest.raises(ValueError, match=rf"does not take `{name}` \(got {value!r}\): set it on the inner optimizer"):
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), **argument)
    with pytest.raises(ValueError, match=r"unexpected arguments: momentum"):
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), momentum=0.9)


def test_inner_must_be_a_keras_optimizer():
    with pytest.raises(ValueError, match=r"inner_optimizer must be a keras.optimizers.Optimizer.*'sgd'"):
        tf_topk.TopKOptimizer("sgd")
    with pytest.raises(ValueError, match=r"already a TopKOptimizer"):
        tf_topk.TopKOptimizer(tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1)))


@pytest.mark.slow
def test_loss_scale_optimizer_inside_is_refused_and_goes_outside():
    """Inside, its inner optimizer would sum the exchanged gradients again (updates x replicas)."""
    message = (r"does not take a LossScaleOptimizer as `inner_optimizer` \(got LossScaleOptimizer\).*"
               r"Put the LossScaleOptimizer outside: keras.mixed_precision.LossScaleOptimizer\(tf_topk.TopKOptimizer")
    with pytest.raises(ValueError, match=message):
        tf_topk.TopKOptimizer(keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1)), density=0.1)
    config = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.1).get_config()
    config["inner_optimizer"] = keras.saving.serialize_keras_object(
        keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    with pytest.raises(ValueError, match=message):
        tf_topk.TopKOptimizer.from_config(config)
    # The order the message names: one step in a custom loop, as the plain SGD would take it.
    model = mlp()
    opt = keras.mixed_precision.LossScaleOptimizer(
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=1.0, min_size=1), initial_scale=8.0)
    before = [v.numpy().copy() for v in model.trainable_variables]
    grads = [tf.ones(v.shape) for v in model.trainable_variables]
    tf.function(lambda: opt.apply([g * 8.0 for g in grads], model.trainable_variables))()
    assert int(opt.iterations.numpy()) == 1
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_allclose(v.numpy(), b - 0.1, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_mixed_precision_single_process_trains():
    x, y = digits(256)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp()
        opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.3), density=0.05)
        history = compile_fit(model, opt, x, y, epochs=4)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert model.optimizer.inner_optimizer is opt
        assert history.history["loss"][-1] < history.history["loss"][0]
        assert opt.residuals[0].dtype == "float32"
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_keras_model_compiled_with_xla_is_refused_with_the_fix():
    x, y = digits(64)
    model = mlp()
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    with pytest.raises(tf.errors.UnimplementedError, match=r"model.compile\(..., jit_compile=False\)"):
        model.fit(x, y, epochs=1, verbose=0)


def test_exchange_outside_a_replica_context_is_an_error():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        variable = tf.Variable(tf.zeros([10]))
        exchange = tf_topk.SparseExchange([variable], density=0.5, min_size=1)
        with pytest.raises(RuntimeError, match="replica context"):
            exchange([tf.ones([10])])


@pytest.mark.slow
def test_inner_optimizer_is_left_as_given_and_all_reduces_when_reused(tmp_path):
    """Two replicas (MirroredStrategy over two logical CPUs, in a fresh
    process): TopKOptimizer(SGD) at density 1 updates as SGD alone does
    (the inner all-reduce is off while it applies), and the same SGD
    instance, used alone afterwards, all-reduces again (same update as a
    fresh SGD, not half of it)."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras, tf_topk
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
        with strategy.scope():
            keras.utils.set_random_seed(1)
            layer = keras.layers.Dense(3, use_bias=False)
            layer.build((None, 8))
            inner = keras.optimizers.SGD(0.1)
            topk = tf_topk.TopKOptimizer(inner, density=1.0, method="exact", min_size=1)
            topk.build(layer.trainable_variables)  # builds the inner optimizer too

        def update_ratio(optimizer):
            # Each replica has two of the four rows; loss = sum of squares / 4, so the
            # all-reduced gradient is 0.5 * x^T x W and SGD moves W by -0.1 times it.
            before = layer.kernel.numpy().copy()
            expected = -0.1 * 0.5 * x.T @ (x @ before)

            def replica_step():
                r = tf.distribute.get_replica_context().replica_id_in_sync_group
                xs = tf.gather(tf.constant(x), tf.stack([2 * r, 2 * r + 1]))
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(tf.reduce_sum(layer(xs) ** 2, axis=1), global_batch_size=4)
                optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)

            tf.function(lambda: strategy.run(replica_step))()
            return float(np.abs(layer.kernel.numpy() - before).sum() / np.abs(expected).sum())

        print("topk", update_ratio(topk))
        print("restored", "_all_reduce_sum_gradients" not in vars(inner))
        print("reused", update_ratio(inner))
    """)
    env = subprocess_env()
    proc = subprocess.run([*PYTHON, "-c", code], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = dict(line.split(" ", 1) for line in proc.stdout.splitlines()
                   if line.split(" ")[0] in ("topk", "restored", "reused"))
    assert abs(float(results["topk"]) - 1.0) < 1e-5, results
    assert results["restored"] == "True", results
    assert abs(float(results["reused"]) - 1.0) < 1e-5, results


def test_loss_scale_fix_is_a_logged_no_op_where_keras_does_not_fit(monkeypatch, caplog):
    from tf_topk.keras import loss_scale_fix

    assert loss_scale_fix.apply_loss_scale_fix() is True
    monkeypatch.setattr(keras, "__version__", "4.0.0")
    with caplog.at_level("WARNING"):
        assert loss_scale_fix.apply_loss_scale_fix() is False
    assert "not Keras 3" in caplog.text
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    monkeypatch.delattr(keras.optimizers.LossScaleOptimizer, "check_finite")
    with caplog.at_level("WARNING"):
        assert loss_scale_fix.apply_loss_scale_fix() is False
    assert "has no check_finite" in caplog.text


# -- sparse updates ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("momentum_correction", [False, True])
def test_sparse_updates_give_the_dense_update(momentum_correction):
    """One replica: variable -= lr * pairs is the dense SGD update exactly, plain or with
    momentum correction; the small variables still go through the inner SGD."""
    x, y = digits(256)
    runs = []
    for sparse_updates in (False, True):
        keras.utils.set_random_seed(0)
        model = mlp()
        inner = keras.optimizers.SGD(0.1, momentum=0.9 if momentum_correction else 0.0)
        opt = tf_topk.TopKOptimizer(inner, density=0.05, min_size=100, momentum_correction=momentum_correction,
                                    sparse_updates=sparse_updates)
        compile_fit(model, opt, x, y, epochs=2)
        runs.append(([w.numpy() for w in model.trainable_variables], int(opt.iterations.numpy())))
    (dense, dense_steps), (sparse, sparse_steps) = runs
    assert dense_steps == sparse_steps == 8
    for a, b in zip(dense, sparse):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("exchange_mode", ["allreduce", "auto", "allgather"])
def test_sparse_updates_of_embeddings_sharing_a_bucket_on_two_replicas(exchange_mode, tmp_path):
    """Two Embedding tables of different sizes in one bucket, 2 replicas
    (MirroredStrategy over logical CPUs, a fresh process), sparse updates:
    most rows get no gradient, so the agreed index set has spare slots, which
    must point inside their own table (they once came back as -offset and
    fit failed). Replicas stay identical, and the weights match the
    dense-update run's."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import sys
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras, tf_topk
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        rng = np.random.default_rng(0)
        x = np.stack([rng.integers(0, 40, 64), rng.integers(0, 3, 64)], axis=1).astype("int32")  # 3 rows: 48 < k = 112
        y = rng.standard_normal((64, 1)).astype("float32")

        def fit(sparse_updates):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                ids = keras.Input((2,), dtype="int32")
                a = keras.layers.Embedding(1000, 16)(ids[:, 0])
                b = keras.layers.Embedding(700, 16)(ids[:, 1])
                model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
                model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01, min_size=1000,
                                                              exchange_mode=sys.argv[1], sparse_updates=sparse_updates),
                              loss="mse")
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            return [strategy.experimental_local_results(w.value) for w in model.trainable_variables]

        sparse, dense = fit(True), fit(False)
        for s, d in zip(sparse, dense):
            np.testing.assert_array_equal(s[0].numpy(), s[1].numpy())  # replicas identical
            # The pairs applied one replica's row at a time round differently from their dense sum.
            np.testing.assert_allclose(s[0].numpy(), d[0].numpy(), rtol=1e-5, atol=1e-7)
        keras.utils.set_random_seed(0)
        untrained = keras.layers.Embedding(1000, 16)
        untrained.build((None,))
        assert not np.allclose(sparse[0][0].numpy(), untrained.embeddings.numpy())  # it trained
        print("ok")
    """)
    env = subprocess_env()
    proc = subprocess.run([*PYTHON, "-c", code, exchange_mode], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_sparse_updates_round_trip_in_the_config_and_respect_constraints():
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), sparse_updates=True)
    assert tf_topk.TopKOptimizer.from_config(opt.get_config()).sparse_updates is True
    inputs = keras.Input((64,))
    outputs = keras.layers.Dense(128, kernel_constraint=keras.constraints.NonNeg())(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(outputs))
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0), density=0.5, min_size=100, sparse_updates=True)
    x, y = digits(64)
    compile_fit(model, opt, x, y, epochs=1)
    assert model.layers[1].kernel.numpy().min() >= 0.0


@pytest.mark.parametrize("inner,kwargs,message", [
    (lambda: keras.optimizers.Adam(), {}, r"needs a keras.optimizers.SGD as inner optimizer .* got Adam"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), {}, r"without momentum \(got momentum=0.9\)"),
    (lambda: keras.optimizers.SGD(0.1, weight_decay=1e-4), {}, r"weight_decay=0.0001 would be ignored"),
    (lambda: keras.optimizers.SGD(0.1, clipnorm=1.0), {}, r"clipnorm=1.0 would be ignored"),
])
def test_sparse_updates_refuse_what_plain_sgd_on_the_pairs_would_ignore(inner, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tf_topk.TopKOptimizer(inner(), sparse_updates=True, **kwargs)


def test_a_multi_optimizer_is_refused_inside_and_sparsifies_around_it():
    """Inside, a MultiOptimizer's sub-optimizers would send every gradient dense, silently: refused by name.
    Around one of its sub-optimizers, the wrapper sparsifies that sub-optimizer's variables."""
    with pytest.raises(ValueError, match="does not take a keras.optimizers.MultiOptimizer as inner_optimizer"):
        tf_topk.TopKOptimizer(keras.optimizers.MultiOptimizer(lambda variable: keras.optimizers.SGD(0.1)))
    topk = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), density=0.01, density_warmup_steps=0)
    sgd = keras.optimizers.SGD(0.1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128), keras.layers.Dense(10)])
    model.compile(keras.optimizers.MultiOptimizer(lambda variable: topk if "kernel" in variable.path else sgd),
                  "mse", jit_compile=False)
    model.fit(np.ones((32, 64), np.float32), np.zeros((32, 10), np.float32), epochs=1, verbose=0)
    assert topk.compression_stats()["density"] == pytest.approx(0.01, abs=1e-4)  # the 64x128 kernel
    assert topk.decoupled_momentum is True
