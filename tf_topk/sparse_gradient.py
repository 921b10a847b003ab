"""SparseGradient: a sparsified variable's summed gradient as (value, index) pairs.

What the exchange hands out with `sparse_output=True`, and the two ways to
use it: `to_dense` and `apply_sparse_sgd`. Both go one row (one replica's
pairs) at a time, so the float sum does not depend on the device.
"""

import collections

import tensorflow as tf

SparseGradient = collections.namedtuple("SparseGradient", ["values", "indices"])
SparseGradient.__doc__ = """A sparsified variable's gradient summed over replicas, as pairs
(`SparseExchange(..., sparse_output=True)`).

values: [rows, m] in the variable's dtype; indices: int32 [rows, m] into the
  flattened variable. The gradient is the sum of all pairs. Within a row the
  indices are distinct but for spare slots (value 0 at index 0); rows repeat
  indices. The all_gather exchange gives one row per replica (its own
  pairs), the agreed-index exchange one row (already summed). A 1-D
  SparseGradient counts as one row.
Apply it with `apply_sparse_sgd`, or make it dense with `to_dense`: both go
row by row, in row order, so the sum is the same on every replica and every
device (a single scatter of pairs with repeated indices is, on GPUs,
summed by atomics in no fixed order).
"""


def _rows(gradient):
    """The (values, indices) rows of a SparseGradient, in order."""
    values, indices = tf.convert_to_tensor(gradient.values), tf.convert_to_tensor(gradient.indices)
    if values.shape.rank == 1:
        return [(values, indices)]
    if values.shape.rank != 2 or values.shape[0] is None:
        raise ValueError(f"SparseGradient values must be [m] or [rows, m] with a known number of rows, "
                         f"got shape {values.shape}")
    return [(values[row], indices[row]) for row in range(values.shape[0])]


def to_dense(gradient, shape):
    """A SparseGradient as a dense tensor of `shape` (one scatter per row, in order)."""
    size = tf.TensorShape(shape).num_elements()
    flat = None
    for values, indices in _rows(gradient):
        coordinates = tf.expand_dims(indices, 1)
        flat = (tf.scatter_nd(coordinates, values, tf.constant([size], tf.int32)) if flat is None
                else tf.tensor_scatter_nd_add(flat, coordinates, values))
    return tf.reshape(flat, shape)


def apply_sparse_sgd(variable, gradient, learning_rate):
    """variable -= learning_rate * gradient for a SparseGradient, touching only
    its entries (a scatter-subtract in place per row: O(pairs), not
    O(entries)).

    Rows subtract one after the other, in order, on every replica the same,
    and within a row indices are distinct (spare slots subtract 0), so the
    result is bitwise the same on every replica and device. A scalar
    variable (min_size=1) is updated with its dense gradient.

    Example (a custom loop with plain SGD):
      >>> result = exchange(grads)
      >>> for variable, grad in zip(variables, result.grads):
      ...     if isinstance(grad, tf_topk.exchange.SparseGradient):
      ...         tf_topk.exchange.apply_sparse_sgd(variable, grad, 0.1)
      ...     else:
      ...         variable.assign_sub(0.1 * grad)
    """
    rate = tf.cast(learning_rate, variable.dtype)
    if variable.shape.rank == 0:
        return variable.assign_sub(rate * tf.cast(to_dense(gradient, []), variable.dtype))
    shape = tf.shape(variable, out_type=tf.int32)
    update = None
    for values, indices in _rows(gradient):
        coordinates = tf.transpose(tf.unravel_index(indices, shape))
        with tf.control_dependencies([] if update is None else [update]):
            update = variable.scatter_nd_sub(coordinates, rate * tf.cast(values, variable.dtype))
    return update
