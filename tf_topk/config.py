"""ExchangeConfig: every option of the sparse exchange, validated once, in one object.

`SparseExchange`, `tf_topk.TopKOptimizer` and `tf_topk.tf_keras.TopKOptimizer`
all take the same options; they live here once, with their checks, so that a
wrapper hands the exchange one object instead of spelling the options out
again, and `get_config` / `from_config` write and read them in one place.

    >>> config = tf_topk.ExchangeConfig(density=0.01, exchange_mode="auto")
    >>> exchange = tf_topk.SparseExchange(model.trainable_variables, config)
    >>> config.replace(density=0.001)          # a new, checked config
"""

import dataclasses
import math
from typing import Any, Optional

from tf_topk.ops import check_method
from tf_topk.schedule import AUTOPILOT, DensitySchedule, warmup_in_steps

# Below this many entries a variable takes the dense all-reduce: its k would be
# a handful of entries, so sparsifying saves almost nothing, while all small
# tensors (biases, normalisation parameters) travel together in one packed
# all-reduce and stay exact. 4096 float32 entries are 16 KiB.
DEFAULT_MIN_SIZE = 4096

EXCHANGE_MODES = ("auto", "allgather", "allreduce", "dense_bf16", "allgather_int8", "allgather_chunk")
SELECTION_SCOPES = ("variable", "bucket")

# density not given (None): the autopilot measures the cluster and chooses the routes and the
# density (`tf_topk.autopilot`). Where it cannot choose both, this fixed density: a route fixed by
# exchange_mode (or a router part), or Adam's momentum correction, whose frozen second moment
# takes a fixed density.
FIXED_DEFAULT_DENSITY = 0.001

# A fixed density of this or less starts, unless told otherwise (density_warmup_steps="auto"),
# with DGC's falling densities over DEFAULT_DENSITY_WARMUP_STEPS steps: from 0.25, a quarter of
# them at each of four densities, then the density given: it guards against the losses of error
# feedback at 0.001 started cold (measured: benchmarks/RESULTS.md#a-fixed-low-density-warms-up-by-default-density_warmup_steps).
WARMUP_UP_TO_DENSITY = 0.01
DEFAULT_DENSITY_WARMUP_STEPS = 400
WARMUP_INITIAL_DENSITY = 0.25

# decoupled_momentum="auto" chooses DeMo's decoupled momentum for an inner Adam or AdamW at a fixed
# density of this or less (measured: benchmarks/RESULTS.md#decoupled-momentum-for-adamw-demo).
DECOUPLED_UP_TO_DENSITY = 0.01

# Both thresholds above are densities of 8-byte pairs (float32 value, int32 index): a route that packs a
# pair in fewer bytes sends the same bytes at a higher density, and is held to the same thresholds by
# its density of 8-byte pairs (`ExchangeConfig.density_in_pair_bytes`).
# The routes that round the values they send, and to what.
ROUNDING_MODES = {"allgather_int8": "8 bits", "allgather_chunk": "a few bits on a per-chunk grid"}
PAIR_BYTES_SHARE = {"allgather_int8": 0.5, "allgather_chunk": 14 / 64}  # 14: the chunk route's default slot bits


def check_min_size(min_size):
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")


def check_min_k(min_k):
    if isinstance(min_k, bool) or not isinstance(min_k, int) or min_k < 1:
        raise ValueError(f"min_k must be an int >= 1, got {min_k!r}")


def check_local_clipnorm(local_clipnorm):
    if local_clipnorm is not None and (isinstance(local_clipnorm, bool) or not isinstance(local_clipnorm, (int, float))
                                       or not local_clipnorm > 0 or local_clipnorm == float("inf")):
        raise ValueError(f"local_clipnorm must be None or a finite float > 0, got {local_clipnorm!r}")


def check_exchange_mode(exchange_mode):
    if exchange_mode not in EXCHANGE_MODES:
        raise ValueError(f"exchange_mode must be one of {EXCHANGE_MODES}, got {exchange_mode!r}")


def check_selection_scope(selection_scope):
    if selection_scope not in SELECTION_SCOPES:
        raise ValueError(f"selection_scope must be one of {SELECTION_SCOPES}, got {selection_scope!r}")


def check_bucket_bytes(bucket_bytes):
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes < 8):
        raise ValueError(f"bucket_bytes must be None or an int >= 8, got {bucket_bytes!r}")


def check_momentum(momentum):
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 < momentum < 1.0:
        raise ValueError(f"momentum must be a float in (0, 1), got {momentum!r}")
    return float(momentum)


def check_beta_2(beta_2):
    if isinstance(beta_2, bool) or not isinstance(beta_2, (int, float)) or not 0.0 < beta_2 < 1.0:
        raise ValueError(f"beta_2 must be None or a float in (0, 1), got {beta_2!r}")
    return float(beta_2)


def check_epsilon(epsilon):
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0.0 < epsilon < float("inf"):
        raise ValueError(f"epsilon must be a finite float > 0, got {epsilon!r}")
    return float(epsilon)


def check_warmup_steps(warmup_steps):
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"variance_warmup_steps must be an int >= 1, got {warmup_steps!r}")
    return warmup_steps


# The link the autopilot plans for where none is given as `link=`: this environment variable's, else measured.
LINK_ENV = "TF_TOPK_LINK"


def check_link(link, name):
    """A link rate as `tf_topk.cost.parse_rate` reads it ("100mbit", "1gbit", "10gbit"), finite."""
    from tf_topk.cost import parse_rate

    try:
        rate = parse_rate(link) if isinstance(link, str) else None
    except ValueError:
        rate = None
    if rate is None:
        raise ValueError(f"{name} must be a link rate such as '100mbit', '1gbit' or '10gbit', got {link!r}")
    return link


def check_decoupled_momentum(value):
    if value != "auto" and not isinstance(value, bool):
        raise ValueError(f"decoupled_momentum must be 'auto', True or False, got {value!r}")


# Decoupled momentum's sign step in learning rates (ExchangeConfig.decoupled_step_scale).
DEFAULT_STEP_SCALE = 2.0


def check_step_scale(scale, name="decoupled_step_scale"):
    """A sign step's size in learning rates: a finite number above 0, as a float."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {scale!r}")
    return float(scale)


def check_density_warmup_steps(steps):
    if steps != "auto" and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
        raise ValueError(f"density_warmup_steps must be 'auto' or an int >= 0, got {steps!r}")


def _check_bucket_scope(config):
    """What selection_scope="bucket" cannot go with (the routes and the rules
    that count on k entries of every variable), named."""
    if config.exchange_mode != "allgather":
        raise ValueError(f"selection_scope='bucket' needs exchange_mode='allgather' (each replica sends its own "
                         f"pairs), got exchange_mode={config.exchange_mode!r}")
    if config.sparse_output:
        raise ValueError("selection_scope='bucket' cannot go with sparse_output=True (sparse updates): each "
                         "replica's pairs fall into the variables differently, so they are densified")
    if config.schedule.adaptive is not None:
        raise ValueError("selection_scope='bucket' cannot go with an adaptive density: pass a float density or "
                         "a schedule")


def _check_decoupled_momentum_options(config):
    """What decoupled_momentum=True cannot go with, named."""
    if config.momentum is not None:
        raise ValueError("decoupled_momentum=True keeps its own momentum: it cannot go with momentum correction "
                         "(momentum=... / momentum_correction=True); pass one or the other")
    if not config.error_feedback:
        raise ValueError("decoupled_momentum=True keeps the momentum not sent in the residual: it needs "
                         "error_feedback=True")
    if config.sparse_output:
        raise ValueError("sparse_output=True (sparse updates) is for SGD; decoupled_momentum=True applies a "
                         "direction to every entry")
    if config.schedule.adaptive is not None or config.schedule.autopilot:
        raise ValueError("decoupled_momentum=True takes a fixed density or a schedule, not an adaptive density "
                         f"or the autopilot, got density={config.density!r}")
    if config.exchange_mode == "dense_bf16":
        raise ValueError("exchange_mode='dense_bf16' sends every entry, the 16-bit baseline of the inner "
                         "optimizer: decoupled momentum would be a sign step of every replica's momentum, not that "
                         "baseline; pass decoupled_momentum=False (or 'auto') with it")


def _check_rescale_residuals(config):
    """rescale_residuals=True rescales plain error feedback's residual: refuse what has none of its own."""
    if config.rescale_residuals not in (True, False):
        raise ValueError(f"rescale_residuals must be True or False, got {config.rescale_residuals!r}")
    if not config.error_feedback:
        raise ValueError("rescale_residuals=True rescales the residual: it needs error_feedback=True")
    if config.momentum is not None:
        raise ValueError("rescale_residuals=True is for plain error feedback; momentum correction (momentum=...) "
                         "keeps a velocity of its own: pass one or the other")
    if config.decoupled_momentum is True:
        raise ValueError("rescale_residuals=True is for plain error feedback; decoupled_momentum=True keeps a "
                         "momentum of its own: pass one or the other")


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    """The options of a sparse exchange (see `tf_topk.SparseExchange` for each).

    Args:
      density: a float in (0, 1], (step, density) pairs, a callable,
        "adaptive" / a `tf_topk.schedule.AdaptiveDensity`, or "autopilot"
        (measured when the exchange is made, `tf_topk.autopilot`; it
        chooses the routes, so exchange_mode must be "auto"). None (the
        default): "autopilot", or FIXED_DEFAULT_DENSITY (0.001) where the
        route is fixed (exchange_mode other than "auto") or with Adam's
        momentum correction (beta_2 set), which takes a fixed density. The
        field stays None (saved as not given); `schedule` is what runs.
      method: "gaussian" or "exact" (the default selector's).
      min_size: variables with fewer entries take the dense all-reduce.
      min_k: the fewest entries a sparsified variable sends a step (its size
        if smaller): a floor under k = ceil(density * size), so that at a low
        density a small layer is not starved (k of 5 for 4,608 entries at
        0.001); the pairs, and the bytes, rise by what the floor adds. 1 (the
        default): k as the density gives it. Not with an adaptive density or
        the autopilot, which choose k themselves (the exchange refuses them).
      bucket_bytes: bound on a bucket's pair bytes; None: one bucket.
      error_feedback: keep residuals (default), or drop unsent entries.
      momentum: None, or m in (0, 1) for momentum correction (DGC); Adam's
        beta_1 with beta_2.
      nesterov, momentum_masking: momentum correction's variants (SGD's).
        Masking (DGC's momentum factor masking, zeroing a replica's velocity
        where it sent) is off by default: it drops the momentum an entry
        would still get after it is sent, so an entry sent often trains with
        hardly any momentum (measured on CNNs:
        benchmarks/RESULTS.md#convolutional-networks-at-01-density-where-the-loss-comes-from).
      beta_2: None, or Adam's beta_2 for Adam's momentum correction
        (`tf_topk.memory.AdamMomentumCorrectionMemory`): dense Adam for
        `variance_warmup_steps` steps, then the second moment frozen and
        each replica's momentum of the preconditioned gradient sent.
      epsilon: Adam's epsilon (with beta_2).
      variance_warmup_steps: dense Adam steps before the second moment
        freezes (with beta_2; 10% of the run or less is enough).
      local_clipnorm: DGC's local gradient clipping (None: off).
      exchange_mode: "auto" (per bucket: all_gather while P * k <= n / 16,
        else the route that sends the fewest bytes, agreed indices or
        dense), "allgather", "allreduce" (agreed indices), or "dense_bf16"
        (no sparsification: every entry in bfloat16, the rounding error kept
        in the residuals; the 16-bit baseline, `routes.Bfloat16DenseRoute`),
        or "allgather_int8" (all_gather of 4-byte pairs: values rounded to 8
        bits, the rounding error kept in the residuals, beside 24-bit
        indices, so twice the density for all_gather's bytes;
        `routes.Int8AllGatherRoute`; buckets of at most 2**24 entries),
        or "allgather_chunk" (the same share of every chunk of 4,096
        entries, each sent in 14 bits: a 12-bit index in its chunk and a
        2-bit value on the chunk's grid, the rounding error kept in the
        residuals; about 4.5x all_gather's entries for its bytes;
        `routes.ChunkAllGatherRoute`; variables of any size).
      sparse_output: hand sparsified gradients out as pairs.
      selection_scope: "variable" (default: k entries of each variable) or
        "bucket": one selection of the bucket's k (the sum of its variables'
        k, so the same bytes) over all its variables, each entry ranked by
        its magnitude over its variable's root mean square, so a variable
        gets more of k the more its largest entries stand out; the recipe for
        CNNs (measured: benchmarks/RESULTS.md#one-selection-over-the-bucket-selection_scopebucket). Needs
        exchange_mode="allgather" (each replica sends its own pairs; how many
        fall in each variable differs between replicas), a fixed or scheduled
        density and dense output.
      density_warmup_steps: "auto" (default): a fixed density of
        WARMUP_UP_TO_DENSITY (0.01) or less (in 8-byte pairs' bytes: 0.02 with
        "allgather_int8") starts with DGC's falling densities over
        the first DEFAULT_DENSITY_WARMUP_STEPS (400) steps, four stages of
        100 from 0.25 down (`tf_topk.schedule.warmup_in_steps`),
        except with Adam's momentum correction, whose first steps are dense
        anyway; any other density as given. An int: that many steps of
        warm-up for a fixed density below 0.25 (0: none, the density from the
        first step). A schedule, an adaptive density or the autopilot with
        an int above 0: a ValueError. Under exchange_mode="auto" it routes
        as any falling schedule: all_gather up to 4 replicas, as the density
        alone; from 5 on, where all_gather at 0.25 would send more than the
        dense all-reduce, agreed indices (or dense on the steps they would
        send more), for the whole run.
      decoupled_momentum: True: DeMo's decoupled momentum
        (`tf_topk.decoupled_momentum`): each replica's momentum in the space
        of a blockwise DCT, the top-k of it sent, the sign of the decoded sum
        applied as the update direction (by the Keras wrappers, at the inner
        optimizer's learning rate, with its decoupled weight decay). "auto"
        (default): the Keras wrappers choose it for an inner Adam or AdamW
        at a fixed density of DECOUPLED_UP_TO_DENSITY (0.01) or less (0.02
        with "allgather_int8", which sends the same bytes)
        (`tf_topk.adapter.wrapper_exchange_config`), and with no density
        given, wherever the autopilot's plan sparsifies, at the plan's fixed
        density (`tf_topk.autopilot.Plan.fixed_density`); an exchange made
        from the config alone, which has no inner optimizer, takes it as
        False. Not with momentum correction, sparse_output, an adaptive
        density or "dense_bf16" (the inner optimizer's 16-bit baseline).
      decoupled_step_scale: decoupled momentum's step in learning rates:
        each sparsified entry moves by decoupled_step_scale times the inner
        optimizer's rate a step (2.0, the default, measured better than DeMo's
        1.0 on both texts, clipped or not: benchmarks/RESULTS.md, "AdamW on
        every path"). Saved with the config; one written before it existed
        loads with 1.0, the step it ran.
      rescale_residuals: plain error feedback whose residual follows the
        learning rate: before each step it is multiplied by the previous
        step's rate over this step's, so an entry sent late moves its
        variable as far as the steps it waited would have (the error kept in
        update space, as EF-SGD's). Changes nothing at a constant rate; under
        a decaying schedule it keeps what waited from shrinking with the
        rate. Needs the learning rate at each call (the Keras wrappers pass
        it); not with momentum correction or decoupled momentum (with an
        inner Adam, decoupled_momentum="auto" then keeps plain error feedback).
      link: the cluster's link as a rate ("100mbit", "1gbit", "10gbit"),
        stated instead of measured: the autopilot (no density given) plans
        for it, with 0.5 ms a collective, and so plans the same on every run.
        None (the default): the TF_TOPK_LINK environment variable's, else the
        cluster measured. Only with no density given (else a ValueError).

    Frozen and checked when made: a bad value raises a ValueError that names
    it. `replace(**changes)` makes a checked copy.
    """

    density: Any = None
    method: str = "gaussian"
    min_size: int = DEFAULT_MIN_SIZE
    min_k: int = 1
    bucket_bytes: Optional[int] = None
    error_feedback: bool = True
    momentum: Optional[float] = None
    nesterov: bool = False
    momentum_masking: bool = False
    local_clipnorm: Optional[float] = None
    exchange_mode: str = "auto"
    sparse_output: bool = False
    beta_2: Optional[float] = None
    epsilon: float = 1e-7
    variance_warmup_steps: int = 100
    selection_scope: str = "variable"
    density_warmup_steps: Any = "auto"
    decoupled_momentum: Any = "auto"
    decoupled_step_scale: float = DEFAULT_STEP_SCALE
    rescale_residuals: bool = False
    link: Optional[str] = None

    def __post_init__(self):
        check_method(self.method)
        check_decoupled_momentum(self.decoupled_momentum)
        object.__setattr__(self, "decoupled_step_scale", check_step_scale(self.decoupled_step_scale))
        if self.decoupled_momentum is True:
            _check_decoupled_momentum_options(self)
        check_density_warmup_steps(self.density_warmup_steps)
        self.schedule  # validates the density
        check_min_size(self.min_size)
        check_min_k(self.min_k)
        check_bucket_bytes(self.bucket_bytes)
        check_local_clipnorm(self.local_clipnorm)
        check_exchange_mode(self.exchange_mode)
        check_selection_scope(self.selection_scope)
        if self.selection_scope == "bucket":
            _check_bucket_scope(self)
        if self.exchange_mode != "auto" and self.schedule.autopilot:
            raise ValueError(f"density='autopilot' chooses each bucket's route, so exchange_mode must be 'auto', "
                             f"got {self.exchange_mode!r}: leave density out for a fixed 0.001 on that route")
        if self.exchange_mode == "allgather_chunk" and self.schedule.adaptive is not None:
            raise ValueError("exchange_mode='allgather_chunk' selects a share of every chunk, and an adaptive density "
                             "reads the whole variable's magnitude profile: pass a float density or a schedule")
        if self.momentum is not None:
            object.__setattr__(self, "momentum", check_momentum(self.momentum))
            if not self.error_feedback:
                raise ValueError("momentum correction accumulates the velocity in the residual: it needs "
                                 "error_feedback=True")
        elif self.nesterov:
            raise ValueError("nesterov=True needs momentum=... (momentum correction)")
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon))
        check_warmup_steps(self.variance_warmup_steps)
        if self.beta_2 is not None:
            object.__setattr__(self, "beta_2", check_beta_2(self.beta_2))
            if self.momentum is None:
                raise ValueError("beta_2=... (Adam's momentum correction) needs momentum=... (Adam's beta_1)")
            if self.nesterov:
                raise ValueError("nesterov=True is SGD's momentum correction; Adam's (beta_2=...) has no Nesterov "
                                 "variant")
            if self.sparse_output:
                raise ValueError("sparse_output=True (sparse updates) is for SGD; Adam's momentum correction "
                                 "(beta_2=...) applies dense directions")
            if self.schedule.adaptive is not None:
                raise ValueError("an adaptive density cannot go with Adam's momentum correction (beta_2=...): "
                                 "pass a float density")
            if self.exchange_mode in ROUNDING_MODES:
                raise ValueError(f"exchange_mode={self.exchange_mode!r} rounds what is sent to "
                                 f"{ROUNDING_MODES[self.exchange_mode]}, and Adam's momentum correction (beta_2=...) "
                                 "sends every gradient entry exactly during its variance warm-up: pass "
                                 "exchange_mode='allgather' or 'auto'")
        if self.rescale_residuals:
            _check_rescale_residuals(self)
        if self.link is not None:
            check_link(self.link, "link")
            if not self.schedule.autopilot:
                raise ValueError(f"link={self.link!r} states the cluster's link for the autopilot, which plans only "
                                 f"with no density given; got density={self.density!r}"
                                 + (f" and exchange_mode={self.exchange_mode!r}" if self.exchange_mode != "auto" else "")
                                 + ": leave link out, or leave density out")
        for name in ("error_feedback", "nesterov", "momentum_masking", "sparse_output", "rescale_residuals"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    @property
    def schedule(self):
        """The DensitySchedule that runs: `density` (None: the default, see
        the class), with its warm-up (`density_warmup_steps`)."""
        given, steps = self._given_and_warmup()
        if not steps:
            return given
        return DensitySchedule(warmup_in_steps(steps, final=given.constant, initial=WARMUP_INITIAL_DENSITY))

    def density_in_pair_bytes(self, density):
        """`density` as the density of 8-byte pairs that sends the same bytes on this exchange_mode
        (half of it with "allgather_int8"): what the "auto" thresholds compare."""
        return density * PAIR_BYTES_SHARE.get(self.exchange_mode, 1.0)

    @property
    def density_warmup_taken(self):
        """The steps of density warm-up that run (`density_warmup_steps`
        applied to the density): 0 where none does."""
        return self._given_and_warmup()[1]

    def _given_and_warmup(self):
        """(the DensitySchedule given, before any warm-up; the warm-up's steps that run, 0 for none)."""
        if self.density is not None:
            given = DensitySchedule(self.density)
        else:
            fixed = self.beta_2 is not None or self.decoupled_momentum is True or self.exchange_mode != "auto"
            given = DensitySchedule(FIXED_DEFAULT_DENSITY if fixed else AUTOPILOT)
        steps = self._warmup_steps(given)
        if not steps or given.constant >= WARMUP_INITIAL_DENSITY:  # nothing above it to start from
            return given, 0
        return given, steps

    def _warmup_steps(self, given):
        """Steps of the density warm-up that `density_warmup_steps` asks of `given`."""
        if self.density_warmup_steps == "auto":
            low = given.constant is not None and self.density_in_pair_bytes(given.constant) <= WARMUP_UP_TO_DENSITY
            return DEFAULT_DENSITY_WARMUP_STEPS if low and self.beta_2 is None else 0
        if self.density_warmup_steps and given.constant is None:
            given_as = f"density={self.density!r}" + (" (the autopilot)" if self.density is None else "")
            raise ValueError(f"density_warmup_steps={self.density_warmup_steps} warms up a fixed density, got "
                             f"{given_as}: give the warm-up in the schedule, or density_warmup_steps=0")
        if self.density_warmup_steps and given.constant >= WARMUP_INITIAL_DENSITY:
            raise ValueError(f"density_warmup_steps={self.density_warmup_steps} warms up from "
                             f"{WARMUP_INITIAL_DENSITY} down to the density given, but density={self.density!r} is "
                             f"not below {WARMUP_INITIAL_DENSITY}: nothing would warm up. Pass density_warmup_steps=0 "
                             "(or 'auto'), or a lower density")
        return self.density_warmup_steps

    def settled_pairs(self, size):
        """The pairs a variable of `size` entries sends once a warm-up is
        over (k at its last density), else `max_pairs`: what buckets are
        sized for (a warm-up's first steps send more, not for long)."""
        settled = self.schedule.settled_density()
        return self.max_pairs(size) if settled is None else self.floored_k(size, math.ceil(settled * size))

    def max_pairs(self, size):
        """The most pairs a variable of `size` entries sends in a step (its k
        at the schedule's largest density), for sizing buckets."""
        max_density = self.schedule.max_density()
        return size if max_density is None else self.floored_k(size, math.ceil(max_density * size))

    def floored_k(self, size, k):
        """k within [min(min_k, size), size] (and at least 1)."""
        return max(1, min(self.min_k, size), min(size, k))

    def replace(self, **changes):
        """A copy with `changes`, checked again."""
        return dataclasses.replace(self, **changes)

    def get_config(self):
        """A JSON-friendly dict (`from_config` reads it back)."""
        config = dataclasses.asdict(self)
        config["density"] = None if self.density is None else DensitySchedule(self.density).get_config()  # as given
        return config

    @classmethod
    def from_config(cls, config):
        """Reads what get_config writes. A config written before
        density_warmup_steps existed ran its density from the first step:
        it loads with 0, not with today's default ("auto"), so that a run
        resumed at a low density does not start a warm-up it never ran; one
        written before decoupled_momentum existed loads with False, the
        method it ran."""
        config = dict(config)
        config.setdefault("density_warmup_steps", 0)
        config.setdefault("decoupled_momentum", False)  # written before it existed: the method it ran
        config.setdefault("rescale_residuals", False)
        config.setdefault("decoupled_step_scale", 1.0)  # written before it existed: the sign step it ran
        config.setdefault("link", None)
        if isinstance(config.get("density"), list):  # JSON turns (step, density) pairs into lists
            config["density"] = [tuple(pair) if isinstance(pair, list) else pair for pair in config["density"]]
        return cls(**config)
