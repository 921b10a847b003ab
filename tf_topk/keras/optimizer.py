"""TopKOptimizer: a Keras 3 optimizer wrapper that sends top-k sparsified gradients.

Built like Keras's LossScaleOptimizer: it wraps an inner optimizer (SGD, Adam,
AdamW, ...), delegates learning rate, iterations and the update rule to it, and
replaces only the dense all-reduce of the gradients with
`tf_topk.SparseExchange` (error feedback, top-k selection, one all_gather per
bucket). Residuals are per-replica optimizer variables, saved in checkpoints
and `.keras` files.

    with strategy.scope():
        model.compile(
            optimizer=tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
            loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(...)

With no density given, the autopilot measures the cluster when the
optimizer is built and chooses by predicted time: every entry dense where
no density would be faster (a fast link, a small model, one replica), else
routes and an adaptive density (`tf_topk.autopilot`). `density=0.001` keeps
a fixed one.

Where the exchange sits: the wrapper's `apply` is the inner optimizer's own
`apply`, so Keras's order holds by construction: unscale (loss_scale_factor),
set aside the variables overwritten with their gradient (float8), clip, then
with gradient accumulation average the micro-steps, and only on an update
step the cross-replica step, then the constraints and the EMA. The exchange
takes the place of that cross-replica step (the TensorFlow backend's
`_backend_update_step`, which all-reduces, then updates): it sees each
replica's gradient as Keras's all-reduce would, clipped and accumulated, so
error feedback keeps what that gradient did not send. Keras's weight decay,
which it applies just before that step, runs inside it, in the branch taken
when every replica's gradient is finite.

Differences from the inner optimizer alone:
- a step where any replica has a non-finite gradient is skipped on every
  replica: no update and no weight decay, iterations not advanced, residuals
  unchanged (counted in `skipped_steps`); an inner EMA still averages the
  (unchanged) weights, and with gradient accumulation the skipped step's
  micro-steps are dropped and counted, so the next ones start a new
  accumulation;
- no XLA: compile the model with `jit_compile=False` where Keras would pick
  XLA (a GPU machine without a distribution strategy);
- a sparse gradient (`tf.IndexedSlices`, an Embedding's) is made dense before
  the exchange: the selection runs over the whole table, and the inner
  optimizer updates it as it updates a dense gradient (the same values as
  Keras, at the cost of a pass over every row).
"""

import keras
import numpy as np
import tensorflow as tf

from tf_topk.adapter import (FROM_CONFIG, InnerOverrides, TopKWrapper, check_inner_only_arguments,
                             check_inner_optimizer, check_saved_method, exchange_parts, wrapper_exchange_config)
from tf_topk.sparse_gradient import SparseGradient
from tf_topk.updates import apply_pairs
from tf_topk.keras.loss_scale_fix import apply_loss_scale_fix
from tf_topk.keras.mwms_fix import apply_mwms_fix
from tf_topk.replica_state import keeps_replica_values, restore_value, saved_values


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


def _no_weight_decay(variables):
    """Keras's weight decay, skipped where Keras's `apply` calls it: the
    wrapper applies it in the step's update (`_exchanged_update_step`)."""
    return None


def _numbered_name(prefix):
    """`prefix`, then `prefix_1`, `prefix_2`, ... as Keras numbers its own optimizers."""
    uid = keras.backend.get_uid(prefix)
    return prefix if uid == 1 else f"{prefix}_{uid - 1}"


def _check_not_multi_optimizer(optimizer):
    """A MultiOptimizer's `apply` hands each variable to its own sub-optimizer's `apply`, which would
    all-reduce it densely past the exchange (the run would train with every entry sent, silently):
    the wrapper goes inside it, around each sub-optimizer whose variables are to be sparsified."""
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is not None and isinstance(optimizer, multi):
        raise ValueError(
            "TopKOptimizer does not take a keras.optimizers.MultiOptimizer as inner_optimizer (its sub-optimizers "
            "would all-reduce every gradient densely, past the exchange): put TopKOptimizer inside it, around "
            "each sub-optimizer, e.g. MultiOptimizer(lambda variable: tf_topk.TopKOptimizer(adamw) if "
            "'encoder' in variable.path else sgd), with one TopKOptimizer object per sub-optimizer")


def _check_all_reduce_hook(optimizer):
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise RuntimeError(f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: this Keras version "
                           "aggregates gradients differently; tf_topk supports Keras 3.x with TensorFlow")


# Arguments of keras.optimizers.Optimizer that act in its own `apply`, which the
# wrapper replaces: they belong on the inner optimizer. get_config writes them
# with these defaults, so the defaults are accepted (as LossScaleOptimizer does).
_INNER_ONLY_DEFAULTS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None, "clipvalue": None, "use_ema": False,
    "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _delegated_to_inner(name):
    """A property reading (and setting) the inner optimizer's `name`: the
    wrapper's clipping is the inner one's, so `opt.clipnorm` reads the value
    that acts. Keras's constructor sets the default before the inner
    optimizer is attached, which is ignored."""

    def get(self):
        inner = self.__dict__.get("inner_optimizer")
        return None if inner is None else getattr(inner, name)

    def set(self, value):
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            setattr(inner, name, value)

    return property(get, set, doc=f"The inner optimizer's {name}.")


def _inner_use_ema():
    """`use_ema`, read from the inner optimizer, which keeps the average: so
    SwapEMAWeights finds it through a LossScaleOptimizer or a MultiOptimizer
    around the wrapper. False while the wrapper builds its own state, so that
    Keras's `build` makes no second average on the wrapper."""

    def get(self):
        inner = self.__dict__.get("inner_optimizer")
        return False if inner is None or self.__dict__.get("_building_own_state") else inner.use_ema

    def set(self, value):
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:  # Keras's constructor sets the default before the inner optimizer is attached
            inner.use_ema = value

    return property(get, set, doc="The inner optimizer's use_ema.")


_DELEGATED_CLIPPING = ("clipnorm", "clipvalue", "global_clipnorm")
# Files of earlier versions began with the wrapper's own iterations and learning rate.
_EARLIER_LAYOUT_EXTRA = 2


@keras.saving.register_keras_serializable(package="tf_topk")
class TopKOptimizer(TopKWrapper, keras.optimizers.Optimizer):
    """Top-k gradient sparsification with error feedback around any Keras optimizer.

    Args:
      inner_optimizer: the keras.optimizers.Optimizer that applies updates
        (SGD, Adam, ...). Not a TopKOptimizer, and not a LossScaleOptimizer:
        a ValueError.
      density: fraction of each large variable's entries sent per step: a float
        in (0, 1], a list of (step, density) pairs (warm-up) or a callable
        step -> density. Steps are the inner optimizer's iterations.
        "adaptive": chosen every step for a typed-in link; "autopilot": the
        cluster measured when the optimizer is built, every entry sent where
        no density would be faster, else routes and density chosen by
        predicted time (`tf_topk.autopilot`). Not given (or None): the
        autopilot, except where it cannot choose both route and density
        (exchange_mode other than "auto", a router, or Adam's momentum
        correction when asked for): 0.001. `opt.density` then reads None
        (saved as not given, with the measured plan: reused where it is
        loaded on as many replicas, measured again on another count).
      method: "gaussian" (default) or "exact", see `tf_topk.approx_topk`.
      min_size: variables with fewer entries (biases, normalisation) take the
        ordinary dense all-reduce, all in one packed call.
      bucket_bytes: bytes of (value, index) pairs per all_gather; None: one
        all_gather per step.
      error_feedback: keep residuals (default True).
      momentum_correction: for an inner `keras.optimizers.SGD` with momentum
        > 0, DGC's momentum correction (without its momentum factor masking
        unless `config=ExchangeConfig(momentum_masking=True)`): its
        momentum and nesterov move into the exchange: each replica keeps a
        velocity, accumulates it in its residual and sends the top-k of that,
        and the inner SGD applies the exchanged sum without momentum (its own
        momentum slots are not made). Recovers what momentum brings at 0.1%
        density, which plain top-k loses. The velocity is in gradient units:
        a changing learning rate scales the whole step, not the velocity
        already built up. For an inner `Adam` or `AdamW`, Adam's momentum
        correction (`tf_topk.memory.AdamMomentumCorrectionMemory`): dense
        AdamW for `variance_warmup_steps` steps, then the second moment frozen
        and each replica's momentum of the preconditioned gradient sent
        (closer to dense Adam at low density; it applies the sparsified
        variables' update itself, so the inner Adam's clipnorm, clipvalue,
        global_clipnorm, use_ema, gradient_accumulation_steps and
        loss_scale_factor are refused with it). Off unless asked for, for
        every inner optimizer: the default is top-k with error feedback in
        front of the inner optimizer, which keeps every option of it. Any
        other inner optimizer: a ValueError.
      variance_warmup_steps: with Adam's momentum correction, the dense
        steps before the second moment freezes (default 100; 10% of the
        run or less is enough).
      decoupled_momentum: "auto" (default), True or False. True: DeMo's
        decoupled momentum for an inner `Adam` or `AdamW`
        (`tf_topk.decoupled_momentum`): each replica keeps its own momentum
        (decay 0.999) in the space of a DCT over blocks of up to 64x64
        entries, sends its top-k coefficients and keeps the rest, and every
        sparsified entry moves by twice the learning rate times the sign of
        the decoded sum (`ExchangeConfig(decoupled_step_scale=...)`, 2.0
        by default; plus AdamW's decoupled weight decay); the dense-path
        variables keep the inner Adam. The inner optimizer's options act
        as they do on its own update (the exchange runs inside its `apply`):
        loss scaling, clipnorm, clipvalue, global_clipnorm and gradient
        accumulation on the gradient before it, constraints and the EMA on
        the variables after it. "auto" takes it for an inner Adam or AdamW
        without AMSGrad at a fixed density of 0.01 or less
        (`tf_topk.config.DECOUPLED_UP_TO_DENSITY`), where top-k in front of
        Adam loses most (measured:
        benchmarks/RESULTS.md#decoupled-momentum-for-adamw-demo), and with no
        density given wherever the autopilot's plan sparsifies, at the fixed
        density the plan chooses for the link (0.01, or 0.001 where 0.01's
        exchange is not 10x faster than dense's); not with
        momentum_correction=True, error_feedback=False, sparse_updates,
        rescale_residuals, exchange parts given, or "dense_bf16" (the inner
        optimizer's own 16-bit baseline). The chief prints one line saying
        what runs, and why an inner Adam does not get it. True with one of
        those: a ValueError naming it.
      local_clipnorm: None, or clip each replica's gradient to this global
        norm / sqrt(replicas) before it enters the accumulation (DGC's local
        clipping); think of it as the clip norm of the summed gradient.
      name: optimizer name.
      exchange_mode: "auto" (default: per bucket, whichever of all_gather,
        agreed indices and dense sends the fewest bytes), "allgather" or
        "allreduce" (agreed indices, bytes per worker that do not grow with
        the number of workers), "dense_bf16" (every entry in bfloat16,
        the rounding error kept in the residuals), "allgather_int8"
        (all_gather of 4-byte pairs, values in 8 bits: twice the density
        for all_gather's bytes), or "allgather_chunk" (the same share of
        every chunk of 4,096 entries in 14 bits an entry: about 4.5x the
        density for all_gather's bytes), as in `tf_topk.SparseExchange`.
      sparse_updates: update each sparsified variable only at the entries
        sent (`variable -= lr * pairs`, O(pairs) instead of a dense gradient
        and an update of every entry). For an inner SGD without momentum
        (or with momentum_correction=True), weight decay, clipping or EMA
        (else a ValueError); the result is the same update as dense, up to
        the order of float additions.
      selection_scope: "variable" (default: each sparsified variable sends
        its own k) or "bucket": one selection of the same total over all of
        a bucket's variables, each entry ranked by its magnitude over its
        variable's root mean square (a global top-k, each layer on its own
        scale); the recipe for CNNs, with plain error feedback and DGC's
        warm-up (measured: benchmarks/RESULTS.md#one-selection-over-the-bucket-selection_scopebucket). Needs
        exchange_mode="allgather" and dense updates (else a ValueError):

          >>> opt = tf_topk.TopKOptimizer(
          ...     keras.optimizers.SGD(0.02, momentum=0.9),
          ...     density=tf_topk.schedule.dgc_warmup(94, epochs=4, final=0.001),
          ...     exchange_mode="allgather", selection_scope="bucket")
      density_warmup_steps: "auto" (default): a fixed density of 0.01 or less
        (given, or the 0.001 taken where the autopilot cannot choose) starts
        with DGC's falling densities over the first 400 steps, four stages
        of 100 from 0.25 down (for 0.001: 0.25, 0.063, 0.016, 0.004), then
        the density given (`tf_topk.schedule.warmup_in_steps`; not with
        Adam's momentum correction, whose first steps are dense): it guards
        against the losses of error feedback at 0.001 started cold (measured:
        benchmarks/RESULTS.md#a-fixed-low-density-warms-up-by-default-density_warmup_steps). An
        int sets the length in steps; 0 switches it off, the density then
        from the first step. A schedule or an adaptive density warms up as it
        says: with those, only "auto" or 0. Under exchange_mode="auto" the
        route is the density's own up to 4 replicas (all_gather at 0.001);
        from 5 on, agreed indices (all_gather at 0.25 would send more than
        dense), as for any falling schedule:

          >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.001)  # warms up
          >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=0.001,
          ...                             density_warmup_steps=0)              # 0.001 from step 0
      link: the cluster's link rate ("100mbit", "1gbit", "10gbit"), stated
        instead of measured: with no density given, the autopilot plans for
        it (so every run plans alike, and nothing is timed when the optimizer
        is built). None: the TF_TOPK_LINK environment variable's, else
        measured. Only with no density given (else a ValueError):

          >>> opt = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), link="100mbit")
      config: a `tf_topk.ExchangeConfig` holding these options in one object
        (sparse_updates is its sparse_output), to share one set between
        optimizers and exchanges. The arguments above that are given replace
        its fields; those not given keep config's values (or, without
        config, ExchangeConfig's defaults, which are the ones listed here).
        Its momentum and nesterov are the inner SGD's: a config with momentum
        set means momentum_correction=True, and a value other than the inner
        SGD's is a ValueError. The result is `exchange_config`; the options
        read back as attributes of the same names (`opt.density`, ...).
      selector, memory, router: parts handed to the `tf_topk.SparseExchange`
        in place of its defaults (a memory replaces what error_feedback
        chooses, and cannot go with momentum_correction). A config cannot
        hold them: `get_config` of an optimizer given any raises
        NotImplementedError, so save its weights or a checkpoint instead.

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
      >>> dgc = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), density=0.001,
      ...                             momentum_correction=True)
      >>> shared = tf_topk.ExchangeConfig(density=0.001, exchange_mode="auto", bucket_bytes=1 << 20)
      >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), config=shared, density=0.01)
      >>> opt.density, opt.exchange_mode        # the argument given, then config's
      (0.01, 'auto')
    """

    def __init__(self, inner_optimizer, density=FROM_CONFIG, method=FROM_CONFIG, min_size=FROM_CONFIG,
                 bucket_bytes=FROM_CONFIG, error_feedback=FROM_CONFIG, momentum_correction=FROM_CONFIG,
                 local_clipnorm=FROM_CONFIG, name=None, exchange_mode=FROM_CONFIG, sparse_updates=FROM_CONFIG, *,
                 variance_warmup_steps=FROM_CONFIG, selection_scope=FROM_CONFIG,
                 density_warmup_steps=FROM_CONFIG, decoupled_momentum=FROM_CONFIG, link=FROM_CONFIG,
                 config=None, selector=None, memory=None, router=None, **kwargs):
        check_inner_optimizer(inner_optimizer, keras.optimizers.Optimizer, TopKOptimizer,
                              keras.mixed_precision.LossScaleOptimizer, "keras")
        _check_not_multi_optimizer(inner_optimizer)
        exchange_config, method_note = wrapper_exchange_config(
            inner_optimizer, keras.optimizers.SGD, (keras.optimizers.Adam, keras.optimizers.AdamW), "keras", config, density=density, method=method,
            min_size=min_size, bucket_bytes=bucket_bytes, error_feedback=error_feedback,
            momentum_correction=momentum_correction, local_clipnorm=local_clipnorm, exchange_mode=exchange_mode,
            variance_warmup_steps=variance_warmup_steps, selection_scope=selection_scope,
            density_warmup_steps=density_warmup_steps, decoupled_momentum=decoupled_momentum, link=link,
            parts_given=any(part is not None for part in (selector, memory, router)),
            sparse_updates=sparse_updates, exchange_inside_inner_apply=True)
        parts = exchange_parts(exchange_config, selector=selector, memory=memory, router=router)
        check_inner_only_arguments(kwargs, _INNER_ONLY_DEFAULTS, "keras")
        super().__init__(learning_rate=0.0, name=name or _numbered_name("topk_optimizer"))
        apply_mwms_fix()  # keras#20585: model.fit under MultiWorkerMirroredStrategy
        apply_loss_scale_fix()  # mixed precision: all replicas agree on skipping a step
        self.inner_optimizer = inner_optimizer
        # The exchange replaces the inner optimizer's dense all-reduce, which is
        # switched off only while this optimizer applies an update through it.
        _check_all_reduce_hook(self.inner_optimizer)
        # While this optimizer applies through the inner one, the exchange is its cross-replica update
        # step, and its weight decay runs there (`_exchanged_update_step`).
        self._set_exchange_config(exchange_config, parts, {
            "_backend_update_step": self._exchanged_update_step, "_apply_weight_decay": _no_weight_decay,
            "_all_reduce_sum_gradients": _no_all_reduce}, method_note)

    clipnorm, clipvalue, global_clipnorm = (_delegated_to_inner(name) for name in _DELEGATED_CLIPPING)
    use_ema = _inner_use_ema()

    @property
    def _model_variables_moving_average(self):
        """The inner optimizer's EMA of the weights (SwapEMAWeights swaps them in)."""
        return self.inner_optimizer._model_variables_moving_average

    # -- state ----------------------------------------------------------------

    def build(self, var_list):
        """This optimizer's state and the exchange, then the inner optimizer's (where it is not built
        yet), without the slots of the variables whose update the exchange applies itself (decoupled
        momentum and Adam's momentum correction keep their own: an inner AdamW's two moments of those
        variables would be two buffers of their size that nothing reads)."""
        object.__setattr__(self, "_building_own_state", True)
        try:
            super().build(var_list)
        finally:
            object.__setattr__(self, "_building_own_state", False)
        self._build_exchange(var_list)
        if not self.inner_optimizer.built:
            with InnerOverrides(self.inner_optimizer, self._inner_build_overrides(var_list)):
                self.inner_optimizer.build(var_list)

    def _inner_build_overrides(self, var_list):
        """The overrides the inner optimizer builds under: the step's, and without the slots of the
        variables it never updates (`_positions_the_inner_never_updates`)."""
        overrides = dict(self._inner_overrides)
        unused = {id(var_list[position]) for position in self._positions_the_inner_never_updates(var_list)}
        if unused:
            overrides["add_optimizer_variables"] = self._slots_left_out_for(unused)
        return overrides

    def _slots_left_out_for(self, unused):
        """The inner optimizer's `add_optimizer_variables`, with None (as Keras puts for a variable it
        overwrites with its gradient) in place of the slots of `unused` variables (ids), except Keras's
        own EMA averages; each call recorded for `_with_every_slot`."""
        inner = self.inner_optimizer
        add_optimizer_variables = type(inner).add_optimizer_variables.__get__(inner)
        calls = []
        object.__setattr__(self, "_left_out_slots", calls)

        def add(trainable_variables, name, initializer="zeros"):
            names = [name] if isinstance(name, str) else list(name)
            if names == ["average"]:
                return add_optimizer_variables(trainable_variables, name, initializer)
            left_out = [id(variable) in unused for variable in trainable_variables]
            calls.append((len(inner.variables), len(names), left_out))
            made = add_optimizer_variables([v for v, out in zip(trainable_variables, left_out) if not out], name,
                                           initializer)
            made = [made] if isinstance(name, str) else list(made)
            slots = []
            for kind in made:
                kept = iter(kind)
                slots.append([None if out else next(kept) for out in left_out])
            return slots[0] if isinstance(name, str) else tuple(slots)

        return add

    def _make_variable(self, name, shape, dtype, kind, initial=0):
        if kind == "counter":
            return self.add_variable(shape=shape, dtype=dtype, name=name, aggregation="only_first_replica",
                                     initializer=keras.initializers.Constant(initial))
        variable = keras.Variable(initializer="zeros", shape=shape, dtype=dtype, trainable=False,
                                  aggregation="sum" if kind == "state" else "only_first_replica",
                                  synchronization="on_read", name=name)
        if kind in ("state", "replicated_state"):
            self._track_variable(variable)  # statistics are tracked as values of a dict attribute
        return variable

    def _tf_variable(self, variable):
        """The tf.Variable behind a Keras variable; a tf.Variable (which Keras's
        own optimizers take too) is its own."""
        return variable.value if isinstance(variable, keras.Variable) else variable

    @property
    def variables(self):
        """This optimizer's state (per-replica residuals and velocities, the
        skipped steps), then the inner optimizer's (iterations, learning
        rate, slots). The wrapper's own iterations and learning rate, which
        Keras's constructor makes and nothing reads (both are the inner
        optimizer's), are left out."""
        unused = (self._iterations, self._learning_rate)
        return [v for v in self._variables if not any(v is u for u in unused)] + self.inner_optimizer.variables

    def save_own_variables(self, store):
        """As Keras, except that per-replica state (residuals, velocities)
        holds every replica's value (`tf_topk.replica_state`): a collective,
        so under MWMS every worker must save (the chief's file is the one kept)."""
        values = saved_values([self._tf_variable(variable) for variable in self.variables])
        for i, value in enumerate(values):
            store[str(i)] = value.numpy()

    def load_own_variables(self, store):
        """As Keras, except that each replica gets its own per-replica state
        back when the number of replicas is unchanged, else sum / replicas.

        Reads the files of earlier versions too, which began with the
        wrapper's own iterations and learning rate (2 more entries, skipped).
        A file saved before the first step holds what an unbuilt wrapper has
        (the inner optimizer's iterations and learning rate; the earlier
        layout, the wrapper's own first): there is nothing of its own to
        restore, and Keras loads the inner optimizer from its own entry of
        the file as it loads it alone (silent for an optimizer without
        slots, Keras's warning otherwise)."""
        saved = [np.asarray(store[str(i)]) for i in range(len(store.keys()))]
        method = getattr(self, "exchange_method", None)  # None before the first build
        for layout in self._saved_layouts():
            if self._fits(saved, layout):
                if method is not None and any(variable is method for variable in layout):
                    check_saved_method(saved[next(i for i, v in enumerate(layout) if v is method)], self._method_code)
                for variable, value in zip(layout, saved):
                    if variable is None:
                        continue
                    if keeps_replica_values(self._tf_variable(variable)):
                        restore_value(self._tf_variable(variable), value)
                    else:
                        variable.assign(value)
                return None
        unbuilt = 1 + isinstance(self.inner_optimizer._learning_rate, keras.Variable)  # iterations, learning rate
        if self.built and len(saved) in (unbuilt, unbuilt + _EARLIER_LAYOUT_EXTRA):
            return None
        return super().load_own_variables(store)  # Keras's warning

    def _saved_layouts(self):
        """The layouts a saved file may have, each a list with the variable each saved array goes to (None:
        an array to pass over): `variables`; with the inner optimizer's slots of every variable (another
        method's file, or one written before the unused slots were left out); without `exchange_method`
        (written before it), with or without those slots; each of them after the wrapper's own
        iterations and learning rate (earlier versions' files)."""
        variables = self.variables
        own = len(variables) - len(self.inner_optimizer.variables)
        without_method = [v for v in variables[:own] if v is not getattr(self, "exchange_method", None)]
        layouts = [variables, self._with_every_slot(variables[:own]),
                   without_method + variables[own:], self._with_every_slot(without_method)]
        return layouts + [[None] * _EARLIER_LAYOUT_EXTRA + layout for layout in layouts]

    def _with_every_slot(self, own):
        """`own` then the inner optimizer's variables as they were when it kept a slot for every variable
        (None where a slot left out would have been: `_left_out_slots`)."""
        inner = list(self.inner_optimizer.variables)
        layout, at = list(own), 0
        for start, names, left_out in self.__dict__.get("_left_out_slots", ()):
            layout += inner[at:start]
            at = start
            for out in left_out:
                layout += [None] * names if out else inner[at:at + names]
                at += 0 if out else names
        return layout + inner[at:]

    def _fits(self, values, layout):
        """Whether saved `values` are one per entry of `layout`, each of its variable's shape (a
        per-replica state holds every replica's value: `tf_topk.replica_state`)."""
        return len(values) == len(layout) and all(
            variable is None or tuple(np.shape(value)) == tuple(variable.shape)
            or keeps_replica_values(self._tf_variable(variable)) for value, variable in zip(values, layout))

    def set_weights(self, weights):
        """As Keras, over `variables`: this optimizer's and then the inner
        optimizer's (iterations, moments, ...), in `variables`' order."""
        if not self.built:
            return super().set_weights(weights)  # Keras's error: build first
        weights = list(weights)
        if len(weights) != len(self.variables):
            raise ValueError(f"set_weights got {len(weights)} arrays, but {self.name} has {len(self.variables)} "
                             "variables (its own, then the inner optimizer's): pass one per variable")
        for variable, weight in zip(self.variables, weights):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(f"Optimizer variable {variable.path} has shape {variable.shape} not compatible "
                                 f"with provided weight shape {np.shape(weight)}")
            variable.assign(weight)

    # -- delegation (as LossScaleOptimizer) -----------------------------------

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def update_step(self, gradient, variable, learning_rate):
        """The inner optimizer's update rule for one variable, as Keras's
        optimizers expose it (no exchange: that is per step, in `apply`)."""
        return self.inner_optimizer.update_step(gradient, variable, learning_rate)

    def _clip_gradients(self, grads):
        """The inner optimizer's clipping (the wrapper's is the inner one's)."""
        return self.inner_optimizer._clip_gradients(grads)

    def get_config(self):
        config = super().get_config()
        for name in _DELEGATED_CLIPPING:  # the inner optimizer's, in its own config; as earlier versions wrote them
            config[name] = None
        config["use_ema"] = False  # likewise
        return config

    # The inner optimizer's: it scales the loss and unscales the gradients. A LossScaleOptimizer
    # around this one sets it to None, as it does for the optimizer it wraps, so that gradients are
    # not unscaled twice.
    loss_scale_factor = _delegated_to_inner("loss_scale_factor")

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """The inner optimizer's: it is the one that decays (before `build`)."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    # -- the step -------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        grads, trainable_variables = list(grads), list(trainable_variables)
        if not self.built:
            if not tf.distribute.has_strategy() and not self.inner_optimizer.built:
                # Where Keras builds its own optimizer without a strategy: in the traced step, so
                # that a build reading the variables' values (ScheduleFreeAdamW copies them) reads
                # the ones a model built in the same trace holds.
                with keras.name_scope(self.name, caller=self), \
                        InnerOverrides(self.inner_optimizer, self._inner_build_overrides(trainable_variables)):
                    self.inner_optimizer.build(trainable_variables)
            # The wrapper's own state eagerly, as tf_keras builds: variables made while a
            # tf.function traces are initialised in its first-call cond, which under
            # MirroredStrategy fails ("You must feed a value for placeholder").
            with tf.init_scope(), keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_replica_context("apply")
        self._check_conditional_inner_options()
        # Keras's own apply, in Keras's order; the exchange is its cross-replica step (_exchanged_update_step).
        with InnerOverrides(self.inner_optimizer, self._inner_overrides):
            self.inner_optimizer.apply(grads, trainable_variables)
        return self.iterations

    def _exchanged_update_step(self, grads, trainable_variables, learning_rate):
        """The inner optimizer's `_backend_update_step` while this optimizer
        applies through it: the exchange in place of the dense all-reduce.

        Keras's `apply` calls it with each replica's gradients after it has
        unscaled them (loss_scale_factor), set aside the variables it
        overwrites with their gradient (float8), clipped them and, with
        gradient accumulation, averaged the micro-steps: so the exchange sees
        what Keras's all-reduce would, once per update. The variables'
        weight decay, which Keras applies just before this step, moves into
        the branch taken when every replica's gradient is finite, so that a
        skipped step changes no variable."""
        positions = [self._get_variable_index(variable) for variable in trainable_variables]
        in_build_order = [None] * len(self._trainable_variables)
        for position, grad in zip(positions, grads):
            in_build_order[position] = grad
        result = self._exchange_step(in_build_order)
        exchanged = [result.grads[position] for position in positions]

        def apply(exchanged):
            type(self.inner_optimizer)._apply_weight_decay(self.inner_optimizer, trainable_variables)
            self._apply_update(exchanged, positions, trainable_variables, learning_rate)
            return tf.constant(True)

        self._apply_or_skip(result.all_finite, apply, exchanged)

    def _skip_update(self):
        """A skipped step: counted, and not counted in the inner optimizer's
        iterations (Keras adds one after this step), except with gradient
        accumulation, where the next micro-steps start a new accumulation."""
        if not self.inner_optimizer.gradient_accumulation_steps:
            self.inner_optimizer._iterations.assign_sub(1)
        return super()._skip_update()

    def _check_conditional_inner_options(self):
        """Gradient accumulation puts the inner optimizer's update step (here:
        the exchange and its branch that skips non-finite steps, which holds a
        synchronisation point, a merge_call) inside a cond; with several
        replicas TensorFlow refuses that in a traced step ("merge_call called
        while defining a new graph"), so it is refused there, by name, before
        any step (run eagerly, as Keras's own distribute tests do, it works)."""
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync < 2 or tf.executing_eagerly():
            return
        inner = self.inner_optimizer
        in_use = {"use_ema": bool(inner.use_ema),
                  "gradient_accumulation_steps": (inner.gradient_accumulation_steps or 1) > 1}
        for name in (name for name, used in in_use.items() if used):
            raise ValueError(
                f"TopKOptimizer with an inner {name}={getattr(inner, name)!r} under {type(strategy).__name__} "
                f"with {strategy.num_replicas_in_sync} replicas is not supported yet (the inner optimizer's "
                f"{name} would run a merge_call inside a cond of the traced step; "
                "Keras's own optimizers fail with it under MirroredStrategy's fit too); it works with one replica")

    def _apply_update(self, grads, positions, trainable_variables, learning_rate):
        """The exchanged gradients applied, each the way its method says (`tf_topk.updates`): sparse
        pairs by SGD, decoupled momentum's and Adam's momentum correction's directions, the rest by the
        inner optimizer's own update step (its dense all-reduce switched off)."""
        directed = self._direction_positions()
        pairs, directions, present = [], [], []
        for grad, position, variable in zip(grads, positions, trainable_variables):
            if isinstance(grad, SparseGradient):
                pairs.append((grad, variable))
            elif position in directed:
                directions.append((grad, variable))
            else:
                present.append((grad, variable))
        if pairs:  # sparse_updates: the inner apply then applies each variable's constraint
            apply_pairs([(g, self._tf_variable(v)) for g, v in pairs], learning_rate)
        if directions:
            self._apply_directions(directions, learning_rate, decay_and_constrain=False)  # Keras's apply does both
        if present:
            type(self.inner_optimizer)._backend_update_step(
                self.inner_optimizer, [g for g, _ in present], [v for _, v in present], learning_rate)

    def apply_gradients(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            raise ValueError("No gradients provided for any variable.")
        grads, trainable_variables = zip(*grads_and_vars)
        return self.apply(list(grads), list(trainable_variables))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError("stateless_apply is not supported by TopKOptimizer: it needs the TensorFlow backend's "
                         "stateful apply (as Keras's own optimizers do with that backend)")

    # -- serialization --------------------------------------------------------

    @staticmethod
    def _serialize_inner(optimizer):
        return keras.saving.serialize_keras_object(optimizer)

    @staticmethod
    def _deserialize_inner(config, custom_objects):
        return keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
