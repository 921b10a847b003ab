"""`python -m tf_topk.bench convergence`: the random-k baseline, and a tiny run with a plot.

Runs of one replica call the command's `main` in this process; runs of several replicas (logical CPUs,
made before TensorFlow starts) and one bad argument go through the command line."""

import argparse
import json
import math
import re
import statistics
import struct
import subprocess
from pathlib import Path

import pytest

from multiworker import PYTHON, subprocess_env

REPO_ROOT = Path(__file__).resolve().parents[1]

SEEDS, EPOCHS, DENSITIES, HIDDEN = 2, 2, [0.1, 0.01], 128
# Both datasets have 64 features and 10 classes: MLP 64-128-10. Only the first
# kernel (8,192 entries) reaches the library's min_size (4,096); the output
# kernel (1,280) and the biases stay dense.
SHAPES = [(64, HIDDEN), (HIDDEN,), (HIDDEN, 10), (10,)]
# Lowest test accuracy per seed after 2 epochs (chance: 0.1). Measured on the
# 2-core CPU machine: digits >= 0.925 (dense and top-k at 0.1), >= 0.897 (the
# rest); synthetic >= 0.608 and >= 0.578.
MIN_ACCURACY = {  # dataset: (dense and top-k at density 0.1, every other row)
    "digits": (0.85, 0.75),
    "synthetic": (0.5, 0.4),
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _size(shape):
    return math.prod(shape)


def check_result(result, dataset, png):
    """Every check of one run's JSON and plot (separate so it can be tried on altered results)."""
    assert result["dataset"] == dataset and result["seeds"] == SEEDS and result["epochs"] == EPOCHS
    assert result["densities"] == DENSITIES
    assert result["methods"] == ["dense", "topk_ef", "topk_noef", "randk_ef"]
    assert result["model"] == f"MLP 64-{HIDDEN}-10"
    assert result["params"] == sum(_size(s) for s in SHAPES)
    sparse_entries = sum(_size(s) for s in SHAPES if _size(s) >= result["min_size"])
    assert sparse_entries == 64 * HIDDEN  # the first kernel only
    rows = result["configs"]
    assert [(r["method"], r["density"]) for r in rows] == [
        ("dense", None),
        ("topk_ef", 0.1), ("topk_noef", 0.1), ("randk_ef", 0.1),
        ("topk_ef", 0.01), ("topk_noef", 0.01), ("randk_ef", 0.01),
    ]
    dense = rows[0]
    high, low = MIN_ACCURACY[dataset]
    for row in rows:
        per_seed = row["test_accuracy_per_seed"]
        assert len(per_seed) == SEEDS
        # Everything learns, far above chance (0.1); dense and top-k at 0.1 most of all.
        floor = high if row["density"] in (None, 0.1) and row["method"] != "randk_ef" else low
        assert min(per_seed) >= floor, (row["method"], row["density"], per_seed)
        assert max(per_seed) <= 1.0
        # The summary agrees with the per-seed values and the curves (mean over seeds per epoch).
        assert row["test_accuracy_mean"] == pytest.approx(statistics.fmean(per_seed), abs=2e-5)
        assert row["test_accuracy_std"] == pytest.approx(statistics.stdev(per_seed), abs=2e-5)
        curves = row["curves"]
        assert len(curves["train_loss"]) == len(curves["test_accuracy"]) == EPOCHS
        assert curves["test_accuracy"][-1] == pytest.approx(row["test_accuracy_mean"], abs=2e-5)
        assert curves["train_loss"][-1] == pytest.approx(row["train_loss_mean"], abs=2e-5)
        assert all(math.isfinite(v) and v > 0 for v in curves["train_loss"])
        # The second epoch's training loss is well below the first's (measured: at most 0.6x).
        assert curves["train_loss"][1] < 0.8 * curves["train_loss"][0], (row["method"], curves)
        assert row["vs_dense_points"] == pytest.approx(
            100 * (row["test_accuracy_mean"] - dense["test_accuracy_mean"]), abs=0.011)
    assert "contraction" not in dense and "random_k_bound" not in dense
    for row in rows[1:]:
        density = row["density"]
        k = max(1, math.ceil(density * sparse_entries))
        # random_k_bound is 1 - k/d over the sparsified entries: 1 - density up to k's rounding up.
        assert row["random_k_bound"] == pytest.approx(1 - k / sparse_entries, abs=2e-5)
        assert abs(row["random_k_bound"] - (1 - density)) <= 1 / sparse_entries + 2e-5
        # At most k non-zero entries sent; top-k sends (nearly) all k, random-k may pick zeros.
        assert 0 < row["sent_density"] <= k / sparse_entries + 2e-6, row
        if row["method"].startswith("topk"):
            assert row["sent_density"] >= 0.9 * k / sparse_entries, row
        assert 0.0 <= row["contraction"] <= 1.0
    for density in DENSITIES:
        by_method = {r["method"]: r for r in rows if r["density"] == density}
        bound = by_method["randk_ef"]["random_k_bound"]
        # Random-k drops 1 - k/d of the energy in expectation (measured: within 0.01);
        # top-k drops clearly less (measured: at least 0.045 less).
        assert by_method["randk_ef"]["contraction"] == pytest.approx(bound, abs=0.05)
        for method in ("topk_ef", "topk_noef"):
            assert by_method[method]["contraction"] < bound - 0.01, by_method[method]
            assert by_method[method]["contraction"] < by_method["randk_ef"]["contraction"]
    # The plot: a PNG of one column per density (figsize 4.2 x 7 inches per column at 110 dpi).
    assert result["plot"] == str(png)
    with open(png, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (round(4.2 * len(DENSITIES) * 110), 7 * 110)
    assert png.stat().st_size > 10_000


def test_random_k_baseline_is_the_library_optimizer_with_only_the_selector_replaced():
    """The random-k optimizer is a TopKOptimizer given a RandomKSelector: every other
    option (method, exchange_mode, local_clipnorm...) reaches its exchange as top-k's does."""
    import keras

    from tf_topk.bench import convergence
    from tf_topk.selector import RandomKSelector

    args = argparse.Namespace(optimizer="sgd", learning_rate=0.05, momentum=0.9, nesterov=False, method="exact",
                              min_size=2000, warmup_epochs=0, workers=4, exchange_mode="auto",
                              agreement="nominated", agreed_slots=1, local_clipnorm=None, masking=False,
                              selection_scope="variable")
    model = convergence.make_model(keras, 64, [HIDDEN], 10)
    topk = convergence.make_optimizer(keras, "topk_ef", 0.01, args, steps_per_epoch=10)
    randk = convergence.make_optimizer(keras, "randk_ef", 0.01, args, steps_per_epoch=10)
    assert type(randk) is type(topk)
    assert randk.exchange_config == topk.exchange_config
    assert randk.exchange_config.method == "exact" and randk.min_size == 2000 and randk.exchange_mode == "auto"
    for optimizer in (topk, randk):
        optimizer.build(model.trainable_variables)
    assert isinstance(randk.exchange.selector, RandomKSelector)
    assert not isinstance(topk.exchange.selector, RandomKSelector)
    assert randk.exchange.config == topk.exchange.config
    # The same error feedback: one residual, for the 64x128 kernel, tracked by the optimizer.
    assert len(randk.residuals) == len(topk.residuals) == 1
    assert any(randk.residuals[0] is v for v in randk.variables)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_runs_error_feedback_without_and_topk_mc_with_adams_correction(optimizer):
    """topk_ef is top-k + EF in front of Adam (TopKOptimizer's default for Adam);
    topk_mc is Adam's momentum correction, warmed up dense over the first 10% of the steps."""
    import keras

    from tf_topk.bench import convergence

    args = argparse.Namespace(optimizer=optimizer, learning_rate=0.001, weight_decay=0.01, method="exact",
                              min_size=2000, warmup_epochs=0, workers=4, exchange_mode="auto",
                              agreement="nominated", agreed_slots=1, epochs=30, local_clipnorm=None,
                              masking=False, selection_scope="variable")
    plain = convergence.make_optimizer(keras, "topk_ef", 0.01, args, steps_per_epoch=45)
    corrected = convergence.make_optimizer(keras, "topk_mc", 0.01, args, steps_per_epoch=45)
    noef = convergence.make_optimizer(keras, "topk_noef", 0.01, args, steps_per_epoch=45)
    assert not plain.momentum_correction and not noef.momentum_correction and not noef.error_feedback
    assert corrected.momentum_correction and corrected.exchange_config.beta_2 == 0.999
    assert corrected.exchange_config.variance_warmup_steps == 45 * 30 // 10


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["digits", "synthetic"])
def test_tiny_run_json_and_plot(tmp_path, dataset, capsys):
    png = tmp_path / "curves.png"
    result = convergence_in_process(capsys, "--dataset", dataset, "--seeds", str(SEEDS), "--epochs", str(EPOCHS),
                                    "--densities", ",".join(map(str, DENSITIES)), "--hidden", str(HIDDEN),
                                    "--density-warmup-steps", "0",  # each density from the first step
                                    "--json", "--plot", str(png))
    check_result(result, dataset, png)


def convergence_in_process(capsys, *args):
    """`python -m tf_topk.bench convergence ARGS --json`'s result, run by this process (the one TensorFlow
    start-up of the test session serves every run of one replica; `main` is what the command line calls)."""
    from tf_topk.bench import convergence

    capsys.readouterr()
    assert convergence.main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def run_convergence(*args, timeout=240):
    return subprocess.run([*PYTHON, "-m", "tf_topk.bench", "convergence", *args], cwd=REPO_ROOT, env=subprocess_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


@pytest.mark.slow
def test_shapes_cnn_with_momentum_correction_and_warmup(tmp_path, capsys):
    result = convergence_in_process(capsys, "--dataset", "shapes", "--seeds", "1", "--epochs", "3", "--densities",
                                    "0.01", "--methods", "topk_ef,topk_mc", "--warmup-epochs", "1", "--learning-rate",
                                    "0.02", "--json", "--plot", str(tmp_path / "curves.png"))
    assert result["model"] == "CNN conv16-conv32-64-10" and result["warmup_epochs"] == 1
    # conv 16*9+16, conv 32*16*9+32, dense 512*64+64, output 64*10+10
    assert result["params"] == 160 + 4640 + 32832 + 650
    assert [r["method"] for r in result["configs"]] == ["dense", "topk_ef", "topk_mc"]
    for row in result["configs"]:
        # 10 glyph classes (chance 0.1): a CNN learns them in 3 epochs (measured: 0.5 to 0.7).
        assert row["test_accuracy_mean"] > 0.3, row
    for row in result["configs"][1:]:
        # After the one-epoch warm-up the last step sends density 0.01 of the two large kernels.
        k = math.ceil(0.01 * 4608) + math.ceil(0.01 * 32768)
        assert row["sent_density"] == pytest.approx(k / (4608 + 32768), abs=2e-4), row
    assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_signals_1d_cnn_with_and_without_momentum_factor_masking(capsys):
    """The 1-D CNN on the generated waveforms; --masking turns DGC's masking on for topk_mc (off by default)."""
    results = {}
    for extra in ([], ["--masking"]):
        results[bool(extra)] = result = convergence_in_process(
            capsys, "--dataset", "signals", "--seeds", "1", "--epochs", "2", "--densities", "0.01", "--methods",
            "topk_mc", "--learning-rate", "0.02", "--json", *extra)
        assert result["model"] == "1-D CNN conv32-conv64-conv64-256-10" and result["momentum_masking"] is bool(extra)
        # convs 5*1*32+32, 5*32*64+64, 5*64*64+64, dense 512*256+256, output 256*10+10
        assert result["params"] == 192 + 10304 + 20544 + 131328 + 2570
        for row in result["configs"]:
            assert row["test_accuracy_mean"] > 0.3, row  # 10 classes; measured 0.6 to 0.8 after 2 epochs
    # The dense rows are the same run; masking changes what topk_mc sends, so its result.
    assert results[False]["configs"][0]["test_accuracy_per_seed"] == results[True]["configs"][0]["test_accuracy_per_seed"]
    assert results[False]["configs"][1]["train_loss_mean"] != results[True]["configs"][1]["train_loss_mean"]


@pytest.mark.slow
def test_adaptive_run_counts_bytes_per_worker_and_draws_bytes_to_accuracy(tmp_path, capsys):
    png = tmp_path / "bytes.png"
    result = convergence_in_process(capsys, "--seeds", "1", "--epochs", "2", "--densities", "0.1,0.01", "--methods",
                                    "topk_ef", "--hidden", str(HIDDEN), "--adaptive", "--workers", "4", "--json",
                                    "--bytes-plot", str(png), "--density-warmup-steps", "0")
    rows = {(r["method"], r["density"]): r for r in result["configs"]}
    assert list(rows) == [("dense", None), ("topk_ef", 0.1), ("topk_ef", 0.01), ("adaptive", None)]
    steps = 2 * math.ceil(1437 / 32)  # digits' training split, batch 32
    dense_step = 2 * 3 / 4 * 4 * result["params"]  # ring all-reduce of every gradient, 4 workers
    assert rows[("dense", None)]["bytes_per_worker_total"] == pytest.approx(steps * dense_step, rel=1e-6)
    small = result["params"] - 64 * HIDDEN + 1  # the dense-path entries and the non-finite count
    for density in (0.1, 0.01):  # every step sends k = ceil(d * 8192) pairs to 3 other workers
        step = 3 * 8 * math.ceil(density * 64 * HIDDEN) + 2 * 3 / 4 * 4 * small
        assert rows[("topk_ef", density)]["bytes_per_worker_total"] == pytest.approx(steps * step, rel=1e-3)
    adaptive = rows[("adaptive", None)]
    curve = adaptive["curves"]["bytes_per_worker"]
    assert len(curve) == 2 and 0 < curve[0] < curve[1] == pytest.approx(adaptive["bytes_per_worker_total"], abs=1)
    assert all(1e-4 <= d <= 1.0 for d in adaptive["curves"]["density"])
    targets = result["adaptive_targets"]
    assert targets["adaptive_bytes"] == adaptive["bytes_per_worker_total"] and isinstance(targets["met"], bool)
    assert png.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow
def test_several_replicas_per_run_exchange_by_the_mode_asked(tmp_path):
    """--replicas 2: MirroredStrategy over two logical CPUs, each replica its
    half of the batch and its own residuals; the pairs travel by
    --exchange-mode (agreed indices here, all_gather in the one-replica run)."""
    runs = {}
    for name, replicas, extra in (("two", 2, ()), ("one", 1, ()), ("leader", 2, ("--agreement", "leader"))):
        proc = run_convergence("--seeds", "1", "--epochs", "1", "--densities", "0.01", "--methods", "topk_ef",
                               "--hidden", str(HIDDEN), "--replicas", str(replicas), "--exchange-mode", "allreduce",
                               *extra, "--json")
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = json.loads(proc.stdout)
    two, one, leader = runs["two"], runs["one"], runs["leader"]
    assert (two["replicas"], two["exchange_mode"], two["agreement"]) == (2, "allreduce", "nominated")
    assert leader["agreement"] == "leader" and leader["configs"][1]["exchange_mode_code"] == 2.0
    # ScaleCom's rule and the nominations choose other indices: other weights after an epoch.
    assert leader["configs"][1]["train_loss_mean"] != two["configs"][1]["train_loss_mean"]
    assert two["configs"][1]["exchange_mode_code"] == 2.0  # agreed indices between the two replicas
    assert one["configs"][1]["exchange_mode_code"] == 1.0  # one replica: nothing to agree on
    for result in (one, two):
        assert result["configs"][1]["test_accuracy_mean"] > 0.5  # digits after one epoch (chance 0.1)
    # Half a batch per replica, so each replica's top-k of its own gradient: not the one-replica run.
    assert two["configs"][1]["test_accuracy_per_seed"] != one["configs"][1]["test_accuracy_per_seed"]


@pytest.mark.slow
def test_cnn_over_eight_replicas_tests_a_split_that_leaves_a_replica_no_sample(tmp_path):
    """shapes' 750 test samples end in a batch of 14, fewer than 8 replicas:
    under `fit`'s own validation one replica gets no sample, which TensorFlow's
    oneDNN convolution refuses, so several replicas test on one device, outside
    the replicas. Agreed indices on 2k slots."""
    proc = run_convergence("--dataset", "shapes", "--seeds", "1", "--epochs", "1", "--densities", "0.01",
                           "--methods", "topk_ef", "--replicas", "8", "--exchange-mode", "allreduce",
                           "--agreed-slots", "2", "--learning-rate", "0.02", "--warmup-epochs", "0", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert (result["replicas"], result["agreed_slots"], result["test_samples"]) == (8, 2, 750)
    topk = result["configs"][1]
    assert topk["exchange_mode_code"] == 2.0  # agreed indices among the 8 replicas
    for row in result["configs"]:
        # 10 glyph classes (chance 0.1): one epoch at learning rate 0.02 is above chance (measured: dense 0.29,
        # agreed indices 0.22).
        assert row["test_accuracy_mean"] > 0.15, row


def test_the_test_at_each_epochs_end_scores_as_keras_evaluate_does():
    """With several replicas the benchmark tests on one device in a callback
    instead of `fit`'s validation: the same `val_loss` and `val_accuracy`."""
    import keras
    import numpy as np

    from tf_topk.bench import convergence

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 8)).astype("float32"), rng.integers(0, 3, 50)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    logs = {"loss": 1.0}
    callback = convergence._test_callback(keras, x, y)
    callback.set_model(model)
    callback.on_epoch_end(0, logs)
    loss, accuracy = model.evaluate(x, y, batch_size=50, verbose=0)
    assert 0.0 < accuracy < 1.0  # a score the two could disagree on
    assert logs == pytest.approx({"loss": 1.0, "val_loss": loss, "val_accuracy": accuracy}, rel=1e-5)


@pytest.mark.parametrize("args,message", [
    (("--replicas", "3"), r"--replicas must be >= 1 and divide --batch-size \(32\), got 3"),
    (("--workers", "1"), "--workers must be >= 2"),
    (("--methods", "topk_mc", "--momentum", "0"), "topk_mc .* needs --momentum > 0 with --optimizer sgd"),
    (("--warmup-epochs", "-1"), "--warmup-epochs must be >= 0, got -1"),
    (("--agreement", "leader"), "--agreement leader needs --exchange-mode allreduce, got auto"),
    (("--agreed-slots", "2"), "--agreed-slots 2 needs --exchange-mode allreduce, got auto"),
    (("--autopilot",), "--autopilot plans for a stated link: give --time-links"),
    (("--time-plot", "t.png"), "--time-plot draws the charged time: give --time-links"),
    (("--time-links", "1gbit,fast"), "links must be comma-separated rates such as 100mbit,1gbit, got '1gbit,fast'"),
    (("--density-warmup-steps", "-5"), r"--density-warmup-steps: must be 'auto' or an integer >= 0, got '-5'"),
    (("--density-warmup-steps", "many"), r"--density-warmup-steps: must be 'auto' or an integer >= 0, got 'many'"),
    (("--density-warmup-steps", "100", "--warmup-epochs", "4"), "--density-warmup-steps warms up a fixed density"),
    (("--dataset", "colors", "--model", "mlp"), "--dataset colors has one model, cnn_rgb, got --model mlp"),
    (("--model", "gru"), "--model gru is --dataset sequences's, got --dataset digits"),
    (("--schedule", "linear"), "argument --schedule: invalid choice: 'linear'"),
    (("--methods", "topk_ef,magic"), "methods must be among topk_ef,topk_mc,topk_noef,randk_ef,demo, got 'topk_ef,magic'"),
])
def test_bad_arguments_are_refused_before_training(args, message, capsys):
    """convergence.main, as the command line calls it: argparse's exit 2 and the message, no output."""
    from tf_topk.bench import convergence

    with pytest.raises(SystemExit) as exit_info:
        convergence.main(list(args))
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    assert re.search(message, captured.err), captured.err[-2000:]


@pytest.mark.slow
def test_the_command_line_refuses_a_bad_argument_with_exit_2():
    """`python -m tf_topk.bench convergence` reaches the same checks (one case; the rest run in-process)."""
    proc = run_convergence("--workers", "1", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--workers must be >= 2" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_time_to_accuracy_charges_each_step_its_predicted_exchange(tmp_path, capsys):
    """Two epochs of digits, one seed: every step of dense costs the measured compute plus a ring all-reduce
    of every parameter at 100 Mbit/s and 4 workers; top-k's its selection and pairs; the autopilot runs
    the plan for each stated link."""
    result = convergence_in_process(capsys, "--epochs", "2", "--seeds", "1", "--densities", "0.001", "--methods",
                                    "topk_ef", "--time-links", "100mbit,10gbit", "--autopilot", "--json",
                                    "--density-warmup-steps", "0", "--time-plot", str(tmp_path / "time.png"))
    assert result["time_plot"] == str(tmp_path / "time.png") and (tmp_path / "time.png").stat().st_size > 10_000
    timing = result["time_to_accuracy"]
    dense, topk, pilot_slow, pilot_fast = result["configs"]
    assert [r["label"] for r in (pilot_slow, pilot_fast)] == ["autopilot (100mbit)", "autopilot (10gbit)"]
    assert set(dense["time_s"]) == {"100mbit", "10gbit"} and set(pilot_slow["time_s"]) == {"100mbit"}
    steps = -(-result["train_samples"] // result["batch_size"])
    params = dense["time_s"]
    compute = timing["compute_s_per_step"]
    for link, rate in (("100mbit", 12.5e6), ("10gbit", 1.25e9)):
        per_step = compute + 5e-4 + 2 * 3 / 4 * 4 * 85_002 / rate  # the MLP 64-256-256-10: 85,002 parameters
        assert params[link] == pytest.approx([per_step * steps, 2 * per_step * steps], rel=1e-3)
        # Top-k at 0.001 sends a few hundred pairs: far less time per epoch than dense on the slow link.
        assert topk["time_s"][link][0] < params[link][0]
    # Its exchange (the time beyond the compute both are charged) is a small part of dense's: compared without
    # the compute, which this machine's load sets (a busy machine's compute alone can be 15% of dense's step).
    exchange = {name: row["time_s"]["100mbit"][0] - compute * steps for name, row in (("dense", dense), ("topk", topk))}
    assert 0 < exchange["topk"] < 0.2 * exchange["dense"], exchange
    links = timing["links"]
    assert set(links["100mbit"]["time_to_target_s"]) == {"dense", "topk_ef:0.001", "autopilot"}
    reached = links["100mbit"]["time_to_target_s"]
    if reached["autopilot"] is not None and reached["topk_ef:0.001"] is not None:
        assert links["100mbit"]["autopilot_vs_best_fixed"] == pytest.approx(
            reached["autopilot"] / reached["topk_ef:0.001"], abs=1e-3)


def test_a_cosine_schedule_decays_the_inner_rate_to_zero_over_the_runs_steps():
    import keras

    from tf_topk.bench import convergence

    args = convergence.parse_args(["--dataset", "sequences", "--schedule", "cosine", "--learning-rate", "0.1"])
    assert args.model == "gru" and convergence.optimizer_name(args) == "SGD(learning_rate=CosineDecay(0.1), momentum=0.9)"
    inner = convergence.make_inner(keras, args, steps=1000)
    schedule = inner._learning_rate
    assert isinstance(schedule, keras.optimizers.schedules.CosineDecay)
    assert float(schedule(0)) == pytest.approx(0.1) and float(schedule(500)) == pytest.approx(0.05)
    assert float(schedule(1000)) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="--schedule cosine needs the run's steps"):
        convergence.make_inner(keras, args)
    assert float(convergence.make_inner(keras, convergence.parse_args([])).learning_rate) == pytest.approx(0.05)
