"""Fields of a few bits each packed into 32-bit words, and read back: the wire format's bit layer.

Why in the graph: a route's buffer travels as float32 words through `all_gather`, so fields narrower
than a word (a 12-bit index, a 2-bit value) must share words to save bytes. Every replica packs the
same field sizes in the same order, so the layout needs no header: the reader knows where each field
starts. Fields are laid out least significant bit first, one after another, across word boundaries.

    >>> words = pack([(tf.constant([5, 3]), 3), (tf.constant([1]), 1)])   # 3 + 3 + 1 bits: one word
    >>> [f.numpy().tolist() for f in unpack(tf.expand_dims(words, 0), [(2, 3), (1, 1)])]
    [[[5, 3]], [[1]]]
"""

import tensorflow as tf

# A field is at most this wide: a field starting at bit 31 of a word then ends below bit 63, and
# every shift stays inside int64 without overflow.
MAX_WIDTH = 24


def _starts(sizes_and_widths):
    """Each field group's first bit (int64 scalars) and the total bits."""
    starts, bit = [], tf.constant(0, tf.int64)
    for size, width in sizes_and_widths:
        if not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"a field's width must be 1 to {MAX_WIDTH} bits, got {width!r}")
        starts.append(bit)
        bit = bit + tf.cast(size, tf.int64) * width
    return starts, bit


def word_count(sizes_and_widths):
    """The words (int64 scalar) that `pack` makes of groups of (size, width) fields."""
    _, bits = _starts(sizes_and_widths)
    return (bits + 31) // 32


def pack(fields):
    """`fields`, a list of (values, width): each values a 1-D integer tensor of numbers in
    [0, 2**width), as consecutive `width`-bit fields. Returns float32 [words]: the words' bits
    (bit-cast; never read as floats)."""
    starts, bits = _starts([(tf.size(values), width) for values, width in fields])
    positions, shifted_values = [], []
    for (values, width), start in zip(fields, starts):
        positions.append(start + tf.range(tf.size(values, out_type=tf.int64), dtype=tf.int64) * width)
        shifted_values.append(tf.cast(values, tf.int64))
    position, value = tf.concat(positions, 0), tf.concat(shifted_values, 0)
    words = (bits + 31) // 32
    shifted = tf.bitwise.left_shift(value, position % 32)
    # The fields' bits never overlap, so adding what lands in a word is OR-ing it: no carries.
    low = tf.bitwise.bitwise_and(shifted, 0xFFFFFFFF)
    high = tf.bitwise.right_shift(shifted, 32)
    word = position // 32
    summed = tf.math.unsorted_segment_sum(tf.concat([low, high], 0), tf.concat([word, word + 1], 0), words + 1)
    return tf.bitcast(tf.cast(summed[:words], tf.uint32), tf.float32)


def unpack(rows, sizes_and_widths):
    """The fields of `pack`'s words, for each row of `rows` (float32 [replicas, words]): one int64
    tensor [replicas, size] per (size, width) group, in [0, 2**width)."""
    starts, _ = _starts(sizes_and_widths)
    words = tf.cast(tf.bitcast(rows, tf.uint32), tf.int64)
    words = tf.concat([words, tf.zeros_like(words[:, :1])], 1)  # a field may end in the last word
    fields = []
    for (size, width), start in zip(sizes_and_widths, starts):
        position = start + tf.range(tf.cast(size, tf.int64), dtype=tf.int64) * width
        word, shift = position // 32, position % 32
        low = tf.bitwise.right_shift(tf.gather(words, word, axis=1), shift)
        # Only the high word's lowest bits belong to the field: masked before the shift, they stay
        # below bit 63.
        high = tf.bitwise.left_shift(tf.bitwise.bitwise_and(tf.gather(words, word + 1, axis=1), (1 << MAX_WIDTH) - 1),
                                     32 - shift)
        fields.append(tf.bitwise.bitwise_and(tf.bitwise.bitwise_or(low, high), (1 << width) - 1))
    return fields
