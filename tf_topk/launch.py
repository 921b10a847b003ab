"""Start N local worker processes of one script, each with its own `TF_CONFIG`.

This is a small local launcher for `tf.distribute.MultiWorkerMirroredStrategy`
(MWMS): it lets one machine play a whole cluster, for development, examples
and tests. This module imports only the standard library (though
``python -m tf_topk.launch`` first runs ``tf_topk/__init__.py``).

Command line::

    python -m tf_topk.launch --workers 2 train.py --epochs 3
    python -m tf_topk.launch --workers 4 --timeout 600 examples/train_mnist.py

Every worker runs ``python train.py --epochs 3`` (the same interpreter as the
launcher) with::

    TF_CONFIG={"cluster": {"worker": ["localhost:41234", "localhost:41235"]},
               "task": {"type": "worker", "index": 0}}      # 1 for the second

on ports found free by binding to port 0 (``--port-base 20000`` asks for
20000, 20001, ... instead). Worker 0 is the chief. Each output line (stdout and
stderr merged) is printed as it comes, prefixed with ``[worker i] ``.

What the launcher guarantees:

* If a worker exits non-zero, the others are stopped (SIGTERM, then SIGKILL
  after a grace period) and the launcher exits with that worker's code; a
  worker killed by signal S gives 128+S. A collective op waits forever for a
  peer that died, so without this the survivors would hang.
* ``--timeout S`` stops everything after S seconds and exits with 124.
* Ctrl-C or SIGTERM to the launcher stops all workers (exit 130 / 143).
* Each worker runs in its own session and process group, so whatever it
  starts (data loaders, shell pipelines) is stopped with it.

From Python (tests use this)::

    from tf_topk.launch import run_workers
    result = run_workers(2, [sys.executable, "train.py"], timeout=120)
    assert result.ok, result.format_failure()
    print(result.outputs[0])          # worker 0's output, without prefixes

How real clusters set TF_CONFIG
-------------------------------
On a real cluster nothing launches the workers for you in this way: every
machine runs the same training script, and each one must see a ``TF_CONFIG``
with the *same* ``cluster`` (all workers' ``host:port``, in the same order) and
its *own* ``task.index``. MWMS reads it when the strategy is created and starts
a gRPC server on that worker's port; the ports must be reachable between the
machines. The usual ways to get there:

* by hand or from a job script: ``export TF_CONFIG='{"cluster": {"worker":
  ["node1:12345", "node2:12345"]}, "task": {"type": "worker", "index": 1}}'``
  on node2, index 0 on node1;
* with Slurm: skip TF_CONFIG and build the strategy from
  ``tf.distribute.cluster_resolver.SlurmClusterResolver()`` (it reads
  ``SLURM_*`` variables; one task per node or per GPU, set with ``srun``)::

      resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=12345)
      strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)

* with a cluster manager: Kubeflow's TFJob (training-operator), Vertex AI and
  SageMaker write ``TF_CONFIG`` into each worker's environment for you.

Only worker 0 (the chief) should write checkpoints and logs to their final
place; the others write to temporary directories, since saving under MWMS is a
collective that every worker must take part in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, Optional, Sequence

__all__ = ["LaunchResult", "find_free_ports", "make_tf_config", "run_workers", "main"]

TIMEOUT_EXIT_CODE = 124  # the same code as coreutils timeout(1)
DEFAULT_GRACE_S = 5.0


@dataclasses.dataclass
class LaunchResult:
    """What happened to the workers of one `run_workers` call."""

    returncodes: list  # per worker, Popen convention: -S when killed by signal S
    outputs: list  # per worker: merged stdout+stderr text, without prefixes
    ports: list
    failed_worker: Optional[int] = None  # first worker that exited non-zero
    timed_out: bool = False
    interrupted: Optional[int] = None  # signal number that stopped the launcher
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def returncode(self) -> int:
        """The launcher's exit code: 0, the failed worker's code, 124 or 128+S."""
        if self.interrupted is not None:
            return 128 + self.interrupted
        if self.timed_out:
            return TIMEOUT_EXIT_CODE
        if self.failed_worker is not None:
            return _exit_code(self.returncodes[self.failed_worker])
        return 0

    def format_failure(self, tail_lines: int = 40) -> str:
        """A readable summary with the tail of every worker's output."""
        parts = [
            f"launcher exit code {self.returncode}: returncodes={self.returncodes} "
            f"failed_worker={self.failed_worker} timed_out={self.timed_out} "
            f"duration={self.duration_s:.1f}s"
        ]
        for i, out in enumerate(self.outputs):
            lines = out.splitlines()[-tail_lines:]
            parts.append(f"--- worker {i} (last {len(lines)} lines) ---")
            parts.extend(lines)
        return "\n".join(parts)


def _exit_code(returncode: Optional[int]) -> int:
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def find_free_ports(n: int) -> list:
    """Return `n` distinct TCP ports that were free a moment ago.

    All sockets stay open until every port is chosen, so the ports differ.
    Another process may still take one before the worker binds it; that race
    is rare and shows up as a clear gRPC "address in use" error.
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))  # all interfaces: what TF's gRPC server binds
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def make_tf_config(ports: Sequence[int], index: int, host: str = "localhost") -> str:
    """The TF_CONFIG JSON for worker `index` of a cluster on `host`."""
    return json.dumps(
        {
            "cluster": {"worker": [f"{host}:{p}" for p in ports]},
            "task": {"type": "worker", "index": index},
        }
    )


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"launcher got signal {signum}")
        self.signum = signum


def pid_alive(pid: int) -> bool:
    """True if `pid` runs; a zombie (dead, not yet reaped, as under PID 1 in a
    container) is not alive. Linux (/proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the worker's process group (it is the group leader)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every worker group, wait up to `grace_s`, then SIGKILL.

    Groups of workers that already exited are signalled too, to catch
    grandchildren they left behind.
    """
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (D state): give up on it
            pass


def _reader(
    index: int,
    pipe: IO[bytes],
    sink: list,
    stream: Optional[IO[str]],
    prefix: bool,
    lock: threading.Lock,
) -> None:
    """Copy one worker's output into `sink` and, prefixed, to `stream`, line by line."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if stream is not None:
            text = line if line.endswith("\n") else line + "\n"
            try:
                with lock:
                    stream.write(f"[worker {index}] {text}" if prefix else text)
                    stream.flush()
            except (OSError, ValueError):  # closed stream or broken pipe (`| head`)
                stream = None  # keep draining, or the worker would block on a full pipe
    pipe.close()


def run_workers(
    n: int,
    argv: Sequence[str],
    env: Optional[Mapping[str, str]] = None,
    timeout: Optional[float] = None,
    line_prefix: bool = True,
    *,
    ports: Optional[Sequence[int]] = None,
    stream: Optional[IO[str]] = None,
    grace_s: float = DEFAULT_GRACE_S,
    cwd: Optional[str] = None,
) -> LaunchResult:
    """Run `argv` as `n` local workers with TF_CONFIG set, and wait for them.

    Args:
      n: number of workers (>= 1).
      argv: the full command of each worker, e.g. `[sys.executable, "train.py"]`.
      env: extra environment variables for every worker, on top of
        `os.environ` (TF_CONFIG is always set by the launcher).
      timeout: seconds until all workers are stopped and the result says
        `timed_out` (exit code 124). None waits forever.
      line_prefix: prefix streamed lines with `[worker i] `.
      ports: the cluster's ports; default: free ports found by binding port 0.
      stream: where lines are streamed live; default `sys.stdout`.
      grace_s: seconds between SIGTERM and SIGKILL when stopping workers.
      cwd: working directory of the workers.

    Returns a `LaunchResult`; every worker process (and its process group) is
    gone when this returns, also when it raises (e.g. KeyboardInterrupt).
    """
    if n < 1:
        raise ValueError(f"need at least one worker, got n={n}")
    if not argv:
        raise ValueError("argv is empty: give the command each worker runs")
    if ports is None:
        ports = find_free_ports(n)
    elif len(ports) != n:
        raise ValueError(f"got {len(ports)} ports for {n} workers")
    ports = list(ports)
    if stream is None:
        stream = sys.stdout

    outputs: list = [[] for _ in range(n)]
    procs: list = []
    readers: list = []
    lock = threading.Lock()
    result = LaunchResult(returncodes=[None] * n, outputs=[], ports=ports)
    start = time.monotonic()
    try:
        for i in range(n):
            worker_env = dict(os.environ)
            worker_env.update(env or {})
            worker_env["TF_CONFIG"] = make_tf_config(ports, i)
            worker_env.setdefault("PYTHONUNBUFFERED", "1")  # stream lines live
            proc = subprocess.Popen(
                list(argv),
                env=worker_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: killpg reaches grandchildren
            )
            procs.append(proc)
            t = threading.Thread(
                target=_reader,
                args=(i, proc.stdout, outputs[i], stream, line_prefix, lock),
                name=f"tf_topk-launch-reader-{i}",
                daemon=True,
            )
            t.start()
            readers.append(t)

        deadline = None if timeout is None else start + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                result.failed_worker = failed[0]
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() >= deadline:
                result.timed_out = True
                break
            time.sleep(0.05)
    except _Interrupted as e:
        result.interrupted = e.signum
    except KeyboardInterrupt:
        result.interrupted = signal.SIGINT
        raise
    finally:
        _stop_all(procs, grace_s)
        for t in readers:
            t.join(timeout=5)
        result.returncodes = [p.returncode for p in procs] + [None] * (n - len(procs))
        result.outputs = ["".join(lines) for lines in outputs]
        result.duration_s = time.monotonic() - start
    return result


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tf_topk.launch",
        description="Run SCRIPT as N local MultiWorkerMirroredStrategy workers, "
        "each with TF_CONFIG on free localhost ports.",
        epilog="Example: python -m tf_topk.launch --workers 2 train.py --epochs 3",
    )
    parser.add_argument("--workers", "-n", type=int, required=True, help="number of workers (>= 1)")
    parser.add_argument(
        "--port-base",
        default="auto",
        help="'auto' (default): free ports found by binding port 0; "
        "or an integer P: use ports P, P+1, ...",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop all workers after this many seconds (exit 124)"
    )
    parser.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE_S, help="seconds between SIGTERM and SIGKILL"
    )
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix lines with [worker i]")
    parser.add_argument("script", help="the Python script each worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)

    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    if not os.path.isfile(args.script):
        parser.error(f"script not found: {args.script}")
    if args.port_base == "auto":
        args.ports = None
    else:
        try:
            base = int(args.port_base)
        except ValueError:
            parser.error(f"--port-base must be 'auto' or an integer, got {args.port_base!r}")
        if not 1 <= base <= 65536 - args.workers:
            parser.error(f"--port-base {base} leaves no room for {args.workers} ports")
        args.ports = list(range(base, base + args.workers))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit code."""
    args = _parse_args(argv)

    def on_signal(signum, frame):
        raise _Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = run_workers(
            args.workers,
            [sys.executable, args.script, *args.args],
            timeout=args.timeout,
            line_prefix=not args.no_prefix,
            ports=args.ports,
            grace_s=args.grace,
        )
    except KeyboardInterrupt:
        print("tf_topk.launch: interrupted, workers stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

    if result.interrupted is not None:
        print(f"tf_topk.launch: got signal {result.interrupted}, workers stopped", file=sys.stderr)
    elif result.timed_out:
        print(f"tf_topk.launch: timed out after {args.timeout:g}s, workers stopped", file=sys.stderr)
    elif result.failed_worker is not None:
        print(
            f"tf_topk.launch: worker {result.failed_worker} exited with code "
            f"{result.returncodes[result.failed_worker]}; stopped the others",
            file=sys.stderr,
        )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
