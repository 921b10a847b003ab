"""The default for Adam and AdamW (no density given): where the autopilot's plan sparsifies, decoupled
momentum at a fixed density the plan chooses for the link; where it sends every entry, the inner
optimizer's own update. A link can be stated (`link=` or TF_TOPK_LINK) instead of measured, so the
plan is the same on every run. `advise --optimizer adamw` predicts the same choice.

Two replicas on logical CPUs of this process (MirroredStrategy), a small AdamW model fitted a few steps.
"""

import dataclasses
import functools
import json
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from logical_cpus import mirrored_on_cpus, split_cpu

split_cpu(2)  # before TensorFlow starts

import tf_topk  # noqa: E402
from multiworker import REPO_ROOT  # noqa: E402
from tf_topk.autopilot import CHUNK_AT_DENSITY, DECOUPLED_DENSITIES, FIXED_DENSITY_SAVING, Plan, advise  # noqa: E402
from tf_topk.bench.__main__ import main as bench_main  # noqa: E402
from tf_topk.cost import AUTO_AGREED_SLOTS, CostModel  # noqa: E402
from tf_topk.decoupled_momentum import DecoupledMomentumMemory  # noqa: E402

TEXT_MODEL = 470_784  # the byte-level transformer of the text tasks


@functools.cache
def two_replicas():
    return mirrored_on_cpus(2, 12_000_000)


def fit(make_optimizer, strategy=None, steps=3):
    """A 64-512-512-10 MLP fitted `steps` steps of 32 on random data; returns the optimizer."""
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
        optimizer = make_optimizer()
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    rng = np.random.default_rng(0)
    model.fit(rng.random((32 * steps, 64), np.float32), rng.integers(0, 10, 32 * steps), batch_size=32, epochs=1,
              verbose=0)
    return optimizer


def plan_for(workers, link, entries, decoupled=True):
    """The plan an optimizer makes for a stated link (agreed indices priced on 2k, as it sends them)."""
    model = dataclasses.replace(CostModel.from_link(workers, link), agreed_slots=AUTO_AGREED_SLOTS)
    return Plan(model, None, entries, decoupled=decoupled)


def test_the_plan_takes_the_first_measured_density_whose_exchange_is_ten_times_cheaper():
    for link, workers, entries in [("100mbit", 2, TEXT_MODEL), ("1gbit", 8, 12_609_546), ("10gbit", 2, TEXT_MODEL)]:
        plan = plan_for(workers, link, entries)
        density = plan.fixed_density()
        assert density in DECOUPLED_DENSITIES
        assert plan.density() == (Plan.chunk_density() if plan.chunked() else density)
        dense_s, at_density = plan._predicted_steps(density)
        if density == DECOUPLED_DENSITIES[0]:  # 10x cheaper than dense, or 0.001 would not halve its time
            assert FIXED_DENSITY_SAVING * at_density <= dense_s or 2 * plan._predicted_steps(0.001)[1] > at_density
        else:
            first = plan._predicted_steps(DECOUPLED_DENSITIES[0])[1]
            assert FIXED_DENSITY_SAVING * first > dense_s and 2 * at_density <= first
    # The 100 Mbit/s text model: 0.01; eight workers at 1 Gbit/s on the wide MLP: 0.001.
    assert plan_for(2, "100mbit", TEXT_MODEL).fixed_density() == 0.01
    assert plan_for(8, "1gbit", 12_609_546).fixed_density() == 0.001
    # Where every entry is faster, no fixed density: the inner optimizer's own update.
    fast = plan_for(2, "100gbit", 70_000)
    assert fast.dense_route() and fast.fixed_density() is None and fast.method().startswith("every entry")
    stated = dataclasses.replace(fast, link="100gbit").decision()
    assert stated.startswith("tf_topk autopilot (the stated link 100gbit, 2 replicas): every entry, dense")
    assert "density=0.01 (any fixed density) sparsifies anyway with decoupled momentum" in stated
    assert plan_for(2, "100mbit", TEXT_MODEL, decoupled=False).fixed_density() is None  # not Adam


def test_at_0_001_on_all_gather_the_plan_sends_its_bytes_in_14_bit_entries():
    """Eight workers at 1 Gbit/s on the wide MLP: decoupled momentum at 0.001's bytes, as the chunk route's
    14-bit entries at 64 / 14 times the density; at 0.01, and where agreed indices are the route, 8-byte
    pairs as before."""
    from tf_topk.routes import FixedRouter

    plan = plan_for(8, "1gbit", 12_609_546)
    assert plan.fixed_density() == CHUNK_AT_DENSITY == 0.001 and plan.chunked()
    assert plan.density() == pytest.approx(0.001 * 64 / 14) and plan.route() == "allgather_chunk"
    router = plan.router()
    assert isinstance(router, FixedRouter) and router.route(None, 8).name == "allgather_chunk"
    assert plan.method() == ("decoupled momentum (DeMo) at density 0.00457 in 14-bit entries (the bytes of 0.001 "
                             "in 8-byte pairs)")
    line = dataclasses.replace(plan, link="1gbit").decision()
    assert "allgather_chunk" in line and "exchange_mode='allgather' 8-byte pairs at 0.001" in line
    for workers, link, entries in [(2, "100mbit", TEXT_MODEL), (16, "1gbit", 12_609_546)]:
        other = plan_for(workers, link, entries)
        assert not other.chunked() and other.density() == other.fixed_density()
        assert other.route() in ("allgather", "allreduce")
    assert plan_for(16, "1gbit", 12_609_546).fixed_density() == 0.001  # agreed indices there: not chunked
    assert not plan_for(8, "1gbit", 12_609_546, decoupled=False).chunked()  # not Adam: an adaptive density


@pytest.mark.parametrize("stated", ["argument", "environment"])
def test_adamw_with_no_density_on_a_stated_slow_link_runs_decoupled_momentum(stated, capsys, monkeypatch):
    strategy = two_replicas()
    if strategy.num_replicas_in_sync != 2:
        pytest.skip("TensorFlow started before this module made its logical CPUs")
    if stated == "environment":
        monkeypatch.setenv("TF_TOPK_LINK", "100mbit")
    link = {"link": "100mbit"} if stated == "argument" else {}
    optimizer = fit(lambda: tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3, global_clipnorm=1.0), **link),
                    strategy)
    assert optimizer.decoupled_momentum is True
    assert isinstance(optimizer.exchange.memory, DecoupledMomentumMemory)
    assert optimizer.exchange.config.schedule.settled_density() == 0.01
    assert optimizer.exchange.config.density_warmup_taken == 400  # as a fixed density of 0.01 warms up
    assert optimizer.compression_stats()["density"] == pytest.approx(0.25, rel=1e-3)  # the warm-up's first stage
    said = capsys.readouterr().err
    line = next(line for line in said.splitlines() if line.startswith("tf_topk autopilot"))
    assert line.startswith("tf_topk autopilot (the stated link 100mbit, 2 replicas): decoupled momentum (DeMo) at "
                           "density 0.01, fixed")
    for how_to_change in ("density=D sets another fixed density", "density=1.0 sends every entry",
                          "decoupled_momentum=False"):
        assert how_to_change in line
    # The plan is the link's, the same on every run; what is saved is the statement, not a measurement.
    config = optimizer.get_config()
    assert "autopilot_plan" not in config and config["density"] is None
    assert config["link"] == ("100mbit" if stated == "argument" else None)


def test_a_stated_link_on_one_replica_sends_every_entry_with_the_inner_adamw(capsys):
    optimizer = fit(lambda: tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), link="100mbit"))
    assert optimizer.decoupled_momentum is False
    assert optimizer.compression_stats()["density"] == 1.0
    assert "one replica, nothing to exchange; every entry, dense" in capsys.readouterr().err


def test_sgd_with_no_density_keeps_error_feedback_at_an_adaptive_density():
    strategy = two_replicas()
    if strategy.num_replicas_in_sync != 2:
        pytest.skip("TensorFlow started before this module made its logical CPUs")
    optimizer = fit(lambda: tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), link="100mbit"), strategy)
    assert optimizer.decoupled_momentum is False
    assert optimizer.exchange.config.schedule.adaptive is not None


@pytest.mark.parametrize("options, message", [
    (dict(link="fast"), "link must be a link rate such as '100mbit', '1gbit' or '10gbit', got 'fast'"),
    (dict(link=100), "link must be a link rate"),
    (dict(link="none"), "link must be a link rate"),
    (dict(link="100mbit", density=0.01), "link='100mbit' states the cluster's link for the autopilot"),
    (dict(link="100mbit", exchange_mode="allgather"), "exchange_mode='allgather'"),
])
def test_a_bad_link_is_named(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), **options)


def test_a_bad_link_in_the_environment_is_named(monkeypatch):
    strategy = two_replicas()
    if strategy.num_replicas_in_sync != 2:
        pytest.skip("TensorFlow started before this module made its logical CPUs")
    monkeypatch.setenv("TF_TOPK_LINK", "quick")
    with pytest.raises(ValueError, match="TF_TOPK_LINK must be a link rate .* got 'quick'"):
        fit(lambda: tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3)), strategy)


@pytest.mark.parametrize("link, workers, params, command_line", [
    ("100mbit", 2, TEXT_MODEL, True), ("1gbit", 8, 12_609_546, False), ("100gbit", 2, 70_000, False)])
def test_advise_predicts_the_method_and_density_the_optimizer_takes(link, workers, params, command_line, capsys):
    """One case through the command line as a user types it; the others call its `main` here (the same
    code, without a TensorFlow start-up each)."""
    argv = ["advise", "--params", str(params), "--workers", str(workers), "--link", link, "--optimizer", "adamw",
            "--json"]
    if command_line:
        output = subprocess.run([sys.executable, "-m", "tf_topk.bench", *argv], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=120, check=True).stdout
    else:
        assert bench_main(argv) == 0
        output = capsys.readouterr().out
    advice = json.loads(output)
    plan = plan_for(workers, link, params)
    assert advice["method"] == plan.method()
    assert advice["autopilot_density"] == (None if plan.fixed_density() is None else plan.density())
    assert advice == {**advice, **{key: value for key, value in
                                   advise(CostModel.from_link(workers, link), params, decoupled=True).items()
                                   if key in ("method", "autopilot", "autopilot_density")}}
