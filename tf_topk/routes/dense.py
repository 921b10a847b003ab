"""The dense all-reduce of a whole bucket, residuals flushed into it."""

import tensorflow as tf

from tf_topk.routes.base import Route, all_reduce_with_carry, ring_all_reduce_bytes, split_dense, taken_out


class DenseRoute(Route):
    """Every entry of gradient + residual, summed by one ring all-reduce:
    2(P-1)/P * 4n bytes per worker. The residuals are sent in full (they
    become zero), so nothing is lost when a bucket goes dense (a warm-up
    density, or "auto" where sparse would send more). With `sparse_output`
    the members still come back dense: every entry was sent."""

    name, code = "dense", 0.0

    def select(self, bucket, accumulate, selector, context, leader):
        everything = [accumulate(i, 0) for i in range(len(bucket.ks))]
        return [taken_out(s, s.remaining, s.remaining, tf.range(size, dtype=tf.int32))
                for s, size in zip(everything, bucket.sizes)]

    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        summed, summed_carry = all_reduce_with_carry(context, values, carry)  # in bucket order: no index needed
        return split_dense(bucket, summed), summed_carry

    def bytes(self, pairs, entries, replicas):
        return ring_all_reduce_bytes(4.0 * entries, replicas)

