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
