"""Checkpoints that give each replica back its own per-replica state.

Per-replica state (`ON_READ` variables: residuals, velocities) differs between
replicas. TensorFlow saves such a variable as its aggregate (the SUM over
replicas) and a restore gives every replica sum / replicas: nothing is lost,
but a resumed run is not the run that would have happened.

`keep_replica_values(variable)` changes what a checkpoint holds for the
variable: with more than one replica, the stack of every replica's value,
shape `[replicas, *variable.shape]`, gathered with one collective
(`strategy.gather`). A restore then follows one rule for every saved value,
a value of the variable's own shape counting as one row (one replica, or a
checkpoint written before):

- as many rows as replicas: replica r gets row r, exactly;
- otherwise the rows are aggregated as the variable is (SUM: summed) and
  each replica gets what TensorFlow gives (SUM: sum / replicas), so the
  total is kept when the number of replicas changes.

The checkpoint key is the variable's usual one (`.../VARIABLE_VALUE`), so
checkpoints made before still restore, by the sum rule. Saving is a
collective: under MultiWorkerMirroredStrategy every worker must save (the
chief to the real path, the others to temporary ones), as it must already
to read a summed ON_READ variable.

The hook is the variable's own `_serialize_to_tensors` / `_restore_from_tensors`,
which TensorFlow's object-based checkpointing looks up on the object before its
class, so one per-replica object owns the save and the restore: there is no
second entry whose restore could run after it. It serves `tf.train.Checkpoint`,
`tf.train.CheckpointManager`, and Keras objects saved through them (a Keras
variable delegates to the tf.Variable it wraps). Keras weights files go through
`saved_value` / `restore_value` (see `tf_topk.TopKOptimizer.save_own_variables`).
Two saves keep TensorFlow's aggregate: a SavedModel (tf.saved_model.load makes
plain variables of the variable's shape), and an async checkpoint
(`CheckpointOptions(enable_async=True)` first copies each variable's aggregate).
"""

import contextlib
import sys
import weakref

import tensorflow as tf
from tensorflow.python.training.saving import saveable_object

VARIABLE_VALUE = "VARIABLE_VALUE"  # the checkpoint attribute of a variable's value
_MARK = "_tf_topk_keeps_replica_values"


def _is_distributed(variable):
    return isinstance(variable, tf.distribute.DistributedValues)


def num_replicas(variable):
    """Replicas holding a copy of `variable` (1 outside a strategy)."""
    return variable.distribute_strategy.num_replicas_in_sync if _is_distributed(variable) else 1


def keeps_replica_values(variable):
    """Whether `keep_replica_values` was applied to `variable`."""
    return bool(getattr(variable, _MARK, False))


def keep_replica_values(variable):
    """Make checkpoints of per-replica `variable` hold every replica's value.

    Idempotent; returns the variable. A mirrored (ON_WRITE) distributed
    variable is the same on every replica and is left as it is. Outside a
    strategy only the restore changes: it also accepts the rows a multi-replica
    run saved (summed, by the rule above).
    """
    if keeps_replica_values(variable):
        return variable
    if _is_distributed(variable):
        if variable.synchronization != tf.VariableSynchronization.ON_READ:
            return variable
        variable._serialize_to_tensors = _Bound(_serialize, variable)
    variable._restore_from_tensors = _Bound(_restore, variable)
    setattr(variable, _MARK, True)
    return variable


@contextlib.contextmanager
def keeping_replica_values():
    """Within the block, every variable created gets `keep_replica_values`
    before anything can track it (a pending checkpoint restore is applied when
    a variable is tracked, so the hook must already be there).

    Enter it inside the strategy's scope, as the exchange does: entered
    outside, it sees only the components the strategy makes on each device.
    """

    def creator(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        if _is_distributed(variable) or not tf.distribute.has_strategy():
            keep_replica_values(variable)
        return variable

    with tf.variable_creator_scope(creator):
        yield


class _Bound:
    """`function(variable, *args)`, holding the variable weakly: the hook is
    stored on the variable itself and must not keep it alive."""

    def __init__(self, function, variable):
        self._function = function
        self._variable = weakref.ref(variable)

    def __call__(self, *args):
        return self._function(self._variable(), *args)


# -- save --------------------------------------------------------------------------------------


def saved_value(variable):
    """What a checkpoint holds for `variable`, as a tensor (see `saved_values`)."""
    return saved_values([variable])[0]


def saved_values(variables):
    """What a checkpoint holds for each of `variables`, as tensors: for
    variables given `keep_replica_values`, with several replicas, the stack
    of every replica's value, `[replicas, *shape]` (one collective for all of
    them: every worker must call this, with the same variables); for the
    others their value, as TensorFlow saves it."""
    values = [None] * len(variables)
    gathered = {}
    for i, variable in enumerate(variables):
        per_replica = keeps_replica_values(variable) and _is_distributed(variable)  # ON_READ: see the hook
        if per_replica and num_replicas(variable) > 1:
            gathered.setdefault(variable.distribute_strategy, []).append(i)
        elif per_replica:  # one replica: its value is the aggregate, read without a collective
            values[i] = tf.identity(variable.distribute_strategy.experimental_local_results(variable)[0])
        else:
            values[i] = tf.convert_to_tensor(variable.read_value())
    for strategy, positions in gathered.items():
        for i, rows in zip(positions, _gather_rows(strategy, [variables[i] for i in positions])):
            values[i] = rows
    return values


_GATHER_FUNCTIONS = weakref.WeakKeyDictionary()  # strategy -> its tf.function


def _gather_rows(strategy, variables):
    """`[replicas, *shape]` for each variable, gathered across every replica."""
    local = [strategy.experimental_local_results(variable) for variable in variables]
    replica = iter(range(len(local[0])))

    def flat_values(_):  # called once per local replica, in order
        index = next(replica)
        return [tf.reshape(components[index].read_value(), [1, -1]) for components in local]

    per_replica = strategy.experimental_distribute_values_from_function(flat_values)
    function = _GATHER_FUNCTIONS.get(strategy)
    if function is None:
        # One function for every variable: flattened, the inputs differ only in
        # length, which reduce_retracing lets one trace take (an eager gather, or a
        # function per variable, would trace once per variable and save).
        reference = weakref.ref(strategy)  # the function is this key's value: it must not keep it alive
        function = tf.function(lambda values: [reference().gather(v, axis=0) for v in values],
                               reduce_retracing=True, autograph=False)
        _GATHER_FUNCTIONS[strategy] = function
    rows = function(per_replica)
    return [tf.reshape(r, [-1] + v.shape.as_list()) for r, v in zip(rows, variables)]


def _serialize(variable):
    if _saving_a_saved_model():
        # tf.saved_model.load makes plain variables of the variable's shape:
        # the SavedModel holds what TensorFlow writes (the aggregate).
        value = variable.read_value
    else:
        value = lambda: saved_value(variable)  # noqa: E731
    # A callable, as TensorFlow's own ON_READ saveable: a restore builds its
    # specs from this too, and must not start a collective.
    primary = variable.distribute_strategy.experimental_local_results(variable)[0]
    return {VARIABLE_VALUE: saveable_object.SaveSpec(value, "", VARIABLE_VALUE, dtype=variable.dtype,
                                                     device=primary.device)}


def _saving_a_saved_model():
    """Whether this save is tf.saved_model.save's (its variables, or the saver in its graph).

    Nothing passed to `_serialize_to_tensors` tells a SavedModel from a
    checkpoint, so look for TensorFlow's SavedModel writer among the callers.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "save_and_return_nodes"
                and frame.f_globals.get("__name__") == "tensorflow.python.saved_model.save"):
            return True
        frame = frame.f_back
    return False


# -- restore -----------------------------------------------------------------------------------


def restore_value(variable, saved):
    """Assign what `saved_value` (or TensorFlow, or an older tf_topk) saved to
    `variable`, by the rule of this module. Returns the assign op (graph) or None."""
    saved = tf.convert_to_tensor(saved)
    shape = variable.shape
    if saved.shape.rank is not None and not (saved.shape.is_compatible_with(shape) or (
            saved.shape.rank == shape.rank + 1 and saved.shape[1:].is_compatible_with(shape))):
        raise ValueError(f"the saved value of {variable.name} has shape {saved.shape}; expected {shape} (its "
                         f"sum over replicas) or [replicas, *{shape.as_list()}] (each replica's value)")
    rows = tf.reshape(tf.cast(saved, variable.dtype), [-1] + shape.as_list())
    replicas = num_replicas(variable)
    fallback = _aggregate(rows, variable.aggregation, replicas)

    def value_for(replica_id):
        count = rows.shape[0]
        if count is not None:
            return rows[replica_id] if count == replicas else fallback
        return tf.cond(tf.equal(tf.shape(rows)[0], replicas),
                       lambda: tf.gather(rows, replica_id), lambda: fallback)

    if not _is_distributed(variable):
        return variable.assign(value_for(0), read_value=False)
    strategy = variable.distribute_strategy
    values = strategy.experimental_distribute_values_from_function(
        lambda context: value_for(context.replica_id_in_sync_group))
    assigns = [component.assign(value, read_value=False) for component, value in
               zip(strategy.experimental_local_results(variable), strategy.experimental_local_results(values))]
    return None if tf.executing_eagerly() else tf.group(assigns)


def _aggregate(rows, aggregation, replicas):
    """What each of `replicas` gets when the rows cannot be given out one per
    replica: TensorFlow's rule for a value saved as the aggregate."""
    if aggregation == tf.VariableAggregation.SUM:
        return tf.reduce_sum(rows, axis=0) / replicas
    if aggregation == tf.VariableAggregation.MEAN:
        return tf.reduce_mean(rows, axis=0)
    return rows[0]


def _restore(variable, restored_tensors):
    saved = restored_tensors[VARIABLE_VALUE]
    if not _is_distributed(variable) and saved.shape == variable.shape:
        # Outside a strategy a value of the variable's shape is restored as
        # TensorFlow restores it.
        return type(variable)._restore_from_tensors(variable, restored_tensors)
    return restore_value(variable, saved)
