"""Two replicas on logical CPUs apply gradient tensors made outside `strategy.run`, as Keras's own
OptimizerDistributeTest does: one tensor for both replicas (test_ema), and one tensor for two
variables in one call (test_weight_decay). TopKOptimizer at density 1.0, on the dense path and with
min_size=1 on the top-k path, and Keras's SGD end with the same variables: TensorFlow's all-reduce
counts a tensor that is the same object on every replica once, and so does every route. Prints SAME
or DIFFERENT, then the values."""

import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402

import tf_topk  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
results = []
for wrapper_options in (None, {"density": 1.0}, {"density": 1.0, "min_size": 1}):
    def make(**options):
        inner = keras.optimizers.SGD(1.0, **options)
        return inner if wrapper_options is None else tf_topk.TopKOptimizer(inner, **wrapper_options)

    with strategy.scope():
        matrix = keras.Variable([[3.0, 4.0], [5.0, 6.0]])
        grads = tf.ones([2, 2])  # test_ema's: made outside, the same object on both replicas
        optimizer = make(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)
        for _ in range(3):
            strategy.run(lambda: optimizer.apply_gradients([(grads, matrix)]))
        decayed, excluded = keras.Variable(2.0), keras.Variable(3.0, name="exclude")
        zero = tf.zeros(())  # test_weight_decay's: one object for two variables in one call
        optimizer = make(weight_decay=0.004)
        optimizer.exclude_from_weight_decay(var_names=["exclude"])
        strategy.run(lambda: optimizer.apply_gradients(zip([zero, zero], [decayed, excluded])))
    results.append([matrix.numpy(), decayed.numpy(), excluded.numpy()])
same = all(np.allclose(a, b, atol=1e-6) for wrapped in results[1:] for a, b in zip(results[0], wrapped))
print("SAME" if same else "DIFFERENT", [[float(np.reshape(w, -1)[0]) for w in r] for r in results])
