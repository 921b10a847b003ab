"""Calibrate under a strategy and write what was found: `calibrate_worker.py OUT_DIR workers|local:N [trial|late]`.

workers: MultiWorkerMirroredStrategy from TF_CONFIG (one replica per worker);
local:N: MirroredStrategy over N logical CPUs of this process;
trial: time the dense and two sparse steps whole (densities 0.003 and 0.03),
however far apart the time model puts them, within a 3 s budget (the steps' third is set aside
for them, however long a loaded machine took over the parts before).
late: worker 1 starts calibrating 4 s after worker 0 (it built its model later), with a 3 s
budget: worker 0's own clock is then past the budget when the dense all-reduce is decided on,
worker 1's is not.

A worker exits only once every worker has written its file: one that left as soon as its own last
collective returned could close its socket while a peer still fetched its part of that collective
("Socket closed" in the peer's RecvBuf).
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import tensorflow as tf

out_dir, where = sys.argv[1], sys.argv[2]
if where == "workers":
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf_config = json.loads(os.environ["TF_CONFIG"])
    task, workers = tf_config["task"]["index"], len(tf_config["cluster"]["worker"])
else:
    replicas = int(where.split(":")[1])
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * replicas)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    task, workers = 0, 1

import tf_topk.calibrate  # noqa: E402
from tf_topk.gather import gathers_in_one_collective  # noqa: E402

trial, late = sys.argv[3:] == ["trial"], sys.argv[3:] == ["late"]
if trial:
    tf_topk.calibrate.CLOSE_CALL = float("inf")
if late and task == 1:
    time.sleep(4.0)
found = tf_topk.calibrate.calibrate(strategy, entries=300_000, budget_s=3.0 if late or trial else 1.5,
                                    small_entries=1_000,
                                    trial_density=0.003 if trial else None,
                                    trial_max_density=0.03 if trial else None, profile_density=0.1)
print(found.describe())
with open(os.path.join(out_dir, f"calibration{task}.json"), "w") as f:
    json.dump({"model": dataclasses.asdict(found.model), "points": found.points, "dense_s": found.dense_s,
               "dense_predicted_s": found.dense_predicted_s, "seconds": found.seconds,
               "sparse_s": found.sparse_s, "sparse_predicted_s": found.sparse_predicted_s, "trial_k": found.trial_k,
               "sparse_max_s": found.sparse_max_s, "trial_max_k": found.trial_max_k,
               "phases": found.phases, "line": found.describe(), "gathers_in_one_collective": gathers_in_one_collective(strategy)}, f)

outputs = [Path(out_dir) / f"calibration{i}.json" for i in range(workers)]
deadline = time.monotonic() + 60.0
while not all(path.exists() for path in outputs) and time.monotonic() < deadline:
    time.sleep(0.05)
