"""TopKOptimizer keeps the Keras optimizer contract: what the inner optimizer does to a gradient or a
variable happens with the wrapper too, and the optimizer API behaves as Keras's.

Density 1.0 sends every entry: the wrapped optimizer must then train exactly as the inner one alone,
with each inner option turned on. The model has a kernel above min_size (the top-k path) and
variables below it (the dense path).
"""

import json
import subprocess
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from digits_models import mlp, train
from multiworker import PYTHON, REPO_ROOT, WORKERS_DIR, worker_env
from test_keras_optimizer_matrix import INNER_OPTIMIZERS, OPTIONS_ONE_AT_A_TIME

import tf_topk


# Options of one optimizer that tests/test_keras_optimizer_matrix.py (every optimizer with each of clipping,
# weight decay, EMA and accumulation) does not turn on.
INNER_OPTIONS = {
    "amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "learning rate schedule": lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 5, 0.5)),
}


@pytest.mark.slow
@pytest.mark.parametrize("option", INNER_OPTIONS)
def test_every_inner_option_acts_as_it_does_without_the_wrapper(option):
    """Adam's own options (clipping with AdamW, where `|TopK(AdamW(clipnorm=1)) - AdamW(clipnorm=1)|` was
    3.5e-2, and accumulation, which moved the variable on every micro-batch, are cells of the matrix in
    tests/test_keras_optimizer_matrix.py)."""
    make = INNER_OPTIONS[option]
    alone = train(make())
    wrapped = train(tf_topk.TopKOptimizer(make(), density=1.0))
    for a, b in zip(alone.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_constraint_holds_on_the_top_k_path_and_with_adams_correction():
    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((64,)),
                                 keras.layers.Dense(128, activation="relu", kernel_constraint=keras.constraints.NonNeg()),
                                 keras.layers.Dense(10)])

    alone = train(keras.optimizers.Adam(0.01), model())
    wrapped = train(tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), density=1.0), model())
    np.testing.assert_allclose(wrapped.get_weights()[0], alone.get_weights()[0], rtol=1e-5, atol=1e-6)
    corrected = train(tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), density=0.05, momentum_correction=True,
                                            variance_warmup_steps=3), model())
    assert corrected.get_weights()[0].min() >= 0.0


@pytest.mark.slow
def test_exclude_from_weight_decay_on_the_wrapper_reaches_the_inner_optimizer():
    alone = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    alone.exclude_from_weight_decay(var_names=["dense"])
    wrapped = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.5), density=1.0)
    wrapped.exclude_from_weight_decay(var_names=["dense"])
    for a, b in zip(train(alone).get_weights(), train(wrapped).get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_set_weights_reaches_the_inner_optimizers_state():
    source = tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), density=1.0)
    train(source)
    target = tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), density=1.0)
    target.build(mlp(seed=1).trainable_variables)
    target.set_weights([v.numpy() for v in source.variables])
    assert int(target.iterations.numpy()) == int(source.iterations.numpy()) > 0
    for a, b in zip(source.inner_optimizer.variables, target.inner_optimizer.variables):
        np.testing.assert_array_equal(b.numpy(), a.numpy())
    with pytest.raises(ValueError, match=r"set_weights got 1 arrays, but .* has \d+ variables"):
        target.set_weights([np.zeros(())])


@pytest.mark.slow
def test_an_inner_optimizer_whose_build_reads_the_variables_builds_where_keras_builds_it():
    """ScheduleFreeAdamW's build copies the variables' values. Without a strategy Keras builds it in
    fit's first traced step, with the model built in the same trace; the wrapper built it eagerly,
    where those values read empty ("Shape mismatch ... (5, 10) and (0,)")."""
    weights = []
    for wrap in (False, True):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.layers.Dense(10)])
        inner = keras.optimizers.ScheduleFreeAdamW(learning_rate=0.01)
        model.compile(optimizer=tf_topk.TopKOptimizer(inner, density=1.0) if wrap else inner, loss="mse")
        model.fit(np.ones((4, 5), "float32"), np.zeros((4, 10), "float32"), epochs=2, verbose=0)
        weights.append(model.get_weights())
    for alone, wrapped in zip(*weights):
        np.testing.assert_allclose(wrapped, alone, rtol=0, atol=1e-6)


def test_overwrite_with_gradient_under_accumulation_acts_as_keras():
    """Keras's test_overwrite_with_gradient_with_gradient_accumulation on public state only: a variable
    marked overwrite_with_gradient takes the accumulated steps' gradient, the other one SGD's step."""
    finals = []
    for options in (None, {"density": 1.0}, {"density": 1.0, "min_size": 1}):
        overwritten = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
        overwritten.overwrite_with_gradient = True
        trained = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
        optimizer = keras.optimizers.SGD(learning_rate=1.0, gradient_accumulation_steps=2)
        if options is not None:
            optimizer = tf_topk.TopKOptimizer(optimizer, **options)
        history = []
        for grad in (tf.ones([2, 2]), 2.0 * tf.ones([2, 2]), tf.ones([2, 2])):
            optimizer.apply_gradients([(grad, overwritten), (grad, trained)])
            history.append((overwritten.numpy(), trained.numpy(), int(optimizer.iterations.numpy())))
        finals.append(history)
    np.testing.assert_allclose(finals[0][1][0], [[2.0, 2.0], [2.0, 2.0]])
    np.testing.assert_allclose(finals[0][1][1], [[-0.5, 0.5], [1.5, 2.5]])
    for history in finals[1:]:
        for (want_overwritten, want_trained, want_steps), (overwritten, trained, steps) in zip(finals[0], history):
            np.testing.assert_allclose(overwritten, want_overwritten, atol=1e-6)
            np.testing.assert_allclose(trained, want_trained, atol=1e-6)
            assert steps == want_steps


def test_wrappers_are_numbered_as_keras_numbers_optimizers():
    first, second = (tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1)) for _ in range(2))
    assert first.name.startswith("topk_optimizer") and first.name != second.name
    assert tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), name="mine").name == "mine"


def test_a_float64_variable_takes_a_float32_gradient_as_keras_casts_it():
    variables = [keras.Variable(np.ones(5000), dtype="float64"), keras.Variable(np.ones(10), dtype="float64")]
    grads = [tf.linspace(0.0, 1.0, 5000), tf.fill([10], 0.5)]  # float32
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01, min_size=1000, method="exact",
                                      density_warmup_steps=0)
    optimizer.apply(grads, variables)
    assert variables[0].dtype == "float64"
    moved = np.flatnonzero(variables[0].numpy() != 1.0)
    np.testing.assert_array_equal(moved, np.arange(4950, 5000))  # the top 50
    np.testing.assert_allclose(variables[0].numpy()[moved], 1.0 - 0.1 * np.linspace(0.0, 1.0, 5000)[moved], rtol=1e-6)
    np.testing.assert_allclose(variables[1].numpy(), 0.95)



@pytest.mark.parametrize("method", ["AdamW's default (decoupled momentum)", "SGD's sparse updates",
                                    "Adam's momentum correction", "SGD with momentum"])
def test_a_tf_variable_trains_as_a_keras_variable_does(method):
    """Keras's optimizers take a tf.Variable as they take a keras.Variable; so does the wrapper on the
    paths that update a variable itself (decoupled momentum's sign step and the sparse updates read the
    tf.Variable behind a Keras one, which a tf.Variable is already)."""
    make = {"AdamW's default (decoupled momentum)": lambda: tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3),
                                                                                   density=0.01),
            "SGD's sparse updates": lambda: tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01,
                                                                  sparse_updates=True),
            "Adam's momentum correction": lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(1e-3), density=0.01,
                                                                        momentum_correction=True),
            "SGD with momentum": lambda: tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                               density=0.01)}[method]
    grads = [tf.constant(np.random.default_rng(step).standard_normal([64, 64]), tf.float32) for step in range(3)]
    finals = []
    for variable in (keras.Variable(np.ones([64, 64], np.float32)), tf.Variable(tf.ones([64, 64]))):
        optimizer = make()
        for grad in grads:
            optimizer.apply_gradients([(grad, variable)])
        finals.append(variable.numpy())
    assert np.count_nonzero(finals[0] != 1.0) > 0
    np.testing.assert_allclose(finals[1], finals[0], rtol=1e-6, atol=1e-7)
def test_no_gradient_is_keras_error_and_a_missing_one_keras_warning():
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=1.0)
    variables = [keras.Variable(np.ones(8, np.float32)), keras.Variable(np.ones(8, np.float32))]
    with pytest.raises(ValueError, match="No gradients provided for any variable."):
        optimizer.apply([None, None], variables)
    with pytest.raises(ValueError, match="No gradients provided for any variable."):
        optimizer.apply_gradients([])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.apply([tf.ones(8), None], variables)
    assert any("Gradients do not exist for variables" in str(w.message) for w in caught)
    np.testing.assert_allclose(variables[0].numpy(), 0.9)
    with pytest.raises(ValueError, match="stateless_apply is not supported"):
        optimizer.stateless_apply([], [], [])


@pytest.mark.slow
def test_a_gradient_made_outside_strategy_run_is_summed_under_mirrored_strategy():
    """Keras's own distribute tests hand the same tensor to every replica: the wrapper's dense route
    gave those objects to the collective, which failed with IndexError; the top-k path (min_size=1)
    counted it once per replica where TensorFlow's all-reduce counts it once."""
    proc = subprocess.run([*PYTHON, str(WORKERS_DIR / "outside_gradient.py")], cwd=REPO_ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[0] == "SAME", proc.stdout


def test_an_inner_loss_scale_factor_is_applied_once_inside_a_loss_scale_optimizer_and_with_sparse_updates():
    """Keras's test_finite_step_with_inner_loss_scale: the LossScaleOptimizer clears the factor of the
    optimizer it wraps, which for the wrapper is the inner one's (the update was [0.995, 1.97, ...]).
    sparse_updates applies the pairs itself, unscaled as the inner apply would (steps were 128x)."""
    for wrap in (False, True):
        inner = keras.optimizers.SGD(learning_rate=0.5, loss_scale_factor=100)
        optimizer = keras.mixed_precision.LossScaleOptimizer(
            tf_topk.TopKOptimizer(inner, density=1.0) if wrap else inner)
        variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
        optimizer.apply([np.array([1.0, 6.0, 7.0, 2.0], np.float32) * optimizer.initial_scale], variables)
        np.testing.assert_allclose(variables[0].numpy(), [0.5, -1.0, -0.5, 3.0], atol=1e-4)
    for sparse in (False, True):
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.5, loss_scale_factor=128), density=0.5, min_size=2,
                                          sparse_updates=sparse)
        variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
        optimizer.apply([np.array([1.0, 6.0, 7.0, 2.0], np.float32) * 128], variables)
        np.testing.assert_allclose(variables[0].numpy(), [1.0, -1.0, -0.5, 4.0], atol=1e-5)


@pytest.mark.slow
def test_a_mixed_precision_fit_takes_keras_steps():
    """In a mixed_float16 fit the kernel moved 3.6e-6 against Keras's 3.0e-4."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        start = mlp().get_weights()
        moves = []
        for optimizer in (keras.optimizers.SGD(0.1), tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=1.0)):
            model = train(optimizer, epochs=1, n=64)
            moves.append(np.abs(model.get_weights()[0] - start[0]).max())
        assert moves[0] > 1e-4
        np.testing.assert_allclose(moves[1], moves[0], rtol=1e-2)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
def test_density_one_is_the_inner_optimizer_with_two_replicas():
    """The twelve optimizers with their defaults, and each option once, on Adam, AdamW or momentum SGD
    (every option with every optimizer on one replica: test_each_option_of_each_optimizer_acts_as_without_
    the_wrapper; the options in pairs on two replicas: tests/test_keras_order.py). Clipping acts on each
    replica's gradient before the sum, as Keras clips (clipping the sum moved a weight 0.154 away from
    Keras's)."""
    owners = {"clipnorm": "Adam", "clipvalue": "AdamW", "global_clipnorm": "SGD momentum", "weight_decay": "Adam",
              "use_ema": "AdamW", "gradient_accumulation_steps": "SGD momentum"}
    assert set(owners) == set(OPTIONS_ONE_AT_A_TIME)
    specs = [*INNER_OPTIMIZERS, *(f"{name}+{option}" for option, name in owners.items())]
    proc = subprocess.run([*PYTHON, str(WORKERS_DIR / "inner_optimizers_replicas.py"), *specs],
                          cwd=REPO_ROOT, env=worker_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    differences = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(differences) == set(specs)
    for spec, difference in differences.items():
        if spec.endswith(("+use_ema", "+gradient_accumulation_steps")):
            # Keras's own optimizer fails with these under MirroredStrategy's fit ("merge_call called while
            # defining a new graph"); the wrapper refuses them with a ValueError that names the option.
            option = spec.split("+")[1]
            assert difference["alone"].startswith("RuntimeError"), difference
            assert difference["wrapped"].startswith(f"ValueError: TopKOptimizer with an inner {option}="), difference
        else:
            assert difference <= 1e-6, (spec, difference)


@pytest.mark.parametrize("make_inner", [lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.Adam(0.01)],
                         ids=["SGD", "Adam"])
def test_a_model_saved_before_training_loads_as_keras_loads_it(make_inner, tmp_path):
    """TensorFlow's multi-worker tutorial saves before training: the wrapper warned "Skipping variable
    loading ... 14 variables whereas the saved optimizer has 4". Now it warns exactly when Keras warns
    for the inner optimizer alone (never for SGD; for Adam, Keras itself warns)."""
    import warnings

    skipped = []
    for wrap in (False, True):
        model = mlp()
        inner = make_inner()
        model.compile(optimizer=tf_topk.TopKOptimizer(inner, density=0.01) if wrap else inner, loss="mse")
        path = str(tmp_path / f"model{wrap}.keras")
        model.save(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = keras.models.load_model(path)
        skipped.append(sum("Skipping variable loading" in str(w.message) for w in caught))
        assert loaded.optimizer.built
    assert skipped[1] == skipped[0], skipped


def test_built_with_no_variables_it_says_so_when_applied():
    """Keras allows build([]) (its Nadam test does it); applying such an optimizer is Keras's own
    clear error, as for the inner optimizer alone."""
    for wrap in (False, True):
        optimizer = keras.optimizers.SGD(0.1)
        optimizer = tf_topk.TopKOptimizer(optimizer, density=1.0) if wrap else optimizer
        optimizer.build([])
        assert optimizer.built and (not wrap or optimizer.exchange is None)
        with pytest.raises(ValueError, match=r"Unknown variable: .* can only be called for the variables it was "
                                             r"originally built with"):
            optimizer.apply([tf.ones(3)], [keras.Variable(np.ones(3, np.float32))])
