"""What the wrapper's dense route adds to a training step, against Keras's own dense all-reduce.

The demo's MLP on scikit-learn's digits under MirroredStrategy over two logical CPUs of this process
(no network: the step is compute and the exchange's own work), trained with Keras's SGD alone,
with `TopKOptimizer(SGD)` on its every-entry-dense route (what the default takes where the plan is
dense: `min_size` above every variable), and at density 0.01. The three are interleaved, `--repeats`
times, so a busy machine slows all of them alike; each run's median step time after the first
fifth of its steps, then the median over runs and each ratio to dense.

    python benchmarks/dense_route_overhead.py [--repeats 4] [--epochs 4]
"""

import argparse
import os
import statistics

CONFIGURATIONS = ("keras dense", "wrapper, every entry dense", "wrapper, density 0.01")


def median_step_ms(configuration, strategy, data, epochs):
    import keras

    import tf_topk

    x, y = data
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
        inner = keras.optimizers.SGD(0.3)
        optimizer = {"keras dense": lambda: inner,
                     "wrapper, every entry dense": lambda: tf_topk.TopKOptimizer(inner, min_size=1 << 40),
                     "wrapper, density 0.01": lambda: tf_topk.TopKOptimizer(inner, density=0.01)}[configuration]()
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
    timer = tf_topk.keras.StepTimer()
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[timer])
    return 1e3 * statistics.median(timer.times[len(timer.times) // 5:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.epochs < 1:
        parser.error(f"--repeats and --epochs must be >= 1, got {args.repeats} and {args.epochs}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 2)
    from tf_topk.bench.data import load_data

    x, y, _, _ = load_data("digits", 0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    times = {configuration: [] for configuration in CONFIGURATIONS}
    for repeat in range(args.repeats):
        for configuration in CONFIGURATIONS:
            times[configuration].append(median_step_ms(configuration, strategy, (x, y), args.epochs))
        print(f"repeat {repeat + 1} of {args.repeats}: " +
              ", ".join(f"{c} {t[-1]:.2f} ms" for c, t in times.items()), flush=True)
    dense = statistics.median(times["keras dense"])
    print(f"\n{'configuration':<28} {'median step':>12} {'vs keras dense':>15}")
    for configuration, values in times.items():
        median = statistics.median(values)
        print(f"{configuration:<28} {median:>9.2f} ms {median / dense:>14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
