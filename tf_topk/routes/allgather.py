"""All_gather of pairs: each replica's own top-k to every replica, densified in replica order."""

import tensorflow as tf

from tf_topk.gather import all_gather_rows
from tf_topk.routes.base import Route, gather_bytes, split_dense, split_pairs


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
        replicas = context.num_replicas_in_sync
        if replicas == 1:
            rows_values, rows_indices, summed_carry = tf.expand_dims(values, 0), tf.expand_dims(indices, 0), carry
        else:
            parts = [values, tf.bitcast(indices, tf.float32)] + ([] if carry is None else [carry])
            rows = tf.reshape(all_gather_rows(context, tf.concat(parts, 0)), [replicas, -1])
            k = tf.size(values)
            rows_values, rows_indices = rows[:, :k], tf.bitcast(rows[:, k:2 * k], tf.int32)
            summed_carry = None
            if carry is not None:
                summed_carry = rows[0, 2 * k:]
                for replica in range(1, replicas):
                    summed_carry = summed_carry + rows[replica, 2 * k:]
        if sparse_output:
            return split_pairs(bucket, lengths, rows_values, rows_indices), summed_carry
        shape = tf.constant([bucket.size], tf.int32)
        dense = tf.scatter_nd(tf.expand_dims(rows_indices[0], 1), rows_values[0], shape)
        for replica in range(1, replicas):
            dense = tf.tensor_scatter_nd_add(dense, tf.expand_dims(rows_indices[replica], 1), rows_values[replica])
        return split_dense(bucket, dense), summed_carry

    def bytes(self, pairs, entries, replicas):
        return (replicas - 1) * 8.0 * pairs

    def carry_bytes(self, entries, replicas):
        """Gathered, not reduced: (P-1) * 4m, the same as a ring all-reduce at
        P = 2 and more above."""
        return gather_bytes(entries, replicas)

