"""What the Keras 3 and the tf_keras (Keras 2) adapters share, importing neither Keras.

`tf_topk.keras.TopKOptimizer` and `tf_topk.tf_keras.TopKOptimizer` differ only
in how they speak to their Keras: how they make and track variables, and how
they make the inner optimizer apply without its own dense all-reduce. The rest
is here, written once: the one `ExchangeConfig` built from the wrapper's
arguments and the checks only a wrapper needs, the exchange with its
per-replica state and statistics, the apply-or-skip branch every replica
takes together, the configuration, and `CompressionStats`' logic.

A wrapper class puts `TopKWrapper` before its Keras optimizer class and
defines how its Keras makes variables and (de)serializes the inner optimizer
(and `_tf_variable` where its variables wrap a tf.Variable):

    class TopKOptimizer(TopKWrapper, keras.optimizers.Optimizer):
        def _make_variable(self, name, shape, dtype, kind): ...
        def _serialize_inner(optimizer): ...                    # staticmethod
        def _deserialize_inner(config, custom_objects): ...     # staticmethod
"""

import dataclasses
import threading

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from tf_topk.config import ExchangeConfig
from tf_topk.exchange import STAT_NAMES, SparseExchange, sparsified_positions, warmup_notice
from tf_topk.memory import METHODS, method_code, state_name
from tf_topk.methods import default_method
from tf_topk.updates import apply_directions, constrain
from tf_topk.notices import tell

# ExchangeConfig's fields, which get_config writes flat beside the wrapper's own
# keys, and from_config gathers into one ExchangeConfig again.
CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(ExchangeConfig))

# What an inner SGD may not do for sparse updates, which the wrapper applies
# itself: attribute -> the value that means "not in use".
_SPARSE_UPDATE_FREE = {"weight_decay": None, "clipnorm": None, "clipvalue": None, "global_clipnorm": None,
                       "use_ema": False, "gradient_accumulation_steps": None}


class InnerOverrides:
    """Within the block, the inner optimizer's attributes take the given
    values; afterwards they are as before, so the user's optimizer is left as
    it was given.

    Used for the inner optimizer's cross-replica step (the exchange in place
    of the dense all-reduce) and, with momentum correction, the inner SGD's
    momentum (0: the exchange applies it). Reference-counted under a lock: MirroredStrategy runs replicas in
    threads, which enter and leave the block around the same optimizer
    concurrently. The bookkeeping bypasses the optimizer's attribute tracking,
    so it never lands in a checkpoint.

        with InnerOverrides(sgd, {"momentum": 0.0, "nesterov": False}):
            sgd.apply_gradients(...)   # plain SGD; its momentum is back afterwards
    """

    _lock = threading.Lock()

    def __init__(self, optimizer, overrides):
        self.optimizer = optimizer
        self.overrides = overrides

    def __enter__(self):
        optimizer = self.optimizer
        with self._lock:
            depth = getattr(optimizer, "_tf_topk_override_depth", 0)
            if depth == 0:
                own = vars(optimizer)
                object.__setattr__(optimizer, "_tf_topk_saved",
                                   {name: (name in own, own.get(name)) for name in self.overrides})
                for name, value in self.overrides.items():
                    setattr(optimizer, name, value)
            object.__setattr__(optimizer, "_tf_topk_override_depth", depth + 1)

    def __exit__(self, *exc):
        optimizer = self.optimizer
        with self._lock:
            object.__setattr__(optimizer, "_tf_topk_override_depth", optimizer._tf_topk_override_depth - 1)
            if optimizer._tf_topk_override_depth == 0:
                for name, (had_own, value) in optimizer._tf_topk_saved.items():
                    if had_own:
                        setattr(optimizer, name, value)
                    else:
                        delattr(optimizer, name)
        return False


# What to do where a checkpoint holds another method's state (said after both methods' names).
_METHOD_MISMATCH = ("the two keep different state (a residual of gradients, a velocity, a momentum in a DCT's "
                    "space), so one cannot go on from the other's. Make the optimizer with the method that wrote "
                    "the checkpoint (decoupled_momentum=True or False, momentum_correction=..., the same density "
                    "and inner optimizer), or restore the model's weights alone and start the optimizer afresh")


def check_saved_method(saved_code, code):
    """A ValueError naming both methods where a saved `exchange_method` is not this optimizer's."""
    saved_code = int(saved_code)
    if code and saved_code != code:
        written = METHODS[saved_code] if 0 <= saved_code < len(METHODS) else f"an unknown method ({saved_code})"
        raise ValueError(f"tf_topk: this optimizer's state comes from a checkpoint written with {written}, and "
                         f"this optimizer runs {METHODS[code]}: {_METHOD_MISMATCH}")


# -- argument checks --------------------------------------------------------------------------


def check_inner_optimizer(inner_optimizer, optimizer_class, wrapper_class, loss_scale_class, keras_name):
    """The inner optimizer must be a plain optimizer of this Keras: not a wrapper
    of the same kind, not a LossScaleOptimizer (it goes outside).

    keras_name is the package users import ("keras" or "tf_keras"), used in
    the messages along with the wrapper's public path."""
    wrapper_path = "tf_topk.TopKOptimizer" if keras_name == "keras" else f"tf_topk.{keras_name}.TopKOptimizer"
    if not isinstance(inner_optimizer, optimizer_class):
        raise ValueError(f"inner_optimizer must be a {keras_name}.optimizers.Optimizer instance, "
                         f"got {inner_optimizer!r}")
    if isinstance(inner_optimizer, wrapper_class):
        raise ValueError("inner_optimizer is already a TopKOptimizer; wrap the plain optimizer once")
    if isinstance(inner_optimizer, loss_scale_class):
        # Its apply never reaches the all-reduce switched off by the wrapper,
        # and the optimizer inside it would sum the exchanged gradients again.
        raise ValueError(
            "TopKOptimizer does not take a LossScaleOptimizer as `inner_optimizer` (got "
            f"{type(inner_optimizer).__name__}): its updates would be multiplied by the number of replicas. "
            f"Put the LossScaleOptimizer outside: {keras_name}.mixed_precision.LossScaleOptimizer("
            f"{wrapper_path}({keras_name}.optimizers.SGD(...), density=...)), or set the 'mixed_float16' "
            "policy and let model.compile wrap it")


def is_adam(inner_optimizer, adam_classes):
    """Whether the inner optimizer is Adam or AdamW (of this Keras), whose
    momentum correction is Adam's (`tf_topk.memory.AdamMomentumCorrectionMemory`)."""
    return isinstance(inner_optimizer, adam_classes)


def check_momentum_correction(inner_optimizer, sgd_class, adam_classes, keras_name):
    """The inner optimizer must be SGD with momentum (its momentum moves into
    the exchange) or Adam / AdamW without AMSGrad (its moments do)."""
    if is_adam(inner_optimizer, adam_classes):
        if getattr(inner_optimizer, "amsgrad", False):
            raise ValueError(f"momentum_correction=True with {type(inner_optimizer).__name__} freezes its second "
                             "moment, which AMSGrad's running maximum would not follow: use amsgrad=False, or "
                             "momentum_correction=False")
        return
    is_sgd = isinstance(inner_optimizer, sgd_class)
    if not is_sgd or not inner_optimizer.momentum > 0:
        what = f"SGD with momentum={inner_optimizer.momentum}" if is_sgd else type(inner_optimizer).__name__
        raise ValueError(
            f"momentum_correction=True needs a {keras_name}.optimizers.SGD with momentum > 0, Adam or AdamW as "
            f"inner optimizer (their momentum moves into the exchange), got {what}. For momentum SGD pass e.g. "
            f"{keras_name}.optimizers.SGD(0.1, momentum=0.9); other optimizers train with momentum_correction=False")


# What the inner Adam does in its own `apply` that Adam's momentum correction, which applies the
# sparsified variables' update itself, does not: attribute -> the value that means "not in use".
_ADAM_CORRECTION_FREE = {"clipnorm": None, "clipvalue": None, "global_clipnorm": None, "use_ema": False,
                         "gradient_accumulation_steps": None, "loss_scale_factor": None}


def _update_options_in_use(inner_optimizer):
    """(name, value) of each option of _ADAM_CORRECTION_FREE the inner optimizer has set."""
    return [(name, getattr(inner_optimizer, name, unused)) for name, unused in _ADAM_CORRECTION_FREE.items()
            if getattr(inner_optimizer, name, unused) != unused]


def check_adam_correction_options(inner_optimizer, keras_name):
    """Adam's momentum correction applies the sparsified variables' update
    itself (the exchanged direction, the learning rate, decoupled weight decay
    and the variables' constraints): an inner option acting elsewhere in
    Adam's own `apply` would be skipped for them, so it is refused by name."""
    for name, value in _update_options_in_use(inner_optimizer)[:1]:
        raise ValueError(
            f"momentum_correction=True with {type(inner_optimizer).__name__} applies the sparsified variables' "
            f"update itself, so the inner optimizer's {name}={value!r} would not act on them: leave {name} "
            f"unset, or use momentum_correction=False (the default: top-k with error feedback in front of the "
            f"inner {type(inner_optimizer).__name__}, which keeps every option)")


def check_sparse_updates(inner_optimizer, sgd_class, keras_name, momentum_correction):
    """Sparse updates replace the inner optimizer's update of the sparsified
    variables by `variable -= lr * pairs`: only plain SGD does exactly that."""
    if not isinstance(inner_optimizer, sgd_class):
        raise ValueError(f"sparse_updates=True needs a {keras_name}.optimizers.SGD as inner optimizer (its update "
                         f"is variable -= learning_rate * gradient, which touches only the sent entries), got "
                         f"{type(inner_optimizer).__name__}")
    if inner_optimizer.momentum and not momentum_correction:
        raise ValueError(f"sparse_updates=True needs an SGD without momentum (got momentum="
                         f"{inner_optimizer.momentum}): momentum moves every entry each step. Use "
                         "momentum_correction=True, which keeps the momentum in the exchange")
    for name, unused in _SPARSE_UPDATE_FREE.items():
        value = getattr(inner_optimizer, name, unused)
        if value != unused:
            raise ValueError(f"sparse_updates=True applies plain SGD itself, so the inner SGD's {name}={value!r} "
                             f"would be ignored: leave {name} unset, or use sparse_updates=False")


def check_inner_only_arguments(kwargs, defaults, keras_name):
    """Remove the inner optimizer's own arguments from kwargs (as get_config
    writes them, with their defaults); refuse any other value or name."""
    for name, default in defaults.items():
        value = kwargs.pop(name, default)
        if value != default:
            raise ValueError(f"TopKOptimizer does not take `{name}` (got {value!r}): set it on the inner "
                             f"optimizer, e.g. TopKOptimizer({keras_name}.optimizers.SGD(0.1, {name}=...), "
                             "density=...)")
    if kwargs:
        raise ValueError(f"TopKOptimizer got unexpected arguments: {', '.join(sorted(kwargs))}")


class _FromConfig:
    """The default of the wrappers' exchange arguments: not given, so the value
    of `config=` (or ExchangeConfig's default) holds. Any value given, even
    the default one, replaces config's."""

    def __repr__(self):
        return "<config's>"


FROM_CONFIG = _FromConfig()


def check_decoupled_momentum(inner_optimizer, adam_classes, keras_name, exchange_inside_inner_apply):
    """decoupled_momentum=True replaces the inner Adam's update of the
    sparsified variables by the sign of the decoded momentum: only Adam and
    AdamW, without AMSGrad. Where the exchange runs inside the inner
    optimizer's own `apply` (Keras 3), Keras unscales, clips and accumulates
    the gradient before it and constrains and averages (EMA) the variables
    after it, so every option acts as it does on Adam's own update; where it
    runs before (tf_keras), an option acting in the inner optimizer's own
    update of those variables would be skipped, and is refused by name."""
    kind = type(inner_optimizer).__name__
    if not is_adam(inner_optimizer, adam_classes):
        raise ValueError(f"decoupled_momentum=True needs a {keras_name}.optimizers.Adam or AdamW as inner "
                         f"optimizer (its update of the sparsified variables is replaced by a sign step scaled "
                         f"by its learning rate), got {kind}")
    if getattr(inner_optimizer, "amsgrad", False):
        raise ValueError(f"decoupled_momentum=True with {kind} applies the sign of its own momentum, which "
                         "AMSGrad's running maximum would not act on: use amsgrad=False, or decoupled_momentum=False")
    for name, value in ([] if exchange_inside_inner_apply else _update_options_in_use(inner_optimizer))[:1]:
        raise ValueError(
            f"decoupled_momentum=True with {keras_name}'s {kind} applies the sparsified variables' update "
            f"itself, so the inner optimizer's {name}={value!r} would not act on them: leave {name} unset, use "
            f"decoupled_momentum=False (top-k with error feedback in front of the inner {kind}), or Keras 3's "
            "tf_topk.TopKOptimizer, which keeps every option with it")


def wrapper_exchange_config(inner_optimizer, sgd_class, adam_classes, keras_name, config=None,
                            momentum_correction=FROM_CONFIG, sparse_updates=FROM_CONFIG,
                            sparse_updates_available=True, parts_given=False, exchange_inside_inner_apply=False,
                            **options):
    """The wrapper's one ExchangeConfig: `config` (None: the defaults) with the
    arguments given (not FROM_CONFIG) in place of its fields.

    `options` are ExchangeConfig fields of the same name; sparse_updates is
    sparse_output; momentum_correction=True sets momentum and nesterov to the
    inner SGD's (they move into the exchange), or momentum, beta_2 and
    epsilon to the inner Adam's; False clears them. Not given, it is as
    config says (off by default, for every inner optimizer: top-k with error
    feedback in front of it keeps everything the inner optimizer does). A
    config with momentum set asks for momentum correction, so its values must
    be the inner optimizer's. decoupled_momentum="auto" is resolved here to
    True, False or "auto" (`tf_topk.methods.default_method`; `parts_given`: the wrapper
    was given a selector, memory or router). ExchangeConfig checks the
    values; here is only what needs the inner optimizer.
    """
    if config is None:
        config = ExchangeConfig()
    elif not isinstance(config, ExchangeConfig):
        raise TypeError(f"config must be a tf_topk.ExchangeConfig, got {config!r}")
    changes = {name: value for name, value in options.items() if value is not FROM_CONFIG}
    if sparse_updates is not FROM_CONFIG:
        changes["sparse_output"] = sparse_updates
    if momentum_correction is FROM_CONFIG:
        momentum_correction = config.momentum is not None
    if momentum_correction:
        check_momentum_correction(inner_optimizer, sgd_class, adam_classes, keras_name)
        if is_adam(inner_optimizer, adam_classes):
            check_adam_correction_options(inner_optimizer, keras_name)
        if is_adam(inner_optimizer, adam_classes):
            inner = dict(momentum=float(inner_optimizer.beta_1), nesterov=False,
                         beta_2=float(inner_optimizer.beta_2), epsilon=float(inner_optimizer.epsilon))
        else:
            inner = dict(momentum=float(inner_optimizer.momentum), nesterov=bool(inner_optimizer.nesterov),
                         beta_2=None)
        if config.momentum is not None and any(getattr(config, name) != value for name, value in inner.items()):
            shown = [name for name, value in inner.items() if value is not None or getattr(config, name) is not None]
            kind = type(inner_optimizer).__name__
            raise ValueError(
                f"config has {', '.join(f'{name}={getattr(config, name)}' for name in shown)}, but the inner {kind} "
                f"has {', '.join(f'{name}={inner[name]}' for name in shown)}: with TopKOptimizer the exchange takes "
                f"the inner {kind}'s momentum. Leave config's momentum None and pass momentum_correction=True")
        changes.update(inner)
    else:
        changes.update(momentum=None, nesterov=False, beta_2=None)
    if changes.get("sparse_output", config.sparse_output):
        if not sparse_updates_available:
            raise ValueError("sparse_updates=True is available with Keras 3 (tf_topk.TopKOptimizer) and custom "
                             f"loops (SparseExchange(sparse_output=True)), not with {keras_name}")
        check_sparse_updates(inner_optimizer, sgd_class, keras_name, bool(momentum_correction))
    decoupled, note = changes.get("decoupled_momentum", config.decoupled_momentum), None
    if decoupled is True:
        if parts_given:
            raise ValueError("decoupled_momentum=True makes the exchange's memory, which the parts given (selector, "
                             "memory, router) would replace: pass one or the other")
        check_decoupled_momentum(inner_optimizer, adam_classes, keras_name, exchange_inside_inner_apply)
    elif decoupled == "auto":
        resolved = config.replace(**changes)
        skipped = [] if exchange_inside_inner_apply else _update_options_in_use(inner_optimizer)
        changes["decoupled_momentum"], note = default_method(
            resolved, is_adam(inner_optimizer, adam_classes), type(inner_optimizer).__name__,
            amsgrad=getattr(inner_optimizer, "amsgrad", False), skipped_option=skipped[0] if skipped else None,
            asked=parts_given or resolved.momentum is not None or resolved.sparse_output
            or not resolved.error_feedback or resolved.rescale_residuals)
    return config.replace(**changes), note


def exchange_parts(config, **parts):
    """The parts given to a wrapper (selector, memory, router), None left out.

    A memory replaces the one momentum correction makes, in which the inner
    SGD's momentum would go: not both."""
    parts = {name: part for name, part in parts.items() if part is not None}
    if "memory" in parts and config.momentum is not None:
        raise ValueError("momentum_correction=True moves the inner SGD's momentum into the memory the exchange "
                         f"makes, which memory={parts['memory']!r} would replace: pass one or the other")
    return parts


def flat_config(config):
    """`config` as get_config writes it: ExchangeConfig's fields with the
    density's config, momentum and nesterov as momentum_correction (they are
    the inner SGD's), sparse_output as sparse_updates."""
    flat = config.get_config()
    for inner in ("nesterov", "beta_2", "epsilon"):  # the inner optimizer's
        del flat[inner]
    flat["momentum_correction"] = flat.pop("momentum") is not None
    flat["sparse_updates"] = flat.pop("sparse_output")
    return flat


# -- the wrapper --------------------------------------------------------------------------------


class TopKWrapper:
    """The Keras-independent half of TopKOptimizer (a mixin before the Keras
    optimizer class).

    The subclass provides `inner_optimizer`, `_make_variable(name, shape,
    dtype, kind)` with kind "state" (per-replica, summed when read: residuals
    and velocities), "replicated_state" (per-replica storage of a value that
    is the same on every replica, the first replica's when read and restored
    as it is: dense-path velocities), "counter" (skipped_steps) or "stat"
    (per-replica, the first replica's when read), and `_serialize_inner(optimizer)` /
    `_deserialize_inner(config, custom_objects)` for its Keras.
    """

    def _set_exchange_config(self, config, parts, overrides, note=None):
        """Keep the checked config, the parts for the exchange, and the inner
        optimizer's overrides while this optimizer applies through it (with
        momentum correction, no second momentum), and the line to say when the
        exchange is made (`note`: why an inner Adam does not get decoupled
        momentum). Outside tracking: plain values."""
        object.__setattr__(self, "_exchange_config", config)
        object.__setattr__(self, "_method_note", note)
        object.__setattr__(self, "_exchange_parts", dict(parts))
        overrides = dict(overrides)
        if self.momentum_correction and config.beta_2 is None:
            overrides.update(momentum=0.0, nesterov=False)
        object.__setattr__(self, "_inner_overrides", overrides)
        object.__setattr__(self, "_exchange_object", None)
        object.__setattr__(self, "_loaded_autopilot_plan", None)  # from_config sets a saved plan

    @property
    def exchange_config(self):
        """The ExchangeConfig the exchange is made with (read-only, as `config=`
        and the arguments made it at construction)."""
        return self._exchange_config

    # The options by their old attribute names, read from the one config.
    density = property(lambda self: self._exchange_config.density)
    method = property(lambda self: self._exchange_config.method)
    min_size = property(lambda self: self._exchange_config.min_size)
    bucket_bytes = property(lambda self: self._exchange_config.bucket_bytes)
    error_feedback = property(lambda self: self._exchange_config.error_feedback)
    local_clipnorm = property(lambda self: self._exchange_config.local_clipnorm)
    exchange_mode = property(lambda self: self._exchange_config.exchange_mode)
    selection_scope = property(lambda self: self._exchange_config.selection_scope)
    density_warmup_steps = property(lambda self: self._exchange_config.density_warmup_steps)
    momentum_correction = property(lambda self: self._exchange_config.momentum is not None)

    @property
    def decoupled_momentum(self):
        """Whether decoupled momentum runs: True or False (the exchange's, once built); "auto" before an
        optimizer given no density is built, where the autopilot's plan decides."""
        exchange = self.__dict__.get("_exchange_object")
        return (self._exchange_config if exchange is None else exchange.config).decoupled_momentum

    sparse_updates = property(lambda self: self._exchange_config.sparse_output)
    link = property(lambda self: self._exchange_config.link)

    def _tf_variable(self, variable):
        """The tf.Variable behind one made by `_make_variable`."""
        return variable

    def _build_exchange(self, var_list):
        """The SparseExchange, its per-replica state, skipped_steps and the statistics."""
        # The exchange's state by suffix ("residual", "momentum"), tracked one by one by _make_variable.
        object.__setattr__(self, "_exchange_state", {})

        def make_state(variable, dtype, suffix, replicated=False):
            state = self._make_variable(state_name(variable, suffix), variable.shape, tf.as_dtype(dtype).name,
                                        "replicated_state" if replicated else "state")
            self._exchange_state.setdefault(suffix, []).append(state)
            return self._tf_variable(state)

        # Held outside Keras tracking: its state is the variables above. None when built with no
        # variables (Keras allows `build([])`; such an optimizer then has nothing to apply to).
        object.__setattr__(self, "_exchange_object", SparseExchange(
            var_list, self._exchange_config, make_state=make_state, saved_plan=self._saved_autopilot_plan(),
            plan_decoupled_momentum=self._exchange_config.decoupled_momentum == "auto",
            **self._exchange_parts) if var_list else None)
        if self._method_note and self._exchange_object is not None and self._exchange_object.sparse_positions:
            tell(self._method_note)
        self.skipped_steps = self._make_variable("skipped_steps", (), "int64", "counter")
        self._stat_variables = {stat: self._make_variable(f"compression_{stat}", (), "float32", "stat")
                                for stat in STAT_NAMES}
        # Which method's state this is, saved with it: a checkpoint of another method's is refused
        # (`_check_method`). Its value is set when it is made, so a restore (deferred or not) overwrites it.
        exchange = self._exchange_object
        object.__setattr__(self, "_method_code", 0 if exchange is None else method_code(exchange.memory))
        self.exchange_method = self._make_variable("exchange_method", (), "int64", "counter",
                                                   initial=self._method_code)

    def _positions_the_inner_never_updates(self, var_list):
        """Positions in `var_list` (the variables of `build`) of those whose update the exchange's memory
        applies itself (`applies_update`: decoupled momentum, Adam's momentum correction): the inner
        optimizer needs no slots for them. Known before the exchange is made where the method is (a
        memory given, or one the config names); with no density given, the plan decides, and makes the
        exchange first."""
        exchange = self.__dict__.get("_exchange_object")
        if exchange is not None:
            return list(exchange.sparse_positions) if exchange.memory.applies_update else []
        memory, config = self._exchange_parts.get("memory"), self._exchange_config
        applies = memory.applies_update if memory is not None else \
            config.decoupled_momentum is True or config.beta_2 is not None
        return sparsified_positions(var_list, config.min_size) if applies and var_list else []

    def _check_method(self):
        """Refuse to go on from state another method wrote: the saved `exchange_method` must be this
        optimizer's (0, a memory of the user's: unchecked). In the step, where a tf.train.Checkpoint's
        restore (deferred or not) has put it by then."""
        code = self._method_code
        if not code:
            return
        saved = tf.convert_to_tensor(self._tf_variable(self.exchange_method))
        written_by = tf.gather(tf.constant(METHODS), tf.clip_by_value(saved, 0, len(METHODS) - 1))
        tf.debugging.Assert(tf.equal(saved, code), [tf.strings.join([
            "tf_topk: this optimizer's state was restored from a checkpoint written with ", written_by,
            f", and this optimizer runs {METHODS[code]}: {_METHOD_MISMATCH}"])])

    def _saved_autopilot_plan(self):
        """The autopilot's plan this optimizer came with (`from_config`), or None."""
        return self._loaded_autopilot_plan

    def _autopilot_plan_config(self):
        """The measured plan to save: the exchange's (once built), else the one it came with."""
        exchange = self.__dict__.get("_exchange_object")
        plan = None if exchange is None else exchange.autopilot_plan
        if plan is not None:
            return plan.get_config() if plan.calibration is not None else None
        return self._saved_autopilot_plan()

    # -- what every wrapper shows ---------------------------------------------------------------

    @property
    def exchange(self):
        """The SparseExchange in use (after the first step or `build`)."""
        return self._exchange_object

    @property
    def residuals(self):
        """Per sparsified variable, this replica's residual."""
        return list(getattr(self, "_exchange_state", {}).get("residual", []))

    @property
    def velocities(self):
        """With momentum correction: the per-replica velocities, sparsified
        variables first, then the dense-path ones."""
        return list(getattr(self, "_exchange_state", {}).get("momentum", []))

    def compression_stats(self):
        """The last step's statistics (this worker's first replica) as floats."""
        if not getattr(self, "_stat_variables", None):
            return {}
        return {stat: float(self._tf_variable(v).numpy()) for stat, v in self._stat_variables.items()}

    # The inner optimizer's, read and set there (as LossScaleOptimizer delegates them).
    iterations = property(lambda self: self.inner_optimizer.iterations,
                          lambda self, value: setattr(self.inner_optimizer, "iterations", value))
    learning_rate = property(lambda self: self.inner_optimizer.learning_rate,
                             lambda self, value: setattr(self.inner_optimizer, "learning_rate", value))

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- the step -------------------------------------------------------------------------------

    def _check_replica_context(self, method):
        if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
            raise RuntimeError(
                f"TopKOptimizer.{method} must run in a replica context (inside strategy.run or model.fit). "
                "It was called in a cross-replica context, which is what LossScaleOptimizer does: for mixed "
                "precision, see TopKOptimizer's documentation.")

    def _exchange_step(self, grads):
        """Exchange `grads` (one per variable of `build`, None allowed) and record the statistics."""
        if self._exchange_object is None:
            raise ValueError(f"{type(self).__name__} was built with no variables (build([])), so it has none to "
                             "apply gradients to: build it with the variables it trains")
        exchange = self._exchange_object
        self._check_method()
        rate = self._learning_rate_now() if exchange.memory.follows_learning_rate else None
        result = exchange(grads, step=self.iterations, learning_rate=rate)
        for stat, variable in self._stat_variables.items():
            variable.assign(tf.cast(result.stats[stat], tf.float32))
        return result

    def _direction_positions(self):
        """Positions (in build order) whose exchanged gradient is an update
        direction to apply by SGD: the sparsified variables, when the memory
        says so (Adam's momentum correction)."""
        exchange = self._exchange_object
        return frozenset(exchange.sparse_positions) if exchange.memory.applies_update else frozenset()

    def _learning_rate_now(self):
        """The inner optimizer's learning rate for this step (before its own
        apply, which is what advances a schedule in some Kerases)."""
        return self.inner_optimizer.learning_rate

    def _apply_directions(self, pairs, learning_rate=None, decay_and_constrain=True):
        """`tf_topk.updates.apply_directions` of (direction, variable) pairs at the inner optimizer's
        learning rate (`learning_rate`, else its rate now) with its decoupled weight decay (where it
        decays that variable), then the variables' constraints. decay_and_constrain=False where the
        inner optimizer's own apply decays and constrains the variables (Keras 3): only the update."""
        inner = self.inner_optimizer
        decays = [float(inner.weight_decay) if decay_and_constrain and inner.weight_decay
                  and inner._use_weight_decay(variable) else 0.0 for _, variable in pairs]
        apply_directions([(d, self._tf_variable(v)) for d, v in pairs],
                         self._learning_rate_now() if learning_rate is None else learning_rate, decays)
        if decay_and_constrain:  # as the inner apply does after its update
            constrain([variable for _, variable in pairs])

    def _apply_or_skip(self, all_finite, apply, grads):
        """`apply(grads)` on every replica when all_finite, else count a skipped
        step; `apply` returns tf.constant(True).

        all_finite is the same on every replica (the exchange all-reduced it).
        Where the strategy needs merge_call (the inner update calls it, and it may
        not sit inside a cond in a replica context), branch in the cross-replica
        context and re-enter the replicas, as LossScaleOptimizer does.
        """
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(all_finite, lambda: apply(grads), self._skip_update)
            return

        def branch_in_cross_replica_context(distribution, grads, all_finite):
            all_finite = distribution.experimental_local_results(all_finite)[0]

            def apply_on_each_replica():
                distribution.extended.call_for_each_replica(apply, args=(grads,))
                return tf.constant(True)

            tf.cond(all_finite, apply_on_each_replica, self._skip_update)

        tf.distribute.get_replica_context().merge_call(branch_in_cross_replica_context, args=(grads, all_finite))

    def _skip_update(self):
        self.skipped_steps.assign_add(1)
        return tf.constant(False)

    # -- configuration: the subclass serializes its inner optimizer ------------------------------

    def get_config(self):
        """The inner optimizer's config and the exchange config's fields, flat
        (as earlier versions wrote them). An optimizer given parts (selector,
        memory, router) raises NotImplementedError: a config cannot hold them,
        and one loaded without them would train with the default parts."""
        if self._exchange_parts:
            raise NotImplementedError(
                f"TopKOptimizer.get_config cannot describe the exchange parts given to it "
                f"({', '.join(f'{name}={part!r}' for name, part in self._exchange_parts.items())}): save "
                "weights or a checkpoint instead (model.save_weights, tf.train.Checkpoint), and make the "
                "optimizer with its parts again to load them")
        config = super().get_config()
        config.pop("learning_rate", None)  # the inner optimizer's
        config["inner_optimizer"] = self._serialize_inner(self.inner_optimizer)
        config.update(flat_config(self._exchange_config))
        # The autopilot's measured plan, so that a model resumed on the same cluster runs it again.
        plan = self._autopilot_plan_config()
        if plan is not None:
            config["autopilot_plan"] = plan
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Reads what get_config writes, and earlier versions' configs (the
        same flat keys, fewer of them; without exchange_mode: "allgather",
        without momentum_masking: True, what they ran): ExchangeConfig's fields make one
        ExchangeConfig, momentum_correction and sparse_updates apply to it.
        The autopilot's saved plan comes back with the optimizer and is run
        again where the cluster and the model are the same."""
        config = dict(config)
        saved_plan = config.pop("autopilot_plan", None)
        inner_optimizer = cls._deserialize_inner(config.pop("inner_optimizer"), custom_objects)
        fields = {name: config.pop(name) for name in CONFIG_FIELDS if name in config}
        # Written before exchange_mode existed, when every exchange was an
        # all_gather: resumes as it ran, not with today's default ("auto").
        fields.setdefault("exchange_mode", "allgather")
        # Written before momentum_masking was saved, when momentum correction always masked.
        fields.setdefault("momentum_masking", True)
        optimizer = cls(inner_optimizer, config=ExchangeConfig.from_config(fields), **config)
        object.__setattr__(optimizer, "_loaded_autopilot_plan", saved_plan)  # used when it builds
        return optimizer


def find_topk_optimizer(optimizer):
    """The TopKOptimizer (of either Keras) in `optimizer`, unwrapping LossScaleOptimizer; None if absent."""
    while optimizer is not None:
        if isinstance(optimizer, TopKWrapper):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


# -- CompressionStats ---------------------------------------------------------------------------

# What TensorBoard's scalar summary writes, without needing the tensorboard
# package: tf.summary.scalar raises TBNotInstalledError without it, and
# TensorFlow 2.21 does not depend on it.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
    plugin_name="scalars"))


# What CompressionStats adds to the epoch logs (and so to the progress bar) by default: the density sent and
# the bytes against the dense all-reduce's; every statistic with logs="all", and in TensorBoard either way.
COMPACT_LOGS = ("density", "bytes_ratio")


def bytes_ratio(stats):
    """A worker's bytes a step as a fraction of what the dense all-reduce would send (0 where nothing would)."""
    return stats["bytes_sent"] / stats["bytes_dense"] if stats.get("bytes_dense") else 0.0


class CompressionStatsLogic:
    """The behaviour of CompressionStats (a mixin before each Keras's Callback):
    the statistics in the epoch logs, and as TensorBoard scalars with `log_dir`."""

    def _init_stats(self, log_dir, update_freq, logs="compact"):
        if isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1:
            raise ValueError(f"update_freq must be an int >= 1, got {update_freq!r}")
        if logs not in ("compact", "all"):
            raise ValueError(f"logs must be 'compact' (density and bytes ratio) or 'all', got {logs!r}")
        self.logs = logs
        self.log_dir = log_dir
        self.update_freq = update_freq
        self._writer = None
        self._step = 0

    def _optimizer(self):
        optimizer = find_topk_optimizer(self.model.optimizer)
        if optimizer is None:
            raise ValueError("CompressionStats needs a model compiled with tf_topk.TopKOptimizer, "
                             f"got optimizer {self.model.optimizer!r}")
        return optimizer

    def on_train_begin(self, logs=None):
        self._warn_if_the_run_ends_in_the_warmup(self._optimizer())
        if self.log_dir:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def _warn_if_the_run_ends_in_the_warmup(self, optimizer):
        """Says so (on the chief) where `fit`'s planned steps end inside a fixed density's warm-up: the
        whole run then trains and reports a higher density than the one given."""
        config = optimizer.exchange.config if optimizer.exchange is not None else optimizer.exchange_config
        params = self.params or {}
        if not params.get("epochs") or not params.get("steps"):
            return  # a run of unknown length
        line = warmup_notice(config, "fit", int(optimizer.iterations.numpy()) + params["epochs"] * params["steps"])
        if line:
            tell(line, getattr(self.model, "distribute_strategy", None))

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._writer is not None and self._step % self.update_freq == 0:
            with self._writer.as_default(step=self._step):
                for name, value in self._optimizer().compression_stats().items():
                    tf.summary.write(f"topk/{name}", tf.cast(value, tf.float32), metadata=_SCALAR_METADATA)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            stats = self._optimizer().compression_stats()
            stats = {**stats, "bytes_ratio": bytes_ratio(stats)} if stats else {}
            for name, value in stats.items():
                if self.logs == "all" or name in COMPACT_LOGS:
                    logs[f"topk_{name}"] = value

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
