"""`tf_topk.gather.all_gather_rows`: TensorFlow's all_gather result in one collective, not two."""

import pytest
import subprocess
import textwrap

from multiworker import PYTHON, subprocess_env

CODE = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
    from tf_topk.gather import all_gather_rows, gathers_in_one_collective

    def rows(strategy):
        def replica_fn():
            context = tf.distribute.get_replica_context()
            r = tf.cast(context.replica_id_in_sync_group, tf.float32)
            row = tf.concat([tf.fill([2], r), tf.range(3.0) * (r + 1.0)], 0)
            return all_gather_rows(context, row), context.all_gather(row, axis=0)
        return replica_fn

    out = {}
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    traced = tf.function(lambda: strategy.run(rows(strategy)))
    for name, run in (("traced", traced), ("eager", lambda: strategy.run(rows(strategy)))):
        ours, tfs = run()
        out[name] = [[v.numpy().tolist() for v in strategy.experimental_local_results(x)] for x in (ours, tfs)]
    graph = traced.get_concrete_function().graph
    out["gathers"] = sum(op.type == "CollectiveGatherV2" for op in graph.get_operations())
    out["one_collective"] = gathers_in_one_collective(strategy)
    # Cross-device ops without collectives: TensorFlow's own all_gather, the same rows.
    reducing = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    ours, tfs = tf.function(lambda: reducing.run(rows(reducing)))()
    out["fallback"] = [[v.numpy().tolist() for v in reducing.experimental_local_results(x)] for x in (ours, tfs)]
    out["fallback_one_collective"] = gathers_in_one_collective(reducing)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_rows_gathered_in_one_collective_equal_tensorflows_all_gather(tmp_path):
    proc = subprocess.run([*PYTHON, "-c", CODE], cwd=str(tmp_path), env=subprocess_env(), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    expected = [0, 0, 0, 1, 2, 1, 1, 0, 2, 4, 2, 2, 0, 3, 6]  # each replica's row, in replica order
    for name in ("traced", "eager"):
        ours, tensorflows = out[name]
        assert ours == [expected] * 3 and tensorflows == ours, name
    # 3 replicas: one gather each, where TensorFlow's all_gather adds a gather of the shapes to each (3 + 6).
    assert out["one_collective"] and out["gathers"] == 3 + 6
    ours, tensorflows = out["fallback"]
    assert not out["fallback_one_collective"] and ours == tensorflows == [expected[:10]] * 2
