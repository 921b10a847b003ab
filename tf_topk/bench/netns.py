"""Network namespaces for the end-to-end benchmark: one per worker, a bridge, rate-limited links.

Layout of one cluster (run id R, N workers)::

    namespace tftopk-e2e-<owner pid>-<R>-br:  bridge br0, ports w0 .. w(N-1)
    namespace tftopk-e2e-<owner pid>-<R>-w<i>: lo, eth0 = 10.213.0.(i+1)/24, the veth peer of w<i>

Nothing is created in the root namespace: each veth pair is made inside its
worker's namespace and its peer moved straight into the bridge's namespace, so
the addresses (10.213.0.0/24, private) exist only inside these namespaces and
no route leads anywhere else. With a bandwidth, a `tbf` qdisc limits the
egress of both ends of every veth: eth0 (what the worker sends) and w<i> (what
it receives), like a switch port of that speed. A latency adds a `netem`
qdisc under the worker side's tbf: one-way worker-to-worker delay.

Every name starts with PREFIX and carries the pid of the process that made
it, so `cleanup_stale()` (`python -m tf_topk.bench e2e --cleanup`) can find and
remove what a killed run left behind, without touching a run still alive.
Removing a namespace first kills the processes inside it (`ip netns pids`);
deleting a worker namespace destroys its veth pair, deleting the bridge's
namespace destroys the bridge.

Requires root, `ip` (iproute2) and `tc`. Imports only the standard library.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time

from tf_topk.cost import parse_rate  # noqa: F401 (the benchmarks' --bandwidth, read here too)
from tf_topk.launch import pid_alive

PREFIX = "tftopk-e2e-"
SUBNET_PREFIX = "10.213.0"  # the /24 used inside the namespaces, nowhere else
WORKER_IFACE = "eth0"
_NAME_RE = re.compile(r"^" + re.escape(PREFIX) + r"(?P<pid>\d+)-(?P<run>[0-9a-z]+)-(?P<role>br|w\d+)$")
_TIME_RE = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>us|ms|s)$")


class NetnsError(RuntimeError):
    """A namespace command failed, or the machine cannot run the namespace mode."""


def parse_latency(text):
    """'1ms' -> seconds (float); None/'0'/'none' -> None."""
    if text is None:
        return None
    text = str(text).strip().lower()
    if text in ("none", "0", ""):
        return None
    m = _TIME_RE.match(text)
    if not m:
        raise ValueError(f"latency must look like 1ms, 500us or 0.01s, got {text!r}")
    return float(m.group("num")) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group("unit")]


def missing_requirements():
    """Why the namespace mode cannot run here (a message), or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns); run as root, or pass --no-netns for localhost without limits"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; install iproute2, or pass --no-netns"
    return None


def _run(argv, check=True, timeout=30):
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_namespaces():
    """Names of all network namespaces (`ip netns list`)."""
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def namespace_pids(name):
    proc = _run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def remove_namespace(name, grace_s=3.0):
    """Kill every process inside namespace `name` (TERM, then KILL), then delete it.

    Returns a list of problems (empty when all went well); never raises for a
    namespace that is already gone.
    """
    problems = []
    pids = namespace_pids(name)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = [p for p in namespace_pids(name) if pid_alive(p)]
            if not pids:
                break
            time.sleep(0.05)
        if not pids:
            break
    if pids:
        problems.append(f"processes {pids} in {name} survived SIGKILL")
    proc = _run(["ip", "netns", "del", name], check=False)
    if proc.returncode != 0 and name in list_namespaces():
        problems.append(f"ip netns del {name}: {proc.stderr.strip()}")
    return problems


def parse_name(name):
    """(owner pid, run id, role) of one of our namespace names, or None."""
    m = _NAME_RE.match(name)
    return (int(m.group("pid")), m.group("run"), m.group("role")) if m else None


def cleanup_stale(include_live=False):
    """Remove the namespaces (and their processes) of runs whose owner process is gone.

    With include_live, remove every namespace with our prefix, also those of
    runs still going. Returns (removed names, problems).
    """
    removed, problems = [], []
    names = [n for n in list_namespaces() if n.startswith(PREFIX)]
    # Workers first, then bridges: a bridge namespace is empty once its peers are gone.
    names.sort(key=lambda n: (n.endswith("-br"), n))
    for name in names:
        parsed = parse_name(name)
        if parsed is None:
            owner_alive = False  # our prefix, a malformed name: a leftover of an older version
        else:
            owner_alive = parsed[0] != os.getpid() and pid_alive(parsed[0])
        if owner_alive and not include_live:
            continue
        problems.extend(remove_namespace(name))
        removed.append(name)
    return removed, problems


class NetnsCluster:
    """N worker namespaces on one bridge, with optional rate limit and latency.

    Use as a context manager, or call setup() and teardown() (teardown is
    idempotent and removes everything this object made, also after a partial
    setup).
    """

    def __init__(self, workers, bandwidth_bits=None, latency_s=None, run_id=None):
        if workers < 1 or workers > 250:
            raise ValueError(f"workers must be in 1..250, got {workers}")
        self.workers = workers
        self.bandwidth_bits = bandwidth_bits
        self.latency_s = latency_s
        self.run_id = (run_id or secrets.token_hex(3)).lower()
        if not re.match(r"^[0-9a-z]{1,12}$", self.run_id):
            raise ValueError(f"run_id must be 1-12 lowercase letters or digits, got {self.run_id!r}")
        self.base = f"{PREFIX}{os.getpid()}-{self.run_id}"
        self.bridge_ns = f"{self.base}-br"
        self.worker_ns = [f"{self.base}-w{i}" for i in range(workers)]
        self.addresses = [f"{SUBNET_PREFIX}.{i + 1}" for i in range(workers)]
        self._made = []  # namespaces created, in order

    # -- set-up ---------------------------------------------------------------

    def _add_namespace(self, name):
        _run(["ip", "netns", "add", name])
        self._made.append(name)

    def _tbf(self, namespace, device, handle="1:"):
        rate_bytes = self.bandwidth_bits / 8.0
        # Burst: at least 10 ms at the rate and 256 KiB (a GSO packet is up to 64 KiB).
        burst = int(max(256 * 1024, rate_bytes * 0.01))
        _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "handle", handle,
              "tbf", "rate", f"{int(self.bandwidth_bits)}bit", "burst", str(burst), "latency", "200ms"])

    def _netem(self, namespace, device, parent):
        argv = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device]
        argv += ["parent", parent, "handle", "10:"] if parent else ["root", "handle", "10:"]
        argv += ["netem", "delay", f"{int(round(self.latency_s * 1e6))}us", "limit", "100000"]
        proc = _run(argv, check=False)
        if proc.returncode != 0:
            hint = (" (this kernel has no sch_netem: run without --latency)"
                    if "unknown" in proc.stderr.lower() else "")
            raise NetnsError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}{hint}")

    def setup(self):
        problem = missing_requirements()
        if problem:
            raise NetnsError(problem)
        self._add_namespace(self.bridge_ns)
        br = ["ip", "-n", self.bridge_ns]
        _run(br + ["link", "add", "br0", "type", "bridge"])
        _run(br + ["link", "set", "br0", "up"])
        for i, ns in enumerate(self.worker_ns):
            self._add_namespace(ns)
            wk = ["ip", "-n", ns]
            port = f"w{i}"
            _run(wk + ["link", "add", WORKER_IFACE, "type", "veth", "peer", "name", port, "netns", self.bridge_ns])
            _run(br + ["link", "set", port, "master", "br0"])
            _run(br + ["link", "set", port, "up"])
            _run(wk + ["addr", "add", f"{self.addresses[i]}/24", "dev", WORKER_IFACE])
            _run(wk + ["link", "set", "lo", "up"])
            _run(wk + ["link", "set", WORKER_IFACE, "up"])
            if self.bandwidth_bits is not None:
                self._tbf(ns, WORKER_IFACE)
                self._tbf(self.bridge_ns, port)
                if self.latency_s:
                    self._netem(ns, WORKER_IFACE, "1:1")
            elif self.latency_s:
                self._netem(ns, WORKER_IFACE, None)
        return self

    def describe(self):
        """The qdiscs in place, as `tc qdisc show` prints them (for the record)."""
        lines = []
        for i, ns in enumerate(self.worker_ns):
            for namespace, device in ((ns, WORKER_IFACE), (self.bridge_ns, f"w{i}")):
                out = _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "show", "dev", device],
                           check=False).stdout.strip()
                lines.append(f"{namespace}/{device}: {out}")
        return lines

    # -- tear-down ------------------------------------------------------------

    def teardown(self):
        """Remove every namespace this cluster made (killing processes inside); idempotent.

        Returns the list of problems (empty on success)."""
        problems = []
        # Workers first (their veths go with them), the bridge last.
        for name in sorted(self._made, key=lambda n: n == self.bridge_ns):
            problems.extend(remove_namespace(name))
        left = set(self._made).intersection(list_namespaces())
        if left:
            problems.append(f"namespaces still present: {sorted(left)}")
        self._made = [n for n in self._made if n in left]
        return problems

    def __enter__(self):
        try:
            return self.setup()
        except BaseException:
            self.teardown()
            raise

    def __exit__(self, *exc):
        problems = self.teardown()
        if problems and exc[0] is None:
            raise NetnsError("cleanup incomplete: " + "; ".join(problems))
        return False
