"""`python -m tf_topk.bench suite`: the task suite's halves, its paired intervals, its table, a run
that resumes from its file, and the arguments it refuses."""

import json
import subprocess

import pytest

from multiworker import PYTHON, REPO_ROOT, subprocess_env
from tf_topk.bench import suite


def test_the_halves_hold_the_development_tasks_and_the_generated_validation_tasks():
    halves = {half: [name for name, task in suite.TASKS.items() if task.half == half] for half in suite.HALVES}
    assert halves == {"development": ["digits", "synthetic", "shapes", "signals"],
                      "validation": ["colors", "sequences", "ratings"]}
    for name in suite.TASKS:  # each task's recipe is a valid convergence command line
        args = suite.task_args(name)
        assert args.dataset == name and args.optimizer == "sgd" and args.momentum == 0.9
    assert suite.task_args("ratings").epochs == 15 and suite.task_args("ratings", epochs=2).epochs == 2


def test_the_paired_interval_is_students_t():
    mean, low, high = suite.paired_interval([1.0, 2.0, 3.0, 4.0])
    # mean 2.5, standard error 0.6455, t(0.975, 3) = 3.1824
    assert mean == 2.5 and low == pytest.approx(2.5 - 3.1824 * 0.6455, abs=1e-3) and high == pytest.approx(
        2.5 + 3.1824 * 0.6455, abs=1e-3)
    mean, low, high = suite.paired_interval([0.7])
    assert mean == 0.7 and low != low and high != high  # nan: one seed has no interval


def test_the_table_pairs_by_seed_and_says_which_means_are_within_the_margin():
    records = [{"task": "colors", "config": "dense", "density": None, "seed": s, "test_accuracy": a}
               for s, a in enumerate([0.80, 0.82, 0.78])]
    records += [{"task": "colors", "config": "default", "density": 0.01, "seed": s, "test_accuracy": a}
                for s, a in enumerate([0.79, 0.82, 0.78])]  # -1, 0, 0 points
    records += [{"task": "colors", "config": "default", "density": 0.001, "seed": s, "test_accuracy": a}
                for s, a in [(0, 0.75), (2, 0.70)]]  # -5 and -8 points; seed 1 not run
    rows = suite.summarize(records, ["colors", "ratings"], [0.01, 0.001])
    colors, ratings = rows
    assert colors[0] == "colors" and colors[1] == pytest.approx(80.0) and colors[3] == 3
    assert colors[4][("default", 0.01)][0] == pytest.approx(-1 / 3)
    assert colors[4][("default", 0.001)][0] == pytest.approx(-6.5)
    assert ratings[3] == 0 and ratings[4][("default", 0.01)] is None
    table = suite.format_table(rows, [0.01, 0.001])
    colors_line = next(line for line in table.splitlines() if line.startswith("colors"))
    assert " -0.33 (" in colors_line and colors_line.count("within") == 1 and colors_line.endswith("BELOW")
    assert "not run" in next(line for line in table.splitlines() if line.startswith("ratings"))


def test_a_configuration_against_another_pairs_by_seed_at_the_same_density():
    records = [{"task": "colors", "config": config, "density": 0.01, "seed": s, "test_accuracy": a}
               for config, accuracies in [("default", [0.70, 0.72, 0.71]), ("chunk", [0.75, 0.77, 0.75]),
                                          ("bucket", [0.69, 0.73, 0.70])]
               for s, a in enumerate(accuracies)]
    rows = suite.summarize(records, ["colors"], [0.01], ["chunk", "bucket"], against="default")
    (_, dense_mean, _, seeds, cells), = rows
    assert dense_mean != dense_mean and seeds == 3  # no dense runs: nan, yet the configurations pair
    assert cells[("chunk", 0.01)][0] == pytest.approx(14 / 3) and cells[("bucket", 0.01)][0] == pytest.approx(-1 / 3)
    line = next(line for line in suite.format_table(rows, [0.01], configs=["chunk", "bucket"],
                                                    against="default").splitlines() if line.startswith("colors"))
    assert "ABOVE" in line and line.rstrip().endswith("-")  # chunk's interval above 0; bucket's straddles it


def test_a_configuration_that_sends_more_than_its_density_is_said_beside_the_table():
    records = [{"task": "ratings", "config": config, "density": 0.001, "seed": s, "test_accuracy": 0.5,
                "sent_density": sent}
               for config, sent in [("default", 0.00104), ("min-k-32", 0.0034)] for s in range(2)]
    records.append({"task": "ratings", "config": "dense", "density": None, "seed": 0, "test_accuracy": 0.5,
                    "sent_density": None})
    assert suite.sent_more(records, ["ratings"], [0.001], ["default", "min-k-32"]) == [
        "ratings min-k-32 d=0.001 sent 0.0034 of the entries a step, 3.40x the density"]


@pytest.mark.parametrize("config", sorted(suite.CONFIGS))
def test_every_configuration_builds_a_topk_optimizer_that_trains(config):
    import keras
    import numpy as np

    args = suite.task_args("digits")
    build = suite.config_optimizer(config, 0.01, steps=400, steps_per_epoch=40)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(2)])
    optimizer = build(keras, args)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    before = [w.copy() for w in model.get_weights()]
    model.fit(x, (x[:, 0] > 0).astype("int32"), epochs=1, batch_size=16, verbose=0)
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert suite.CONFIGS[config].what and type(optimizer.inner_optimizer).__name__ == "SGD"


def _suite(argv, **kw):
    return subprocess.run([*PYTHON, "-m", "tf_topk.bench", "suite", *argv], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=400, **kw)


@pytest.mark.slow
def test_a_suite_run_appends_each_run_and_resumes_without_training_them_again(tmp_path):
    out = tmp_path / "runs.jsonl"
    argv = ["--tasks", "ratings", "--seeds", "2", "--epochs", "1", "--densities", "0.01", "--out", str(out)]
    proc = _suite(argv[:3] + ["1"] + argv[4:])  # one seed first, as if stopped there
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 2
    proc = _suite(argv + ["--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["config"], r["seed"]) for r in records] == [("dense", 0), ("default", 0), ("dense", 1), ("default", 1)]
    assert proc.stderr.count("[suite] ratings seed") == 2  # seed 1's two runs only
    assert all(r["half"] == "validation" and r["epochs"] == 1 and 0.0 < r["test_accuracy"] <= 1.0 for r in records)
    # The fit beside the test: the last epoch's running training loss and accuracy.
    assert all(r["train_loss"] > 0.0 and 0.0 < r["train_accuracy"] <= 1.0 for r in records)
    assert records[1]["sent_density"] > 0.01  # one epoch of 300 steps lies inside the library's warm-up
    row, = json.loads(proc.stdout)["rows"]
    assert row["task"] == "ratings" and row["seeds"] == 2 and row["default"]["0.01"]["low"] < row["default"]["0.01"]["high"]
    proc = _suite(["--tasks", "ratings", "--seeds", "2", "--densities", "0.01", "--out", str(out), "--table-only"])
    assert proc.returncode == 0 and "[suite] ratings seed" not in proc.stderr and "ratings    validation" in proc.stdout


@pytest.mark.parametrize("argv,message", [
    ([], "give --half development|validation or --tasks"),
    (["--half", "validation", "--tasks", "colors"], "give --half development|validation or --tasks"),
    (["--tasks", "colors,imagenet"], "tasks must be among digits,synthetic"),
    (["--half", "validation", "--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["--half", "validation", "--against", "sparse"], "--against must be dense or among default,"),
    (["--half", "validation", "--configs", "default,magic"], "configs must be among default,"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        suite.parse_args(argv)
    assert message in capsys.readouterr().err


def test_error_feedback_in_dct_blocks_sending_everything_is_the_inner_sgd():
    """The `dct` configuration decodes what was sent and hands it to the inner optimizer: at density
    1.0 nothing waits in the residual, so the step is the inner SGD's on the gradient itself."""
    import keras
    import numpy as np

    args = suite.task_args("digits")
    optimizer = suite.config_optimizer("dct", 1.0, steps=400, steps_per_epoch=40)(keras, args)
    plain = keras.optimizers.SGD(args.learning_rate, momentum=args.momentum)
    ours, theirs = keras.Variable(np.ones([64, 64], np.float32)), keras.Variable(np.ones([64, 64], np.float32))
    for step in range(3):
        grad = np.random.default_rng(step).standard_normal([64, 64]).astype(np.float32)
        optimizer.apply_gradients([(grad, ours)])
        plain.apply_gradients([(grad, theirs)])
    assert not np.array_equal(ours.numpy(), np.ones([64, 64]))
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-5)


def test_the_quarter_warm_ups_span_the_runs_first_quarter():
    assert suite.CONFIGS["warmup-quarter"].options(0.001, 3350, 112) == {"density": 0.001,
                                                                         "density_warmup_steps": 837}
    schedule = list(suite.CONFIGS["warmup-quarter-from-0.125"].options(0.001, 3350, 112)["density"])
    assert schedule[0] == (0, 0.125) and schedule[-1] == (837, 0.001) and len(schedule) == 5


def test_the_chunk_wire_configuration_sends_the_defaults_bytes_in_14_bit_entries():
    options = suite.CONFIGS["chunk-wire"].options(0.001, 3350, 112)
    assert options["exchange_mode"] == "allgather_chunk"
    assert options["density"] == pytest.approx(0.001 * 64 / 14)
