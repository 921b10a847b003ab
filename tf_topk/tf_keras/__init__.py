"""tf_keras (Keras 2) adapter of tf_topk: `TopKOptimizer` and `CompressionStats` for `tf_keras`.

For code that runs on Keras 2 through the `tf_keras` package
(`TF_USE_LEGACY_KERAS=1`, or `import tf_keras as keras`). The same exchange,
arguments and behaviour as `tf_topk.TopKOptimizer` (Keras 3); only the Keras
it speaks to differs:

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1), density=0.01),
                      loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[tf_topk.tf_keras.CompressionStats(),
                               tf_keras.callbacks.BackupAndRestore("/shared/backup")])

tf_keras is an optional dependency: `import tf_topk` never imports it, and
importing this package without it raises an ImportError that says what to
install.
"""

try:
    import tf_keras  # noqa: F401  (the Keras 2 package, not this one)
except ImportError as error:
    import tensorflow as _tf

    _release = ".".join(_tf.__version__.split(".")[:2])
    raise ImportError(
        "tf_topk.tf_keras is the adapter for Keras 2 and needs the tf_keras package, which could not be "
        f"imported ({error}). Install the release matching TensorFlow {_tf.__version__}: "
        f"pip install 'tf_keras=={_release}.*'. For Keras 3, use tf_topk.TopKOptimizer instead.") from error

from tf_topk.tf_keras.optimizer import TopKOptimizer, restore_optimizer_variables  # noqa: E402
from tf_topk.tf_keras.callbacks import CompressionStats  # noqa: E402

__all__ = ["CompressionStats", "TopKOptimizer", "restore_optimizer_variables"]
