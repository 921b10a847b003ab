"""examples/demo.py (`make demo`): its table is not buried in TensorFlow's start-up log lines.

Two real workers through the launcher, each importing TensorFlow (which logs absl's notice and
oneDNN's line whatever TF_CPP_MIN_LOG_LEVEL says), then printing a line and a warning of its own.
"""

import pytest
import importlib.util
import io
import sys

from multiworker import REPO_ROOT, worker_env

from tf_topk.launch import run_workers


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", REPO_ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


@pytest.mark.slow
def test_the_demo_shows_the_workers_lines_without_tensorflows_start_up_log():
    demo = load_demo()
    shown = io.StringIO()
    script = ("import sys, tensorflow as tf; tf.constant(1.0).numpy(); print('table line', flush=True); "
              "print('W0000 a warning of its own', file=sys.stderr, flush=True)")
    result = run_workers(2, [sys.executable, "-c", script], env=worker_env(TF_CPP_MIN_LOG_LEVEL="2"),
                         timeout=120, stream=demo.WithoutStartupLog(shown))
    assert result.ok, result.format_failure()
    lines = shown.getvalue().splitlines()
    assert sorted(line for line in lines if "table line" in line) == ["[worker 0] table line",
                                                                      "[worker 1] table line"]
    assert sum("a warning of its own" in line for line in lines) == 2
    assert not [line for line in lines if demo.STARTUP_LOG.match(line)], lines
    # TensorFlow 2.21 does log them here (else the filter has nothing to do), and they stay in the
    # workers' outputs, which a failure message shows.
    hidden = [f"[worker {i}] {line}" for i, output in enumerate(result.outputs) for line in output.splitlines()
              if demo.STARTUP_LOG.match(f"[worker {i}] {line}")]
    assert len(hidden) >= 2, result.outputs
