"""Start N local worker processes of one script, each with its own `TF_CONFIG`.

This is a small local launcher for `tf.distribute.MultiWorkerMirroredStrategy`
(MWMS): it lets one machine play a whole cluster, for development, examples
and tests. This module imports only the standard library (though
``python -m tf_topk.launch`` first runs ``tf_topk/__init__.py``).

Command line::

    python -m tf_topk.launch --workers 2 train.py --epochs 3
    python -m tf_topk.launch --workers 4 --timeout 600 examples/train_mnist.py
    python -m tf_topk.launch --workers 2 --restarts 3 train.py   # restart all on a failure

Every worker runs ``python train.py --epochs 3`` (the same interpreter as the
launcher) with::

    TF_CONFIG={"cluster": {"worker": ["localhost:41234", "localhost:41235"]},
               "task": {"type": "worker", "index": 0}}      # 1 for the second

on ports found free by binding to port 0 (``--port-base 20000`` asks for
20000, 20001, ... instead). Worker 0 is the chief. Each output line (stdout and
stderr merged) is printed as it comes, prefixed with ``[worker i] ``, except
TensorFlow's start-up log lines (``--verbose`` shows them); ``--chief-only``
shows worker 0's lines alone.

What the launcher guarantees:

* If a worker exits non-zero, the others are stopped (SIGTERM, then SIGKILL
  after a grace period) and the launcher exits with that worker's code; a
  worker killed by signal S gives 128+S. A collective op waits forever for a
  peer that died, so without this the survivors would hang.
* ``--restarts N`` (default 0): when a worker fails, stop the others, then
  start *all* workers again, on fresh free ports, up to N times (torchrun's
  ``--max-restarts``). Each worker sees the attempt number in
  ``TF_TOPK_RESTART`` (0 first, then 1, 2, ...). A collective job cannot
  replace one worker: the survivors' collectives are bound to the dead peer,
  so the whole cluster starts over and resumes from its last backup (see
  ``tf_topk.keras.BackupAndRestore``). When the restarts are used up, the
  launcher exits with the last failure's code.
* ``--timeout S`` stops everything after S seconds and exits with 124. The S
  seconds cover the whole run, restarts included.
* Ctrl-C or SIGTERM to the launcher stops all workers (exit 130 / 143), and
  never restarts them. Another signal while the workers are being stopped
  (a second Ctrl-C during the grace period) does not cut that short: it is
  handled once every worker is gone.
* Each worker runs in its own session and process group, so whatever it
  starts (data loaders, shell pipelines) is stopped with it.

From Python (tests use this)::

    from tf_topk.launch import run_workers
    result = run_workers(2, [sys.executable, "train.py"], timeout=120)
    assert result.ok, result.format_failure()
    print(result.outputs[0])          # worker 0's output, without prefixes

    result = run_workers(2, [sys.executable, "train.py"], timeout=600, restarts=2)
    print(result.attempts, [a.returncodes for a in result.earlier])  # e.g. 2 [[-15, -9]]

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
collective that every worker must take part in. For ``model.fit``,
``tf_topk.keras.BackupAndRestore`` does this, and resumes a restarted job.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import re
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Mapping, Optional, Sequence

__all__ = ["LaunchResult", "RESTART_ENV", "describe_returncode", "find_free_ports", "is_startup_log", "make_tf_config",
           "pid_alive", "run_workers", "shown_lines", "main"]

TIMEOUT_EXIT_CODE = 124  # the same code as coreutils timeout(1)
DEFAULT_GRACE_S = 5.0
_REAP_S = 10.0  # after SIGKILL, how long to wait for workers to exit before giving up on them
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # those that stop the launcher
RESTART_ENV = "TF_TOPK_RESTART"  # the attempt number each worker sees: 0, then 1, 2, ... after restarts


@dataclasses.dataclass
class LaunchResult:
    """What happened to the workers of one `run_workers` call.

    With restarts, the fields describe the last attempt (its return codes,
    outputs and ports); `earlier` holds one LaunchResult per attempt before
    it, oldest first, and `duration_s` covers all of them.
    """

    returncodes: list  # per worker, Popen convention: -S when killed by signal S
    outputs: list  # per worker: merged stdout+stderr text, without prefixes
    ports: list
    failed_worker: Optional[int] = None  # first worker that exited non-zero
    timed_out: bool = False
    interrupted: Optional[int] = None  # signal number that stopped the launcher
    duration_s: float = 0.0
    attempts: int = 1  # 1 + the restarts used
    earlier: list = dataclasses.field(default_factory=list)  # LaunchResult of each failed attempt before the last
    left_running: list = dataclasses.field(default_factory=list)  # pids alive after SIGKILL (stuck in the kernel)

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
        """A readable summary with the tail of every worker's output (last attempt)."""
        parts = [
            f"launcher exit code {self.returncode}: returncodes={self.returncodes} "
            f"failed_worker={self.failed_worker} timed_out={self.timed_out} "
            f"attempts={self.attempts} duration={self.duration_s:.1f}s"
        ]
        if self.left_running:
            parts.append(f"still running after SIGKILL: pids {self.left_running}")
        for number, attempt in enumerate(self.earlier, 1):
            worker = attempt.failed_worker
            parts.append(f"attempt {number}: worker {worker} exited with "
                         f"{describe_returncode(attempt.returncodes[worker])}")
        for i, out in enumerate(self.outputs):
            lines = out.splitlines()[-tail_lines:]
            parts.append(f"--- worker {i} (last {len(lines)} lines) ---")
            parts.extend(lines)
        return "\n".join(parts)


def describe_returncode(returncode: Optional[int]) -> str:
    """'code 3', or '-9 (SIGKILL)' for a process killed by a signal."""
    if returncode is None:
        return "no exit code"
    if returncode >= 0:
        return f"code {returncode}"
    try:
        return f"{returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return f"{returncode} (signal {-returncode})"


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


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP during the block, then deliver them to
    the handlers that were in place (which may raise).

    A handler that raises (KeyboardInterrupt, the launcher's own) would
    otherwise cut a stop short between SIGTERM and SIGKILL and leave workers
    running. Nested blocks pass held signals outwards. Only the main thread
    runs signal handlers, so in other threads there is nothing to hold.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list = []

    def hold(signum, frame):
        held.append(signum)

    previous: dict = {}
    try:
        for s in _STOP_SIGNALS:
            if signal.getsignal(s) is not None:  # None: set outside Python, cannot be put back
                previous[s] = signal.signal(s, hold)
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):
            signal.raise_signal(s)  # runs the restored handler now


def _stop_all(procs: Sequence[subprocess.Popen], grace_s: float) -> list:
    """SIGTERM every worker group, wait up to `grace_s`, then SIGKILL; return
    the workers still running after that (stuck in the kernel), normally none.

    Groups of workers that already exited are signalled too, to catch
    grandchildren they left behind. Signals to the launcher are held until
    every worker is reaped, and the SIGKILL pass runs whatever happens before.
    """
    with _signals_held():
        try:
            for p in procs:
                _signal_group(p, signal.SIGTERM)
            _wait_all(procs, grace_s)
        finally:
            for p in procs:
                _signal_group(p, signal.SIGKILL)
            _wait_all(procs, _REAP_S)  # one still running is unkillable (D state): given up on
    return [p for p in procs if p.returncode is None]


def _wait_all(procs, seconds):
    """Wait for every process, `seconds` in all."""
    deadline = time.monotonic() + seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


# Lines of a failed worker that --chief-only did not show, printed when it fails.
FAILURE_TAIL_LINES = 40
# TensorFlow's start-up log lines, which TF_CPP_MIN_LOG_LEVEL does not silence in TF 2.21: absl's notice
# that logging is not set up yet, informational lines (oneDNN's, the CPU features), and the CPU features'
# second line. Warnings and errors are not among them.
STARTUP_LOG = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called|I\d{4} |"
                         r"To enable the following instructions: )")


# The error a worker logs when it still talks to the coordination service (on worker 0) after worker
# 0 has exited: the end of a job whose workers finish a moment apart, not a failure. Held back while
# the job runs; printed if it fails (`main`).
SHUTDOWN_RACE_LOG = re.compile(r"^E\d{4} .*(Failed to send RPC to coordination service|"
                               r"coordination service.*(Connection refused|Socket closed))")


def is_startup_log(line: str) -> bool:
    """Whether a worker's output line is one of TensorFlow's start-up log lines (`STARTUP_LOG`)."""
    return bool(STARTUP_LOG.match(line))


def shown_lines(verbose: bool = False, chief_only: bool = False,
                held: Optional[list] = None) -> Callable[[int, str], bool]:
    """The `show` filter of `run_workers` that the command line's --verbose and --chief-only ask for:
    TensorFlow's start-up lines hidden unless `verbose`; with `chief_only`, worker 0's lines alone. The
    coordination service's end-of-job error (`SHUTDOWN_RACE_LOG`) is held back unless `verbose`: appended
    to `held` as (index, line), for the caller to print if the job fails."""
    def show(index: int, line: str) -> bool:
        if not verbose and held is not None and SHUTDOWN_RACE_LOG.match(line):
            held.append((index, line))
            return False
        return (index == 0 or not chief_only) and (verbose or not is_startup_log(line))
    return show


def _reader(
    index: int,
    pipe: IO[bytes],
    sink: list,
    stream: Optional[IO[str]],
    prefix: bool,
    lock: threading.Lock,
    show: Optional[Callable[[int, str], bool]] = None,
) -> None:
    """Copy one worker's output into `sink` and, prefixed, to `stream`, line by line (on `stream`
    only the lines `show(index, line)` accepts)."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if stream is not None and (show is None or show(index, line)):
            text = line if line.endswith("\n") else line + "\n"
            try:
                with lock:
                    stream.write(f"[worker {index}] {text}" if prefix else text)
                    stream.flush()
            except (OSError, ValueError):  # closed stream or broken pipe (`| head`)
                stream = None  # keep draining, or the worker would block on a full pipe
    pipe.close()


def _check_restarts(restarts) -> int:
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be an int >= 0, got {restarts!r}")
    return restarts


def _say(stream: Optional[IO[str]], lock: threading.Lock, text: str) -> None:
    """One launcher line, in the stream of worker lines (so it lands in order)."""
    if stream is None:
        return
    try:
        with lock:
            stream.write(f"[launch] {text}\n")
            stream.flush()
    except (OSError, ValueError):
        pass


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
    restarts: int = 0,
    show: Optional[Callable[[int, str], bool]] = None,
) -> LaunchResult:
    """Run `argv` as `n` local workers with TF_CONFIG set, and wait for them.

    Args:
      n: number of workers (>= 1).
      argv: the full command of each worker, e.g. `[sys.executable, "train.py"]`.
      env: extra environment variables for every worker, on top of
        `os.environ` (TF_CONFIG and TF_TOPK_RESTART are always set by the
        launcher).
      timeout: seconds until all workers are stopped and the result says
        `timed_out` (exit code 124), counted over all attempts. None waits
        forever.
      line_prefix: prefix streamed lines with `[worker i] `.
      ports: the cluster's ports, used by every attempt; default: free ports
        found by binding port 0, found anew for each attempt.
      stream: where lines are streamed live; default `sys.stdout`.
      grace_s: seconds between SIGTERM and SIGKILL when stopping workers.
      cwd: working directory of the workers.
      show: `show(worker_index, line)` says whether a line is streamed
        (default: every line); the outputs in the result keep every line.
        `shown_lines(verbose, chief_only)` is the command line's filter.
      restarts: how many times to start all workers again after a worker
        fails (exits non-zero or is killed). A timeout or a signal to the
        launcher never restarts. Each restart is announced on `stream` as
        `[launch] worker 1 exited with -9 (SIGKILL); restarting all
        workers, attempt 2 of 3`.

    Returns a `LaunchResult` of the last attempt (`attempts` says how many
    were made); every worker process (and its process group) is gone when
    this returns, also when it raises (e.g. KeyboardInterrupt).

    Example, a script that resumes from its backups after a failure::

        result = run_workers(2, [sys.executable, "train.py"], timeout=900, restarts=3)
        if not result.ok:
            print(result.format_failure())
    """
    if n < 1:
        raise ValueError(f"need at least one worker, got n={n}")
    if not argv:
        raise ValueError("argv is empty: give the command each worker runs")
    if ports is not None and len(ports) != n:
        raise ValueError(f"got {len(ports)} ports for {n} workers")
    restarts = _check_restarts(restarts)
    if stream is None:
        stream = sys.stdout

    lock = threading.Lock()  # one writer at a time on `stream`, across attempts
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    earlier: list = []
    attempt = 0
    result = None
    try:
        while True:
            attempt_ports = find_free_ports(n) if ports is None else list(ports)
            result = _run_attempt(n, argv, env, attempt, attempt_ports, deadline, line_prefix,
                                  stream, lock, grace_s, cwd, show)
            if result.failed_worker is None or result.interrupted is not None or attempt >= restarts:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break  # no time left for another attempt: report this failure
            worker = result.failed_worker
            _say(stream, lock, f"worker {worker} exited with {describe_returncode(result.returncodes[worker])}; "
                               f"restarting all workers, attempt {attempt + 2} of {restarts + 1}")
            earlier.append(result)
            attempt += 1
    except _Interrupted as e:  # between attempts: no worker is running
        if result is None:
            result = LaunchResult(returncodes=[None] * n, outputs=[""] * n, ports=[])
        result.interrupted = e.signum
    result.attempts = attempt + 1
    result.earlier = earlier
    result.duration_s = time.monotonic() - start
    return result


def _run_attempt(
    n: int,
    argv: Sequence[str],
    env: Optional[Mapping[str, str]],
    attempt: int,
    ports: list,
    deadline: Optional[float],
    line_prefix: bool,
    stream: Optional[IO[str]],
    lock: threading.Lock,
    grace_s: float,
    cwd: Optional[str],
    show: Optional[Callable[[int, str], bool]] = None,
) -> LaunchResult:
    """Start all `n` workers once and wait until they all succeed, one fails,
    the deadline passes or the launcher gets a signal; then stop them all."""
    outputs: list = [[] for _ in range(n)]
    procs: list = []
    readers: list = []
    result = LaunchResult(returncodes=[None] * n, outputs=[], ports=ports)
    start = time.monotonic()
    try:
        with _signals_held():  # a signal between Popen and append would leave a worker unstopped
            for i in range(n):
                worker_env = dict(os.environ)
                worker_env.update(env or {})
                worker_env["TF_CONFIG"] = make_tf_config(ports, i)
                worker_env[RESTART_ENV] = str(attempt)
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
                    args=(i, proc.stdout, outputs[i], stream, line_prefix, lock, show),
                    name=f"tf_topk-launch-reader-{i}",
                    daemon=True,
                )
                t.start()
                readers.append(t)

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
        try:
            with _signals_held():  # the result is complete before a signal that came meanwhile is handled
                result.left_running = [p.pid for p in _stop_all(procs, grace_s)]
                for t in readers:
                    t.join(timeout=5)
                result.returncodes = [p.returncode for p in procs] + [None] * (n - len(procs))
                result.outputs = ["".join(lines) for lines in outputs]
                result.duration_s = time.monotonic() - start
        except _Interrupted as e:  # came while stopping; the workers are gone now
            if result.interrupted is None:
                result.interrupted = e.signum
    return result


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tf_topk.launch",
        description="Run SCRIPT as N local MultiWorkerMirroredStrategy workers, "
        "each with TF_CONFIG on free localhost ports.",
        epilog="Examples: python -m tf_topk.launch --workers 2 train.py --epochs 3; "
        "python -m tf_topk.launch --workers 2 -m tf_topk.bench advise --params 12609546 --calibrate",
    )
    parser.add_argument("--workers", "-n", type=int, required=True, help="number of workers (>= 1)")
    parser.add_argument(
        "--port-base",
        default="auto",
        help="'auto' (default): free ports found by binding port 0; "
        "or an integer P: use ports P, P+1, ...",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="stop all workers after this many seconds, restarts included (exit 124)",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="when a worker fails, stop the others and start all workers again, at most this many "
        "times (default 0); each worker sees the attempt number (0, 1, ...) in $TF_TOPK_RESTART",
    )
    parser.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE_S, help="seconds between SIGTERM and SIGKILL"
    )
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix lines with [worker i]")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show TensorFlow's start-up log lines too (hidden by default)")
    parser.add_argument("--chief-only", action="store_true",
                        help="show worker 0's lines only (every worker still runs; when another worker "
                        "fails, its last lines are printed)")
    parser.add_argument("-m", dest="module", metavar="MODULE",
                        help="run a module as each worker's script, as python -m MODULE does "
                        "(e.g. -m tf_topk.bench advise --params 12609546 --calibrate)")
    parser.add_argument("script", nargs="?", help="the Python script each worker runs (none with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)

    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    if args.restarts < 0:
        parser.error(f"--restarts must be at least 0, got {args.restarts}")
    if args.module is not None:
        args.command = ["-m", args.module, *([args.script] if args.script is not None else []), *args.args]
    elif args.script is None:
        parser.error("give the script each worker runs, or -m MODULE")
    elif not os.path.isfile(args.script):
        parser.error(f"script not found: {args.script}")
    else:
        args.command = [args.script, *args.args]
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

    # SIGINT too, rather than KeyboardInterrupt: the result then says what
    # was stopped, and the first signal decides the exit code.
    previous = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS}
    held = []  # the coordination service's end-of-job errors, shown only if the job fails
    try:
        result = run_workers(
            args.workers,
            [sys.executable, *args.command],
            timeout=args.timeout,
            line_prefix=not args.no_prefix,
            ports=args.ports,
            grace_s=args.grace,
            restarts=args.restarts,
            show=shown_lines(verbose=args.verbose, chief_only=args.chief_only, held=held),
        )
    except KeyboardInterrupt:
        print("tf_topk.launch: interrupted, workers stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

    if result.returncode != 0:
        for index, line in held:
            print(f"[worker {index}] {line}" if not args.no_prefix else line, file=sys.stderr)
    unstopped = ""
    if result.left_running:
        unstopped = f" except pids {', '.join(map(str, result.left_running))} (still running after SIGKILL)"
    if result.interrupted is not None:
        print(f"tf_topk.launch: got signal {result.interrupted}, workers stopped{unstopped}", file=sys.stderr)
    elif result.timed_out:
        print(f"tf_topk.launch: timed out after {args.timeout:g}s, workers stopped{unstopped}", file=sys.stderr)
    elif result.failed_worker is not None:
        if args.chief_only and result.failed_worker != 0:  # its lines were not shown: its last ones now
            lines = [line for line in result.outputs[result.failed_worker].splitlines() if not is_startup_log(line)]
            print("\n".join(f"[worker {result.failed_worker}] {line}" for line in lines[-FAILURE_TAIL_LINES:]),
                  file=sys.stderr)
        attempts = ""
        if result.attempts > args.restarts > 0:
            attempts = f" (no restarts left after {result.attempts} attempts)"
        elif args.restarts:
            attempts = f" (no time left before --timeout for restart {result.attempts} of {args.restarts})"
        print(
            f"tf_topk.launch: worker {result.failed_worker} exited with code "
            f"{result.returncodes[result.failed_worker]}; stopped the others{unstopped}{attempts}",
            file=sys.stderr,
        )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
