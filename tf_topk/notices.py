"""Lines the library says to the user: once per job, from the chief.

Every worker of a multi-worker job builds the same optimizer and exchange, so
a line said where they are built would be printed once per worker; the chief
(the worker that checkpoints, `strategy.extended.should_checkpoint`) says it
for all. Lines go to stderr, beside TensorFlow's and Keras's own.
"""

import sys

import tensorflow as tf


def is_chief(strategy=None):
    """Whether this process speaks for the job: the chief of `strategy` (default: the current one; the
    process itself with no strategy or one worker)."""
    return bool((strategy or tf.distribute.get_strategy()).extended.should_checkpoint)


def tell(line, strategy=None):
    """Print `line` to stderr on the chief of `strategy` (default: the current one, as where an optimizer
    is built; a Keras callback, which runs outside the strategy's scope, passes its model's); other
    workers print nothing."""
    if is_chief(strategy):
        print(line, file=sys.stderr, flush=True)
