"""SparseExchange's agreed-index all-reduce, on every replica, for a numpy reference.

Usage: agreed_replicas.py OUT_DIR CONFIG_JSON (from tests/test_exchange_allreduce.py).
Under TF_CONFIG: MultiWorkerMirroredStrategy, one replica per worker process,
writing OUT_DIR/worker<i>.npz. Without: MirroredStrategy over `replicas`
logical CPUs in this process, writing OUT_DIR/local.npz. Every process makes
the same gradients (one seed) and each replica takes its own. Runs: plain
error feedback with exchange_mode="allreduce" (nominated indices, one bucket, a
non-finite gradient on one replica at `nan_step`), the same with ScaleCom's
leader rule (leader from the call count), the same gradients on every
replica (all nominate the same entries), one bucket per variable, momentum
correction with DGC's momentum factor masking, and exchange_mode="auto"
under a density schedule whose first step goes dense. Writes per run, step
and replica the summed gradients, the residuals, velocities and statistics.
"""

import json
import os
import sys

import numpy as np

out_dir, config = sys.argv[1], json.loads(sys.argv[2])
SHAPES = [tuple(shape) for shape in config["shapes"]]
REPLICAS, STEPS, DENSITY, NAN_STEP = config["replicas"], config["steps"], config["density"], config["nan_step"]
MULTI_WORKER = "TF_CONFIG" in os.environ

import tensorflow as tf  # noqa: E402

if MULTI_WORKER:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    out_path = os.path.join(out_dir, f"worker{json.loads(os.environ['TF_CONFIG'])['task']['index']}.npz")
else:
    cpu = tf.config.list_physical_devices("CPU")[0]  # one logical CPU per replica, before TensorFlow starts
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    out_path = os.path.join(out_dir, "local.npz")
assert strategy.num_replicas_in_sync == REPLICAS

import tf_topk  # noqa: E402

rng = np.random.default_rng(11)
grads = [[[rng.standard_normal(shape).astype(np.float32) for shape in SHAPES] for _ in range(REPLICAS)]
         for _ in range(STEPS)]
grads[NAN_STEP][1][0].flat[3] = np.nan  # only the runs "ef" and "ef_leader" get it
common = dict(method="exact", min_size=config["min_size"], density_warmup_steps=0)
RUNS = {
    "ef": dict(exchange_mode="allreduce", density=DENSITY),
    "ef_leader": dict(router=tf_topk.routes.FixedRouter(tf_topk.routes.AgreedIndexRoute("leader")), density=DENSITY),
    "ef_slots2": dict(router=tf_topk.routes.FixedRouter(tf_topk.routes.AgreedIndexRoute(slots=2)), density=DENSITY),
    "ef_same": dict(exchange_mode="allreduce", density=DENSITY),  # every replica gets replica 0's gradients
    "ef_buckets": dict(exchange_mode="allreduce", density=DENSITY, bucket_bytes=8),
    "dgc": dict(exchange_mode="allreduce", density=DENSITY, momentum=config["momentum"], momentum_masking=True),
    "auto_schedule": dict(exchange_mode="auto", density=[(0, config["first_density"]), (1, DENSITY)]),
}
saved = {}
for label, options in RUNS.items():
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]
        exchange = tf_topk.SparseExchange(variables, **common, **options)
    pass_step = label != "ef_leader"  # "ef_leader": the leader rotates with the number of calls

    @tf.function
    def step(step_grads, s):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            mine = [tf.gather(g, replica) for g in step_grads]
            result = exchange(mine, step=s if pass_step else None)
            return result.grads, result.all_finite, result.stats

        return strategy.run(replica_fn)

    for s in range(STEPS):
        inputs = [np.stack([grads[s][r][v] for r in range(REPLICAS)]) for v in range(len(SHAPES))]
        if label not in ("ef", "ef_leader") and s == NAN_STEP:
            inputs[0] = np.nan_to_num(inputs[0])
        if label == "ef_same":
            inputs = [np.repeat(x[:1], REPLICAS, axis=0) for x in inputs]
        out, all_finite, stats = step([tf.constant(x) for x in inputs], tf.constant(s, tf.int64))
        local = strategy.experimental_local_results
        for i, replica_out in enumerate(local(all_finite)):
            r = i if not MULTI_WORKER else int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
            prefix = f"{label}/step{s}/replica{r}"
            saved[f"{prefix}/all_finite"] = np.array(bool(replica_out))
            for v in range(len(SHAPES)):
                saved[f"{prefix}/grad{v}"] = local(out[v])[i].numpy()
            for name in ("bytes_sent", "exchange_mode", "selected"):
                saved[f"{prefix}/{name}"] = local(stats[name])[i].numpy()
            for slot, residual in enumerate(exchange.residuals):
                saved[f"{prefix}/residual{slot}"] = local(residual)[i].numpy()
            for slot, velocity in enumerate(getattr(exchange.memory, "velocities", None) or []):
                saved[f"{prefix}/velocity{slot}"] = local(velocity)[i].numpy()
saved.update({f"input/step{s}/grad{v}": np.stack([grads[s][r][v] for r in range(REPLICAS)])
              for s in range(STEPS) for v in range(len(SHAPES))})
np.savez(out_path, **saved)
print("OK")
