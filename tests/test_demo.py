"""`make demo` and `python -m tf_topk.launch`: the workers' lines are not buried in TensorFlow's start-up
log lines.

Two real workers through the launcher, each importing TensorFlow (which logs absl's notice and
oneDNN's line whatever TF_CPP_MIN_LOG_LEVEL says), then printing a line and a warning of its own;
streamed through `shown_lines()`, the filter examples/demo.py and the launcher's command line use.
"""

import io
import sys

import pytest

from multiworker import worker_env

from tf_topk.launch import is_startup_log, run_workers, shown_lines


@pytest.mark.slow
def test_the_launchers_filter_hides_tensorflows_real_start_up_log():
    """What the demo and `python -m tf_topk.launch` stream (`shown_lines()`), with TensorFlow itself."""
    shown = io.StringIO()
    script = ("import sys, tensorflow as tf; tf.constant(1.0).numpy(); print('table line', flush=True); "
              "print('W0000 a warning of its own', file=sys.stderr, flush=True)")
    result = run_workers(2, [sys.executable, "-c", script], env=worker_env(TF_CPP_MIN_LOG_LEVEL="2"),
                         timeout=120, stream=shown, show=shown_lines())
    assert result.ok, result.format_failure()
    lines = shown.getvalue().splitlines()
    assert sorted(line for line in lines if "table line" in line) == ["[worker 0] table line",
                                                                      "[worker 1] table line"]
    assert sum("a warning of its own" in line for line in lines) == 2
    assert not [line for line in lines if is_startup_log(line.split("] ", 1)[1])], lines
    # TensorFlow 2.21 does log them here (else the filter has nothing to do), and they stay in the
    # workers' outputs, which a failure message shows.
    hidden = [line for output in result.outputs for line in output.splitlines() if is_startup_log(line)]
    assert len(hidden) >= 2, result.outputs
