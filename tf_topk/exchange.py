"""Sparse gradient exchange over tf.distribute: the replacement for the dense all-reduce.

Per step and replica, for each sparsified variable: add the residual (error
feedback), select k entries and keep the rest as the next residual, all in one
pass of the fused op (`tf_topk.error_feedback_topk`); then each bucket of
sparsified variables travels by a route (`tf_topk.routes`: an all_gather of
every replica's pairs, an all-reduce at agreed indices, or dense), chosen per
bucket by a router (`exchange_mode`). Variables smaller than `min_size` take
the dense path: their gradients and the count of non-finite entries ride in
a bucket's collective when that is cheaper, else in one packed all-reduce. A
step with one bucket makes one collective (two with agreed indices).

Usable in any replica context: inside `strategy.run` of a custom training
loop, in a SavedModel's training function, or through the Keras optimizer
wrapper (`tf_topk.TopKOptimizer`). Without a strategy (one replica) nothing is
exchanged, but selection and error feedback still apply.

Example (custom training loop; examples/custom_loop.py is the complete version):

    with strategy.scope():
        model, optimizer = make_model(), keras.optimizers.SGD(0.1)
        tf_topk.keras.disable_dense_all_reduce(optimizer)   # the exchange sums already
        exchange = tf_topk.SparseExchange(model.trainable_variables, density=0.01)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(y, model(x)), global_batch_size=GLOBAL_BATCH)
        result = exchange(tape.gradient(loss, model.trainable_variables), step=optimizer.iterations)
        return result.grads, result.all_finite

    @tf.function
    def train_step(x, y):
        grads, all_finite = strategy.run(replica_step, args=(x, y))
        # Branch in cross-replica context: optimizer.apply calls merge_call,
        # which may not sit inside a tf.cond in a replica context.
        def apply():
            strategy.run(lambda g: optimizer.apply(g, model.trainable_variables), args=(grads,))
            return tf.constant(True)
        return tf.cond(strategy.experimental_local_results(all_finite)[0], apply, lambda: tf.constant(False))
"""

import collections
import math

import tensorflow as tf

from tf_topk import autopilot, ops
from tf_topk.config import DEFAULT_MIN_SIZE, ExchangeConfig  # noqa: F401  (DEFAULT_MIN_SIZE: public here too)
from tf_topk.config import FIXED_DEFAULT_DENSITY
from tf_topk.memory import ErrorFeedbackMemory, Memory, make_state_variable
from tf_topk.methods import memory_for
from tf_topk.notices import tell
from tf_topk.replica_state import keep_replica_values, keeping_replica_values
from tf_topk.routes import (MODE_CODES, ROUTES, AgreedIndexRoute, AgreedOrDenseRoute, AllGatherOrDenseRoute,
                            AllGatherRoute, Bucket, Router, all_reduce_dense, carries, ring_all_reduce_bytes,
                            router_for, taken_out)
from tf_topk.routes.packed import INDEX_BITS, MAX_BUCKET_ENTRIES, Int8AllGatherRoute
from tf_topk.selector import Selector, TopKSelector, select_over_bucket
from tf_topk.step_density import replica_counter, step_density_for
from tf_topk.sparse_gradient import SparseGradient, apply_sparse_sgd, to_dense  # noqa: F401  public here too

ExchangeResult = collections.namedtuple("ExchangeResult", ["grads", "all_finite", "stats"])
ExchangeResult.__doc__ = """What one exchange returns.

grads: per variable, the gradient summed over replicas (None where the input
  was None), ready for an optimizer's update.
all_finite: bool scalar, False when any replica had a non-finite gradient
  entry; then every replica should skip the update (residuals were left as
  they were and nothing was sent).
stats: dict of float32 scalars describing this replica's step (see STAT_NAMES).
"""

STAT_NAMES = (
    "density",           # non-zero selected entries / entries of sparsified variables
    "selected",          # non-zero selected entries
    "bytes_sent",        # estimated bytes this worker sends per step (ring collectives)
    "bytes_dense",       # what the dense all-reduce of every gradient would send
    "residual_norm",     # L2 norm of all residuals after the step
    "contraction",       # ||acc - topk(acc)||^2 / ||acc||^2 over sparsified variables
    "random_k_bound",    # 1 - k/d, the contraction random-k selection would give in expectation
    "exchange_mode",     # 0 dense all-reduce, 1 all_gather, 2 agreed-index all-reduce (mean over buckets)
)

_VariableSpec = collections.namedtuple("_VariableSpec", ["name", "shape", "size", "dtype", "sparse"])


class SparseExchange(tf.Module):
    """Top-k sparsified, error-compensated exchange of gradients between replicas.

    Three replaceable parts do the work: the selector picks k entries of each
    accumulated gradient (`tf_topk.selector`), the memory keeps what was not
    sent (`tf_topk.memory`), and a route moves a bucket between replicas
    (`tf_topk.routes`), chosen per bucket by the router. The exchange owns the
    rest: which variables are sparsified, the buckets, k per variable, the
    agreed skip of non-finite steps, and the statistics.

    Args:
      variables: the variables whose gradients are exchanged, in the order the
        gradients will be passed (for Keras: `model.trainable_variables`).
      config: a `tf_topk.ExchangeConfig` (None: the defaults, among them no
        density: the autopilot measures the cluster now and chooses the routes
        and the density, or 0.001 where a router or exchange_mode fixes the
        route); its fields are documented there: density, method, min_size,
        exchange_mode, bucket_bytes, error_feedback, momentum (correction),
        nesterov, momentum_masking, local_clipnorm, sparse_output,
        selection_scope, and Adam's
        momentum correction (beta_2, epsilon, variance_warmup_steps; the
        exchange then needs `step=` and returns, for the sparsified variables,
        the direction to apply by `variable -= lr * direction`).
      **options: any of those fields, overriding `config`'s
        (`SparseExchange(variables, density=0.01, exchange_mode="auto")`).
      selector, memory: replacements for the default parts (top-k of
        `method`; error feedback or momentum correction from the config).
      router: a `tf_topk.routes.Router` in place of `exchange_mode`'s.
      residuals: ready-made residual variables for error feedback.
      make_state: the factory `(variable, dtype, suffix, replicated=False)
        -> variable` the memory makes its per-replica state with (the Keras
        wrapper passes one that makes tracked Keras variables);
        `replicated` state is the same on every replica (see
        `tf_topk.memory.make_state_variable`). Call the constructor in the
        strategy's scope.
      saved_plan: with the autopilot, a plan it made before
        (`exchange.autopilot_plan.get_config()`, which the Keras wrappers
        save in their config): reused where the replicas and the variables'
        sizes are the same, else the cluster is measured again.
      plan_decoupled_momentum: with the autopilot, where its plan
        sparsifies, decoupled momentum at the plan's fixed density
        (`tf_topk.autopilot.Plan.fixed_density`) in place of error feedback
        at an adaptive density. The Keras wrappers pass True for an inner
        Adam or AdamW (they apply its directions); where the plan sends every
        entry, the inner optimizer's own update runs.

    With `sparse_output`, each sparsified variable's gradient comes back as a
    `SparseGradient` (a row of pairs per replica, or one summed row with
    agreed indices): `apply_sparse_sgd` updates only the entries sent. A
    bucket that "auto" sends dense when traced comes back as dense tensors.
    """

    _TF_MODULE_IGNORED_PROPERTIES = tf.Module._TF_MODULE_IGNORED_PROPERTIES | {"_calls", "step_density"}

    def __init__(self, variables, config=None, *, selector=None, memory=None, router=None, residuals=None,
                 make_state=None, name="sparse_exchange", communicator=None, saved_plan=None,
                 plan_decoupled_momentum=False, **options):
        super().__init__(name=name)
        if communicator is not None:
            raise TypeError("communicator=... was replaced by routes: pass router=tf_topk.routes.FixedRouter(route) "
                            "or exchange_mode=...")
        if config is not None and not isinstance(config, ExchangeConfig):
            raise TypeError(f"config must be a tf_topk.ExchangeConfig, got {config!r}")
        config = config or ExchangeConfig()
        self.config = config.replace(**options) if options else config
        if router is not None and self.config.density is None:  # a route given: the autopilot cannot choose it
            self.config = self.config.replace(density=FIXED_DEFAULT_DENSITY)
        variables = list(variables)
        if not variables:
            raise ValueError("variables must be a non-empty list of variables, got []")
        if memory is not None and (residuals is not None or self.config.momentum is not None):
            raise ValueError(f"pass {'residuals' if residuals is not None else 'momentum'} to the memory, "
                             "not next to it")
        # density="autopilot": measure the cluster now, then either send every entry (dense or bfloat16,
        # where no density would be faster) or route by time at an adaptive density over the measured
        # link (tf_topk.autopilot). The optimizer's own config keeps "autopilot" for saving.
        self.autopilot_plan = None
        if self.config.schedule.autopilot:
            if self.config.min_k > 1:
                raise ValueError(f"min_k={self.config.min_k} is a floor under a fixed or scheduled density's k; "
                                 "the autopilot (the default density) chooses k itself: pass density=... or min_k=1")
            specs = [_spec(v, self.config.min_size) for v in variables]
            self.autopilot_plan = autopilot.plan(sum(spec.size for spec in specs if spec.sparse),
                                                 sum(spec.size for spec in specs if not spec.sparse) + 1,
                                                 saved=saved_plan, decoupled=plan_decoupled_momentum,
                                                 link=self.config.link)
            decoupled = self.autopilot_plan.fixed_density() is not None
            self.config = self.config.replace(density=self.autopilot_plan.density(), link=None,
                                              decoupled_momentum=decoupled)
            if self.autopilot_plan.dense_route() and self.config.momentum is not None:
                # Every entry is sent: momentum factor masking, if asked for, would clear every velocity
                # each step (plain SGD); unmasked, the replicas' velocities sum to the momentum of the
                # summed gradient.
                self.config = self.config.replace(momentum_masking=False)
        given_router = router
        if self.autopilot_plan:
            router = router or self.autopilot_plan.router()
        self.selector = _part(selector, Selector, "selector") or TopKSelector(self.config.method)
        self.memory = _part(memory, Memory, "memory") or memory_for(self.config, residuals)
        sparsifies = any(_spec(v, self.config.min_size).sparse for v in variables)
        if self.config.density is None and self.config.beta_2 is not None and sparsifies:  # say what runs
            tell(f"tf_topk: Adam's momentum correction: every entry for the first {self.config.variance_warmup_steps} "
                 f"steps, then density {FIXED_DEFAULT_DENSITY:g} (fixed: the autopilot does not choose a density for "
                 "a frozen second moment; pass density=... to choose one)")
        if getattr(self.memory, "describe", None) and sparsifies:
            tell(self.memory.describe())
        if self.config.density_warmup_taken and sparsifies:
            tell(describe_density_warmup(self.config))
        # Where the autopilot sends every entry in float32 with plain error feedback, one all-reduce of the
        # gradients (the residuals flushed into it) does what the dense route would, without its selection.
        self._every_entry_as_dense = bool(
            self.autopilot_plan and given_router is None and self.autopilot_plan.dense_route() == "dense"
            and type(self.memory) is ErrorFeedbackMemory and not self.config.sparse_output
            and self.config.local_clipnorm is None)
        self.router = _part(router, Router, "router") or router_for(self.config.exchange_mode)
        # Without a step, the leader of ScaleCom's agreed-index rule (AgreedIndexRoute("leader")) rotates
        # with the number of calls (the same on every replica); not checkpointed: any leader is valid.
        object.__setattr__(self, "_calls", replica_counter(0, tf.int64, "exchange_calls")
                           if self.router.uses_leader else None)
        # Only static facts about the variables are kept: holding the variables
        # themselves would make them part of this module's checkpoint.
        self._specs = [_spec(v, self.config.min_size) for v in variables]
        self.sparse_positions = [i for i, s in enumerate(self._specs) if s.sparse]
        self.dense_positions = [i for i, s in enumerate(self._specs) if not s.sparse]
        self._buckets = _buckets(self._specs, self.sparse_positions, self.config)
        if self.config.exchange_mode == "allgather_int8":
            for position in self.sparse_positions:
                if self._specs[position].size > MAX_BUCKET_ENTRIES:
                    tell(f"tf_topk: {self._specs[position].name.split(':')[0]} has {self._specs[position].size:,} entries, more "
                         f"than exchange_mode='allgather_int8' indexes in {INDEX_BITS} bits ({MAX_BUCKET_ENTRIES:,}): "
                         "it travels as 8-byte pairs (float32 values, int32 indices) in a bucket of its own")
        # k of each variable at each step, and what choosing it needs gathered (tf_topk.step_density).
        object.__setattr__(self, "step_density", step_density_for(
            self.config.schedule, self.router, sum(self._specs[i].size for i in self.sparse_positions),
            self.config.min_k))
        make_state = make_state or make_state_variable
        # Checkpoints give each replica its own state back (tf_topk.replica_state):
        # hooked as the state is made, before a pending restore can reach it.
        with keeping_replica_values():
            self.memory.build([variables[i] for i in self.sparse_positions], make_state)
            self.memory.build_dense([variables[i] for i in self.dense_positions], make_state)
        self.error_feedback = bool(self.memory.keeps_unsent)
        # The memory's per-replica state, tracked so that checkpoints of the
        # exchange hold it; the residuals alone for inspection.
        self.memory_state = [keep_replica_values(v) for v in self.memory.state_variables]  # also ready-made ones
        self.residuals = list(self.memory.residuals or [])
        self._slot = {position: slot for slot, position in enumerate(self.sparse_positions)}
        self._dense_slot = {position: slot for slot, position in enumerate(self.dense_positions)}

    def say_if_run_ends_in_warmup(self, steps):
        """Say (on the chief) that a run ending after `steps` optimizer steps ends inside the density
        warm-up, as `fit` says it (`tf_topk.keras.CompressionStats`): a custom loop calls it with the
        steps it plans. Returns the line, or None."""
        line = warmup_notice(self.config, "run", steps)
        if line:
            tell(line)
        return line

    @property
    def num_buckets(self):
        """Number of buckets: each is one collective per step (two with agreed indices)."""
        return len(self._buckets)

    @property
    def adaptive_density(self):
        """With an adaptive density: the density the next step uses (this
        replica's copy; every replica holds the same). None otherwise."""
        return self.step_density.current

    # Written with tf.cond where a branch depends on a tensor, so AutoGraph has nothing to convert here; its
    # conversion of the exchange's code cost 4.7 s at the first traced step and 0.4-1 s at each later trace
    # (benchmarks/RESULTS.md, "The first traced step").
    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads, step=None, learning_rate=None):
        """Exchange `grads` (one per variable, None allowed) in a replica context.

        Returns an ExchangeResult. `step` (an int tensor, e.g. the optimizer's
        iterations) is required when the density is scheduled, and so with a
        fixed density of 0.01 or less, which warms up (`density_warmup_steps`).
        `learning_rate` (the inner optimizer's rate for this step) is required
        with `rescale_residuals=True`, and read by no other memory.
        """
        if step is None and self.config.density_warmup_taken:
            raise ValueError(
                f"density={self.config.schedule.settled_density():g} starts with a "
                f"{self.config.density_warmup_taken}-step warm-up (density_warmup_steps="
                f"{self.config.density_warmup_steps!r}), which counts steps: pass step=... (e.g. the optimizer's "
                "iterations), or density_warmup_steps=0 for that density from the first step")
        grads, context = self._check_call(grads)
        replicas = context.num_replicas_in_sync
        self.memory.begin_step(learning_rate)
        if self._every_entry_as_dense:
            return _all_reduce_every_entry(grads, context, self._specs,
                                           {p: self.memory.residuals[slot] for p, slot in self._slot.items()},
                                           {p: self.memory.residual(slot) for p, slot in self._slot.items()})
        if self.config.local_clipnorm is not None:
            grads = _clip_locally(grads, self.config.local_clipnorm, replicas)
        buckets = [self._bucket([p for p in positions if grads[p] is not None], step) for positions in self._buckets]
        routed = [self._route(bucket, replicas) for bucket in buckets if bucket.positions]
        buckets, routes = [bucket for bucket, _ in routed], [route for _, route in routed]
        leader = self._leader(step, replicas) if any(route.uses_leader for route in routes) else None
        # 1. Local work, no communication but the agreement on indices: every
        #    sparsified variable's compensation and selection (the fused op).
        selections = [self._select(bucket, route, grads, context, leader)
                      for bucket, route in zip(buckets, routes)]
        # 2. The dense-path gradients, the non-finite count and the density's
        #    votes (if it takes any) ride in a bucket's collective when that is
        #    cheaper, else in their own all-reduce.
        dense_positions = [i for i, g in enumerate(grads) if g is not None and not self._specs[i].sparse]
        small = [grads[i] for i in dense_positions]
        pieces = [piece for _, selection in selections for piece in selection]
        non_finite = tf.add_n([_non_finite_count(g) for g in small] + [tf.cast(p.stats[2], tf.float32) for p in pieces])
        votes = self.step_density.votes(buckets, pieces, replicas)
        scalars = tf.reshape(non_finite, [1]) if votes is None else tf.concat([tf.reshape(non_finite, [1]), votes], 0)
        carrier = _carrier(routes, small, scalars, replicas)
        totals = collections.defaultdict(lambda: tf.constant(0.0, tf.float32))
        if carrier is None and not pieces and votes is None:
            # Every gradient present is on the dense path: the sums themselves say whether some replica's
            # gradient was non-finite, so they travel alone, as the inner optimizer's all-reduce sends them.
            reduced = all_reduce_dense(context, small)
            reduced.append(tf.reshape(tf.add_n([_non_finite_count(s) for s in reduced]), [1]))
            totals["bytes"] += ring_all_reduce_bytes(sum(self._specs[i].size * self._specs[i].dtype.size
                                                         for i in dense_positions), replicas)
        elif carrier is None:
            reduced = all_reduce_dense(context, small + [scalars])
            totals["bytes"] += ring_all_reduce_bytes(sum(self._specs[i].size * self._specs[i].dtype.size
                                                         for i in dense_positions) + 4.0 * int(scalars.shape[0]),
                                                     replicas)
        # 3. One route per bucket: its collective, then its split.
        out = [None] * len(grads)
        for index, (bucket, route, (compensations, selection)) in enumerate(zip(buckets, routes, selections)):
            carry = _pack(small, scalars) if index == carrier else None
            values = tf.concat([tf.cast(s.values, tf.float32) for s in selection], 0)
            indices = tf.concat([s.indices + offset for s, offset in zip(selection, bucket.offsets)], 0)
            summed, summed_carry = route.send(context, bucket, values, indices,
                                              [tf.size(s.values) for s in selection], carry, self.config.sparse_output)
            for position, gradient in zip(bucket.positions, summed):
                out[position] = gradient
            if carry is not None:
                reduced = _unpack(summed_carry, small, int(scalars.shape[0]))
                totals["bytes"] += route.carry_bytes(int(carry.shape[0]), replicas)
            pairs = tf.cast(tf.size(values), tf.float32)
            totals["bytes"] += route.bytes(pairs, bucket.size, replicas) + route.bucket_overhead_bytes(bucket, replicas)
            totals["k"] += pairs
            totals["mode"] += route.code
        all_finite = tf.equal(reduced[-1][0], 0.0)
        for position, tensor in zip(dense_positions, reduced[:-1]):
            out[position] = self.memory.apply_dense(self._dense_slot[position], tensor, all_finite)
        for bucket in buckets:
            for slot, position in zip(bucket.slots, bucket.positions):
                out[position] = self.memory.apply_sparse(slot, out[position], all_finite)
        # 4. State changes only when every replica's step was finite: the
        #    memory's, and the density's for the next step.
        self._update_state(buckets, selections, all_finite, None if votes is None else reduced[-1][1:])
        return ExchangeResult(out, all_finite, _stats(self._specs, grads, pieces, totals, len(buckets), replicas,
                                                      self.error_feedback))

    def _route(self, bucket, replicas):
        """The router's route for `bucket`, and the bucket it travels as. A
        memory that sends every entry on some steps (Adam's warm-up) gets the
        route the router takes at the density of its other steps, as any
        memory does, and sends every entry on its dense steps through the same
        collective (agreed indices or all_gather of all n; a collective may not
        sit in a branch)."""
        route = self.router.route(bucket, replicas)
        if isinstance(route, Int8AllGatherRoute) and bucket.size > MAX_BUCKET_ENTRIES:
            route = ROUTES["allgather"]  # one variable beyond the packed index's reach (`_buckets`)
        if not self.memory.may_send_every_entry:
            return bucket, route
        dense_when = self.memory.sends_every_entry()
        every_entry = bucket._replace(ks=[tf.where(dense_when, n, k) for n, k in zip(bucket.sizes, bucket.ks)],
                                      max_pairs=bucket.size)
        if isinstance(route, AgreedOrDenseRoute):
            return every_entry, AgreedOrDenseRoute(tf.logical_or(dense_when, route.dense_when), route.agreement,
                                                   route.slots)
        if isinstance(route, AgreedIndexRoute):
            return every_entry, AgreedOrDenseRoute(dense_when, route.agreement, route.slots)
        if type(route) is AllGatherRoute and not self.config.sparse_output:
            return every_entry, AllGatherOrDenseRoute(dense_when)
        return every_entry, route  # dense: every entry anyway; all_gather with sparse_output: k = n pairs

    def _check_call(self, grads):
        """The gradients as dense tensors (or None), and the replica context."""
        grads = list(grads)
        if len(grads) != len(self._specs):
            raise ValueError(f"expected {len(self._specs)} gradients (one per variable), got {len(grads)}")
        context = tf.distribute.get_replica_context()
        if context is None:
            raise RuntimeError("SparseExchange must be called in a replica context: inside strategy.run(...), "
                               "or outside any strategy scope")
        shared = _same_object_on_every_replica(grads, context)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        # A gradient that is one tensor on every replica is one value to TensorFlow, whose all-reduce
        # counts it once: each replica sends its share, so that every route sums it to that value.
        grads = [g / context.num_replicas_in_sync if one else g for g, one in zip(grads, shared)]
        # A gradient in another float dtype than its variable's (a float64 variable, a float32 loss) is
        # cast to the variable's, as Keras's optimizers cast it: residuals and sums are in that dtype.
        grads = [g if g is None or g.dtype == spec.dtype or not (g.dtype.is_floating and spec.dtype.is_floating)
                 else tf.cast(g, spec.dtype) for g, spec in zip(grads, self._specs)]
        if all(g is None for g in grads):
            raise ValueError("all gradients are None: nothing to exchange")
        return grads, context

    def _leader(self, step, replicas):
        """The replica whose indices the agreed-index route sends: step mod P."""
        if step is None:
            step = self._calls.assign_add(1) - 1
        return tf.cast(tf.math.floormod(tf.cast(step, tf.int64), replicas), tf.int32)

    def _bucket(self, positions, step):
        """This step's Bucket of the present `positions`, with k per variable."""
        sizes = [self._specs[p].size for p in positions]
        return Bucket(positions, [self._slot[p] for p in positions], sizes,
                      [sum(sizes[:i]) for i in range(len(sizes))], sum(sizes),
                      [self.step_density.k(n, step) for n in sizes],
                      [self._specs[p].shape for p in positions], [self._specs[p].dtype for p in positions],
                      sum(self.config.max_pairs(n) for n in sizes))

    def _select(self, bucket, route, grads, context, leader):
        """(the memory's Compensation, the route's ErrorFeedbackSelection) per member."""
        compensations = [self.memory.compensate(slot, grads[p])
                         for slot, p in zip(bucket.slots, bucket.positions)]
        fused = self.selector.fused_method

        def accumulate(i, k, chunk=None, value_bits=0):  # member i: gradient + residual and (fused) k entries
            compensation, size = compensations[i], bucket.sizes[i]
            if chunk is not None:  # k entries of every chunk of `chunk`, rounded (the chunk route, on a CPU)
                return ops.error_feedback_chunk_topk(compensation.gradient, compensation.residual, k, chunk,
                                                     value_bits)

            def fused_op(profile_density=1.0):
                return ops.error_feedback_topk(
                    compensation.gradient, compensation.residual, k if fused else 0, method=fused or "gaussian",
                    with_profile=self.step_density.with_profile, profile_density=profile_density)

            selection = self.step_density.select(fused_op, size)
            if fused or (isinstance(k, int) and k == 0):
                return selection
            values, indices = self.selector.select(selection.remaining, k)
            return taken_out(selection, selection.remaining, values, indices)

        if self.config.selection_scope == "bucket":
            if isinstance(route, AgreedIndexRoute):
                raise ValueError(f"selection_scope='bucket' cannot take the route {route!r}: agreed indices choose "
                                 "k entries of every variable")
            if len(bucket.ks) > 1:  # one variable's share is all of k
                accumulate = self._over_bucket(bucket, accumulate)
        return compensations, route.select(bucket, accumulate, self.selector, context, leader)

    def _over_bucket(self, bucket, accumulate):
        """`accumulate` for selection_scope="bucket": every member summed
        (k = 0), then one selection of the bucket's k over all of them
        (`selector.select_over_bucket`), made before the route asks, outside
        any branch it takes; a member asked for k entries gets its share."""
        summed = [accumulate(i, 0) for i in range(len(bucket.ks))]
        total = tf.add_n([tf.convert_to_tensor(k, tf.int32) for k in bucket.ks])
        shares = select_over_bucket(self.selector, [s.remaining for s in summed], total)

        def share(i, k):
            if isinstance(k, int) and k == 0:
                return summed[i]
            values, indices = shares[i]
            return taken_out(summed[i], summed[i].remaining, values, indices)

        return share

    def _update_state(self, buckets, selections, all_finite, summed_votes):
        """The memory's update of every slot and the density's agreement on
        the next step, in one branch taken only when every replica's step was
        finite (nothing is undone otherwise)."""
        def update():
            for bucket, (compensations, selection) in zip(buckets, selections):
                for slot, compensation, piece in zip(bucket.slots, compensations, selection):
                    self.memory.update(slot, compensation, piece.remaining, piece.values, piece.indices)
            self.memory.finish_step()
            self.step_density.finish(summed_votes, buckets)
            return tf.constant(True)

        tf.cond(all_finite, update, lambda: tf.constant(False))


def _all_reduce_every_entry(grads, context, specs, residuals, waiting):
    """Every gradient (a sparsified one with its residual, which is then
    emptied) and the non-finite count summed in one all-reduce per dtype,
    as the plain optimizer's dense all-reduce does: the autopilot's choice
    where no density would be faster (`residuals`: per position of a
    sparsified variable, its residual variable; `waiting`: what of it joins
    this step's gradient, the memory's `residual`)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    flushed = {i: grads[i] + tf.cast(waiting[i], grads[i].dtype) for i in present if specs[i].sparse}
    sent = [flushed.get(i, grads[i]) for i in present]
    # A non-finite entry of any replica makes its sum non-finite: the sums say it, no count travels.
    summed = all_reduce_dense(context, sent)
    all_finite = tf.equal(tf.add_n([_non_finite_count(s) for s in summed]), 0.0)

    def empty_residuals():
        for i in flushed:
            residuals[i].assign(tf.zeros_like(residuals[i]))
        return tf.constant(True)

    if flushed:
        tf.cond(all_finite, empty_residuals, lambda: tf.constant(False))
    out = [None] * len(grads)
    for i, gradient in zip(present, summed):
        out[i] = gradient
    entries = float(sum(specs[i].size for i in flushed))
    dense_bytes = ring_all_reduce_bytes(sum(specs[i].size * specs[i].dtype.size for i in present),
                                        context.num_replicas_in_sync)
    selected = tf.constant(entries, tf.float32)
    stats = {"density": tf.constant(1.0 if entries else 0.0, tf.float32), "selected": selected,
             "bytes_sent": tf.constant(dense_bytes, tf.float32),
             "bytes_dense": tf.constant(dense_bytes, tf.float32),
             "residual_norm": tf.constant(0.0, tf.float32), "contraction": tf.constant(0.0, tf.float32),
             "random_k_bound": tf.constant(0.0, tf.float32),
             "exchange_mode": tf.constant(MODE_CODES["dense"], tf.float32)}
    return ExchangeResult(out, all_finite, stats)


def _buckets(specs, sparse_positions, config):
    """Consecutive sparsified variables, at most `config.bucket_bytes` of pairs
    each (once a warm-up is over: its first steps send more), and with
    "allgather_int8" at most the 2**24 entries its packed index reaches (a
    variable of more is a bucket of its own, sent as 8-byte pairs: `_route`)."""
    most_entries = MAX_BUCKET_ENTRIES if config.exchange_mode == "allgather_int8" else None
    buckets, current, current_bytes, current_entries = [], [], 0, 0
    for position in sparse_positions:
        pair_bytes = 8 * config.settled_pairs(specs[position].size)
        if current and ((config.bucket_bytes is not None and current_bytes + pair_bytes > config.bucket_bytes) or
                        (most_entries is not None and current_entries + specs[position].size > most_entries)):
            buckets.append(current)
            current, current_bytes, current_entries = [], 0, 0
        current.append(position)
        current_bytes += pair_bytes
        current_entries += specs[position].size
    buckets += [current] if current else []
    for bucket in buckets:
        total = sum(specs[p].size for p in bucket)
        if total >= 2**31:
            raise ValueError(f"a bucket of sparsified variables holds {total} entries; indices are int32, "
                             "so set bucket_bytes to split them into buckets of fewer than 2^31 entries")
    return buckets


def _clip_locally(grads, clipnorm, replicas):
    """This replica's gradients clipped to global norm clipnorm / sqrt(replicas)
    (a non-finite norm makes them NaN: the step is then skipped)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    clipped, _ = tf.clip_by_global_norm([grads[i] for i in present],
                                        clipnorm / math.sqrt(replicas))
    grads = list(grads)
    for position, tensor in zip(present, clipped):
        grads[position] = tensor
    return grads


def _carrier(routes, small, scalars, replicas):
    """Index of the bucket whose collective carries the dense-path
    gradients and the scalars, or None for their own all-reduce: the
    route where carrying costs the fewest extra bytes, if at most
    DENSE_CARRY_BYTES (what one collective's latency is worth on a
    1 Gbit/s link). float64 gradients take their own all-reduce (the
    carrying buffers are float32)."""
    if replicas == 1 or not routes or any(g.dtype == tf.float64 for g in small):
        return None
    entries = sum(int(g.shape.num_elements()) for g in small) + int(scalars.shape[0])
    _, index = min((route.extra_carry_bytes(entries, replicas), i) for i, route in enumerate(routes))
    return index if carries(routes[index], entries, replicas) else None


def _stats(specs, grads, pieces, totals, buckets, replicas, error_feedback):
    """The statistics of one replica's step (STAT_NAMES)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    sparse_entries = float(sum(specs[p].size for p in present if specs[p].sparse))
    # What the dense all-reduce sends: each gradient in its own dtype.
    dense_all_bytes = float(sum(specs[p].size * specs[p].dtype.size for p in present))
    selected = tf.add_n([tf.cast(tf.math.count_nonzero(p.values), tf.float32) for p in pieces] or [0.0])
    accumulated_sq = tf.add_n([tf.cast(p.stats[0], tf.float32) for p in pieces] or [0.0])
    dropped_sq = tf.add_n([tf.cast(tf.maximum(p.stats[1], 0.0), tf.float32) for p in pieces] or [0.0])
    # With a memory, what was dropped from the accumulated gradient is the residual.
    residual_sq = dropped_sq if error_feedback else tf.constant(0.0, tf.float32)
    return {
        "density": selected / max(sparse_entries, 1.0),
        "selected": selected,
        "bytes_sent": totals["bytes"],
        "bytes_dense": tf.constant(ring_all_reduce_bytes(dense_all_bytes, replicas), tf.float32),
        "residual_norm": tf.sqrt(residual_sq),
        "contraction": dropped_sq / tf.maximum(accumulated_sq, 1e-30),
        "random_k_bound": 1.0 - totals["k"] / max(sparse_entries, 1.0),
        "exchange_mode": totals["mode"] / max(float(buckets), 1.0),
    }


def _part(part, base, name):
    """A replacement part, which must implement its interface (or None)."""
    if part is not None and not isinstance(part, base):
        raise TypeError(f"{name} must be a {base.__module__}.{base.__name__} (subclass it), got {part!r}")
    return part


def sparsified_positions(variables, min_size):
    """Positions of the variables an exchange with this `min_size` sparsifies (the rest take the dense path)."""
    return [i for i, variable in enumerate(variables) if _spec(variable, min_size).sparse]


def _spec(variable, min_size):
    shape = tf.TensorShape(variable.shape)
    if not shape.is_fully_defined():
        raise ValueError(f"variables must have fully defined shapes, got {shape}")
    dtype = tf.as_dtype(variable.dtype)
    if not dtype.is_floating:
        raise ValueError(f"variable {variable.name} has dtype {dtype.name}; only float variables have gradients "
                         "to exchange")
    size = int(shape.num_elements())
    return _VariableSpec(variable.name, shape, size, dtype, size >= min_size)


def _same_object_on_every_replica(grads, context):
    """For each gradient, whether every replica of this process passed the same tensor object (one
    made outside `strategy.run`, e.g. a constant captured by the step). A merge_call, so only where
    this process holds every replica: with several workers, each worker's tensor is its own."""
    replicas = context.num_replicas_in_sync
    if replicas < 2 or len(tf.distribute.get_strategy().extended.worker_devices) != replicas:
        return [False] * len(grads)
    # merge_call regroups the replicas' arguments: the same object on every replica stays one object.
    return context.merge_call(
        lambda _, *values: [v is not None and not isinstance(v, tf.distribute.DistributedValues) for v in values],
        args=tuple(grads))


def _non_finite_count(tensor):
    return tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(tensor)), tf.float32))


def _pack(small, scalars):
    """The dense-path gradients (float32, flat) and the scalars (float32 [m]:
    the non-finite count, the density votes) in one buffer."""
    return tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for g in small] + [scalars], 0)


def _unpack(summed, small, count):
    """What `_pack` packed, summed: the gradients in their shapes and dtypes,
    then the `count` scalars as one vector."""
    pieces = tf.split(summed, [int(g.shape.num_elements()) for g in small] + [count])
    return [tf.cast(tf.reshape(p, tf.shape(g)), g.dtype) for p, g in zip(pieces, small)] + [pieces[-1]]


def warmup_notice(config, run, steps):
    """The line that says a run (`run`: "fit", "run") that ends after `steps` optimizer steps ends inside
    `config`'s density warm-up, sending more than the density given; None where it does not."""
    warmup = config.density_warmup_taken
    if not warmup or steps >= warmup:
        return None
    final = config.schedule.settled_density()
    reached = [d for step, d in config.schedule.steps if step <= steps - 1][-1]  # the warm-up's stage then
    return (f"tf_topk: this {run} ends at step {steps}, inside the {warmup}-step warm-up of density {final:g}: its "
            f"last steps send density {reached:.2g}, not {final:g}; density_warmup_steps=0 (or a shorter warm-up) "
            "trains at the density given")


def describe_density_warmup(config):
    """The line that announces a fixed density's warm-up: what runs, for how long, how to switch it off."""
    steps, final = config.density_warmup_taken, config.schedule.settled_density()
    stages = [density for _, density in config.schedule.steps[:-1]]  # the schedule the warm-up runs
    return (f"tf_topk: density {final:g} after a {steps}-step warm-up (Deep Gradient Compression's falling "
            f"densities {', '.join(f'{d:.2g}' for d in stages)} in {len(stages)} equal stages); "
            f"density_warmup_steps=0 sends {final:g} from the first step")
