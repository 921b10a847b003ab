"""`python -m tf_topk.bench e2e`: a tiny run, clean-up on SIGTERM, --cleanup of leftovers.

As root with `ip` and `tc` (CI), the runs use network namespaces and a rate
limit; otherwise (or with TF_TOPK_TEST_NO_NETNS=1) `--no-netns` (localhost,
no limits). Either way every test checks that no namespace and no worker
process of its run is left.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tf_topk.bench import e2e, netns

REPO_ROOT = Path(__file__).resolve().parents[1]

BENCH = [sys.executable, "-m", "tf_topk.bench", "e2e"]


def _netns_usable():
    """Root, ip and tc present, and a namespace can really be made here (TF_TOPK_TEST_NO_NETNS=1: no)."""
    if os.environ.get("TF_TOPK_TEST_NO_NETNS") == "1" or netns.missing_requirements() is not None:
        return False
    probe = f"{netns.PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}-br"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


USE_NETNS = _netns_usable()
MODE_ARGS = ["--bandwidth", "1gbit"] if USE_NETNS else ["--no-netns", "--bandwidth", "none"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _run_id():
    return "t" + secrets.token_hex(4)


def _our_namespaces(run_id):
    if shutil.which("ip") is None:
        return []
    return [n for n in netns.list_namespaces() if n.startswith(netns.PREFIX) and f"-{run_id}-" in n]


def _processes_with(tag):
    """Live processes whose command line mentions `tag` (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if tag in cmdline and state not in ("Z", "X"):
            found.append((int(entry), cmdline.replace("\0", " ")[:200]))
    return found


def _assert_nothing_left(run_id):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_our_namespaces(run_id) or _processes_with(run_id)):
        time.sleep(0.2)
    assert _our_namespaces(run_id) == []
    assert _processes_with(run_id) == []


# -- fast checks of the pieces -----------------------------------------------------------------

def test_parse_rate_and_latency():
    assert netns.parse_rate("100mbit") == 100e6
    assert netns.parse_rate("10gbit") == 10e9
    assert netns.parse_rate("1.5mbit") == 1.5e6
    assert netns.parse_rate("none") is None
    for bad in ("100", "100mb", "fast", "-1mbit"):
        with pytest.raises(ValueError):
            netns.parse_rate(bad)
    assert netns.parse_latency("1ms") == pytest.approx(1e-3)
    assert netns.parse_latency("250us") == pytest.approx(250e-6)
    assert netns.parse_latency(None) is None
    with pytest.raises(ValueError):
        netns.parse_latency("1 ms")


def test_names_carry_owner_and_stay_in_the_private_subnet():
    cluster = netns.NetnsCluster(4, run_id="abc123")
    assert netns.parse_name(cluster.bridge_ns) == (os.getpid(), "abc123", "br")
    assert netns.parse_name(cluster.worker_ns[3]) == (os.getpid(), "abc123", "w3")
    assert netns.parse_name("someone-elses-namespace") is None
    assert cluster.addresses == ["10.213.0.1", "10.213.0.2", "10.213.0.3", "10.213.0.4"]
    with pytest.raises(ValueError):
        netns.NetnsCluster(2, run_id="Bad-Id")


def test_summary_and_ratios():
    def worker(times, sent, est):
        return {"steps": len(times), "step_times": times, "batch_size": 8, "replicas": 2, "losses": [2.0, 1.0],
                "ready_s": 3.0, "wire": {"sent": sent * len(times), "received": sent * len(times)},
                "tcp": None, "estimated_bytes_sent": est}

    dense = e2e.summarize("dense", [worker([1.0, 2.0, 3.0], 1000, 990), worker([1.5, 1.0, 3.5], 1000, 990)], 10)
    topk = e2e.summarize("topk:0.01", [worker([0.5, 0.5, 0.5], 10, 9), worker([0.5, 0.25, 0.5], 10, 9)], 5)
    assert dense["step_time_s"] == 2.0  # median of per-step maxima (1.5, 2.0, 3.5)
    assert dense["samples_per_s"] == 8.0
    assert dense["wire_tx_bytes_per_step"] == 1000
    rows = e2e.add_ratios([dense, topk])
    assert rows[1]["speedup_vs_dense"] == 4.0
    assert rows[1]["bytes_reduction_vs_dense"] == 100.0
    assert rows[1]["density"] == 0.01
    table = e2e.format_table({"configs": rows, "workers": 2, "bandwidth": "100mbit", "latency": None,
                              "model": "tiny", "params": 1000, "batch_size": 8, "steps": 3, "warmup": 1,
                              "netns": True})
    assert "topk:0.01" in table and "4.00x" in table


def test_refuses_limits_without_namespaces_and_explains_root(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--no-netns", "--bandwidth", "100mbit"])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert e2e.main(["--workers", "2"]) == 2
    assert "root" in capsys.readouterr().err


# -- real runs ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_run_reports_fewer_bytes_for_topk_and_leaves_nothing():
    run_id = _run_id()
    argv = BENCH + ["--workers", "2", "--model", "tiny", "--steps", "3", "--warmup", "1", "--densities", "0.01",
                    "--json", "--run-id", run_id, "--timeout", "100"] + MODE_ARGS
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=180)
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout)
        assert result["netns"] is USE_NETNS
        assert result["workers"] == 2 and result["model"] == "tiny" and result["params"] > 60_000
        dense, topk = result["configs"]
        assert (dense["config"], topk["config"]) == ("dense", "topk:0.01")
        for row in (dense, topk):
            assert row["step_time_s"] > 0 and row["samples_per_s"] > 0
            for key in ("wire_tx_bytes_per_step", "wire_rx_bytes_per_step", "tcp_sent_bytes_per_step",
                        "estimated_bytes_sent_per_step", "speedup_vs_dense", "bytes_reduction_vs_dense"):
                assert key in row
        key = "wire_tx_bytes_per_step" if USE_NETNS else "tcp_sent_bytes_per_step"
        if USE_NETNS or dense[key] is not None:  # `ss` may be missing without namespaces
            assert topk[key] < dense[key] / 5, (topk, dense)
            # Dense ring all-reduce of 2 workers: about 4 bytes per parameter each way.
            assert 0.8 * 4 * result["params"] < dense[key] < 1.5 * 4 * result["params"]
            assert topk["bytes_reduction_vs_dense"] > 5
        assert topk["estimated_bytes_sent_per_step"] < dense["estimated_bytes_sent_per_step"]
        if USE_NETNS:
            assert any("tbf" in line for line in result["qdiscs"])
    finally:
        _assert_nothing_left(run_id)


@pytest.mark.slow
def test_sigterm_stops_workers_and_removes_namespaces():
    run_id = _run_id()
    argv = BENCH + ["--workers", "2", "--model", "tiny", "--steps", "100000", "--warmup", "1", "--densities",
                    "0.01", "--run-id", run_id, "--timeout", "100"] + MODE_ARGS
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        # Wait until both workers run (inside their namespaces when USE_NETNS).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            workers = [p for p in _processes_with(run_id) if "e2e_worker" in p[1] and " -c " not in p[1]]
            if len(workers) >= 2 and (not USE_NETNS or len(_our_namespaces(run_id)) == 3):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"workers did not start: {proc.poll()} {proc.stderr.read()[-3000:] if proc.poll() else ''}")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "stopped by signal" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _assert_nothing_left(run_id)


@pytest.mark.slow
@pytest.mark.skipif(not USE_NETNS, reason="needs root, ip and tc (network namespaces)")
def test_cleanup_removes_leftovers_of_a_dead_run_only():
    dead = subprocess.Popen(["true"])
    dead.wait()
    run_id = _run_id()
    stale = [f"{netns.PREFIX}{dead.pid}-{run_id}-w0", f"{netns.PREFIX}{dead.pid}-{run_id}-br"]
    live = f"{netns.PREFIX}{os.getpid()}-{run_id}l-br"  # owner (this process) alive: must stay
    sleeper = None
    try:
        for name in stale + [live]:
            subprocess.run(["ip", "netns", "add", name], check=True)
        # A process left inside a stale namespace (as after SIGKILL of a run) is killed too.
        sleeper = subprocess.Popen(["ip", "netns", "exec", stale[0], "sleep", "300"])
        time.sleep(0.3)
        proc = subprocess.run(BENCH + ["--cleanup", "--json"], cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert set(stale) <= set(report["removed"])
        assert live not in report["removed"]
        assert sleeper.wait(timeout=10) != 0
        names = netns.list_namespaces()
        assert not set(stale).intersection(names)
        assert live in names
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        for name in stale + [live]:
            netns.remove_namespace(name)
    assert not _our_namespaces(run_id) and not _our_namespaces(run_id + "l")
