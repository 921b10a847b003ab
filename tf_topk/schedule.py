"""Density schedules: how many entries of each variable a step sends.

A density is a fraction of a variable's entries, k = ceil(density * size),
at least 1. A schedule is one of:
  - a float in (0, 1]: constant density; k is a Python int, so every shape in
    the exchange is static;
  - a list of (step, density) pairs, step ascending and starting at 0: the
    density of the last pair whose step is <= the current step (a warm-up as in
    Deep Gradient Compression: [(0, 0.25), (200, 0.0625), (400, 0.015),
    (600, 0.004), (800, 0.001)]);
  - a callable taking the step (an int64 tensor) and returning the density as
    a float tensor, like a Keras learning-rate schedule (return float64 for
    k to match the constant case exactly).
With a list or a callable, k is a tensor that changes with the step.
`dgc_warmup` builds DGC's warm-up list from the epoch length.
"""

import math

import tensorflow as tf


def _check_density(density, where):
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ValueError(f"{where} must be a float in (0, 1], got {density!r}")
    if not 0.0 < float(density) <= 1.0 or math.isnan(density):
        raise ValueError(f"{where} must be in (0, 1], got {density!r}")
    return float(density)


def dgc_warmup(steps_per_epoch, epochs=4, final=0.001, initial=0.25):
    """Deep Gradient Compression's density warm-up, as (step, density) pairs.

    The density falls exponentially, one value per epoch, from `initial` in
    the first epoch to `final` from epoch `epochs` on: with the defaults
    0.25, 0.0628, 0.0158, 0.00397, then 0.001 (DGC: 75%, 93.75%, 98.4%,
    99.6%, 99.9% sparsity over the first four epochs). Early gradients change
    fast and the residuals are still empty, so sending more at first keeps
    the start of training close to dense.

    Example:
        >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
        ...                             density=tf_topk.schedule.dgc_warmup(len(x_train) // 32),
        ...                             momentum_correction=True)
    """
    for name, value in (("steps_per_epoch", steps_per_epoch), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "steps_per_epoch" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'steps_per_epoch' else 0}, got {value!r}")
    final = _check_density(final, "final")
    initial = _check_density(initial, "initial")
    if final > initial:
        raise ValueError(f"final ({final}) must not exceed initial ({initial}): a warm-up lowers the density")
    if epochs == 0:
        return [(0, final)]
    ratio = (final / initial) ** (1.0 / epochs)
    return [(epoch * steps_per_epoch, initial * ratio**epoch) for epoch in range(epochs)] + \
        [(epochs * steps_per_epoch, final)]


class DensitySchedule:
    """The density of each step, and k for a variable of a given size."""

    def __init__(self, density):
        self.constant = None
        self.steps = None
        self.callable = None
        if isinstance(density, DensitySchedule):
            self.constant, self.steps, self.callable = density.constant, density.steps, density.callable
        elif isinstance(density, (int, float)) and not isinstance(density, bool):
            self.constant = _check_density(density, "density")
        elif isinstance(density, (list, tuple)):
            self.steps = self._check_steps(density)
        elif callable(density):
            self.callable = density
        else:
            raise ValueError(
                "density must be a float in (0, 1], a list of (step, density) pairs or a callable "
                f"step -> density, got {density!r}")

    @staticmethod
    def _check_steps(pairs):
        if not pairs:
            raise ValueError("density schedule must have at least one (step, density) pair, got []")
        checked = []
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"density schedule entries must be (step, density) pairs, got {pair!r}")
            step, density = pair
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"density schedule steps must be ints >= 0, got step {step!r}")
            checked.append((step, _check_density(density, f"density at step {step}")))
        steps = [s for s, _ in checked]
        if steps[0] != 0:
            raise ValueError(f"density schedule must start at step 0, got first step {steps[0]}")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"density schedule steps must increase, got {steps}")
        return checked

    @property
    def is_constant(self):
        return self.constant is not None

    def max_density(self):
        """Largest density the schedule can give (None for a callable)."""
        if self.constant is not None:
            return self.constant
        if self.steps is not None:
            return max(d for _, d in self.steps)
        return None

    def density(self, step=None):
        """The density at `step`: a float, or a float64 tensor when scheduled.

        float64, as Python's floats: k = ceil(density * size) must come out the
        same for a scheduled 0.001 as for a constant one (in float32, 0.001 is
        slightly above it, and ceil(0.001 * 10000) would give 11).
        """
        if self.constant is not None:
            return self.constant
        if step is None:
            raise ValueError("a scheduled density needs the current step; pass step=...")
        step = tf.cast(step, tf.int64)
        if self.steps is not None:
            boundaries = tf.constant([s for s, _ in self.steps], tf.int64)
            values = tf.constant([d for _, d in self.steps], tf.float64)
            position = tf.searchsorted(boundaries, tf.reshape(step, [1]), side="right")[0] - 1
            return tf.gather(values, tf.maximum(position, 0))
        return tf.cast(self.callable(step), tf.float64)

    def k(self, size, step=None):
        """k for a variable of `size` entries: a Python int when constant."""
        density = self.density(step)
        if isinstance(density, float):
            return max(1, min(size, math.ceil(density * size)))
        k = tf.cast(tf.math.ceil(density * size), tf.int32)
        return tf.clip_by_value(k, 1, size)

    def get_config(self):
        if self.constant is not None:
            return self.constant
        if self.steps is not None:
            return [list(pair) for pair in self.steps]
        raise ValueError("a callable density schedule cannot be serialized; use a float or a list of pairs")
