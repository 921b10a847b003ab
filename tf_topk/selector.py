"""Selectors: which k entries of a replica's accumulated gradient it sends.

A selector is one of the exchange's three parts (selector, memory, route).
It sees one flat tensor at a time (the gradient plus the residual) and a k,
and returns (values, indices), both of shape [k]; spare slots hold value 0 at
index 0, which adds nothing when scattered back. A new selector subclasses
`Selector` and defines `select(accumulated, k)`, passed as
`SparseExchange(..., selector=MySelector())`. A selector whose choice the
fused op makes itself says so with `fused_method`, and the exchange then
selects in the same pass as the error-feedback sum.

Example:
    >>> exchange = tf_topk.SparseExchange(variables, density=0.01,
    ...                                   selector=tf_topk.selector.TopKSelector("exact"))
"""

import abc

import tensorflow as tf

from tf_topk import ops


class Selector(abc.ABC):
    """Which k entries of a flat tensor a replica sends.

    fused_method: the `tf_topk.error_feedback_topk` method that makes the same
    choice inside the fused op ("gaussian", "exact"), or None when the
    selector picks on its own after the op has summed.
    """

    fused_method = None

    @abc.abstractmethod
    def select(self, accumulated, k):
        """(values, indices), both of shape [k], of flat `accumulated`."""


class TopKSelector(Selector):
    """The ~k largest magnitudes, by `tf_topk.approx_topk` ("gaussian" or "exact")."""

    def __init__(self, method="gaussian"):
        ops.check_method(method)
        self.method = method

    @property
    def fused_method(self):
        return self.method

    def select(self, accumulated, k):
        return ops.approx_topk(accumulated, k, method=self.method)

    def __repr__(self):
        return f"TopKSelector({self.method!r})"


class RandomKSelector(Selector):
    """k entries chosen uniformly at random, without replacement.

    A BENCHMARK BASELINE (random-k sparsification), not a way to train: the
    convergence benchmark compares it with top-k under the same error
    feedback. The choice differs between replicas and steps.
    """

    def select(self, accumulated, k):
        indices = tf.random.shuffle(tf.range(tf.size(accumulated, out_type=tf.int32)))[:k]
        return tf.gather(accumulated, indices), indices

    def __repr__(self):
        return "RandomKSelector()"


class ChunkTopKSelector(Selector):
    """The largest magnitudes spread over fixed-size chunks: each run of `chunk`
    consecutive entries offers its ceil(k / chunks) largest, and the k largest
    of those are sent. No part of a variable waits behind another part whose
    entries are larger (plain top-k can leave a third of a layer unsent for a
    whole run at density 0.001); SparseLoCo selects chunk-wise for the same
    reason. Exact within each chunk; not fused with the error-feedback sum.

    >>> x = tf.constant([9.0, 8.0, 7.0, 0.5, 0.0, 0.2])
    >>> sorted(ChunkTopKSelector(chunk=3).select(x, 2)[1].numpy().tolist())
    [0, 3]
    """

    def __init__(self, chunk=1024):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        self.chunk = chunk

    def select(self, accumulated, k):
        size = int(accumulated.shape[0])
        chunks = -(-size // self.chunk)
        padded = tf.pad(accumulated, [[0, chunks * self.chunk - size]])
        per_chunk = tf.minimum((k + chunks - 1) // chunks, self.chunk)
        _, columns = tf.math.top_k(tf.abs(tf.reshape(padded, [chunks, self.chunk])), per_chunk)
        offered = tf.reshape(columns + self.chunk * tf.range(chunks)[:, None], [-1])
        _, best = tf.math.top_k(tf.abs(tf.gather(padded, offered)), k)
        indices = tf.gather(offered, best)
        # A padding entry (value 0) becomes a spare slot: value 0 at index 0.
        return tf.gather(padded, indices), tf.where(indices < size, indices, 0)

    def __repr__(self):
        return f"ChunkTopKSelector(chunk={self.chunk})"



def select_over_bucket(selector, accumulated, k):
    """One selection of `k` entries over a bucket's variables (flat tensors
    `accumulated`, their gradient plus residual), each entry ranked by its
    magnitude over its variable's root mean square: a variable whose largest
    entries stand out more gets more of k, whatever its scale (a layer with
    small gradients is not starved for it). The values are the accumulated
    ones. Returns (values, indices) per variable, indices into the variable;
    how many each gets varies from step to step, and the counts sum to k (a
    spare slot of the selector, value 0 at index 0, stays a spare slot of
    the first variable).

    >>> a, b = tf.constant([0.0, 5.0, 0.1]), tf.constant([100.0, 90.0, 1.0])
    >>> [i.numpy().tolist() for _, i in select_over_bucket(TopKSelector("exact"), [a, b], 2)]
    [[1], [0]]
    """
    scores = [tf.math.divide_no_nan(flat, _finite_rms(flat)) for flat in accumulated]
    values, indices = selector.select(tf.concat(scores, 0), k)
    order = tf.argsort(indices)
    indices, taken = tf.gather(indices, order), tf.not_equal(tf.gather(values, order), 0)
    sizes = [int(flat.shape[0]) for flat in accumulated]
    bounds = tf.searchsorted(indices, tf.constant([sum(sizes[:i]) for i in range(len(sizes) + 1)], tf.int32),
                             side="left")
    counts = bounds[1:] - bounds[:-1]
    selected = []
    for flat, offset, piece, piece_taken in zip(accumulated, [sum(sizes[:i]) for i in range(len(sizes))],
                                                tf.split(indices, counts, num=len(sizes)),
                                                tf.split(taken, counts, num=len(sizes))):
        local = tf.where(piece_taken, piece - offset, 0)
        selected.append((tf.where(piece_taken, tf.gather(flat, local), tf.zeros([], flat.dtype)), local))
    return selected


def _finite_rms(flat):
    """Root mean square of the finite entries (a non-finite entry is never sent)."""
    finite = tf.where(tf.math.is_finite(flat), flat, tf.zeros_like(flat))
    return tf.sqrt(tf.reduce_mean(tf.square(finite)))
