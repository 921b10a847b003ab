"""Sparse gradient exchange over tf.distribute: the replacement for the dense all-reduce.

Per step and replica, for each sparsified variable: add the residual (error
feedback), select k entries with the op, keep the rest in the residual; pack
the (value, index) pairs of all sparsified variables of a bucket into one
float32 buffer (indices bit-cast), exchange it with ONE `all_gather` per bucket,
and scatter-add every replica's pairs back into a dense SUM, replica by replica
in a fixed order so that every replica computes bitwise the same result.
Variables smaller than `min_size` take the ordinary dense all-reduce, all of
them in one packed call.

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

from tf_topk.communicator import AllGatherCommunicator, ring_all_reduce_bytes
from tf_topk.memory import ErrorFeedbackMemory, NoMemory, make_state_variable
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

STAT_NAMES = (
    "density",           # non-zero selected entries / entries of sparsified variables
    "selected",          # non-zero selected entries
    "bytes_sent",        # estimated bytes this worker sends per step (ring collectives)
    "bytes_dense",       # what the dense all-reduce of every gradient would send
    "residual_norm",     # L2 norm of all residuals after the step
    "contraction",       # ||acc - topk(acc)||^2 / ||acc||^2 over sparsified variables
    "random_k_bound",    # 1 - k/d, the contraction random-k selection would give in expectation
)

_VariableSpec = collections.namedtuple("_VariableSpec", ["name", "shape", "size", "dtype", "sparse"])


def _flat_size(shape):
    shape = tf.TensorShape(shape)
    if not shape.is_fully_defined():
        raise ValueError(f"variables must have fully defined shapes, got {shape}")
    return int(shape.num_elements())


def check_min_size(min_size):
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")


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
        (0, 1], a list of (step, density) pairs or a callable (see
        `tf_topk.schedule`).
      method: selection method of `tf_topk.approx_topk`: "gaussian" or "exact"
        (the default selector's).
      min_size: variables with fewer entries take the dense all-reduce.
      bucket_bytes: upper bound on the bytes of (value, index) pairs per
        all_gather; None puts all sparsified variables in one all_gather.
        A variable is never split, so a bucket holds at least one.
      error_feedback: keep residuals (default). Without, unsent entries are
        dropped: only for comparisons. (The default memory's choice.)
      residuals: optional pre-made residual variables, one per sparsified
        variable in order; by default the memory makes them with
        `make_state`, so call the constructor in the strategy's scope.
      selector, memory, communicator: the parts, to replace the defaults
        (TopKSelector(method), ErrorFeedbackMemory or NoMemory,
        AllGatherCommunicator).
      make_state: the factory `(variable, dtype, suffix) -> variable` the
        memory makes its per-replica state with (the Keras wrapper passes one
        that makes tracked Keras variables).
    """

    def __init__(self, variables, density=0.001, method="gaussian", min_size=DEFAULT_MIN_SIZE,
                 bucket_bytes=None, error_feedback=True, residuals=None, name="sparse_exchange",
                 selector=None, memory=None, communicator=None, make_state=None):
        super().__init__(name=name)
        variables = list(variables)
        if not variables:
            raise ValueError("variables must be a non-empty list of variables, got []")
        check_min_size(min_size)
        check_bucket_bytes(bucket_bytes)
        self.selector = selector if selector is not None else TopKSelector(method)
        self.method = getattr(self.selector, "method", method)
        self.schedule = DensitySchedule(density)
        self.min_size = min_size
        self.bucket_bytes = bucket_bytes
        if memory is None:
            memory = ErrorFeedbackMemory(residuals) if error_feedback else NoMemory()
        elif residuals is not None:
            raise ValueError("pass residuals to the memory, not next to it")
        self.memory = memory
        self.communicator = communicator if communicator is not None else AllGatherCommunicator()
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
        self.dense_positions = [i for i, s in enumerate(self._specs) if not s.sparse]
        self._buckets = self._make_buckets()
        self.memory.build([variables[i] for i in self.sparse_positions], make_state or make_state_variable)
        self.error_feedback = bool(getattr(self.memory, "keeps_unsent", False))
        # The memory's per-replica state, tracked here so that checkpoints of
        # the exchange hold it.
        self.residuals = self.memory.state_variables
        self._slot = {position: slot for slot, position in enumerate(self.sparse_positions)}

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
        """Number of all_gather calls per step (one per bucket)."""
        return len(self._buckets)

    def __call__(self, grads, step=None):
        """Exchange `grads` (one per variable, None allowed) in a replica context.

        Returns an ExchangeResult. `step` (an int tensor, e.g. the optimizer's
        iterations) is required when the density is scheduled.
        """
        grads, context = self._check_call(grads)
        out = [None] * len(grads)
        all_finite = self._reduce_dense(grads, context, out)
        totals = collections.defaultdict(lambda: tf.constant(0.0, tf.float32))
        for bucket in self._buckets:
            members = [p for p in bucket if grads[p] is not None]
            if not members:
                continue
            dense_bucket = self._exchange_bucket(members, grads, all_finite, step, context, totals)
            offset = 0
            for position in members:
                spec = self._specs[position]
                piece = dense_bucket[offset:offset + spec.size]
                out[position] = tf.reshape(tf.cast(piece, spec.dtype), spec.shape)
                offset += spec.size
        return ExchangeResult(out, all_finite, self._stats(grads, totals, context.num_replicas_in_sync))

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

    def _reduce_dense(self, grads, context, out):
        """All-reduces the small variables' gradients into `out` together with
        the count of non-finite entries on all replicas; returns all_finite:
        non-finite entries anywhere make every replica skip the step."""
        present = [i for i, g in enumerate(grads) if g is not None]
        non_finite = tf.add_n([tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(grads[i])), tf.float32))
                               for i in present])
        dense_positions = [i for i in present if not self._specs[i].sparse]
        reduced = self.communicator.all_reduce_dense(context, [grads[i] for i in dense_positions] + [non_finite])
        for position, tensor in zip(dense_positions, reduced[:-1]):
            out[position] = tensor
        return tf.equal(reduced[-1], 0.0)

    def _exchange_bucket(self, members, grads, all_finite, step, context, totals):
        """Select, remember and send one bucket; returns its dense float32 sum
        over replicas and adds its statistics to `totals`."""
        values_list, indices_list, offset = [], [], 0
        for position in members:
            spec = self._specs[position]
            slot = self._slot[position]
            accumulated = self.memory.compensate(slot, grads[position])
            k = self.schedule.k(spec.size, step)
            values, indices = self.selector.select(accumulated, k)
            remaining = self.memory.update(slot, accumulated, values, indices, all_finite)
            values = tf.where(all_finite, tf.cast(values, tf.float32), 0.0)  # a skipped step sends nothing
            values_list.append(values)
            indices_list.append(indices + offset)
            offset += spec.size
            totals["k"] += tf.cast(k, tf.float32)
            totals["selected"] += tf.cast(tf.math.count_nonzero(values), tf.float32)
            totals["accumulated_sq"] += _finite_square_sum(accumulated)
            totals["dropped_sq"] += _finite_square_sum(remaining)
        return self.communicator.exchange_pairs(context, tf.concat(values_list, 0),
                                                tf.concat(indices_list, 0), offset)

    def _stats(self, grads, totals, replicas):
        present = [i for i, g in enumerate(grads) if g is not None]
        sparse_entries = float(sum(self._specs[p].size for p in present if self._specs[p].sparse))
        dense_entries = float(sum(self._specs[p].size for p in present if not self._specs[p].sparse))
        k_total = totals["k"]
        # With a memory, what was dropped from the accumulated gradient is the residual.
        residual_sq = totals["dropped_sq"] if self.error_feedback else tf.constant(0.0, tf.float32)
        return {
            "density": totals["selected"] / max(sparse_entries, 1.0),
            "selected": totals["selected"],
            "bytes_sent": self.communicator.bytes_sent(k_total, dense_entries, replicas),
            "bytes_dense": tf.constant(ring_all_reduce_bytes(4.0 * (sparse_entries + dense_entries), replicas),
                                       tf.float32),
            "residual_norm": tf.sqrt(residual_sq),
            "contraction": totals["dropped_sq"] / tf.maximum(totals["accumulated_sq"], 1e-30),
            "random_k_bound": 1.0 - k_total / max(sparse_entries, 1.0),
        }


def _finite_square_sum(tensor):
    """Sum of squares of the finite entries, as float32."""
    finite = tf.where(tf.math.is_finite(tensor), tensor, tf.zeros_like(tensor))
    return tf.cast(tf.reduce_sum(tf.square(finite)), tf.float32)
