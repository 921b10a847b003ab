"""The overhead benchmark (`python -m tf_topk.bench overhead`): every timing taken, the ratios from them."""

import pytest


@pytest.mark.slow
def test_overhead_times_every_exchange_and_reports_its_ratios():
    from tf_topk.bench import overhead

    result = overhead.measure(0.001, repeats=1)
    seconds = {key: value for key, value in result.items() if key.endswith("_s") and key != "target_s"}
    assert {"exchange_s", "exchange_sparse_s", "exchange_bucket_s", "selection_s", "read_pass_s"} <= set(seconds)
    assert all(value > 0 for value in seconds.values()), seconds
    assert result["bucket_over_exchange"] == pytest.approx(result["exchange_bucket_s"] / result["exchange_s"],
                                                           rel=0.02, abs=0.01)
    assert result["chunk_over_exchange"] == pytest.approx(result["exchange_chunk_s"] / result["exchange_s"],
                                                          rel=0.02, abs=0.01)  # one round: its own ratio
    assert result["target_met"] == (result["exchange_s"] <= result["target_s"])


def test_overhead_names_a_bad_density():
    from tf_topk.bench import overhead

    with pytest.raises(SystemExit):
        overhead.main(["--densities", "0"])


def test_a_routes_ratio_is_the_median_of_each_rounds_own_ratio():
    """A burst of load that slows one round slows both of its calls: the ratio of that round stays, where
    the ratio of separate medians would move with the burst."""
    from tf_topk.bench import overhead

    assert overhead._paired_ratio([2.0, 30.0, 2.4, 2.2], [1.0, 10.0, 1.2, 1.1]) == pytest.approx(2.0)
    assert overhead._paired_ratio([1.0, 9.0], [1.0, 3.0]) == pytest.approx(2.0)  # here they would read 5 / 2 = 2.5
