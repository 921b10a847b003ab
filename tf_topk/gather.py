"""An all_gather of rows that are the same size on every replica, in one collective.

`ReplicaContext.all_gather` accepts a different length on every replica, and
pays for it on every call: TensorFlow's collective launcher first all-gathers
the shapes, pads each input to the longest, gathers, and slices every
replica's part back out (`CollectiveReplicaLauncher.all_gather`). The routes
gather buffers whose length every replica knows to be equal (k of a fixed
density, or of a density the replicas voted on a step earlier), so the first
collective is one network round trip spent learning nothing: about a
collective's latency per bucket and step (milliseconds between machines,
more than the pairs' bytes at density 0.001).

`all_gather_rows(context, buffer)` issues the one gather that remains,
through the launcher of the strategy's own `CollectiveAllReduce` (the same
group, instance keys and ordering as TensorFlow's collectives, so it
interleaves with them safely). It needs strategies whose cross-device ops
are collectives (MirroredStrategy's and MultiWorkerMirroredStrategy's
defaults); elsewhere (e.g. `cross_device_ops=ReductionToOneDevice()`) it
falls back to `context.all_gather`, which gives the same result.

Unequal lengths are the caller's error: the collective would fail or hang.
"""

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_utils, values

__all__ = ["all_gather_rows", "gathers_in_one_collective"]


def all_gather_rows(context, buffer):
    """`context.all_gather(buffer, axis=0)` for a rank-1 `buffer` whose length
    is the same on every replica, without the shape exchange.

    context: the replica context (`tf.distribute.get_replica_context()`).
    Returns the [replicas * len(buffer)] concatenation in replica order.

    >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    >>> strategy.run(lambda: all_gather_rows(tf.distribute.get_replica_context(), tf.ones([3]))).shape
    TensorShape([3])
    """
    if context.num_replicas_in_sync == 1:
        return tf.identity(buffer)
    if not gathers_in_one_collective(context.strategy):
        return context.all_gather(buffer, axis=0)
    return context.merge_call(_gather_local_rows, args=(buffer,))


def gathers_in_one_collective(strategy):
    """Whether `all_gather_rows` takes its one-collective path under `strategy`
    (in the graph being built): collective cross-device ops, and replicas that
    meet in a merge call (not so for a replica function compiled by XLA on
    GPUs, which TensorFlow runs per device)."""
    cross_device_ops = getattr(strategy.extended, "_cross_device_ops", None)
    merges = getattr(strategy.extended, "_use_merge_call", lambda: True)()
    return merges and isinstance(cross_device_ops, cross_device_ops_lib.CollectiveAllReduce) and \
        bool(getattr(cross_device_ops, "_launchers", None))


def _gather_local_rows(strategy, buffer):
    """In the cross-replica context: one gather per local device, by that device's launcher."""
    cross_device_ops = strategy.extended._cross_device_ops
    launchers = cross_device_ops._launchers
    local = strategy.experimental_local_results(buffer)
    options = getattr(strategy.extended, "_communication_options", None) or \
        tf.distribute.experimental.CommunicationOptions()

    def gather():
        with cross_device_ops._lock:  # every device issues its collectives in the same order
            return [launcher._all_gather(row, options) for launcher, row in zip(launchers, local)]

    gathered = tf.function(gather)() if tf.executing_eagerly() else gather()
    return distribute_utils.regroup(gathered, wrap_class=values.Mirrored)
