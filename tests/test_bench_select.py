"""`python -m tf_topk.bench select`: the selection's figures, and what the magnitude profile costs."""

import pytest

from tf_topk.bench import select


def test_selection_figures_and_the_profiles_cost_at_each_depth():
    result = select.run(50_000, 0.01, repeats=2, profile_depths=(0.05, 1.0))
    assert result["k"] == 500 and result["recall"] > 0.9 and 0 < result["count"] <= 500
    assert result["fused_error_feedback"] > 0
    assert set(result["profile"]) == set(result["profile_over_fused"]) == {"0.05", "1.0"}
    for depth, seconds in result["profile"].items():
        assert seconds > 0
        # The ratio of the unrounded times, to 2 places.
        assert result["profile_over_fused"][depth] == pytest.approx(seconds / result["fused_error_feedback"],
                                                                    rel=1e-3, abs=0.006)
    assert "profile" not in select.run(10_000, 0.01, repeats=1)  # only when asked


@pytest.mark.parametrize("depths, message", [("0", "in (0, 1], got '0'"), ("0.1,x", "comma-separated numbers")])
def test_bad_profile_depths_name_the_flag(depths, message, capsys):
    with pytest.raises(SystemExit):
        select.main(["--n", "1000", "--profile-depths", depths])
    err = capsys.readouterr().err
    assert "--profile-depths must be" in err and message in err


def test_bench_help_says_what_each_subcommand_measures():
    import subprocess
    import sys

    from tf_topk.bench.__main__ import SUBCOMMANDS

    proc = subprocess.run([sys.executable, "-m", "tf_topk.bench", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    for name, (_, text) in SUBCOMMANDS.items():
        assert f"  {name:<12} {text}" in proc.stdout
