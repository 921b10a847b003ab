"""The default warm-up of a fixed low density (`density_warmup_steps`): what it runs, where it
applies and where not, how it routes, and what it refuses, from the config to `model.fit`."""

import json
import os
import subprocess

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_topk
from multiworker import PYTHON, REPO_ROOT, worker_env
from tf_topk.config import DEFAULT_DENSITY_WARMUP_STEPS, WARMUP_UP_TO_DENSITY
from tf_topk.schedule import dgc_warmup, warmup_in_steps


def test_warmup_in_steps_is_dgcs_warmup_with_its_epochs_given_in_steps():
    assert [step for step, _ in warmup_in_steps(400, final=0.001)] == [0, 100, 200, 300, 400]
    assert [d for _, d in warmup_in_steps(400, final=0.001)] == pytest.approx([0.25, 0.0629, 0.0158, 0.00398, 0.001],
                                                                               rel=1e-3)
    assert warmup_in_steps(0, final=0.001) == [(0, 0.001)]
    assert warmup_in_steps(2, final=0.01) == [(0, 0.25), (1, 0.05), (2, 0.01)]  # fewer steps than stages
    assert warmup_in_steps(10, final=0.5) == [(0, 0.5)]  # above where it would start: nothing to warm up
    for kwargs, message in [({"steps": -1}, "steps must be an int >= 0, got -1"),
                            ({"steps": 4.0}, "steps must be an int >= 0, got 4.0"),
                            ({"stages": 0}, "stages must be an int >= 1, got 0"),
                            ({"final": 0.0}, "final must be in")]:
        with pytest.raises(ValueError, match=message):
            warmup_in_steps(**{"steps": 400, "final": 0.001, **kwargs})


@pytest.mark.parametrize("density", [0.001, WARMUP_UP_TO_DENSITY, 1e-5])
def test_a_fixed_low_density_warms_up_by_default(density):
    config = tf_topk.ExchangeConfig(density=density)
    assert config.density == density and config.density_warmup_steps == "auto"  # saved as given
    assert config.schedule.steps == warmup_in_steps(DEFAULT_DENSITY_WARMUP_STEPS, final=density)
    assert config.density_warmup_taken == DEFAULT_DENSITY_WARMUP_STEPS
    assert config.settled_pairs(100_000) == int(np.ceil(density * 100_000)) and config.max_pairs(100_000) == 25_000


@pytest.mark.parametrize("config", [
    tf_topk.ExchangeConfig(density=0.02),  # above the low densities
    tf_topk.ExchangeConfig(density=0.001, density_warmup_steps=0),  # switched off
    tf_topk.ExchangeConfig(density=0.001, momentum=0.9, beta_2=0.999),  # Adam's: dense first steps anyway
    tf_topk.ExchangeConfig(density=0.3),  # above where a warm-up starts
])
def test_where_the_density_runs_as_given(config):
    assert config.schedule.is_constant and config.density_warmup_taken == 0


def test_an_int_sets_the_length_and_schedules_warm_up_as_they_say():
    assert tf_topk.ExchangeConfig(density=0.05, density_warmup_steps=8).schedule.steps == \
        warmup_in_steps(8, final=0.05)
    # The fixed 0.001 taken where the autopilot cannot choose (a fixed route) is a fixed low density too.
    assert tf_topk.ExchangeConfig(exchange_mode="allgather").density_warmup_taken == DEFAULT_DENSITY_WARMUP_STEPS
    pairs = dgc_warmup(10, epochs=2, final=0.001)
    assert tf_topk.ExchangeConfig(density=pairs).schedule.steps == pairs  # "auto": as the schedule says
    assert tf_topk.ExchangeConfig(density="adaptive").schedule.adaptive is not None


@pytest.mark.parametrize("kwargs, message", [
    ({"density_warmup_steps": -1}, "density_warmup_steps must be 'auto' or an int >= 0, got -1"),
    ({"density_warmup_steps": "none"}, "density_warmup_steps must be 'auto' or an int >= 0, got 'none'"),
    ({"density_warmup_steps": True}, "density_warmup_steps must be 'auto' or an int >= 0, got True"),
    ({"density": [(0, 0.1), (5, 0.01)], "density_warmup_steps": 5}, r"density_warmup_steps=5 warms up a fixed density"),
    ({"density": "adaptive", "density_warmup_steps": 5}, r"density_warmup_steps=5 .* density='adaptive'"),
    ({"density_warmup_steps": 5}, r"density=None \(the autopilot\)"),
    ({"density": 0.5, "density_warmup_steps": 100},
     r"density_warmup_steps=100 warms up from 0.25 .* density=0.5 is not below 0.25: nothing would warm up"),
])
def test_bad_warmups_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tf_topk.ExchangeConfig(**kwargs)


def test_the_exchange_sends_the_warmups_k_at_each_step_and_needs_the_step():
    variable = tf.Variable(tf.zeros([10_000]))
    exchange = tf_topk.SparseExchange([variable], density=0.001, min_size=1, method="exact")
    grad = tf.random.stateless_normal([10_000], seed=[1, 2])
    selected = {step: int(exchange([grad], step=tf.constant(step, tf.int64)).stats["selected"])
                for step in (0, 99, 100, 399, 400, 5000)}
    assert selected == {0: 2500, 99: 2500, 100: 629, 399: 40, 400: 10, 5000: 10}
    with pytest.raises(ValueError, match=r"density=0.001 starts with a 400-step warm-up \(density_warmup_steps='auto'\)"
                                         r".*pass step=.*density_warmup_steps=0"):
        exchange([grad])
    off = tf_topk.SparseExchange([tf.Variable(tf.zeros([10_000]))], density=0.001, min_size=1, method="exact",
                               density_warmup_steps=0)
    assert int(off([grad]).stats["selected"]) == 10  # no step needed: 0.001 from the first call


def test_the_warmup_announces_itself_once_with_how_to_switch_it_off(capsys):
    """Made (by the Keras wrappers or a custom loop), an exchange whose fixed density warms up says so on
    stderr: the density, the steps, the stages and the option that switches it off; none where nothing
    warms up. (Of several workers, the chief alone: test_multiworker_topk.)"""
    variable = tf.Variable(tf.zeros([10_000]))
    tf_topk.SparseExchange([variable], density=0.001, min_size=1)
    assert capsys.readouterr().err.splitlines() == [
        "tf_topk: density 0.001 after a 400-step warm-up (Deep Gradient Compression's falling densities "
        "0.25, 0.063, 0.016, 0.004 in 4 equal stages); density_warmup_steps=0 sends 0.001 from the first step"]
    tf_topk.SparseExchange([variable], density=0.01, min_size=1, density_warmup_steps=40)
    assert "density 0.01 after a 40-step warm-up" in capsys.readouterr().err
    for quiet in ({"density_warmup_steps": 0}, {"density": 0.05}, {"min_size": 100_000}):  # off; above 0.01; dense
        tf_topk.SparseExchange([variable], **{"density": 0.001, "min_size": 1, **quiet})
        assert "warm-up" not in capsys.readouterr().err, quiet


def test_buckets_are_sized_for_the_density_after_the_warmup():
    variables = [tf.Variable(tf.zeros([10_000])) for _ in range(4)]
    options = {"density": 0.001, "min_size": 1, "bucket_bytes": 8 * 20}  # two variables' 10 pairs a bucket
    assert tf_topk.SparseExchange(variables, **options).num_buckets == \
        tf_topk.SparseExchange(variables, **options, density_warmup_steps=0).num_buckets == 2


# P logical CPUs; "auto" at 0.001 with the default warm-up and with it off: the route (stats'
# exchange_mode: 1 all_gather, 2 agreed indices) and the pairs replica 0 selected, at each step.
ROUTES_SCRIPT = r"""
import json, sys
import tensorflow as tf
replicas = int(sys.argv[1])
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * replicas)
import tf_topk

strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
found = {}
for name, options in [("auto", {}), ("off", {"density_warmup_steps": 0})]:
    with strategy.scope():
        variable = tf.Variable(tf.zeros([40_000]))
        exchange = tf_topk.SparseExchange([variable], density=0.001, min_size=1, method="exact", **options)

    @tf.function
    def step(step, exchange=exchange):
        def replica_fn():
            replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            grad = tf.random.stateless_normal([40_000], seed=[1, 2]) * (replica + 1.0)
            result = exchange([grad], step=step)
            return result.stats["exchange_mode"], result.stats["selected"]

        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    found[name] = [[float(v) for v in step(tf.constant(s, tf.int64))] for s in (0, 100, 399, 400, 401)]
print(json.dumps(found))
"""


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [3, 6])
def test_auto_routes_the_warmup_as_any_falling_schedule(replicas):
    """Under exchange_mode="auto" the warm-up never sends more than the dense all-reduce: on 3
    replicas by all_gather, the route of 0.001 alone, each step with its own k; on 6, where all_gather
    of a quarter of the entries from every replica would send more than dense, by agreed indices
    for the whole run, where 0.001 alone takes all_gather."""
    env = {**os.environ, **worker_env()}
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([*PYTHON, "-c", ROUTES_SCRIPT, str(replicas)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["off"] == [[1.0, 40.0]] * 5
    if replicas == 3:
        assert found["auto"] == [[1.0, 10_000.0], [1.0, 2_515.0], [1.0, 160.0], [1.0, 40.0], [1.0, 40.0]]
    else:
        assert [mode for mode, _ in found["auto"]] == [2.0] * 5


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])


@pytest.mark.slow
def test_the_keras_wrapper_warms_up_on_its_iterations_and_saves_the_option(tmp_path):
    x = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    y = np.arange(256) % 10
    sent = {}
    for warmup in ("auto", 0):
        model = _model()
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=0.001,
                                          density_warmup_steps=warmup)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # 8 steps, all in the warm-up's first stage
        sent[warmup] = float(optimizer.compression_stats()["density"])
        assert optimizer.density == 0.001 and optimizer.density_warmup_steps == warmup
    assert sent["auto"] == pytest.approx(0.25, rel=0.01) and sent[0] == pytest.approx(0.001, rel=0.1)
    config = optimizer.get_config()
    assert (config["density"], config["density_warmup_steps"]) == (0.001, 0)
    warming = tf_topk.ExchangeConfig(density=0.001, density_warmup_steps=40)  # saved as given, not as it runs
    assert warming.get_config()["density"] == 0.001
    assert tf_topk.ExchangeConfig.from_config(warming.get_config()) == warming
    assert tf_topk.TopKOptimizer.from_config(config).exchange_config.schedule.is_constant
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.density_warmup_steps == 0 and loaded.optimizer.density == 0.001


@pytest.mark.parametrize("warmup,epochs,warns", [("auto", 2, True), (8, 2, False), (20, 2, True), (20, 3, False)])
def test_compression_stats_says_when_the_fit_ends_inside_the_warmup(warmup, epochs, warns, capsys):
    """8 steps an epoch: a fit whose last step falls inside the warm-up says so at train begin, with the
    density its last steps send; one that reaches the density given says nothing."""
    x = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    y = np.arange(256) % 10
    model = _model()
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.05), density=0.001,
                                                  density_warmup_steps=warmup),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    capsys.readouterr()
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[tf_topk.keras.CompressionStats()])
    said = [line for line in capsys.readouterr().err.splitlines() if "this fit ends" in line]
    if not warns:
        assert said == []
    elif warmup == "auto":
        assert said == ["tf_topk: this fit ends at step 16, inside the 400-step warm-up of density 0.001: its last "
                        "steps send density 0.25, not 0.001; density_warmup_steps=0 (or a shorter warm-up) trains "
                        "at the density given"]
    else:  # 20 steps: stages at 0, 5, 10, 15; the 16th step is in the fourth
        assert len(said) == 1 and "its last steps send density 0.004, not 0.001" in said[0]


def test_a_config_saved_before_the_warmup_existed_resumes_without_one():
    """A model at density 0.001 saved before `density_warmup_steps` existed ran 0.001 from its first
    step: it resumes so, not into a 400-step warm-up it never ran; a wrapper's config likewise."""
    old = tf_topk.ExchangeConfig(density=0.001).get_config()
    del old["density_warmup_steps"]
    assert tf_topk.ExchangeConfig.from_config(old).schedule.is_constant
    optimizer_config = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.001).get_config()
    del optimizer_config["density_warmup_steps"]
    loaded = tf_topk.TopKOptimizer.from_config(optimizer_config)
    assert loaded.density_warmup_steps == 0 and loaded.exchange_config.schedule.is_constant


def test_a_custom_loop_hears_that_its_run_ends_inside_the_warmup(capsys):
    """`SparseExchange.say_if_run_ends_in_warmup(steps)`: the line `fit` says, for the steps a loop plans."""
    exchange = tf_topk.SparseExchange([tf.Variable(tf.zeros([5000]))], density=0.01)
    line = exchange.say_if_run_ends_in_warmup(84)
    assert line == ("tf_topk: this run ends at step 84, inside the 400-step warm-up of density 0.01: its last steps "
                    "send density 0.25, not 0.01; density_warmup_steps=0 (or a shorter warm-up) trains at the "
                    "density given")
    assert line in capsys.readouterr().err
    assert exchange.say_if_run_ends_in_warmup(400) is None
    assert "0.11, not 0.01" in exchange.say_if_run_ends_in_warmup(200)
    assert tf_topk.SparseExchange([tf.Variable(tf.zeros([5000]))], density=0.01,
                                  density_warmup_steps=0).say_if_run_ends_in_warmup(84) is None
