"""Communicators: how the replicas' selected pairs become the summed gradient.

A communicator is one of the exchange's three parts (selector, memory,
communicator). It owns the collectives: the packed dense all-reduce (small
variables and the non-finite flag, one call per step) and the exchange of
one bucket of (value, index) pairs, which must return the same dense sum on
every replica. It also says how many bytes a worker sends for that, since
that depends on the collectives it uses. `AllGatherCommunicator` gathers
every replica's own pairs; `AgreedIndexCommunicator` also sums values at
indices all replicas agreed on, with all-reduces only, and `choose_mode`
picks per bucket from the volume formulas (`mode_bytes`).

Values travel as float32 whatever the variable's dtype: float64 variables
keep float64 residuals and a float64 dense path, but their selected entries
are rounded to float32 on the wire.
"""

import tensorflow as tf


def ring_all_reduce_bytes(num_bytes, replicas):
    """Bytes each worker sends in a ring all-reduce of `num_bytes`."""
    return 2.0 * (replicas - 1) / replicas * num_bytes if replicas > 1 else 0.0


def gather_bytes(entries, replicas):
    """Bytes each worker sends in an all_gather of `entries` float32 entries per replica."""
    return (replicas - 1) * 4.0 * entries


# What one more collective per step is worth in bytes: its latency (rounds of
# messages between workers, about half a millisecond) at 1 Gbit/s.
DENSE_CARRY_BYTES = 64 * 1024


def carry_in_gather(entries, replicas):
    """Whether an all_gather should carry `entries` float32 dense entries
    (summed after it) instead of a separate all-reduce of them: gathering
    sends (P-1) * 4m bytes where the ring all-reduce sends 2(P-1)/P * 4m, so
    the same at P = 2 and more above; worth it while the extra bytes stay
    within DENSE_CARRY_BYTES."""
    return gather_bytes(entries, replicas) - ring_all_reduce_bytes(4.0 * entries, replicas) <= DENSE_CARRY_BYTES


class AllGatherCommunicator:
    """One `all_gather` per bucket of pairs; densified one replica at a time.

    The bucket's values and bit-cast indices (and, when the exchange asks,
    the dense-path gradients with the non-finite count) travel in one float32
    buffer. Every replica densifies the gathered pairs with one scatter per
    replica, in replica order: within one replica's pairs the indices are
    distinct (spare slots add 0), so no scatter sums repeated indices, and
    every replica computes bitwise the same sum on any device (a single
    scatter of all pairs would sum repeated indices by atomics on GPUs, in no
    fixed order, and mirrored weights would drift apart).
    """

    def all_reduce_dense(self, context, tensors):
        """SUM over replicas of `tensors` (a list): one call per dtype (the
        strategy packs a call's tensors into one buffer, so they must share
        a dtype; float64 or float16 variables beside the float32 count)."""
        tensors = list(tensors)
        if context.num_replicas_in_sync == 1:
            return tensors
        by_dtype = {}
        for position, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(position)
        summed = [None] * len(tensors)
        for positions in by_dtype.values():
            for position, value in zip(positions, context.all_reduce(tf.distribute.ReduceOp.SUM,
                                                                     [tensors[p] for p in positions])):
                summed[position] = value
        return summed

    def exchange_pairs(self, context, values, indices, size, carry=None, densify=True):
        """The dense float32 [size] sum over replicas of scatter(values,
        indices) (with densify=False: every replica's pairs, values and
        indices of shape [P, K]), and the sum over replicas of `carry`
        (float32 [m], or None), summed in replica order in the same
        all_gather."""
        replicas = context.num_replicas_in_sync
        shape = tf.reshape(tf.constant(size, tf.int32), [1])
        if replicas == 1:
            if not densify:
                return (tf.expand_dims(values, 0), tf.expand_dims(indices, 0)), carry
            return tf.scatter_nd(tf.expand_dims(indices, 1), values, shape), carry
        parts = [values, tf.bitcast(indices, tf.float32)] + ([] if carry is None else [carry])
        rows = tf.reshape(context.all_gather(tf.concat(parts, 0), axis=0), [replicas, -1])
        k = tf.size(values)
        if densify:
            all_indices = tf.bitcast(rows[:, k:2 * k], tf.int32)
            dense = tf.scatter_nd(tf.expand_dims(all_indices[0], 1), rows[0, :k], shape)
            for replica in range(1, replicas):
                dense = tf.tensor_scatter_nd_add(dense, tf.expand_dims(all_indices[replica], 1), rows[replica, :k])
        else:
            dense = rows[:, :k], tf.bitcast(rows[:, k:2 * k], tf.int32)
        if carry is None:
            return dense, None
        summed = rows[0, 2 * k:]
        for replica in range(1, replicas):
            summed = summed + rows[replica, 2 * k:]
        return dense, summed

    def __repr__(self):
        return "AllGatherCommunicator()"


# -- volumes and the choice of exchange -------------------------------------------------------

MODES = ("dense", "allgather", "allreduce")
MODE_CODES = {mode: float(code) for code, mode in enumerate(MODES)}  # the "exchange_mode" statistic


def mode_bytes(mode, pairs, entries, replicas):
    """Bytes a worker sends per step to exchange one bucket of `entries`
    entries with `pairs` selected (value, index) pairs, in `mode`:

      dense:     ring all-reduce of every entry        2(P-1)/P * 4n
      allgather: its pairs to every other replica      (P-1) * 8k
      allreduce: ring all-reduce of k agreed indices,
                 then of the k values there            2 * 2(P-1)/P * 4k

    allreduce stays below 16k whatever P; allgather grows with P.
    """
    if mode == "dense":
        return ring_all_reduce_bytes(4.0 * entries, replicas)
    if mode == "allgather":
        return (replicas - 1) * 8.0 * pairs
    if mode == "allreduce":
        return 2.0 * ring_all_reduce_bytes(4.0 * pairs, replicas)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def choose_mode(replicas, pairs, entries, modes=MODES):
    """The mode among `modes` that sends the fewest bytes (ties: the earlier
    of allgather, allreduce, dense: each replica's own top-k is the better
    selection, and the sparse modes keep residuals)."""
    order = [m for m in ("allgather", "allreduce", "dense") if m in modes]
    if not order:
        raise ValueError(f"modes must hold at least one of {MODES}, got {modes!r}")
    return min(order, key=lambda m: mode_bytes(m, pairs, entries, replicas))


class AgreedIndexCommunicator(AllGatherCommunicator):
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
    leader's indices alone would pad every replica's part to k and grow
    with P again; and only all-reduces ride NCCL on GPUs. Error feedback stays exact: a
    replica keeps in its residual everything but what it contributed at the
    agreed indices.

    Also does everything AllGatherCommunicator does, so the exchange's
    "auto" mode can choose per bucket.
    """

    def agree_indices(self, context, indices, valid, leader):
        """The leader's `indices` (int32 [K]) on every replica, and where they
        are real (its `valid`, bool [K]); spare slots come back as index 0."""
        if context.num_replicas_in_sync == 1:
            return tf.where(valid, indices, 0), valid
        is_leader = tf.equal(tf.cast(context.replica_id_in_sync_group, tf.int32), tf.cast(leader, tf.int32))
        code = tf.where(tf.logical_and(is_leader, valid), indices + 1, 0)
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, code)
        return tf.maximum(summed - 1, 0), summed > 0

    def sum_values(self, context, values, indices, size, carry=None, densify=True):
        """The dense float32 [size] scatter of the SUM over replicas of
        `values` (float32 [K]), all taken at the same `indices` (None: all
        entries, in order; with densify=False and indices: the summed values
        and the indices, each of shape [1, K]), and the SUM of `carry`
        (float32 [m], or None) from the same all-reduce."""
        summed_carry = carry
        if context.num_replicas_in_sync > 1:
            if carry is None:
                values = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
            else:
                summed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([values, carry], 0))
                values, summed_carry = tf.split(summed, [-1, int(carry.shape[0])])
        if indices is None:
            return values, summed_carry
        if not densify:
            return (tf.expand_dims(values, 0), tf.expand_dims(indices, 0)), summed_carry
        return (tf.scatter_nd(tf.expand_dims(indices, 1), values, tf.reshape(tf.constant(size, tf.int32), [1])),
                summed_carry)

    def __repr__(self):
        return "AgreedIndexCommunicator()"
