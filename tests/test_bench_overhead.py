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
    assert result["target_met"] == (result["exchange_s"] <= result["target_s"])


def test_overhead_names_a_bad_density():
    from tf_topk.bench import overhead

    with pytest.raises(SystemExit):
        overhead.main(["--densities", "0"])
