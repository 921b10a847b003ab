"""Keras callbacks: the exchange's statistics as logs and TensorBoard scalars
(`CompressionStats`), and the wall time of each training step (`StepTimer`)."""

import time

import keras

from tf_topk.adapter import CompressionStatsLogic, find_topk_optimizer

__all__ = ["CompressionStats", "StepTimer", "find_topk_optimizer"]


class CompressionStats(CompressionStatsLogic, keras.callbacks.Callback):
    """Adds the last step's compression statistics to the logs of each epoch.

    Keys (prefixed `topk_`): density achieved, selected entries, bytes sent per
    worker per step and what the dense all-reduce would send, residual norm,
    and the contraction ||acc - topk(acc)||^2 / ||acc||^2 beside the random-k
    bound 1 - k/d (top-k is typically far below it). With `log_dir`, also
    writes them as TensorBoard scalars (tags `topk/...`) every `update_freq`
    steps; the tensorboard package is needed only to view them. For tf_keras
    (Keras 2), `tf_topk.tf_keras.CompressionStats` does the same.

    Example:
      >>> model.fit(x, y, callbacks=[tf_topk.keras.CompressionStats(log_dir="logs")])
    """

    def __init__(self, log_dir=None, update_freq=50):
        super().__init__()
        self._init_stats(log_dir, update_freq)


class StepTimer(keras.callbacks.Callback):
    """The wall time of each training batch, in seconds (`times`), as the demo
    and the benchmarks report a step: from the batch's begin to its end on
    this worker, the exchange included.

    Example:
      >>> timer = tf_topk.keras.StepTimer()
      >>> model.fit(x, y, callbacks=[timer])
      >>> statistics.median(timer.times[len(timer.times) // 5:])   # after the first steps' traces
    """

    def __init__(self):
        super().__init__()
        self.times = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)
