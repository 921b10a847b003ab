"""How the exchanged sum reaches the variables: one way per method (`tf_topk.methods`).

| the memory (`tf_topk.memory`, `tf_topk.decoupled_momentum`) | a sparsified variable gets | applied by |
|---|---|---|
| error feedback, momentum correction for SGD, none | its summed gradient | the inner optimizer's own update |
| the same with `sparse_updates=True` | its pairs (`SparseGradient`) | `apply_pairs`: plain SGD on the sent entries |
| decoupled momentum, Adam's momentum correction (`applies_update`) | an update direction | `apply_directions` |

The dense-path variables (below `min_size`) always take the inner optimizer's own update. Both
functions go through the strategy's variable update, as Keras's optimizers apply theirs, and take
`(tensor, variable)` pairs of the tf.Variables themselves (a Keras variable's `.value`).
"""

import tensorflow as tf

from tf_topk.sparse_gradient import apply_sparse_sgd


def apply_directions(pairs, learning_rate, decays):
    """`variable -= learning_rate * (direction + decay * variable)` for each (direction, variable) of
    `pairs` and its decay in `decays` (0.0: none), in the variable's dtype: decoupled momentum's sign
    step and Adam's momentum correction's direction, with the inner optimizer's decoupled weight decay."""
    learning_rate = tf.convert_to_tensor(learning_rate)

    def step(variable, direction, decay):
        direction = tf.cast(direction, variable.dtype)
        if decay:
            direction += decay * variable
        return variable.assign_sub(tf.cast(learning_rate, variable.dtype) * direction)

    def update(distribution, pairs):
        for (direction, variable), decay in zip(pairs, decays):
            distribution.extended.update(variable, step, args=(direction, decay), group=False)

    tf.__internal__.distribute.interim.maybe_merge_call(update, tf.distribute.get_strategy(), list(pairs))


def apply_pairs(pairs, learning_rate):
    """sparse_updates: plain SGD on the entries sent, for each (SparseGradient, variable) of `pairs`
    (`apply_sparse_sgd`: O(pairs), not a dense gradient and an update of every entry)."""

    def update(distribution, pairs):
        for grad, variable in pairs:
            distribution.extended.update(variable, lambda v, g: apply_sparse_sgd(v, g, learning_rate),
                                         args=(grad,), group=False)

    tf.__internal__.distribute.interim.maybe_merge_call(update, tf.distribute.get_strategy(), list(pairs))


def constrain(variables):
    """Each variable's constraint, as Keras applies it after an update (where the inner optimizer's own
    apply does not: tf_keras)."""
    for variable in variables:
        if getattr(variable, "constraint", None) is not None:
            variable.assign(variable.constraint(variable))
