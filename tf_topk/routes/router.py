"""Routers: which route each bucket takes this step, and the byte model they decide by."""

import abc

import tensorflow as tf

from tf_topk.cost import AUTO_AGREED_SLOTS
from tf_topk.routes.agreed import AgreedIndexRoute, AgreedOrDenseRoute
from tf_topk.routes.allgather import AllGatherRoute
from tf_topk.routes.base import ring_all_reduce_bytes
from tf_topk.routes.chunked import ChunkAllGatherRoute
from tf_topk.routes.dense import Bfloat16DenseRoute, DenseRoute
from tf_topk.routes.packed import Int8AllGatherRoute

ROUTES = {route.name: route for route in (DenseRoute(), AllGatherRoute(), AgreedIndexRoute(), Bfloat16DenseRoute(),
                                          Int8AllGatherRoute(), ChunkAllGatherRoute())}
MODES = tuple(ROUTES)  # ("dense", "allgather", "allreduce", "dense_bf16", "allgather_int8", "allgather_chunk")
MODE_CODES = {name: route.code for name, route in ROUTES.items()}  # the "exchange_mode" statistic

# What one more collective per step is worth in bytes: its latency (rounds of
# messages between workers, about half a millisecond) at 1 Gbit/s.
DENSE_CARRY_BYTES = 64 * 1024

# "auto" keeps all_gather while it sends at most this share of the dense
# all-reduce's bytes, that is while P * k <= n / 16: each replica's own top-k
# is the more accurate selection (agreed indices send k distinct entries a
# step, all_gather up to P * k), and its bytes are small beside dense. At 4
# replicas agreed indices matched all_gather at density 0.01 (P * k = n / 25)
# and lost accuracy at 0.001 (measured: benchmarks/RESULTS.md#agreed-indices-at-4-replicas-accuracy-against-all_gather-convergence---replicas-4).
ALLGATHER_SHARE = 1.0 / 16

AUTO_ROUTES = {"allgather": ROUTES["allgather"], "allreduce": AgreedIndexRoute(slots=AUTO_AGREED_SLOTS),
               "dense": ROUTES["dense"]}


def mode_bytes(mode, pairs, entries, replicas):
    """Bytes a worker sends per step to exchange one bucket of `entries`
    entries with `pairs` selected (value, index) pairs, by route name:

      dense:     ring all-reduce of every entry        2(P-1)/P * 4n
      allgather: its pairs to every other replica      (P-1) * 8k
      allreduce: ring all-reduce of k agreed indices,
                 then of the k values there            2 * 2(P-1)/P * 4k

    allreduce stays below 16k whatever P; allgather grows with P.
    """
    if mode not in ROUTES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return ROUTES[mode].bytes(pairs, entries, replicas)


def choose_mode(replicas, pairs, entries, modes=MODES):
    """The route name among `modes` for a bucket of `entries` entries whose
    variables select `pairs` pairs at `replicas` replicas, by "auto"'s routes
    (`AUTO_ROUTES`: agreed indices on AUTO_AGREED_SLOTS * k): allgather while
    it sends at most ALLGATHER_SHARE of the dense all-reduce's bytes, else
    whichever sends the fewest bytes (ties: the earlier of allgather,
    allreduce, dense: each replica's own top-k is the better selection, and
    the sparse routes keep residuals). Never more bytes than dense.

    >>> choose_mode(4, pairs=16, entries=16_384)     # P * k = n / 256
    'allgather'
    >>> choose_mode(8, pairs=164, entries=16_384)    # P * k = n / 12.5
    'allreduce'
    """
    order = [m for m in ("allgather", "allreduce", "dense") if m in modes]
    if not order:
        raise ValueError(f"modes must hold at least one of {MODES}, got {modes!r}")

    def sent(mode):
        return AUTO_ROUTES[mode].bytes_for_k(pairs, entries, replicas)

    if "allgather" in order and sent("allgather") <= ALLGATHER_SHARE * sent("dense"):
        return "allgather"
    return min(order, key=sent)


def carries(route, entries, replicas):
    """Whether `route`'s collective should carry `entries` float32 dense-path
    entries (the small variables and the step's scalars) instead of an
    all-reduce of their own: while it costs at most DENSE_CARRY_BYTES more."""
    return route.extra_carry_bytes(entries, replicas) <= DENSE_CARRY_BYTES


def dense_path_bytes(mode, entries, replicas):
    """Bytes a worker sends for `entries` dense-path float32 entries beside a
    bucket of route `mode`: carried in its collective where `carries` says
    so, else their own ring all-reduce."""
    route = ROUTES[mode]
    if carries(route, entries, replicas):
        return route.carry_bytes(entries, replicas)
    return ring_all_reduce_bytes(4.0 * entries, replicas)


def carry_in_gather(entries, replicas):
    """Whether an all_gather should carry `entries` float32 dense entries
    (summed after it) instead of a separate all-reduce of them: worth it
    while the extra bytes stay within DENSE_CARRY_BYTES."""
    return carries(ROUTES["allgather"], entries, replicas)


class Router(abc.ABC):
    """Picks a route per bucket and step.

    uses_leader: whether any route it returns may need the leader replica
    (the exchange then keeps a call counter for steps given no `step`).
    can_go_dense: whether a bucket can take the dense route (the adaptive
    density's dense end then costs a dense all-reduce).
    """

    uses_leader = False
    can_go_dense = False

    @abc.abstractmethod
    def route(self, bucket, replicas):
        """The Route of `bucket` (a tf_topk.routes.Bucket) at `replicas`."""

    def sparse_route(self, bucket, replicas):
        """The route the adaptive density's byte costs assume for pairs."""
        route = self.route(bucket, replicas)
        if isinstance(route, AgreedOrDenseRoute):
            return AgreedIndexRoute(route.agreement, route.slots)
        return AgreedIndexRoute() if isinstance(route, DenseRoute) else route


class FixedRouter(Router):
    """Every bucket the same route (one replica: a sparse route becomes
    all_gather, which then makes no collective and selects as any sparse
    route would)."""

    def __init__(self, route):
        self._route = route
        self.uses_leader = route.uses_leader

    def route(self, bucket, replicas):
        sparse = self._route.name in ("allgather", "allreduce")
        return ROUTES["allgather"] if replicas == 1 and sparse else self._route

    def __repr__(self):
        return f"FixedRouter({self._route!r})"


class AutoRouter(Router):
    """Per bucket, the route `choose_mode` picks: all_gather while P * k <=
    n / 16, else the fewest bytes: agreed indices on 2k slots
    (AUTO_AGREED_SLOTS; from 5 replicas on, below that all_gather sends no
    more), or dense once k > n/4 (k > n/P at P = 2). Decided when traced;
    with a k tensor (scheduled or adaptive density) whose largest value can
    reach the dense side, per step (`AgreedOrDenseRoute`). Never more bytes
    than dense."""

    uses_leader = False  # its agreed indices are nominated
    can_go_dense = True

    def route(self, bucket, replicas):
        if replicas == 1:
            return ROUTES["allgather"]
        if all(isinstance(k, int) for k in bucket.ks):
            return AUTO_ROUTES[choose_mode(replicas, sum(bucket.ks), bucket.size)]
        sparse = choose_mode(replicas, bucket.max_pairs, bucket.size, ("allgather", "allreduce"))
        dense_bytes = mode_bytes("dense", bucket.max_pairs, bucket.size, replicas)
        if AUTO_ROUTES[sparse].bytes_for_k(bucket.max_pairs, bucket.size, replicas) <= dense_bytes:
            return AUTO_ROUTES[sparse]
        pairs = tf.add_n([tf.cast(k, tf.float32) for k in bucket.ks])
        agreed = AUTO_ROUTES["allreduce"]
        return AgreedOrDenseRoute(agreed.bytes_for_k(pairs, bucket.size, replicas) > dense_bytes,
                                  slots=agreed.slots)

    def __repr__(self):
        return "AutoRouter()"


class TimedRouter(Router):
    """Per bucket, the route a `tf_topk.cost.CostModel` predicts fastest
    (`CostModel.choose`: dense, dense_bf16, all_gather or agreed indices on
    the model's `agreed_slots` * k, all_gather kept unless agreed indices are
    clearly faster), from measured seconds (`tf_topk.calibrate`) instead of
    bytes. Decided when traced. With a k tensor (scheduled or adaptive
    density): given a `typical_density` (the caller settled on sparse, as the
    autopilot's plan does), the sparse route fastest at that density;
    otherwise the sparse route fastest at the largest k, or, where that would
    be slower than dense, agreed indices that switch to dense per step
    (`AgreedOrDenseRoute`: only agreed indices can). small_entries: the
    dense-path entries that travel beside the buckets.

    >>> model = tf_topk.calibrate.calibrate(strategy, entries=n).model
    >>> exchange = tf_topk.SparseExchange(variables, density=0.01, router=TimedRouter(model))
    """

    uses_leader = False
    can_go_dense = True

    def __init__(self, cost_model, small_entries=0, typical_density=None):
        from tf_topk.cost import CostModel

        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a tf_topk.cost.CostModel, got {type(cost_model).__name__}")
        self.cost_model = cost_model
        self.small_entries = small_entries
        self.typical_density = typical_density
        self._routes = {**ROUTES, "allreduce": AgreedIndexRoute(slots=cost_model.agreed_slots)}

    def route(self, bucket, replicas):
        if replicas == 1:
            return ROUTES["allgather"]
        model, small = self._model(replicas), self.small_entries
        if all(isinstance(k, int) for k in bucket.ks):
            return self._routes[model.choose(bucket.size, sum(bucket.ks), small_entries=small)]
        if self.typical_density is not None:  # sparse was settled (the autopilot's plan): at a typical k
            return self._routes[model.sparse_route_at(bucket.size, self.typical_density, small, bucket.max_pairs)]
        sparse = model.choose(bucket.size, bucket.max_pairs, ("allgather", "allreduce"), small)
        dense_s = model.route_time("dense", 0, bucket.size, small)
        if model.route_time(sparse, bucket.max_pairs, bucket.size, small) <= dense_s:
            return self._routes[sparse]
        pairs = tf.add_n([tf.cast(k, tf.float32) for k in bucket.ks])
        return AgreedOrDenseRoute(model.route_time("allreduce", pairs, bucket.size, small) > dense_s,
                                  slots=model.agreed_slots)

    def sparse_route(self, bucket, replicas):
        route = self.route(bucket, replicas)
        if isinstance(route, AgreedOrDenseRoute):
            return AgreedIndexRoute(route.agreement, route.slots)
        return route if route.name in ("allgather", "allreduce") else self._routes["allreduce"]

    def _model(self, replicas):
        """The cost model at `replicas` (the calibrated one, or its links at another count)."""
        if replicas == self.cost_model.replicas:
            return self.cost_model
        import dataclasses

        return dataclasses.replace(self.cost_model, replicas=replicas)

    def __repr__(self):
        return f"TimedRouter({self.cost_model!r})"


def router_for(exchange_mode):
    """The router of an exchange_mode string."""
    if exchange_mode == "auto":
        return AutoRouter()
    return FixedRouter(ROUTES[exchange_mode])
