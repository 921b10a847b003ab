"""Agreed indices: every replica sums its values at the leader's indices, by all-reduce only."""

import tensorflow as tf

from tf_topk.routes.base import Route, all_reduce_with_carry, ring_all_reduce_bytes, split_dense, split_pairs, taken_out
from tf_topk.routes.dense import DenseRoute


class AgreedIndexRoute(Route):
    """All replicas sum their values at ONE agreed index set, by ring all-reduce.

    ScaleCom's cyclic local top-k (Chen et al., NeurIPS 2020): at step t the
    leader replica t mod P selects its top-k, the indices reach every replica
    in one all-reduce of an int32 buffer that is zero except on the leader
    (index + 1; 0 marks a spare slot), and every replica then sends its own
    accumulated values at those indices through a second all-reduce. Each
    all-reduce moves 2(P-1)/P * 4k bytes per worker, so the total,
    16k(P-1)/P, stays below 16k as P grows, where an all_gather of the pairs
    moves (P-1) * 8k. A ring broadcast would halve the agreement, but
    tf.distribute's replica context offers none; an all_gather of the
    leader's indices alone would pad every replica's part to k and grow with
    P again; and only all-reduces ride NCCL on GPUs. Error feedback stays
    exact: a replica keeps in its residual everything but what it
    contributed at the agreed indices. A spare slot (the leader had fewer
    than k non-zero entries) is value 0 at its own variable's index 0, so
    pairs never point outside their variable.

    agreement: how the k indices are chosen.
      "nominated" (the default): slot j of each variable's k belongs to
        replica j mod P, which puts there its own (j // P)-th largest
        candidate, so every replica's top k/P entries are sent; an index two
        replicas nominate is sent once (the later slot becomes spare). Same
        collectives and bytes as "leader". It aims where ARC-Top-K (sketching
        the sum of the replicas' top entries) aims, without a sketch: at 4
        replicas and density 0.001 ScaleCom's leader rule sent a smaller share
        of each replica's accumulated energy than all_gather and lost accuracy
        (measured: benchmarks/RESULTS.md#agreed-indices-at-4-replicas-accuracy-against-all_gather-convergence---replicas-4).
      "leader": ScaleCom's rule, the leader's top-k for everyone.
    slots: agreed indices per variable as a multiple of its k (an int >= 1).
      Agreed indices update at most `slots` * k distinct entries a step where
      all_gather updates up to P * k; more slots send more of each replica's
      accumulated energy for 16 * slots * k * (P-1)/P bytes per worker, still
      flat in P (benchmarks/history/2026-11-24-agreed-index-remedies.md, "Remedy 3").
    """

    name, code = "allreduce", 2.0
    AGREEMENTS = ("nominated", "leader")

    def __init__(self, agreement="nominated", slots=1):
        if agreement not in self.AGREEMENTS:
            raise ValueError(f"agreement must be one of {self.AGREEMENTS}, got {agreement!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1 (agreed indices per variable, as a multiple of k), "
                             f"got {slots!r}")
        self.agreement = agreement
        self.slots = slots

    @property
    def uses_leader(self):
        return self.agreement == "leader"

    def select(self, bucket, accumulate, selector, context, leader):
        everything = [accumulate(i, 0) for i in range(len(bucket.ks))]
        taken = self._agree([s.remaining for s in everything], bucket, selector, context, leader)
        return [taken_out(s, s.remaining, values, indices) for s, (values, indices) in zip(everything, taken)]

    def _local(self, accumulated, bucket, selector):
        """This replica's candidates: (values, indices) per member, `slots` * k of them."""
        return [tuple(selector.select(a, self.slot_count(k, a))) for a, k in zip(accumulated, bucket.ks)]

    def slot_count(self, k, accumulated):
        """The agreed slots of a variable with `k` (int or int32 tensor) pairs."""
        if self.slots == 1:
            return k
        if isinstance(k, int):
            return min(self.slots * k, int(accumulated.shape[0]))
        return tf.minimum(self.slots * k, tf.size(accumulated, out_type=k.dtype))

    def _agreement(self, context, candidates, valid, leader, bucket):
        """The agreed indices on every replica, and where they are real."""
        if self.agreement == "leader":
            return agree_indices(context, candidates, valid, leader)
        return share_indices(context, candidates, valid)

    def _candidates(self, local, bucket, context):
        """What this replica offers for the agreement: (bucket indices, valid)."""
        if self.agreement == "nominated":
            local = [nominations(context, v, i) for v, i in local]
            return (tf.concat([i + offset for (i, _), offset in zip(local, bucket.offsets)], 0),
                    tf.concat([ok for _, ok in local], 0))
        return (tf.concat([i + offset for (_, i), offset in zip(local, bucket.offsets)], 0),
                tf.concat([tf.not_equal(v, 0) for v, _ in local], 0))

    def _agree(self, accumulated, bucket, selector, context, leader):
        """Per member, this replica's (values, indices) at the agreed indices."""
        local = self._local(accumulated, bucket, selector)
        candidates, valid = self._candidates(local, bucket, context)
        agreed, agreed_valid = self._agreement(context, candidates, valid, leader, bucket)
        lengths = tf.stack([tf.size(i) for _, i in local])
        selected = []
        for a, offset, piece, piece_valid in zip(accumulated, bucket.offsets, tf.split(agreed, lengths),
                                                 tf.split(agreed_valid, lengths)):
            indices = tf.where(piece_valid, piece - offset, 0)
            selected.append((tf.where(piece_valid, tf.gather(a, indices), tf.zeros([], a.dtype)), indices))
        return selected

    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        summed, summed_carry = all_reduce_with_carry(context, values, carry)
        if sparse_output:  # one row: already summed
            return split_pairs(bucket, lengths, tf.expand_dims(summed, 0), tf.expand_dims(indices, 0)), summed_carry
        dense = tf.scatter_nd(tf.expand_dims(indices, 1), summed, tf.constant([bucket.size], tf.int32))
        return split_dense(bucket, dense), summed_carry

    def bytes(self, pairs, entries, replicas):
        """`pairs`: the slots sent (`slots` * k)."""
        return 2.0 * ring_all_reduce_bytes(4.0 * pairs, replicas)

    def bytes_for_k(self, k, entries, replicas):
        """Bytes a worker sends for a bucket whose variables select `k` pairs."""
        return self.bytes(self.slots * k, entries, replicas)

    def __repr__(self):
        return f"{type(self).__name__}(agreement={self.agreement!r}, slots={self.slots})"


class AgreedOrDenseRoute(AgreedIndexRoute):
    """Agreed indices, or every entry where `dense_when` (a bool tensor) holds:
    the run-time switch of "auto" when k is a tensor (a scheduled density
    that can reach the side where the dense all-reduce sends fewer bytes).
    Dense steps send every entry through the same value all-reduce (no index
    travels), so nothing is lost either way."""

    def __init__(self, dense_when, agreement="nominated", slots=1):
        super().__init__(agreement, slots)
        self.dense_when = dense_when

    @property
    def code(self):
        return tf.where(self.dense_when, DenseRoute.code, AgreedIndexRoute.code)

    def _local(self, accumulated, bucket, selector):
        return [tf.cond(self.dense_when, lambda a=a: (a, tf.range(tf.size(a, out_type=tf.int32))),
                        lambda a=a, k=k: tuple(selector.select(a, self.slot_count(k, a))))
                for a, k in zip(accumulated, bucket.ks)]

    def _candidates(self, local, bucket, context):
        # Dense steps agree on nothing (no index travels), then take every entry.
        return tf.cond(self.dense_when, lambda: (tf.zeros([0], tf.int32), tf.zeros([0], tf.bool)),
                       lambda: AgreedIndexRoute._candidates(self, local, bucket, context))

    def _agreement(self, context, candidates, valid, leader, bucket):
        agreed, agreed_valid = super()._agreement(context, candidates, valid, leader, bucket)
        whole = tf.range(bucket.size, dtype=tf.int32)
        return (tf.cond(self.dense_when, lambda: whole, lambda: agreed),
                tf.cond(self.dense_when, lambda: tf.ones_like(whole, tf.bool), lambda: agreed_valid))

    def bytes(self, pairs, entries, replicas):
        return tf.where(self.dense_when, DenseRoute().bytes(pairs, entries, replicas),
                        super().bytes(pairs, entries, replicas))

    def __repr__(self):
        return (f"AgreedOrDenseRoute(dense_when={self.dense_when!r}, agreement={self.agreement!r}, "
                f"slots={self.slots})")


def agree_indices(context, indices, valid, leader):
    """The leader's `indices` (int32 [K]) on every replica, and where they
    are real (its `valid`, bool [K]); spare slots come back as index 0."""
    is_leader = tf.equal(tf.cast(context.replica_id_in_sync_group, tf.int32), tf.cast(leader, tf.int32))
    return share_indices(context, indices, tf.logical_and(valid, is_leader))


def nominations(context, values, indices):
    """This replica's nominations among one variable's k slots.

    Slot j belongs to replica j mod P, which puts there its (j // P)-th
    largest candidate, so each replica names its own top k/P (or one more).
    Returns (indices, valid) for `share_indices`; slots of other replicas
    are not valid here.
    """
    replicas = context.num_replicas_in_sync
    order = tf.argsort(tf.abs(values), direction="DESCENDING", stable=True)
    slots = tf.range(tf.size(values, out_type=tf.int32))
    rank = tf.gather(order, slots // replicas)
    mine = tf.equal(slots % replicas, tf.cast(context.replica_id_in_sync_group, tf.int32))
    return tf.gather(indices, rank), tf.logical_and(mine, tf.not_equal(tf.gather(values, rank), 0))


def share_indices(context, indices, valid):
    """Every replica's valid `indices` (int32 [K]; each slot valid on at most
    one replica) on every replica, by one all-reduce of index + 1 (0 marks a
    spare slot). An index shared in two slots is kept at the first only, so
    no value is summed twice. Returns (indices, real); spare slots are 0."""
    if context.num_replicas_in_sync == 1:
        return tf.where(valid, indices, 0), valid
    code = tf.where(valid, indices + 1, 0)
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, code)
    slots = tf.range(tf.size(summed, out_type=tf.int32))
    unique, position = tf.unique(summed)
    first = tf.math.unsorted_segment_min(slots, position, tf.size(unique))
    kept = tf.logical_and(summed > 0, tf.equal(tf.gather(first, position), slots))
    return tf.where(kept, summed - 1, 0), kept
