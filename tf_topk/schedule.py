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
`AdaptiveDensity` (or density="adaptive") chooses the density every step from
the gradient itself: the most improvement per byte sent. density="autopilot"
does that with the link measured on the cluster, and routes each bucket by
predicted time (`tf_topk.autopilot`).
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
    return warmup_in_steps(epochs * steps_per_epoch, final, initial, stages=max(1, epochs))


def warmup_in_steps(steps, final, initial=0.25, stages=4):
    """DGC's falling densities over the first `steps` steps, as (step, density) pairs.

    `stages` equal stages from `initial` down to `final`, each `final /
    initial` to the power 1 / stages below the last, then `final` from step
    `steps` on: DGC's warm-up with its epochs given as steps, for where the
    epoch's length is not known (the default warm-up of a fixed density
    of 0.01 or less, `tf_topk.ExchangeConfig.density_warmup_steps`). steps=0:
    `final` from the first step.

    Example:
        >>> tf_topk.schedule.warmup_in_steps(400, final=0.001)
        [(0, 0.25), (100, 0.0629), (200, 0.0158), (300, 0.00398), (400, 0.001)]   # rounded here
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    final = _check_density(final, "final")
    initial = _check_density(initial, "initial")
    if final >= initial or steps == 0:
        return [(0, final)]
    stages = min(stages, steps)
    ratio = (final / initial) ** (1.0 / stages)
    return [(steps * stage // stages, initial * ratio**stage) for stage in range(stages)] + [(steps, final)]


class DensitySchedule:
    """The density of each step, and k for a variable of a given size."""

    def __init__(self, density):
        self.constant = None
        self.steps = None
        self.callable = None
        self.autopilot = (isinstance(density, str) and density == AUTOPILOT) or \
            getattr(density, "autopilot", False)
        self.adaptive = adaptive_from(density)
        if self.adaptive is not None:
            pass  # the exchange keeps the density it chose (SparseExchange.adaptive_density)
        elif isinstance(density, DensitySchedule):
            self.constant, self.steps, self.callable = density.constant, density.steps, density.callable
            self.adaptive = density.adaptive
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
        if self.adaptive is not None:
            return 1.0 if self.adaptive.dense else self.adaptive.max_density
        if self.constant is not None:
            return self.constant
        if self.steps is not None:
            return max(d for _, d in self.steps)
        return None

    def settled_density(self):
        """The density a warm-up settles at (a list of pairs whose densities
        never rise: its last), the constant one, else None."""
        if self.constant is not None:
            return self.constant
        if self.steps is not None and all(b <= a for (_, a), (_, b) in zip(self.steps, self.steps[1:])):
            return self.steps[-1][1]
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
        if self.autopilot:  # measured again wherever it runs
            return AUTOPILOT
        if self.adaptive is not None:
            return {"adaptive": self.adaptive.get_config()}
        if self.constant is not None:
            return self.constant
        if self.steps is not None:
            return [list(pair) for pair in self.steps]
        raise ValueError("a callable density schedule cannot be serialized; use a float or a list of pairs")


# -- adaptive density -------------------------------------------------------------------------

# The default link model: what one more message costs (latency) and what a byte
# costs (bandwidth), for a 1 Gbit/s Ethernet link between workers.
DEFAULT_LATENCY_S = 5e-4
DEFAULT_BANDWIDTH = 1.25e8  # bytes per second
# Compute the sparse path spends per entry (the fused selection and what goes
# with it), as `python -m tf_topk.bench overhead` measures it on a 2-core CPU;
# only the choice between sparse and dense depends on it.
DEFAULT_SELECTION_S_PER_ENTRY = 1.2e-9
# Candidate k values the rule compares, geometrically spaced over its bounds.
GRID_POINTS = 64
# How far above this step's density the next step's may go: the magnitude
# profile is taken down to PROFILE_HEADROOM times the density in use (at a
# depth of the halving ladder `AdaptiveDensity.profile_levels`), not to
# max_density, since its cost grows with the depth (the fused op at 12.6M
# entries: 1.17x at depth 0.001, 1.53x at 0.1). The rule can climb by this
# factor a step, and fall at once.
PROFILE_HEADROOM = 4.0


def _check_positive(value, name, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or \
            value < 0 or (value == 0 and not allow_zero) or value == float("inf"):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


class AdaptiveDensity:
    """k chosen every step from the gradient: the most improvement per byte sent.

    The rule of Khirirat, Magnusson, Aytekin and Johansson ("Communication
    Efficient Sparsification for Large Scale Machine Learning", 2020) for
    magnitude sparsification: a step that sends the k largest entries of the
    accumulated gradient improves the objective in proportion to their energy
    E(k) = ||top_k(acc)||^2, and costs C(k) = c0 + c1 * k bytes, so

        k_t = argmax over k in [min_density * n, max_density * n] of E(k) / C(k)

    with c1 the bytes a worker sends per (value, index) pair in the exchange
    mode in use ((P-1) * 8 for all_gather), and c0 the fixed cost of a step's
    message plus the compute the sparse path spends, in bytes of the link:
    `message_bytes` (default latency_s * bandwidth) + selection_s_per_entry *
    n * bandwidth. The dense end is part of the rule: sending everything
    (density 1, which flushes the residuals) costs what that takes in the
    exchange mode (a dense all-reduce with exchange_mode="auto") and brings
    the whole energy; the rule takes it when its ratio is the best.

    E(k) comes at no extra pass from the fused selection's magnitude profile
    (count and energy per 1/8-octave bin, `tf_topk.error_feedback_topk(...,
    with_profile=True)`), interpolated inside a bin, over all sparsified
    variables (each variable profiled down to the bucket-wide rank depth * n,
    so one layer holding most of the large entries is counted whole). The
    depth follows the density in use (`profile_depth`: PROFILE_HEADROOM times
    it, at most max_density), so a step at density 0.001 does not pay for a
    profile down to 0.1; beyond the depth a larger k gains nothing, so the
    next step's density is at most about PROFILE_HEADROOM times this one's.
    Every replica proposes a density from its own gradient, as a vote over the candidates (`candidates`); the votes travel in the
    step's collective (GRID_POINTS + 1 floats) and their lower median
    (`agree`) is the density of the NEXT step on every replica, so replicas
    always agree, on a density one of them chose, and no collective is
    added. The first step uses `initial_density`.

    Args:
      min_density, max_density: bounds of the sparse choice (0 < min <= max <= 1).
      message_bytes: c0 in bytes; default latency_s * bandwidth_bytes_per_s.
      latency_s, bandwidth_bytes_per_s: the link model (default 0.5 ms, 1 Gbit/s).
      selection_s_per_entry: compute of the sparse path per entry, in seconds.
      pair_compute_s: compute per pair sent (densifying the pairs every
        replica receives), in seconds; added to c1 in bytes of the link.
      dense: whether the rule may choose to send everything.
      replicas: the number of workers the byte costs assume; default the
        replicas in sync. With one replica nothing travels, so the rule sends
        everything: set it to study a cluster's choices from one process.
      initial_density: the first step's density (default max_density).

    Example:
      >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density="adaptive")
      >>> opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), exchange_mode="auto",
      ...     density=tf_topk.schedule.AdaptiveDensity(bandwidth_bytes_per_s=1.25e7))  # 100 Mbit/s
    """

    def __init__(self, min_density=1e-4, max_density=0.1, message_bytes=None, latency_s=DEFAULT_LATENCY_S,
                 bandwidth_bytes_per_s=DEFAULT_BANDWIDTH, selection_s_per_entry=DEFAULT_SELECTION_S_PER_ENTRY,
                 dense=True, replicas=None, initial_density=None, pair_compute_s=0.0):
        self.min_density = _check_density(min_density, "min_density")
        self.max_density = _check_density(max_density, "max_density")
        if self.min_density > self.max_density:
            raise ValueError(f"min_density ({min_density}) must not exceed max_density ({max_density})")
        self.latency_s = _check_positive(latency_s, "latency_s", allow_zero=True)
        self.bandwidth_bytes_per_s = _check_positive(bandwidth_bytes_per_s, "bandwidth_bytes_per_s")
        self.message_bytes = (self.latency_s * self.bandwidth_bytes_per_s if message_bytes is None
                              else _check_positive(message_bytes, "message_bytes", allow_zero=True))
        self.selection_s_per_entry = _check_positive(selection_s_per_entry, "selection_s_per_entry",
                                                     allow_zero=True)
        self.pair_compute_s = _check_positive(pair_compute_s, "pair_compute_s", allow_zero=True)
        self.dense = bool(dense)
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise ValueError(f"replicas must be None or an int >= 1, got {replicas!r}")
        self.replicas = replicas
        self.initial_density = (self.max_density if initial_density is None
                                else _check_density(initial_density, "initial_density"))
        self._explicit_message_bytes = message_bytes is not None

    def fixed_bytes(self, entries):
        """c0: the message's fixed cost and the sparse path's compute, in bytes."""
        return self.message_bytes + self.selection_s_per_entry * entries * self.bandwidth_bytes_per_s

    def profile_levels(self):
        """The depths the profile is taken at, descending: max_density halved
        while a half still covers PROFILE_HEADROOM * min_density. Static, so
        the fused op (whose depth is an attribute) has one variant per level."""
        levels = [self.max_density]
        while levels[-1] / 2.0 >= PROFILE_HEADROOM * self.min_density:
            levels.append(levels[-1] / 2.0)
        return levels

    def profile_depth(self, density):
        """The depth (a float) a step at `density` is profiled at: the
        shallowest of `profile_levels()` covering PROFILE_HEADROOM * density.

        >>> AdaptiveDensity(min_density=1e-4, max_density=0.1).profile_depth(0.001)
        0.00625
        """
        levels = self.profile_levels()
        return levels[int(self.profile_level(density))]

    def profile_level(self, density):
        """Index into `profile_levels()` of the shallowest depth covering
        PROFILE_HEADROOM * `density` (a float64 tensor; max_density's level at
        and above it, the dense end included), as an int32 tensor."""
        levels = tf.constant(self.profile_levels(), tf.float64)
        density = tf.cast(tf.convert_to_tensor(density, dtype_hint=tf.float64), tf.float64)  # a float: exactly
        wanted = tf.minimum(PROFILE_HEADROOM * density, self.max_density)
        covering = tf.reduce_sum(tf.cast(levels >= wanted * (1.0 - 1e-9), tf.int32))
        return tf.maximum(covering - 1, 0)

    def candidates(self, entries):
        """The densities the rule chooses among for `entries` entries, ascending:
        GRID_POINTS values of k spaced geometrically over [min_density * n,
        max_density * n], then 1.0 (send everything) when the dense end is on.
        The same on every replica, so a choice travels as its index."""
        return [k / float(entries) for k in self._grid(entries)] + ([1.0] if self.dense else [])

    def _grid(self, entries):
        """The sparse candidates as k values."""
        low = max(1.0, math.ceil(self.min_density * entries))
        high = max(low, math.ceil(self.max_density * entries))
        return sorted({float(round(low * (high / low) ** (i / (GRID_POINTS - 1)))) for i in range(GRID_POINTS)})

    def choose(self, profile, entries, pair_bytes, dense_bytes, total_energy=None):
        """The density the rule picks (float64 scalar tensor; 1.0: dense).

        profile: float64 [2, bins]: count and energy per ascending magnitude
        bin of the accumulated gradients, exact at least down to rank
        max_density * n from the top; entries: n, their number; pair_bytes:
        c1; dense_bytes: what sending everything costs (a float, or None when
        the dense end is off); total_energy: the energy of all entries (the
        dense end's gain; default: the profile's).
        """
        index = self.choose_index(profile, entries, pair_bytes, dense_bytes, total_energy)
        return tf.gather(tf.constant(self.candidates(entries), tf.float64), index)

    def choose_index(self, profile, entries, pair_bytes, dense_bytes, total_energy=None):
        """What `choose` picks, as an index into `candidates(entries)` (int32)."""
        profile = tf.cast(profile, tf.float64)
        counts, energy = tf.reverse(profile[0], [0]), tf.reverse(profile[1], [0])  # largest bins first
        through_k, through_e = tf.cumsum(counts), tf.cumsum(energy)
        above_k, above_e = through_k - counts, through_e - energy
        ks = self._grid(entries)
        grid = tf.constant(ks, tf.float64)
        # Beyond what the profile covers (zeros) a larger k gains nothing more.
        covered = tf.minimum(grid, tf.maximum(through_k[-1], 1.0))
        # E(k): the bins above k's bin, and k's share of its bin (linear inside it).
        bin_of_k = tf.minimum(tf.searchsorted(through_k, covered, side="left"), tf.size(counts) - 1)
        inside = tf.clip_by_value((covered - tf.gather(above_k, bin_of_k))
                                  / tf.maximum(tf.gather(counts, bin_of_k), 1.0), 0.0, 1.0)
        gain = tf.gather(above_e, bin_of_k) + inside * tf.gather(energy, bin_of_k)
        per_pair = pair_bytes + self.pair_compute_s * self.bandwidth_bytes_per_s
        ratio = gain / (self.fixed_bytes(entries) + per_pair * grid)
        best = tf.cast(tf.argmax(ratio), tf.int32)
        if dense_bytes is None or not self.dense:
            return best
        total = through_e[-1] if total_energy is None else tf.cast(total_energy, tf.float64)
        dense_ratio = total / (self.message_bytes + float(dense_bytes))
        return tf.where(dense_ratio > tf.gather(ratio, best), tf.constant(len(ks), tf.int32), best)

    def agree(self, votes, entries):
        """The density every replica uses next, from the SUM over replicas of
        one-hot votes (`tf.one_hot(choose_index(...), len(candidates(entries)))`):
        the lower median of the proposals.

        A median is a density some replica chose (a mean of 0.01 and 1.0
        would be 0.505, which no replica asked for and which costs more than
        either end in the all_gather mode); the lower one at an even count,
        so two replicas take the smaller proposal, never sending more than
        both wanted. One outlying replica cannot move it far.
        """
        votes = tf.cast(votes, tf.float64)
        replicas = tf.reduce_sum(votes)
        position = tf.math.floor((replicas - 1.0) / 2.0)  # 0-based rank of the lower median
        index = tf.argmax(tf.cast(tf.cumsum(votes) > position, tf.int32), output_type=tf.int32)
        return tf.gather(tf.constant(self.candidates(entries), tf.float64), index)

    def get_config(self):
        config = {"min_density": self.min_density, "max_density": self.max_density,
                  "latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                  "selection_s_per_entry": self.selection_s_per_entry, "dense": self.dense,
                  "pair_compute_s": self.pair_compute_s,
                  "replicas": self.replicas, "initial_density": self.initial_density}
        if self._explicit_message_bytes:
            config["message_bytes"] = self.message_bytes
        return config

    def __repr__(self):
        return f"AdaptiveDensity({', '.join(f'{k}={v!r}' for k, v in self.get_config().items())})"


# density="autopilot": the exchange measures the cluster when it is made
# (`tf_topk.autopilot`) and chooses the route and the density by time.
AUTOPILOT = "autopilot"


def adaptive_from(density):
    """The AdaptiveDensity `density` asks for ("adaptive", an AdaptiveDensity,
    or its config as {"adaptive": {...}}), or None for a fixed or scheduled
    one. "autopilot" gives the typed-in link's AdaptiveDensity, which the
    exchange replaces with the measured one."""
    if isinstance(density, AdaptiveDensity):
        return density
    if isinstance(density, str):
        if density not in ("adaptive", AUTOPILOT):
            raise ValueError(f"density must be a float in (0, 1], a list of (step, density) pairs, a callable, "
                             f"'adaptive', 'autopilot' or a tf_topk.schedule.AdaptiveDensity, got {density!r}")
        return AdaptiveDensity()
    if isinstance(density, dict) and set(density) == {"adaptive"}:
        return AdaptiveDensity(**density["adaptive"])
    return None
