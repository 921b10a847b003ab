"""TopKOptimizer: a Keras 3 optimizer wrapper that sends top-k sparsified gradients.

Built like Keras's LossScaleOptimizer: it wraps an inner optimizer (SGD, Adam,
AdamW, ...), delegates learning rate, iterations and the update rule to it, and
replaces only the dense all-reduce of the gradients with
`tf_topk.SparseExchange` (error feedback, top-k selection, one all_gather per
bucket). Residuals are per-replica optimizer variables, saved in checkpoints
and `.keras` files.

    with strategy.scope():
        model.compile(
            optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), density=0.001),
            loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(...)

Differences from the inner optimizer alone:
- gradient clipping and weight decay of the inner optimizer act on the summed
  (exchanged) gradient, not on each replica's local gradient;
- a step where any replica has a non-finite gradient is skipped on every
  replica: no update, iterations not advanced, residuals unchanged (counted in
  `skipped_steps`);
- no XLA: compile the model with `jit_compile=False` where Keras would pick
  XLA (a GPU machine without a distribution strategy).
"""

import threading

import keras
import tensorflow as tf

from tf_topk.exchange import (DEFAULT_MIN_SIZE, STAT_NAMES, SparseExchange, check_bucket_bytes,
                              check_min_size)
from tf_topk.keras.loss_scale_fix import apply_loss_scale_fix
from tf_topk.keras.mwms_fix import apply_mwms_fix
from tf_topk.memory import state_name
from tf_topk.ops import check_method
from tf_topk.schedule import DensitySchedule


def disable_dense_all_reduce(optimizer):
    """Stop a Keras 3 optimizer from all-reducing the gradients given to `apply`.

    Keras's TensorFlow optimizer sums gradients over replicas inside `apply()`,
    with no public switch (keras#19308). Gradients from `SparseExchange` are
    already summed: a second all-reduce would multiply them by the number of
    replicas and send the dense gradients after all. Returns the optimizer.
    """
    _check_all_reduce_hook(optimizer)
    optimizer._all_reduce_sum_gradients = _no_all_reduce
    return optimizer


def _no_all_reduce(grads_and_vars):
    return list(grads_and_vars)


def _check_all_reduce_hook(optimizer):
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise RuntimeError(f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: this Keras version "
                           "aggregates gradients differently; tf_topk supports Keras 3.x with TensorFlow")


class _DenseAllReduceOff:
    """Within the block, `optimizer.apply` does not all-reduce; afterwards it
    does again, so the user's optimizer is left as it was given.

    Reference-counted under a lock: MirroredStrategy runs replicas in threads,
    which enter and leave the block around the same optimizer concurrently.
    """

    _lock = threading.Lock()

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __enter__(self):
        optimizer = self.optimizer
        with self._lock:
            depth = getattr(optimizer, "_tf_topk_all_reduce_off", 0)
            if depth == 0:
                # One switched off by disable_dense_all_reduce stays off.
                optimizer._tf_topk_restore = "_all_reduce_sum_gradients" not in vars(optimizer)
                optimizer._all_reduce_sum_gradients = _no_all_reduce
            optimizer._tf_topk_all_reduce_off = depth + 1

    def __exit__(self, *exc):
        optimizer = self.optimizer
        with self._lock:
            optimizer._tf_topk_all_reduce_off -= 1
            if optimizer._tf_topk_all_reduce_off == 0 and optimizer._tf_topk_restore:
                del optimizer._all_reduce_sum_gradients
        return False


# Arguments of keras.optimizers.Optimizer that act in its own `apply`, which the
# wrapper replaces: they belong on the inner optimizer. get_config writes them
# with these defaults, so the defaults are accepted (as LossScaleOptimizer does).
_INNER_ONLY_DEFAULTS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
    "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _check_inner_only_arguments(kwargs):
    """Remove the inner-only arguments from kwargs; refuse any that is not its default."""
    for name, default in _INNER_ONLY_DEFAULTS.items():
        value = kwargs.pop(name, default)
        if value != default:
            raise ValueError(f"TopKOptimizer does not take `{name}` (got {value!r}): set it on the inner "
                             f"optimizer, e.g. TopKOptimizer(keras.optimizers.SGD(0.1, {name}=...), density=...)")
    if kwargs:
        raise ValueError(f"TopKOptimizer got unexpected arguments: {', '.join(sorted(kwargs))}")


@keras.saving.register_keras_serializable(package="tf_topk")
class TopKOptimizer(keras.optimizers.Optimizer):
    """Top-k gradient sparsification with error feedback around any Keras optimizer.

    Args:
      inner_optimizer: the keras.optimizers.Optimizer that applies updates
        (SGD, Adam, ...). Not a TopKOptimizer, and not a LossScaleOptimizer:
        a ValueError.
      density: fraction of each large variable's entries sent per step: a float
        in (0, 1], a list of (step, density) pairs (warm-up) or a callable
        step -> density. Steps are the inner optimizer's iterations.
      method: "gaussian" (default) or "exact", see `tf_topk.approx_topk`.
      min_size: variables with fewer entries (biases, normalisation) take the
        ordinary dense all-reduce, all in one packed call.
      bucket_bytes: bytes of (value, index) pairs per all_gather; None: one
        all_gather per step.
      error_feedback: keep residuals (default True).
      name: optimizer name.

    Mixed precision: the LossScaleOptimizer goes outside, never inside. Set
    the "mixed_float16" policy and `model.compile` wraps the TopKOptimizer in
    one; in a custom training loop, wrap it yourself:
    `keras.mixed_precision.LossScaleOptimizer(tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1)))`.
    Inside (`TopKOptimizer(LossScaleOptimizer(SGD))`) the optimizer within the
    LossScaleOptimizer would all-reduce the already summed gradients again,
    so it is refused.

    Example:
      >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.01)
      >>> model.compile(optimizer=opt, loss="mse")
    """

    def __init__(self, inner_optimizer, density=0.001, method="gaussian", min_size=DEFAULT_MIN_SIZE,
                 bucket_bytes=None, error_feedback=True, name=None, **kwargs):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError("inner_optimizer must be a keras.optimizers.Optimizer instance, "
                             f"got {inner_optimizer!r}")
        if isinstance(inner_optimizer, TopKOptimizer):
            raise ValueError("inner_optimizer is already a TopKOptimizer; wrap the plain optimizer once")
        if isinstance(inner_optimizer, keras.mixed_precision.LossScaleOptimizer):
            # Its apply never reaches the all-reduce switched off here, and the
            # optimizer inside it would sum the exchanged gradients again.
            raise ValueError(
                "TopKOptimizer does not take a LossScaleOptimizer as `inner_optimizer` (got "
                f"{type(inner_optimizer).__name__}): its updates would be multiplied by the number of replicas. "
                "Put the LossScaleOptimizer outside: keras.mixed_precision.LossScaleOptimizer("
                "tf_topk.TopKOptimizer(keras.optimizers.SGD(...), density=...)), or set the 'mixed_float16' "
                "policy and let model.compile wrap it")
        check_method(method)
        DensitySchedule(density)  # validates
        check_min_size(min_size)
        check_bucket_bytes(bucket_bytes)
        _check_inner_only_arguments(kwargs)
        super().__init__(learning_rate=0.0, name=name or "topk_optimizer")
        apply_mwms_fix()  # keras#20585: model.fit under MultiWorkerMirroredStrategy
        apply_loss_scale_fix()  # mixed precision: all replicas agree on skipping a step
        self.inner_optimizer = inner_optimizer
        self.density = density
        self.method = method
        self.min_size = min_size
        self.bucket_bytes = bucket_bytes
        self.error_feedback = bool(error_feedback)
        # The exchange replaces the inner optimizer's dense all-reduce, which is
        # switched off only while this optimizer applies an update through it.
        _check_all_reduce_hook(self.inner_optimizer)
        self._exchange_object = None

    # -- state ----------------------------------------------------------------

    def build(self, var_list):
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._residuals = []  # the exchange's state, as tracked Keras variables

        def make_state(variable, dtype, suffix):
            state = keras.Variable(initializer="zeros", shape=variable.shape, dtype=tf.as_dtype(dtype).name,
                                   trainable=False, aggregation="sum", synchronization="on_read",
                                   name=state_name(variable, suffix))
            self._track_variable(state)
            self._residuals.append(state)
            return state.value

        # Held outside Keras tracking: its state is the Keras variables above.
        object.__setattr__(self, "_exchange_object", SparseExchange(
            var_list, density=self.density, method=self.method, min_size=self.min_size,
            bucket_bytes=self.bucket_bytes, error_feedback=self.error_feedback, make_state=make_state))
        self.skipped_steps = self.add_variable(shape=(), dtype="int64", name="skipped_steps",
                                               aggregation="only_first_replica")
        self._stat_variables = {
            stat: keras.Variable(initializer="zeros", shape=(), dtype="float32", trainable=False,
                                 aggregation="only_first_replica", synchronization="on_read",
                                 name=f"compression_{stat}")
            for stat in STAT_NAMES
        }

    @property
    def exchange(self):
        """The SparseExchange in use (after the first step or `build`)."""
        return self._exchange_object

    @property
    def residuals(self):
        return list(getattr(self, "_residuals", []))

    def compression_stats(self):
        """The last step's statistics (this worker's first replica) as floats."""
        if not getattr(self, "_stat_variables", None):
            return {}
        return {stat: float(keras.ops.convert_to_numpy(v.value)) for stat, v in self._stat_variables.items()}

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    # -- delegation (as LossScaleOptimizer) -----------------------------------

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- the step -------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        grads, trainable_variables = list(grads), list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
            raise RuntimeError(
                "TopKOptimizer.apply must run in a replica context (inside strategy.run or model.fit). "
                "It was called in a cross-replica context, which is what LossScaleOptimizer does: for mixed "
                "precision, see TopKOptimizer's documentation.")
        result = self._exchange_object(grads, step=self.iterations)
        for stat, variable in self._stat_variables.items():
            variable.assign(tf.cast(result.stats[stat], tf.float32))
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(result.all_finite,
                    lambda: self._apply_update(result.grads, trainable_variables),
                    self._skip_update)
        else:
            # As LossScaleOptimizer does: the inner update calls merge_call,
            # which may not sit inside a cond in a replica context, so branch
            # in the cross-replica context and re-enter the replicas.
            def branch_in_cross_replica_context(distribution, grads, all_finite):
                # all_finite is the same on every replica (it was all-reduced).
                all_finite = distribution.experimental_local_results(all_finite)[0]

                def apply_on_each_replica():
                    distribution.extended.call_for_each_replica(self._apply_update,
                                                                args=(grads, trainable_variables))
                    return tf.constant(True)

                tf.cond(all_finite, apply_on_each_replica, self._skip_update)

            tf.distribute.get_replica_context().merge_call(
                branch_in_cross_replica_context, args=(result.grads, result.all_finite))
        return self.iterations

    def _apply_update(self, grads, trainable_variables):
        present = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        with _DenseAllReduceOff(self.inner_optimizer):
            self.inner_optimizer.apply([g for g, _ in present], [v for _, v in present])
        return tf.constant(True)

    def _skip_update(self):
        self.skipped_steps.assign_add(1)
        return tf.constant(False)

    def apply_gradients(self, grads_and_vars):
        grads, trainable_variables = zip(*grads_and_vars)
        return self.apply(list(grads), list(trainable_variables))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError("TopKOptimizer needs the TensorFlow backend's stateful apply")

    # -- serialization --------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        for key in ("learning_rate",):
            config.pop(key, None)
        config.update({
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "density": DensitySchedule(self.density).get_config(),
            "method": self.method,
            "min_size": self.min_size,
            "bucket_bytes": self.bucket_bytes,
            "error_feedback": self.error_feedback,
        })
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        density = config.pop("density")
        if isinstance(density, list):
            density = [tuple(pair) for pair in density]
        return cls(inner, density=density, **config)
