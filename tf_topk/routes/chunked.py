"""All_gather of each chunk's largest entries in about 14 bits an entry: chunk-local indices and
low-bit values on a per-chunk grid (SparseLoCo's wire format, arXiv 2508.15706).

Why: at a low density the pairs are all a sparse route sends, and a float32 value beside an int32
index spends 64 bits where the entry's information is far less. Selecting the same number of
entries in every chunk of CHUNK (4,096) consecutive entries makes an index 12 bits local to its
chunk, the chunk itself known from the entry's slot; a value rounded to `value_bits` bits on its
chunk's grid keeps what error feedback needs, since the rounding error stays in the residual as
what was not sent does. The same bytes then carry four times the entries of 8-byte pairs.

The wire format of one bucket, per replica (no header: every replica packs the same sizes):

    one int32 word per member                 e_m, the member's exponent
    OFFSET_BITS (4) bits per chunk            o, the chunk's grid is 2**(e_m - o), o in [0, 15]
    INDEX_BITS + value_bits bits per slot     the index in the chunk, and c in [-L, L] (two's
                                              complement, L = 2**(value_bits - 1) - 1)

and an entry's value is c * 2**(e_m - o). With L = 1 (2 bits: -1, 0, 1) a chunk's grid is the power
of two nearest the mean magnitude of its selected entries, so every sent entry moves by about the
chunk's typical size; with more levels it is the finest grid on which the chunk's largest entry fits
in L steps. Entries that round to 0 are not sent (kept whole in the residual). Either rule is its own
fixed point, as `allgather_int8`'s grid is: rounded values give back the same exponents and codes,
so `send` rebuilds the words from the values `select` rounded, and every replica decodes exactly
what the sender took out of its residual. A chunk 2**15 times below its member's largest is rounded
on the coarsest grid the offset reaches (its small entries stay in the residual).
"""

import tensorflow as tf

from tf_topk import ops
from tf_topk.routes import bitfields
from tf_topk.routes.allgather import AllGatherRoute, _gather, gathered_gradients
from tf_topk.routes.base import taken_out

CHUNK = 4096
INDEX_BITS = 12  # an index inside a chunk of CHUNK entries
OFFSET_BITS = 4
MAX_OFFSET = (1 << OFFSET_BITS) - 1
VALUE_BITS = (2, 3, 4, 8)
DEFAULT_VALUE_BITS = 2
MIN_EXPONENT = -149  # float32's smallest subnormal is 2**-149
MAX_EXPONENT = 127  # float32's largest power of two


def chunks_of(size):
    """(chunk length, number of chunks) of a member of `size` entries: chunks of CHUNK entries, the
    last one shorter; a member of fewer entries is one chunk."""
    length = min(CHUNK, size)
    return length, -(-size // length)


def chunk_k(k, size):
    """Slots per chunk (int32 scalar) for a member of `size` entries asked for `k` (int or int32
    tensor): k spread evenly over its chunks, rounded, at least 1 and at most a chunk's length, so
    that `density` keeps meaning the share of entries sent."""
    length, count = chunks_of(size)
    per_chunk = tf.math.round(tf.cast(k, tf.float64) / count)
    return tf.cast(tf.clip_by_value(per_chunk, 1, length), tf.int32)


def _log2(x):
    return tf.math.log(x) / tf.math.log(tf.constant(2.0, tf.float64))


def chunk_exponents(values, levels):
    """Per row of `values` (float64 [chunks, slots] magnitudes, non-finite ones as 0): the exponent
    e of its grid 2**e (int32 [chunks]; MIN_EXPONENT for a row of zeros). levels = 1: the power of
    two nearest the mean of the row's nonzero magnitudes; more: the smallest e with
    max <= levels * 2**e; at most MAX_EXPONENT (a mean beyond 2**127.5 is sent as 2**127)."""
    nonzero = values > 0
    if levels == 1:
        count = tf.reduce_sum(tf.cast(nonzero, tf.float64), 1)
        mean = tf.reduce_sum(values, 1) / tf.maximum(count, 1.0)
        exponent = tf.math.round(_log2(tf.maximum(mean, 1e-300)))
    else:
        largest = tf.reduce_max(tf.concat([values, tf.zeros_like(values[:, :1])], 1), 1)
        guess = tf.math.ceil(_log2(tf.maximum(largest, 1e-300) / levels))
        # log2 rounds; the two corrections make e exact (levels * 2**e is exact in float64).
        two = tf.constant(2.0, tf.float64)
        guess = tf.where(largest > levels * tf.pow(two, guess), guess + 1, guess)
        exponent = tf.where(largest <= levels * tf.pow(two, guess - 1), guess - 1, guess)
    exponent = tf.clip_by_value(tf.cast(exponent, tf.int32), MIN_EXPONENT, MAX_EXPONENT)
    return tf.where(tf.reduce_any(nonzero, 1), exponent, MIN_EXPONENT)


def grid(values, levels):
    """(member exponent e_m: int32 scalar, offsets o: int32 [chunks], codes c: int32 [chunks, slots])
    of one member's selected values (float [chunks, slots]); non-finite values code 0."""
    finite = tf.math.is_finite(values)
    values = tf.cast(tf.where(finite, values, tf.zeros_like(values)), tf.float64)
    exponents = chunk_exponents(tf.abs(values), levels)
    member = tf.reduce_max(tf.concat([exponents, [MIN_EXPONENT]], 0))
    offsets = tf.clip_by_value(member - exponents, 0, MAX_OFFSET)
    step = tf.pow(tf.constant(2.0, tf.float64), tf.cast(tf.expand_dims(member - offsets, 1), tf.float64))
    codes = tf.cast(tf.clip_by_value(tf.math.round(values / step), -levels, levels), tf.int32)
    return member, offsets, codes


def power_of_two(exponents):
    """2**exponents (int32 in [MIN_EXPONENT, MAX_EXPONENT]) in float32, exactly, from the bits: a
    power of float64's `pow` per entry costs more than the rest of decoding."""
    normal = tf.bitcast(tf.bitwise.left_shift(tf.maximum(exponents, -126) + 127, 23), tf.float32)
    subnormal = tf.bitcast(tf.bitwise.left_shift(tf.ones_like(exponents), tf.maximum(exponents + 149, 0)), tf.float32)
    return tf.where(exponents >= -126, normal, subnormal)


def decoded(codes, exponents):
    """codes * 2**exponents in float32 (exact: a few significant bits)."""
    return tf.cast(codes, tf.float32) * power_of_two(exponents)


class ChunkAllGatherRoute(AllGatherRoute):
    """One `all_gather` per bucket of each chunk's top entries in INDEX_BITS + value_bits bits
    (14 by default), plus 4 bits a chunk and 4 bytes a member: (P-1) * about 14k / 8 bytes per
    worker, where `AllGatherRoute` sends (P-1) * 8k.

    Each replica selects the same number of entries from every chunk of CHUNK entries of its
    accumulated gradient (`chunk_k`: k spread evenly), rounds them on the chunk's grid, and keeps
    the rounding error in its residual. Variables of any size take it: indices are local to a chunk.
    The sum is all_gather's replica-ordered scatter of the decoded values, bitwise the same on
    every replica.

    Args:
      value_bits: bits a value: 2 (-1, 0, 1 on the chunk's grid), 3, 4 or 8.

    >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.004, exchange_mode="allgather_chunk")
    """

    name, code = "allgather_chunk", 5.0

    def __init__(self, value_bits=DEFAULT_VALUE_BITS):
        if isinstance(value_bits, bool) or value_bits not in VALUE_BITS:
            raise ValueError(f"value_bits must be one of {VALUE_BITS}, got {value_bits!r}")
        self.value_bits = value_bits
        self.levels = (1 << (value_bits - 1)) - 1

    @property
    def slot_bits(self):
        """Bits a sent entry's slot takes: its index in the chunk and its value."""
        return INDEX_BITS + self.value_bits

    def select(self, bucket, accumulate, selector, context, leader):
        on_cpu = _selects_on_cpu()
        return [self._select_member(accumulate, i, k, size, on_cpu)
                for i, (k, size) in enumerate(zip(bucket.ks, bucket.sizes))]

    def _select_member(self, accumulate, i, k, size, on_cpu):
        """The top `chunk_k` entries by magnitude of every chunk of member i's gradient + residual,
        rounded on the chunk's grid and taken out of it (the rounding error stays). Slots that round to
        0 send nothing (value 0 at the chunk's first entry). On a CPU one op selects and rounds
        (`ops.error_feedback_chunk_topk`, the same rule in C++); elsewhere TensorFlow's top_k over the
        chunks and `grid`."""
        length, count = chunks_of(size)
        per_chunk = chunk_k(k, size)
        if on_cpu:  # one op: selected, rounded, the rounding error kept
            return accumulate(i, per_chunk, chunk=length, value_bits=self.value_bits)
        selection = accumulate(i, 0)
        padded = tf.reshape(tf.pad(selection.remaining, [[0, length * count - size]]), [count, length])
        magnitude = tf.where(tf.math.is_finite(padded), tf.abs(padded), tf.zeros_like(padded))
        _, local = tf.math.top_k(magnitude, per_chunk, sorted=False)
        picked = tf.gather(padded, local, batch_dims=1)
        values = tf.where(tf.math.is_finite(picked), picked, tf.zeros_like(picked))  # never sent, as on a CPU
        member, offsets, codes = grid(values, self.levels)
        rounded = tf.cast(decoded(codes, tf.expand_dims(member - offsets, 1)), values.dtype)
        local = tf.where(tf.equal(rounded, 0), 0, local)
        indices = tf.reshape(local + tf.expand_dims(tf.range(count) * length, 1), [-1])
        return taken_out(selection, selection.remaining, tf.reshape(rounded, [-1]), indices)

    def send(self, context, bucket, values, indices, lengths, carry, sparse_output):
        if _selects_on_cpu():  # one op packs, one unpacks (the same format as `_words` and `_read`)
            layout = dict(sizes=bucket.sizes, starts=bucket.offsets, chunk=CHUNK, value_bits=self.value_bits)
            slots = tf.stack(lengths)
            rows, summed_carry = _gather(context, ops.chunk_pack(values, indices, slots, **layout), carry)
            rows_values, rows_indices = ops.chunk_unpack(rows, slots, **layout)
        else:
            rows, summed_carry = _gather(context, self._words(bucket, values, indices, lengths), carry)
            rows_values, rows_indices = self._read(bucket, rows, lengths)
        return gathered_gradients(bucket, lengths, rows_values, rows_indices, sparse_output), summed_carry

    def _words(self, bucket, values, indices, lengths):
        """The bucket's words in the graph: each member's exponent word, then the chunks' offsets and the
        slots packed (`bitfields`)."""
        members = len(lengths)
        exponents, offsets, slots = [], [], []
        mask = (1 << self.value_bits) - 1
        for size, start, member_values, member_indices in zip(
                bucket.sizes, bucket.offsets, tf.split(values, tf.stack(lengths), num=members),
                tf.split(indices, tf.stack(lengths), num=members)):
            length, count = chunks_of(size)
            member, member_offsets, codes = grid(tf.reshape(member_values, [count, -1]), self.levels)
            local = tf.reshape(member_indices - start, [count, -1]) - tf.expand_dims(tf.range(count) * length, 1)
            exponents.append(member)
            offsets.append(member_offsets)
            slots.append(tf.reshape(tf.bitwise.bitwise_or(
                local, tf.bitwise.left_shift(tf.bitwise.bitwise_and(codes, mask), INDEX_BITS)), [-1]))
        offsets, slots = tf.concat(offsets, 0), tf.concat(slots, 0)
        return tf.concat([tf.bitcast(tf.stack(exponents), tf.float32),
                          bitfields.pack([(offsets, OFFSET_BITS), (slots, self.slot_bits)])], 0)

    def _read(self, bucket, rows, lengths):
        """Every replica's words (rows [replicas, words]) in the graph: (values float32, flat indices),
        each [replicas, slots]."""
        members = len(lengths)
        chunk_counts = [chunks_of(size)[1] for size in bucket.sizes]
        total_chunks, total_slots = sum(chunk_counts), tf.add_n([tf.cast(length, tf.int32) for length in lengths])
        mask = (1 << self.value_bits) - 1
        rows_offsets, rows_slots = bitfields.unpack(rows[:, members:], [(total_chunks, OFFSET_BITS),
                                                                         (total_slots, self.slot_bits)])
        rows_exponents = tf.bitcast(rows[:, :members], tf.int32)  # [replicas, members]
        # Where each slot belongs (the same layout on every replica): its member and its chunk.
        slot_chunk = tf.repeat(tf.range(total_chunks), tf.repeat(
            tf.stack([length // count for length, count in zip(lengths, chunk_counts)]), chunk_counts))
        chunk_member = tf.repeat(tf.range(members), chunk_counts)
        chunk_start = tf.concat([start + tf.range(count) * chunks_of(size)[0]
                                 for start, size, count in zip(bucket.offsets, bucket.sizes, chunk_counts)], 0)
        rows_slots = tf.cast(rows_slots, tf.int32)
        raw = tf.bitwise.right_shift(rows_slots, INDEX_BITS)
        rows_codes = tf.where(raw > self.levels, raw - (mask + 1), raw)
        rows_steps = tf.gather(rows_exponents, tf.gather(chunk_member, slot_chunk), axis=1) - tf.gather(
            tf.cast(rows_offsets, tf.int32), slot_chunk, axis=1)
        rows_indices = tf.bitwise.bitwise_and(rows_slots, (1 << INDEX_BITS) - 1) + tf.gather(chunk_start, slot_chunk)
        return decoded(rows_codes, rows_steps), rows_indices

    def bytes(self, pairs, entries, replicas):
        return (replicas - 1) * self.slot_bits / 8.0 * pairs

    def bucket_overhead_bytes(self, bucket, replicas):
        """Each member's exponent word and each chunk's offset."""
        chunks = sum(chunks_of(size)[1] for size in bucket.sizes)
        return (replicas - 1) * (4.0 * len(bucket.sizes) + OFFSET_BITS / 8.0 * chunks)

    def __repr__(self):
        return f"ChunkAllGatherRoute(value_bits={self.value_bits})"


def _selects_on_cpu():
    """Whether the selection being built runs on a CPU: the device scope's, else whether the machine has
    no GPU (where TensorFlow places ops on one)."""
    device = tf.zeros([]).device
    if device:
        return "CPU" in device.upper()
    return not tf.config.list_logical_devices("GPU")
