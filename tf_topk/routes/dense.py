"""The dense all-reduce of a whole bucket (float32, or bfloat16), residuals flushed into it."""

import math

import tensorflow as tf

from tf_topk import ops
from tf_topk.routes.base import Route, all_reduce_with_carry, ring_all_reduce_bytes, split_dense


class DenseRoute(Route):
    """Every entry of gradient + residual, summed by one ring all-reduce:
    2(P-1)/P * 4n bytes per worker. The residuals are sent in full (they
    become zero), so nothing is lost when a bucket goes dense (a warm-up
    density, or "auto" where sparse would send more). With `sparse_output`
    the members still come back dense: every entry was sent."""

    name, code = "dense", 0.0

    def select(self, bucket, accumulate, selector, context, leader):
        everything = [accumulate(i, 0) for i in range(len(bucket.ks))]
        return [send_all(s, self._sent(s.remaining), size) for s, size in zip(everything, bucket.sizes)]

    def _sent(self, accumulated):
        """What a replica contributes of `accumulated`: all of it."""
        return accumulated

    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        summed, summed_carry = all_reduce_with_carry(context, values, carry)  # in bucket order: no index needed
        return split_dense(bucket, summed), summed_carry

    def bytes(self, pairs, entries, replicas):
        return ring_all_reduce_bytes(4.0 * entries, replicas)


class Bfloat16DenseRoute(DenseRoute):
    """Every entry of gradient + residual rounded to bfloat16 and summed by one
    ring all-reduce in bfloat16: 2(P-1)/P * 2n bytes per worker, half the
    dense route's. What a practitioner tries before any sparsification
    (Agarwal et al., MLSys 2022, compare every compression scheme with it).

    The rounding error of each replica's contribution stays in its residual
    (the step sends round(g + r) and keeps g + r - round(g + r)), so nothing
    a replica computed is lost, only delayed, as with top-k; what the ring
    loses summing in bfloat16 is not kept. The dense-path gradients and the
    step's scalars never ride in its buffer (they would be rounded too): they
    take their own float32 all-reduce.

    >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), exchange_mode="dense_bf16")
    """

    name, code = "dense_bf16", 3.0

    def _sent(self, accumulated):
        """`accumulated` rounded to the nearest bfloat16 (in float32; non-finite
        entries stay as they are: the step is then skipped)."""
        return tf.cast(tf.cast(accumulated, tf.bfloat16), accumulated.dtype)

    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        if carry is not None:
            raise ValueError("Bfloat16DenseRoute cannot carry float32 entries")
        halves = tf.cast(values, tf.bfloat16)
        if context.num_replicas_in_sync > 1:
            halves = context.all_reduce(tf.distribute.ReduceOp.SUM, halves)
        return split_dense(bucket, tf.cast(halves, tf.float32)), None

    def bytes(self, pairs, entries, replicas):
        return ring_all_reduce_bytes(2.0 * entries, replicas)

    def extra_carry_bytes(self, entries, replicas):
        return math.inf



def send_all(selection, sent, size):
    """`selection` (of k = 0: gradient + residual in `remaining`) turned into
    sending `sent` at every index, what is not sent (nothing, or the rounding
    error) remaining. Elementwise, no scatter."""
    remaining = selection.remaining - sent
    finite = tf.where(tf.math.is_finite(remaining), remaining, tf.zeros_like(remaining))
    stats = tf.stack([selection.stats[0], tf.cast(tf.reduce_sum(tf.square(finite)), tf.float64), selection.stats[2]])
    return ops.ErrorFeedbackSelection(sent, tf.range(size, dtype=tf.int32), remaining, stats, selection.profile)
