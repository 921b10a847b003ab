"""Two real workers (MultiWorkerMirroredStrategy over localhost) train the byte-level transformer with
TopKOptimizer(AdamW): by default (decoupled momentum at density 0.01, each worker's own momentum), and with
Adam's momentum correction (through its dense warm-up, the freeze of the second moment and sparse steps),
both workers end with bitwise the same weights, and with the model of the same two replicas run in one
process."""

import json
import subprocess

import pytest

from multiworker import PYTHON, REPO_ROOT, worker_env
from tf_topk.launch import run_workers

COMMAND = [*PYTHON, str(REPO_ROOT / "examples" / "text_fit.py"), "--steps", "12", "--layers", "1", "--width",
           "32", "--density", "0.01"]
METHODS = {"decoupled_momentum": [], "momentum_correction": ["--momentum-correction", "--warmup", "3"]}


def report(output):
    return json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_two_workers_end_bitwise_identical_and_as_two_replicas_in_one_process(method):
    command = COMMAND + METHODS[method]
    result = run_workers(2, command, timeout=300)
    assert result.ok, result.format_failure()
    workers = [report(output) for output in result.outputs]
    assert [r["worker"] for r in workers] == [0, 1] and all(r["replicas"] == 2 for r in workers)
    assert all(r["steps"] == 12 and r["method"] == method for r in workers)
    assert workers[0]["weights_sha256"] == workers[1]["weights_sha256"]
    assert 0 < workers[0]["val_loss"] < 5.545  # below a uniform guess over 256 bytes
    # subprocess.run kills the process if it runs past the timeout.
    one = subprocess.run(command + ["--logical-cpus", "2"], cwd=REPO_ROOT, env=worker_env(), capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-4000:]
    local = report(one.stdout)
    assert local["replicas"] == 2
    assert abs(local["val_loss"] - workers[0]["val_loss"]) < 2e-3, (local, workers[0])
