"""Time to accuracy on a stated cluster (tf_topk.bench.time_to_accuracy) against hand-computed cases."""

import pytest

from tf_topk.bench.time_to_accuracy import cost_model, epoch_times, step_route, step_seconds, time_to_target

N, SMALL = 1_000_000, 1_000


def test_each_step_takes_the_route_of_the_stated_cluster():
    model = cost_model("100mbit", 8)
    sparse = {"selected": 10_000.0, "density": 0.01, "mode": 1}
    # The default router by bytes: 8 x 10,000 = n / 12.5 > n / 16, so agreed indices; the autopilot's by time too.
    assert step_route(sparse, model, N, "auto") == "allreduce"
    assert step_route(sparse, model, N, "timed") == model.choose(N, 10_000) == "allreduce"
    assert step_route(sparse, model, N, "allgather") == "allgather"
    assert step_route({"selected": N, "density": 1.0, "mode": 2}, model, N, "auto") == "dense"
    assert step_route({"selected": N, "density": 1.0, "mode": 3}, model, N, "timed") == "dense_bf16"
    assert step_route({"selected": 0.0, "density": 1.0, "mode": None}, model, N, "auto") == "dense"


def test_a_step_costs_compute_exchange_and_the_small_variables():
    model = cost_model("1gbit", 4, latency_ms=1.0)
    step = {"selected": 1_000.0, "density": 0.001, "mode": 1}
    # all_gather carries the small entries: 3 x (8 x 1,000 + 4 x 1,000) bytes in one collective.
    expected = 0.01 + model.selection_s_per_entry * N + 1e-3 + 3 * (8 * 1_000 + 4 * SMALL) / 1.25e8
    assert step_seconds(step, model, 0.01, N, SMALL, "allgather") == pytest.approx(expected)
    plain = {"selected": 0.0, "density": 1.0, "mode": None}
    assert step_seconds(plain, model, 0.01, N, SMALL, "auto") == pytest.approx(
        0.01 + 1e-3 + 1.5 * 4 * (N + SMALL) / 1.25e8)
    # Epoch ends after steps 2 and 3: cumulative times.
    times = epoch_times([plain, plain, step], [2, 3], model, 0.01, N, SMALL, "allgather")
    one = step_seconds(plain, model, 0.01, N, SMALL, "auto")
    assert times == pytest.approx([2 * one, 2 * one + expected])


def test_time_to_target_is_the_first_epoch_that_reaches_it():
    assert time_to_target([0.5, 0.8, 0.79, 0.9], [1.0, 2.0, 3.0, 4.0], 0.8) == 2.0
    assert time_to_target([0.5, 0.6], [1.0, 2.0], 0.8) is None
