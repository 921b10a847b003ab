"""What every route shares: the Route interface, a bucket's facts, byte formulas, the splits.

A route is how one bucket of sparsified variables travels between replicas
for one step: which entries each replica contributes (its selection, when
that differs from each replica's own top-k), the collective that sums them,
how the sum is cut back into the variables' gradients (dense, or pairs with
`sparse_output`), and what that costs in bytes per worker. The exchange
(`tf_topk.SparseExchange`) asks a router for a route per bucket and step and
runs the same loop whatever the route.

A new route subclasses `Route` (a local-only baseline, each replica applying
its own top-k: a few lines):

    class LocalRoute(Route):
        name, code = "local", 3.0

        def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
            dense = tf.scatter_nd(tf.expand_dims(indices, 1), values, [bucket.size])
            return split_dense(bucket, dense), None

        def bytes(self, pairs, entries, replicas):
            return 0.0

        def extra_carry_bytes(self, entries, replicas):
            return math.inf                          # sums nothing: cannot carry

and a router returns it: `SparseExchange(..., router=FixedRouter(LocalRoute()))`.
"""

import abc
import collections

import tensorflow as tf

from tf_topk import ops
from tf_topk.sparse_gradient import SparseGradient


def ring_all_reduce_bytes(num_bytes, replicas):
    """Bytes each worker sends in a ring all-reduce of `num_bytes`."""
    return 2.0 * (replicas - 1) / replicas * num_bytes if replicas > 1 else 0.0


def gather_bytes(entries, replicas):
    """Bytes each worker sends in an all_gather of `entries` float32 entries per replica."""
    return (replicas - 1) * 4.0 * entries


Bucket = collections.namedtuple("Bucket", ["positions", "slots", "sizes", "offsets", "size", "ks", "shapes",
                                           "dtypes", "max_pairs"])
Bucket.__doc__ = """One bucket's variables this step (those with a gradient).

positions: their indices among the exchange's variables; slots: their
memory slots; sizes, offsets: entries and offset into the bucket's index
space; size: the bucket's entries; ks: k per variable (int, or int32 tensor
when scheduled or adaptive); shapes, dtypes: of the variables; max_pairs: the
most pairs the bucket sends at the schedule's largest density.
"""


class Route(abc.ABC):
    """How one bucket travels: selection, collective, split, bytes.

    name: what the route is called ("allgather", "allreduce", "dense");
    code: the float the "exchange_mode" statistic reports for it.
    uses_leader: whether `select` needs the step's leader replica.
    """

    name = None
    code = None
    uses_leader = False

    def select(self, bucket, accumulate, selector, context, leader):
        """Each member's ErrorFeedbackSelection (values, indices, remaining,
        stats, profile). `accumulate(i, k)` runs member i's fused selection of
        k entries (k = 0: only gradient + residual, in `remaining`;
        `accumulate(i, k, chunk=c, value_bits=b)`: k entries of every chunk of
        c, rounded to b bits, by the CPU's `ops.error_feedback_chunk_topk`);
        `selector.select(flat, k)` picks k entries of a flat tensor. By
        default each replica sends its own top-k."""
        return [accumulate(i, k) for i, k in enumerate(bucket.ks)]

    @abc.abstractmethod
    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        """The collective. values: float32 [K] and indices: int32 [K] (offset
        into the bucket) of this replica's pairs, `lengths` of them per member
        (int32 scalars); carry: float32 [m] to sum over replicas in the same
        collective, or None. Returns (one gradient per member: a tensor of its
        shape and dtype, or a SparseGradient with `sparse_output`; the summed
        carry or None)."""

    @abc.abstractmethod
    def bytes(self, pairs, entries, replicas):
        """Bytes a worker sends for a bucket of `entries` with `pairs` pairs."""

    def bytes_for_k(self, k, entries, replicas):
        """Bytes a worker sends for a bucket whose variables select `k` pairs
        (a route may send more pairs than it selects: agreed slots)."""
        return self.bytes(k, entries, replicas)

    def bucket_overhead_bytes(self, bucket, replicas):
        """Bytes a worker sends per bucket beyond `bytes` (a per-member scale): none by default."""
        return 0.0

    def carry_bytes(self, entries, replicas):
        """Bytes a worker sends for `entries` float32 entries carried in `send`."""
        return ring_all_reduce_bytes(4.0 * entries, replicas)

    def extra_carry_bytes(self, entries, replicas):
        """What carrying costs beyond an all-reduce of its own (which costs a
        collective's latency instead): none for a route made of all-reduces;
        math.inf for a route whose `send` cannot sum a carry over replicas."""
        return self.carry_bytes(entries, replicas) - ring_all_reduce_bytes(4.0 * entries, replicas)

    def __repr__(self):
        return f"{type(self).__name__}()"


def split_dense(bucket, summed):
    """A bucket's dense float32 sum cut into its members' gradients."""
    return [tf.reshape(tf.cast(summed[offset:offset + size], dtype), shape)
            for offset, size, dtype, shape in zip(bucket.offsets, bucket.sizes, bucket.dtypes, bucket.shapes)]


def split_pairs(bucket, lengths, values, indices):
    """A bucket's pairs ([rows, K] values and bucket indices, each member's
    `lengths` consecutive) cut into its members' SparseGradients."""
    lengths = tf.stack(lengths)
    return [SparseGradient(tf.cast(member_values, dtype), member_indices - offset)
            for member_values, member_indices, offset, dtype in zip(tf.split(values, lengths, axis=1),
                                                                     tf.split(indices, lengths, axis=1),
                                                                     bucket.offsets, bucket.dtypes)]


def taken_out(selection, accumulated, values, indices):
    """`selection` with (values, indices) taken out of `accumulated` instead:
    for a selection the fused op did not make (another selector, agreed
    indices). Spare slots (value 0) take nothing out."""
    remaining = tf.tensor_scatter_nd_sub(accumulated, tf.expand_dims(indices, 1), tf.cast(values, accumulated.dtype))
    finite = tf.where(tf.math.is_finite(remaining), remaining, tf.zeros_like(remaining))
    stats = tf.stack([selection.stats[0], tf.cast(tf.reduce_sum(tf.square(finite)), tf.float64), selection.stats[2]])
    return ops.ErrorFeedbackSelection(values, indices, remaining, stats, selection.profile)


def all_reduce_with_carry(context, values, carry):
    """SUM over replicas of float32 `values`, and of `carry` (float32 [m], or
    None) in the same all-reduce."""
    if context.num_replicas_in_sync == 1:
        return values, carry
    if carry is None:
        return context.all_reduce(tf.distribute.ReduceOp.SUM, values), None
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([values, carry], 0))
    values, summed_carry = tf.split(summed, [-1, int(carry.shape[0])])
    return values, summed_carry


def all_reduce_dense(context, tensors):
    """SUM over replicas of `tensors` (a list): one call per dtype (the
    strategy packs a call's tensors into one buffer, so they must share a
    dtype; float64 or float16 variables beside the float32 count)."""
    tensors = list(tensors)
    if context.num_replicas_in_sync == 1:
        return tensors
    by_dtype = {}
    for position, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(position)
    summed = [None] * len(tensors)
    for positions in by_dtype.values():
        # Each tensor object once: one given twice in a call (a gradient tensor made outside
        # strategy.run, applied to two variables) fails in TensorFlow's collective ("IndexError: tuple
        # index out of range"). Across replicas such a tensor is one value, which TensorFlow's
        # all-reduce does not multiply by the replicas, as for Keras's own optimizers.
        unique = list({id(tensors[p]): tensors[p] for p in positions}.values())
        reduced = dict(zip(map(id, unique), context.all_reduce(tf.distribute.ReduceOp.SUM, unique)))
        for position in positions:
            summed[position] = reduced[id(tensors[position])]
    return summed
