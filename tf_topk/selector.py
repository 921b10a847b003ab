"""Selectors: which k entries of a replica's accumulated gradient it sends.

A selector is one of the exchange's three parts (selector, memory,
communicator). It sees one flat tensor at a time (the gradient plus the
residual) and a k, and returns (values, indices), both of shape [k]; spare
slots hold value 0 at index 0, which adds nothing when scattered back. A new
selector is a class with a `select(accumulated, k)` method, passed as
`SparseExchange(..., selector=MySelector())`.

Example:
    >>> exchange = tf_topk.SparseExchange(variables, density=0.01,
    ...                                   selector=tf_topk.selector.TopKSelector("exact"))
"""

import tensorflow as tf

from tf_topk import ops


class TopKSelector:
    """The ~k largest magnitudes, by `tf_topk.approx_topk` ("gaussian" or "exact")."""

    def __init__(self, method="gaussian"):
        ops.check_method(method)
        self.method = method

    def select(self, accumulated, k):
        return ops.approx_topk(accumulated, k, method=self.method)

    def __repr__(self):
        return f"TopKSelector({self.method!r})"


class RandomKSelector:
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
