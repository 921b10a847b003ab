"""CompressionStats for tf_keras: the same statistics, logs and TensorBoard scalars as tf_topk.keras's."""

import tf_keras

from tf_topk.adapter import CompressionStatsLogic


class CompressionStats(CompressionStatsLogic, tf_keras.callbacks.Callback):
    """Adds the last step's compression statistics to the logs of each epoch
    (`topk_density` and `topk_bytes_ratio`; every `topk_*` with `logs="all"`)
    and, with `log_dir`, writes them all as TensorBoard scalars (`topk/*`)
    every `update_freq` steps. See `tf_topk.keras.CompressionStats`.

    Example:
      >>> model.fit(x, y, callbacks=[tf_topk.tf_keras.CompressionStats(log_dir="logs")])
    """

    def __init__(self, log_dir=None, update_freq=50, logs="compact"):
        super().__init__()
        self._init_stats(log_dir, update_freq, logs)
