"""TopKOptimizer for tf_keras (Keras 2): the same wrapper as `tf_topk.TopKOptimizer`, for `tf_keras.optimizers`.

Built like tf_keras's own LossScaleOptimizer: it wraps an inner optimizer
(`tf_keras.optimizers.SGD`, `Adam`, ...), delegates learning rate, iterations
and the update rule to it, and replaces only the dense all-reduce of the
gradients with `tf_topk.SparseExchange`. tf_keras has a supported hook for
that: the exchange runs in `aggregate_gradients`, and the summed gradients
reach the inner optimizer through `apply_gradients(...,
skip_gradients_aggregation=True)`, so the inner optimizer is never switched
off or patched to skip its own all-reduce.

    with strategy.scope():
        optimizer = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1))
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        optimizer.build(model.trainable_variables)   # so the autopilot can measure

With no density given, the autopilot measures the cluster when the
optimizer is built (`tf_topk.autopilot`). tf_keras's fit builds it inside
its first traced step, where nothing can be timed (the autopilot then
assumes a 1 Gbit/s link and says so): build it under the strategy's scope
before fit, as above. `density=0.001` keeps a fixed density.

Only the current optimizers (`tf_keras.optimizers.*`, the default since
TensorFlow 2.11) are wrapped, not `tf_keras.optimizers.legacy.*`: each legacy
optimizer has a current twin with the same update rule and arguments, and
the legacy ones aggregate and mix precision through other code paths
(OptimizerV2 and its own LossScaleOptimizer).
"""

import copy
import os

import tensorflow as tf
import tf_keras

from tf_topk.adapter import (FROM_CONFIG, InnerOverrides, TopKWrapper, check_inner_only_arguments,
                             check_inner_optimizer, exchange_parts, wrapper_exchange_config)

# Arguments of tf_keras.optimizers.Optimizer that act in its own
# apply_gradients, which the wrapper replaces: they belong on the inner
# optimizer. get_config writes them with these values, so they are accepted.
_INNER_ONLY_DEFAULTS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
    "ema_momentum": 0.99, "ema_overwrite_frequency": None, "jit_compile": False,
}


def _without_slots(add_variable_from_reference, names, variables, key=None):
    """tf_keras's `add_variable_from_reference`, returning None for the slots `names` of `variables`
    (keys by `key`; None: of every variable). tf_keras's SGD makes a momentum slot `m` per variable
    whatever its momentum, and updates without momentum where the slot is None: with momentum
    correction the velocity is the exchange's, so no slot is made; Adam's moments of a variable whose
    update the exchange applies itself are never read."""

    def add_variable(model_variable, variable_name, shape=None, initial_value=None):
        if variable_name in names and (variables is None or key(model_variable) in variables):
            return None
        return add_variable_from_reference(model_variable, variable_name, shape=shape, initial_value=initial_value)

    return add_variable


@tf_keras.saving.register_keras_serializable(package="tf_topk")
class TopKOptimizer(TopKWrapper, tf_keras.optimizers.Optimizer):
    """Top-k gradient sparsification with error feedback around any tf_keras optimizer.

    The arguments and their meaning are those of `tf_topk.TopKOptimizer`
    (Keras 3): inner_optimizer (a `tf_keras.optimizers.Optimizer`, not a
    legacy one, not a LossScaleOptimizer), density, method, min_size,
    bucket_bytes, error_feedback, momentum_correction (for an inner
    `tf_keras.optimizers.SGD` with momentum > 0, or Adam's for an inner
    `Adam` or `AdamW`; off unless asked for), variance_warmup_steps, local_clipnorm, name,
    exchange_mode, selection_scope, density_warmup_steps, decoupled_momentum
    (DeMo for an inner `Adam` or `AdamW`; "auto" takes it at a fixed density
    of 0.01 or less, and with no density where the autopilot's plan
    sparsifies; tf_keras's clipnorm, clipvalue, global_clipnorm and use_ema act
    in the inner optimizer's own update, which it replaces: with one of those
    "auto" keeps top-k in front of the inner optimizer and says so, and True
    is a ValueError), link (the link rate the autopilot plans for, stated
    instead of measured), and `config` (a `tf_topk.ExchangeConfig`, whose fields the
    arguments given replace), selector, memory and router (parts for the
    exchange; `get_config` of an optimizer given any raises
    NotImplementedError).
    Not `sparse_updates` (Keras 3 only): tf_keras applies updates through its
    own distributed apply, which takes dense or IndexedSlices gradients.
    Residuals and velocities are per-replica variables of this optimizer,
    saved in checkpoints, BackupAndRestore backups and SavedModels; a step
    where any replica has a non-finite gradient is skipped by every replica
    (counted in `skipped_steps`).

    Build the inner optimizer in the strategy's scope, as any tf_keras
    optimizer. Mixed precision: the LossScaleOptimizer goes outside, and
    under the "mixed_float16" policy `model.compile` puts it there. It calls
    `aggregate_gradients` (the exchange) and then checks the summed gradients,
    which are NaN on a step some replica could not send: every replica skips
    it and lowers its loss scale together.

    Example:
      >>> opt = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1), density=0.01)
      >>> model.compile(optimizer=opt, loss="mse")
      >>> dgc = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1, momentum=0.9), density=0.001,
      ...                                      momentum_correction=True)
      >>> shared = tf_topk.ExchangeConfig(density=0.001, exchange_mode="auto")
      >>> opt = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.SGD(0.1), config=shared, density=0.01)
      >>> opt.density, opt.exchange_mode        # the argument given, then config's
      (0.01, 'auto')
    """

    def __init__(self, inner_optimizer, density=FROM_CONFIG, method=FROM_CONFIG, min_size=FROM_CONFIG,
                 bucket_bytes=FROM_CONFIG, error_feedback=FROM_CONFIG, momentum_correction=FROM_CONFIG,
                 local_clipnorm=FROM_CONFIG, name=None, exchange_mode=FROM_CONFIG, sparse_updates=FROM_CONFIG, *,
                 variance_warmup_steps=FROM_CONFIG, selection_scope=FROM_CONFIG,
                 density_warmup_steps=FROM_CONFIG, decoupled_momentum=FROM_CONFIG, link=FROM_CONFIG,
                 config=None, selector=None, memory=None, router=None, **kwargs):
        if isinstance(inner_optimizer, tf_keras.optimizers.legacy.Optimizer):
            raise ValueError(
                f"TopKOptimizer does not wrap legacy optimizers (got tf_keras.optimizers.legacy."
                f"{type(inner_optimizer).__name__}): use its current twin, e.g. "
                "tf_keras.optimizers.SGD(0.1) for tf_keras.optimizers.legacy.SGD(0.1)")
        check_inner_optimizer(inner_optimizer, tf_keras.optimizers.Optimizer, TopKOptimizer,
                              tf_keras.mixed_precision.LossScaleOptimizer, "tf_keras")
        exchange_config, method_note = wrapper_exchange_config(
            inner_optimizer, tf_keras.optimizers.SGD, (tf_keras.optimizers.Adam, tf_keras.optimizers.AdamW),
            "tf_keras", config, density=density, method=method,
            min_size=min_size, bucket_bytes=bucket_bytes, error_feedback=error_feedback,
            momentum_correction=momentum_correction, local_clipnorm=local_clipnorm, exchange_mode=exchange_mode,
            variance_warmup_steps=variance_warmup_steps, selection_scope=selection_scope,
            density_warmup_steps=density_warmup_steps, decoupled_momentum=decoupled_momentum, link=link,
            parts_given=any(part is not None for part in (selector, memory, router)),
            sparse_updates=sparse_updates, sparse_updates_available=False)
        parts = exchange_parts(exchange_config, selector=selector, memory=memory, router=router)
        kwargs.pop("is_legacy_optimizer", None)  # written by get_config
        check_inner_only_arguments(kwargs, _INNER_ONLY_DEFAULTS, "tf_keras")
        super().__init__(name=name or "TopKOptimizer", weight_decay=None, jit_compile=False)
        self.inner_optimizer = inner_optimizer
        self._set_exchange_config(exchange_config, parts, {}, method_note)

    # -- state ----------------------------------------------------------------

    def build(self, var_list):
        if getattr(self, "_built", False):
            return
        var_list = list(var_list)
        super().build(var_list)  # the variable -> position index
        self._build_exchange(var_list)
        overrides = dict(self._inner_overrides)
        if self.momentum_correction and self.exchange_config.beta_2 is None:
            overrides["add_variable_from_reference"] = _without_slots(
                self.inner_optimizer.add_variable_from_reference, ("m",), None)
        unused = {self._var_key(var_list[p]) for p in self._positions_the_inner_never_updates(var_list)}
        if unused:  # the exchange applies their update itself (decoupled momentum, Adam's momentum correction)
            overrides["add_variable_from_reference"] = _without_slots(
                self.inner_optimizer.add_variable_from_reference, ("m", "v", "vhat"), unused, self._var_key)
        with InnerOverrides(self.inner_optimizer, overrides):
            self.inner_optimizer.build(var_list)
        self._built = True

    def _make_variable(self, name, shape, dtype, kind, initial=0):
        synchronization = tf.VariableSynchronization.AUTO if kind == "counter" else tf.VariableSynchronization.ON_READ
        aggregation = tf.VariableAggregation.SUM if kind == "state" else tf.VariableAggregation.ONLY_FIRST_REPLICA
        with tf.init_scope():
            variable = tf.Variable(tf.fill(shape, tf.constant(initial, dtype)), trainable=False, name=name,
                                   synchronization=synchronization, aggregation=aggregation)
        self._variables.append(variable)
        return variable

    @property
    def variables(self):
        variables = super().variables  # a new list of this optimizer's own variables
        variables.extend(self.inner_optimizer.variables)
        return variables

    # -- the step -------------------------------------------------------------

    def _in_build_order(self, grads_and_vars):
        """The gradients at their variables' positions in `build` (None elsewhere)."""
        grads = [None] * len(self._index_dict)
        for grad, variable in grads_and_vars:
            position = self._index_dict.get(self._var_key(variable))
            if position is None:
                raise ValueError(f"TopKOptimizer was built for {len(grads)} variables, not for {variable.name}: "
                                 "build it with every variable it will update (model.trainable_variables)")
            grads[position] = grad
        return grads

    def _exchange_pairs(self, grads_and_vars):
        """(summed gradients, one per pair, and all_finite) from one exchange."""
        result = self._exchange_step(self._in_build_order(grads_and_vars))
        return [result.grads[self._index_dict[self._var_key(v)]] for _, v in grads_and_vars], result.all_finite

    def aggregate_gradients(self, grads_and_vars):
        """The exchange, where tf_keras all-reduces: (summed gradient, variable) pairs.

        A LossScaleOptimizer calls this, then skips the step if a sum is not
        finite; the sums are NaN on a step where any replica had a non-finite
        gradient (which the exchange did not send), so every replica skips it.
        """
        self._check_replica_context("aggregate_gradients")
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        summed, all_finite = self._exchange_pairs(grads_and_vars)
        nan = float("nan")
        return [(tf.where(all_finite, g, tf.constant(nan, g.dtype)), v) for g, (_, v) in zip(summed, grads_and_vars)]

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        """Exchange the gradients and apply their sum through the inner optimizer,
        or skip the step on every replica. With skip_gradients_aggregation=True
        (gradients summed already, as a LossScaleOptimizer passes them after
        `aggregate_gradients`) they are applied as given."""
        aggregate = kwargs.pop("experimental_aggregate_gradients", True) and not skip_gradients_aggregation
        if kwargs:
            raise ValueError(f"apply_gradients got unexpected arguments: {', '.join(sorted(kwargs))}")
        grads_and_vars = list(grads_and_vars)
        with tf.init_scope():
            self.build([v for _, v in grads_and_vars])
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if not grads_and_vars:
            return self.iterations
        variables = [v for _, v in grads_and_vars]
        if not aggregate:
            self._apply_update([g for g, _ in grads_and_vars], variables)
            return self.iterations
        self._check_replica_context("apply_gradients")
        summed, all_finite = self._exchange_pairs(grads_and_vars)
        self._apply_or_skip(all_finite, lambda grads: self._apply_update(grads, variables), summed)
        return self.iterations

    def _learning_rate_now(self):
        """tf_keras refreshes a schedule's learning rate inside apply_gradients:
        read before it, `learning_rate` is the previous step's, so the schedule
        is read here at this step's iterations."""
        schedule = getattr(self.inner_optimizer, "_learning_rate", None)
        if isinstance(schedule, tf_keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self.inner_optimizer.iterations)
        return self.inner_optimizer.learning_rate

    def _apply_update(self, grads, variables):
        directed = self._direction_positions()
        is_direction = [self._index_dict[self._var_key(v)] in directed for v in variables]
        directions = [(g, v) for g, v, d in zip(grads, variables, is_direction) if d]
        present = [(g, v) for g, v, d in zip(grads, variables, is_direction) if not d]
        if directions:  # first: the learning rate of this iteration, before the inner apply advances it
            self._apply_directions(directions)
        with InnerOverrides(self.inner_optimizer, self._inner_overrides):
            if present:
                self.inner_optimizer.apply_gradients(present, skip_gradients_aggregation=True)
            else:
                self.inner_optimizer.iterations.assign_add(1)
        return tf.constant(True)

    # -- serialization --------------------------------------------------------

    @staticmethod
    def _serialize_inner(optimizer):
        return tf_keras.optimizers.serialize(optimizer)

    @staticmethod
    def _deserialize_inner(config, custom_objects):
        # deserialize edits the config it is given (class names made lower case): give it a copy.
        return tf_keras.optimizers.deserialize(copy.deepcopy(config), custom_objects=custom_objects)


def restore_optimizer_variables(model, saved_model_dir):
    """Restore `model.optimizer`'s variables from the SavedModel it was loaded from.

    tf_keras's `load_model` of a SavedModel compiles the optimizer from its
    configuration but leaves the variables of every optimizer in the files:
    iterations, the inner optimizer's slots and TopKOptimizer's residuals and
    velocities. Resuming without the residuals would drop the gradient mass
    they hold back, so read them back (the model's weights are loaded
    already). Call it in the strategy's scope, on every worker; each
    replica gets its residual as the saved sum / replicas. Returns the
    restore status.

        model = tf_keras.models.load_model(path)
        tf_topk.tf_keras.restore_optimizer_variables(model, path)
    """
    prefix = os.path.join(saved_model_dir, "variables", "variables")
    if not any(name.startswith("optimizer/") for name, _ in tf.train.list_variables(prefix)):
        raise ValueError(f"the SavedModel at {saved_model_dir!r} holds no optimizer variables "
                         "(saved with include_optimizer=False, or before the optimizer was built)")
    model.optimizer.build(model.trainable_variables)
    return tf.train.Checkpoint(optimizer=model.optimizer).restore(prefix).expect_partial()
