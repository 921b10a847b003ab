"""Adam's momentum correction (`tf_topk.memory.AdamMomentumCorrectionMemory`).

Two replicas in one process (tests/workers/adam_replicas.py) run
TopKOptimizer(AdamW) of both Keras wrappers with both exchange modes over a
dense warm-up, the freeze of the second moment and sparse steps, one of them
non-finite; every replica's variables and state are compared with the
algorithm written in numpy. The rest runs in this process: the warm-up is
Keras's AdamW, the defaults, the state in checkpoints and `.keras` files,
mixed precision, and the errors.
"""

import json
import math
import subprocess

import keras
import numpy as np
import pytest
import tensorflow as tf

from digits_models import digits, mlp
from multiworker import PYTHON, REPO_ROOT, WORKERS_DIR, worker_env
from selection_reference import nominated_indices, top_k_indices

import tf_topk
from tf_topk.config import ExchangeConfig
from tf_topk.memory import PRECONDITIONER_FLOOR

SHAPES = [(40, 50), (300,), (3000,)]  # 2000 and 3000 entries sparsified; 300 on the dense path
MIN_SIZE, DENSITY, REPLICAS, STEPS, WARMUP, NAN_STEP = 1000, 0.01, 2, 7, 3, 5
LR, WD, BETA_1, BETA_2, EPSILON = 0.01, 0.05, 0.9, 0.999, 1e-7
SPARSE = [v for v, shape in enumerate(SHAPES) if math.prod(shape) >= MIN_SIZE]
CLOSE = dict(rtol=2e-5, atol=2e-6)


def adam_direction(first, second, t):
    """Keras's Adam step per unit of learning rate, at its t-th step (from 1)."""
    return first * math.sqrt(1 - BETA_2 ** t) / (1 - BETA_1 ** t) / (np.sqrt(second) + EPSILON)


def reference(data, mode):
    """Per step: the variables, and per replica the memory state (residual, velocity) after it; the
    moments (the same on every replica)."""
    x = [data[f"input/start{v}"].reshape(-1).astype(np.float64) for v in range(len(SHAPES))]
    sizes = [math.prod(shape) for shape in SHAPES]
    first = [np.zeros(sizes[v]) for v in range(len(SHAPES))]   # per variable: the memory's or the inner Adam's
    second = [np.zeros(sizes[v]) for v in range(len(SHAPES))]
    residuals = [[np.zeros(sizes[v]) for v in SPARSE] for _ in range(REPLICAS)]
    velocities = [[np.zeros(sizes[v]) for v in SPARSE] for _ in range(REPLICAS)]
    scales = [[np.zeros(2) for v in SPARSE] for _ in range(REPLICAS)]  # per replica: EMA of mean g^2, frozen value
    t, steps = 0, []  # t: kept steps so far (the optimizer's iterations)
    for s in range(STEPS):
        grads = [[data[f"input/step{s}/replica{r}/grad{v}"].reshape(-1).astype(np.float64)
                  for v in range(len(SHAPES))] for r in range(REPLICAS)]
        if all(np.isfinite(g).all() for gs in grads for g in gs):
            ratios = [[1.0] * len(SPARSE) for _ in range(REPLICAS)]  # p's scale factor, per replica and slot
            for r in range(REPLICAS):
                for slot, v in enumerate(SPARSE):
                    running = BETA_2 * scales[r][slot][0] + (1 - BETA_2) * np.mean(grads[r][v] ** 2)
                    running_hat = running / (1 - BETA_2 ** (t + 1))
                    frozen = running_hat if t == WARMUP - 1 else scales[r][slot][1]
                    if t >= WARMUP:
                        ratios[r][slot] = math.sqrt(running_hat / frozen)
                    scales[r][slot] = np.array([running, frozen])
            for v in range(len(SHAPES)):
                if v in SPARSE and t >= WARMUP:
                    slot = SPARSE.index(v)
                    root = np.sqrt(second[v])
                    root = np.maximum(root, PRECONDITIONER_FLOOR * root.mean())
                    frozen_p = (root + EPSILON) / math.sqrt(1 - BETA_2 ** WARMUP)
                    accumulated = []
                    for r in range(REPLICAS):
                        preconditioner = frozen_p * ratios[r][slot]
                        if t == WARMUP:  # the switch: each replica's velocity from the first moment
                            velocities[r][slot] = first[v] / (1 - BETA_1 ** WARMUP) / (REPLICAS * preconditioner)
                        velocities[r][slot] = BETA_1 * velocities[r][slot] + (1 - BETA_1) * grads[r][v] / preconditioner
                        accumulated.append(residuals[r][slot] + velocities[r][slot])
                    k = math.ceil(DENSITY * sizes[v])
                    direction = np.zeros(sizes[v])
                    for r in range(REPLICAS):
                        indices = (top_k_indices(accumulated[r], k) if mode == "allgather"
                                   else nominated_indices(accumulated, k))
                        sent = np.zeros(sizes[v])
                        sent[indices] = accumulated[r][indices]
                        residuals[r][slot] = accumulated[r] - sent
                        direction += sent
                else:  # warm-up (the memory's Adam) or the dense path (the inner AdamW): Adam on the sum
                    summed = sum(grads[r][v] for r in range(REPLICAS))
                    first[v] = BETA_1 * first[v] + (1 - BETA_1) * summed
                    second[v] = BETA_2 * second[v] + (1 - BETA_2) * summed ** 2
                    direction = adam_direction(first[v], second[v], t + 1)
                x[v] = x[v] - LR * (direction + WD * x[v])
            t += 1
        steps.append(([w.copy() for w in x], [[u.copy() for u in us] for us in velocities],
                      [[e.copy() for e in es] for es in residuals], [first[v].copy() for v in SPARSE],
                      [second[v].copy() for v in SPARSE], [[c.copy() for c in cs] for cs in scales]))
    return steps


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("adam") / "replicas.npz"
    config = json.dumps(dict(shapes=SHAPES, min_size=MIN_SIZE, density=DENSITY, replicas=REPLICAS, steps=STEPS,
                             warmup_steps=WARMUP, learning_rate=LR, weight_decay=WD, nan_step=NAN_STEP, runs=RUNS))
    proc = subprocess.run([*PYTHON, str(WORKERS_DIR / "adam_replicas.py"), str(path), config],
                          cwd=REPO_ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(path) as saved:
        return dict(saved)


# "auto" after the warm-up takes the route plain error feedback takes here (all_gather at 2 replicas).
RUNS = [f"{api}/{mode}" for api in ("keras", "tf_keras") for mode in ("allgather", "allreduce")] + ["keras/auto"]
REFERENCE_MODE = {"allgather": "allgather", "allreduce": "allreduce", "auto": "allgather"}


@pytest.mark.slow
@pytest.mark.parametrize("label", RUNS)
def test_two_replicas_match_numpy_over_warmup_freeze_and_sparse_steps(data, label):
    mode = REFERENCE_MODE[label.split("/")[1]]
    for s, (x, velocities, residuals, first, second, scales) in enumerate(reference(data, mode)):
        for r in range(REPLICAS):
            prefix = f"{label}/step{s}/replica{r}"
            for v in range(len(SHAPES)):
                np.testing.assert_allclose(data[f"{prefix}/variable{v}"].reshape(-1), x[v], **CLOSE,
                                           err_msg=f"{prefix} variable {v}")
            for slot in range(len(SPARSE)):
                for name, expected in (("velocity", velocities[r][slot]), ("residual", residuals[r][slot]),
                                       ("first", first[slot]), ("second", second[slot]),
                                       ("scale", scales[r][slot])):
                    np.testing.assert_allclose(data[f"{prefix}/{name}{slot}"].reshape(-1), expected,
                                               rtol=2e-5, atol=1e-5, err_msg=f"{prefix} {name} {slot}")
    assert int(data[f"{label}/skipped"]) == 1 and int(data[f"{label}/iterations"]) == STEPS - 1


@pytest.mark.parametrize("label", RUNS)
def test_replicas_stay_bitwise_identical_and_keep_their_own_residuals(data, label):
    last = f"{label}/step{STEPS - 1}"
    for v in range(len(SHAPES)):
        np.testing.assert_array_equal(data[f"{last}/replica1/variable{v}"], data[f"{last}/replica0/variable{v}"])
    # Sparse steps happened: residuals are kept, and differ per replica.
    assert np.abs(data[f"{last}/replica0/residual0"]).sum() > 0
    assert not np.array_equal(data[f"{last}/replica0/velocity0"], data[f"{last}/replica1/velocity0"])


def test_the_non_finite_step_left_everything_as_it_was(data):
    for label in RUNS:
        before, after = f"{label}/step{NAN_STEP - 1}/replica0", f"{label}/step{NAN_STEP}/replica0"
        for name in ("variable0", "variable1", "residual0", "velocity0", "first0", "second0", "scale0"):
            np.testing.assert_array_equal(data[f"{after}/{name}"], data[f"{before}/{name}"])


def test_the_two_wrappers_agree(data):
    for mode in ("allgather", "allreduce"):
        for v in range(len(SHAPES)):
            np.testing.assert_allclose(data[f"tf_keras/{mode}/step{STEPS - 1}/replica0/variable{v}"],
                                       data[f"keras/{mode}/step{STEPS - 1}/replica0/variable{v}"], rtol=1e-5,
                                       atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_auto_takes_the_route_of_error_feedback_after_the_warmup(tmp_path, replicas):
    """One routing rule for every memory: after its dense warm-up, Adam's momentum correction travels
    by the route "auto" gives plain error feedback at the same density and replica count (0.001:
    all_gather up to 4 replicas; 0.3: all_gather, then dense at 4), and by a dense step before."""
    path = tmp_path / "modes.json"
    proc = subprocess.run([*PYTHON, str(WORKERS_DIR / "adam_routes.py"), str(replicas), str(path)],
                          cwd=REPO_ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    modes = json.loads(path.read_text())
    warmup = 2  # tests/workers/adam_routes.py's
    for density in (0.001, 0.3):
        adam, sgd = modes[f"{replicas}/{density}/adam"], modes[f"{replicas}/{density}/sgd"]
        assert adam[:warmup] == [0.0] * warmup, (density, adam)
        assert adam[warmup:] == sgd[warmup:], (density, adam, sgd)
    assert modes[f"{replicas}/0.001/sgd"][-1] == 1.0  # all_gather


# -- one process ---------------------------------------------------------------------------------

def compile_fit(model, optimizer, x, y, epochs=1):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model.fit(x, y, epochs=epochs, batch_size=64, verbose=0, shuffle=False)


@pytest.mark.slow
def test_during_the_warmup_it_is_keras_adamw():
    x, y = digits(512)
    dense, ours = mlp(), mlp()
    compile_fit(dense, keras.optimizers.AdamW(0.003, weight_decay=0.05), x, y, epochs=2)
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.003, weight_decay=0.05), density=0.01,
                                      min_size=2000, momentum_correction=True, variance_warmup_steps=1000)
    compile_fit(ours, optimizer, x, y, epochs=2)
    for a, b in zip(dense.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    assert optimizer.exchange.memory.applies_update and optimizer.exchange.sparse_positions


@pytest.mark.parametrize("make_inner", [lambda: keras.optimizers.Adam(0.01), lambda: keras.optimizers.AdamW(0.01)])
def test_it_is_opt_in_for_adam_and_reads_the_inner_optimizer(make_inner):
    optimizer = tf_topk.TopKOptimizer(make_inner(), density=0.01, momentum_correction=True)
    config = optimizer.exchange_config
    assert optimizer.momentum_correction
    assert (config.momentum, config.beta_2, config.epsilon, config.variance_warmup_steps) == (0.9, 0.999, 1e-7, 100)
    default = tf_topk.TopKOptimizer(make_inner())
    assert not default.momentum_correction and default.exchange_config.beta_2 is None
    assert default.density is None and default.exchange_config.schedule.autopilot  # the same default as SGD's
    sgd = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), density=0.01)
    assert not sgd.momentum_correction  # SGD's stays opt-in


@pytest.mark.slow
def test_sparse_steps_train_better_than_error_feedback_in_front_of_adam():
    """On digits at 0.1% (128 steps, 32 of them dense for the correction), Adam's correction reaches
    a training loss well below top-k + EF + Adam's (measured: 0.54 against 1.80)."""
    x, y = digits(1024)
    losses = {}
    for correction in (False, True):
        keras.utils.set_random_seed(0)
        # error feedback at 0.001 from the first step; without the correction top-k in front of Adam, as
        # named (at 0.001 "auto" would take decoupled momentum)
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.Adam(0.003), density=0.001, min_size=1000,
                                          momentum_correction=correction, variance_warmup_steps=32,
                                          density_warmup_steps=0, decoupled_momentum=False)
        losses[correction] = compile_fit(mlp(), optimizer, x, y, epochs=8).history["loss"][-1]
    assert losses[True] < 0.5 * losses[False], losses


@pytest.mark.slow
def test_keras_file_and_checkpoint_restore_the_state_exactly(tmp_path):
    x, y = digits(512)
    model = mlp()
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.003), density=0.01, min_size=1000,
                                      momentum_correction=True, variance_warmup_steps=3)
    compile_fit(model, optimizer, x, y)  # 8 steps: 3 dense, 5 sparse
    memory = optimizer.exchange.memory
    state = [v.numpy().copy() for v in memory.state_variables]
    assert np.abs(state[0]).sum() > 0 and len(state) == 5 * len(optimizer.exchange.sparse_positions) + 1
    assert int(memory.steps.numpy()) == 8  # its own count of kept steps
    config = optimizer.get_config()
    assert config["momentum_correction"] is True and config["variance_warmup_steps"] == 3
    assert "beta_2" not in config  # the inner optimizer's
    assert tf_topk.TopKOptimizer.from_config(config).get_config() == config
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.exchange_config == optimizer.exchange_config
    saved = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / "ckpt"))
    other = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.003), density=0.01, min_size=1000,
                                  momentum_correction=True, variance_warmup_steps=3)
    other.build(mlp(seed=3).trainable_variables)
    tf.train.Checkpoint(optimizer=other).restore(saved).assert_existing_objects_matched()
    for expected, restored in zip(state, other.exchange.memory.state_variables):
        np.testing.assert_array_equal(restored.numpy(), expected)


@pytest.mark.slow
def test_mixed_precision_trains():
    x, y = digits(512)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.003), density=0.05, momentum_correction=True,
                                          variance_warmup_steps=8)
        history = compile_fit(mlp(), optimizer, x, y, epochs=4)
        assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
        memory = optimizer.exchange.memory
        assert all(v.dtype == tf.float32 for v in memory.state_variables if v is not memory.steps)
        assert memory.steps.dtype == tf.int64
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("make,message", [
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01, amsgrad=True), momentum_correction=True),
     "use amsgrad=False, or momentum_correction=False"),
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), variance_warmup_steps=0),
     "variance_warmup_steps must be an int >= 1, got 0"),
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), density="adaptive", momentum_correction=True),
     "an adaptive density cannot go with Adam's momentum correction"),
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), sparse_updates=True),
     "sparse_updates=True needs a keras.optimizers.SGD as inner optimizer .* got Adam"),
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01, clipnorm=1.0), momentum_correction=True),
     "the inner optimizer's clipnorm=1.0 would not act on them"),
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01, use_ema=True), momentum_correction=True),
     "the inner optimizer's use_ema=True would not act on them"),
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
                                   momentum_correction=True),
     "gradient_accumulation_steps=2 would not act on them"),
    (lambda: tf_topk.tf_keras.TopKOptimizer(__import__("tf_keras").optimizers.Adam(0.01, global_clipnorm=1.0),
                                            momentum_correction=True),
     "global_clipnorm=1.0 would not act on them"),
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), sparse_updates=True, momentum_correction=True),
     "sparse_updates=True needs a keras.optimizers.SGD as inner optimizer .* got Adam"),
    (lambda: tf_topk.TopKOptimizer(keras.optimizers.Adam(0.01), config=ExchangeConfig(momentum=0.9)),
     "config has .* but the inner Adam has"),
    (lambda: ExchangeConfig(beta_2=0.999), r"beta_2=... \(Adam's momentum correction\) needs momentum"),
    (lambda: ExchangeConfig(momentum=0.9, beta_2=1.0), r"beta_2 must be None or a float in \(0, 1\), got 1.0"),
    (lambda: ExchangeConfig(momentum=0.9, beta_2=0.999, epsilon=0.0), "epsilon must be a finite float > 0, got 0.0"),
    (lambda: ExchangeConfig(momentum=0.9, beta_2=0.999, sparse_output=True), "sparse_output=True .* is for SGD"),
])
def test_bad_combinations_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_warmup_counts_the_memorys_own_kept_steps():
    """A custom loop needs no step: the memory counts its kept steps (a non-finite one is not
    counted), sends every entry while warming up, then k."""
    variable = tf.Variable(tf.zeros([5000]))
    exchange = tf_topk.SparseExchange([variable], density=0.01, min_size=100, momentum=0.9, beta_2=0.999,
                                      variance_warmup_steps=2)
    selected = []
    for grad in ([1.0] * 5000, [float("nan")] + [1.0] * 4999, [1.0] * 5000, [1.0] * 5000):
        result = exchange([tf.constant(grad)])
        selected.append((bool(result.all_finite), int(result.stats["selected"]),
                         int(exchange.memory.steps.numpy())))
    assert [(finite, steps) for finite, _, steps in selected] == [(True, 1), (False, 1), (True, 2), (True, 3)]
    assert [count for finite, count, _ in selected if finite] == [5000, 5000, 50]


@pytest.mark.parametrize("api", ["keras", "tf_keras"])
def test_a_learning_rate_schedule_moves_the_sparsified_variables_at_this_steps_rate(api):
    """A schedule of 0.1, then 0: the second step moves nothing (tf_keras's refreshed its rate only
    inside the inner apply, after the directions had been applied at the previous step's 0.1)."""
    import tf_keras

    kerases = {"keras": (keras, tf_topk.TopKOptimizer, keras.Variable),
               "tf_keras": (tf_keras, tf_topk.tf_keras.TopKOptimizer, tf.Variable)}
    module, wrapper, make_variable = kerases[api]
    schedule = module.optimizers.schedules.PiecewiseConstantDecay([0], [0.1, 0.0])  # step 0: 0.1, after: 0
    variable = make_variable(np.ones(5000, np.float32))
    optimizer = wrapper(module.optimizers.Adam(schedule), density=1.0, min_size=100, momentum_correction=True,
                        variance_warmup_steps=1)
    moved = []
    for _ in range(2):
        before = np.array(variable.numpy())
        optimizer.apply_gradients([(tf.ones([5000]), variable)])
        moved.append(float(np.abs(np.array(variable.numpy()) - before).max()))
    assert moved[0] > 0.05 and moved[1] == 0.0, moved


def test_the_correction_without_a_density_says_what_runs(capsys):
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01), momentum_correction=True, min_size=100)
    optimizer.build([keras.Variable(np.ones(500, np.float32))])
    assert capsys.readouterr().err == (
        "tf_topk: Adam's momentum correction: every entry for the first 100 steps, then density 0.001 (fixed: the "
        "autopilot does not choose a density for a frozen second moment; pass density=... to choose one)\n")
    tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01), momentum_correction=True, density=0.01, min_size=100).build(
        [keras.Variable(np.ones(500, np.float32))])
    assert capsys.readouterr().err == ""
