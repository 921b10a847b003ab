"""benchmarks/time_to_loss.py, which RESULTS' time to dense's loss on a slow link comes from: where a
curve first reaches a loss, the seconds of a run along the density warm-up, and a refusal of a
density the e2e run did not time."""

import importlib.util
import json
import subprocess
import sys

import pytest

from multiworker import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "time_to_loss.py"
_spec = importlib.util.spec_from_file_location("time_to_loss", SCRIPT)
time_to_loss = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(time_to_loss)


def test_a_curve_reaches_a_loss_between_two_evaluations():
    curve = [3.0, 2.0, 1.5, 1.2]  # evaluations after steps 50, 100, 150, 200
    assert time_to_loss.steps_to_reach(curve, 50, 1.75) == pytest.approx(125.0)  # halfway from 2.0 to 1.5
    assert time_to_loss.steps_to_reach(curve, 50, 2.0) == 100.0
    assert time_to_loss.steps_to_reach(curve, 50, 3.5) == 50.0  # the first evaluation is below already
    assert time_to_loss.steps_to_reach(curve, 50, 1.1) is None


def test_a_run_along_the_warm_up_takes_each_densitys_step_time():
    schedule = time_to_loss.warmup_densities(0.01)
    assert [first for first, _ in schedule] == [0, 100, 200, 300, 400]
    assert schedule[0][1] == 0.25 and schedule[-1][1] == 0.01
    seconds = {density: 1.0 + i for i, (_, density) in enumerate(schedule)}  # 1 s a step at 0.25 ... 5 s at 0.01
    assert time_to_loss.seconds_for(50, schedule, seconds) == pytest.approx(50.0)
    assert time_to_loss.seconds_for(450, schedule, seconds) == pytest.approx(100 * (1 + 2 + 3 + 4) + 50 * 5)
    assert time_to_loss.warmup_densities(0.01, 0) == [(0, 0.01)]  # no warm-up: the density from the first step
    assert [first for first, _ in time_to_loss.warmup_densities(0.01, 100)] == [0, 25, 50, 75, 100]


def _e2e(densities, dense_s=1.0, sparse_s=0.2):
    return {"configs": [{"config": "dense", "step_time_s": dense_s},
                        *({"config": f"topk:{d:.3g}", "step_time_s": sparse_s} for d in densities)]}


def test_a_density_the_e2e_run_did_not_time_is_refused_with_the_densities_to_run():
    with pytest.raises(ValueError, match=r"no configuration at density 0\.112 .*--densities 0\.25,0\.112,0\.05,"):
        time_to_loss.e2e_step_seconds(_e2e([0.25, 0.01]), [d for _, d in time_to_loss.warmup_densities(0.01)])


def test_the_command_prints_each_seeds_time_and_the_median_ratio(tmp_path):
    densities = [d for _, d in time_to_loss.warmup_densities(0.01)]
    runs = [{"variant": "dense", "density": 0.01, "seed": 0, "dataset": "text", "steps": 600,
             "curve": [2.0, 1.8, 1.6]},  # every 200 steps: 1.6 after its 600
            {"variant": "demo:warm=auto", "density": 0.01, "seed": 0, "dataset": "text", "steps": 1000,
             "curve": [2.1, 1.9, 1.7, 1.6, 1.5]},  # 1.6 at step 800
            {"variant": "demo:warm=auto", "density": 0.01, "seed": 1, "dataset": "text", "steps": 1000,
             "curve": [2.1, 1.9, 1.7, 1.6, 1.5]}]  # no dense run of seed 1: left out
    (tmp_path / "curves.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    (tmp_path / "e2e.json").write_text(json.dumps(_e2e(densities)))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "curves.jsonl"), str(tmp_path / "e2e.json"),
                           "--steps", "1000", "--target-step", "600"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # dense: 600 steps of 1 s; the default: 400 warm-up steps of 0.2 s and 400 more of 0.2 s
    assert "seed 0: dense 1.6000 at step 600 in    600.0 s; demo:warm=auto reaches it at step 800:    160.0 s" \
        in proc.stdout
    assert "median over 1 of 1 seeds: 3.75x sooner" in proc.stdout


def test_dense_loss_at_a_step_comes_from_a_run_evaluated_there():
    runs = [{"variant": "dense", "seed": 0, "dataset": "text", "steps": 2000, "curve": [float(i) for i in range(16)]},
            {"variant": "dense", "seed": 0, "dataset": "text", "steps": 800, "curve": [float(i) for i in range(16)]}]
    assert time_to_loss.dense_loss_at(runs, "text", 0, 800) == 15.0  # the 800-step run's last (every 50)
    assert time_to_loss.dense_loss_at(runs, "text", 0, 1000) == 7.0  # the 2000-step run's 8th (every 125)
    assert time_to_loss.dense_loss_at(runs, "text", 0, 900) is None and time_to_loss.dense_loss_at(runs, "prose", 0, 800) is None


def test_an_exchange_modes_steps_are_timed_on_its_own_configurations():
    """`--exchange-mode allgather_chunk` times the steps on e2e's topk:<d>@allgather_chunk rows, never
    on the same density's 8-byte pairs, and refuses a run that lacks them."""
    densities = [d for _, d in time_to_loss.warmup_densities(0.00456)]
    e2e = _e2e(densities, sparse_s=0.5)
    e2e["configs"] += [{"config": f"topk:{d:.3g}@allgather_chunk", "step_time_s": 0.1} for d in densities]
    assert time_to_loss.e2e_step_seconds(e2e, densities)[0.00456] == 0.5
    assert time_to_loss.e2e_step_seconds(e2e, densities, "allgather_chunk")[0.00456] == 0.1
    with pytest.raises(ValueError, match=r"no configuration at density 0\.25 on allgather_int8 .*"
                                         r"--exchange-modes allgather_int8"):
        time_to_loss.e2e_step_seconds(e2e, densities, "allgather_int8")
