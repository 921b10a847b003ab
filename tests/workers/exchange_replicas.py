"""Single process, two logical CPUs: SparseExchange under MirroredStrategy against numpy.

Three sparsified variables and one small dense one; each replica gets its own
gradients. The same two steps run with one bucket (bucket_bytes=None) and with
one bucket per sparsified variable. Writes, per bucketing and step, what each
replica returned and each replica's residuals to the .npz named on the
command line, plus the inputs; tests/test_exchange.py compares them with a
numpy reference. Exits non-zero on any failure.
"""

import os
import sys

os.environ.pop("TF_CONFIG", None)

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import tf_topk  # noqa: E402

SHAPES = [(40, 50), (300,), (3000,), (25, 80)]  # 2000, 300 (dense: below min_size), 3000, 2000 entries
MIN_SIZE, DENSITY, REPLICAS, STEPS = 1000, 0.01, 2, 2

out_path = sys.argv[1]
rng = np.random.default_rng(7)
# grads[step][replica][variable]; continuous values, so the exact top-k has no ties.
grads = [[[rng.standard_normal(shape).astype(np.float32) for shape in SHAPES] for _ in range(REPLICAS)]
         for _ in range(STEPS)]
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
assert strategy.num_replicas_in_sync == REPLICAS

saved = {}
for label, bucket_bytes in (("one_bucket", None), ("per_variable", 8 * 30)):
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]
        exchange = tf_topk.SparseExchange(variables, density=DENSITY, method="exact", min_size=MIN_SIZE,
                                          bucket_bytes=bucket_bytes)
    saved[f"{label}/num_buckets"] = np.array(exchange.num_buckets)

    @tf.function
    def step(step_grads):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            mine = [tf.gather(tf.stack([g[r] for r in range(REPLICAS)]), replica) for g in step_grads]
            result = exchange(mine)
            return result.grads, result.all_finite

        return strategy.run(replica_fn)

    for s in range(STEPS):
        per_variable = [tf.constant(np.stack([grads[s][r][v] for r in range(REPLICAS)])) for v in range(len(SHAPES))]
        out, all_finite = step(per_variable)
        for r in range(REPLICAS):
            assert bool(strategy.experimental_local_results(all_finite)[r])
            for v in range(len(SHAPES)):
                saved[f"{label}/step{s}/replica{r}/grad{v}"] = strategy.experimental_local_results(out[v])[r].numpy()
            for slot, residual in enumerate(exchange.residuals):
                saved[f"{label}/step{s}/replica{r}/residual{slot}"] = residual.values[r].numpy()
for s in range(STEPS):
    for r in range(REPLICAS):
        for v in range(len(SHAPES)):
            saved[f"input/step{s}/replica{r}/grad{v}"] = grads[s][r][v]
np.savez(out_path, **saved)
print("OK")
