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

from tf_topk import ops
from tf_topk.memory import ErrorFeedbackMemory, make_residual
from tf_topk.schedule import DensitySchedule

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


def _ring_all_reduce_bytes(num_bytes, replicas):
    return 2.0 * (replicas - 1) / replicas * num_bytes if replicas > 1 else 0.0


class SparseExchange(tf.Module):
    """Top-k sparsified, error-compensated exchange of gradients between replicas.

    Args:
      variables: the variables whose gradients are exchanged, in the order the
        gradients will be passed (for Keras: `model.trainable_variables`).
      density: fraction of entries sent per sparsified variable: a float in
        (0, 1], a list of (step, density) pairs or a callable (see
        `tf_topk.schedule`).
      method: selection method of `tf_topk.approx_topk`: "gaussian" or "exact".
      min_size: variables with fewer entries take the dense all-reduce.
      bucket_bytes: upper bound on the bytes of (value, index) pairs per
        all_gather; None puts all sparsified variables in one all_gather.
        A variable is never split, so a bucket holds at least one.
      error_feedback: keep residuals (default). Without, unsent entries are
        dropped: only for comparisons.
      residuals: optional pre-made residual variables, one per sparsified
        variable in order (the Keras wrapper passes its own); by default they
        are created here, so call the constructor in the strategy's scope.
    """

    def __init__(self, variables, density=0.001, method="gaussian", min_size=DEFAULT_MIN_SIZE,
                 bucket_bytes=None, error_feedback=True, residuals=None, name="sparse_exchange"):
        super().__init__(name=name)
        variables = list(variables)
        if not variables:
            raise ValueError("variables must be a non-empty list of variables, got []")
        if method not in ops.METHODS:
            raise ValueError(f"method must be one of {ops.METHODS}, got {method!r}")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
            raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                         or bucket_bytes < 8):
            raise ValueError(f"bucket_bytes must be None or an int >= 8, got {bucket_bytes!r}")
        self.schedule = DensitySchedule(density)
        self.method = method
        self.min_size = min_size
        self.bucket_bytes = bucket_bytes
        self.error_feedback = bool(error_feedback)
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
        if self.error_feedback:
            if residuals is None:
                residuals = [make_residual(variables[i]) for i in self.sparse_positions]
            residuals = list(residuals)
            if len(residuals) != len(self.sparse_positions):
                raise ValueError(f"residuals must hold one variable per sparsified variable "
                                 f"({len(self.sparse_positions)}), got {len(residuals)}")
            self.residuals = residuals
        else:
            self.residuals = []
        self._memory = ErrorFeedbackMemory(self.residuals)
        self._residual_slot = {position: slot for slot, position in enumerate(self.sparse_positions)}

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
        grads = list(grads)
        if len(grads) != len(self._specs):
            raise ValueError(f"expected {len(self._specs)} gradients (one per variable), got {len(grads)}")
        context = tf.distribute.get_replica_context()
        if context is None:
            raise RuntimeError("SparseExchange must be called in a replica context: inside strategy.run(...), "
                               "or outside any strategy scope")
        replicas = context.num_replicas_in_sync
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]  # IndexedSlices -> dense
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            raise ValueError("all gradients are None: nothing to exchange")

        # Non-finite entries anywhere make every replica skip the step.
        non_finite = tf.add_n([tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(grads[i])), tf.float32))
                               for i in present])
        dense_positions = [i for i in present if not self._specs[i].sparse]
        dense_inputs = [grads[i] for i in dense_positions] + [non_finite]
        if replicas > 1:
            dense_inputs = context.all_reduce(tf.distribute.ReduceOp.SUM, dense_inputs)
        all_finite = tf.equal(dense_inputs[-1], 0.0)
        out = [None] * len(grads)
        for position, reduced in zip(dense_positions, dense_inputs[:-1]):
            out[position] = reduced

        totals = collections.defaultdict(lambda: tf.constant(0.0, tf.float32))
        pair_count = 0
        for bucket in self._buckets:
            members = [p for p in bucket if grads[p] is not None]
            if not members:
                continue
            dense_bucket, bucket_stats = self._exchange_bucket(members, grads, all_finite, step, context, replicas)
            offset = 0
            for position in members:
                spec = self._specs[position]
                piece = dense_bucket[offset:offset + spec.size]
                out[position] = tf.reshape(tf.cast(piece, spec.dtype), spec.shape)
                offset += spec.size
            for key, value in bucket_stats.items():
                totals[key] += value
            pair_count += 1

        sparse_entries = float(sum(self._specs[p].size for p in present if self._specs[p].sparse))
        dense_entries = float(sum(self._specs[p].size for p in dense_positions))
        all_entries = sparse_entries + dense_entries
        k_total = totals["k"]
        stats = {
            "density": totals["selected"] / max(sparse_entries, 1.0),
            "selected": totals["selected"],
            "bytes_sent": (replicas - 1) * 8.0 * k_total + _ring_all_reduce_bytes(4.0 * dense_entries, replicas),
            "bytes_dense": tf.constant(_ring_all_reduce_bytes(4.0 * all_entries, replicas), tf.float32),
            "residual_norm": tf.sqrt(totals["residual_sq"]),
            "contraction": totals["dropped_sq"] / tf.maximum(totals["accumulated_sq"], 1e-30),
            "random_k_bound": 1.0 - k_total / max(sparse_entries, 1.0),
        }
        return ExchangeResult(out, all_finite, stats)

    def _exchange_bucket(self, members, grads, all_finite, step, context, replicas):
        values_list, indices_list, offset = [], [], 0
        stats = collections.defaultdict(lambda: tf.constant(0.0, tf.float32))
        for position in members:
            spec = self._specs[position]
            if self.error_feedback:
                accumulated = self._memory.compensate(self._residual_slot[position], grads[position])
            else:
                accumulated = tf.reshape(tf.cast(grads[position], tf.float32), [-1])
            k = self.schedule.k(spec.size, step)
            values, indices = ops.approx_topk(accumulated, k, method=self.method)
            if self.error_feedback:
                remaining = self._memory.update(self._residual_slot[position], accumulated, values, indices,
                                                all_finite)
            else:
                selected = tf.scatter_nd(tf.expand_dims(indices, 1), values, tf.shape(accumulated))
                remaining = accumulated - selected
            values = tf.where(all_finite, tf.cast(values, tf.float32), 0.0)  # a skipped step sends nothing
            values_list.append(values)
            indices_list.append(indices + offset)
            offset += spec.size
            finite_acc = tf.where(tf.math.is_finite(accumulated), accumulated, tf.zeros_like(accumulated))
            finite_rem = tf.where(tf.math.is_finite(remaining), remaining, tf.zeros_like(remaining))
            stats["k"] += tf.cast(k, tf.float32)
            stats["selected"] += tf.cast(tf.math.count_nonzero(values), tf.float32)
            stats["accumulated_sq"] += tf.cast(tf.reduce_sum(tf.square(finite_acc)), tf.float32)
            stats["dropped_sq"] += tf.cast(tf.reduce_sum(tf.square(finite_rem)), tf.float32)
            stats["residual_sq"] += (tf.cast(tf.reduce_sum(tf.square(finite_rem)), tf.float32)
                                     if self.error_feedback else 0.0)
        values = tf.concat(values_list, 0)
        indices = tf.concat(indices_list, 0)
        dense = tf.zeros([offset], tf.float32)
        if replicas == 1:
            return tf.tensor_scatter_nd_add(dense, tf.expand_dims(indices, 1), values), stats
        # One collective for the whole bucket: values and bit-cast indices.
        buffer = tf.concat([values, tf.bitcast(indices, tf.float32)], 0)
        gathered = tf.reshape(context.all_gather(buffer, axis=0), [replicas, 2, -1])
        # Replica by replica, in replica order: within one replica's pairs the
        # indices are distinct (spare slots add 0), so each scatter-add is
        # order-free and every replica computes the same sum.
        for replica in range(replicas):
            replica_indices = tf.bitcast(gathered[replica, 1], tf.int32)
            dense = tf.tensor_scatter_nd_add(dense, tf.expand_dims(replica_indices, 1), gathered[replica, 0])
        return dense, stats
