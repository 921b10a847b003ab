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
