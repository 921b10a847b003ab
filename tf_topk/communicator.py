"""Communicators: how the replicas' selected pairs become the summed gradient.

A communicator is one of the exchange's three parts (selector, memory,
communicator). It owns the collectives: the packed dense all-reduce (small
variables and the non-finite flag, one call per step) and the exchange of
one bucket of (value, index) pairs, which must return the same dense sum on
every replica. It also says how many bytes a worker sends for that, since
that depends on the collectives it uses.

Values travel as float32 whatever the variable's dtype: float64 variables
keep float64 residuals and a float64 dense path, but their selected entries
are rounded to float32 on the wire.
"""

import tensorflow as tf


def ring_all_reduce_bytes(num_bytes, replicas):
    """Bytes each worker sends in a ring all-reduce of `num_bytes`."""
    return 2.0 * (replicas - 1) / replicas * num_bytes if replicas > 1 else 0.0


class AllGatherCommunicator:
    """One `all_gather` per bucket of pairs; densified replica by replica.

    The bucket's values and bit-cast indices travel in one float32 buffer.
    Every replica scatter-adds the gathered pairs replica by replica, in
    replica order: within one replica's pairs the indices are distinct (spare
    slots add 0), so each scatter-add is order-free and every replica
    computes bitwise the same sum.
    """

    def all_reduce_dense(self, context, tensors):
        """SUM over replicas of `tensors` (a list), packed into one call."""
        if context.num_replicas_in_sync == 1:
            return list(tensors)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors))

    def exchange_pairs(self, context, values, indices, size):
        """The dense float32 [size] sum over replicas of scatter(values, indices)."""
        dense = tf.zeros([size], tf.float32)
        replicas = context.num_replicas_in_sync
        if replicas == 1:
            return tf.tensor_scatter_nd_add(dense, tf.expand_dims(indices, 1), values)
        buffer = tf.concat([values, tf.bitcast(indices, tf.float32)], 0)
        gathered = tf.reshape(context.all_gather(buffer, axis=0), [replicas, 2, -1])
        for replica in range(replicas):
            replica_indices = tf.bitcast(gathered[replica, 1], tf.int32)
            dense = tf.tensor_scatter_nd_add(dense, tf.expand_dims(replica_indices, 1), gathered[replica, 0])
        return dense

    def bytes_sent(self, pairs, dense_entries, replicas):
        """Bytes a worker sends per step: its pairs to every other replica,
        plus the ring all-reduce of the dense float32 entries."""
        return (replicas - 1) * 8.0 * pairs + ring_all_reduce_bytes(4.0 * dense_entries, replicas)

    def __repr__(self):
        return "AllGatherCommunicator()"
