"""Sparse gradient exchange over tf.distribute: the replacement for the dense all-reduce.

Per step and replica, for each sparsified variable: add the residual (error
feedback), select k entries and keep the rest as the next residual, all in one
pass of the fused op (`tf_topk.error_feedback_topk`); pack the (value, index)
pairs of all sparsified variables of a bucket into one float32 buffer (indices
bit-cast), exchange it with ONE `all_gather` per bucket, and scatter every
replica's pairs into a dense SUM in one scatter, in replica order, so that
every replica computes bitwise the same result (or hand the pairs over as
`SparseGradient`s, `sparse_output=True`). Or (`exchange_mode`) all replicas
agree on the leader replica's indices and all-reduce their values there, or
send the bucket dense.
Variables smaller than `min_size` take the dense path: their gradients and
the count of non-finite entries ride in a bucket's collective when that is
cheaper, else in one packed all-reduce. A step with one bucket makes one
collective.

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

from tf_topk import ops
from tf_topk.communicator import (MODE_CODES, AgreedIndexCommunicator, AllGatherCommunicator, carry_in_gather,
                                  choose_mode, gather_bytes, mode_bytes, ring_all_reduce_bytes)
from tf_topk.memory import ErrorFeedbackMemory, MomentumCorrectionMemory, NoMemory, make_state_variable
from tf_topk.replica_state import keep_replica_values, keeping_replica_values
from tf_topk.schedule import DensitySchedule
from tf_topk.selector import TopKSelector

# Below this many entries a variable takes the dense all-reduce: its k would be
# a handful of entries, so sparsifying saves almost nothing, while all small
# tensors (biases, normalisation parameters) travel together in one packed
# all-reduce and stay exact. 4096 float32 entries are 16 KiB.
DEFAULT_MIN_SIZE = 4096

ExchangeResult = collections.namedtuple("ExchangeResult", ["grads", "all_finite", "stats"])
ExchangeResult.__doc__ = """What one exchange returns.

grads: per variable, the gradient summed over replicas (None where the input
  was None), ready for an optimizer's update.
all_finite: bool scalar, False when any replica had a non-finite gradient
  entry; then every replica should skip the update (residuals were left as
  they were and nothing was sent).
stats: dict of float32 scalars describing this replica's step (see STAT_NAMES).
"""

SparseGradient = collections.namedtuple("SparseGradient", ["values", "indices"])
SparseGradient.__doc__ = """A sparsified variable's gradient summed over replicas, as pairs
(`SparseExchange(..., sparse_output=True)`).

values: [rows, m] in the variable's dtype; indices: int32 [rows, m] into the
  flattened variable. The gradient is the sum of all pairs. Within a row the
  indices are distinct but for spare slots (value 0 at index 0); rows repeat
  indices. The all_gather exchange gives one row per replica (its own
  pairs), the agreed-index exchange one row (already summed). A 1-D
  SparseGradient counts as one row.
Apply it with `apply_sparse_sgd`, or make it dense with `to_dense`: both go
row by row, in row order, so the sum is the same on every replica and every
device (a single scatter of pairs with repeated indices is, on GPUs,
summed by atomics in no fixed order).
"""


def _rows(gradient):
    """The (values, indices) rows of a SparseGradient, in order."""
    values, indices = tf.convert_to_tensor(gradient.values), tf.convert_to_tensor(gradient.indices)
    if values.shape.rank == 1:
        return [(values, indices)]
    if values.shape.rank != 2 or values.shape[0] is None:
        raise ValueError(f"SparseGradient values must be [m] or [rows, m] with a known number of rows, "
                         f"got shape {values.shape}")
    return [(values[row], indices[row]) for row in range(values.shape[0])]


def to_dense(gradient, shape):
    """A SparseGradient as a dense tensor of `shape` (one scatter per row, in order)."""
    size = tf.TensorShape(shape).num_elements()
    flat = None
    for values, indices in _rows(gradient):
        coordinates = tf.expand_dims(indices, 1)
        flat = (tf.scatter_nd(coordinates, values, tf.constant([size], tf.int32)) if flat is None
                else tf.tensor_scatter_nd_add(flat, coordinates, values))
    return tf.reshape(flat, shape)


def apply_sparse_sgd(variable, gradient, learning_rate):
    """variable -= learning_rate * gradient for a SparseGradient, touching only
    its entries (a scatter-subtract in place per row: O(pairs), not
    O(entries)).

    Rows subtract one after the other, in order, on every replica the same,
    and within a row indices are distinct (spare slots subtract 0), so the
    result is bitwise the same on every replica and device. A scalar
    variable (min_size=1) is updated with its dense gradient.

    Example (a custom loop with plain SGD):
      >>> result = exchange(grads)
      >>> for variable, grad in zip(variables, result.grads):
      ...     if isinstance(grad, tf_topk.exchange.SparseGradient):
      ...         tf_topk.exchange.apply_sparse_sgd(variable, grad, 0.1)
      ...     else:
      ...         variable.assign_sub(0.1 * grad)
    """
    rate = tf.cast(learning_rate, variable.dtype)
    if variable.shape.rank == 0:
        return variable.assign_sub(rate * tf.cast(to_dense(gradient, []), variable.dtype))
    shape = tf.shape(variable, out_type=tf.int32)
    update = None
    for values, indices in _rows(gradient):
        coordinates = tf.transpose(tf.unravel_index(indices, shape))
        with tf.control_dependencies([] if update is None else [update]):
            update = variable.scatter_nd_sub(coordinates, rate * tf.cast(values, variable.dtype))
    return update



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

EXCHANGE_MODES = ("auto", "allgather", "allreduce")

_VariableSpec = collections.namedtuple("_VariableSpec", ["name", "shape", "size", "dtype", "sparse"])


def _flat_size(shape):
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined():
        raise ValueError(f"variables must have fully defined shapes, got {shape}")
    return int(shape.num_elements())


def check_min_size(min_size):
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")


def check_local_clipnorm(local_clipnorm):
    if local_clipnorm is not None and (isinstance(local_clipnorm, bool) or not isinstance(local_clipnorm, (int, float))
                                       or not local_clipnorm > 0 or local_clipnorm == float("inf")):
        raise ValueError(f"local_clipnorm must be None or a finite float > 0, got {local_clipnorm!r}")


def check_exchange_mode(exchange_mode):
    if exchange_mode not in EXCHANGE_MODES:
        raise ValueError(f"exchange_mode must be one of {EXCHANGE_MODES}, got {exchange_mode!r}")


def check_bucket_bytes(bucket_bytes):
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes < 8):
        raise ValueError(f"bucket_bytes must be None or an int >= 8, got {bucket_bytes!r}")


class SparseExchange(tf.Module):
    """Top-k sparsified, error-compensated exchange of gradients between replicas.

    Three replaceable parts do the work: the selector picks k entries of each
    accumulated gradient (`tf_topk.selector`), the memory keeps what was not
    sent (`tf_topk.memory`), the communicator moves the pairs and the dense
    tensors between replicas (`tf_topk.communicator`). The exchange owns the
    rest: which variables are sparsified, the buckets, k per variable, the
    agreed skip of non-finite steps, and the statistics.

    Args:
      variables: the variables whose gradients are exchanged, in the order the
        gradients will be passed (for Keras: `model.trainable_variables`).
      density: fraction of entries sent per sparsified variable: a float in
        (0, 1], a list of (step, density) pairs, a callable, or "adaptive" /
        a `tf_topk.schedule.AdaptiveDensity` (chosen every step from the
        gradient; see `tf_topk.schedule`).
      method: selection method of `tf_topk.approx_topk`: "gaussian" or "exact"
        (the default selector's).
      min_size: variables with fewer entries take the dense all-reduce.
      exchange_mode: how a bucket's selected entries are summed (statistic
        "exchange_mode" says which was used):
        "allgather" (default): each replica's own top-k pairs to every
          replica, one all_gather; (P-1) * 8k bytes per worker, growing
          with P.
        "allreduce": the agreed-index all-reduce
          (`tf_topk.communicator.AgreedIndexCommunicator`): the leader
          replica (step mod P) picks the indices, all replicas sum their
          values there; 16k(P-1)/P bytes per worker, below 16k for any P.
        "auto": per bucket, whichever of dense all-reduce,
          "allgather" and "allreduce" sends the fewest bytes
          (`tf_topk.communicator.choose_mode`): "allgather" at P <= 2,
          "allreduce" above, dense once k > n/2 (k > n/P at P = 2). Decided
          when traced; with a scheduled density that can reach the dense
          side, per step (the residual is then sent in full, so nothing is
          lost). Never more bytes than the dense all-reduce.
      bucket_bytes: upper bound on the bytes of (value, index) pairs per
        all_gather; None puts all sparsified variables in one all_gather.
        A variable is never split, so a bucket holds at least one.
      error_feedback: keep residuals (default). Without, unsent entries are
        dropped: only for comparisons. (The default memory's choice.)
      momentum: None (default) or m in (0, 1): momentum correction (DGC,
        `tf_topk.memory.MomentumCorrectionMemory`): each replica keeps a
        velocity and sends top-k of its accumulation, and the returned
        gradients already carry the momentum, so apply them with plain SGD
        (no momentum in the optimizer). Dense-path variables get ordinary
        momentum on their sum.
      nesterov: with `momentum`, DGC's Nesterov variant.
      momentum_masking: with `momentum`, zero the velocity where sent
        (default True, as DGC).
      local_clipnorm: None, or clip each replica's gradients (all of them,
        by their global norm) to local_clipnorm / sqrt(replicas) before they
        enter the accumulation, as DGC's local gradient clipping: clipping
        the exchanged sum instead would act on gradients already delayed in
        the residuals. Think of it as the global clip norm of the sum.
      residuals: optional pre-made residual variables, one per sparsified
        variable in order; by default the memory makes them with
        `make_state`, so call the constructor in the strategy's scope.
      selector, memory, communicator: the parts, to replace the defaults
        (TopKSelector(method); MomentumCorrectionMemory with `momentum`,
        else ErrorFeedbackMemory or NoMemory; AgreedIndexCommunicator, or
        AllGatherCommunicator with exchange_mode="allgather"). A communicator
        without `agree_indices` and `sum_values` only does "allgather".
      make_state: the factory `(variable, dtype, suffix, replicated=False)
        -> variable` the memory makes its per-replica state with (the Keras
        wrapper passes one that makes tracked Keras variables); `replicated`
        state is the same on every replica (see
        `tf_topk.memory.make_state_variable`).
      sparse_output: return each sparsified variable's summed gradient as a
        `SparseGradient` (a row of pairs per replica, or one summed row with
        agreed indices) instead of a dense tensor: no pass over the
        variable's entries is made, and `apply_sparse_sgd` updates only the
        entries sent. For plain SGD (and momentum correction, whose exchanged
        sum plain SGD applies). A bucket that "auto" sends dense when traced
        comes back as dense tensors: every entry was sent, and there are no
        pairs to hand out (check with `isinstance(g, SparseGradient)`).
    """

    _TF_MODULE_IGNORED_PROPERTIES = tf.Module._TF_MODULE_IGNORED_PROPERTIES | {"_calls", "_adaptive_density"}

    def __init__(self, variables, density=0.001, method="gaussian", min_size=DEFAULT_MIN_SIZE,
                 bucket_bytes=None, error_feedback=True, residuals=None, name="sparse_exchange",
                 selector=None, memory=None, communicator=None, make_state=None, momentum=None,
                 nesterov=False, momentum_masking=True, local_clipnorm=None, exchange_mode="allgather",
                 sparse_output=False):
        super().__init__(name=name)
        variables = list(variables)
        if not variables:
            raise ValueError("variables must be a non-empty list of variables, got []")
        check_min_size(min_size)
        check_bucket_bytes(bucket_bytes)
        check_local_clipnorm(local_clipnorm)
        check_exchange_mode(exchange_mode)
        self.local_clipnorm = local_clipnorm
        self.exchange_mode = exchange_mode
        self.sparse_output = bool(sparse_output)
        self.selector = selector if selector is not None else TopKSelector(method)
        self.method = getattr(self.selector, "method", method)
        self.schedule = DensitySchedule(density)
        self.min_size = min_size
        self.bucket_bytes = bucket_bytes
        self.memory = self._choose_memory(memory, error_feedback, residuals, momentum, nesterov, momentum_masking)
        if communicator is None:
            communicator = AllGatherCommunicator() if exchange_mode == "allgather" else AgreedIndexCommunicator()
        self.communicator = communicator
        self._agrees = exchange_mode != "allgather" and hasattr(communicator, "agree_indices")
        if exchange_mode == "allreduce" and not self._agrees:
            raise ValueError(f"exchange_mode='allreduce' needs a communicator with agree_indices and sum_values, "
                             f"got communicator={communicator!r}")
        # Without a step, the leader of the agreed-index mode rotates with the
        # number of calls (the same on every replica). Not checkpointed: any
        # leader is a valid one, and checkpoints stay as they were.
        object.__setattr__(self, "_calls", tf.Variable(
            0, dtype=tf.int64, trainable=False, name="exchange_calls",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA) if self._agrees else None)
        # With an adaptive density: the density this step uses, agreed by all
        # replicas at the previous step. Not checkpointed: after a restore the
        # rule starts again from its initial density.
        self.adaptive = self.schedule.adaptive
        object.__setattr__(self, "_adaptive_density", tf.Variable(
            self.adaptive.initial_density, dtype=tf.float64, trainable=False, name="adaptive_density",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA) if self.adaptive else None)
        # Only static facts about the variables are kept: holding the variables
        # themselves would make them part of this module's checkpoint.
        self._specs = []
        for variable in variables:
            size = _flat_size(variable.shape)
            dtype = tf.as_dtype(variable.dtype)
            if not dtype.is_floating:
                raise ValueError(f"variable {variable.name} has dtype {dtype.name}; only float variables have gradients to exchange")
            self._specs.append(_VariableSpec(variable.name, tf.TensorShape(variable.shape), size, dtype,
                                             size >= min_size))
        self.sparse_positions = [i for i, s in enumerate(self._specs) if s.sparse]
        self._sparse_entries = sum(self._specs[i].size for i in self.sparse_positions)
        self.dense_positions = [i for i, s in enumerate(self._specs) if not s.sparse]
        self._buckets = self._make_buckets()
        make_state = make_state or make_state_variable
        # Checkpoints give each replica its own state back (tf_topk.replica_state):
        # hooked as the state is made, before a pending restore can reach it.
        with keeping_replica_values():
            self.memory.build([variables[i] for i in self.sparse_positions], make_state)
            self.memory.build_dense([variables[i] for i in self.dense_positions], make_state)
        self.error_feedback = bool(getattr(self.memory, "keeps_unsent", False))
        # The memory's per-replica state, tracked here so that checkpoints of
        # the exchange hold it; the residuals alone for inspection.
        self.memory_state = [keep_replica_values(v) for v in self.memory.state_variables]  # also ready-made ones
        self.residuals = list(getattr(self.memory, "residuals", None) or [])
        self._slot = {position: slot for slot, position in enumerate(self.sparse_positions)}
        self._dense_slot = {position: slot for slot, position in enumerate(self.dense_positions)}

    @staticmethod
    def _choose_memory(memory, error_feedback, residuals, momentum, nesterov, momentum_masking):
        if memory is not None:
            for name, value in (("residuals", residuals), ("momentum", momentum)):
                if value is not None:
                    raise ValueError(f"pass {name} to the memory, not next to it")
            return memory
        if momentum is None:
            if nesterov:
                raise ValueError("nesterov=True needs momentum=... (momentum correction)")
            return ErrorFeedbackMemory(residuals) if error_feedback else NoMemory()
        if not error_feedback:
            raise ValueError("momentum correction accumulates the velocity in the residual: it needs "
                             "error_feedback=True")
        if residuals is not None:
            raise ValueError("residuals=... is for plain error feedback; with momentum the memory makes its state")
        return MomentumCorrectionMemory(momentum, nesterov=nesterov, masking=momentum_masking)

    def _make_buckets(self):
        """Consecutive sparsified variables, at most bucket_bytes of pairs each."""
        max_density = self.schedule.max_density()
        buckets, current, current_bytes = [], [], 0
        for position in self.sparse_positions:
            size = self._specs[position].size
            pair_bytes = 8 * (size if max_density is None else max(1, math.ceil(max_density * size)))
            if current and self.bucket_bytes is not None and current_bytes + pair_bytes > self.bucket_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(position)
            current_bytes += pair_bytes
        if current:
            buckets.append(current)
        for bucket in buckets:
            total = sum(self._specs[p].size for p in bucket)
            if total >= 2**31:
                raise ValueError(f"a bucket of sparsified variables holds {total} entries; indices are int32, "
                                 "so set bucket_bytes to split them into buckets of fewer than 2^31 entries")
        return buckets

    @property
    def num_buckets(self):
        """Number of buckets: each is one all_gather, or two all-reduces
        (agreed indices, then values), or one dense all-reduce per step."""
        return len(self._buckets)

    def __call__(self, grads, step=None):
        """Exchange `grads` (one per variable, None allowed) in a replica context.

        Returns an ExchangeResult. `step` (an int tensor, e.g. the optimizer's
        iterations) is required when the density is scheduled.
        """
        grads, context = self._check_call(grads)
        replicas = context.num_replicas_in_sync
        if self.local_clipnorm is not None:
            grads = self._clip_locally(grads, replicas)
        totals = collections.defaultdict(lambda: tf.constant(0.0, tf.float32))
        plans = []
        for bucket in self._buckets:
            members = [p for p in bucket if grads[p] is not None]
            if members:
                ks = [self._k(self._specs[p].size, step) for p in members]
                plans.append((members, ks, *self._bucket_mode(ks, [self._specs[p].size for p in members], replicas)))
        agrees = any(path == "allreduce" and dense is not True for _, _, path, dense in plans)
        leader = self._leader(step, replicas) if agrees else None
        # 1. Local work, no communication but the agreement on indices: every
        #    sparsified variable's compensation and selection (the fused op).
        selections = [self._select_bucket(members, ks, path, dense, grads, leader, context, totals)
                      for members, ks, path, dense in plans]
        # 2. The dense-path gradients and the non-finite count travel in one
        #    of the buckets' collectives when that is cheaper, else on their own.
        dense_positions = [i for i, g in enumerate(grads) if g is not None and not self._specs[i].sparse]
        small = [grads[i] for i in dense_positions]
        non_finite = tf.add_n([_non_finite_count(g) for g in small]
                              + [tf.cast(s.stats[2], tf.float32) for sel in selections for s in sel.pieces])
        # The non-finite count, then (adaptive density) this replica's vote.
        scalars = tf.reshape(non_finite, [1])
        if self.adaptive:
            votes, entries = self._propose_density(plans, selections, replicas)
            scalars = tf.concat([scalars, votes], 0)
        carrier = self._carrier(plans, small, replicas)
        out = [None] * len(grads)
        carried = None
        if carrier is None:
            reduced = self.communicator.all_reduce_dense(context, small + [scalars])
            totals["other_bytes"] += ring_all_reduce_bytes(
                sum(self._specs[i].size * self._specs[i].dtype.size for i in dense_positions)
                + 4.0 * int(scalars.shape[0]), replicas)
        # 3. One collective per bucket (two with agreed indices); scatter.
        for index, ((members, ks, path, dense), selection) in enumerate(zip(plans, selections)):
            carry = _pack(small, scalars) if index == carrier else None
            summed, summed_carry = self._send_bucket(members, path, dense, selection, carry, context, totals)
            if carry is not None:
                carried = summed_carry
            if self.sparse_output and not (path == "allreduce" and dense is True):
                self._split_pairs(members, selection, summed, out)
            else:
                self._split_dense(members, summed, out)
        if carried is not None:
            reduced = _unpack(carried, small, int(scalars.shape[0]))
        summed_scalars = reduced[-1]
        all_finite = tf.equal(summed_scalars[0], 0.0)
        for position, tensor in zip(dense_positions, reduced[:-1]):
            out[position] = self.memory.apply_dense(self._dense_slot[position], tensor, all_finite)
        # 4. State changes only when every replica's step was finite: the
        #    memory's, and the density the replicas agreed on for the next step.
        agreed_density = self.adaptive.agree(summed_scalars[1:], entries) if self.adaptive else None
        self._update_memory(selections, all_finite, agreed_density)
        return ExchangeResult(out, all_finite, self._stats(grads, totals, replicas))

    def _check_call(self, grads):
        """The gradients as dense tensors (or None), and the replica context."""
        grads = list(grads)
        if len(grads) != len(self._specs):
            raise ValueError(f"expected {len(self._specs)} gradients (one per variable), got {len(grads)}")
        context = tf.distribute.get_replica_context()
        if context is None:
            raise RuntimeError("SparseExchange must be called in a replica context: inside strategy.run(...), "
                               "or outside any strategy scope")
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        if all(g is None for g in grads):
            raise ValueError("all gradients are None: nothing to exchange")
        return grads, context

    def _clip_locally(self, grads, replicas):
        """This replica's gradients clipped to global norm local_clipnorm / sqrt(replicas)
        (a non-finite norm makes them NaN: the step is then skipped)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        clipped, _ = tf.clip_by_global_norm([grads[i] for i in present], self.local_clipnorm / math.sqrt(replicas))
        grads = list(grads)
        for position, tensor in zip(present, clipped):
            grads[position] = tensor
        return grads

    def _leader(self, step, replicas):
        """The replica whose indices the agreed-index mode sends: step mod P."""
        if replicas == 1:
            return tf.constant(0, tf.int32)
        if step is None:
            step = self._calls.assign_add(1) - 1
        return tf.cast(tf.math.floormod(tf.cast(step, tf.int64), replicas), tf.int32)

    def _bucket_mode(self, ks, sizes, replicas):
        """(path, dense): path "allgather" or "allreduce"; dense (a bool, or a
        bool tensor when k is scheduled) sends every entry on the allreduce path."""
        if replicas == 1 or not self._agrees:
            return "allgather", False
        if self.exchange_mode == "allreduce":
            return "allreduce", False
        entries = sum(sizes)
        if all(isinstance(k, int) for k in ks):
            mode = choose_mode(replicas, sum(ks), entries)
            return ("allgather", False) if mode == "allgather" else ("allreduce", mode == "dense")
        max_density = self.schedule.max_density()
        max_pairs = entries if max_density is None else sum(max(1, min(n, math.ceil(max_density * n)))
                                                            for n in sizes)
        sparse = choose_mode(replicas, max_pairs, entries, ("allgather", "allreduce"))
        dense_bytes = mode_bytes("dense", max_pairs, entries, replicas)
        if mode_bytes(sparse, max_pairs, entries, replicas) <= dense_bytes:
            return sparse, False
        pairs = tf.add_n([tf.cast(k, tf.float32) for k in ks])
        return "allreduce", mode_bytes("allreduce", pairs, entries, replicas) > dense_bytes

    @property
    def adaptive_density(self):
        """With an adaptive density: the density the next step uses (this
        replica's copy; every replica holds the same). None otherwise."""
        return None if self._adaptive_density is None else self._adaptive_density.read_value()

    def _k(self, size, step):
        """k of a variable of `size` entries this step."""
        if self.adaptive is None:
            return self.schedule.k(size, step)
        k = tf.cast(tf.math.ceil(self._adaptive_density.read_value() * size), tf.int32)
        return tf.clip_by_value(k, 1, size)

    def _propose_density(self, plans, selections, replicas):
        """This replica's vote for the next step's density (float32 one-hot
        over `self.adaptive.candidates(entries)`) by the adaptive rule on the
        profile of every sparsified variable, with the byte costs of the
        exchange mode in use; and `entries`, which the agreement needs."""
        pieces = [piece for selection in selections for piece in selection.pieces]
        profile = tf.add_n([piece.profile for piece in pieces])
        total_energy = tf.add_n([piece.stats[0] for piece in pieces])
        entries = float(sum(selection.size for selection in selections))
        workers = self.adaptive.replicas or replicas
        path = "allgather" if any(p == "allgather" for _, _, p, _ in plans) else "allreduce"
        pair_bytes = mode_bytes(path, 1.0, entries, workers)
        # Density 1 takes the dense all-reduce where the mode can switch to it
        # ("auto"), else every pair through the same path.
        dense_bytes = (mode_bytes("dense", entries, entries, workers) if self.exchange_mode == "auto"
                       else mode_bytes(path, entries, entries, workers))
        index = self.adaptive.choose_index(profile, entries, pair_bytes, dense_bytes, total_energy)
        return tf.one_hot(index, len(self.adaptive.candidates(entries)), dtype=tf.float32), entries

    def _split_dense(self, members, summed, out):
        """A bucket's dense sum cut into its variables' gradients."""
        offset = 0
        for position in members:
            spec = self._specs[position]
            out[position] = tf.reshape(tf.cast(summed[offset:offset + spec.size], spec.dtype), spec.shape)
            offset += spec.size

    def _split_pairs(self, members, selection, pairs, out):
        """A bucket's pairs ([rows, K] values and bucket indices) cut into
        its variables' SparseGradients."""
        values, indices = pairs
        lengths = tf.stack([tf.size(piece.values) for piece in selection.pieces])
        offset = 0
        for position, member_values, member_indices in zip(members, tf.split(values, lengths, axis=1),
                                                           tf.split(indices, lengths, axis=1)):
            spec = self._specs[position]
            out[position] = SparseGradient(tf.cast(member_values, spec.dtype), member_indices - offset)
            offset += spec.size

    def _carrier(self, plans, small, replicas):
        """Index of the bucket whose collective carries the dense-path
        gradients and the non-finite count, or None for a separate all-reduce.

        An agreed-index bucket's value all-reduce carries them at no extra
        byte. An all_gather bucket carries them when the extra bytes of
        gathering instead of reducing them, (P-1) * 4m * (1 - 2/P) (none at
        P = 2), stay within `DENSE_CARRY_BYTES`, what one collective's
        latency is worth on a 1 Gbit/s link (`carry_in_gather`). float64
        dense gradients always take the separate all-reduce (the buffers are
        float32).
        """
        if replicas == 1 or not plans or any(g.dtype == tf.float64 for g in small):
            return None
        for index, (_, _, path, dense) in enumerate(plans):
            if path == "allreduce" and dense is not True:
                return index
        entries = sum(int(g.shape.num_elements()) for g in small) + 1
        for index, (_, _, path, _) in enumerate(plans):
            if path == "allgather" and carry_in_gather(entries, replicas):
                return index
        return None

    def _profile_density(self, size):
        """How deep a variable of `size` entries is profiled: down to the rank
        the adaptive rule may reach over ALL sparsified entries (max_density *
        n), not its own share of it, since one variable may hold most of the
        largest entries; the summed profiles are then exact to that rank."""
        return min(1.0, self.adaptive.max_density * self._sparse_entries / size)

    def _select(self, slot, grad, k):
        """The memory's compensation and the fused selection of one sparsified
        variable: an ErrorFeedbackSelection (values, indices, remaining, stats)."""
        compensation = self.memory.compensate(slot, grad)
        fused = isinstance(self.selector, TopKSelector)
        selection = ops.error_feedback_topk(
            compensation.gradient, compensation.residual, k if fused else 0, method=self.method,
            with_profile=self.adaptive is not None,
            profile_density=self._profile_density(int(grad.shape.num_elements())) if self.adaptive else 1.0)
        if not fused:  # another selector: the op adds, the selector picks
            accumulated = selection.remaining
            values, indices = self.selector.select(accumulated, k)
            selection = _taken_out(selection, accumulated, values, indices)
        return compensation, selection

    def _select_bucket(self, members, ks, path, dense, grads, leader, context, totals):
        """Selects every member of a bucket (and agrees on the leader's indices
        on the agreed-index path); returns a _BucketSelection."""
        slots = [self._slot[p] for p in members]
        sizes = [self._specs[p].size for p in members]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        if path == "allgather":
            picked = [self._select(slot, grads[p], k) for slot, p, k in zip(slots, members, ks)]
        else:
            everything = [self._select(slot, grads[p], 0) for slot, p in zip(slots, members)]
            taken = self._agree([s.remaining for _, s in everything], ks, sizes, offsets, dense, leader, context)
            picked = [(c, _taken_out(s, s.remaining, values, indices))
                      for (c, s), (values, indices) in zip(everything, taken)]
        pieces = [s for _, s in picked]
        values = tf.concat([tf.cast(s.values, tf.float32) for s in pieces], 0)
        indices = tf.concat([s.indices + offset for s, offset in zip(pieces, offsets)], 0)
        for s in pieces:
            totals["selected"] += tf.cast(tf.math.count_nonzero(s.values), tf.float32)
            totals["accumulated_sq"] += tf.cast(s.stats[0], tf.float32)
            totals["dropped_sq"] += tf.cast(tf.maximum(s.stats[1], 0.0), tf.float32)
        return _BucketSelection(slots, [c for c, _ in picked], pieces, values, indices, sum(sizes))

    def _send_bucket(self, members, path, dense, selection, carry, context, totals):
        """One bucket's collective: its dense float32 sum over replicas, and the
        sum of `carry` (None when not carried); adds the bucket's statistics."""
        replicas = context.num_replicas_in_sync
        size = selection.size
        carry_entries = 0 if carry is None else int(carry.shape[0])
        pairs = tf.cast(tf.size(selection.values), tf.float32)
        totals["k"] += pairs
        totals["buckets"] += 1.0
        if path == "allgather":
            totals["other_bytes"] += (mode_bytes("allgather", pairs, size, replicas)
                                      + gather_bytes(carry_entries, replicas))
            totals["mode"] += MODE_CODES["allgather"]
            return self.communicator.exchange_pairs(context, selection.values, selection.indices, size, carry,
                                                    densify=not self.sparse_output)
        totals["other_bytes"] += (tf.where(dense, mode_bytes("dense", pairs, size, replicas),
                                           mode_bytes("allreduce", pairs, size, replicas))
                                  + ring_all_reduce_bytes(4.0 * carry_entries, replicas))
        totals["mode"] += tf.where(dense, MODE_CODES["dense"], MODE_CODES["allreduce"])
        # The bucket indices of the pieces: the agreed ones where the leader had
        # an entry; a spare slot points at its own variable's first entry (its
        # value is 0 on every replica), so the split never leaves a variable.
        indices = None if dense is True else selection.indices
        return self.communicator.sum_values(context, selection.values, indices, size, carry,
                                            densify=not self.sparse_output or dense is True)

    def _agree(self, accumulated, ks, sizes, offsets, dense, leader, context):
        """The agreed-index mode's selection: per variable, this replica's
        (values, indices) at the bucket's agreed indices (spare slots: value 0
        at the variable's index 0). `dense` sends every entry; no index
        travels then."""
        everything = [(a, tf.range(n)) for a, n in zip(accumulated, sizes)]
        if dense is True:
            return everything
        if dense is False:
            local = [self.selector.select(a, k) for a, k in zip(accumulated, ks)]
        else:
            local = [tf.cond(dense, lambda pair=pair: pair, lambda a=a, k=k: tuple(self.selector.select(a, k)))
                     for pair, a, k in zip(everything, accumulated, ks)]
        candidates = tf.concat([i + offset for (_, i), offset in zip(local, offsets)], 0)
        valid = tf.concat([tf.not_equal(v, 0) for v, _ in local], 0)
        if dense is not False:  # nothing to agree on: the agreement carries no index
            candidates = tf.cond(dense, lambda: tf.zeros([0], tf.int32), lambda: candidates)
            valid = tf.cond(dense, lambda: tf.zeros([0], tf.bool), lambda: valid)
        agreed, agreed_valid = self.communicator.agree_indices(context, candidates, valid, leader)
        lengths = [tf.size(i) for _, i in local]
        if dense is not False:
            whole = tf.concat([i + offset for (_, i), offset in zip(everything, offsets)], 0)
            agreed = tf.cond(dense, lambda: whole, lambda: agreed)
            agreed_valid = tf.cond(dense, lambda: tf.ones_like(whole, tf.bool), lambda: agreed_valid)
        selected = []
        for a, offset, piece, piece_valid in zip(accumulated, offsets, tf.split(agreed, tf.stack(lengths)),
                                                 tf.split(agreed_valid, tf.stack(lengths))):
            indices = tf.where(piece_valid, piece - offset, 0)
            selected.append((tf.where(piece_valid, tf.gather(a, indices), tf.zeros([], a.dtype)), indices))
        return selected

    def _update_memory(self, selections, all_finite, agreed_density=None):
        """The memory's update of every slot (and the adaptive density of the
        next step), in one branch taken only when every replica's step was
        finite (nothing is undone otherwise)."""
        def update():
            for selection in selections:
                for slot, compensation, piece in zip(selection.slots, selection.compensations, selection.pieces):
                    self.memory.update(slot, compensation, piece.remaining, piece.values, piece.indices)
            if agreed_density is not None:
                self._adaptive_density.assign(tf.cast(agreed_density, tf.float64))
            return tf.constant(True)

        tf.cond(all_finite, update, lambda: tf.constant(False))

    def _stats(self, grads, totals, replicas):
        present = [i for i, g in enumerate(grads) if g is not None]
        sparse_entries = float(sum(self._specs[p].size for p in present if self._specs[p].sparse))
        # What the dense all-reduce sends: each gradient in its own dtype.
        dense_all_bytes = float(sum(self._specs[p].size * self._specs[p].dtype.size for p in present))
        k_total = totals["k"]
        # With a memory, what was dropped from the accumulated gradient is the residual.
        residual_sq = totals["dropped_sq"] if self.error_feedback else tf.constant(0.0, tf.float32)
        return {
            "density": totals["selected"] / max(sparse_entries, 1.0),
            "selected": totals["selected"],
            "bytes_sent": totals["other_bytes"],
            "bytes_dense": tf.constant(ring_all_reduce_bytes(dense_all_bytes, replicas), tf.float32),
            "residual_norm": tf.sqrt(residual_sq),
            "contraction": totals["dropped_sq"] / tf.maximum(totals["accumulated_sq"], 1e-30),
            "random_k_bound": 1.0 - k_total / max(sparse_entries, 1.0),
            "exchange_mode": totals["mode"] / tf.maximum(totals["buckets"], 1.0),
        }


_BucketSelection = collections.namedtuple(
    "_BucketSelection", ["slots", "compensations", "pieces", "values", "indices", "size"])
# One bucket after selection: per member its slot, the memory's Compensation
# and its ErrorFeedbackSelection; the bucket's float32 values and int32
# indices (offset into the bucket) to send (on the agreed-index path the
# same indices on every replica); the bucket's entries.


def _taken_out(selection, accumulated, values, indices):
    """`selection` with (values, indices) taken out of `accumulated` instead:
    for a selection the fused op did not make (another selector, agreed
    indices). Spare slots (value 0) take nothing out."""
    remaining = tf.tensor_scatter_nd_sub(accumulated, tf.expand_dims(indices, 1), tf.cast(values, accumulated.dtype))
    finite = tf.where(tf.math.is_finite(remaining), remaining, tf.zeros_like(remaining))
    stats = tf.stack([selection.stats[0], tf.cast(tf.reduce_sum(tf.square(finite)), tf.float64), selection.stats[2]])
    return ops.ErrorFeedbackSelection(values, indices, remaining, stats, selection.profile)


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
