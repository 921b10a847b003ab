"""Decoupled momentum (DeMo, Peng, Quesnelle, Kingma et al., arXiv 2411.19870): each replica keeps its
own momentum, sends the largest components of its blockwise DCT, subtracts what it sent, and every
replica applies the sign of the gathered components.

Why a transform: a momentum's energy sits in few low-frequency components of each block, so k
coefficients decode into a direction for every entry of the variable, where k entries of the raw
momentum move k entries. Why the sign: the decoded sum's magnitude follows how many components were
sent, not the step the entry needs; the sign makes the step lr per entry, as Adam's update roughly
is (Signum).

    m <- beta * m + DCT(g)                  (per replica, in the transform's space)
    send the top-k of m;  m <- m - sent     (the exchange's error feedback, on m)
    variable -= lr * (sign(IDCT(sum of every replica's sent)) + weight_decay * variable)

The transform is a 2-D DCT-II (orthonormal) over blocks of at most `chunk` x `chunk` entries of the
variable seen as a matrix (its last axis the columns, the others the rows), each side the largest
divisor of that dimension up to `chunk`; a block's coefficients are contiguous in the flat order the
exchange selects from. An embedding table's rows are unrelated tokens (or positions), so its blocks
are one row high: a 2-D block would move a row by the sign of its neighbours' momentum. The DCT is
linear, so the momentum can live in the transformed space, and the sum over replicas of what they
sent is the transform of the sum.
"""

import math

import numpy as np
import tensorflow as tf

from tf_topk.config import check_momentum
from tf_topk.memory import Compensation, ErrorFeedbackMemory

DEFAULT_CHUNK = 64
DEFAULT_DECAY = 0.999


def block_side(dimension, chunk):
    """The largest divisor of `dimension` up to `chunk`."""
    return max(d for d in range(1, min(dimension, chunk) + 1) if dimension % d == 0)


def dct_matrix(size):
    """The orthonormal DCT-II matrix D (size x size): coefficients = D @ x, x = D.T @ coefficients."""
    n = np.arange(size)
    matrix = np.cos(np.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * size)) * math.sqrt(2.0 / size)
    matrix[0] /= math.sqrt(2.0)
    return matrix.astype(np.float32)


def is_embedding_table(variable):
    """Whether `variable` is an embedding table: named `embeddings`, as Keras's Embedding names its
    table (a Keras variable's path `.../embeddings`, a tf.Variable's name `.../embeddings:0`)."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None) or ""
    return name.split(":")[0].rsplit("/", 1)[-1] == "embeddings"


class BlockDCT:
    """The blockwise 2-D DCT of one variable's shape, and its inverse, on flat tensors
    (`rows_apart`: blocks one row high, a DCT along each row only)."""

    def __init__(self, shape, chunk=DEFAULT_CHUNK, rows_apart=False):
        shape = [int(d) for d in shape]
        columns = shape[-1] if shape else 1
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        self.rows, self.columns = rows, columns
        self.row_side = 1 if rows_apart else block_side(rows, chunk)
        self.column_side = block_side(columns, chunk)
        self._row_matrix = tf.constant(dct_matrix(self.row_side))
        self._column_matrix = tf.constant(dct_matrix(self.column_side))

    def _blocks(self):
        return [self.rows // self.row_side, self.row_side, self.columns // self.column_side, self.column_side]

    def forward(self, flat):
        """Coefficients, flat, each block's row-major and contiguous."""
        x = tf.reshape(flat, self._blocks())  # [I, a, J, b]
        y = tf.einsum("ua,iajb,vb->ijuv", self._row_matrix, x, self._column_matrix)
        return tf.reshape(y, [-1])

    def inverse(self, flat):
        y = tf.reshape(flat, [self._blocks()[0], self._blocks()[2], self.row_side, self.column_side])
        x = tf.einsum("ua,ijuv,vb->iajb", self._row_matrix, y, self._column_matrix)
        return tf.reshape(x, [-1])


class DecoupledMomentumMemory(ErrorFeedbackMemory):
    """DeMo's memory: the residual is each replica's momentum in the DCT's space, decayed by `decay`;
    the exchanged sum is decoded and its sign is the update direction (`applies_update`: the
    optimizer applies it by SGD at the inner optimizer's learning rate, with its decoupled weight
    decay). Dense-path variables keep the inner optimizer.

    Args:
      decay: beta, the momentum's decay (DeMo's 0.999).
      chunk: the largest block side of the DCT (DeMo's 64).
      sign: apply the sign of the decoded sum (DeMo's default) rather than the sum itself.
      embedding_rows_apart: an embedding table's (`is_embedding_table`) blocks are one row high, so
        that no row moves by its neighbours' momentum; False: 2-D blocks for every variable, as DeMo.
    """

    applies_update = True

    def __init__(self, decay=DEFAULT_DECAY, chunk=DEFAULT_CHUNK, sign=True, embedding_rows_apart=True):
        super().__init__()
        self.decay = check_momentum(decay)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
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
                f"of their sum applied at the learning rate{'' if self.sign else ' (the sum itself: sign=False)'}; "
                "decoupled_momentum=False for top-k in front of the inner optimizer")

    def compensate(self, slot, grad):
        residual = self.residuals[slot]
        coefficients = self.transforms[slot].forward(tf.cast(tf.reshape(grad, [-1]), residual.dtype))
        return Compensation(coefficients, self.decay * tf.reshape(tf.convert_to_tensor(residual), [-1]), None)

    def apply_sparse(self, slot, summed, keep):
        decoded = self.transforms[slot].inverse(tf.cast(tf.reshape(summed, [-1]), tf.float32))
        direction = tf.sign(decoded) if self.sign else decoded
        return tf.reshape(tf.cast(direction, summed.dtype), tf.shape(summed))
