"""Tests of tf_topk.launch with real processes (tests/workers/behave.py, no TensorFlow)."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from multiworker import LAUNCH_CLI, REPO_ROOT, WORKERS_DIR, launch, load_json, run_behave, wait_dead, worker_env

BEHAVE = str(WORKERS_DIR / "behave.py")


def test_tf_config_has_free_distinct_ports_and_own_index(tmp_path):
    result = run_behave("--record", tmp_path, "extra-arg", workers=3, timeout=30)
    assert result.ok, result.format_failure()
    assert len(set(result.ports)) == 3 and all(0 < p < 65536 for p in result.ports)
    for i in range(3):
        record = load_json(tmp_path / f"worker_{i}.json")
        assert record["tf_config"] == {
            "cluster": {"worker": [f"localhost:{p}" for p in result.ports]},
            "task": {"type": "worker", "index": i},
        }
        assert record["rest"] == ["extra-arg"]  # script arguments are passed through


def test_output_is_prefixed_merged_and_captured():
    stream = io.StringIO()
    result = run_behave("--stderr", "--no-newline", workers=2, timeout=30, stream=stream)
    assert result.ok, result.format_failure()
    lines = stream.getvalue().splitlines()
    assert lines and all(re.match(r"\[worker [01]\] ", line) for line in lines), lines
    for i in range(2):
        for text in (f"hello from {i}", f"stderr from {i}", f"partial from {i}"):
            assert f"[worker {i}] {text}" in lines
        # captured output is per worker and unprefixed
        assert result.outputs[i].splitlines() == [f"hello from {i}", f"stderr from {i}", f"partial from {i}"]


def test_no_prefix():
    stream = io.StringIO()
    result = run_behave(workers=2, timeout=30, stream=stream, line_prefix=False)
    assert result.ok
    assert sorted(stream.getvalue().splitlines()) == ["hello from 0", "hello from 1"]


def test_failing_worker_code_propagates_and_hanging_sibling_is_stopped():
    # Worker 0 would sleep 1000 s; worker 1 exits 3 after 0.3 s.
    result = run_behave("--exit", "1:3", "--hang", workers=2, timeout=60, stream=io.StringIO())
    assert result.failed_worker == 1
    assert result.returncode == 3
    assert result.returncodes[1] == 3
    assert result.returncodes[0] == -signal.SIGTERM
    assert not result.timed_out
    assert result.duration_s < 15


def test_sigterm_ignoring_sibling_gets_sigkill():
    result = run_behave(
        "--exit", "1:4", "--hang", "--ignore-sigterm",
        workers=2, timeout=60, grace_s=0.5, stream=io.StringIO(),
    )
    assert result.returncode == 4
    assert result.returncodes[0] == -signal.SIGKILL


def test_grandchildren_are_stopped_with_their_worker(tmp_path):
    result = run_behave(
        "--grandchild", tmp_path, "--exit", "1:5", "--delay", "1.0", "--hang",
        workers=2, timeout=60, stream=io.StringIO(),
    )
    assert result.returncode == 5, result.format_failure()
    pids = [int((tmp_path / f"grandchild_{i}").read_text()) for i in range(2)]
    assert not wait_dead(pids), f"grandchildren {pids} outlived the launch"


def test_timeout_stops_everything():
    result = run_behave("--hang", workers=2, timeout=1.0, stream=io.StringIO())
    assert result.timed_out
    assert result.returncode == launch.TIMEOUT_EXIT_CODE == 124
    assert all(c is not None and c < 0 for c in result.returncodes)
    assert result.duration_s < 10


def test_library_argument_errors():
    with pytest.raises(ValueError, match="at least one worker"):
        launch.run_workers(0, [sys.executable, BEHAVE])
    with pytest.raises(ValueError, match="argv is empty"):
        launch.run_workers(1, [])
    with pytest.raises(ValueError, match="2 ports for 3 workers"):
        launch.run_workers(3, [sys.executable, BEHAVE], ports=[1, 2])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "0", BEHAVE], "--workers must be at least 1"),
        (["--workers", "2", "no/such/script.py"], "script not found: no/such/script.py"),
        (["--workers", "2", "--port-base", "x", BEHAVE], "'auto' or an integer"),
        (["--workers", "2", "--timeout", "-1", BEHAVE], "--timeout must be positive"),
        (["--workers", "2"], "give the script each worker runs, or -m MODULE"),
    ],
)
def test_cli_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_module_runs_on_every_worker_as_advise_prints_it():
    """`advise --help` tells how to measure a cluster of local workers: that line runs as printed."""
    from tf_topk.bench import advise

    hint = next(line for line in advise.__doc__.splitlines() if "tf_topk.launch" in line)
    command = hint.strip().strip("(`").split("`")[0].split()
    assert command[:5] == ["python", "-m", "tf_topk.launch", "--workers", "4"]
    command = [sys.executable, *command[1:4], "2", *command[5:], "--json", "--budget", "1"]
    env = {**os.environ, **worker_env()}
    env.pop("TF_CONFIG", None)
    run = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    chief = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("[worker 0] {"))
                       .removeprefix("[worker 0] "))
    assert chief["replicas"] == 2 and chief["rows"] and chief["source"]


def _cli(*args):
    return [*LAUNCH_CLI, *map(str, args)]


def test_cli_exit_code_prefix_and_script_args(tmp_path):
    proc = subprocess.run(
        _cli("--workers", "2", "--timeout", "60", BEHAVE, "--exit", "0:7", "--hang", "--record", tmp_path),
        cwd=REPO_ROOT, env={**os.environ, **worker_env()}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 7, proc.stderr
    assert "[worker 0] hello from 0" in proc.stdout.splitlines()
    assert "worker 0 exited with code 7" in proc.stderr
    # options after the script name belong to the script, not the launcher
    assert load_json(tmp_path / "worker_1.json")["argv"] == ["--exit", "0:7", "--hang", "--record", str(tmp_path)]


@pytest.mark.parametrize("options", [[], ["--verbose"], ["--chief-only"], ["--chief-only", "--verbose"]])
def test_cli_hides_tensorflows_startup_lines_and_shows_the_chief_alone_when_asked(options):
    proc = subprocess.run(_cli("--workers", "2", "--timeout", "60", *options, BEHAVE, "--startup-log", "--stderr"),
                          cwd=REPO_ROOT, env={**os.environ, **worker_env()}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    workers = [0] if "--chief-only" in options else [0, 1]
    assert {line.split("]")[0] + "]" for line in lines} == {f"[worker {i}]" for i in workers}, lines
    for i in workers:
        assert f"[worker {i}] hello from {i}" in lines and f"[worker {i}] stderr from {i}" in lines
    startup = [line for line in lines if "absl::InitializeLog" in line or "] I0000 " in line
               or "To enable the following instructions" in line]
    assert len(startup) == (4 * len(workers) if "--verbose" in options else 0), lines


@pytest.mark.parametrize("exit_code", [0, 3])
def test_cli_holds_back_the_coordination_services_end_of_job_error_unless_the_job_fails(exit_code):
    """Worker 1 still talking to the coordination service after worker 0 (its host) has left logs an
    error at the end of a job that succeeded: not shown then; shown when the job fails."""
    proc = subprocess.run(_cli("--workers", "2", "--timeout", "60", BEHAVE, "--shutdown-race-log",
                               "--exit", f"1:{exit_code}"),
                          cwd=REPO_ROOT, env={**os.environ, **worker_env()}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == exit_code
    shown = "Failed to send RPC to coordination service" in proc.stdout + proc.stderr
    assert shown == (exit_code != 0), proc.stdout + proc.stderr
    assert "[worker 1] hello from 1" in proc.stdout


def test_cli_chief_only_prints_the_last_lines_of_another_worker_that_fails():
    proc = subprocess.run(_cli("--workers", "2", "--timeout", "60", "--chief-only", BEHAVE, "--startup-log",
                               "--exit", "1:3", "--hang"),
                          cwd=REPO_ROOT, env={**os.environ, **worker_env()}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert "[worker 1]" not in proc.stdout and "[worker 0] hello from 0" in proc.stdout
    assert "[worker 1] hello from 1" in proc.stderr.splitlines(), proc.stderr
    assert "absl::InitializeLog" not in proc.stderr and "worker 1 exited with code 3" in proc.stderr


def test_cli_timeout_exits_124():
    proc = subprocess.run(
        _cli("--workers", "2", "--timeout", "1", BEHAVE, "--hang"),
        cwd=REPO_ROOT, env={**os.environ, **worker_env()}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 124, proc.stderr
    assert "timed out after 1s" in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_signal_stops_all_workers(sig, tmp_path):
    # The launcher runs in its own group so this test can always clean it up.
    proc = subprocess.Popen(
        _cli("--workers", "2", "--timeout", "100", BEHAVE, "--grandchild", tmp_path, "--hang"),
        cwd=REPO_ROOT, env={**os.environ, **worker_env()}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"grandchild_{i}").exists() for i in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        pids = [int((tmp_path / f"grandchild_{i}").read_text()) for i in range(2)]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, err
        assert "workers stopped" in err
        assert not wait_dead(pids), f"grandchildren {pids} outlived the launcher"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# A preemption-style worker: it notes each SIGTERM and keeps running, so only
# SIGKILL stops it. The note tells the test that the launcher's grace period
# has begun; the pid file tells it which processes to check and clean up.
_SIGTERM_NOTING_WORKER = """\
import json, os, signal, sys, time
out = sys.argv[1]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(out, f"sigterm_{index}"), "w").close())
with open(os.path.join(out, f"pid_{index}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, f"pid_{index}.tmp"), os.path.join(out, f"pid_{index}"))
while True:
    time.sleep(1000)
"""


def _wait_for_files(proc, paths, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, f"the launcher exited with {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_cli_second_signal_during_grace_still_kills_all_workers(second, tmp_path):
    """A second SIGTERM or Ctrl-C while the launcher waits out the grace period
    must not cut the stop short: workers that ignore SIGTERM still get SIGKILL.

    The grace is long enough for a loaded machine (CI runs two test processes on
    two cores) to schedule the workers' SIGTERM handlers before it runs out; at
    2 s a fresh-clone run once saw the launcher finish first."""
    grace = 8.0
    script = tmp_path / "noting_worker.py"
    script.write_text(_SIGTERM_NOTING_WORKER)
    proc = subprocess.Popen(
        _cli("--workers", "2", "--grace", grace, "--timeout", "100", script, tmp_path),
        cwd=REPO_ROOT, env={**os.environ, **worker_env()}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    pid_files = [tmp_path / f"pid_{i}" for i in range(2)]
    try:
        _wait_for_files(proc, pid_files, "the workers started")
        pids = [int(p.read_text()) for p in pid_files]
        proc.send_signal(signal.SIGTERM)
        _wait_for_files(proc, [tmp_path / f"sigterm_{i}" for i in range(2)], "SIGTERM reached the workers")
        assert proc.poll() is None  # the launcher is in its grace period
        proc.send_signal(second)
        out, err = proc.communicate(timeout=grace + 30)
        assert not wait_dead(pids, timeout=2.0), f"workers {pids} outlived the launcher; it said: {err}"
        assert proc.returncode == 128 + signal.SIGTERM, err  # the first signal decides
        assert "workers stopped" in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for path in pid_files:  # never leave a worker behind, whatever failed
            if path.exists() and launch.pid_alive(int(path.read_text())):
                try:
                    os.killpg(int(path.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_launch_module_needs_no_tensorflow():
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('launch', {str(REPO_ROOT / 'tf_topk' / 'launch.py')!r}); "
        "m = sys.modules['launch'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(sorted(k for k in ('tensorflow', 'keras', 'numpy') if k in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_launcher_and_netns_need_no_tensorflow(tmp_path):
    """`python -m tf_topk.launch --help` and the netns helpers work where
    TensorFlow cannot be imported (a package of that name that refuses)."""
    blocked = tmp_path / "blocked" / "tensorflow"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('tensorflow is not importable here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "blocked"), str(REPO_ROOT)]))
    help_run = subprocess.run([sys.executable, "-m", "tf_topk.launch", "--help"], cwd=str(tmp_path), env=env,
                              capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0, help_run.stderr[-2000:]
    assert "--workers" in help_run.stdout
    probe = subprocess.run([sys.executable, "-c", "import tf_topk.bench.netns, tf_topk.launch, sys; "
                            "print('tensorflow' in sys.modules)"], cwd=str(tmp_path), env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip() == "False"
    # The check itself holds: TensorFlow really is blocked in that environment.
    blocked_tf = subprocess.run([sys.executable, "-c", "import tensorflow"], cwd=str(tmp_path), env=env,
                                capture_output=True, text=True, timeout=60)
    assert blocked_tf.returncode != 0 and "not importable" in blocked_tf.stderr
