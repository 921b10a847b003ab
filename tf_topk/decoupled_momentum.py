"""Decoupled momentum (DeMo, Peng, Quesnelle, Kingma et al., arXiv 2411.19870): each replica keeps its
own momentum, sends the largest components of its blockwise DCT, subtracts what it sent, and every
replica applies the sign of the gathered components.

Why a transform: a momentum's energy sits in few low-frequency components of each block, so k
coefficients decode into a direction for every entry of the variable, where k entries of the raw
momentum move k entries. Why the sign: the decoded sum's magnitude follows how many components were
sent, not the step the entry needs; the sign makes the step the same for every entry (a multiple
of lr), as Adam's update roughly is (Signum).

    m <- beta * m + DCT(g)                  (per replica, in the transform's space)
    send the top-k of m;  m <- m - sent     (the exchange's error feedback, on m)
    variable -= lr * (step_scale * sign(IDCT(sum of every replica's sent)) + weight_decay * variable)

The transform is a 2-D DCT-II (orthonormal) over blocks of at most `chunk` x `chunk` entries of the
variable seen as a matrix (its last axis the columns, the others the rows), each side the largest
divisor of that dimension up to `chunk`; a block's coefficients are contiguous in the flat order the
exchange selects from. An embedding table's rows are unrelated tokens (or positions), so its blocks
are one row high: a 2-D block would move a row by the sign of its neighbours' momentum. The DCT is
linear, so the momentum can live in the transformed space, and the sum over replicas of what they
sent is the transform of the sum.

Why a step of twice the learning rate (`step_scale=2.0`): at AdamW's own rate the sign step lagged
dense AdamW, most where AdamW's options steady dense (`global_clipnorm=1.0`); twice the rate halved
that gap on both texts and measured better on every seed, clipped or not (benchmarks/RESULTS.md,
"AdamW on every path").
"""

import functools
import math

import numpy as np
import tensorflow as tf

from tf_topk.config import DEFAULT_STEP_SCALE, check_momentum, check_step_scale
from tf_topk.memory import Compensation, ErrorFeedbackMemory

DEFAULT_CHUNK = 64
DEFAULT_DECAY = 0.999


def block_sides(dimension, chunk):
    """The blocks along one axis of `dimension` entries: ceil(dimension / chunk) of them, as equal as
    can be, as (side, count) pairs, the larger side first. Any dimension gets blocks of about `chunk`
    (a prime 97: 49 and 48), so no dimension falls to blocks one entry wide, which would leave its
    entries untransformed (a coefficient would move one entry, not a block)."""
    count = -(-dimension // chunk)
    side, larger = divmod(dimension, count)
    return [(s, c) for s, c in ((side + 1, larger), (side, count - larger)) if c]


@functools.lru_cache(maxsize=None)
def _dct_matrix64(size):
    n = np.arange(size)
    matrix = np.cos(np.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * size)) * math.sqrt(2.0 / size)
    matrix[0] /= math.sqrt(2.0)
    matrix.setflags(write=False)
    return matrix


def dct_matrix(size, dtype=np.float32):
    """The orthonormal DCT-II matrix D (size x size): coefficients = D @ x, x = D.T @ coefficients."""
    return _dct_matrix64(size).astype(dtype)


class _Plane:
    """The blockwise 2-D DCT of a [rows, columns] matrix: the matrix cut into regions of equal blocks
    (at most two block sides along each axis, `block_sides`), each region's blocks transformed by one
    einsum and laid out block after block, row-major within a block, the regions one after another."""

    def __init__(self, rows, columns, row_blocks, column_blocks):
        self.rows, self.columns = rows, columns
        self.row_blocks, self.column_blocks = row_blocks, column_blocks
        self.size = rows * columns

    def forward(self, matrix):
        parts, top = [], 0
        for a, count_a in self.row_blocks:
            left = 0
            for b, count_b in self.column_blocks:
                region = matrix[top:top + a * count_a, left:left + b * count_b] \
                    if len(self.row_blocks) * len(self.column_blocks) > 1 else matrix
                x = tf.reshape(region, [count_a, a, count_b, b])
                y = tf.einsum("ua,iajb,vb->ijuv", _matrix(a, x.dtype), x, _matrix(b, x.dtype))
                parts.append(tf.reshape(y, [-1]))
                left += b * count_b
            top += a * count_a
        return parts[0] if len(parts) == 1 else tf.concat(parts, 0)

    def inverse(self, flat):
        sizes = [a * count_a * b * count_b for a, count_a in self.row_blocks for b, count_b in self.column_blocks]
        pieces = iter(tf.split(flat, sizes) if len(sizes) > 1 else [flat])
        bands = []
        for a, count_a in self.row_blocks:
            band = []
            for b, count_b in self.column_blocks:
                y = tf.reshape(next(pieces), [count_a, count_b, a, b])
                x = tf.einsum("ua,ijuv,vb->iajb", _matrix(a, y.dtype), y, _matrix(b, y.dtype))
                band.append(tf.reshape(x, [a * count_a, b * count_b]))
            bands.append(band[0] if len(band) == 1 else tf.concat(band, 1))
        return bands[0] if len(bands) == 1 else tf.concat(bands, 0)


def _matrix(side, dtype):
    """The DCT matrix of `side` as a constant of the graph being built, in `dtype` (a constant made
    once and kept would belong to the first graph that made it: a second trace, as Keras's
    LossScaleOptimizer's, could not reach it)."""
    return tf.constant(dct_matrix(side, dtype.as_numpy_dtype))


def is_embedding_table(variable):
    """Whether `variable` is an embedding table: named `embeddings`, as Keras's Embedding names its
    table (a Keras variable's path `.../embeddings`, a tf.Variable's name `.../embeddings:0`)."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None) or ""
    return name.split(":")[0].rsplit("/", 1)[-1] == "embeddings"


class BlockDCT:
    """The blockwise 2-D DCT of one variable's shape, and its inverse, on flat tensors.

    The variable is seen as a matrix, its last axis the columns and the others the rows; a 1-D
    variable of n entries as rows of `chunk` ([n // chunk, chunk], its last n % chunk entries a row of
    their own), so that its blocks hold up to chunk x chunk entries as a matrix's do. Each axis is cut
    by `block_sides`. rows_apart: blocks one row high (an embedding table: a DCT along each row only);
    columns_apart: one column wide. Where ceil(dimension / chunk) blocks of one side fit a dimension
    exactly (128, 96, 100, ...) they are the blocks of earlier versions (the largest divisor up to
    `chunk`), so a checkpoint's momentum keeps its meaning; dimensions no such side fits (97, 130, ...)
    and 1-D variables had other blocks before (the largest divisor, 1 for a prime; one row high).
    """

    def __init__(self, shape, chunk=DEFAULT_CHUNK, rows_apart=False, columns_apart=False):
        shape = [int(d) for d in shape]
        size = int(np.prod(shape)) if shape else 1
        if len(shape) >= 2:
            views = [(size // shape[-1] if shape[-1] else 0, shape[-1])]
        elif size > chunk:
            views = [(size // chunk, chunk)] + ([(1, size % chunk)] if size % chunk else [])
        else:
            views = [(1, size)]
        self.planes = [_Plane(rows, columns, [(1, rows)] if rows_apart else block_sides(rows, chunk),
                              [(1, columns)] if columns_apart else block_sides(columns, chunk))
                       for rows, columns in views]
        self.size = size
        # The largest block's sides (the first plane's first region).
        self.row_side = self.planes[0].row_blocks[0][0]
        self.column_side = self.planes[0].column_blocks[0][0]

    def blocks(self):
        """Every block as (first coefficient, rows, columns), in the flat order of the coefficients."""
        found, offset = [], 0
        for plane in self.planes:
            for a, count_a in plane.row_blocks:
                for b, count_b in plane.column_blocks:
                    found += [(offset + i * a * b, a, b) for i in range(count_a * count_b)]
                    offset += a * count_a * b * count_b
        return found

    def _per_plane(self, flat, transform, shape_of):
        if len(self.planes) == 1:
            return tf.reshape(transform(self.planes[0], tf.reshape(flat, shape_of(self.planes[0]))), [-1])
        pieces = tf.split(flat, [plane.size for plane in self.planes])
        return tf.concat([tf.reshape(transform(plane, tf.reshape(piece, shape_of(plane))), [-1])
                          for plane, piece in zip(self.planes, pieces)], 0)

    def forward(self, flat):
        """Coefficients, flat, each block's row-major and contiguous."""
        return self._per_plane(flat, _Plane.forward, lambda plane: [plane.rows, plane.columns])

    def inverse(self, flat):
        return self._per_plane(flat, _Plane.inverse, lambda plane: [-1])


class DecoupledMomentumMemory(ErrorFeedbackMemory):
    """DeMo's memory: the residual is each replica's momentum in the DCT's space, decayed by `decay`;
    the exchanged sum is decoded and its sign is the update direction (`applies_update`: the
    optimizer applies it by SGD at the inner optimizer's learning rate, with its decoupled weight
    decay). Dense-path variables keep the inner optimizer.

    Args:
      decay: beta, the momentum's decay (DeMo's 0.999).
      chunk: the largest block side of the DCT (DeMo's 64).
      sign: apply the sign of the decoded sum (DeMo's default) rather than the sum itself.
      step_scale: the step in units of the inner optimizer's learning rate: each sparsified entry
        moves by step_scale * learning_rate a step (with the sign), plus the weight decay's own step
        (a subclass whose decoded sum goes to the inner optimizer, `applies_update` False, ignores it).
        1.0 is DeMo's sign step at the inner rate; the default 2.0 measured better (module docstring).
      embedding_rows_apart: an embedding table's (`is_embedding_table`) blocks are one row high, so
        that no row moves by its neighbours' momentum; False: 2-D blocks for every variable, as DeMo.
    """

    applies_update = True
    method = "decoupled momentum"

    def __init__(self, decay=DEFAULT_DECAY, chunk=DEFAULT_CHUNK, sign=True, embedding_rows_apart=True,
                 step_scale=DEFAULT_STEP_SCALE):
        super().__init__()
        self.decay = check_momentum(decay)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        self.step_scale = check_step_scale(step_scale, "step_scale")
        if not isinstance(embedding_rows_apart, bool):
            raise ValueError(f"embedding_rows_apart must be True or False, got {embedding_rows_apart!r}")
        self.chunk = chunk
        self.sign = bool(sign)
        self.embedding_rows_apart = embedding_rows_apart
        self.transforms = None

    def build(self, variables, make_state):
        super().build(variables, make_state)
        self.transforms = [BlockDCT(v.shape, self.chunk, self.embedding_rows_apart and is_embedding_table(v))
                           for v in variables]

    def describe(self):
        """The line the chief prints when the exchange is made: what runs, and how to switch it off."""
        return (f"tf_topk: decoupled momentum (DeMo) for the sparsified variables: each replica's momentum "
                f"(decay {self.decay:g}) in DCT blocks of up to {self.chunk}x{self.chunk}"
                f"{' (an embedding table: 1x' + str(self.chunk) + ')' if self.embedding_rows_apart else ''}"
                ", its top-k sent, the sign "
                f"of their sum applied at {self.step_scale:g}x the learning rate"
                f"{'' if self.sign else ' (the sum itself: sign=False)'} (ExchangeConfig's decoupled_step_scale); "
                "decoupled_momentum=False for top-k in front of the inner optimizer")

    def compensate(self, slot, grad):
        residual = self.residuals[slot]
        coefficients = self.transforms[slot].forward(tf.cast(tf.reshape(grad, [-1]), residual.dtype))
        return Compensation(coefficients, self.decay * tf.reshape(tf.convert_to_tensor(residual), [-1]), None)

    def apply_sparse(self, slot, summed, keep):
        decoded = self.transforms[slot].inverse(tf.cast(tf.reshape(summed, [-1]), self.residuals[slot].dtype))
        # The step is the memory's own only where it applies the update; a subclass that hands the decoded
        # sum to the inner optimizer as a gradient (applies_update False) hands it unscaled.
        scale = self.step_scale if self.applies_update else 1.0
        direction = scale * (tf.sign(decoded) if self.sign else decoded)
        return tf.reshape(tf.cast(direction, summed.dtype), tf.shape(summed))
