"""tf_topk.configure_coordination: argument checks, and real 2-worker runs.

The 2-worker runs stop worker 1 with SIGSTOP (every thread, the heartbeat
sender included, as a worker stuck behind a slow link would be) and check
that the configured timeout, not MWMS's 10 s default, decides whether the job
survives: 14 s stopped with a 60 s timeout trains on (without
configure_coordination the same stop aborts the job: "The following tasks are
unhealthy (stopped sending heartbeats)"), and 8 s stopped with a 4 s timeout
aborts (without it, 8 s is survived). Run the worker with `--heartbeat 0` to
see the default's behaviour.
"""

import io
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from multiworker import REPO_ROOT, assert_ok, load_json, load_weights, run_script

BAD_TIMEOUTS = [0, -1, 0.0001, math.nan, math.inf, True, "600", None]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_bad_heartbeat_timeout_is_refused(bad):
    from tf_topk.distribute import configure_coordination

    with pytest.raises(ValueError, match=r"heartbeat_timeout_s must be a finite number of seconds >= 0\.001, got "
                                         + re.escape(repr(bad))):
        configure_coordination(heartbeat_timeout_s=bad)


def test_exported_lazily_and_checks_without_tensorflow():
    code = ("import sys, tf_topk\n"
            "try:\n    tf_topk.configure_coordination(heartbeat_timeout_s=-5)\n"
            "except ValueError as e:\n    print(e)\n"
            "print('tensorflow' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["heartbeat_timeout_s must be a finite number of seconds >= 0.001, got -5",
                                        "False"]


def test_nothing_to_coordinate_returns_none(monkeypatch):
    import tensorflow as tf

    from tf_topk.distribute import configure_coordination

    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert configure_coordination(heartbeat_timeout_s=60) is None  # no cluster
    one_worker = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["localhost:1"]}), task_type="worker", task_id=0)
    assert configure_coordination(heartbeat_timeout_s=60, cluster_resolver=one_worker) is None


def _run_with_worker_1_stopped(out, heartbeat_s, stop_s):
    """Run tests/workers/coordination.py on 2 workers; SIGSTOP worker 1 for
    `stop_s` seconds at the start of epoch 1. Returns the LaunchResult."""
    box = {}
    runner = threading.Thread(target=lambda: box.setdefault("result", run_script(
        "coordination.py", "--heartbeat", heartbeat_s, "--stop-at", 1, "--out", out,
        timeout=110, stream=io.StringIO())))
    runner.start()
    pid = None
    try:
        while not (out / "stop_me").exists():
            assert runner.is_alive(), "the workers ended before worker 1 reached epoch 1"
            time.sleep(0.05)
        pid = int((out / "stop_me").read_text())
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stop_s)
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        (out / "go").touch()
        runner.join()  # run_workers stops every worker by its own timeout at the latest
    return box["result"]


@pytest.mark.slow  # 2 TensorFlow workers, one stopped for 14 s: ~30 s
def test_two_workers_configured_before_the_strategy_train_through_a_long_stall(tmp_path):
    result = _run_with_worker_1_stopped(tmp_path, heartbeat_s=60, stop_s=14)
    assert_ok(result)
    expected = {"heartbeat_timeout_in_ms": 60_000, "service_leader": "/job:worker/replica:0/task:0",
                "jobs": {"worker": 2}}
    for worker in (0, 1):
        record = load_json(tmp_path / f"worker{worker}.json")
        assert record["returned"] == expected
        assert record["after_strategy"] == expected  # MWMS kept the configured service
        assert record["same_value_again"] == expected
        assert "comes too late: the coordination service is already configured with a 60 s heartbeat timeout" \
            in record["late_call_error"]
        assert "call configure_coordination before building the strategy" in record["late_call_error"]
        assert record["loss"][-1] < record["loss"][0]
    for a, b in zip(load_weights(tmp_path / "worker0.npz"), load_weights(tmp_path / "worker1.npz")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # 2 TensorFlow workers, one stopped for 8 s: ~20 s
def test_configured_timeout_is_the_one_in_effect(tmp_path):
    # 8 s is within MWMS's 10 s default (a run without configure_coordination
    # survives it), so only the configured 4 s aborts the job.
    result = _run_with_worker_1_stopped(tmp_path, heartbeat_s=4, stop_s=8)
    assert not result.ok
    assert not result.timed_out
    assert "stopped sending heartbeats" in "".join(result.outputs), result.format_failure()
