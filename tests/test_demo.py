"""`make demo` and `python -m tf_topk.launch`: the workers' lines are not buried in TensorFlow's start-up
log lines, and the demo's report says what each figure compares.

Two real workers through the launcher, each importing TensorFlow (which logs absl's notice and
oneDNN's line whatever TF_CPP_MIN_LOG_LEVEL says), then printing a line and a warning of its own;
streamed through `shown_lines()`, the filter examples/demo.py and the launcher's command line use.
The demo's table and its paragraph of `advise` from made-up reports (the runs are `make demo`'s).
"""

import importlib.util
import io
import re
import sys

import pytest

from multiworker import REPO_ROOT, worker_env

from tf_topk.autopilot import advise
from tf_topk.cost import CostModel
from tf_topk.launch import is_startup_log, run_workers, shown_lines


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", REPO_ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def report(accuracy, bytes_per_step, step_seconds):
    return {"test_accuracy": accuracy, "bytes_per_step": bytes_per_step, "median_step_seconds": step_seconds}


def test_the_demos_table_names_what_each_ratio_compares():
    """Bytes and speed are separate columns, each ratio named for its direction (dense over the run)."""
    table = load_demo().format_table([("dense all-reduce", report(0.97, 200_000, 0.010)),
                                      ("TopK density 0.01", report(0.96, 10_000, 0.008)),
                                      ("autopilot (default)", report(0.97, 200_000, 0.0125))]).splitlines()
    assert re.split(r"\s{2,}", table[0].strip()) == ["configuration", "test accuracy", "bytes/step/worker",
                                                    "bytes: x fewer", "median step", "speed vs dense"]
    assert re.split(r"\s{2,}", table[2].strip()) == ["TopK density 0.01", "0.9600", "10,000", "20.0x", "8.0ms",
                                                    "1.25x"]
    assert table[3].endswith(" 0.80x")  # slower than dense reads below 1


def test_the_demos_advice_is_one_short_paragraph_of_advises_predictions():
    paragraph = load_demo().advice_paragraph(50_826, 2, 0.01)
    assert len(paragraph.splitlines()) <= 6 and "\n\n" not in paragraph
    for link in ("1gbit", "100mbit"):
        advice = advise(CostModel.from_link(2, link), 50_826, densities=(0.01,))
        dense = next(r["seconds"] for r in advice["rows"] if r["route"] == "dense")
        assert f"at {link} a step's exchange is predicted {dense * 1e3:,.1f} ms dense" in " ".join(paragraph.split())


@pytest.mark.slow
def test_the_launchers_filter_hides_tensorflows_real_start_up_log():
    """What the demo and `python -m tf_topk.launch` stream (`shown_lines()`), with TensorFlow itself."""
    shown = io.StringIO()
    script = ("import sys, tensorflow as tf; tf.constant(1.0).numpy(); print('table line', flush=True); "
              "print('W0000 a warning of its own', file=sys.stderr, flush=True)")
    result = run_workers(2, [sys.executable, "-c", script], env=worker_env(TF_CPP_MIN_LOG_LEVEL="0"),
                         timeout=120, stream=shown, show=shown_lines())
    assert result.ok, result.format_failure()
    lines = shown.getvalue().splitlines()
    assert sorted(line for line in lines if "table line" in line) == ["[worker 0] table line",
                                                                      "[worker 1] table line"]
    assert sum("a warning of its own" in line for line in lines) == 2
    assert not [line for line in lines if is_startup_log(line.split("] ", 1)[1])], lines
    # At its default log level (0) TensorFlow 2.21 logs them (else the filter has nothing to do; at level 2
    # some machines of this kind log none), and they stay in the workers' outputs, which a failure shows.
    hidden = [line for output in result.outputs for line in output.splitlines() if is_startup_log(line)]
    assert len(hidden) >= 2, result.outputs
