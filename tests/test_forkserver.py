"""tests/forkserver.py: a script run through `PYTHON` behaves as `python SCRIPT` would, and nothing it
starts outlives its client."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import forkserver
from multiworker import KERAS_2, PYTHON, REPO_ROOT, launch, pid_alive, subprocess_env, wait_dead, worker_env

pytestmark = pytest.mark.slow

REPORT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "marker": os.environ.get("MARKER"),
                  "path0": sys.path[0], "name": __name__, "tensorflow": "tensorflow" in sys.modules}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def run(argv, env, **kwargs):
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, **kwargs)


def report_of(proc):
    return json.loads(proc.stdout.splitlines()[0])


def test_a_forked_script_sees_what_the_interpreter_would_show_it(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    env = subprocess_env(MARKER="mine", EXIT="3")
    forked = run([*PYTHON, str(script), "a", "b"], env, cwd=tmp_path)
    plain = run([sys.executable, str(script), "a", "b"], env, cwd=tmp_path)
    assert forked.returncode == plain.returncode == 3
    assert forked.stderr == plain.stderr == "to stderr\n"
    seen, expected = report_of(forked), report_of(plain)
    assert seen["tensorflow"] and not expected["tensorflow"]  # what the fork saves: TensorFlow imported already
    for key in ("argv", "cwd", "marker", "path0", "name"):
        assert seen[key] == expected[key], key
    code = run([*PYTHON, "-c", REPORT, "x"], env, cwd=tmp_path)
    assert code.returncode == 3 and report_of(code)["argv"] == ["-c", "x"]
    module = run([*PYTHON, "-m", "tf_topk.launch", "--help"], env, cwd=REPO_ROOT)
    assert module.returncode == 0 and "--workers" in module.stdout


def test_an_exception_exits_1_with_its_traceback_and_a_signal_kills_the_client_too(tmp_path):
    env = subprocess_env()
    failed = run([*PYTHON, "-c", "raise RuntimeError('on purpose')"], env)
    assert failed.returncode == 1 and "RuntimeError: on purpose" in failed.stderr
    killed = run([*PYTHON, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], env)
    assert killed.returncode == -signal.SIGKILL


def test_the_interpreter_runs_where_the_start_up_environment_differs(tmp_path):
    """A start-up variable the server did not start under (and Keras 2 set up inside a script, without a
    server for it) gets the interpreter itself, which os.execv starts in the client's own process."""
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    forked = report_of(run([*PYTHON, str(script)], subprocess_env()))
    other = report_of(run([*PYTHON, str(script)], subprocess_env(TF_CPP_MIN_LOG_LEVEL="1")))
    assert forked["tensorflow"] and not other["tensorflow"]
    keras_2 = tmp_path / "keras_2.py"
    keras_2.write_text('import os\nos.environ["TF_USE_LEGACY_KERAS"] = "1"\n' + REPORT)
    assert not report_of(run([*PYTHON, str(keras_2)], subprocess_env()))["tensorflow"]
    assert report_of(run([*PYTHON, str(keras_2)], subprocess_env(**KERAS_2)))["tensorflow"]


def test_a_killed_client_takes_its_child_with_it(tmp_path):
    """The launcher stops a worker by SIGTERM, then SIGKILL, to its process group: the forked child is
    not in it, so it goes when its client goes (and a stopped child too)."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    for stop in (signal.SIGTERM, signal.SIGKILL):
        pid_file.unlink(missing_ok=True)
        client = subprocess.Popen([*PYTHON, "-c", code], env=subprocess_env(), start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not pid_file.exists() or not pid_file.read_text():
                assert client.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            child = int(pid_file.read_text())
            assert child != client.pid  # forked, not the client's own process
            if stop == signal.SIGKILL:
                os.kill(child, signal.SIGSTOP)
            os.killpg(client.pid, stop)
            assert client.wait(timeout=30) == -stop
            assert wait_dead([child], timeout=10) == [], f"the child outlived a {stop!r} of its client"
        finally:
            if client.poll() is None:
                os.killpg(client.pid, signal.SIGKILL)
                client.wait()


def test_two_forked_workers_form_a_cluster_through_the_launcher(tmp_path):
    code = ("import json, os, tensorflow as tf; s = tf.distribute.MultiWorkerMirroredStrategy(); "
            "v = s.run(lambda: tf.distribute.get_replica_context().all_reduce('sum', tf.constant(1.0))); "
            "print('SUM', float(s.experimental_local_results(v)[0]), os.getpid(), flush=True)")
    result = launch.run_workers(2, [*PYTHON, "-c", code], env=worker_env(), timeout=90, stream=open(os.devnull, "w"))
    assert result.ok, result.format_failure()
    lines = [line.split() for output in result.outputs for line in output.splitlines() if line.startswith("SUM")]
    assert [line[1] for line in lines] == ["2.0", "2.0"]
    assert not any(pid_alive(int(line[2])) for line in lines)


def test_the_import_time_environment_leaves_out_what_a_child_applies_itself():
    env = {"TF_CONFIG": "{}", "PYTHONUNBUFFERED": "1", "TF_TOPK_VERBOSE": "1", "HOME": "/x",
           "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": "/p", "TF_USE_LEGACY_KERAS": "1"}
    assert forkserver.import_time_environment(env) == {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": "/p",
                                                       "TF_USE_LEGACY_KERAS": "1"}


def test_a_script_that_never_closes_its_file_has_written_it(tmp_path):
    """The child ends with os._exit: a file a script left open (its buffer unwritten) is flushed first,
    as the interpreter's own exit flushes it."""
    target = tmp_path / "left_open.txt"
    code = f"log = open({str(target)!r}, 'w'); log.write('every line\\n' * 3)"
    assert run([*PYTHON, "-c", code], subprocess_env()).returncode == 0
    assert target.read_text() == "every line\n" * 3


def test_a_client_that_sends_nothing_holds_up_no_other(tmp_path):
    env = subprocess_env()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(env[forkserver.SOCKET_ENV])  # connected, and never a byte
    try:
        started = time.monotonic()
        forked = run([*PYTHON, "-c", "import sys, tensorflow; print('tensorflow' in sys.modules)"], env)
        assert forked.stdout.strip() == "True" and time.monotonic() - started < 30
    finally:
        silent.close()


def test_a_child_holds_no_other_clients_descriptors(tmp_path):
    """While one client's child runs, the next child has its own connection to the server and nothing
    of the first's (its connection, its standard streams, the server's handle on its process)."""
    env = subprocess_env()
    ready = tmp_path / "ready"
    first = subprocess.Popen([*PYTHON, "-c", f"import time; open({str(ready)!r}, 'w').close(); time.sleep(60)"],
                             env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        code = ("import json, os\nlinks = []\nfor fd in os.listdir('/proc/self/fd'):\n    try:\n"
                "        links.append(os.readlink(f'/proc/self/fd/{fd}'))\n    except OSError:\n"
                "        pass  # the listing's own descriptor, closed by now\nprint(json.dumps(links))")
        links = json.loads(run([*PYTHON, "-c", code], env).stdout)
        assert sum(link.startswith("socket:") for link in links) == 1, links  # its own connection only
        assert not any("pidfd" in link for link in links), links
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_the_server_ends_with_the_process_that_started_it(tmp_path):
    """A test process killed by SIGKILL runs no clean-up of its own: its fork server stops by itself
    (it was 650 MB) and removes its folder."""
    starter = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time; sys.path.insert(0, 'tests'); import forkserver; "
                               "print(forkserver.server_socket(dict(os.environ)), flush=True); time.sleep(120)"],
        cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        path = starter.stdout.readline().strip()
        assert path and os.path.exists(path)
        servers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).endswith(
            f"--serve\0{path}\0")]
        assert len(servers) == 1
        os.killpg(starter.pid, signal.SIGKILL)
        starter.wait()
        assert wait_dead(servers, timeout=10) == [], "the fork server outlived the process that started it"
        assert not os.path.exists(os.path.dirname(path))
    finally:
        if starter.poll() is None:
            os.killpg(starter.pid, signal.SIGKILL)
            starter.wait()


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""
