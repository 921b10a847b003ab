"""All_gather of pairs: each replica's own top-k to every replica, densified in replica order."""

import tensorflow as tf

from tf_topk.gather import all_gather_rows
from tf_topk.routes.base import Route, gather_bytes, split_dense, split_pairs
from tf_topk.routes.dense import DenseRoute, send_all


class AllGatherRoute(Route):
    """One `all_gather` per bucket: (P-1) * 8k bytes per worker, growing with P.

    Every replica's buffer has the same length (k, the carry), so the gather
    skips TensorFlow's exchange of shapes (`tf_topk.gather`): one collective.

    The bucket's values and bit-cast indices (and the carried dense-path
    gradients with the non-finite count) travel in one float32 buffer. Every
    replica densifies the gathered pairs with one scatter per replica, in
    replica order: within one replica's pairs the indices are distinct
    (spare slots add 0), so no scatter sums repeated indices, and every
    replica computes bitwise the same sum on any device (a single scatter of
    all pairs would sum repeated indices by atomics on GPUs, in no fixed
    order, and mirrored weights would drift apart). With `sparse_output`
    each member gets one row of pairs per replica.
    """

    name, code = "allgather", 1.0

    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        rows, summed_carry = _gather(context, tf.concat([values, tf.bitcast(indices, tf.float32)], 0), carry)
        k = tf.size(values)
        return gathered_gradients(bucket, lengths, rows[:, :k], tf.bitcast(rows[:, k:], tf.int32),
                                  sparse_output), summed_carry

    def bytes(self, pairs, entries, replicas):
        return (replicas - 1) * 8.0 * pairs

    def carry_bytes(self, entries, replicas):
        """Gathered, not reduced: (P-1) * 4m, the same as a ring all-reduce at
        P = 2 and more above."""
        return gather_bytes(entries, replicas)


class AllGatherOrDenseRoute(AllGatherRoute):
    """All_gather of pairs, or, on the steps where `dense_when` (a bool
    tensor, the same on every replica) holds, every entry's value in bucket
    order through the same gather, summed in replica order: a memory's dense
    steps (Adam's warm-up) ahead of the all_gather that "auto" takes at the
    memory's density, as for any memory. One collective either way, since a
    collective may not sit in a branch of a replica context; on dense steps
    it sends (P-1) * 4n bytes, P/2 times the dense all-reduce's, at the
    replica counts where "auto" gathers. No `sparse_output`: a dense step
    returns every entry."""

    def __init__(self, dense_when):
        self.dense_when = dense_when

    @property
    def code(self):
        return tf.where(self.dense_when, DenseRoute.code, AllGatherRoute.code)

    def select(self, bucket, accumulate, selector, context, leader):
        def every_entry(i, size):  # as the dense route selects
            accumulated = accumulate(i, 0)
            return send_all(accumulated, accumulated.remaining, size)

        def member(i, k, size):
            return tf.cond(self.dense_when, lambda: every_entry(i, size), lambda: accumulate(i, k))

        return [member(i, k, size) for i, (k, size) in enumerate(zip(bucket.ks, bucket.sizes))]

    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        if sparse_output:
            raise ValueError("AllGatherOrDenseRoute returns dense gradients: sparse_output must be False")
        # Dense steps: the values alone, in bucket order (every replica sends all n).
        sent = tf.cond(self.dense_when, lambda: values, lambda: tf.concat([values, tf.bitcast(indices, tf.float32)], 0))
        rows, summed_carry = _gather(context, sent, carry)
        k = tf.size(values)
        summed = tf.cond(self.dense_when, lambda: _sum_in_replica_order(rows), lambda: _scatter_in_replica_order(
            rows[:, :k], tf.bitcast(rows[:, k:2 * k], tf.int32), bucket.size))
        return split_dense(bucket, summed), summed_carry

    def bytes(self, pairs, entries, replicas):
        return tf.where(self.dense_when, gather_bytes(entries, replicas), AllGatherRoute.bytes(self, pairs, entries,
                                                                                               replicas))

    def __repr__(self):
        return f"AllGatherOrDenseRoute(dense_when={self.dense_when!r})"


def gathered_gradients(bucket, lengths, rows_values, rows_indices, sparse_output):
    """Every replica's pairs (rows [replicas, K]) as the members' gradients: pairs per replica with
    `sparse_output`, else their sum densified in replica order."""
    if sparse_output:
        return split_pairs(bucket, lengths, rows_values, rows_indices)
    return split_dense(bucket, _scatter_in_replica_order(rows_values, rows_indices, bucket.size))


def _gather(context, buffer, carry):
    """Every replica's `buffer` (+ `carry`) as rows [replicas, len], and the
    carry summed over replicas in replica order (None without a carry)."""
    replicas = context.num_replicas_in_sync
    if replicas == 1:
        return tf.expand_dims(buffer, 0), carry
    parts = [buffer] + ([] if carry is None else [carry])
    rows = tf.reshape(all_gather_rows(context, tf.concat(parts, 0)), [replicas, -1])
    if carry is None:
        return rows, None
    width = tf.size(buffer)
    return rows[:, :width], _sum_in_replica_order(rows[:, width:])


def _sum_in_replica_order(rows):
    """The rows ([replicas, m]) summed one after another: bitwise the same on every replica."""
    summed = rows[0]
    for replica in range(1, rows.shape[0]):
        summed = summed + rows[replica]
    return summed


def _scatter_in_replica_order(rows_values, rows_indices, size):
    """The pairs of every row summed into a dense [size] tensor, one scatter
    per replica in replica order (bitwise the same on every replica)."""
    shape = tf.constant([size], tf.int32)
    dense = tf.scatter_nd(tf.expand_dims(rows_indices[0], 1), rows_values[0], shape)
    for replica in range(1, rows_values.shape[0]):
        dense = tf.tensor_scatter_nd_add(dense, tf.expand_dims(rows_indices[replica], 1), rows_values[replica])
    return dense
