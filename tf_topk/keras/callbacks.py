"""Keras callbacks: the exchange's statistics as logs and TensorBoard scalars
(`CompressionStats`), and the wall time of each training step (`StepTimer`)."""

import time

import keras

from tf_topk.adapter import CompressionStatsLogic, find_topk_optimizer

__all__ = ["CompressionStats", "StepTimer", "find_topk_optimizer"]


class CompressionStats(CompressionStatsLogic, keras.callbacks.Callback):
    """Adds the last step's compression statistics to the logs of each epoch.

    By default two keys, short enough for the progress bar: `topk_density`
    (the density sent) and `topk_bytes_ratio` (a worker's bytes a step over
    what the dense all-reduce would send). `logs="all"` adds the rest: selected
    entries, `bytes_sent` and `bytes_dense`, the residual norm, the contraction
    ||acc - topk(acc)||^2 / ||acc||^2 beside the random-k bound 1 - k/d (top-k
    is typically far below it) and the route's code. With `log_dir`, every
    statistic goes to TensorBoard (tags `topk/...`) every `update_freq` steps;
    the tensorboard package is needed only to view them. At `fit`'s start it
    says (on the chief) when the planned steps end inside a fixed density's
    warm-up. For tf_keras (Keras 2), `tf_topk.tf_keras.CompressionStats` does
    the same.

    Example:
      >>> model.fit(x, y, callbacks=[tf_topk.keras.CompressionStats(log_dir="logs")])
    """

    def __init__(self, log_dir=None, update_freq=50, logs="compact"):
        super().__init__()
        self._init_stats(log_dir, update_freq, logs)


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
