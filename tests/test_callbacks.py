"""CompressionStats: compression statistics in the epoch logs and as TensorBoard scalars."""

import math
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import tf_topk
from tf_topk.exchange import STAT_NAMES
from tf_topk.keras import CompressionStats, StepTimer

STEPS_PER_EPOCH, EPOCHS = 4, 3
# Logical CPUs for the two-replica case, made before TensorFlow starts (three, as test_exchange_matrix
# makes them: the last module collected sets the count for the whole session).
try:
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 3)
except RuntimeError:  # TensorFlow already started (another module made them)
    pass


def fit(optimizer, callback):
    x, y = load_digits(return_X_y=True)
    x, y = (x[:256] / 16.0).astype("float32"), y[:256].astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(x, y, batch_size=256 // STEPS_PER_EPOCH, epochs=EPOCHS, verbose=0, callbacks=[callback])


def read_scalars(log_dir):
    """{tag: [(step, value), ...]} from every event file under log_dir."""
    scalars = {}
    for path in tf.io.gfile.glob(f"{log_dir}/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    return scalars


def test_logs_and_tensorboard_scalars(tmp_path):
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01, density_warmup_steps=0)
    history = fit(optimizer, CompressionStats(log_dir=str(tmp_path), update_freq=2, logs="all"))
    k, d = math.ceil(0.01 * 64 * 128), 64 * 128
    for name in (*STAT_NAMES, "bytes_ratio"):
        assert len(history.history[f"topk_{name}"]) == EPOCHS
    assert history.history["topk_density"][-1] == pytest.approx(k / d)
    assert history.history["topk_random_k_bound"][-1] == pytest.approx(1 - k / d)
    assert history.history["topk_bytes_sent"][-1] == 0.0  # one replica sends nothing
    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == sorted(f"topk/{name}" for name in STAT_NAMES)
    steps = [step for step, _ in scalars["topk/density"]]
    assert steps == list(range(2, STEPS_PER_EPOCH * EPOCHS + 1, 2))  # every update_freq steps
    densities = np.array([value for _, value in scalars["topk/density"]])
    np.testing.assert_allclose(densities, k / d, rtol=1e-6)
    assert all(0 < value < 1 - k / d for _, value in scalars["topk/contraction"])


@pytest.mark.slow
def test_step_timer_times_every_training_batch_and_nothing_else():
    """One wall time per training batch (evaluation batches are not steps), each the batch's own."""
    timer = StepTimer()

    class Slow(keras.callbacks.Callback):  # runs inside each batch's window, after the timer's begin
        def on_train_batch_begin(self, batch, logs=None):
            time.sleep(0.02)

    x, y = load_digits(return_X_y=True)
    x, y = (x[:256] / 16.0).astype("float32"), y[:256].astype("int32")
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, epochs=2, verbose=0, validation_data=(x, y), callbacks=[timer, Slow()])
    assert len(timer.times) == 2 * 4
    assert all(seconds >= 0.02 for seconds in timer.times)


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_progress_bar_gets_the_density_and_the_bytes_ratio_alone(replicas):
    """By default two keys reach the epoch logs (and so Keras's progress bar); TensorBoard and
    logs="all" get the rest. Two replicas send pairs: the ratio is bytes_sent over bytes_dense."""
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:replicas]
    assert len(devices) == replicas
    from logical_cpus import mirrored_on_cpus

    with mirrored_on_cpus(replicas, 9_500_000 + 100_000 * replicas).scope():
        optimizer = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01, density_warmup_steps=0)
        history = fit(optimizer, CompressionStats())
    assert sorted(key for key in history.history if key.startswith("topk_")) == ["topk_bytes_ratio", "topk_density"]
    stats = optimizer.compression_stats()
    if replicas == 1:
        assert history.history["topk_bytes_ratio"][-1] == 0.0  # one replica sends nothing
    else:
        assert 0 < history.history["topk_bytes_ratio"][-1] == pytest.approx(stats["bytes_sent"] / stats["bytes_dense"])
        assert history.history["topk_bytes_ratio"][-1] < 0.5  # the small layers go whole


def test_logs_must_be_compact_or_all():
    with pytest.raises(ValueError, match="logs must be 'compact' .* or 'all', got 'some'"):
        CompressionStats(logs="some")


def test_needs_a_topk_optimizer():
    with pytest.raises(ValueError, match="CompressionStats needs a model compiled with tf_topk.TopKOptimizer"):
        fit(keras.optimizers.SGD(0.1), CompressionStats())


@pytest.mark.parametrize("update_freq", [0, -3, 1.5, True, "epoch"])
def test_bad_update_freq_is_named(update_freq):
    with pytest.raises(ValueError, match=rf"update_freq must be an int >= 1, got {update_freq!r}"):
        CompressionStats(update_freq=update_freq)
