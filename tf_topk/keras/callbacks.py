"""CompressionStats: the exchange's statistics as Keras logs and TensorBoard scalars."""

import keras
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from tf_topk.keras.optimizer import TopKOptimizer

# What TensorBoard's scalar summary writes, without needing the tensorboard
# package: tf.summary.scalar raises TBNotInstalledError without it, and
# TensorFlow 2.21 does not depend on it.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
    plugin_name="scalars"))


def find_topk_optimizer(optimizer):
    """The TopKOptimizer in `optimizer`, unwrapping LossScaleOptimizer; None if absent."""
    while optimizer is not None:
        if isinstance(optimizer, TopKOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


class CompressionStats(keras.callbacks.Callback):
    """Adds the last step's compression statistics to the logs of each epoch.

    Keys (prefixed `topk_`): density achieved, selected entries, bytes sent per
    worker per step and what the dense all-reduce would send, residual norm,
    and the contraction ||acc - topk(acc)||^2 / ||acc||^2 beside the random-k
    bound 1 - k/d (top-k is typically far below it). With `log_dir`, also
    writes them as TensorBoard scalars (tags `topk/...`) every `update_freq`
    steps; the tensorboard package is needed only to view them.

    Example:
      >>> model.fit(x, y, callbacks=[tf_topk.keras.CompressionStats(log_dir="logs")])
    """

    def __init__(self, log_dir=None, update_freq=50):
        super().__init__()
        if isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1:
            raise ValueError(f"update_freq must be an int >= 1, got {update_freq!r}")
        self.log_dir = log_dir
        self.update_freq = update_freq
        self._writer = None
        self._step = 0

    def _optimizer(self):
        optimizer = find_topk_optimizer(self.model.optimizer)
        if optimizer is None:
            raise ValueError("CompressionStats needs a model compiled with tf_topk.TopKOptimizer, "
                             f"got optimizer {self.model.optimizer!r}")
        return optimizer

    def on_train_begin(self, logs=None):
        self._optimizer()
        if self.log_dir:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._writer is not None and self._step % self.update_freq == 0:
            with self._writer.as_default(step=self._step):
                for name, value in self._optimizer().compression_stats().items():
                    tf.summary.write(f"topk/{name}", tf.cast(value, tf.float32), metadata=_SCALAR_METADATA)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            for name, value in self._optimizer().compression_stats().items():
                logs[f"topk_{name}"] = value

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
