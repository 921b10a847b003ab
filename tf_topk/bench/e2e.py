"""End-to-end benchmark: `python -m tf_topk.bench e2e --workers 4 --bandwidth 100mbit --model wide --json`.

Trains the same model on the same generated data under
MultiWorkerMirroredStrategy, once with the plain optimizer (Keras's dense
all-reduce) and once with `tf_topk.TopKOptimizer` per density, and measures
per configuration: the median step time after warm-up, samples/s, and the
bytes each worker puts on the wire per step (its veth's tx/rx counters around
the timed steps), with ratios to dense.

`--calibrations N` trains nothing: the workers run the autopilot's
measurement of the cluster (`tf_topk.autopilot.measure`) N times in a row and
report each run's fitted all-reduce and all_gather rates as shares of
`--bandwidth`: whether the calibration reads the link it runs on
(`python -m tf_topk.bench e2e --workers 4 --bandwidth 100mbit --calibrations 10`).

Each worker runs in its own network namespace (root required; see
`tf_topk.bench.netns`): one veth per worker to a bridge in a namespace of its
own, addresses 10.213.0.0/24 that exist only there, every veth end's egress
limited by `tc tbf` to `--bandwidth`, and optionally delayed by `netem`
(`--latency`). Everything made (namespaces, links, bridge, worker processes)
is removed at the end, also on errors, Ctrl-C and SIGTERM; `--cleanup` removes
what a killed run (SIGKILL) left behind. `--no-netns` runs the workers on
localhost without limits (no root needed): bytes then come from the workers'
own TCP sockets (`ss`), as the loopback counters are shared.

Workers share this machine's cores: with 4 workers on 2 cores, compute is
slowed down too, so the defaults keep it small (the `wide` model has 12.6M
parameters but a batch of 16 per worker).
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time

from tf_topk.bench import netns as netns_lib
from tf_topk.launch import run_workers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_MODULE = "tf_topk.bench.e2e_worker"
BASE_PORT = 23456  # inside a namespace every port is free

# What run_workers starts for each worker in namespace mode, still in the root
# namespace: rewrites TF_CONFIG's hosts to the namespace addresses and execs
# `ip netns exec <ns> <worker command>` (same pid, so the launcher's process
# group handling still applies). Standard library only: TensorFlow is imported
# once, inside the namespace.
_ENTER_NAMESPACE = r"""
import json, os, sys
base, hosts, command = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
ports = [w.rsplit(":", 1)[1] for w in config["cluster"]["worker"]]
config["cluster"]["worker"] = [h + ":" + p for h, p in zip(hosts, ports)]
os.environ["TF_CONFIG"] = json.dumps(config)
os.execvp("ip", ["ip", "netns", "exec", base + "-w" + str(index)] + command)
"""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so every `finally` runs."""

    def __init__(self, signum):
        super().__init__(f"got signal {signum}")
        self.signum = signum


def _on_signal(signum, frame):
    raise Terminated(signum)


def _log(*parts):
    print("[e2e]", *parts, file=sys.stderr, flush=True)


class _Discard:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


def machine_info():
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "mem_gib": mem_gib, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg_start": [round(v, 2) for v in os.getloadavg()]}


def configurations(densities, dgc=False, adaptive=False, exchange_modes=None, bf16=False, autopilot=False):
    """The configuration names to run: `topk:<d>` per density (`topk:<d>@<mode>`
    per density and mode when `exchange_modes` is given), and so on."""
    suffixes = [""] if not exchange_modes else [f"@{m}" for m in exchange_modes]
    return (["dense"] + (["dense_bf16"] if bf16 else []) + [f"topk:{d:g}{s}" for d in densities for s in suffixes]
            + ([f"dgc:{d:g}{s}" for d in densities for s in suffixes] if dgc else [])
            + (["adaptive"] if adaptive else []) + (["autopilot"] if autopilot else []))


def _per_step(workers_results, key):
    """Mean over workers of `key` ('wire' or 'tcp') bytes per timed step, or None."""
    values = [r[key] for r in workers_results]
    if any(v is None for v in values):
        return None
    steps = workers_results[0]["steps"]
    return {direction: statistics.fmean(v[direction] for v in values) / steps for direction in ("sent", "received")}


def summarize(config, workers_results, duration_s):
    """One configuration's row from its workers' result files."""
    first = workers_results[0]
    # Step i of the cluster ends when its slowest worker is done.
    per_step = [max(r["step_times"][i] for r in workers_results) for i in range(first["steps"])]
    step_time = statistics.median(per_step)
    global_batch = first["batch_size"] * first["replicas"]
    wire, tcp = _per_step(workers_results, "wire"), _per_step(workers_results, "tcp")
    return {
        "config": config,
        "density": float(config.split(":", 1)[1].split("@")[0]) if ":" in config else None,
        "exchange_mode": config.split("@")[1] if "@" in config else None,
        "params": first.get("params"),
        "decoupled_momentum": first.get("decoupled_momentum"),  # TopKOptimizer's choice (AdamW at <= 0.01)
        "step_time_s": round(step_time, 5),
        "step_time_s_min": round(min(per_step), 5),
        "step_time_s_max": round(max(per_step), 5),
        "samples_per_s": round(global_batch / step_time, 2),
        "wire_tx_bytes_per_step": None if wire is None else round(wire["sent"]),
        "wire_rx_bytes_per_step": None if wire is None else round(wire["received"]),
        "tcp_sent_bytes_per_step": None if tcp is None else round(tcp["sent"]),
        "tcp_received_bytes_per_step": None if tcp is None else round(tcp["received"]),
        "estimated_bytes_sent_per_step": round(statistics.fmean(r["estimated_bytes_sent"] for r in workers_results)),
        "sent_density": first.get("compression_stats", {}).get("density"),  # the last step's
        "loss_first": round(first["losses"][0], 4),
        "loss_last": round(first["losses"][-1], 4),
        "ready_s": round(max(r["ready_s"] for r in workers_results), 1),
        "exchange_mode_code": first.get("compression_stats", {}).get("exchange_mode"),  # the last step's
        "autopilot": first.get("autopilot"),
        "duration_s": round(duration_s, 1),
    }


# The calibration reads the link right where each collective's fitted rate is within this share
# of the configured rate (a ring all-reduce and an all_gather send at most the link's rate).
RATE_TOLERANCE = 0.3


def summarize_calibrations(config, workers_results, duration_s, rate_bits):
    """The row of a `calibrate:<n>` configuration: per run, each collective's
    fitted rate as a share of the configured one (`rate_bits`, None on an
    unlimited link: no share), and how many runs read both within
    RATE_TOLERANCE. Every worker fits the same line (agreed), so worker 0's
    runs speak for all; that they agree is checked here."""
    runs = workers_results[0]["calibrations"]
    for other in workers_results[1:]:
        keys = ("all_reduce_bytes_per_s", "all_gather_bytes_per_s", "all_reduce_latency_s", "all_gather_latency_s")
        if [[r[k] for k in keys] for r in other["calibrations"]] != [[r[k] for k in keys] for r in runs]:
            raise RuntimeError(f"{config}: worker {other['index']} fitted other links than worker 0")
    configured = None if rate_bits is None else rate_bits / 8.0
    for run in runs:
        for kind in ("all_reduce", "all_gather"):
            fitted = run[f"{kind}_bytes_per_s"]
            run[f"{kind}_rate_share"] = (None if configured is None or fitted is None
                                         else round(fitted / configured, 3))
    shares = [(r["all_reduce_rate_share"], r["all_gather_rate_share"]) for r in runs]
    return {
        "config": config, "calibrations": runs, "runs": len(runs),
        "within_tolerance": (None if configured is None else
                             sum(all(s is not None and abs(s - 1.0) <= RATE_TOLERANCE for s in pair)
                                 for pair in shares)),
        "seconds_median": round(statistics.median(r["seconds"] for r in runs), 2),
        "seconds_max": round(max(r["seconds"] for r in runs), 2),
        "phases_median": {phase: round(statistics.median(r["phases"][phase] for r in runs), 3)
                          for phase in runs[0].get("phases") or {}},
        "duration_s": round(duration_s, 1),
    }


def format_calibrations(result, row):
    """The table of a `--calibrations` run: one line per calibration."""
    lines = [f"e2e --calibrations: {result['workers']} workers, bandwidth {result['bandwidth']}, model "
             f"{result['model']} ({result['params']:,} parameters)",
             f"{'run':>4} {'seconds':>8} {'all-reduce':>22} {'all_gather':>22} {'dense ms':>9} {'predicted':>10}"]

    def link(run, kind):
        rate, share = run[f"{kind}_bytes_per_s"], run[f"{kind}_rate_share"]
        text = "-" if rate is None else f"{rate * 8 / 1e6:,.1f} Mbit/s"
        return text + ("" if share is None else f" ({share:.2f}x)")

    def ms(value):
        return "-" if value is None else f"{value * 1e3:,.1f}"

    for i, run in enumerate(row["calibrations"]):
        lines.append(f"{i + 1:>4} {run['seconds']:>8.2f} {link(run, 'all_reduce'):>22} {link(run, 'all_gather'):>22} "
                     f"{ms(run['dense_s']):>9} {ms(run['dense_predicted_s']):>10}")
    if row.get("phases_median"):
        lines.append("median seconds per phase (worker 0): " +
                     ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in row["phases_median"].items()))
    if row["within_tolerance"] is not None:
        lines.append(f"{row['within_tolerance']} of {row['runs']} runs fitted both rates within "
                     f"{RATE_TOLERANCE:.0%} of the configured {result['bandwidth']}")
    return "\n".join(lines)


def add_ratios(rows):
    """speedup (dense step time / step time) and bytes reduction (dense bytes / bytes) per row."""
    dense = next((r for r in rows if r["config"] == "dense"), None)
    for row in rows:
        row["speedup_vs_dense"] = None
        row["bytes_reduction_vs_dense"] = None
        if dense is None:
            continue
        row["speedup_vs_dense"] = round(dense["step_time_s"] / row["step_time_s"], 3)
        for key in ("wire_tx_bytes_per_step", "tcp_sent_bytes_per_step"):
            if dense[key] and row[key]:
                row["bytes_reduction_vs_dense"] = round(dense[key] / row[key], 2)
                row["bytes_measured_by"] = key
                break
    return rows


def format_table(result):
    rows = result["configs"]
    wire = any(r["wire_tx_bytes_per_step"] is not None for r in rows)
    source = "wire" if wire else "tcp"
    head = (f"{'config':<20} {'step ms':>9} {'samples/s':>10} {source + ' tx MB':>10} {source + ' rx MB':>10} "
            f"{'est. MB':>8} {'speedup':>8} {'bytes/':>8}")
    lines = [f"e2e: {result['workers']} workers, bandwidth {result['bandwidth']}, latency {result['latency']}, "
             f"model {result['model']} ({result['params']:,} parameters), batch {result['batch_size']}/worker, "
             f"{result['steps']} timed steps after {result['warmup']} warm-up, "
             f"{'network namespaces' if result['netns'] else 'localhost, no limits'}",
             head, "-" * len(head)]

    def mb(value):
        return "-" if value is None else f"{value / 1e6:.3f}"

    for r in rows:
        tx = r["wire_tx_bytes_per_step"] if wire else r["tcp_sent_bytes_per_step"]
        rx = r["wire_rx_bytes_per_step"] if wire else r["tcp_received_bytes_per_step"]
        speed = "-" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
        ratio = "-" if r["bytes_reduction_vs_dense"] is None else f"{r['bytes_reduction_vs_dense']:.1f}x"
        lines.append(f"{r['config']:<20} {r['step_time_s'] * 1e3:>9.1f} {r['samples_per_s']:>10.1f} {mb(tx):>10} "
                     f"{mb(rx):>10} {mb(r['estimated_bytes_sent_per_step']):>8} {speed:>8} {ratio:>8}")
    lines.append("MB per worker per step; speedup = dense step time / step time; bytes/ = dense bytes / bytes.")
    return "\n".join(lines)


def run_config(config, args, cluster, run_id, out_dir, stream):
    """Launch the workers for one configuration; returns its summary row."""
    config_dir = os.path.join(out_dir, config.replace(":", "_"))
    os.makedirs(config_dir)
    worker = [sys.executable, "-m", WORKER_MODULE, "--config", config, "--model", args.model,
              "--optimizer", args.optimizer,
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
              "--learning-rate", str(args.learning_rate), "--seed", str(args.seed), "--threads", str(args.threads),
              "--out", config_dir, "--parent-pid", str(os.getpid()), "--run-id", run_id,
              "--iface", netns_lib.WORKER_IFACE if cluster is not None else ""]
    if cluster is not None:
        argv = [sys.executable, "-c", _ENTER_NAMESPACE, cluster.base, ",".join(cluster.addresses), *worker]
        ports = [BASE_PORT + i for i in range(args.workers)]
    else:
        argv, ports = worker, None
    env = {"PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"), "CUDA_VISIBLE_DEVICES": "-1"}
    _log(f"{config}: starting {args.workers} workers")
    launched = run_workers(args.workers, argv, env=env, timeout=args.timeout, ports=ports, stream=stream,
                           cwd=REPO_ROOT)
    if not launched.ok:
        raise RuntimeError(f"{config}: workers failed\n{launched.format_failure()}")
    results = []
    for i in range(args.workers):
        with open(os.path.join(config_dir, f"result_{i}.json")) as f:
            results.append(json.load(f))
    if config.startswith("calibrate:"):
        row = summarize_calibrations(config, results, launched.duration_s,
                                     netns_lib.parse_rate(args.bandwidth) if cluster is not None else None)
        _log(f"{config}: {row['runs']} calibrations, median {row['seconds_median']} s, {launched.duration_s:.0f} s")
        return row, results[0]
    row = summarize(config, results, launched.duration_s)
    _log(f"{config}: median step {row['step_time_s'] * 1e3:.1f} ms, "
         f"tx {row['wire_tx_bytes_per_step'] or row['tcp_sent_bytes_per_step']} B/step/worker, "
         f"{launched.duration_s:.0f} s")
    return row, results[0]


def run(args):
    run_id = args.run_id or os.urandom(3).hex()
    started = time.monotonic()
    result = {
        "benchmark": "e2e", "workers": args.workers, "bandwidth": args.bandwidth if args.netns else "none",
        "latency": args.latency, "netns": args.netns, "model": args.model, "optimizer": args.optimizer,
        "batch_size": args.batch_size,
        "steps": args.steps, "warmup": args.warmup, "run_id": run_id,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "command": "python -m tf_topk.bench e2e " + " ".join(args.argv),
    }
    stream = sys.stderr if args.verbose else _Discard()
    out_dir = tempfile.mkdtemp(prefix=f"tftopk-e2e-{run_id}-")
    cluster = None
    rows = []
    try:
        if args.netns:
            removed, problems = netns_lib.cleanup_stale()
            if removed:
                _log(f"removed leftovers of earlier runs: {removed} {problems or ''}")
            cluster = netns_lib.NetnsCluster(args.workers, netns_lib.parse_rate(args.bandwidth),
                                             netns_lib.parse_latency(args.latency), run_id=run_id)
            _log(f"setting up namespaces {cluster.base}-*")
            cluster.setup()  # a partial set-up is removed by the teardown below
            result["qdiscs"] = cluster.describe()
        configs = ([f"calibrate:{args.calibrations}"] if args.calibrations else
                   configurations(args.densities, args.dgc, args.adaptive, args.exchange_modes, args.bf16,
                                  args.autopilot))
        for config in configs:
            row, first = run_config(config, args, cluster, run_id, out_dir, stream)
            rows.append(row)
            result.update(params=first["params"], tf_version=first["tf_version"],
                          keras_version=first["keras_version"])
    finally:
        # No signal may interrupt the clean-up.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            if cluster is not None:
                problems = cluster.teardown()
                if problems:
                    _log("CLEANUP PROBLEMS:", *problems)
                else:
                    _log(f"removed namespaces {cluster.base}-*")
            shutil.rmtree(out_dir, ignore_errors=True)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    result["configs"] = rows if args.calibrations else add_ratios(rows)
    result["duration_s"] = round(time.monotonic() - started, 1)
    result["machine"]["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    return result


def _parse_densities(text):
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"densities must be comma-separated numbers, got {text!r}")
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"densities must be in (0, 1], got {text!r}")
    return values


def _parse_modes(text):
    from tf_topk.config import EXCHANGE_MODES

    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in EXCHANGE_MODES for v in values):
        raise argparse.ArgumentTypeError(f"exchange modes must be among {','.join(EXCHANGE_MODES)}, got {text!r}")
    return values


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m tf_topk.bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--bandwidth", default="100mbit", help="per-worker link rate (tc tbf): 100mbit, 1gbit, "
                        "10gbit, none (default 100mbit)")
    parser.add_argument("--latency", default=None, help="one-way delay added by netem, e.g. 1ms (needs sch_netem)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="sgd: SGD with momentum 0.9 (default); adamw: AdamW with weight decay 0.01, which "
                             "TopKOptimizer runs with decoupled momentum at a fixed density of 0.01 or less")
    parser.add_argument("--model", choices=("wide", "cnn", "tiny", "transformer"), default="wide",
                        help="wide: 12.6M-parameter MLP; cnn: small CNN (0.2M); tiny: for tests")
    parser.add_argument("--densities", type=_parse_densities, default=[0.01, 0.001],
                        help="comma-separated TopK densities (default 0.01,0.001)")
    parser.add_argument("--exchange-modes", type=_parse_modes, default=None,
                        help="comma-separated exchange modes to run each density with, as topk:<d>@<mode> "
                             "(allgather, allreduce, auto; default: the library's default only)")
    parser.add_argument("--dgc", action="store_true",
                        help="also run dgc:<d> per density: momentum correction and sparse updates")
    parser.add_argument("--adaptive", action="store_true",
                        help="also run `adaptive`: the density chosen every step (default link model)")
    parser.add_argument("--bf16", action="store_true",
                        help="also run `dense_bf16`: every entry all-reduced in bfloat16, rounding error kept")
    parser.add_argument("--autopilot", action="store_true",
                        help="also run `autopilot`: the link measured, route and density chosen by time")
    parser.add_argument("--calibrations", type=int, default=0,
                        help="instead of training: the autopilot's measurement of the cluster this many times in "
                             "a row, each run's fitted rates against --bandwidth")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (tracing, connections)")
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="TF intra-op threads per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    parser.add_argument("--no-netns", dest="netns", action="store_false",
                        help="workers on localhost, no namespaces, no limits, no root needed")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove namespaces and processes left by earlier runs (whose process is gone), then exit")
    parser.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--verbose", "-v", action="store_true", help="stream the workers' output to stderr")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.cleanup:
        problem = netns_lib.missing_requirements()
        if problem:
            print(f"e2e --cleanup: {problem}", file=sys.stderr)
            return 2
        removed, problems = netns_lib.cleanup_stale()
        print(json.dumps({"removed": removed, "problems": problems}) if args.json else
              f"removed {len(removed)} namespaces: {removed}" + (f"; problems: {problems}" if problems else ""))
        return 1 if problems else 0
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.calibrations < 0:
        parser.error(f"--calibrations must be >= 0, got {args.calibrations}")
    if args.steps < 1 or args.warmup < 1 or args.batch_size < 1:
        parser.error("--steps, --warmup and --batch-size must be >= 1")
    if args.run_id is not None and not args.run_id.isalnum():
        parser.error("--run-id must be alphanumeric")
    try:
        rate = netns_lib.parse_rate(args.bandwidth)
        netns_lib.parse_latency(args.latency)
    except ValueError as e:
        parser.error(str(e))
    if args.netns:
        problem = netns_lib.missing_requirements()
        if problem:
            print(f"e2e: {problem}", file=sys.stderr)
            return 2
    elif rate is not None or args.latency:
        parser.error("--no-netns cannot limit bandwidth or add latency: pass --bandwidth none and no --latency")

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = run(args)
    except Terminated as e:
        _log(f"stopped by signal {e.signum}; everything removed")
        return 128 + e.signum
    except KeyboardInterrupt:
        _log("interrupted; everything removed")
        return 130
    except (RuntimeError, netns_lib.NetnsError) as e:
        print(f"e2e: {e}", file=sys.stderr)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_calibrations(result, result["configs"][0]) if args.calibrations else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
