"""Measure the cluster: the collectives' latency and time per byte, and the selection's time per entry.

`calibrate(strategy, entries)` times, under the strategy in use, an
all-reduce and an all_gather of a few sizes (Hockney's line through them),
the fused error-feedback selection on this worker, the densifying of pairs
into a bucket of `entries` (a pair costs 5-15x more where the bucket
outgrows the caches), and the dense all-reduce of `entries` float32 entries (the
model's gradients) when that is affordable.
Where the line predicts the dense step and a sparse one (`trial_density`)
within CLOSE_CALL of each other, both steps are timed whole on the model's
size (the trial): the selection with its profile, the all_gather of the
pairs, the densifying, against the dense all-reduce, under the load of every
worker at once; what the line leaves out (the work around the collectives on
a busy worker) then decides, not the line. A second sparse step at
`trial_max_density` gives what each further pair costs, measured
(`Calibration.pair_slope_s`).
Every worker measures; the slowest decides: the numbers travel in one small
all_gather (their maximum), so every replica builds the same `tf_topk.cost.CostModel`
and makes the same choices. That is the rule for every branch: it is decided on agreed
values (the slowest worker's numbers and clock) or on inputs that are the same everywhere,
never on one worker's own measurement, or the workers' collectives would not pair up. The work
is bounded by `budget_s` (sizes grow geometrically and stop when the next would not fit), and
`Calibration.phases` says where its seconds went.

    >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()
    >>> found = tf_topk.calibrate.calibrate(strategy, entries=12_609_546)
    >>> print(found.describe())          # one line: the links, the compute, the dense all-reduce
    >>> found.model.choose(entries=12_609_546, k=12_610)    # the route predicted fastest
"""

import contextlib
import dataclasses
import gc
import math
import statistics
import time

import numpy as np
import tensorflow as tf

from tf_topk import ops
from tf_topk.cost import CostModel, LinkModel, ring_bytes
from tf_topk.gather import all_gather_rows

# float32 entries of the first timed collective; each next size is FACTOR times larger.
FIRST_ENTRIES = 256
FACTOR = 8
# Calls per size (the median is kept), the first size's after one untimed call that traces; down to
# MIN_REPEATS where a size is latency-bound or its calls would not fit the budget otherwise.
REPEATS = 5
MIN_REPEATS = 3
# Entries the selection and the rounding are timed on (throughput), and the selection's density.
SELECTION_ENTRIES = 1 << 20
SELECTION_DENSITY = 0.01
# Densifying is timed on a bucket of the model's size (SELECTION_ENTRIES where none is
# given), with SELECTION_DENSITY of it as pairs but at least MIN_TIMED_PAIRS: a pair's
# scatter costs more where the bucket outgrows the caches (on this machine 28-34 us per
# thousand pairs into 1M entries, 5-15x that into the 12.6M of the wide MLP). Fewer pairs than
# this do not show: 4,096 read -33 to -73 ns a pair against a scatter of none (the demo's
# calibration printed "densifying 0 us per M pairs"), 65,536 read 31-36 ns, into 49k or 1M entries.
MIN_TIMED_PAIRS = 1 << 16
# The trial times the dense and the sparse step whole where the line predicts neither
# this many times faster than the other (farther apart, the line's error cannot flip the choice).
CLOSE_CALL = 3.0
# A line whose prediction of the dense all-reduce the timed one contradicts by more than this
# factor (either way) is not used as it is: a slope from a few sizes with a TCP stall in them read
# a 100 Mbit/s link as 1 Mbit/s and predicted 531.6 s for an all-reduce timed at 7.39 s.
CONTRADICTED = 3.0
# A line with no slope (every larger size timed no slower: latency and noise alone, as on a tiny
# model's few sizes) says bytes are free. Larger sizes are timed, FACTOR times each, up to this
# many entries while the budget allows; a line still flat takes the stated fallback (`_line`).
FLAT_LINE_ENTRIES = 1 << 20
# A size whose call is predicted within this many times the first size's is latency-bound
# (`_next_size`): it takes MIN_REPEATS calls, so that the budget reaches the sizes whose bytes show.
LATENCY_BOUND = 1.5
# The share of the budget the compute's timing takes at most (`_time_compute`), after the collectives' two thirds.
COMPUTE_SHARE = 1 / 6
# Rounds of the trial's steps, each step called once a round, after one call of each that traces.
# The steps take turns, so a burst of load slows both calls of a round (`paired_with_the_first`).
# The trial runs where TRIAL_REPEATS rounds fit its third of the budget (as the line predicts them),
# and takes as many more, up to TRIAL_MAX_ROUNDS, as fit: a median of more rounds scatters less
# around a close call (a wide MLP's trial read sparse 1.22x to 2.02x as fast in ten runs of 5 rounds,
# against the 1.5x the autopilot asks). The count comes from agreed values: every worker runs as many.
TRIAL_REPEATS = 5
TRIAL_MAX_ROUNDS = 15
# Where the trial's rounds put the dense step's time within this factor (either way) of `decide_at`
# times the sparse one's, the trial times as many rounds again and reads the pooled rounds: the
# ratio that decides scatters less exactly where its scatter would flip the decision (the wide MLP,
# sparse about 1.75x as fast against the autopilot's 1.5x, read 1.47x-2.02x in ten runs of up to 15
# rounds under load, and went dense once). Such a close call costs one more third of the budget.
CLOSE_TRIAL_BAND = 1.25


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `calibrate` found.

    model: the CostModel every replica agreed on; points: {"all_reduce" |
    "all_gather": [(bytes a worker sent, median seconds), ...]} on this
    worker; dense_s: the measured dense all-reduce of `entries` (and the
    small entries beside them; None when not measured); dense_predicted_s:
    the model's prediction of it; sparse_s: the measured sparse step of the
    trial (trial_k pairs of `entries` by all_gather; None when not measured)
    and sparse_predicted_s; sparse_max_s: the same step with trial_max_k
    pairs (None when not measured); seconds: the calibration's own wall time;
    refit_from_s: where the timed dense all-reduce contradicted the line
    (CONTRADICTED), what the line had predicted for it (the links were then
    refit through the timed point), else None; trial_rounds: the rounds the
    trial's medians pooled (None without a trial); phases: this worker's
    seconds in each part ("all_reduce", "all_gather": their sizes;
    "compute"; "agree"; "steps": the trial or the dense all-reduce;
    "collect": freeing what it made), where `seconds` goes.
    """

    model: CostModel
    points: dict
    entries: int
    dense_s: float
    dense_predicted_s: float
    seconds: float
    sparse_s: float = None
    sparse_predicted_s: float = None
    trial_k: int = None
    sparse_max_s: float = None
    trial_max_k: int = None
    refit_from_s: float = None
    phases: dict = None
    trial_rounds: int = None

    def trial(self):
        """(dense_s, sparse_s) where both steps were timed whole, else None."""
        return None if self.dense_s is None or self.sparse_s is None else (self.dense_s, self.sparse_s)

    def pair_slope_s(self):
        """Seconds each further pair (per replica) added to the timed sparse
        step, from its two sizes (at least 0), or None where not timed."""
        if self.sparse_s is None or self.sparse_max_s is None or self.trial_max_k <= self.trial_k:
            return None
        return max(0.0, (self.sparse_max_s - self.sparse_s) / (self.trial_max_k - self.trial_k))

    def describe(self):
        """One line for a log."""
        dense = "" if self.dense_s is None else (
            f"; dense all-reduce of {self.entries:,} entries {self.dense_s * 1e3:,.1f} ms "
            f"(predicted {self.dense_predicted_s * 1e3:,.1f} ms)")
        if self.refit_from_s is not None:
            dense += (f" [the links refit through it: the fitted line predicted {self.refit_from_s * 1e3:,.1f} ms, "
                      f"more than {CONTRADICTED:g}x off]")
        sparse = "" if self.sparse_s is None else (
            f", top-{self.trial_k:,} step by all_gather {self.sparse_s * 1e3:,.1f} ms "
            f"(predicted {self.sparse_predicted_s * 1e3:,.1f} ms"
            f"{'' if self.trial_rounds is None else f'; {self.trial_rounds} rounds'})")
        if self.sparse_max_s is not None:
            sparse += f", top-{self.trial_max_k:,} {self.sparse_max_s * 1e3:,.1f} ms"
        return f"calibration ({self.seconds:.2f} s): {self.model.describe()}{dense}{sparse}"


def calibrate(strategy=None, entries=None, budget_s=2.0, small_entries=0, trial_density=None,
              trial_max_density=None, profile_density=1.0, decide_at=None):
    """Measure the collectives and the selection under `strategy` (default:
    the current one) and return a Calibration. Call it in the cross-replica
    context (outside `strategy.run`), on every worker at the same point.

    entries: the gradient entries the model exchanges: collectives are timed
      up to that size (not beyond what a step sends) and the dense
      all-reduce of exactly that many is measured when it fits the budget.
    budget_s: a bound on the calibration's time: the collectives' calls get
      two thirds (the all_gather's at most one, the all-reduce's what it
      left; a size whose predicted time would overrun is not timed), the
      compute's timing at most COMPUTE_SHARE, then the whole steps (the trial,
      or the dense all-reduce alone) at most a third, set aside for them
      whatever the parts before took (at most 7/6 of budget_s in all; 3/2
      where a close trial times its rounds twice, `decide_at`); the one
      trace per function comes on top.
    small_entries: float32 entries of the dense path beside `entries` (small
      variables): in the dense all-reduce, and carried by the trial's all_gather.
    trial_density: the sparse step the trial times (k = ceil(trial_density *
      entries) pairs by all_gather); None: no trial.
    trial_max_density: the trial also times the sparse step at this density
      (above trial_density: what more pairs cost); None: not.
    profile_density: how deep the trial's selection profiles the magnitudes,
      as the exchange would: a float, or a function of the timed step's
      density (an adaptive density's `profile_depth`).
    decide_at: the ratio of the dense step's time to the sparse one's at
      which the caller will decide (the autopilot's SPARSE_MUST_WIN_BY);
      a trial whose ratio lands within CLOSE_TRIAL_BAND of it times as many
      rounds again and reports the pooled medians. None: one set of rounds.

    Memory: at its peak (the trial) at most 7 times the float32 gradient of
    `entries` per replica, about what one exchange step holds; nothing once
    it returns.
    """
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
        raise ValueError(f"budget_s must be a number > 0, got {budget_s!r}")
    if entries is not None and (isinstance(entries, bool) or not isinstance(entries, int) or entries < 1):
        raise ValueError(f"entries must be None or an int >= 1, got {entries!r}")
    if isinstance(small_entries, bool) or not isinstance(small_entries, int) or small_entries < 0:
        raise ValueError(f"small_entries must be an int >= 0, got {small_entries!r}")
    for name, value in (("trial_density", trial_density), ("trial_max_density", trial_max_density)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
            raise ValueError(f"{name} must be None or a float in (0, 1], got {value!r}")
    if decide_at is not None and (isinstance(decide_at, bool) or not isinstance(decide_at, (int, float))
                                  or not 0 < decide_at < math.inf):
        raise ValueError(f"decide_at must be None or a number > 0, got {decide_at!r}")
    if trial_max_density is not None and (trial_density is None or trial_max_density <= trial_density):
        raise ValueError(f"trial_max_density ({trial_max_density!r}) needs a trial_density below it, "
                         f"got {trial_density!r}")
    start = time.perf_counter()
    with _collected_on_return() as phases:
        found = _calibrate(strategy or tf.distribute.get_strategy(), entries, budget_s, small_entries, trial_density,
                           trial_max_density, profile_density, decide_at, phases)
    return dataclasses.replace(found, seconds=time.perf_counter() - start, phases=phases)


@contextlib.contextmanager
def _collected_on_return():
    """The calibration's phases (a dict), its garbage collected on return.

    Its traced functions sit in reference cycles, with the timed steps'
    buffers (the model's gradient a few times over): freed when it returns,
    not at a later collection while the model trains. What existed before
    is frozen meanwhile (`gc.freeze`), so that collection looks at the
    calibration's own objects only (a full one took 0.26-0.38 s in a worker
    holding a model, a seventh of the budget)."""
    phases = {}
    freezes = gc.get_freeze_count() == 0  # someone else's freeze is left as it is
    if freezes:
        gc.freeze()
    try:
        yield phases
    finally:
        began = time.perf_counter()
        gc.collect()
        phases["collect"] = time.perf_counter() - began
        if freezes:
            gc.unfreeze()


def _calibrate(strategy, entries, budget_s, small_entries, trial_density, trial_max_density, profile_density,
               decide_at, phases):
    """`calibrate`'s work (its `seconds` set by the caller), each part's seconds into `phases`."""
    replicas = strategy.num_replicas_in_sync
    largest = entries or (1 << 22)

    def timed(phase, function, *args):
        began = time.perf_counter()
        result = function(*args)
        phases[phase] = time.perf_counter() - began
        return result

    points = {"all_gather": [], "all_reduce": []}
    if replicas > 1:
        # Two thirds of the budget for the collectives' sizes: the all_gather's first, at most a third
        # (it sends P / 2 times the all-reduce's bytes per entry, so its bytes show at smaller sizes),
        # then the all-reduce's, what the all_gather left (8 workers on two cores: a call costs 20-30 ms
        # up to 512 KB, and a third reached no size whose bytes showed). The spent time is agreed.
        points["all_gather"], spent = timed("all_gather", _time_collective, strategy, "all_gather", largest,
                                            budget_s / 3)
        left = 2 * budget_s / 3 - slowest(strategy, [spent])[0]
        points["all_reduce"], _ = timed("all_reduce", _time_collective, strategy, "all_reduce", largest, left)
    selection, rounding, pair = timed("compute", _time_compute, SELECTION_ENTRIES, entries or SELECTION_ENTRIES,
                                      budget_s * COMPUTE_SHARE)
    # No later branch reads a clock: each worker's own would differ (one that arrived first waited in
    # the first collective), and a worker skipping a collective the others run would hang them.
    local = [*_line(points["all_reduce"]), *_line(points["all_gather"]), selection, rounding, pair]
    agreed = timed("agree", slowest, strategy, local)
    model = CostModel(replicas, LinkModel(agreed[0], agreed[1]), LinkModel(agreed[2], agreed[3]), agreed[4],
                      agreed[5], pair_s=agreed[6])
    if entries is None:
        return Calibration(model, points, entries, None, None, 0.0)
    found = timed("steps", _time_steps, strategy, model, entries, small_entries, trial_density, trial_max_density,
                  profile_density, budget_s, decide_at)
    return dataclasses.replace(refit_where_contradicted(found, small_entries), points=points)


def refit_where_contradicted(found, small_entries=0):
    """`found`, or where the timed dense all-reduce and the line's prediction
    of it are more than CONTRADICTED times apart, `found` with the all-reduce
    line through the timed point (its latency kept, at most half the timed time)
    and the all_gather line's rate scaled alike (the same link carries both),
    the predictions made again and `refit_from_s` set. Every input is agreed
    (the slowest worker's), so every worker refits alike."""
    if found.dense_s is None or not found.dense_predicted_s or not found.dense_s > 0:
        return found
    if 1.0 / CONTRADICTED <= found.dense_predicted_s / found.dense_s <= CONTRADICTED:
        return found
    model = found.model
    sent = model.bytes("dense", 0, found.entries) + ring_bytes(4.0 * small_entries, model.replicas)
    # At least half the timed call is its bytes': a call as fast as the line's latency is no free link.
    latency = min(model.all_reduce.latency_s, found.dense_s / 2)
    per_byte = (found.dense_s - latency) / sent
    old = model.all_reduce.seconds_per_byte
    gather_per_byte = model.all_gather.seconds_per_byte * (per_byte / old) if old > 0 else per_byte
    model = dataclasses.replace(model, all_reduce=LinkModel(latency, per_byte),
                                all_gather=LinkModel(model.all_gather.latency_s, gather_per_byte))
    sparse_predicted_s = None if found.trial_k is None else \
        model.route_time("allgather", found.trial_k, found.entries, small_entries)
    return dataclasses.replace(found, model=model, refit_from_s=found.dense_predicted_s,
                               dense_predicted_s=model.route_time("dense", 0, found.entries, small_entries),
                               sparse_predicted_s=sparse_predicted_s)


def _time_steps(strategy, model, entries, small_entries, trial_density, trial_max_density, profile_density,
                budget_s, decide_at=None):
    """A Calibration of `model` with the whole steps timed (no points, seconds 0): the
    trial where the call is close, else the dense all-reduce alone, where its
    calls fit the third of the budget set aside for the steps. Every branch is
    decided on the agreed model and the budget, the same on every worker, so
    their collectives pair up."""
    replicas = model.replicas
    dense_predicted_s = model.route_time("dense", 0, entries, small_entries)
    dense_step = _of_size(_collective(strategy, "all_reduce"), entries + small_entries)
    dense_s = sparse_s = sparse_predicted_s = k = sparse_max_s = k_max = pooled = None
    predicted_max_s = 0.0
    if trial_density is not None:
        k = max(1, min(entries, math.ceil(trial_density * entries)))
        sparse_predicted_s = model.route_time("allgather", k, entries, small_entries)
        if trial_max_density is not None:
            k_max = max(1, min(entries, math.ceil(trial_max_density * entries)))
            predicted_max_s = model.route_time("allgather", k_max, entries, small_entries)
    close = k is not None and max(dense_predicted_s, sparse_predicted_s) <= \
        CLOSE_CALL * min(dense_predicted_s, sparse_predicted_s)
    # The steps' third is set aside whatever the parts before took (on a loaded machine their traces
    # overran a 3 s budget to 4.6 s, and a close call was then decided on the line, not on timed steps;
    # a line read 16x too fast went without the timed dense all-reduce that refits it).
    rounds = trial_rounds(dense_predicted_s + (sparse_predicted_s or 0.0) + predicted_max_s, budget_s)
    if replicas > 1 and close and rounds >= TRIAL_REPEATS:
        depth = profile_density if callable(profile_density) else lambda density: profile_density
        # One gradient and residual for both sparse steps: the trial's memory is the model's
        # gradient a few times over (`calibrate`), not once more for each step.
        inputs = _sparse_inputs(entries, small_entries)
        steps = [dense_step, _sparse_step(strategy, inputs, k, depth(k / entries))]
        if k_max is not None and k_max > k:
            steps.append(_sparse_step(strategy, inputs, k_max, depth(k_max / entries)))
        times = interleaved_times(steps, rounds)
        timed = slowest(strategy, paired_medians(times))  # agreed: every worker takes the same branch
        if decide_at is not None and is_close_trial(timed[0] / timed[1], decide_at):
            more = interleaved_times(steps, rounds, warm_up=False)
            times = [first + again for first, again in zip(times, more)]
            timed = slowest(strategy, paired_medians(times))
        dense_s, sparse_s, *more = timed
        sparse_max_s = more[0] if more else None
        pooled = len(times[0])
    elif replicas > 1 and 2 * dense_predicted_s <= budget_s / 3:
        dense_s = _dense_all_reduce_within(strategy, dense_step, budget_s / 3)
    return Calibration(model, {}, entries, dense_s, dense_predicted_s, 0.0, sparse_s, sparse_predicted_s, k,
                       sparse_max_s, k_max if sparse_max_s is not None else None, trial_rounds=pooled)


def is_close_trial(ratio, decide_at):
    """Whether a trial's ratio (dense step / sparse step) lies within
    CLOSE_TRIAL_BAND of `decide_at`, either way: close enough that its
    scatter could flip the decision, so the trial times more rounds."""
    return decide_at / CLOSE_TRIAL_BAND < ratio < decide_at * CLOSE_TRIAL_BAND


def trial_rounds(round_s, budget_s):
    """Rounds of the trial whose calls (one round predicted `round_s`), after
    the round that traces, fit a third of `budget_s`: at most TRIAL_MAX_ROUNDS;
    fewer than TRIAL_REPEATS means no trial."""
    if round_s <= 0:
        return TRIAL_MAX_ROUNDS
    return min(TRIAL_MAX_ROUNDS, math.floor(budget_s / 3 / round_s) - 1)


def _dense_all_reduce_within(strategy, dense_step, left_s):
    """Seconds of the dense all-reduce (the slowest worker's): one call, then
    a second, kept, where twice the first's agreed time fits `left_s` (the
    first warms it up; a line that predicts it 1.3x too fast would otherwise
    overrun the budget by as much)."""
    first = slowest(strategy, [_seconds_of(dense_step)])[0]
    if 2 * first > left_s:
        return first
    return slowest(strategy, [_seconds_of(dense_step)])[0]


def _line(points):
    """(latency, seconds per byte) through `points`; (0, 0) with none (one replica).

    The stated fallback for a line still flat after the larger sizes
    (`FLAT_LINE_ENTRIES`): every second of the largest call counted as its
    bytes' (the slowest rate those calls allow), never a free link."""
    if not points:
        return 0.0, 0.0
    link = LinkModel.fit(points)
    if link.seconds_per_byte == 0.0:
        sent, seconds = max(points)
        return link.latency_s, (seconds / sent if sent > 0 else 0.0)
    return link.latency_s, link.seconds_per_byte


def _per_strategy(make):
    """`make(strategy, *key)` made once per strategy and key, then reused: each calibration (and each
    agreement) would otherwise trace a new tf.function, and TensorFlow warns of retracing from the
    fifth. Kept on the strategy itself: a traced function holds its replica context, which holds the
    strategy, so a cache held anywhere else would keep every strategy alive; on the strategy the two
    form a cycle that the garbage collector frees with it."""
    def get(strategy, *key):
        functions = vars(strategy).setdefault("_tf_topk_calibration_functions", {})
        key = (make.__name__, *key)
        if key not in functions:
            functions[key] = make(strategy, *key[1:])
        return functions[key]

    return get


@_per_strategy
def _collective(strategy, kind):
    """A function running one `kind` collective of its float32 [n] argument on every replica, traced
    once for every n (each size would otherwise cost a trace, which on a busy worker outweighs the
    collectives timed)."""
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def run(buffer):
        def replica_fn():
            context = tf.distribute.get_replica_context()
            local = tf.identity(buffer)  # on the replica's device
            if kind == "all_reduce":
                return context.all_reduce(tf.distribute.ReduceOp.SUM, local)[:1]
            return all_gather_rows(context, local)[:1]  # as the all_gather route gathers

        return strategy.run(replica_fn)

    return run


def _of_size(function, size):
    """`function` called on a buffer of `size` entries."""
    buffer = tf.ones([size], tf.float32)
    return lambda: function(buffer)


def _seconds_of(function):
    """Seconds of one call."""
    begin = time.perf_counter()
    _block(function())
    return time.perf_counter() - begin


def _median_call(function, repeats, within_s=None):
    """Median seconds of up to `repeats` calls, after one that traces (`interleaved_times`)."""
    return statistics.median(interleaved_times([function], repeats, within_s)[0])


def interleaved_medians(functions, repeats):
    """Median seconds of each function over `repeats` rounds that call every
    function once in turn, after one call of each that traces: whatever else
    the machine runs meanwhile falls on all of them alike, not on one."""
    return [statistics.median(seconds) for seconds in interleaved_times(functions, repeats)]


def paired_with_the_first(functions, repeats):
    """Seconds of each function over `repeats` interleaved rounds: the first's
    median, and each other one's as that median over the median of the rounds'
    ratios (first / other). A burst of load that slows one round slows both
    calls of it and drops out of their ratio; separate medians let such bursts
    decide a close trial (the digits MLP's sparse step read 0.93x to 2.19x as fast
    as the dense one in ten runs of one script on an idle machine)."""
    return paired_medians(interleaved_times(functions, repeats))


def paired_medians(times):
    """`paired_with_the_first`'s medians of rounds already timed: `times`
    holds each function's seconds, one per round, in the rounds' order."""
    first, *others = times
    median = statistics.median(first)
    return [median, *(median / statistics.median(a / b for a, b in zip(first, other)) for other in others)]


def median_difference(function, baseline, repeats, within_s=None):
    """Median over up to `repeats` rounds (`interleaved_times`) of what
    `function` took beyond `baseline` called right after it: a small difference of two larger times, which
    the difference of their separate medians buries in load (on 4 busy
    workers a densifying cost read 53,800-311,259 us per M pairs that way,
    27,647-34,397 paired in 9 of 12 calibrations:
    benchmarks/history/2026-11-25-autopilot-remedies.md, remedy 8)."""
    first, second = interleaved_times([function, baseline], repeats, within_s)
    return statistics.median(a - b for a, b in zip(first, second))


def interleaved_times(functions, repeats, within_s=None, warm_up=True):
    """Seconds of each call of each function, `repeats` rounds in turn, after
    one call of each that traces (none where `warm_up` is False: traced
    already). With `within_s`, the rounds stop early where
    the next would end past `within_s` from the first call (as long as the
    last round took): at least one round. The rounds are this worker's own:
    nothing here pairs up with the other workers."""
    began = time.perf_counter()
    for function in functions if warm_up else ():
        _block(function())
    times = [[] for _ in functions]
    for done in range(repeats):
        if done and within_s is not None and \
                time.perf_counter() - began + sum(seconds[-1] for seconds in times) > within_s:
            break
        for function, seconds in zip(functions, times):
            seconds.append(_seconds_of(function))
    return times


def _timed_calls(function, repeats, warm_up=True):
    """(median seconds of `repeats` calls, the seconds they took): after one
    untimed call where `warm_up` (a function's first call traces), which the
    seconds taken count as a median call."""
    if warm_up:
        _seconds_of(function)
    seconds = [_seconds_of(function) for _ in range(repeats)]
    median = statistics.median(seconds)
    return median, sum(seconds) + (median if warm_up else 0.0)


def _block(result):
    for tensor in tf.nest.flatten(result):
        for local in getattr(tensor, "values", (tensor,)):
            local.numpy()


def _time_collective(strategy, kind, largest, budget_s):
    """([(bytes a worker sends, median seconds)], the seconds its calls took on
    this worker) for sizes FIRST_ENTRIES, x FACTOR,
    ... up to `largest`: the first two always (a line needs two), then each
    while MIN_REPEATS calls of the next size are predicted to fit `budget_s`
    (the one trace of the function is not counted).

    The first size takes REPEATS calls after an untimed one (the latency);
    a later size's calls are all timed (a new size's first call is no slower
    than the next: 8 workers, 24-38 ms against medians of 23-31 ms), MIN_REPEATS
    of them where the next call is predicted latency-bound (`_next_size`), so
    that the budget goes to the sizes whose bytes show. The prediction is
    the line through the sizes timed so far, never below the last size's call.
    Every worker must time the same sizes (the collectives pair up), so the
    decision to go on is itself agreed: the line through the slowest worker's
    time at each size."""
    replicas = strategy.num_replicas_in_sync

    def sent(size):
        return ring_bytes(4.0 * size, replicas) if kind == "all_reduce" else (replicas - 1) * 4.0 * size

    collective = _collective(strategy, kind)
    size = min(FIRST_ENTRIES, largest)
    seconds, spent = _timed_calls(_of_size(collective, size), REPEATS)
    points, top = [(sent(size), seconds)], size
    if size == largest:  # `largest` is the first size: a line needs two, the smallest halved
        half = size // 2 if size > 1 else FIRST_ENTRIES
        points.append((sent(half), _timed_calls(_of_size(collective, half), REPEATS)[0]))
    else:
        size, repeats = min(size * FACTOR, largest), MIN_REPEATS
        while True:
            seconds, seconds_spent = _timed_calls(_of_size(collective, size), repeats, warm_up=False)
            spent += seconds_spent
            points.append((sent(size), seconds))
            if size == largest:
                break
            spent_everywhere, *times = slowest(strategy, [spent] + [t for _, t in points])
            following = min(size * FACTOR, largest)
            decided = _next_size([b for b, _ in points], times, sent(following), budget_s - spent_everywhere)
            if decided is None:
                break
            size, repeats = following, decided
        top = size
    while top < FLAT_LINE_ENTRIES:
        # A flat line is measured again on larger sizes; decided on the slowest worker's times and
        # clock, so every worker times the same sizes.
        spent_everywhere, *times = slowest(strategy, [spent] + [t for _, t in points])
        flat = LinkModel.fit([(b, t) for (b, _), t in zip(points, times)]).seconds_per_byte == 0.0
        # The next call predicted as if all bandwidth: FACTOR times the slowest so far.
        if not flat or MIN_REPEATS * FACTOR * max(times) > budget_s - spent_everywhere:
            break
        top *= FACTOR
        seconds, seconds_spent = _timed_calls(_of_size(collective, top), MIN_REPEATS, warm_up=False)
        spent += seconds_spent
        points.append((sent(top), seconds))
    return points, spent


def _next_size(sent, times, following_sent, left_s):
    """How many calls the next size (`following_sent` bytes a worker) takes,
    or None where MIN_REPEATS of them would not fit `left_s`: `sent`, `times`,
    the sizes so far and their agreed seconds.

    Its call is predicted by the line through the sizes so far, never below
    the last one's. A call predicted within LATENCY_BOUND times the first
    size's is latency-bound: it adds a point to the latency, not to the rate,
    and takes MIN_REPEATS calls; a larger one takes as many as fit at twice
    its prediction (the line bends upwards where a burst ends), up to REPEATS.
    Five calls of every latency-bound size stopped 8 workers on two cores
    (20-30 ms a call up to 512 KB) before any size's bytes showed."""
    call = max(LinkModel.fit(list(zip(sent, times))).time(following_sent), times[-1])
    if left_s < MIN_REPEATS * call:
        return None
    if call < LATENCY_BOUND * times[0]:
        return MIN_REPEATS
    return max(MIN_REPEATS, min(REPEATS, int(left_s / (2.0 * call))))


def _sparse_inputs(entries, small_entries):
    """The trial's gradient and residual of a bucket of `entries`, and `small_entries` dense-path entries."""
    return (tf.random.stateless_normal([entries], seed=[0, 1]), tf.zeros([entries], tf.float32),
            tf.ones([small_entries], tf.float32))


def _sparse_step(strategy, inputs, k, profile_density):
    """One sparse exchange step of a bucket on every replica, as the all_gather
    route takes it: the fused selection of k pairs (with the magnitude
    profile), their all_gather with the dense-path entries, and the P * k
    pairs densified. `inputs`: `_sparse_inputs`."""
    replicas = strategy.num_replicas_in_sync
    gradient, residual, small = inputs
    entries = int(gradient.shape[0])

    @tf.function
    def run():
        def replica_fn():
            selection = ops.error_feedback_topk(tf.identity(gradient), residual, k, with_profile=True,
                                                profile_density=profile_density)
            parts = tf.concat([selection.values, tf.bitcast(selection.indices, tf.float32), tf.identity(small)], 0)
            rows = tf.reshape(all_gather_rows(tf.distribute.get_replica_context(), parts), [replicas, -1])
            indices = tf.reshape(tf.bitcast(rows[:, k:2 * k], tf.int32), [-1, 1])
            dense = tf.scatter_nd(indices, tf.reshape(rows[:, :k], [-1]), [entries])
            return dense[:1], selection.remaining[:1], tf.reduce_sum(rows[:, 2 * k:], 0)[:1]

        return strategy.run(replica_fn)

    return run


def _time_compute(size, bucket, within_s=None):
    """Seconds per entry, on this worker, of the fused error-feedback
    selection and of the 16-bit route's rounding (with its residual), both
    on `size` entries, and per pair of densifying pairs (a scatter into a
    bucket of `bucket` entries). The functions are traced once per process
    (their inputs are arguments): a calibration pays for timing them, not
    for tracing them again. With `within_s`, each of the three takes fewer
    calls where its share of it (a quarter, a quarter, a half) would not fit
    them (8 workers on two cores: 1 s for all, half the budget, before)."""
    share = (lambda part: None) if within_s is None else (lambda part: part * within_s)
    rng = np.random.default_rng(0)
    gradient = tf.constant(rng.standard_normal(size).astype(np.float32))
    residual = tf.zeros([size], tf.float32)
    pairs = max(MIN_TIMED_PAIRS, int(SELECTION_DENSITY * bucket))
    target = tf.zeros([bucket], tf.float32)
    indices = tf.constant(rng.integers(0, bucket, (pairs, 1)).astype(np.int32))
    values = tf.constant(rng.standard_normal(pairs).astype(np.float32))
    def scatter():
        return _densify(target, indices, values)

    # A scatter of few pairs still writes the bucket: what it adds per pair is its time minus that of no
    # pairs (`median_difference`). Where that is not above 0 (below what the timing resolves), the stated
    # fallback: the whole scatter counted as its pairs', the most they can cost, never a free pair.
    difference = median_difference(scatter, lambda: _densify(target, indices[:0], values[:0]), MIN_REPEATS,
                                   share(0.5))
    per_pair = (difference if difference > 0 else _median_call(scatter, 1)) / pairs
    # The selection is traced anew each time: a kernel kept with its function would keep its
    # scratch buffer of `size` entries after the calibration.
    select = tf.function(_select)
    return (_median_call(lambda: select(gradient, residual), REPEATS, share(0.25)) / size,
            _median_call(lambda: _round_to_bfloat16(gradient, residual), REPEATS, share(0.25)) / size, per_pair)


def _select(gradient, residual):
    """The fused selection of SELECTION_DENSITY of `gradient`'s entries."""
    k = tf.maximum(1, tf.cast(SELECTION_DENSITY * tf.cast(tf.size(gradient), tf.float64), tf.int32))
    return ops.error_feedback_topk(gradient, residual, k).remaining[:1]


@tf.function(input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
def _round_to_bfloat16(gradient, residual):
    """The 16-bit route's rounding, with its rounding error kept."""
    accumulated = gradient + residual
    rounded = tf.cast(accumulated, tf.bfloat16)
    return (accumulated - tf.cast(rounded, tf.float32))[:1], rounded[:1]


@tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([None, 1], tf.int32),
                              tf.TensorSpec([None], tf.float32)])
def _densify(target, indices, values):
    """Pairs added into a bucket, as a route densifies them."""
    return tf.tensor_scatter_nd_add(target, indices, values)[:1]


def slowest(strategy, values):
    """The largest of every replica's `values` (floats), on every replica."""
    local = tf.constant(values, tf.float64)
    if strategy.num_replicas_in_sync == 1:
        return [float(v) for v in local.numpy()]
    result = strategy.experimental_local_results(_largest_over_replicas(strategy)(local))[0]
    return [float(v) for v in result.numpy()]


@_per_strategy
def _largest_over_replicas(strategy):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float64)])
    def run(local):  # tf.distribute reduces by SUM or MEAN only: gather the rows, then take the max
        def replica_fn():
            rows = all_gather_rows(tf.distribute.get_replica_context(), tf.identity(local))
            return tf.reduce_max(tf.reshape(rows, [strategy.num_replicas_in_sync, -1]), axis=0)

        return strategy.run(replica_fn)

    return run
