"""`python -m tf_topk.bench trace`: the first traced steps of a custom loop, the exchange converted by
AutoGraph or not, each variant in a new process."""

import pytest

from tf_topk.bench import trace


@pytest.mark.slow
def test_both_variants_time_every_loop_and_the_ratios_compare_them(capsys):
    assert trace.main(["--loops", "2", "--json"]) == 0
    import json

    result = json.loads(capsys.readouterr().out)
    assert result["loops"] == 2 and result["replicas"] == 2
    for name in ("unconverted_s", "converted_s"):
        assert len(result[name]) == 2 and all(s > 0 for s in result[name]), result
    assert result["first_ratio"] == pytest.approx(result["converted_s"][0] / result["unconverted_s"][0], rel=0.02)
    assert result["later_ratio"] == pytest.approx(result["converted_s"][1] / result["unconverted_s"][1], rel=0.02)


def test_the_exchange_is_left_unconverted_and_the_benchmark_can_undo_that():
    """What `converted` undoes is there: the decorator's target is the exchange's own method."""
    import tf_topk

    assert tf_topk.SparseExchange.__call__.__wrapped__.__name__ == "__call__"


def test_a_bad_loop_count_is_refused_by_name():
    with pytest.raises(SystemExit) as info:
        trace.main(["--loops", "0"])
    assert info.value.code == 2
