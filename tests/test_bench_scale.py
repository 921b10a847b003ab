"""`python -m tf_topk.bench scale`: measured bytes per worker equal the volume formulas."""

import json

import pytest

from tf_topk.bench import __main__ as bench_main
from tf_topk.bench import scale


@pytest.mark.slow
def test_scale_measures_each_mode_and_projects_larger_clusters(capsys):
    argv = ["scale", "--workers", "2,3", "--size", "10000", "--small", "100", "--density", "0.03", "--steps", "1",
            "--json"]
    assert bench_main.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    measured = [r for r in result["rows"] if r["source"] == "measured"]
    projected = [r for r in result["rows"] if r["source"] == "formula"]
    assert [r["workers"] for r in measured] == [2, 3] and [r["workers"] for r in projected] == list(scale.PROJECTED)
    for row in measured:  # the exchange's own statistics agree with the formulas
        formula = scale.projection(row["workers"], 10000, 100, 0.03)
        for key in ("dense", "allgather", "allreduce", "auto"):
            assert row[key] == pytest.approx(formula[key], rel=1e-6), (row, key)
        assert row["auto_mode"] == formula["auto_mode"]
    # P * k = 900 > n / 16 at P = 3, but "auto"'s agreed indices on 2k slots send 32k * 2/3 bytes, more than
    # all_gather's 16k: all_gather at 2 and 3 workers; agreed indices from 5 workers on.
    assert [r["auto_mode"] for r in measured] == ["allgather", "allgather"]
    assert [r["auto_mode"] for r in projected][:3] == ["allreduce"] * 3 and scale.PROJECTED[0] >= 5
    # 300 pairs: all_gather sends them to every other worker, the agreed indices stay below 16 bytes a pair
    # (32 with "auto"'s 2k slots).
    big = projected[-1]
    small = scale.ring_all_reduce_bytes(404.0, big["workers"])
    assert big["allgather"] > big["dense"] > big["auto"] > big["allreduce"]
    assert big["auto"] - small == pytest.approx(2 * (big["allreduce"] - small))
    assert big["allreduce"] < 16 * 300 + scale.ring_all_reduce_bytes(404.0, big["workers"])
    targets = result["targets"]
    assert targets["pairs"] == 300 and targets["allreduce_below_16_bytes_a_pair_every_P"] is True
    assert targets["allreduce_pair_bytes_by_P"]["2"] == pytest.approx(2 * 4 * 300)  # 2(P-1)/P * 4k, twice
    assert targets["allreduce_pair_bytes_by_P"]["3"] == pytest.approx(2 * 4 / 3 * 4 * 300)
    # all_gather: 8 bytes a pair to each other worker, plus the 100 small entries and the non-finite
    # count, which ride in the same all_gather (4 bytes to each other worker).
    assert targets["allgather_growth_P2_to_P3"] == pytest.approx((4800 + 2 * 404) / (2400 + 404), rel=1e-3)
    assert result["targets"]["allgather_sparse_growth_P2_to_P3"] == pytest.approx(2.0)
    assert result["targets"]["allreduce_sparse_growth_P2_to_P3"] == pytest.approx((2 / 3) / (1 / 2), rel=1e-3)


def test_scale_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        scale.main(["--workers", "1,2"])
    assert "workers must be ints >= 2, got '1,2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        scale.main(["--small", "5000"])
    assert "--small must be in [1, 4096)" in capsys.readouterr().err
