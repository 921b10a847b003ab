"""DensitySchedule: k per variable for constant, stepped and callable densities."""

import math

import numpy as np
import pytest
import tensorflow as tf

import tf_topk
from tf_topk.schedule import GRID_POINTS, PROFILE_HEADROOM, AdaptiveDensity, DensitySchedule, dgc_warmup


def test_constant_density_gives_a_python_int_k():
    schedule = DensitySchedule(0.001)
    assert schedule.is_constant and schedule.max_density() == 0.001
    assert schedule.k(25_000_000) == 25_000
    assert schedule.k(1500) == 2  # ceil(1.5)
    assert schedule.k(10) == 1  # at least one entry
    assert isinstance(schedule.k(10), int)
    assert DensitySchedule(1.0).k(7) == 7


@pytest.mark.parametrize("step, density", [(0, 0.25), (99, 0.25), (100, 0.0625), (250, 0.0625), (300, 0.001),
                                           (10**9, 0.001)])
def test_stepped_density_takes_the_last_pair_at_or_before_the_step(step, density):
    schedule = DensitySchedule([(0, 0.25), (100, 0.0625), (300, 0.001)])
    assert not schedule.is_constant and schedule.max_density() == 0.25
    assert float(schedule.density(tf.constant(step, tf.int64))) == pytest.approx(density)
    k = schedule.k(10_000, step=tf.constant(step))
    assert k.dtype == tf.int32 and int(k) == math.ceil(density * 10_000)


def test_stepped_density_inside_tf_function_follows_a_variable_step():
    schedule = DensitySchedule([(0, 0.5), (2, 0.01)])
    step = tf.Variable(0, dtype=tf.int64)
    k_of = tf.function(lambda: schedule.k(1000, step=step))
    ks = []
    for _ in range(4):
        ks.append(int(k_of()))
        step.assign_add(1)
    assert ks == [500, 500, 10, 10]


def test_callable_density_is_called_with_the_step_and_k_is_clipped():
    schedule = DensitySchedule(lambda step: 1.0 / tf.cast(step + 1, tf.float32))
    assert schedule.max_density() is None
    assert [int(schedule.k(100, step=tf.constant(s))) for s in (0, 1, 3, 999)] == [100, 50, 25, 1]
    with pytest.raises(ValueError, match="callable density schedule cannot be serialized"):
        schedule.get_config()


def test_scheduled_density_needs_the_step():
    with pytest.raises(ValueError, match="needs the current step"):
        DensitySchedule([(0, 0.1)]).k(100)


def test_config_round_trip():
    assert DensitySchedule(0.01).get_config() == 0.01
    pairs = [(0, 0.25), (500, 0.001)]
    config = DensitySchedule(pairs).get_config()
    assert config == [[0, 0.25], [500, 0.001]]
    assert DensitySchedule(config).steps == pairs


@pytest.mark.parametrize("density, message", [
    (0.0, r"density must be in \(0, 1\], got 0.0"),
    (-0.5, r"density must be in \(0, 1\], got -0.5"),
    (float("nan"), r"density must be in \(0, 1\], got nan"),
    (True, r"density must be a float in \(0, 1\], a list"),
    (None, r"density must be a float in \(0, 1\], a list"),
    ([], r"at least one \(step, density\) pair"),
    ([(0, 0.1, 3)], r"must be \(step, density\) pairs, got \(0, 0.1, 3\)"),
    ([(0.5, 0.1)], r"steps must be ints >= 0, got step 0.5"),
    ([(0, 0.1), (10, 2.0)], r"density at step 10 must be in \(0, 1\], got 2.0"),
    ([(1, 0.1)], r"must start at step 0, got first step 1"),
    ([(0, 0.1), (20, 0.01), (10, 0.001)], r"steps must increase, got \[0, 20, 10\]"),
])
def test_bad_densities_name_the_value(density, message):
    with pytest.raises(ValueError, match=message):
        DensitySchedule(density)


def test_dgc_warmup_falls_exponentially_per_epoch_to_the_final_density():
    pairs = dgc_warmup(100, epochs=4, final=0.001)
    assert [step for step, _ in pairs] == [0, 100, 200, 300, 400]
    densities = [d for _, d in pairs]
    assert densities[0] == 0.25 and densities[-1] == 0.001
    ratios = [b / a for a, b in zip(densities, densities[1:])]
    assert max(ratios) == pytest.approx(min(ratios)) == pytest.approx((0.001 / 0.25) ** 0.25)
    schedule = DensitySchedule(pairs)  # a valid schedule
    assert schedule.k(10_000, tf.constant(250)) == math.ceil(densities[2] * 10_000)
    assert schedule.k(10_000, tf.constant(10_000)) == 10
    assert dgc_warmup(50, epochs=0, final=0.01) == [(0, 0.01)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(steps_per_epoch=0), "steps_per_epoch must be an int >= 1, got 0"),
    (dict(steps_per_epoch=10.5), "steps_per_epoch must be an int >= 1, got 10.5"),
    (dict(steps_per_epoch=10, epochs=-1), "epochs must be an int >= 0, got -1"),
    (dict(steps_per_epoch=10, final=0.0), r"final must be in \(0, 1\], got 0.0"),
    (dict(steps_per_epoch=10, initial=2.0), r"initial must be in \(0, 1\], got 2.0"),
    (dict(steps_per_epoch=10, final=0.5), r"final \(0.5\) must not exceed initial \(0.25\)"),
])
def test_dgc_warmup_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dgc_warmup(**kwargs)


# -- adaptive density -------------------------------------------------------------------------------



def exact_gain(values, k):
    """E(k): the energy of the k largest magnitudes."""
    ordered = np.sort(np.abs(values.astype(np.float64)))[::-1]
    return np.sum(ordered[:int(k)] ** 2)


def grid(entries, rule):
    low = max(1.0, np.ceil(rule.min_density * entries))
    high = max(low, np.ceil(rule.max_density * entries))
    return sorted({float(round(low * (high / low) ** (i / (GRID_POINTS - 1)))) for i in range(GRID_POINTS)})


@pytest.mark.parametrize("message_bytes", [0.0, 1e3, 1e5, 1e7])
@pytest.mark.parametrize("distribution", ["normal", "student_t"])
def test_adaptive_rule_against_sorted_magnitudes(message_bytes, distribution):
    """The k the rule picks from the bin profile does (almost) as well as the
    argmax of E(k) / (c0 + c1 k) over the same candidates, E(k) from sorted magnitudes."""
    rng = np.random.default_rng(7)
    n = 200_000
    x = (rng.standard_normal(n) if distribution == "normal" else rng.standard_t(3, n)).astype(np.float32)
    profile = tf_topk.error_feedback_topk(x, tf.zeros(n), 1, with_profile=True).profile
    rule = AdaptiveDensity(min_density=1e-4, max_density=0.2, message_bytes=message_bytes,
                           selection_s_per_entry=0.0)
    pair_bytes = 24.0
    chosen = round(float(rule.choose(profile, n, pair_bytes, None)) * n)
    candidates = grid(n, rule)
    assert chosen in candidates
    ratios = {k: exact_gain(x, k) / (rule.fixed_bytes(n) + pair_bytes * k) for k in candidates}
    best = max(ratios, key=ratios.get)
    assert ratios[chosen] >= 0.98 * ratios[best], (chosen, best)
    if message_bytes == 0.0:
        assert chosen == candidates[0]  # nothing fixed to amortise: the densest entries only


def test_adaptive_rule_sends_more_when_a_message_costs_more_and_goes_dense_when_selection_dominates():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(100_000).astype(np.float32)
    profile = tf_topk.error_feedback_topk(x, tf.zeros(100_000), 1, with_profile=True).profile
    chosen = [float(AdaptiveDensity(message_bytes=c0, selection_s_per_entry=0.0).choose(profile, 100_000, 8.0, None))
              for c0 in (1e2, 1e4, 1e6)]
    assert chosen[0] < chosen[1] < chosen[2] <= 0.1
    # When a message costs more than all the pairs, sending everything pays best.
    assert float(AdaptiveDensity(message_bytes=1e6).choose(profile, 100_000, 8.0, 8e5)) == 1.0
    # A fast link and a slow selection: sending everything (the dense all-reduce) pays best.
    fast = AdaptiveDensity(bandwidth_bytes_per_s=1e10, selection_s_per_entry=1e-8)
    assert float(fast.choose(profile, 100_000, 8.0, 4e5)) == 1.0
    assert float(AdaptiveDensity(bandwidth_bytes_per_s=1e10, selection_s_per_entry=1e-8, dense=False)
                 .choose(profile, 100_000, 8.0, 4e5)) <= 0.1


@pytest.mark.parametrize("message_bytes", [1e6, 1e7])
def test_exchange_profiles_every_variable_down_to_the_rank_of_all_entries(message_bytes):
    """One layer holds every one of the largest entries (gradient scales 100
    and 1): the exchange's choice does as well as the rule on the exact
    sorted magnitudes of both layers together. A profile cut at each layer's
    own share of max_density * n missed half of them and chose too small a k."""
    rng = np.random.default_rng(0)
    n = 300_000
    grads = [rng.standard_normal(n).astype(np.float32) * 100, rng.standard_normal(n).astype(np.float32)]
    rule = AdaptiveDensity(max_density=0.1, replicas=4, message_bytes=message_bytes, selection_s_per_entry=0.0,
                           dense=False)
    exchange = tf_topk.SparseExchange([tf.Variable(tf.zeros(n)) for _ in grads], density=rule,
                                      exchange_mode="allgather")
    exchange([tf.constant(g) for g in grads])
    both = np.concatenate(grads)
    pair_bytes = 3 * 8.0  # all_gather, 4 workers
    ratios = {k: exact_gain(both, k) / (message_bytes + pair_bytes * k) for k in grid(2 * n, rule)}
    best = max(ratios, key=ratios.get)
    chosen = round(float(exchange.adaptive_density) * 2 * n)
    assert chosen in ratios
    assert ratios[chosen] >= 0.995 * ratios[best], (chosen, best)


@pytest.mark.parametrize("density,depth", [
    (1e-4, 0.1 / 128),  # the shallowest level still covers 4x the lowest density
    (0.001, 0.1 / 16),  # 4x is 0.004: the next level up is 0.00625
    (0.1 / 64, 0.1 / 16),  # exactly 4x a level's density: that level
    (0.02, 0.1),
    (1.0, 0.1),  # the dense end: the deepest level
])
def test_the_profile_depth_is_the_shallowest_level_covering_four_times_the_density(density, depth):
    rule = AdaptiveDensity(min_density=1e-4, max_density=0.1)
    assert PROFILE_HEADROOM == 4.0
    assert rule.profile_levels() == [0.1 / 2**j for j in range(8)]  # 0.1 down to 0.00078 >= 4 * 1e-4
    assert rule.profile_depth(density) == pytest.approx(depth)
    assert AdaptiveDensity(min_density=0.01, max_density=0.02).profile_levels() == [0.02]


@pytest.mark.slow
def test_the_exchange_climbs_by_the_profile_headroom_a_step_to_the_rules_choice():
    """From density 0.001 the profile reaches only down to 0.00625 of the entries,
    so where the rule wants 50x more the first step climbs at most to about
    that depth, and the next steps reach the choice a full-depth profile makes at
    once (no error feedback: every step sees the same gradient)."""
    rng = np.random.default_rng(2)
    n = 300_000
    gradient = tf.constant((rng.standard_normal(n) * np.exp(2 * rng.standard_normal(n))).astype(np.float32))

    def densities(initial, steps):
        rule = AdaptiveDensity(max_density=0.1, replicas=4, message_bytes=1e8, selection_s_per_entry=0.0,
                               dense=False, initial_density=initial)
        exchange = tf_topk.SparseExchange([tf.Variable(tf.zeros(n))], density=rule, exchange_mode="allgather",
                                          error_feedback=False)
        step = tf.function(lambda: exchange([gradient]).all_finite)
        found = []
        for _ in range(steps):
            step()
            found.append(float(exchange.adaptive_density))
        return found

    full_depth = densities(0.1, 1)[0]
    climbing = densities(0.001, 6)
    rule = AdaptiveDensity(max_density=0.1)
    assert full_depth >= 0.05
    # Each step reaches at most a little below the depth times 2 (the profile's
    # floor keeps a margin: a sampled magnitude with more than depth * n above it).
    assert 0.001 < climbing[0] <= 2 * rule.profile_depth(0.001) < full_depth
    assert climbing[1] <= 2 * rule.profile_depth(climbing[0])
    assert all(b >= a for a, b in zip(climbing, climbing[1:]))
    assert climbing[-1] == pytest.approx(full_depth, rel=0.05)


@pytest.mark.parametrize("proposals,expected", [
    ([3], 3),                 # one replica: its own choice
    ([3, 64], 3),             # two replicas: the smaller, never a density between
    ([64, 3], 3),
    ([1, 64, 5], 5),          # the median of three
    ([7, 7, 2, 64], 7),       # the lower median of four
    ([64, 64, 64], 64),       # every replica asked for dense
])
def test_replicas_agree_on_the_lower_median_of_their_votes(proposals, expected):
    rule = AdaptiveDensity(min_density=1e-3, max_density=0.1)
    candidates = rule.candidates(10_000)
    assert candidates[-1] == 1.0 and len(candidates) <= GRID_POINTS + 1
    votes = tf.add_n([tf.one_hot(min(i, len(candidates) - 1), len(candidates)) for i in proposals])
    expected_density = candidates[min(expected, len(candidates) - 1)]
    assert float(rule.agree(votes, 10_000)) == expected_density


def test_choose_is_the_candidate_at_choose_index():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(50_000).astype(np.float32)
    profile = tf_topk.error_feedback_topk(x, tf.zeros(50_000), 1, with_profile=True).profile
    for rule, dense_bytes in ((AdaptiveDensity(message_bytes=1e4), None), (AdaptiveDensity(message_bytes=1e6), 1.0)):
        index = int(rule.choose_index(profile, 50_000, 8.0, dense_bytes))
        assert float(rule.choose(profile, 50_000, 8.0, dense_bytes)) == rule.candidates(50_000)[index]
    assert index == len(rule.candidates(50_000)) - 1  # a message dearer than everything: dense


@pytest.mark.parametrize("kwargs,message", [
    (dict(min_density=0.0), r"min_density must be in \(0, 1\], got 0.0"),
    (dict(min_density=0.5, max_density=0.1), r"min_density \(0.5\) must not exceed max_density \(0.1\)"),
    (dict(bandwidth_bytes_per_s=0), r"bandwidth_bytes_per_s must be a finite number > 0, got 0"),
    (dict(latency_s=-1.0), r"latency_s must be a finite number >= 0, got -1.0"),
    (dict(message_bytes=float("nan")), r"message_bytes must be a finite number >= 0, got nan"),
    (dict(replicas=0), r"replicas must be None or an int >= 1, got 0"),
])
def test_adaptive_density_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveDensity(**kwargs)
    with pytest.raises(ValueError, match=r"'adaptive', 'autopilot' or a tf_topk.schedule.AdaptiveDensity, got 'fast'"):
        DensitySchedule("fast")


def test_adaptive_density_round_trips_through_keras_config():
    import keras

    rule = AdaptiveDensity(min_density=1e-3, bandwidth_bytes_per_s=1.25e7, replicas=4)
    opt = tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density=rule)
    again = tf_topk.TopKOptimizer.from_config(opt.get_config())
    assert DensitySchedule(again.density).adaptive.get_config() == rule.get_config()
    assert DensitySchedule(tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), density="adaptive").density).adaptive \
        .get_config() == AdaptiveDensity().get_config()


def test_compute_per_pair_makes_the_adaptive_density_send_fewer():
    """pair_compute_s (densifying the pairs received) counts in c1: with it, the same gradient
    profile on a fast link gets a smaller k."""
    rng = np.random.default_rng(3)
    values = tf.constant((rng.standard_normal(50_000) * np.exp(rng.standard_normal(50_000))).astype(np.float32))
    profile = tf_topk.error_feedback_topk(values, tf.zeros_like(values), 5_000, with_profile=True,
                                          profile_density=0.1).profile
    free = AdaptiveDensity(bandwidth_bytes_per_s=1e10, dense=False)
    costly = AdaptiveDensity(bandwidth_bytes_per_s=1e10, dense=False, pair_compute_s=4e-7)
    assert float(costly.choose(profile, 50_000, 8.0, None)) < float(free.choose(profile, 50_000, 8.0, None))
    assert costly.get_config()["pair_compute_s"] == 4e-7
