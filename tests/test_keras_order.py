"""TopKOptimizer applies in Keras's own order: the inner optimizer's `apply` unscales (loss_scale_factor),
sets aside the variables it overwrites with their gradient (float8), clips, accumulates and decays, the
exchange takes the place of its cross-replica sum, then it updates and averages (EMA).

The options that act on a gradient are combined pairwise (every pair of values of two options in some
cell) and each cell is run against Keras alone, on one device and on two replicas (MirroredStrategy over
logical CPUs, eagerly, as Keras's own distribute tests run): at density 1.0 with every variable on the
top-k path, the weights, the overwritten variable and the EMA agree within 1e-6. Then each defect of the
order that a review found, with the numbers it measured.
"""

import functools
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

# Logical CPUs must exist before TensorFlow starts: made at import, as tests/test_exchange_matrix.py does.
try:
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 3)
except RuntimeError:  # TensorFlow already started: the test skips unless enough CPUs exist
    pass

import tf_topk  # noqa: E402
from pairwise import cell_id, pairwise  # noqa: E402

REPLICAS = 2
STEPS = 6
OPTIONS = {
    "loss_scale_factor": (None, 64.0),
    "clip": (None, "clipnorm", "clipvalue", "global_clipnorm"),
    "gradient_accumulation_steps": (None, 2),
    "overwritten": (False, True),
    "use_ema": (False, True),
    "schedule": (False, True),
}
CLIPPING = {None: {}, "clipnorm": {"clipnorm": 0.5}, "clipvalue": {"clipvalue": 0.05},
            "global_clipnorm": {"global_clipnorm": 0.7}}


@functools.cache
def two_replicas():
    """One MirroredStrategy for the module, with collective keys of its own: a second strategy of the
    same size would reuse the first one's collective instances ("Shape mismatch in the collective
    instance"), and one of another module would share its group."""

    class Strategy(tf.distribute.MirroredStrategy):
        _collective_key_base = 7_000_000

    return Strategy([f"/cpu:{i}" for i in range(REPLICAS)])


CELLS = pairwise(OPTIONS)


def make_inner(cell):
    """The cell's SGD. Its EMA overwrites the weights every 3 steps, except beside an overwritten
    variable, where Keras alone fails ("Attempt to convert a value (None)" in its overwrite's cond)."""
    rate = keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5) if cell["schedule"] else 0.1
    overwrite_frequency = 3 if cell["use_ema"] and not cell["overwritten"] else None
    return keras.optimizers.SGD(rate, momentum=0.5, loss_scale_factor=cell["loss_scale_factor"],
                                gradient_accumulation_steps=cell["gradient_accumulation_steps"],
                                use_ema=cell["use_ema"], ema_overwrite_frequency=overwrite_frequency,
                                **CLIPPING[cell["clip"]])


def make_variables(cell, kernel):
    size = int(np.prod(kernel))
    variables = [keras.Variable(np.linspace(-1.0, 1.0, size, dtype=np.float32).reshape(kernel), name="kernel"),
                 keras.Variable(np.full(3, 0.5, np.float32), name="bias")]
    if cell["overwritten"]:
        amax = keras.Variable(np.ones(4, np.float32), name="amax_history", trainable=True)
        amax.overwrite_with_gradient = True
        variables.append(amax)
    return variables


def gradients(cell, step, replica, kernel):
    """This replica's gradients at `step`, as `fit` hands them (scaled by the loss scale factor);
    some large enough to be clipped, the overwritten variable's a new value."""
    rng = np.random.default_rng(100 * step + replica)
    scale = cell["loss_scale_factor"] or 1.0
    grads = [rng.normal(0.0, 0.3 + step % 3, kernel).astype(np.float32) * scale,
             rng.normal(0.0, 0.2, 3).astype(np.float32) * scale]
    if cell["overwritten"]:
        grads.append((rng.uniform(0.5, 3.0, 4)).astype(np.float32))
    return grads


def run(cell, wrap, strategy=None, kernel=(6, 8)):
    """The variables (and the EMA) after STEPS steps of Keras alone (wrap None) or wrapped (wrap: the
    wrapper's options); the optimizer built first, as `fit` builds it."""
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        variables = make_variables(cell, kernel)
        optimizer = make_inner(cell)
        if wrap is not None:
            optimizer = tf_topk.TopKOptimizer(optimizer, **wrap)
        optimizer.build(variables)
    for step in range(STEPS):
        if strategy is None:
            optimizer.apply([tf.constant(g) for g in gradients(cell, step, 0, kernel)], variables)
        else:
            def replica_step():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                per_replica = [gradients(cell, step, r, kernel) for r in range(REPLICAS)]
                grads = [tf.gather(tf.constant(np.stack([g[i] for g in per_replica])), replica)
                         for i in range(len(per_replica[0]))]
                optimizer.apply(grads, variables)

            strategy.run(replica_step)
    inner = optimizer.inner_optimizer if wrap is not None else optimizer
    ema = [v.numpy() for v in inner._model_variables_moving_average if v is not None] if cell["use_ema"] else []
    return [v.numpy() for v in variables] + ema + [int(optimizer.iterations.numpy())], optimizer


def assert_same(wrapped, alone):
    assert len(wrapped) == len(alone)
    for a, b in zip(alone, wrapped):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)


EVERY_VARIABLE_TOPK = {"density": 1.0, "min_size": 1}


def strategy_of(replicas):
    if replicas == 1:
        return None
    strategy = two_replicas()
    if strategy.num_replicas_in_sync != REPLICAS:
        pytest.skip("TensorFlow started before this module made its logical CPUs")
    return strategy


@pytest.mark.parametrize("replicas", [1, REPLICAS], ids=["one device", "two replicas"])
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_inner_options_combined_act_as_keras(cell, replicas):
    strategy = strategy_of(replicas)
    assert_same(run(cell, EVERY_VARIABLE_TOPK, strategy)[0], run(cell, None, strategy)[0])


@pytest.mark.parametrize("replicas", [1, REPLICAS], ids=["one device", "two replicas"])
@pytest.mark.parametrize("cell", [c for c in CELLS if not c["use_ema"] and not c["gradient_accumulation_steps"]][:2]
                         + [c for c in CELLS if c["gradient_accumulation_steps"]][:1], ids=cell_id)
def test_the_default_acts_as_keras_where_it_plans_dense(cell, replicas):
    """The default (no density) on a kernel of min_size entries: the autopilot measures the replicas and
    plans. One device always plans dense; on two replicas what it plans is what this machine measured:
    dense must then equal Keras alone, and a plan that sends pairs must still train every cell."""
    strategy = strategy_of(replicas)
    kernel = (64, 80)  # 5,120 entries: above the default min_size, so the autopilot plans
    wrapped, optimizer = run(cell, {}, strategy, kernel)
    route = optimizer.exchange.autopilot_plan.dense_route()
    if replicas == 1:
        assert route == "dense"
    if route == "dense":
        assert_same(wrapped, run(cell, None, strategy, kernel)[0])
    else:
        assert all(np.isfinite(w).all() for w in wrapped[:-1]) and wrapped[-1] == run(cell, None, strategy, kernel)[0][-1]


def test_the_cells_cover_every_pair_of_option_values():
    names = list(OPTIONS)
    for a, b in itertools.combinations(names, 2):
        seen = {(cell[a], cell[b]) for cell in CELLS}
        assert seen == set(itertools.product(OPTIONS[a], OPTIONS[b])), (a, b)
    assert len(CELLS) < len(list(itertools.product(*OPTIONS.values()))) / 4


# -- the defects, each with its measured numbers ---------------------------------------------------

WRAPPINGS = {"density 1.0": {"density": 1.0}, "every variable top-k": EVERY_VARIABLE_TOPK, "default": {}}


def moved(optimizer, grads, steps=1, start=(0.0, 0.0)):
    variable = keras.Variable(np.array(start, np.float32))
    for grad in grads[:steps] if isinstance(grads[0], list) else [grads] * steps:
        optimizer.apply([tf.constant(grad, tf.float32)], [variable])
    return variable.numpy() - np.array(start, np.float32)


@pytest.mark.parametrize("wrapping", WRAPPINGS)
@pytest.mark.parametrize("clip", [{"clipnorm": 1.0}, {"clipvalue": 0.35}, {"global_clipnorm": 1.0}],
                         ids=lambda clip: next(iter(clip)))
def test_clipping_acts_on_the_unscaled_gradient(wrapping, clip):
    """A gradient of true norm 0.5 fed scaled by 1024: Keras moves by [0.3, -0.4] (unscaled, then not
    clipped by a norm of 1); the wrapper clipped the scaled gradient and moved by [0.000586, -0.000781]."""
    grad = [0.3 * 1024, -0.4 * 1024]
    alone = moved(keras.optimizers.SGD(1.0, loss_scale_factor=1024, **clip), grad)
    wrapped = moved(tf_topk.TopKOptimizer(keras.optimizers.SGD(1.0, loss_scale_factor=1024, **clip),
                                          **WRAPPINGS[wrapping]), grad)
    np.testing.assert_allclose(alone, [-0.3, 0.35 if "clipvalue" in clip else 0.4], atol=1e-6)
    np.testing.assert_allclose(wrapped, alone, atol=1e-6)


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_clipping_acts_once_on_the_accumulated_gradient(wrapping):
    """Micro-gradients [10, 0], [0, 0], [0, 0] with clipnorm=1: Keras clips their mean once and moves
    by [1, 0]; the wrapper clipped each micro-step and moved by [0.333, 0]."""
    grads = [[10.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    make = lambda: keras.optimizers.SGD(1.0, clipnorm=1.0, gradient_accumulation_steps=3)  # noqa: E731
    alone = moved(make(), grads, steps=3)
    wrapped = moved(tf_topk.TopKOptimizer(make(), **WRAPPINGS[wrapping]), grads, steps=3)
    np.testing.assert_allclose(alone, [-1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(wrapped, alone, atol=1e-6)


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_overwritten_variables_are_not_clipped_nor_counted_in_the_global_norm(wrapping):
    """float8's overwritten variable takes its gradient as it is (2.0, not 0.5 clipped) and stays out
    of the global norm (the real update 0.5, not 0.776)."""
    results = []
    for wrap in (None, WRAPPINGS[wrapping]):
        for clip in ({"clipnorm": 0.5}, {"global_clipnorm": 0.5}):
            overwritten = keras.Variable([0.0], name="amax")
            overwritten.overwrite_with_gradient = True
            trained = keras.Variable([0.0, 0.0], name="weight")
            optimizer = keras.optimizers.SGD(1.0, **clip)
            if wrap is not None:
                optimizer = tf_topk.TopKOptimizer(optimizer, **wrap)
            optimizer.apply([tf.constant([2.0]), tf.constant([0.3, 0.4])], [overwritten, trained])
            results.append((overwritten.numpy(), trained.numpy()))
    alone, wrapped = results[:2], results[2:]
    np.testing.assert_allclose(alone[0][0], [2.0])
    np.testing.assert_allclose(np.linalg.norm(alone[1][1]), 0.5, atol=1e-6)
    for (a_over, a_trained), (w_over, w_trained) in zip(alone, wrapped):
        np.testing.assert_allclose(w_over, a_over, atol=1e-6)
        np.testing.assert_allclose(w_trained, a_trained, atol=1e-6)


@pytest.mark.slow
def test_a_float8_model_trains_as_keras_with_clipping():
    """A float8-quantized MLP, 20 steps with global_clipnorm: every weight and amax history as Keras's
    (14 of 16 differed, amax histories off by up to 3.9)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 16)).astype(np.float32), rng.normal(size=(64, 4)).astype(np.float32)
    weights = []
    for wrap in (False, True):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
        model.quantize("float8")
        inner = keras.optimizers.SGD(0.05, global_clipnorm=0.5)
        model.compile(optimizer=tf_topk.TopKOptimizer(inner, density=1.0) if wrap else inner, loss="mse",
                      jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=5, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    assert len(weights[0]) > 6  # the amax histories and scales are among them
    for a, b in zip(*weights):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_skipped_step_changes_nothing_with_weight_decay_and_counts_no_iteration():
    """Keras decays before its update step; the wrapper decays in the branch taken only when every
    replica's gradient is finite, so a skipped step leaves the variables as they were."""
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.1, weight_decay=0.5), density=1.0, min_size=1)
    variables = [keras.Variable(np.ones(6, np.float32))]
    optimizer.apply([tf.fill([6], np.nan)], variables)
    np.testing.assert_array_equal(variables[0].numpy(), np.ones(6))
    assert int(optimizer.skipped_steps.numpy()) == 1 and int(optimizer.iterations.numpy()) == 0
    alone = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    reference = [keras.Variable(np.ones(6, np.float32))]
    alone.apply([tf.ones(6)], reference)
    optimizer.apply([tf.ones(6)], variables)
    np.testing.assert_allclose(variables[0].numpy(), reference[0].numpy(), atol=1e-6)
    assert int(optimizer.iterations.numpy()) == 1


# -- the rest of the review's findings -------------------------------------------------------------

@pytest.mark.slow
def test_adams_momentum_correction_trains_a_model_with_nothing_to_sparsify(capfd):
    """Every variable below min_size: the memory's step counter is never made, and the first step
    crashed ('NoneType' object has no attribute 'assign_add') after printing the correction's line."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), momentum_correction=True)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    x, y = np.ones((32, 8), np.float32), np.zeros((32, 4), np.float32)
    history = model.fit(x, y, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert optimizer.exchange.sparse_positions == []
    assert "momentum correction" not in capfd.readouterr().err


def ema_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="dense_1"),
                             keras.layers.Dense(1, name="dense_2")])


@pytest.mark.parametrize("around", ["loss scale optimizer", "multi optimizer"])
def test_swap_ema_weights_finds_the_inner_average_through_what_wraps_the_wrapper(around):
    """What `compile` builds under mixed_float16 (a LossScaleOptimizer around the wrapper), and a
    MultiOptimizer of wrappers: SwapEMAWeights raised; now it swaps as it does for Keras alone."""
    x = np.random.default_rng(0).random((64, 8), np.float32)
    y = x[:, :1] * 2.0
    results = []
    for wrap in (lambda o: o, lambda o: tf_topk.TopKOptimizer(o, density=1.0)):
        model = ema_model()
        if around == "loss scale optimizer":
            optimizer = keras.mixed_precision.LossScaleOptimizer(wrap(keras.optimizers.SGD(0.1, use_ema=True)))
        else:
            optimizer = keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
                default_optimizer=wrap(keras.optimizers.SGD(0.1)),
                optimizer_map={".*dense_1/.*": wrap(keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9))}))
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        model.fit(x, y, epochs=2, verbose=0, callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)])
        results.append([model.evaluate(x, y, verbose=0)] + model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    wrapper = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, use_ema=True), density=1.0)
    assert wrapper.use_ema and wrapper.get_config()["use_ema"] is False  # the inner one's, in its own config
    wrapper.build(ema_model().trainable_variables)
    assert wrapper._model_variables_moving_average is wrapper.inner_optimizer._model_variables_moving_average


def test_a_model_saved_before_training_with_a_schedule_loads_silently(tmp_path):
    """The load special-cased exactly 4 saved variables; with a learning-rate schedule an unbuilt
    optimizer has 3, and loading warned 'Skipping variable loading for optimizer'. Keras alone is silent."""
    import warnings

    for wrap in (False, True):
        inner = keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))
        model = ema_model()
        model.compile(optimizer=tf_topk.TopKOptimizer(inner, density=1.0) if wrap else inner, loss="mse")
        path = tmp_path / f"model_{wrap}.keras"
        model.save(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = keras.models.load_model(path)
        assert not [w for w in caught if "Skipping variable loading" in str(w.message)], wrap
        loaded.fit(np.ones((8, 8), np.float32), np.ones((8, 1), np.float32), verbose=0)


def test_the_wrappers_unused_iterations_and_learning_rate_are_not_its_variables_and_old_files_load():
    """Keras's constructor gives the wrapper an iterations (stuck at 0) and a learning rate (0.0):
    both the inner optimizer's in fact. They left `variables` and saved files; files that begin with
    them (earlier versions) still load."""
    variables = [keras.Variable(np.zeros((40, 50), np.float32)), keras.Variable(np.zeros(5, np.float32))]
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), density=0.01, min_size=100,
                                       density_warmup_steps=0)
    for step in range(3):
        optimizer.apply([tf.random.stateless_normal((40, 50), [step, 1]), tf.ones(5)], variables)
    assert not any(v is optimizer._iterations or v is optimizer._learning_rate for v in optimizer.variables)
    assert [v.path for v in optimizer.variables[-len(optimizer.inner_optimizer.variables):]] == \
        [v.path for v in optimizer.inner_optimizer.variables]
    saved = {}
    optimizer.save_own_variables(saved)
    assert len(saved) == len(optimizer.variables)
    earlier = {"0": np.int64(0), "1": np.float32(0.0), **{str(int(k) + 2): v for k, v in saved.items()}}
    for store in (saved, earlier):
        target = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), density=0.01, min_size=100,
                                        density_warmup_steps=0)
        target.build(variables)
        target.load_own_variables(store)
        assert int(target.iterations.numpy()) == 3
        for a, b in zip(optimizer.variables, target.variables):
            np.testing.assert_array_equal(b.numpy(), a.numpy())


def test_a_constraint_acts_once_a_step_with_adams_momentum_correction():
    """Adam's momentum correction applies the sparsified variables' update itself; Keras's own apply
    then constrains every variable, so the correction no longer constrains them a second time (a
    constraint that is not a projection would act twice)."""
    calls = []

    def counted(value):
        calls.append(1)
        return value * 0.5

    variable = keras.Variable(np.ones(5000, np.float32))
    variable.constraint = counted
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), density=0.01, min_size=1000,
                                      momentum_correction=True, variance_warmup_steps=2)
    for step in range(4):
        optimizer.apply([tf.random.stateless_normal([5000], [step, 0])], [variable])
    assert len(calls) == 4
