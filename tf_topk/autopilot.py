"""The autopilot: measure the cluster once, then choose routes and densities by predicted time.

The default: `TopKOptimizer(inner)` and `SparseExchange(variables)` with
no density given (or density="autopilot"; an explicit density keeps a
fixed one, and Adam's momentum correction, when asked for, keeps 0.001) call `plan` when
the exchange is made: it calibrates the collectives and the selection
under the strategy in use (`tf_topk.calibrate`), prints one line of what
it found, and gives the exchange its parts. Where sending every entry
(dense, or bfloat16 when that is faster) is predicted to beat even the
sparsest step of the adaptive range, every step goes that way: no
selection is spent (a fast link with a small model; the residuals stay
empty). Where the prediction is a close call, the calibration times both
steps whole, and the sparse one is taken only where it ran
SPARSE_MUST_WIN_BY times faster (else every entry, dense). Otherwise a `TimedRouter` (per
bucket: dense, 16-bit dense, all_gather or agreed indices, whichever is
predicted fastest) and an `AdaptiveDensity` whose link is the measured one
(Khirirat et al.'s most improvement per unit of cost, in the measured
seconds): a slow link sends little.

Calibration needs eager execution in the cross-replica context (an
exchange made under `strategy.scope()`, or `optimizer.build(variables)`
before the training loop; `model.fit` builds so). An exchange made inside a
traced function cannot time anything: it then uses the typed-in link of
`tf_topk.cost` (1 Gbit/s, 0.5 ms) and says so.

`advise(model, entries)` predicts, without training, what dense, the 16-bit
dense all-reduce and each route at each density would cost per step, and
what the autopilot would choose (`python -m tf_topk.bench advise`).
"""

import dataclasses
import math
import os

from tf_topk.config import LINK_ENV
from tf_topk.cost import AUTO_AGREED_SLOTS, CostModel, LinkModel

# The link assumed when nothing can be measured (an exchange made in a traced function).
ASSUMED_LINK = "1gbit"
# Largest bandwidth the adaptive density is told (a measured slope of 0: unlimited).
MAX_BANDWIDTH_BYTES_PER_S = 1e12
# The adaptive density's range where the autopilot sparsifies, and the density its router
# decides the route at (the range's geometric middle): a route cannot change per step, and
# only dense is reachable from agreed indices, so the plan settles dense or sparse once and
# the adaptive rule chooses k within the sparse range.
MIN_DENSITY, MAX_DENSITY = 1e-4, 0.1
TYPICAL_DENSITY = math.sqrt(MIN_DENSITY * MAX_DENSITY)
# Where the trial timed the steps whole (a close call), the most step time the adaptive
# density may add to the timed sparse step's: the range stops where the line through the two
# timed sparse steps reaches it. The rule buys the most gradient energy per second, which on a
# fast link is many pairs at a cost small in bytes yet not in a step so short (the small CNN on
# unlimited links took 0.066-0.076 and ran 0.85-0.96x dense, where density 0.001 ran 1.1-1.3x).
CLOSE_CALL_SLACK = 0.05
# Where the trial timed the steps whole, how many times faster than the dense step the timed
# sparse step must be for the plan to sparsify. The trial times the exchange, not the work the
# sparse path adds around it in a training step (a selection per variable, the residuals' and
# statistics' updates), and closer than this the order of two short steps on a busy machine is
# noise, while every entry sent dense costs no accuracy. On localhost the demo's trial timed
# the sparse step 1.2-1.35x faster, and trained slower than dense (9.0 ms against 7.7 ms a step).
SPARSE_MUST_WIN_BY = 1.5
# With decoupled momentum (an inner Adam or AdamW) a plan that sparsifies sends a fixed density, not an
# adaptive one (the momentum lives in the DCT's space, where the adaptive rule's profile of the gradient
# means nothing): the first of the densities decoupled momentum was measured at
# (benchmarks/RESULTS.md#decoupled-momentum-for-adamw-demo)
# whose exchange is predicted FIXED_DENSITY_SAVING times faster than sending every entry, or that the
# next would not make twice as fast (a link where latency, not bytes, sets the time), else the last.
# A tenth of dense's exchange leaves little to gain from fewer pairs (at most that tenth of a step),
# and 0.01 is the more accurate.
DECOUPLED_DENSITIES = (0.01, 0.001)
FIXED_DENSITY_SAVING = 10.0
# At the last of them, where all_gather is the route, the plan sends the same bytes as 14-bit entries
# (`exchange_mode="allgather_chunk"`: 64 / 14 times the entries, density 0.00457): with AdamW on both
# texts that was more accurate on every seed of 8, and at 0.01's bytes less accurate, so 0.01 keeps
# 8-byte pairs (benchmarks/RESULTS.md#each-sent-entry-in-14-bits-allgather_chunk).
CHUNK_AT_DENSITY = DECOUPLED_DENSITIES[-1]
# Set to 1, the chief prints the calibration's figures (`Plan.describe()`) under the decision's line.
VERBOSE_ENV = "TF_TOPK_VERBOSE"
# Densities `advise` tabulates.
ADVISE_DENSITIES = (0.1, 0.01, 0.001, 0.0001)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the autopilot decided for an exchange of `entries` sparsifiable
    entries and `small_entries` dense-path ones: the cost model, the
    calibration behind it (None when assumed), and the parts it makes."""

    model: CostModel
    calibration: object
    entries: int
    small_entries: int = 0
    # The inner optimizer takes decoupled momentum where the plan sparsifies: a fixed density
    # (`fixed_density`). Not saved: it is the optimizer's, set again where the plan is used.
    decoupled: bool = False
    # The link the user stated (`link=` or TF_TOPK_LINK), where nothing was measured: the model is its.
    link: object = None

    def dense_route(self):
        """"dense" or "dense_bf16" where no density of the adaptive range would
        be faster than sending every entry (the faster of the two; one
        replica: dense, nothing travels), else None. Where the calibration
        timed both steps whole (a close call), the measured times decide:
        "dense" unless the sparse step was SPARSE_MUST_WIN_BY times faster."""
        if self.entries == 0:  # no variable large enough to sparsify
            return "dense"
        trial = None if self.calibration is None else self.calibration.trial()
        if trial is not None:
            dense_s, sparse_s = trial
            return "dense" if dense_s < SPARSE_MUST_WIN_BY * sparse_s else None
        dense_s, sparse_s = self._predicted_steps()
        return self.model.choose(max(1, self.entries), 0, ("dense", "dense_bf16"), self.small_entries) \
            if dense_s <= sparse_s else None

    def _predicted_steps(self, density=None):
        """(the faster of dense and dense_bf16, the fastest sparse step at `density`), predicted seconds;
        `density` None: the sparse end (`sparsest_density`)."""
        entries, small = max(1, self.entries), self.small_entries
        pairs = max(1, math.ceil((density or self.sparsest_density()) * entries))
        sparse = min(self.model.route_time(route, pairs, entries, small) for route in ("allgather", "allreduce"))
        dense = self.model.choose(entries, 0, ("dense", "dense_bf16"), small)
        return self.model.route_time(dense, 0, entries, small), sparse

    def sparsest_density(self):
        """The fewest pairs the plan may send: the adaptive range's bottom, or with decoupled momentum
        the last of its fixed densities."""
        return DECOUPLED_DENSITIES[-1] if self.decoupled else MIN_DENSITY

    def fixed_density(self):
        """With decoupled momentum, where the plan sparsifies: the first of DECOUPLED_DENSITIES whose
        exchange is predicted FIXED_DENSITY_SAVING times faster than sending every entry, or that the
        next would not make twice as fast, else the last. None otherwise."""
        if not self.decoupled or self.dense_route():
            return None
        for density, sparser in zip(DECOUPLED_DENSITIES, DECOUPLED_DENSITIES[1:]):
            dense_s, sparse_s = self._predicted_steps(density)
            if FIXED_DENSITY_SAVING * sparse_s <= dense_s or 2.0 * self._predicted_steps(sparser)[1] > sparse_s:
                return density
        return DECOUPLED_DENSITIES[-1]

    def chunked(self):
        """Whether decoupled momentum's fixed density is sent in 14-bit entries (the chunk route, at
        `chunk_density()`): at CHUNK_AT_DENSITY, where all_gather would be its route."""
        density = self.fixed_density()
        return density == CHUNK_AT_DENSITY and \
            self.model.sparse_route_at(max(1, self.entries), density, self.small_entries) == "allgather"

    @staticmethod
    def chunk_density(density=CHUNK_AT_DENSITY):
        """The density of the chunk route's entries that sends the bytes of `density` in 8-byte pairs."""
        from tf_topk.routes import ROUTES

        return density * 64 / ROUTES["allgather_chunk"].slot_bits

    def method(self):
        """What runs, in words: "every entry, dense" (or dense_bf16), "decoupled momentum (DeMo) at
        density D" (and in what entries, where not 8-byte pairs), or "top-k with error feedback at an
        adaptive density"."""
        from tf_topk.methods import DECOUPLED, TOP_K

        dense = self.dense_route()
        if dense:
            return f"every entry, {dense}"
        if self.chunked():
            return (f"{DECOUPLED} at density {self.density():.3g} in 14-bit entries (the bytes of "
                    f"{self.fixed_density():g} in 8-byte pairs)")
        if self.decoupled:
            return f"{DECOUPLED} at density {self.fixed_density():g}"
        return f"{TOP_K} at an adaptive density {MIN_DENSITY:g} to {self.max_density():.3g}"

    def route(self):
        """The route this plan's router takes for one bucket of every
        sparsifiable entry: `dense_route()`, or the sparse route predicted
        fastest at TYPICAL_DENSITY (as `router()` settles it), or "allgather_chunk" where `chunked()`."""
        if self.chunked():
            return "allgather_chunk"
        return self.dense_route() or self.model.sparse_route_at(max(1, self.entries),
                                                                self.fixed_density() or TYPICAL_DENSITY,
                                                                self.small_entries)

    def router(self):
        """A TimedRouter over the model (its sparse route settled at TYPICAL_DENSITY, or at decoupled
        momentum's fixed density), or a FixedRouter of `dense_route()` where that holds, or of the chunk
        route where `chunked()`."""
        from tf_topk.routes import ROUTES, FixedRouter, TimedRouter

        dense = self.dense_route()
        if dense:
            return FixedRouter(ROUTES[dense])
        if self.chunked():
            return FixedRouter(ROUTES["allgather_chunk"])
        return TimedRouter(self.model, self.small_entries, typical_density=self.fixed_density() or TYPICAL_DENSITY)

    def density(self, replicas=None):
        """An AdaptiveDensity over the measured link (all-reduce latency and
        bandwidth, selection time) in [MIN_DENSITY, max_density()], without
        its dense end (the plan chose sparse), or 1.0 where `dense_route()`
        holds. What a pair costs beyond its bytes is the measured densifying,
        or, where the trial timed two sparse steps, what a further pair added
        to them. The first step sends the range's TYPICAL_DENSITY (at most its
        top), not its top: from 0.1 the rule took about 10 steps to come down
        to the 0.001 it settles at on the wide MLP, and those steps send 4-50x
        the pairs. replicas: the workers its byte costs assume (default: the
        replicas in sync; set it to study a cluster from one process)."""
        from tf_topk.schedule import AdaptiveDensity

        if self.dense_route():
            return 1.0
        if self.chunked():
            return self.chunk_density()
        if self.decoupled:
            return self.fixed_density()
        link = self.model.all_reduce
        bandwidth = MAX_BANDWIDTH_BYTES_PER_S if link.seconds_per_byte == 0 else \
            min(1.0 / link.seconds_per_byte, MAX_BANDWIDTH_BYTES_PER_S)
        pair_compute_s = self.model.pair_s * self.model.replicas
        slope = None if self.calibration is None else self.calibration.pair_slope_s()
        if slope is not None:  # the timed step's slope holds the pair's bytes too
            pair_bytes = (self.model.replicas - 1) * 8.0
            pair_compute_s = max(pair_compute_s, slope - pair_bytes / bandwidth)
        top = self.max_density()
        return AdaptiveDensity(min_density=MIN_DENSITY, max_density=top, latency_s=link.latency_s,
                               bandwidth_bytes_per_s=bandwidth, selection_s_per_entry=self.model.selection_s_per_entry,
                               dense=False, replicas=replicas, pair_compute_s=pair_compute_s,
                               initial_density=min(TYPICAL_DENSITY, top))

    def max_density(self):
        """The top of the sparse range: MAX_DENSITY, or where the trial timed
        two sparse steps, the density whose step the line through them puts
        at the dense step's time over SPARSE_MUST_WIN_BY (the sparse range
        stays as much faster than dense as the plan asked of it) or
        CLOSE_CALL_SLACK above the timed sparse step's, whichever comes
        first, within [MIN_DENSITY, MAX_DENSITY]."""
        calibration = self.calibration
        slope = None if calibration is None else calibration.pair_slope_s()
        if not slope:
            return MAX_DENSITY
        dense_s, sparse_s = calibration.trial()
        budget_s = min(dense_s / SPARSE_MUST_WIN_BY, (1.0 + CLOSE_CALL_SLACK) * sparse_s)
        k = calibration.trial_k + max(0.0, budget_s - sparse_s) / slope
        return min(MAX_DENSITY, max(MIN_DENSITY, k / max(1, self.entries)))

    def get_config(self):
        """What a saved optimizer keeps of a measured plan (JSON-ready): the
        cost model every worker agreed on and the calibration's timed steps,
        without its points and phases (one worker's). `Plan.from_config` makes the same
        plan again, and so the same decisions, without measuring."""
        if self.calibration is None:
            raise ValueError("only a measured plan is saved (this one assumed or was told its link)")
        calibration = {field.name: getattr(self.calibration, field.name)
                       for field in dataclasses.fields(self.calibration) if field.name not in ("points", "phases")}
        calibration["model"] = dataclasses.asdict(calibration["model"])
        return _plain({"model": dataclasses.asdict(self.model), "calibration": calibration, "entries": self.entries,
                       "small_entries": self.small_entries})

    @classmethod
    def from_config(cls, config):
        from tf_topk.calibrate import Calibration

        calibration = dict(config["calibration"])
        calibration["model"] = _cost_model(calibration["model"])
        return cls(_cost_model(config["model"]), Calibration(points={}, **calibration), config["entries"],
                   config["small_entries"])

    def decision(self):
        """The line the chief prints: what the plan runs, why (the step times it compared: timed where
        the calibration timed both steps, else predicted) and how to override it. The figures behind
        it are `describe()`'s, printed too with TF_TOPK_VERBOSE=1."""
        if self.entries == 0 or self.model.replicas == 1 or (self.calibration is None and self.link is None):
            return self.describe()  # nothing measured or stated: that line says what runs and why
        dense = self.dense_route()
        trial = None if self.calibration is None else self.calibration.trial()
        if trial is not None:
            dense_s, sparse_s = trial
            how = "timed"
        else:  # `dense_route`'s comparison: every entry against the sparse end's fastest step
            dense_s, sparse_s = self._predicted_steps(self.fixed_density())
            how = "predicted"
        where = "" if trial is not None else f" at density {self.fixed_density() or self.sparsest_density():g}"
        asked = "" if trial is None else f", {SPARSE_MUST_WIN_BY:g}x asked"
        link = "" if self.link is None else f" (the stated link {self.link}, {_replicas(self.model.replicas)})"
        times = (f"a step {how} {dense_s * 1e3:,.1f} ms sending every entry, {sparse_s * 1e3:,.1f} ms sparse{where} "
                 f"(sparse {dense_s / sparse_s:.2f}x as fast{asked})" if sparse_s > 0 else
                 f"a step {how} {dense_s * 1e3:,.1f} ms sending every entry")
        if dense:
            method = " with decoupled momentum" if self.decoupled else ""
            return (f"tf_topk autopilot{link}: every entry, {dense}: {times}; density=0.01 (any fixed density) "
                    f"sparsifies anyway{method}, TF_TOPK_VERBOSE=1 prints the calibration")
        if self.decoupled:
            return (f"tf_topk autopilot{link}: {self.method()}, fixed (of "
                    f"{', '.join(f'{d:g}' for d in DECOUPLED_DENSITIES)}, the first whose exchange is predicted "
                    f"{FIXED_DENSITY_SAVING:g}x faster than every entry's or not twice as slow as the next's), "
                    f"{self.route()}: {times}; density=D sets "
                    "another fixed density, density=1.0 sends every entry, "
                    + ("exchange_mode='allgather' 8-byte pairs at 0.001, " if self.chunked() else "")
                    + "decoupled_momentum=False runs top-k in front of the inner optimizer at an adaptive density")
        return (f"tf_topk autopilot{link}: {self.route()}, adaptive density {MIN_DENSITY:g} to "
                f"{self.max_density():.3g}: {times}; density=1.0 sends every entry, density=0.01 a fixed density, "
                "TF_TOPK_VERBOSE=1 prints the calibration")

    def describe(self):
        dense = self.dense_route()
        choice = f"; {self.method()}" + ("" if dense else f", {self.route()}")
        if self.entries == 0:
            return ("tf_topk autopilot: no variable of min_size entries or more, nothing to sparsify: every "
                    "entry, dense (nothing measured)")
        if self.calibration is not None:
            return f"tf_topk autopilot: {self.calibration.describe()}{choice}"
        if self.model.replicas == 1:
            return f"tf_topk autopilot: one replica, nothing to exchange{choice}"
        if self.link is not None:
            return f"tf_topk autopilot: the stated link {self.link}, {self.model.describe()}{choice}"
        return (f"tf_topk autopilot: nothing measured (the exchange was made in a traced function or a replica "
                f"context; build the optimizer under strategy.scope() before training to measure, or state the "
                f"link: link='1gbit' or {LINK_ENV}=1gbit), assuming {self.model.describe()}{choice}")


def _replicas(count):
    return f"{count} replica" + ("" if count == 1 else "s")


def _plain(value):
    """`value` with numpy numbers made Python's (a config is written as JSON)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return value.item()  # a numpy scalar: its Python number


def _cost_model(fields):
    """A CostModel from `dataclasses.asdict` of one."""
    fields = dict(fields)
    return CostModel(all_reduce=LinkModel(**fields.pop("all_reduce")), all_gather=LinkModel(**fields.pop("all_gather")),
                     **fields)


# Calibrations made in this process, by cluster and model sizes: a second optimizer for the same
# model on the same cluster (a notebook re-running fit, a tutorial's next cell) reuses the
# measurement instead of paying its seconds again. Every worker runs the same builds in the same
# order, so every worker finds the same entries here and none calibrates alone.
_MEASURED = {}


def _cluster_key(strategy):
    """What identifies a cluster for `_MEASURED`: the strategy's kind, its devices and TF_CONFIG's
    cluster (a strategy made again for the same cluster is the same cluster)."""
    import json
    import os

    cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster")
    return (type(strategy).__name__, strategy.num_replicas_in_sync, tuple(strategy.extended.worker_devices),
            json.dumps(cluster, sort_keys=True))


def plan(entries, small_entries=0, strategy=None, budget_s=2.0, log=True, saved=None, decoupled=False, link=None):
    """The autopilot's Plan for an exchange of `entries` sparsifiable entries
    and `small_entries` dense-path ones under `strategy` (default: the
    current one). One replica sends nothing: every entry, dense, without a
    calibration (the default of a model trained on one device); so does an
    exchange with no sparsifiable entries (`entries` 0: every variable below
    min_size). `saved`: a plan's `get_config()` kept with a model; where the
    replicas and the model's sizes are the same it is the plan (an exact
    resume, nothing measured), else the cluster is measured again and the
    line says why. `decoupled`: the inner optimizer takes decoupled momentum
    where the plan sparsifies (`Plan.decoupled`). `link`: a rate ("100mbit")
    stated instead of measuring, else the TF_TOPK_LINK environment variable's,
    else measured: a stated link plans the same on every run (nothing timed),
    and is not saved (the same statement makes the same plan)."""
    import tensorflow as tf

    from tf_topk.notices import tell

    strategy = strategy or tf.distribute.get_strategy()
    link = stated_link(link)
    if link is not None:
        model = CostModel.from_link(strategy.num_replicas_in_sync, link)
        result = Plan(dataclasses.replace(model, agreed_slots=AUTO_AGREED_SLOTS), None, entries, small_entries,
                      decoupled, link)
        if log:
            tell(result.decision())
        return result
    if saved is not None:
        restored = dataclasses.replace(Plan.from_config(saved), decoupled=decoupled)
        now = (strategy.num_replicas_in_sync, entries, small_entries)
        then = (restored.model.replicas, restored.entries, restored.small_entries)
        if now == then:
            if log:
                tell(f"tf_topk autopilot: the plan saved with the model, for the same {now[0]} replicas and "
                     f"model: {restored.decision().removeprefix('tf_topk autopilot: ')}")
            return restored
        if log:
            tell(f"tf_topk autopilot: the plan saved with the model was made for {_replicas(then[0])} and "
                 f"{then[1]:,} + {then[2]:,} entries; here {_replicas(now[0])} and {now[1]:,} + {now[2]:,}: "
                 "planning again")
    outside_replicas = not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context()
    # One replica: nothing travels, so nothing to measure (the assumed link's plan is every entry, dense).
    if entries > 0 and strategy.num_replicas_in_sync > 1 and tf.executing_eagerly() and outside_replicas:
        key = (_cluster_key(strategy), entries, small_entries)
        found = _MEASURED.get(key)
        if found is None:
            found = _MEASURED[key] = measure(strategy, entries, small_entries, budget_s)
        elif log:
            tell("tf_topk autopilot: the same cluster and model sizes as an earlier plan in this process: its "
                 "measurement reused")
        model = dataclasses.replace(found.model, agreed_slots=AUTO_AGREED_SLOTS)
        result = Plan(model, found, entries, small_entries, decoupled)
    else:
        model = CostModel.from_link(strategy.num_replicas_in_sync, ASSUMED_LINK)
        result = Plan(dataclasses.replace(model, agreed_slots=AUTO_AGREED_SLOTS), None, entries, small_entries,
                      decoupled)
    if log:
        decision = result.decision()
        tell(decision)
        if os.environ.get(VERBOSE_ENV, "0") not in ("", "0") and decision != result.describe():
            tell(result.describe())
    return result


def stated_link(link=None):
    """The link rate the user stated: `link`, else the TF_TOPK_LINK environment variable's, else None
    (measure). A bad value is a ValueError naming where it came from."""
    from tf_topk.config import LINK_ENV, check_link

    if link is not None:
        return check_link(link, "link")
    from_env = os.environ.get(LINK_ENV, "").strip()
    return check_link(from_env, LINK_ENV) if from_env else None


def measure(strategy, entries, small_entries=0, budget_s=2.0):
    """The calibration the plan is made from (`tf_topk.calibrate.calibrate`
    with the autopilot's trial: a sparse step at TYPICAL_DENSITY and at
    MAX_DENSITY, profiled as the adaptive density would), measured anew; on
    every worker at the same point, in the cross-replica context."""
    from tf_topk.calibrate import calibrate
    from tf_topk.schedule import AdaptiveDensity

    return calibrate(strategy, entries=max(1, entries), budget_s=budget_s, small_entries=small_entries,
                     trial_density=TYPICAL_DENSITY, trial_max_density=MAX_DENSITY,
                     profile_density=AdaptiveDensity(MIN_DENSITY, MAX_DENSITY).profile_depth,
                     decide_at=SPARSE_MUST_WIN_BY)


def advise(model, entries, densities=ADVISE_DENSITIES, small_entries=0, decoupled=False):
    """Predicted seconds per step of exchanging `entries` entries by every
    route at every density, the fastest route at each fixed density, and
    what the autopilot would do on `model`'s cluster (its own Plan, so the
    same decision as an optimizer whose calibration found `model`).

    small_entries: dense-path entries beside them (small variables).
    Agreed indices are priced on AUTO_AGREED_SLOTS * k, as the autopilot
    and "auto" send them. Returns {"rows": [{"config", "route", "density",
    "k", "bytes", "seconds"}, ...] (dense and dense_bf16 once, then
    all_gather and agreed indices per density), "choices": {density: route}
    (`CostModel.choose` with every route open: a density whose sparse routes
    are slower than a dense one goes dense), "dense_end": the faster of
    dense and dense_bf16, "autopilot": `Plan.route()`, "autopilot_range":
    None where it sends every entry, else its density range, "method": what
    runs in words (`Plan.method`), "autopilot_density": the fixed density it
    sends with decoupled momentum (of the chunk route's entries where
    `Plan.chunked()`), else None}. Which density the autopilot
    runs at within an adaptive range depends on the gradients. decoupled: the
    inner optimizer is Adam or AdamW, which takes decoupled momentum at a
    fixed density where the plan sparsifies (`Plan.fixed_density`).

    >>> advice = advise(CostModel.from_link(8, "100mbit"), 12_609_546)
    >>> advice["dense_end"], advice["choices"][0.01], advice["choices"][0.0001], advice["autopilot"]
    ('dense_bf16', 'allreduce', 'allgather', 'allgather')
    """
    plan = Plan(dataclasses.replace(model, agreed_slots=AUTO_AGREED_SLOTS), None, entries, small_entries, decoupled)
    model = plan.model
    rows = [_row(model, route, None, 0, entries, small_entries) for route in ("dense", "dense_bf16")]
    choices = {}
    for density in densities:
        k = max(1, min(entries, math.ceil(density * entries)))
        rows += [_row(model, route, density, k, entries, small_entries) for route in ("allgather", "allreduce")]
        choices[density] = model.choose(entries, k, small_entries=small_entries)
    return {"rows": rows, "choices": choices,
            "dense_end": model.choose(entries, 0, ("dense", "dense_bf16"), small_entries),
            "autopilot": plan.route(), "method": plan.method(),
            "autopilot_density": None if plan.fixed_density() is None else plan.density(),
            "autopilot_range": None if plan.dense_route() or decoupled else (MIN_DENSITY, plan.max_density())}


def _row(model, route, density, k, entries, small_entries):
    return {"config": route if density is None else f"topk:{density:g}@{route}", "route": route,
            "density": density, "k": k, "bytes": model.bytes(route, k, entries),
            "seconds": model.route_time(route, k, entries, small_entries)}


def format_advice(model, entries, advice):
    """`advise`'s answer as a table and a line of choices."""
    lines = [f"{entries:,} entries; {model.describe()}",
             f"{'config':<22} {'k':>10} {'MB/worker':>10} {'ms/step':>10} {'vs dense':>9}"]
    dense = next(r["seconds"] for r in advice["rows"] if r["route"] == "dense")
    for r in advice["rows"]:
        ratio = f"{dense / r['seconds']:.2f}x" if r["seconds"] > 0 else "-"
        lines.append(f"{r['config']:<22} {r['k']:>10,} {r['bytes'] / 1e6:>10.3f} {r['seconds'] * 1e3:>10.2f} "
                     f"{ratio:>9}")
    lines.append("fastest route at a fixed density: " + "; ".join(f"density {d:g} -> {route}"
                                                                  for d, route in advice["choices"].items())
                 + f"; dense end -> {advice['dense_end']}")
    lines.append(f"autopilot: {advice['method']}" + ("" if advice["method"].startswith("every entry") else
                                                      f", {advice['autopilot']}"))
    return "\n".join(lines)
