"""`tf_topk.launch --restarts N` with real processes (tests/workers/behave.py, no TensorFlow).

The worker script reads the attempt number from $TF_TOPK_RESTART and writes
its pid and TF_CONFIG to a file per attempt (`--pid-dir`), so the tests can
check which attempts ran, on which ports, and that no process outlived the
launcher.
"""

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from multiworker import LAUNCH_CLI, REPO_ROOT, WORKERS_DIR, launch, load_json, run_behave, wait_dead, worker_env

BEHAVE = str(WORKERS_DIR / "behave.py")


def _records(pid_dir):
    """{(worker, attempt): record} of every worker start that wrote its pid file."""
    records = {}
    for path in pid_dir.glob("worker*_attempt*.json"):
        record = load_json(path)
        records[(record["tf_config"]["task"]["index"], record["attempt"])] = record
    return records


def _assert_all_dead(records):
    pids = [r["pid"] for r in records.values()]
    assert not wait_dead(pids), f"worker processes {pids} outlived the launcher"


def _cli(*args, timeout=60):
    return subprocess.run(
        [*LAUNCH_CLI, *map(str, args)], cwd=REPO_ROOT, env={**os.environ, **worker_env()},
        capture_output=True, text=True, timeout=timeout,
    )


def test_failure_on_first_attempt_then_success(tmp_path):
    stream = io.StringIO()
    result = run_behave("--exit", "1:3", "--exit-attempts", "1", "--pid-dir", tmp_path,
                        workers=2, timeout=60, stream=stream, restarts=2)
    assert result.ok, result.format_failure()
    assert result.attempts == 2
    [first] = result.earlier
    assert first.failed_worker == 1 and first.returncodes[1] == 3
    assert "[launch] worker 1 exited with code 3; restarting all workers, attempt 2 of 3" in stream.getvalue()
    records = _records(tmp_path)
    assert sorted(records) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # all workers again, told their attempt
    # each attempt has its own free ports, the same for all of its workers
    for attempt, ports in ((0, first.ports), (1, result.ports)):
        for worker in (0, 1):
            cluster = records[(worker, attempt)]["tf_config"]["cluster"]["worker"]
            assert cluster == [f"localhost:{p}" for p in ports]
    assert first.ports != result.ports
    assert result.outputs[1].splitlines() == ["hello from 1"]  # the last attempt's output
    _assert_all_dead(records)


def test_cli_killed_worker_is_restarted_and_exit_code_is_0(tmp_path):
    proc = _cli("--workers", "2", "--restarts", "2", "--timeout", "60", BEHAVE,
                "--exit", "1:-9", "--exit-attempts", "1", "--pid-dir", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "[launch] worker 1 exited with -9 (SIGKILL); restarting all workers, attempt 2 of 3" in lines
    assert lines.count("[worker 1] hello from 1") == 2
    assert sorted(_records(tmp_path)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _assert_all_dead(_records(tmp_path))


@pytest.mark.slow
def test_cli_always_failing_stops_after_n_restarts_with_its_code(tmp_path):
    # Worker 1 exits 3 on every attempt; worker 0 hangs until stopped.
    proc = _cli("--workers", "2", "--restarts", "2", "--timeout", "60", BEHAVE,
                "--exit", "1:3", "--hang", "--pid-dir", tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    messages = [line for line in proc.stdout.splitlines() if line.startswith("[launch]")]
    assert messages == [
        "[launch] worker 1 exited with code 3; restarting all workers, attempt 2 of 3",
        "[launch] worker 1 exited with code 3; restarting all workers, attempt 3 of 3",
    ]
    assert "worker 1 exited with code 3; stopped the others (no restarts left after 3 attempts)" in proc.stderr
    records = _records(tmp_path)
    assert sorted(records) == [(w, a) for w in (0, 1) for a in (0, 1, 2)]
    _assert_all_dead(records)


def test_library_result_after_restarts_run_out(tmp_path):
    result = run_behave("--exit", "0:-15", "--pid-dir", tmp_path,
                        workers=2, timeout=60, stream=io.StringIO(), restarts=1)
    assert result.returncode == 128 + signal.SIGTERM
    assert result.attempts == 2 and len(result.earlier) == 1
    assert [r.failed_worker for r in (*result.earlier, result)] == [0, 0]
    assert "attempt 1: worker 0 exited with -15 (SIGTERM)" in result.format_failure()


def test_restarts_0_keeps_the_old_behaviour(tmp_path):
    stream = io.StringIO()
    result = run_behave("--exit", "1:3", "--hang", "--pid-dir", tmp_path,
                        workers=2, timeout=60, stream=stream)
    assert result.returncode == 3 and result.failed_worker == 1
    assert result.returncodes[0] == -signal.SIGTERM
    assert result.attempts == 1 and result.earlier == []
    assert "[launch]" not in stream.getvalue()
    records = _records(tmp_path)
    assert sorted(records) == [(0, 0), (1, 0)]  # TF_TOPK_RESTART=0 on the only attempt
    _assert_all_dead(records)


@pytest.mark.slow
def test_timeout_covers_all_attempts(tmp_path):
    # Each attempt fails after ~2 s; the 3 s budget leaves room for one restart
    # only, which is stopped at the deadline, not given 3 s of its own.
    result = run_behave("--exit", "1:3", "--delay", "2", "--hang", "--pid-dir", tmp_path,
                        workers=2, timeout=3.0, stream=io.StringIO(), restarts=5)
    assert result.timed_out, result.format_failure()
    assert result.returncode == launch.TIMEOUT_EXIT_CODE
    assert result.attempts == 2
    assert result.duration_s < 3.0 + launch.DEFAULT_GRACE_S
    _assert_all_dead(_records(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_signal_stops_everything_without_restart(sig, tmp_path):
    proc = subprocess.Popen(
        [*LAUNCH_CLI, "--workers", "2", "--restarts", "3", "--timeout", "100", BEHAVE, "--hang",
         "--pid-dir", str(tmp_path)],
        cwd=REPO_ROOT, env={**os.environ, **worker_env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,  # its own group, so this test can always clean it up
    )
    try:
        deadline = time.monotonic() + 60
        while len(_records(tmp_path)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        proc.send_signal(sig)  # to the launcher only, as Ctrl-C in a terminal would
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, err
        assert "restarting" not in out
        time.sleep(0.5)  # a restart, if there were one, would have written its pid files by now
        records = _records(tmp_path)
        assert sorted(records) == [(0, 0), (1, 0)]
        _assert_all_dead(records)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for record in _records(tmp_path).values():  # never leave a worker behind
            if launch.pid_alive(record["pid"]):
                try:
                    os.killpg(record["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_restarts_argument_errors(capsys):
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"restarts must be an int >= 0, got "):
            launch.run_workers(1, [sys.executable, BEHAVE], restarts=bad)
    with pytest.raises(SystemExit) as exc:
        launch.main(["--workers", "2", "--restarts", "-1", BEHAVE])
    assert exc.value.code == 2
    assert "--restarts must be at least 0, got -1" in capsys.readouterr().err


def test_describe_returncode():
    assert launch.describe_returncode(3) == "code 3"
    assert launch.describe_returncode(-9) == "-9 (SIGKILL)"
    assert launch.describe_returncode(None) == "no exit code"
