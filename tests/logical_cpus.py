"""Replicas on logical CPUs of one process, for tests of what two replicas compute together.

Logical CPUs must exist before TensorFlow starts, so a test module calls `split_cpu()` at import.
Each module's strategy takes collective keys of its own (`mirrored_on_cpus(..., key_base)`): a second
strategy of the same size would reuse the first one's collective instances ("Shape mismatch in the
collective instance"), and one of another module would share its group.
"""

import tensorflow as tf


def split_cpu(count=3):
    """The CPU as `count` logical devices; False where TensorFlow had already started (a test that
    needs them then skips)."""
    try:
        tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                                   [tf.config.LogicalDeviceConfiguration()] * count)
        return True
    except RuntimeError:
        return False


def mirrored_on_cpus(replicas, key_base):
    """A MirroredStrategy over /cpu:0 .. /cpu:replicas-1 whose collective keys start at `key_base`."""

    class Strategy(tf.distribute.MirroredStrategy):
        _collective_key_base = key_base

    return Strategy([f"/cpu:{i}" for i in range(replicas)])


def strategy_for(replicas, two_replicas):
    """None for one device, else the module's two-replica strategy (`two_replicas()`); the test skips
    where TensorFlow had started before the module made its logical CPUs."""
    if replicas == 1:
        return None
    strategy = two_replicas()
    if strategy.num_replicas_in_sync != replicas:
        import pytest

        pytest.skip("TensorFlow started before this module made its logical CPUs")
    return strategy


def apply_step(optimizer, variable, gradients, strategy=None):
    """One `optimizer.apply` of one variable: `gradients[r]` (a numpy array) on replica r of
    `strategy`, or `gradients[0]` with no strategy."""
    if strategy is None:
        optimizer.apply([tf.constant(gradients[0])], [variable])
        return

    def replica_step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        optimizer.apply([tf.gather(tf.constant(gradients), replica)], [variable])

    strategy.run(replica_step)


def train_variable(strategy, make_optimizer, gradients, replicas, entries, steps):
    """A zero variable of `entries` after each of `steps` steps (a list of arrays) of the optimizer
    `make_optimizer()` returns, made in the strategy's scope (an inner optimizer's slots are variables
    of the strategy); `gradients(step, replica)` is replica r's gradient, `strategy` None for one
    device."""
    import keras
    import numpy as np

    with strategy.scope() if strategy is not None else tf.init_scope():
        variable = keras.Variable(np.zeros(entries, np.float32))
        optimizer = make_optimizer()
        optimizer.build([variable])
    after = []
    for step in range(steps):
        apply_step(optimizer, variable, np.stack([gradients(step, r) for r in range(replicas)]), strategy)
        after.append(variable.numpy().copy())
    return after


def summed_over_replicas(strategy, variable):
    """A per-replica variable's copies summed (numpy), or its value on one device (`strategy` None):
    what the replicas hold together, e.g. every residual's share of what was not yet sent."""
    if strategy is None:
        return variable.numpy()
    return sum(local.numpy() for local in strategy.experimental_local_results(variable))
