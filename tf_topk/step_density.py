"""The exchange's density part: k of every variable at each step, and what choosing it needs.

`SparseExchange` asks one object, its step density, four things a step:
  - `k(size, step)`: k of a variable of `size` entries at this step;
  - `select(fused_op, size)`: the fused selection of a variable, with the
    magnitude profile the density reads, if any;
  - `votes(buckets, pieces, replicas)`: the float32 values this replica
    sends in the step's collective for the next step's choice (None: none);
  - `finish(summed_votes, buckets)`: on a finite step, the votes summed over
    the replicas, to agree on the next step's density.

`ScheduledDensity` serves a `tf_topk.schedule.DensitySchedule` (a constant, a
list of (step, density) pairs, a callable): nothing is profiled or gathered.
`AgreedAdaptiveDensity` serves `tf_topk.schedule.AdaptiveDensity` (also the
autopilot's when it routes by time): each replica votes for the density of
the most improvement per byte on its own profile, and every replica takes
the lower median of the votes at the next step.
"""

import tensorflow as tf

from tf_topk.routes import ring_all_reduce_bytes


def step_density_for(schedule, router, sparse_entries, min_k=1):
    """The step density of a `DensitySchedule` (`router`: the exchange's,
    whose routes price the adaptive rule's pairs; `sparse_entries`: the
    entries of every sparsified variable; `min_k`: the floor under a
    scheduled density's k, `ExchangeConfig.min_k`)."""
    if schedule.adaptive is None:
        return ScheduledDensity(schedule, min_k)
    if min_k > 1:
        raise ValueError(f"min_k={min_k} is a floor under a scheduled density's k; an adaptive density or the "
                         "autopilot chooses k itself: pass a float density or a schedule, or min_k=1")
    return AgreedAdaptiveDensity(schedule.adaptive, router, sparse_entries)


def replica_counter(initial, dtype, name):
    """A per-replica variable every replica updates alike (the first's is
    read). Not part of any checkpoint: its holder keeps it out of tracking."""
    return tf.Variable(initial, dtype=dtype, trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


class ScheduledDensity:
    """k by a density schedule: a Python int when the density is constant
    (every shape static), else a tensor of the step; never below
    min(min_k, size)."""

    with_profile = False

    def __init__(self, schedule, min_k=1):
        self.schedule = schedule
        self.min_k = min_k

    @property
    def current(self):
        """The density chosen at run time (None: the schedule fixes it)."""
        return None

    def k(self, size, step):
        k, floor = self.schedule.k(size, step), min(self.min_k, size)
        if floor <= 1:
            return k
        return max(floor, k) if isinstance(k, int) else tf.maximum(k, floor)

    def select(self, fused_op, size):
        del size  # no profile to size
        return fused_op()

    def votes(self, buckets, pieces, replicas):
        del buckets, pieces, replicas  # nothing to agree on
        return None

    def finish(self, summed_votes, buckets):
        del summed_votes, buckets


class AgreedAdaptiveDensity:
    """The adaptive rule's density, the same on every replica.

    Each step uses the density the replicas agreed on at the previous finite
    step (the rule's `initial_density` at first). The density is not
    checkpointed: the rule restarts from its initial density.
    """

    with_profile = True

    def __init__(self, rule, router, sparse_entries):
        self.rule = rule
        self.router = router
        self.sparse_entries = sparse_entries
        self.density = replica_counter(rule.initial_density, tf.float64, "adaptive_density")

    @property
    def current(self):
        """The density the next step uses (this replica's copy; every replica holds the same)."""
        return self.density.read_value()

    def k(self, size, step):
        del step  # the agreed density is this step's
        k = tf.cast(tf.math.ceil(self.density.read_value() * size), tf.int32)
        return tf.clip_by_value(k, 1, size)

    def select(self, fused_op, size):
        """`fused_op` with the magnitude profile of a variable of `size`
        entries taken at this step's depth: down to the rank the rule may
        reach next over ALL sparsified entries (depth * n), not the
        variable's own share of it, since one variable may hold most of the
        largest entries; the summed profiles are then exact to that rank. One
        branch per depth of `AdaptiveDensity.profile_levels` (the op's depth
        is an attribute)."""
        depths = [min(1.0, depth * self.sparse_entries / size) for depth in self.rule.profile_levels()]
        if len(set(depths)) == 1:
            return fused_op(depths[0])
        level = self.rule.profile_level(self.density.read_value())
        return tf.switch_case(level, [lambda depth=depth: fused_op(depth) for depth in depths])

    def votes(self, buckets, pieces, replicas):
        """This replica's vote for the next step's density: a float32 one-hot
        over the rule's candidates, chosen on the summed profile of every
        sparsified variable with the byte costs of the routes in use."""
        if not buckets:
            return None
        entries = _entries(buckets)
        workers = self.rule.replicas or replicas
        pair_bytes = max(self.router.sparse_route(bucket, replicas).bytes_for_k(1.0, entries, workers)
                         for bucket in buckets)
        # Density 1 takes the dense route where the router can choose it, else
        # every pair through the same route.
        dense_bytes = (ring_all_reduce_bytes(4.0 * entries, workers) if self.router.can_go_dense
                       else pair_bytes * entries)
        index = self.rule.choose_index(tf.add_n([p.profile for p in pieces]), entries, pair_bytes, dense_bytes,
                                       tf.add_n([p.stats[0] for p in pieces]))
        return tf.one_hot(index, len(self.rule.candidates(entries)), dtype=tf.float32)

    def finish(self, summed_votes, buckets):
        """Every replica takes the lower median of the votes."""
        if summed_votes is not None:
            self.density.assign(tf.cast(self.rule.agree(summed_votes, _entries(buckets)), tf.float64))


def _entries(buckets):
    """The entries of this step's sparsified variables (those with a gradient)."""
    return float(sum(bucket.size for bucket in buckets))
