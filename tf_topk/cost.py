"""The time model: what a collective, the selection and each route cost per step, in seconds.

Every route's cost is its collectives' (Hockney's model: a collective of x
bytes per worker takes latency + x * seconds_per_byte) plus, for the sparse
routes, the selection's compute over the bucket's entries. The numbers come
from a typed-in link (`LinkModel.from_rate("1gbit")`) or from measuring the
cluster (`tf_topk.calibrate.calibrate`). Pure Python: a cluster one does not
have can be studied without TensorFlow (`python -m tf_topk.bench advise`).

    >>> link = LinkModel.from_rate("1gbit", latency_s=5e-4)
    >>> model = CostModel(replicas=4, all_reduce=link, all_gather=link, selection_s_per_entry=1.2e-9)
    >>> round(model.route_time("dense", k=0, entries=1_000_000), 4)     # 6 MB in a ring
    0.0485
    >>> model.choose(entries=1_000_000, k=1_000)
    'allgather'
"""

import dataclasses
import math
import re

# Where "auto" takes agreed indices it agrees on twice k indices per variable:
# on k they lost accuracy against all_gather where 2k did not (measured:
# benchmarks/history/2026-11-24-agreed-index-remedies.md, "Remedy 3"), for 32k(P-1)/P bytes per worker, still flat in P, and fewer than
# all_gather's (P-1) * 8k from 5 replicas on (the same at 4: all_gather keeps the tie).
AUTO_AGREED_SLOTS = 2

_RATE_RE = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>kbit|mbit|gbit)$")
_UNIT_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text):
    """'100mbit' -> bits per second (float); 'none' -> None."""
    text = str(text).strip().lower()
    if text in ("none", "unlimited", "0"):
        return None
    m = _RATE_RE.match(text)
    if not m:
        raise ValueError(f"bandwidth must look like 100mbit, 1gbit, 500kbit or none, got {text!r}")
    bits = float(m.group("num")) * _UNIT_BITS[m.group("unit")]
    if bits <= 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    return bits


# Routes the time model knows, by the names of tf_topk.routes.
ROUTE_NAMES = ("dense", "dense_bf16", "allgather", "allreduce")
# all_gather keeps the bucket unless agreed indices are predicted this much
# faster: with the same k, each replica's own top-k (all_gather) updates up to
# P * k entries where agreed indices update k, and was the more accurate at
# 4 and 8 replicas (measured: benchmarks/RESULTS.md#agreed-indices-at-4-replicas-accuracy-against-all_gather-convergence---replicas-4).
AGREED_SPEEDUP = 1.25
# Compute per entry when nothing is measured, as `tf_topk.calibrate` finds it on
# the project's 2-core CPU machine: the fused selection, and the rounding to bfloat16.
DEFAULT_SELECTION_S_PER_ENTRY = 1.2e-9
DEFAULT_ROUNDING_S_PER_ENTRY = 1.0e-9


def _check_seconds(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0 or \
            math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def ring_bytes(num_bytes, replicas):
    """Bytes each worker sends in a ring all-reduce of `num_bytes`."""
    return 2.0 * (replicas - 1) / replicas * num_bytes if replicas > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """One collective's time: latency_s + seconds_per_byte * (bytes a worker sends)."""

    latency_s: float
    seconds_per_byte: float

    def __post_init__(self):
        object.__setattr__(self, "latency_s", _check_seconds(self.latency_s, "latency_s"))
        object.__setattr__(self, "seconds_per_byte", _check_seconds(self.seconds_per_byte, "seconds_per_byte"))

    def time(self, num_bytes):
        """Seconds for one collective in which a worker sends `num_bytes`."""
        return self.latency_s + self.seconds_per_byte * num_bytes

    @classmethod
    def from_rate(cls, rate, latency_s=5e-4):
        """A link of `rate` ("100mbit", "1gbit", or bytes per second as a number)."""
        if isinstance(rate, str):
            bits = parse_rate(rate)
            if bits is None:
                raise ValueError(f"rate must be a finite link rate such as 1gbit, got {rate!r}")
            bytes_per_s = bits / 8.0
        else:
            bytes_per_s = _check_seconds(rate, "rate")
            if bytes_per_s == 0:
                raise ValueError(f"rate must be > 0, got {rate!r}")
        return cls(latency_s, 1.0 / bytes_per_s)

    @classmethod
    def fit(cls, points):
        """The least-squares line through `points` [(bytes, seconds), ...]
        (at least two sizes), with latency and slope clipped at 0."""
        points = [(float(x), float(t)) for x, t in points]
        if len({x for x, _ in points}) < 2:
            raise ValueError(f"fitting a link needs at least two different sizes, got {points!r}")
        mean_x = sum(x for x, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        slope = sum((x - mean_x) * (t - mean_t) for x, t in points) / sum((x - mean_x) ** 2 for x, _ in points)
        slope = max(slope, 0.0)
        latency = max(mean_t - slope * mean_x, 0.0)
        return cls(latency, slope)

    def describe(self):
        rate = "unlimited" if self.seconds_per_byte == 0 else f"{8e-6 / self.seconds_per_byte:,.0f} Mbit/s"
        return f"{self.latency_s * 1e6:,.0f} us + bytes at {rate}"


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What each route costs per step at `replicas` workers.

    all_reduce, all_gather: the LinkModel of each collective (bytes: what a
    worker sends); selection_s_per_entry: the sparse path's compute (the
    fused error-feedback selection) per entry of a bucket;
    rounding_s_per_entry: the 16-bit route's compute (rounding to bfloat16
    and keeping the error) per entry; pair_s: compute per pair a worker
    receives and densifies (all_gather: P * k of them; agreed indices: their
    slots); agreed_slots: agreed indices per k (`tf_topk.routes.AgreedIndexRoute`'s
    slots).
    """

    replicas: int
    all_reduce: LinkModel
    all_gather: LinkModel
    selection_s_per_entry: float = 0.0
    rounding_s_per_entry: float = 0.0
    agreed_slots: int = 1
    pair_s: float = 0.0

    def __post_init__(self):
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")
        for name in ("selection_s_per_entry", "rounding_s_per_entry", "pair_s"):
            object.__setattr__(self, name, _check_seconds(getattr(self, name), name))
        if isinstance(self.agreed_slots, bool) or not isinstance(self.agreed_slots, int) or self.agreed_slots < 1:
            raise ValueError(f"agreed_slots must be an int >= 1, got {self.agreed_slots!r}")

    @classmethod
    def from_link(cls, replicas, link, selection_s_per_entry=DEFAULT_SELECTION_S_PER_ENTRY,
                  rounding_s_per_entry=DEFAULT_ROUNDING_S_PER_ENTRY):
        """Both collectives over one typed-in `link` (a LinkModel, or a rate for LinkModel.from_rate)."""
        link = link if isinstance(link, LinkModel) else LinkModel.from_rate(link)
        return cls(replicas, link, link, selection_s_per_entry, rounding_s_per_entry)

    def bytes(self, route, k, entries):
        """Bytes a worker sends for a bucket of `entries` with `k` pairs."""
        p = self.replicas
        if route == "dense":
            return ring_bytes(4.0 * entries, p)
        if route == "dense_bf16":
            return ring_bytes(2.0 * entries, p)
        if route == "allgather":
            return (p - 1) * 8.0 * k
        if route == "allreduce":
            return 2.0 * ring_bytes(4.0 * self.agreed_slots * k, p)
        raise ValueError(f"route must be one of {ROUTE_NAMES}, got {route!r}")

    def route_time(self, route, k, entries, small_entries=0):
        """Predicted seconds one step spends exchanging a bucket of `entries`
        entries with `k` pairs by `route` (one replica: only the selection),
        with `small_entries` float32 dense-path entries (small variables, the
        step's scalars) beside it: carried in the route's collective (an
        all_gather sends them to every replica), or in an all-reduce of their
        own for dense_bf16, which cannot carry float32 entries."""
        num_bytes = self.bytes(route, k, entries)
        per_entry = {"allgather": self.selection_s_per_entry, "allreduce": self.selection_s_per_entry,
                     "dense_bf16": self.rounding_s_per_entry}.get(route, 0.0)
        compute = per_entry * entries + self.pair_s * self.pairs_received(route, k)
        if self.replicas == 1:
            return compute
        small = ring_bytes(4.0 * small_entries, self.replicas)
        if route == "allgather":
            return compute + self.all_gather.time(num_bytes + (self.replicas - 1) * 4.0 * small_entries)
        if route == "allreduce":  # the index agreement, then the values (and the carry): two collectives
            return compute + self.all_reduce.time(num_bytes / 2) + self.all_reduce.time(num_bytes / 2 + small)
        if route == "dense_bf16" and small_entries:
            return compute + self.all_reduce.time(num_bytes) + self.all_reduce.time(small)
        return compute + self.all_reduce.time(num_bytes + small)

    def pairs_received(self, route, k):
        """Pairs a worker densifies per step by `route`."""
        if route == "allgather":
            return self.replicas * k
        return self.agreed_slots * k if route == "allreduce" else 0.0

    def times(self, entries, k, routes=ROUTE_NAMES, small_entries=0):
        """{route: predicted seconds} for a bucket."""
        return {route: self.route_time(route, k, entries, small_entries) for route in routes}

    def choose(self, entries, k, routes=ROUTE_NAMES, small_entries=0):
        """The route predicted fastest for a bucket of `entries` with `k`
        pairs, except that all_gather keeps it against agreed indices unless
        they are AGREED_SPEEDUP times faster (the more accurate selection).
        Ties go to the earlier of `routes`."""
        times = self.times(entries, k, routes, small_entries)
        best = min(routes, key=lambda r: times[r])
        if best == "allreduce" and "allgather" in times and \
                times["allgather"] <= AGREED_SPEEDUP * times["allreduce"] and \
                times["allgather"] <= min(t for r, t in times.items() if r != "allreduce"):
            return "allgather"
        return best

    def sparse_route_at(self, entries, density, small_entries=0, max_pairs=None):
        """The sparse route (all_gather or agreed indices) predicted fastest for
        a bucket of `entries` at `density` (k at most max_pairs): the route the
        autopilot's router settles on, and what `advise` reports for it."""
        k = max(1, min(entries if max_pairs is None else max_pairs, round(density * entries)))
        return self.choose(entries, k, ("allgather", "allreduce"), small_entries)

    def describe(self):
        """One line: what the model says, for logs."""
        return (f"{self.replicas} workers; all-reduce {self.all_reduce.describe()}; "
                f"all_gather {self.all_gather.describe()}; "
                f"selection {self.selection_s_per_entry * 1e12:,.0f} us, bfloat16 rounding "
                f"{self.rounding_s_per_entry * 1e12:,.0f} us per M entries, densifying {self.pair_s * 1e12:,.0f} us "
                f"per M pairs")
