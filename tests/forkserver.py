"""Worker processes forked from one that has already imported TensorFlow (not a test module).

Starting Python with TensorFlow, Keras and scikit-learn costs 8-9 s of CPU on this project's 2-core
machine, and the suite starts well over a hundred worker processes. A fork server imports them once,
before TensorFlow's runtime exists (no eager context, no thread pool: the server checks that it
runs a single thread, and serves nothing otherwise), and forks each worker from that state. A
forked worker is still a process of its own: its own TF_CONFIG, its own gRPC server on its own
port, TensorFlow's collective runtime between processes. Only the import is shared.

Run a script through it with ``python tests/forkserver.py SCRIPT ARGS...`` (or ``-m MODULE ARGS``,
``-c CODE ARGS``): that command behaves as ``python SCRIPT ARGS...`` (exit status, death by a
signal, stdin, stdout and stderr, SIGTERM and SIGINT passed on), and runs the real interpreter
instead (``os.execv``, the same pid) when no server is running (``TF_TOPK_TEST_FORKSERVER`` unset
or stale), when its environment differs from the server's in a variable read at start-up
(`import_time_environment`: TF_USE_LEGACY_KERAS, TF_CPP_MIN_LOG_LEVEL, CUDA_VISIBLE_DEVICES,
PYTHONPATH, ...), or when the script or code names TF_USE_LEGACY_KERAS but its environment does not
set it (it sets Keras 2 up itself before importing TensorFlow; a server for Keras 2 is one started
under TF_USE_LEGACY_KERAS=1, which imports tf_keras too).

What a test must never fork, and runs with ``sys.executable`` as before: a new process's imports
themselves (a saved model loaded after ``import tf_topk`` alone, either import order) and the
launcher's own command line.

Protocol, one Unix-socket connection per worker: the client sends its argv, environment and working
directory as one JSON line with its descriptors 0, 1 and 2 attached (SCM_RIGHTS); the server answers
``exec`` (run the interpreter yourself) or forks; the child sends ``pid N``; the server sends
``exit STATUS`` (a wait status) when the child is gone. The connection stays open while the child
runs: when the client dies (SIGKILL of its process group, as the launcher stops workers), the server
and the child both see its end and the child's process group is killed, so nothing outlives the
client.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_ENV = "TF_TOPK_TEST_FORKSERVER"
# Not tf_topk: each child imports it as a new process would (its Keras registrations included). Under
# TF_USE_LEGACY_KERAS=1 (Keras 2 as tf.keras), tf_keras too.
PRELOAD = ("numpy", "tensorflow", "keras", "sklearn.datasets")
PRELOAD_KERAS_2 = ("tf_keras",)
# Variables a forked child applies itself, or that only the launcher and the tests read at run time.
_RUN_TIME = {"TF_CONFIG", "PYTHONUNBUFFERED", SOCKET_ENV}
_START_UP_PREFIXES = ("TF_", "KERAS_", "CUDA", "XLA_", "OMP_", "MKL_", "OPENBLAS_", "PYTHON", "LD_",
                      "COVERAGE_", "MPLBACKEND")


def import_time_environment(env) -> dict:
    """The part of `env` that a process reads when it starts or imports TensorFlow and Keras: a
    child forked from a server that started under other values would not be what it claims."""
    return {k: v for k, v in env.items()
            if k.startswith(_START_UP_PREFIXES) and k not in _RUN_TIME and not k.startswith("TF_TOPK_")}


# ---------------------------------------------------------------------------------------- client

def _send_request(sock, argv):
    header = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode() + b"\n"
    sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(memoryview(_fds(0, 1, 2))))])


def _fds(*fds):
    import array

    return array.array("i", fds)


def _die_of(sig):
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal that does not end a process (SIGCHLD, say) ends it anyway


def _exec(argv):
    os.execv(sys.executable, [sys.executable, *argv])


def _keras_2(env) -> bool:
    return env.get("TF_USE_LEGACY_KERAS") == "1"


def _sets_up_keras_2(argv) -> bool:
    """Whether the code to run names TF_USE_LEGACY_KERAS (a module run with -m is not read): it sets Keras 2
    up before it imports TensorFlow, which only a server started under TF_USE_LEGACY_KERAS=1 did."""
    if _keras_2(os.environ):
        return False
    if argv[0] == "-c":
        return "TF_USE_LEGACY_KERAS" in argv[1]
    if argv[0] == "-m":
        return False
    try:
        with open(argv[0], encoding="utf-8", errors="replace") as f:
            return "TF_USE_LEGACY_KERAS" in f.read()
    except OSError:
        return False


def client(argv) -> None:
    """Run `argv` (SCRIPT ARGS or -m MODULE ARGS) in a child of the server, or exec the interpreter."""
    path = os.environ.get(SOCKET_ENV)
    if not path or _sets_up_keras_2(argv):
        _exec(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        _send_request(sock, argv)
    except OSError:
        sock.close()
        _exec(argv)
    reader = sock.makefile("r")
    child = {"pid": None, "pending": []}

    def forward(signum, frame):
        if child["pid"] is None:
            child["pending"].append(signum)
            return
        for sig in (signum, signal.SIGCONT):  # a stopped child gets the signal too
            try:
                os.killpg(child["pid"], sig)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    status = None
    for line in reader:
        word, _, value = line.strip().partition(" ")
        if word == "exec":
            sock.close()
            _exec(argv)
        elif word == "pid":
            child["pid"] = int(value)
            for signum in child["pending"]:
                forward(signum, None)
        elif word == "exit":
            status = int(value)
            break
    if status is None and child["pid"] is None:
        _exec(argv)  # nothing ran: the server could not fork
    if status is None:
        print("tests/forkserver.py: the fork server went away before the child's exit status came",
              file=sys.stderr)
        sys.exit(1)
    if os.WIFSIGNALED(status):  # die of the same signal, as the child did
        _die_of(os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


# ---------------------------------------------------------------------------------------- server

def serve(path) -> None:
    """Import PRELOAD, then fork a child for each request on the Unix socket `path` until SIGTERM."""
    import selectors
    import socket as socket_module

    started_under = import_time_environment(os.environ)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # NumPy's BLAS would start a thread: the server must run one
    import importlib

    for name in PRELOAD + (PRELOAD_KERAS_2 if _keras_2(os.environ) else ()):
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"tests/forkserver.py: {threads} threads after the imports; forking would be unsafe, serving none",
              file=sys.stderr)
        return
    del os.environ["OPENBLAS_NUM_THREADS"]

    listener = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears only once it accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("accept", None))
    children = {}  # pid -> (connection, pidfd)
    client_fds = set()  # every descriptor held for a client: a forked child closes all but its own
    stopping = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))

    parent = os.getppid()  # the process that started this server: when it is gone, so is the server
    while not stopping and os.getppid() == parent:
        for key, _ in selector.select(timeout=0.5):
            kind, data = key.data
            if kind == "accept":
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                conn.setblocking(False)  # a client that sends nothing holds up no other
                pending = _Request(conn)
                client_fds.add(conn.fileno())
                selector.register(conn, selectors.EVENT_READ, ("request", pending))
            elif kind == "request":
                pending = data
                if not pending.read(client_fds):
                    continue
                selector.unregister(pending.conn)
                pid = _handle(pending, started_under, listener, selector, client_fds)
                if pid is None:
                    continue
                pidfd = os.pidfd_open(pid)
                client_fds.add(pidfd)
                children[pid] = {"conn": pending.conn, "pidfd": pidfd, "watched": True}
                selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
                selector.register(pending.conn, selectors.EVENT_READ, ("client", pid))
            elif kind == "exited":
                child = children.pop(data)
                _, status = os.waitpid(data, 0)
                selector.unregister(child["pidfd"])
                client_fds.discard(child["pidfd"])
                os.close(child["pidfd"])
                if child["watched"]:
                    selector.unregister(child["conn"])
                try:
                    child["conn"].setblocking(True)
                    child["conn"].sendall(f"exit {status}\n".encode())
                except OSError:
                    pass
                client_fds.discard(child["conn"].fileno())
                child["conn"].close()
            elif kind == "client" and data in children:
                child = children[data]
                try:
                    gone = not child["conn"].recv(1, socket_module.MSG_PEEK)
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:  # the client is gone: so is its child
                    selector.unregister(child["conn"])
                    child["watched"] = False
                    _kill_group(data)
    for pid in children:
        _kill_group(pid)
    import shutil

    shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # the starter's own clean-up may never run


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Request:
    """One client's request as it arrives, read as far as the socket has it (non-blocking): the JSON line
    and the descriptors 0, 1 and 2 attached to it."""

    def __init__(self, conn):
        import array

        self.conn, self.data, self.fds, self.closed = conn, b"", array.array("i"), False

    def read(self, client_fds) -> bool:
        """Read what has arrived; True once the line is complete or the client closed before it was."""
        try:
            chunk, ancillary, _, _ = self.conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * self.fds.itemsize))
        except BlockingIOError:
            return False
        except OSError:
            chunk, ancillary = b"", []
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = payload[:len(payload) - len(payload) % self.fds.itemsize]
                self.fds.frombytes(received)
                client_fds.update(self.fds)
        self.data += chunk
        self.closed = not chunk
        return self.closed or self.data.endswith(b"\n")


def _handle(pending, started_under, listener, selector, client_fds):
    """Answer a complete request: `exec`, or fork its child. The child's pid, or None."""
    conn, fds = pending.conn, list(pending.fds)

    def release():
        for fd in fds:
            client_fds.discard(fd)
            os.close(fd)

    try:
        if pending.closed:
            raise OSError("the client closed before its request was complete")
        request = json.loads(pending.data)
        if len(fds) != 3 or import_time_environment(request["env"]) != started_under:
            conn.setblocking(True)
            conn.sendall(b"exec\n")
            raise OSError("not forked")
    except (OSError, ValueError):
        release()
        client_fds.discard(conn.fileno())
        conn.close()
        return None
    try:
        pid = os.fork()
    except OSError:
        pid = None
    if pid == 0:
        try:
            selector.close()
            listener.close()
            for fd in client_fds - {conn.fileno(), *fds}:  # other clients' connections and descriptors
                try:
                    os.close(fd)
                except OSError:
                    pass
            conn.setblocking(True)
            _child(conn, request, fds)
        finally:
            os._exit(70)  # _child exits itself; this is reached only if it failed before running anything
    release()
    if pid is None:
        client_fds.discard(conn.fileno())
        conn.close()  # the client sees the end before a pid, and execs
    return pid


def _child(conn, request, fds) -> None:
    """In the forked child: become the process `python ARGV` would have been, run it, exit."""
    import atexit
    import io
    import random
    import runpy
    import tempfile
    import threading
    import traceback

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False) if unbuffered else
                                  io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                  write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                  line_buffering=True, write_through=True)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again, as a new process would
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    conn.sendall(f"pid {os.getpid()}\n".encode())

    def watch():  # the client gone while this runs: stop, as its process group would have been
        try:
            while conn.recv(1, socket.MSG_PEEK):
                pass
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="forkserver-client-watch", daemon=True).start()
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = request["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - Python prints it and exits 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # non-daemon threads end first, as at a normal exit
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        _die_of(-code)
    os._exit(code)


def _flush_open_files():
    """Flush every file object still open, as the interpreter's own exit does when it finalizes them:
    `os._exit` would drop what a script wrote into a file it never closed."""
    import gc
    import io

    for obj in gc.get_objects():
        if isinstance(obj, (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)):
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):
                pass


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ---------------------------------------------------------------------- starting one from the tests

_servers = {}  # the import-time environment (as a sorted tuple) -> its server's socket, or None


def server_socket(env):
    """The socket of this process's fork server for `env`'s import-time environment, started at the first
    call for it (about 10 s: the imports); None where it could not start (clients then exec)."""
    key = tuple(sorted(import_time_environment(env).items()))
    if key in _servers:
        return _servers[key]
    import atexit
    import shutil
    import subprocess
    import tempfile
    import time

    folder = tempfile.mkdtemp(prefix="tf_topk_forkserver_")
    path = os.path.join(folder, "socket")
    with open(os.path.join(folder, "server.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path],
                                env={k: v for k, v in env.items() if k != SOCKET_ENV}, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop():
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _servers[key] = path if os.path.exists(path) else None
    return _servers[key]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    elif len(sys.argv) < 2:
        sys.exit("usage: python tests/forkserver.py SCRIPT ARGS... | -m MODULE ARGS... | -c CODE ARGS...")
    else:
        client(sys.argv[1:])
