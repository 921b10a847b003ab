"""All_gather of pairs packed in one 32-bit word each: an 8-bit value beside a 24-bit index.

Why: at a low density the pairs are all a sparse route sends, and float32 values beside int32 indices
spend 8 bytes a pair. An index into a bucket of at most 2**24 entries needs 24 bits and a value
rounded to 8 bits keeps what error feedback needs (the rounding error stays in the residual, as
what was not sent does), so one word carries a pair: the same bytes send twice the pairs
(SparseLoCo and DeMo quantize their values for the same reason).

A member's values are rounded to integers c in [-127, 127] times a step that is a power of two,
2**e, the smallest for which its largest magnitude is at most 127 steps; e (one int32 word per
member) travels beside the words. The step being a power of two makes the rounding its own fixed
point: values already on the grid give back the same e and c, so the words can be rebuilt in `send`
from the values `select` rounded, and every replica decodes exactly what the sender took out of its
residual.
"""

import tensorflow as tf

from tf_topk.routes.allgather import AllGatherRoute, _gather, gathered_gradients
from tf_topk.routes.base import taken_out

INDEX_BITS = 24
MAX_BUCKET_ENTRIES = 1 << INDEX_BITS
LEVELS = 127  # |c| at most: 8 bits, two's complement, -128 unused (symmetric)
MIN_EXPONENT = -149  # float32's smallest subnormal is 2**-149


def value_exponent(values):
    """e (int32 scalar) of the grid 2**e for float32 `values`: the smallest with max |finite value|
    <= 127 * 2**e (0 for an empty or all-zero tensor)."""
    finite = tf.where(tf.math.is_finite(values), tf.abs(values), tf.zeros_like(values))
    largest = tf.cast(tf.reduce_max(tf.concat([finite, [0.0]], 0)), tf.float64)
    # log2 rounds; the two corrections make e exact (127 * 2**e is exact in float64).
    guess = tf.math.ceil(tf.math.log(tf.maximum(largest, 1e-300) / LEVELS) / tf.math.log(tf.constant(2.0, tf.float64)))
    guess = tf.where(largest > LEVELS * tf.pow(tf.constant(2.0, tf.float64), guess), guess + 1, guess)
    guess = tf.where(largest <= LEVELS * tf.pow(tf.constant(2.0, tf.float64), guess - 1), guess - 1, guess)
    # Below 2**-149 the grid would be finer than float32's: its smallest step is float32's smallest.
    return tf.where(largest > 0, tf.maximum(tf.cast(guess, tf.int32), MIN_EXPONENT), 0)


def value_codes(values, exponent):
    """The integers c = round(values / 2**exponent) in [-127, 127] (int32; non-finite values 0)."""
    step = tf.pow(tf.constant(2.0, tf.float64), tf.cast(exponent, tf.float64))
    finite = tf.math.is_finite(values)
    scaled = tf.math.round(tf.cast(tf.where(finite, values, tf.zeros_like(values)), tf.float64) / step)
    return tf.cast(tf.clip_by_value(scaled, -LEVELS, LEVELS), tf.int32)


def decoded(codes, exponent):
    """codes * 2**exponent in float32 (exact: 8 significant bits)."""
    step = tf.pow(tf.constant(2.0, tf.float64), tf.cast(exponent, tf.float64))
    return tf.cast(tf.cast(codes, tf.float64) * step, tf.float32)


def rounded_to_grid(values):
    """`values` on their own grid, in their dtype: what a replica sends of them. Non-finite values stay
    as they are (the step is then skipped on every replica)."""
    exponent = value_exponent(values)
    on_grid = tf.cast(decoded(value_codes(values, exponent), exponent), values.dtype)
    return tf.where(tf.math.is_finite(values), on_grid, values)


def pack(indices, codes):
    """One float32-typed word per pair: index << 8 | (c mod 256), bit-cast (never read as a float)."""
    words = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.cast(indices, tf.uint32), 8),
                                  tf.cast(tf.bitwise.bitwise_and(codes, 0xFF), tf.uint32))
    return tf.bitcast(words, tf.float32)


def unpack(words):
    """(indices int32, codes int32 in [-128, 127]) of `pack`'s words."""
    words = tf.bitcast(words, tf.uint32)
    indices = tf.cast(tf.bitwise.right_shift(words, 8), tf.int32)
    low = tf.cast(tf.bitwise.bitwise_and(words, 0xFF), tf.int32)
    return indices, tf.where(low > LEVELS, low - 256, low)


class Int8AllGatherRoute(AllGatherRoute):
    """One `all_gather` per bucket of 4-byte pairs: (P-1) * (4k + 4 * members) bytes per worker, half of
    `AllGatherRoute`'s 8k, so a density twice as high sends the same bytes.

    Each replica's selection is rounded to its 8-bit grid before it leaves (`select`), and the rounding
    error goes back into that replica's residual: nothing a replica computed is lost, as with the
    entries it did not send. The sum is the same replica-ordered scatter as all_gather's, of the
    decoded values, so every replica computes bitwise the same sum. A bucket may hold at most 2**24
    entries (24 bits of index): lower `bucket_bytes` for larger ones; a single larger variable cannot
    take this route.

    >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.002, exchange_mode="allgather_int8")
    """

    name, code = "allgather_int8", 4.0

    def select(self, bucket, accumulate, selector, context, leader):
        _check_bucket(bucket)
        selections = super().select(bucket, accumulate, selector, context, leader)
        return [_rounded(selection) for selection in selections]

    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        _check_bucket(bucket)
        members = len(lengths)
        exponents, codes = [], []
        for member_values in tf.split(values, tf.stack(lengths), num=members):
            exponent = value_exponent(member_values)
            exponents.append(exponent)
            codes.append(value_codes(member_values, exponent))
        buffer = tf.concat([pack(indices, tf.concat(codes, 0)), tf.bitcast(tf.stack(exponents), tf.float32)], 0)
        rows, summed_carry = _gather(context, buffer, carry)
        k = tf.size(values)
        rows_indices, rows_codes = unpack(rows[:, :k])
        rows_exponents = tf.bitcast(rows[:, k:k + members], tf.int32)  # [replicas, members]
        member_of = tf.repeat(tf.range(members), tf.stack(lengths))  # the same layout on every replica
        rows_values = decoded(rows_codes, tf.gather(rows_exponents, member_of, axis=1))
        return gathered_gradients(bucket, lengths, rows_values, rows_indices, sparse_output), summed_carry

    def bytes(self, pairs, entries, replicas):
        return (replicas - 1) * 4.0 * pairs

    def bucket_overhead_bytes(self, bucket, replicas):
        """Each member's exponent word."""
        return (replicas - 1) * 4.0 * len(bucket.sizes)


def _rounded(selection):
    """`selection` sending its values on their 8-bit grid, the rounding error kept in `remaining`. A
    value that rounds to 0 is not sent (kept whole) and its slot becomes a spare one (index 0)."""
    on_grid = rounded_to_grid(selection.values)
    accumulated = tf.tensor_scatter_nd_add(selection.remaining, tf.expand_dims(selection.indices, 1),
                                           tf.cast(selection.values, selection.remaining.dtype))
    return taken_out(selection, accumulated, on_grid, tf.where(tf.equal(on_grid, 0), 0, selection.indices))


def _check_bucket(bucket):
    if bucket.size > MAX_BUCKET_ENTRIES:
        raise ValueError(f"exchange_mode='allgather_int8' packs an index in {INDEX_BITS} bits, so a bucket holds at "
                         f"most {MAX_BUCKET_ENTRIES:,} entries; this one holds {bucket.size:,} (variables of "
                         f"{list(bucket.sizes)} entries): lower bucket_bytes, or take exchange_mode='allgather' "
                         f"for a variable of more entries")
