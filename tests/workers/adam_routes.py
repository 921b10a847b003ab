"""Single process, one logical CPU per replica: the route "auto" takes for Adam's momentum correction
against plain error feedback's (SGD's), per density.

Usage: adam_routes.py REPLICAS OUT.json (one process per replica count: TensorFlow's collectives keep
one group size per process). For each density, one SparseExchange with Adam's
momentum correction (a warm-up of WARMUP steps) and one with error feedback run STEPS steps of random
gradients under MirroredStrategy; writes the `exchange_mode` statistic of every step.
"""

import json
import os
import sys

os.environ.pop("TF_CONFIG", None)

import numpy as np
import tensorflow as tf

REPLICAS, OUT = int(sys.argv[1]), sys.argv[2]
DENSITIES, WARMUP, STEPS, SIZE = (0.001, 0.3), 2, 4, 40_000
cpu = tf.config.list_physical_devices("CPU")[0]  # one logical CPU per replica, before TensorFlow starts
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import tf_topk  # noqa: E402

rng = np.random.default_rng(5)
results = {}
for replicas in (REPLICAS,):
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    grads = [rng.standard_normal([replicas, SIZE]).astype(np.float32) for _ in range(STEPS)]
    for density in DENSITIES:
        for name, options in (("adam", dict(momentum=0.9, beta_2=0.999, variance_warmup_steps=WARMUP)),
                              ("sgd", {})):
            with strategy.scope():
                variable = tf.Variable(tf.zeros([SIZE]))
                exchange = tf_topk.SparseExchange([variable], density=density, exchange_mode="auto", min_size=1000,
                                                  **options)
                step = tf.Variable(0, dtype=tf.int64)

            @tf.function
            def run(g):
                def replica_fn():
                    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                    result = exchange([tf.gather(g, replica)], step=step)
                    return result.stats["exchange_mode"]
                return strategy.run(replica_fn)

            modes = []
            for s in range(STEPS):
                mode = run(tf.constant(grads[s]))
                step.assign_add(1)
                modes.append(float(strategy.experimental_local_results(mode)[0]))
            results[f"{replicas}/{density}/{name}"] = modes
with open(OUT, "w") as f:
    json.dump(results, f)
print("OK")
