"""Worker for launcher tests: print, fail, hang or spawn children on request.

No TensorFlow: it starts in milliseconds. Options (all optional):
  --record DIR        write TF_CONFIG and the argv to DIR/worker_{i}.json
  --stderr            also print a line to stderr
  --startup-log       first print TensorFlow's start-up log lines (as TF 2.21 does) to stderr
  --shutdown-race-log worker 1 prints the coordination service's end-of-job error (as TF 2.21 does)
  --no-newline        end with a partial line (no trailing newline)
  --exit I:CODE       worker I exits with CODE after --delay seconds (CODE -S: kills
                      itself with signal S)
  --exit-attempts N   apply --exit only on attempts below N ($TF_TOPK_RESTART < N)
  --pid-dir DIR       write DIR/worker{i}_attempt{a}.json: pid, attempt, TF_CONFIG
  --delay S           (default 0.3)
  --ignore-sigterm    ignore SIGTERM (the launcher must SIGKILL)
  --grandchild DIR    start a `sleep` grandchild and write its pid to DIR/grandchild_{i}
  --hang              every worker not told to exit sleeps "forever"
Without --hang, workers not told to exit return 0.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--record")
p.add_argument("--stderr", action="store_true")
p.add_argument("--startup-log", action="store_true")
p.add_argument("--shutdown-race-log", action="store_true")
p.add_argument("--no-newline", action="store_true")
p.add_argument("--exit", action="append", default=[])
p.add_argument("--exit-attempts", type=int, default=None)
p.add_argument("--pid-dir")
p.add_argument("--delay", type=float, default=0.3)
p.add_argument("--ignore-sigterm", action="store_true")
p.add_argument("--grandchild")
p.add_argument("--hang", action="store_true")
args, rest = p.parse_known_args()

config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
attempt = int(os.environ.get("TF_TOPK_RESTART", "0"))
if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if args.record:
    with open(os.path.join(args.record, f"worker_{index}.json"), "w") as f:
        json.dump({"tf_config": config, "argv": sys.argv[1:], "rest": rest}, f)
if args.grandchild:
    child = subprocess.Popen(["sleep", "1000"])
    path = os.path.join(args.grandchild, f"grandchild_{index}")
    with open(path + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(path + ".tmp", path)  # readers never see a partial file

if args.pid_dir:
    path = os.path.join(args.pid_dir, f"worker{index}_attempt{attempt}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "attempt": attempt, "tf_config": config}, f)
    os.replace(path + ".tmp", path)

if args.startup_log:  # TensorFlow 2.21's lines, as a worker prints them with TF_CPP_MIN_LOG_LEVEL=2
    print("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
          "I0000 00:00:1795887987.084910   19723 port.cc:153] oneDNN custom operations are on.\n"
          "I0000 00:00:1795887987.152885   19723 cpu_feature_guard.cc:227] This TensorFlow binary is optimized.\n"
          "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow.",
          file=sys.stderr, flush=True)
print(f"hello from {index}", flush=True)
if args.stderr:
    print(f"stderr from {index}", file=sys.stderr, flush=True)
if args.no_newline:
    print(f"partial from {index}", end="", flush=True)
if args.shutdown_race_log and index == 1:  # as TF 2.21 logs it where worker 0, the service's host, left first
    print("E0000 00:00:1796622101.453858   31881 base_collective_executor.cc:252] BaseCollectiveExecutor::"
          "StartAbort UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task died or "
          "the connection failed: Connection refused", file=sys.stderr, flush=True)

codes = dict(map(int, e.split(":")) for e in args.exit)
if args.exit_attempts is not None and attempt >= args.exit_attempts:
    codes = {}
if index in codes:
    time.sleep(args.delay)
    if codes[index] < 0:
        os.kill(os.getpid(), -codes[index])
    sys.exit(codes[index])
if args.hang:
    time.sleep(1000)
