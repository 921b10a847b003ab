"""Single process, one logical CPU per replica: SparseExchange under MirroredStrategy against numpy.

Usage: exchange_replicas.py OUT.npz CONFIG_JSON, the configuration coming
from tests/test_exchange.py: variable shapes, min_size, density, replicas,
steps, and the momentum-correction settings. Each replica gets its own
gradients. The same steps run with one bucket (bucket_bytes=None), with one
bucket per sparsified variable, and with momentum correction (DGC's, with
masking, plain and Nesterov with local clipping; and the default, unmasked). Writes, per run and step, what each replica
returned and each replica's residuals and velocities, plus the inputs; the
test compares them with a numpy reference. Exits non-zero on any failure.
"""

import json
import os
import sys

os.environ.pop("TF_CONFIG", None)

import numpy as np
import tensorflow as tf

out_path, config = sys.argv[1], json.loads(sys.argv[2])
SHAPES = [tuple(shape) for shape in config["shapes"]]
MIN_SIZE, DENSITY, REPLICAS, STEPS = config["min_size"], config["density"], config["replicas"], config["steps"]
cpu = tf.config.list_physical_devices("CPU")[0]  # one logical CPU per replica, before TensorFlow starts
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import tf_topk  # noqa: E402

rng = np.random.default_rng(7)
# grads[step][replica][variable]; continuous values, so the exact top-k has no ties.
grads = [[[rng.standard_normal(shape).astype(np.float32) for shape in SHAPES] for _ in range(REPLICAS)]
         for _ in range(STEPS)]
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
assert strategy.num_replicas_in_sync == REPLICAS

saved = {}
MOMENTUM, CLIPNORM = config["momentum"], config["local_clipnorm"]
RUNS = {
    "one_bucket": dict(bucket_bytes=None),
    "per_variable": dict(bucket_bytes=8 * 30),
    "dgc": dict(momentum=MOMENTUM, momentum_masking=True),
    "dgc_nesterov_clip": dict(momentum=MOMENTUM, nesterov=True, local_clipnorm=CLIPNORM, bucket_bytes=8 * 30,
                              momentum_masking=True),
    "momentum_unmasked": dict(momentum=MOMENTUM),  # the default: no momentum factor masking
}
for label, options in RUNS.items():
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]
        exchange = tf_topk.SparseExchange(variables, density=DENSITY, method="exact", min_size=MIN_SIZE,
                                          density_warmup_steps=0,
                                          **options)
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
            for slot, velocity in enumerate(getattr(exchange.memory, "velocities", None) or []):
                saved[f"{label}/step{s}/replica{r}/velocity{slot}"] = velocity.values[r].numpy()
            for slot, velocity in enumerate(getattr(exchange.memory, "dense_velocities", None) or []):
                saved[f"{label}/step{s}/replica{r}/dense_velocity{slot}"] = velocity.values[r].numpy()
for s in range(STEPS):
    for r in range(REPLICAS):
        for v in range(len(SHAPES)):
            saved[f"input/step{s}/replica{r}/grad{v}"] = grads[s][r][v]
np.savez(out_path, **saved)
print("OK")
