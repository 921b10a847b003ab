"""`python -m tf_topk.bench e2e`: a tiny run, clean-up on SIGTERM, --cleanup of leftovers.

As root with `ip` and `tc` (CI), the runs use network namespaces and a rate
limit; otherwise (or with TF_TOPK_TEST_NO_NETNS=1) `--no-netns` (localhost,
no limits). Either way every test checks that no namespace and no worker
process of its run is left.
"""

import json
import math
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
from tf_topk.calibrate import CONTRADICTED
from tf_topk.launch import pid_alive

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
        except OSError:
            continue
        if tag in cmdline and pid_alive(int(entry)):
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


def test_calibration_runs_are_read_against_the_configured_rate():
    def run(all_reduce_mbit, all_gather_mbit):
        return {"seconds": 2.0, "dense_s": 0.5, "dense_predicted_s": 0.4, "refit_from_s": None, "line": "",
                "phases": {"all_reduce": 0.6, "all_gather": all_gather_mbit / 100, "compute": 0.3},
                "all_reduce_latency_s": 1e-3, "all_gather_latency_s": 2e-3,
                "all_reduce_bytes_per_s": all_reduce_mbit * 1e6 / 8, "all_gather_bytes_per_s": all_gather_mbit * 1e6 / 8}

    runs = [run(95, 80), run(100, 60), run(1, 99)]  # the second and third misread a link by more than 30%
    workers = [{"index": i, "calibrations": [dict(r) for r in runs]} for i in range(2)]
    row = e2e.summarize_calibrations("calibrate:3", workers, 30.0, 100e6)
    assert row["runs"] == 3 and row["within_tolerance"] == 1
    assert [r["all_reduce_rate_share"] for r in row["calibrations"]] == [0.95, 1.0, 0.01]
    table = e2e.format_calibrations({"workers": 2, "bandwidth": "100mbit", "model": "wide", "params": 10}, row)
    assert "1 of 3 runs fitted both rates within 30% of the configured 100mbit" in table
    assert row["phases_median"] == {"all_reduce": 0.6, "all_gather": 0.8, "compute": 0.3}
    assert "median seconds per phase (worker 0): all_reduce 0.60, all_gather 0.80, compute 0.30" in table
    assert e2e.summarize_calibrations("calibrate:3", workers, 30.0, None)["within_tolerance"] is None
    workers[1]["calibrations"][2]["all_gather_bytes_per_s"] *= 2  # every worker must have fitted the same lines
    with pytest.raises(RuntimeError, match="worker 1 fitted other links than worker 0"):
        e2e.summarize_calibrations("calibrate:3", workers, 30.0, 100e6)


def test_bad_calibration_counts_are_refused_by_name(capsys):
    from tf_topk.bench.e2e_worker import parse_config

    assert parse_config("calibrate:10") == ("calibrate", 10, None)
    for text in ("calibrate:0", "calibrate:-1", "calibrate:x"):
        with pytest.raises(ValueError, match="'calibrate:<runs>'"):
            parse_config(text)
    with pytest.raises(SystemExit):
        e2e.main(["--calibrations", "-1", "--no-netns", "--bandwidth", "none"])
    assert "--calibrations must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrations_measure_the_link_again_and_again_and_leave_nothing():
    """`--calibrations 2`: no training, the autopilot's measurement twice on two workers (in
    namespaces at 1 Gbit/s where root allows), every worker fitting the same links each time."""
    run_id = _run_id()
    argv = BENCH + ["--workers", "2", "--model", "tiny", "--calibrations", "2", *MODE_ARGS, "--json",
                    "--run-id", run_id, "--timeout", "150"]
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=300)
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        (row,) = json.loads(proc.stdout)["configs"]
        assert row["config"] == "calibrate:2" and row["runs"] == 2
        for calibration in row["calibrations"]:
            # A rate of None is a line with no slope read as a free link (a flat line is timed on
            # larger sizes, then takes the stated fallback).
            assert calibration["all_reduce_bytes_per_s"] and calibration["all_gather_bytes_per_s"], calibration["line"]
            assert calibration["all_reduce_bytes_per_s"] > 0 and calibration["all_gather_bytes_per_s"] > 0
            assert calibration["dense_predicted_s"] > 0 and calibration["line"].startswith("calibration ("), \
                calibration["line"]
        assert (row["within_tolerance"] is None) == (not USE_NETNS)
    finally:
        _assert_nothing_left(run_id)


def test_exchange_modes_name_the_configurations_and_reach_the_workers(capsys):
    from tf_topk.bench.e2e_worker import parse_config

    assert e2e.configurations([0.01, 0.001]) == ["dense", "topk:0.01", "topk:0.001"]
    assert e2e.configurations([0.01], dgc=True, exchange_modes=["allgather", "allreduce"]) == [
        "dense", "topk:0.01@allgather", "topk:0.01@allreduce", "dgc:0.01@allgather", "dgc:0.01@allreduce"]
    assert parse_config("topk:0.01@allreduce") == ("topk", 0.01, "allreduce")
    assert parse_config("dgc:1e-3") == ("dgc", 0.001, None)
    assert parse_config("dense") == (None, None, None)
    assert parse_config("dense_bf16") == ("dense_bf16", 1.0, "dense_bf16")
    assert parse_config("autopilot") == ("autopilot", "autopilot", None)
    assert e2e.configurations([0.01], bf16=True, autopilot=True) == ["dense", "dense_bf16", "topk:0.01", "autopilot"]
    for bad in ("topk:0.01@", "topk:2", "topk:0.01@all-gather"):
        with pytest.raises(ValueError, match="config must be"):
            parse_config(bad)
    row = e2e.summarize("topk:0.01@allreduce", [{"steps": 1, "step_times": [1.0], "batch_size": 8, "replicas": 2,
                                                 "losses": [1.0], "ready_s": 1.0, "wire": None, "tcp": None,
                                                 "estimated_bytes_sent": 10}], 1.0)
    assert (row["density"], row["exchange_mode"]) == (0.01, "allreduce")
    with pytest.raises(SystemExit):
        e2e.main(["--exchange-modes", "allgather,ring", "--no-netns", "--bandwidth", "none"])
    assert "exchange modes must be among auto,allgather,allreduce,dense_bf16,allgather_int8,allgather_chunk, got 'allgather,ring'" in \
        capsys.readouterr().err


def test_refuses_limits_without_namespaces_and_explains_root(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--no-netns", "--bandwidth", "100mbit"])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert e2e.main(["--workers", "2"]) == 2
    assert "root" in capsys.readouterr().err


# -- real runs ---------------------------------------------------------------------------------

# The `tiny` model of e2e_worker: Dense(256) on 256 inputs, then Dense(10).
TINY_SHAPES = [(256, 256), (256,), (256, 10), (10,)]
TINY_WORKERS, TINY_BATCH, TINY_STEPS, TINY_DENSITY = 2, 16, 3, 0.01
MIN_SIZE = 4096  # tf_topk.exchange.DEFAULT_MIN_SIZE: smaller variables take the dense all-reduce


def _ring_bytes(entries, replicas):
    """Bytes one worker sends in a ring all-reduce of `entries` float32 values."""
    return 2 * (replicas - 1) / replicas * 4 * entries


def _expected_bytes_sent(shapes, density, replicas, min_size=MIN_SIZE):
    """What the exchange should report per worker and step: (value, index) pairs of 8 bytes to every
    other replica for the sparsified variables, plus the dense ones and the non-finite count, which
    ride in the same all_gather at 2 workers (as many bytes as their ring all-reduce)."""
    sizes = [math.prod(s) for s in shapes]
    if density is None:
        return _ring_bytes(sum(sizes), replicas)
    k_total = sum(max(1, min(n, math.ceil(density * n))) for n in sizes if n >= min_size)
    dense_entries = sum(n for n in sizes if n < min_size) + 1
    return (replicas - 1) * 8 * k_total + _ring_bytes(dense_entries, replicas)


def test_byte_arithmetic_matches_the_library():
    from tf_topk.routes import gather_bytes, mode_bytes, ring_all_reduce_bytes
    from tf_topk.exchange import DEFAULT_MIN_SIZE

    assert DEFAULT_MIN_SIZE == MIN_SIZE
    for replicas in (1, 2, 3, 4, 8):
        for entries in (1, 2826, 68362):
            ring = _ring_bytes(entries, replicas) if replicas > 1 else 0.0
            assert ring_all_reduce_bytes(4.0 * entries, replicas) == pytest.approx(ring)
            assert mode_bytes("allgather", 656, entries, replicas) == (replicas - 1) * 8 * 656
            assert gather_bytes(entries, replicas) == pytest.approx(ring if replicas <= 2 else
                                                                   (replicas - 1) * 4 * entries)
    # The tiny model: 256 x 256 kernel sparsified (k = 656 at 0.01); 2,826 dense entries and the count.
    assert _expected_bytes_sent(TINY_SHAPES, 0.01, 2) == 8 * 656 + 4 * 2827 == 16556
    assert _expected_bytes_sent(TINY_SHAPES, None, 2) == 4 * 68362


def check_tiny_run(result, use_netns, tcp_expected):
    """Every check of the tiny run's JSON (separate so it can be tried on altered results)."""
    assert result["netns"] is use_netns
    assert result["workers"] == TINY_WORKERS and result["model"] == "tiny"
    assert result["params"] == sum(math.prod(s) for s in TINY_SHAPES) == 68362
    assert (result["steps"], result["warmup"], result["batch_size"]) == (TINY_STEPS, 1, TINY_BATCH)
    dense, topk = result["configs"]
    assert (dense["config"], topk["config"]) == ("dense", f"topk:{TINY_DENSITY:g}")
    assert (dense["density"], topk["density"]) == (None, TINY_DENSITY)
    for row in (dense, topk):
        # Step times: positive, finite, ordered; samples/s from the global batch.
        times = (row["step_time_s_min"], row["step_time_s"], row["step_time_s_max"])
        assert all(math.isfinite(t) for t in times) and 0 < times[0] <= times[1] <= times[2] < 60, row
        # step_time_s is rounded to 1e-5 s, so a fast step carries up to 0.5e-5 / step_time of relative error.
        assert row["samples_per_s"] == pytest.approx(TINY_WORKERS * TINY_BATCH / row["step_time_s"],
                                                     rel=max(1e-3, 1e-5 / row["step_time_s"]))
        assert row["speedup_vs_dense"] == pytest.approx(dense["step_time_s"] / row["step_time_s"], abs=1e-3)
        assert 0 < row["ready_s"] and 0 < row["duration_s"] < 200
        # Losses: finite cross-entropies of 10 classes (ln 10 = 2.3 at chance), no divergence.
        for loss in (row["loss_first"], row["loss_last"]):
            assert math.isfinite(loss) and 0.5 < loss < 10, row
    # Same model, seed and batches: the first step's loss (before any update) is the same.
    assert topk["loss_first"] == pytest.approx(dense["loss_first"], abs=2e-4)
    # The optimizer's own statistics (in-process, no tools needed): the exchange's arithmetic.
    # Dense: Keras's ring all-reduce of every parameter; top-k: 656 pairs + 2,826 entries and the count.
    assert dense["estimated_bytes_sent_per_step"] == round(_expected_bytes_sent(TINY_SHAPES, None, 2)) == 273448
    assert topk["estimated_bytes_sent_per_step"] == round(
        _expected_bytes_sent(TINY_SHAPES, TINY_DENSITY, 2)) == 16556
    # Measured bytes: the interface counters in namespaces, the workers' TCP sockets with `ss`.
    measured = []
    if use_netns:
        measured.append("wire")
    else:
        assert dense["wire_tx_bytes_per_step"] is None and topk["wire_tx_bytes_per_step"] is None
    if tcp_expected:
        measured.append("tcp")
    for source in measured:
        keys = ("wire_tx_bytes_per_step", "wire_rx_bytes_per_step") if source == "wire" else (
            "tcp_sent_bytes_per_step", "tcp_received_bytes_per_step")
        for row in (dense, topk):
            estimate = row["estimated_bytes_sent_per_step"]
            for key in keys:  # with 2 workers each receives what the other sends
                # Payload plus framing (and headers on the wire): measured 1.00x-1.15x the estimate.
                assert row[key] is not None and 0.95 * estimate <= row[key] <= 1.5 * estimate, (key, row)
    key = "wire_tx_bytes_per_step" if use_netns else "tcp_sent_bytes_per_step"
    if measured:
        assert topk["bytes_measured_by"] == key
        assert topk["bytes_reduction_vs_dense"] == pytest.approx(dense[key] / topk[key], abs=0.01)
        # Estimated reduction 16.5x; measured 15x-16.4x.
        assert topk["bytes_reduction_vs_dense"] > 10
    else:  # no measurement: no made-up ratio
        assert topk["bytes_reduction_vs_dense"] is None
    if use_netns:
        assert any("tbf" in line for line in result["qdiscs"])


@pytest.mark.slow
def test_tiny_run_reports_fewer_bytes_for_topk_and_leaves_nothing():
    run_id = _run_id()
    argv = BENCH + ["--workers", str(TINY_WORKERS), "--model", "tiny", "--steps", str(TINY_STEPS), "--warmup", "1",
                    "--batch-size", str(TINY_BATCH), "--densities", str(TINY_DENSITY), "--json", "--run-id", run_id,
                    "--timeout", "100"] + MODE_ARGS
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=180)
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        # The workers read their sockets with `ss` (from the same PATH) when it is installed.
        check_tiny_run(json.loads(proc.stdout), USE_NETNS, tcp_expected=shutil.which("ss") is not None)
    finally:
        _assert_nothing_left(run_id)


@pytest.mark.slow
def test_the_transformer_with_adamw_runs_decoupled_momentum_at_a_low_density():
    """The language model's step under AdamW, dense against the default at 0.01 (decoupled momentum),
    for the time-to-loss comparison of benchmarks/RESULTS.md."""
    run_id = _run_id()
    argv = BENCH + ["--workers", "2", "--model", "transformer", "--optimizer", "adamw", "--steps", "2", "--warmup",
                    "1", "--batch-size", "4", "--densities", "0.01", "--json", "--run-id", run_id,
                    "--timeout", "150"] + MODE_ARGS
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=240)
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout)
        assert (result["model"], result["optimizer"]) == ("transformer", "adamw")
        dense, topk = result["configs"]
        assert (dense["config"], topk["config"]) == ("dense", "topk:0.01")
        assert dense["params"] == topk["params"] > 400_000
        assert (dense["decoupled_momentum"], topk["decoupled_momentum"]) == (False, True)
        assert topk["estimated_bytes_sent_per_step"] < 0.1 * dense["estimated_bytes_sent_per_step"]
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


@pytest.mark.timing
@pytest.mark.slow
@pytest.mark.skipif(not USE_NETNS, reason="needs root, ip and tc (network namespaces)")
def test_autopilot_sends_little_on_a_slow_link_and_bf16_halves_the_dense_bytes():
    """Two workers in namespaces, `tc` limiting each to 10 Mbit/s: the autopilot measures that link
    (not told it) and goes sparse; the 16-bit baseline sends half of dense's bytes."""
    run_id = _run_id()
    argv = BENCH + ["--workers", "2", "--model", "tiny", "--steps", "3", "--warmup", "1", "--densities", "0.01",
                    "--bf16", "--autopilot", "--bandwidth", "10mbit", "--json", "--run-id", run_id,
                    "--timeout", "150"]
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=400)
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = {row["config"]: row for row in json.loads(proc.stdout)["configs"]}
        assert list(rows) == ["dense", "dense_bf16", "topk:0.01", "autopilot"]
        dense, bf16, autopilot = rows["dense"], rows["dense_bf16"], rows["autopilot"]
        # bfloat16: the sparsified kernel's 65,536 entries in 2 bytes; the 2,826 small ones and the count in 4.
        assert bf16["estimated_bytes_sent_per_step"] == round(2 * 65_536 + 4 * 2_827)
        assert 0.4 < bf16["wire_tx_bytes_per_step"] / dense["wire_tx_bytes_per_step"] < 0.65
        facts = autopilot["autopilot"]
        assert facts["line"].startswith("tf_topk autopilot: calibration (")
        # The measured link: within CONTRADICTED (3x) of 10 Mbit/s (1.25 MB/s; TCP and framing take their share),
        # what the calibration keeps a line to where it times the dense all-reduce (else it refits through that
        # call). The line of a few small sizes read 20 Mbit/s once, beside a timed all-reduce at 10 Mbit/s.
        assert 1 / CONTRADICTED / 1.25e6 < facts["model"]["all_reduce"]["seconds_per_byte"] < \
            CONTRADICTED / 1.25e6, facts
        # It sends little: a sparse route, a small part of dense's bytes (the adaptive density moves with the
        # gradients: 3 to 11% of dense's bytes in the runs seen, 10.7% once; the top of its range, 0.1, would
        # send about a fifth).
        assert autopilot["exchange_mode_code"] in (1.0, 2.0), autopilot
        assert autopilot["wire_tx_bytes_per_step"] < 0.15 * dense["wire_tx_bytes_per_step"]
    finally:
        _assert_nothing_left(run_id)
