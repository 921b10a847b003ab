"""Models compiled with TopKOptimizer load in a new process after `import tf_topk`, in any import order.

`import tf_topk` imports no Keras, so TopKOptimizer is registered with each
Keras (`keras`, `tf_keras`) when that Keras is imported: these checks need
fresh processes, where nothing has touched `tf_topk.TopKOptimizer` yet. The
models are trained and saved here; each subprocess loads all of them.
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
import tf_keras

import tf_topk
import tf_topk.tf_keras

from multiworker import REPO_ROOT, worker_env
from tensorflow_warnings import tensorflow_warnings

LOAD = r"""
import importlib, json, sys, warnings
import numpy as np

order, api, saved = sys.argv[1].split(","), sys.argv[2], json.loads(sys.argv[3])
with_tf_topk = None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for name in order:
        importlib.import_module(name)
        if name == "tf_topk":
            with_tf_topk = sorted(m for m in ("keras", "tf_keras", "tensorflow") if m in sys.modules)
    import keras, tensorflow as tf, tf_keras
    loaders = {"keras": keras.models.load_model, "tf.keras": tf.keras.models.load_model,
               "tf_keras": tf_keras.models.load_model}
    report = {"imported_with_tf_topk": with_tf_topk, "models": {}}
    for name, entry in saved.items():
        model = loaders[api if entry["keras"] == "keras" else "tf_keras"](entry["path"])
        optimizer = model.optimizer
        report["models"][name] = {
            "type": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
            "config": json.loads(json.dumps(optimizer.get_config(), default=repr)),
            # Called, not predict(): six predict functions traced in one process make TensorFlow warn of retracing.
            "predictions": np.asarray(model(np.load(entry["x"]), training=False)).tolist(),
            "residuals": [r.numpy().tolist() for r in optimizer.residuals],
            "dct_row_sides": [t.row_side for t in getattr(getattr(optimizer.exchange, "memory", None), "transforms", None) or []],
        }
report["warnings"] = [str(w.message) for w in caught if "tf_topk" in str(w.message)]
print("REPORT " + json.dumps(report))
"""


def jsonable_config(optimizer):
    return json.loads(json.dumps(optimizer.get_config(), default=repr))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Keras 3 `.keras` file and a tf_keras `.keras` file and SavedModel, each trained one epoch
    with its TopKOptimizer; returns what the loads must give back, by name."""
    path = tmp_path_factory.mktemp("saved")
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 8), dtype=np.float32), rng.random((64, 2), dtype=np.float32)
    np.save(path / "x.npy", x)
    models = {}

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.25, min_size=100),
                  loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "keras3.keras")
    models["keras3"] = dict(keras="keras", path=str(path / "keras3.keras"), model=model)

    # Adam's momentum correction: its extra state, in a new process too.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01), density=0.25, min_size=100,
                                                  momentum_correction=True, variance_warmup_steps=1), loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "keras3_adamw.keras")
    models["keras3_adamw"] = dict(keras="keras", path=str(path / "keras3_adamw.keras"), model=model)

    # AdamW at a low fixed density: decoupled momentum by default, its per-replica momentum in the file;
    # the sparsified variable an embedding table, whose DCT runs along each row in the new process too.
    keras.utils.set_random_seed(0)
    tokens = rng.integers(0, 32, (64, 4)).astype(np.int32)
    np.save(path / "tokens.npy", tokens)
    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(32, 8), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01), density=0.01, min_size=100),
                  loss="mse")
    model.fit(tokens, y, batch_size=16, verbose=0)
    assert model.optimizer.decoupled_momentum is True
    assert [t.row_side for t in model.optimizer.exchange.memory.transforms] == [1]
    model.save(path / "keras3_decoupled.keras")
    models["keras3_decoupled"] = dict(keras="keras", path=str(path / "keras3_decoupled.keras"), model=model,
                                      x=str(path / "tokens.npy"))

    # One selection over the bucket (selection_scope="bucket"): the option comes back with the model.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.25, min_size=100,
                                                  exchange_mode="allgather", selection_scope="bucket"), loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "keras3_bucket.keras")
    models["keras3_bucket"] = dict(keras="keras", path=str(path / "keras3_bucket.keras"), model=model)

    # A fixed low density saved in its warm-up, with a floor under k: the options come back, the warm-up
    # goes on from the step.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.001, min_size=100,
                                                  density_warmup_steps=40, config=tf_topk.ExchangeConfig(min_k=4)),
                  loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "keras3_warmup.keras")
    models["keras3_warmup"] = dict(keras="keras", path=str(path / "keras3_warmup.keras"), model=model)

    # Residuals that follow a decaying rate (rescale_residuals=True): the option and its state come back.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    cosine = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=8)
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(cosine), density=0.25, min_size=100,
                                                  config=tf_topk.ExchangeConfig(rescale_residuals=True)),
                  loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "keras3_rescaled.keras")
    models["keras3_rescaled"] = dict(keras="keras", path=str(path / "keras3_rescaled.keras"), model=model)

    # Pairs in 32-bit words (exchange_mode="allgather_int8"): the mode and the residuals that hold its rounding.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.25, min_size=100,
                                                  exchange_mode="allgather_int8"), loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "keras3_int8.keras")
    models["keras3_int8"] = dict(keras="keras", path=str(path / "keras3_int8.keras"), model=model)

    # Each chunk's top entries in 14 bits (exchange_mode="allgather_chunk"), in Keras 3 and in tf_keras.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.25, min_size=100,
                                                  exchange_mode="allgather_chunk"), loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "keras3_chunk.keras")
    models["keras3_chunk"] = dict(keras="keras", path=str(path / "keras3_chunk.keras"), model=model)
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(16), tf_keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1), density=0.25,
                                                           min_size=100, exchange_mode="allgather_chunk"),
                  loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "tf_keras_chunk.keras")
    models["tf_keras_chunk"] = dict(keras="tf_keras", path=str(path / "tf_keras_chunk.keras"), model=model)

    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(16), tf_keras.layers.Dense(2)])
    model.compile(optimizer=tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1), density=0.25,
                                                           min_size=100), loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(path / "tf_keras.keras")
    model.save(path / "tf_keras_saved_model", save_format="tf")
    models["tf_keras"] = dict(keras="tf_keras", path=str(path / "tf_keras.keras"), model=model)
    models["tf_keras_saved_model"] = dict(keras="tf_keras", path=str(path / "tf_keras_saved_model"), model=model)

    expected = {}
    for name, entry in models.items():
        optimizer = entry["model"].optimizer
        residuals = [r.numpy() for r in optimizer.residuals]
        assert len(residuals) == 1 and np.abs(residuals[0]).sum() > 0  # the 8x16 kernel (or table), sparsified
        inputs = entry.get("x", str(path / "x.npy"))
        expected[name] = dict(keras=entry["keras"], path=entry["path"], x=inputs,
                              type=f"{type(optimizer).__module__}.TopKOptimizer",
                              config=jsonable_config(optimizer),
                              predictions=entry["model"].predict(np.load(inputs), verbose=0), residuals=residuals)
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("order,api", [
    ("keras,tf_keras,tf_topk", "keras"),  # registered by `import tf_topk`
    ("tf_topk,keras,tf_keras", "keras"),  # registered when each Keras is imported
    ("tensorflow,tf_topk", "tf.keras"),  # TensorFlow imported Keras 3 before tf_topk
    ("tf_topk,tensorflow", "tf.keras"),  # ... after tf_topk, from within TensorFlow's own import
    ("tf_topk.routes,keras,tf_keras", "keras"),  # Keras imported while a tf_topk module is half imported
])
def test_saved_models_load_in_a_new_process(saved, order, api):
    arguments = {name: {k: entry[k] for k in ("keras", "path", "x")} for name, entry in saved.items()}
    env = worker_env(CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    # subprocess.run kills the process if it runs past the timeout.
    proc = subprocess.run([sys.executable, "-c", LOAD, order, api, json.dumps(arguments)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert tensorflow_warnings(proc.stderr) == []
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert report["warnings"] == []
    if order.split(",")[0] == "tf_topk":
        assert report["imported_with_tf_topk"] == []  # `import tf_topk` imports neither Keras nor TensorFlow
    assert sorted(report["models"]) == sorted(saved)
    for name, entry in saved.items():
        loaded = report["models"][name]
        assert loaded["type"] == entry["type"], name
        assert loaded["config"] == entry["config"], name
        assert loaded["config"]["selection_scope"] == ("bucket" if name == "keras3_bucket" else "variable"), name
        assert loaded["config"]["rescale_residuals"] is (name == "keras3_rescaled"), name
        assert loaded["config"]["min_k"] == (4 if name == "keras3_warmup" else 1), name
        if name == "keras3_warmup":
            assert (loaded["config"]["density"], loaded["config"]["density_warmup_steps"]) == (0.001, 40)
        # Decoupled momentum's transform is made again on load: the embedding table's rows stay apart.
        assert loaded["dct_row_sides"] == ([1] if name == "keras3_decoupled" else []), name
        np.testing.assert_allclose(np.array(loaded["predictions"]), entry["predictions"], rtol=1e-6, atol=1e-7)
        if name != "tf_keras_saved_model":  # a SavedModel's optimizer variables: restore_optimizer_variables
            np.testing.assert_array_equal(np.array(loaded["residuals"][0], np.float32), entry["residuals"][0])
