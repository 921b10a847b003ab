"""Helpers for tests that start real worker processes through `tf_topk.launch`.

Not a test module. Workers are real processes on free localhost ports, using
TensorFlow's own collective runtime; `run_workers` stops every worker and its
process group before returning, also on failure or timeout, so no process or
port outlives a test. `PYTHON` runs a script as `python` would, in a process
forked from one that has imported TensorFlow already (tests/forkserver.py):
each worker is still a process of its own, without the 8-9 s of CPU that
TensorFlow's import costs. Tests of a new process's imports, of the launcher's
command line and of Keras 2 run `sys.executable` itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import forkserver
from tf_topk import launch
from tf_topk.launch import pid_alive

REPO_ROOT = Path(__file__).resolve().parents[1]

LaunchResult, run_workers = launch.LaunchResult, launch.run_workers
LAUNCH_CLI = [sys.executable, "-m", "tf_topk.launch"]
WORKERS_DIR = Path(__file__).resolve().parent / "workers"
FORKSERVER = Path(__file__).resolve().parent / "forkserver.py"
# The command that runs `python ARGS...` (a script, -m MODULE or -c CODE) for a test, forked from the
# fork server where the environment from `worker_env` allows, else the interpreter itself.
PYTHON = [sys.executable, str(FORKSERVER)]

# Generous: a 2-worker TF run takes ~10 s on a 2-core machine. A hung
# collective is stopped at this limit instead of hanging the test session.
DEFAULT_TIMEOUT_S = 120.0


# worker_env(**KERAS_2): tf.keras is tf_keras (Keras 2), set before TensorFlow starts.
KERAS_2 = {"TF_USE_LEGACY_KERAS": "1"}


def worker_env(**extra: str) -> dict:
    """Environment for worker processes: this checkout importable, quiet TF, no GPU, and the fork
    server that `PYTHON` uses: one per test process for this environment and one for it with KERAS_2,
    each started at the first call that needs it (other start-up variables in `extra` get none, and
    `PYTHON` runs the interpreter itself)."""
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {
        "PYTHONPATH": pythonpath,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "-1",
    }
    served = {**os.environ, **env, **{k: v for k, v in extra.items() if KERAS_2.get(k) == v}}
    env.update(extra)
    if forkserver.import_time_environment({**os.environ, **env}) == forkserver.import_time_environment(served):
        socket = forkserver.server_socket(served)
        if socket:
            env[forkserver.SOCKET_ENV] = socket
    return env


def subprocess_env(**extra: str) -> dict:
    """The environment of one test process started with `subprocess`: this process's environment with
    `worker_env(**extra)` on top, and no TF_CONFIG (a single process, not a cluster's worker)."""
    env = {**os.environ, **worker_env(**extra)}
    env.pop("TF_CONFIG", None)
    return env


def run_script(
    script: str, *args: str, workers: int = 2, timeout: float = DEFAULT_TIMEOUT_S, python=PYTHON, **run_kwargs
) -> LaunchResult:
    """Run `tests/workers/<script>` as `workers` processes with TF_CONFIG set, each started by `python`
    (forked, by default; `[sys.executable]` for the interpreter itself)."""
    argv = [*python, str(WORKERS_DIR / script), *map(str, args)]
    env = worker_env(**run_kwargs.pop("env", {}))
    return run_workers(workers, argv, env=env, timeout=timeout, **run_kwargs)


def run_behave(*args, **run_kwargs) -> LaunchResult:
    """`run_script("behave.py", ...)` with the interpreter itself: the launcher's own tests (behave.py
    imports no TensorFlow, so a fork would save nothing and stand between the launcher and its workers)."""
    return run_script("behave.py", *args, python=[sys.executable], **run_kwargs)


def assert_ok(result: LaunchResult) -> None:
    """Fail with every worker's output tail unless all workers exited 0."""
    assert result.ok, "workers failed:\n" + result.format_failure()


def load_json(path: Path):
    with open(path) as f:
        return json.load(f)


def load_weights(path: Path) -> list:
    """The arrays saved by `np.savez(path, *weights)`, in order."""
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def kill_when_written(process, pid_file: Path, timeout: float = 100.0) -> None:
    """SIGKILL the pid a worker writes to `pid_file` once it appears, while `process` (the launcher) runs.

    The worker writes its pid when it reaches the step to be killed at (and waits there), so the
    kill lands mid-training at a known point, from outside, as a machine failure would.
    """
    import signal
    import time

    deadline = time.monotonic() + timeout
    while not pid_file.exists():
        assert process.poll() is None, f"the launcher exited with {process.returncode} before {pid_file} appeared"
        assert time.monotonic() < deadline, f"{pid_file} did not appear within {timeout:g} s"
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def kill_recorded_workers(out: Path) -> None:
    """SIGKILL the process group of every worker that recorded its pid in `out/attempt*_worker*.json`
    and is still alive: whatever happened, no worker of a test outlives it."""
    import signal

    for path in out.glob("attempt*_worker*.json"):
        pid = load_json(path)["pid"]
        if pid_alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_dead(pids, timeout: float = 5.0) -> list:
    """Wait until none of `pids` is alive; return those still alive at the deadline."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)
