"""selection_scope="bucket": one selection over a bucket's variables, each entry ranked on its variable's scale.

The exchange's results against a numpy reference, with every memory and 1-3
replicas, are in test_exchange_matrix.py; saving and loading in a new
process in test_load_new_process.py. Here: the ranking itself, what it
cannot go with, and the Keras wrapper's journey.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_topk
from tf_topk.routes import AgreedIndexRoute, Router
from tf_topk.selector import TopKSelector, select_over_bucket


def test_a_variable_whose_largest_entries_stand_out_gets_more_of_k():
    """Seven spikes in a small variable beside a large one with gradients 100x
    larger: per variable, the small one sends 5 entries; over the bucket, its
    seven spikes (50 of its own root mean square) and the large one's rest,
    the same total; what is not sent stays in the residuals."""
    rng = np.random.default_rng(0)
    spiky = rng.standard_normal(5000).astype(np.float32)
    spiky[:7] *= 50
    large = (100 * rng.standard_normal(20000)).astype(np.float32)
    sent = {}
    for scope in ("variable", "bucket"):
        variables = [tf.Variable(tf.zeros(5000)), tf.Variable(tf.zeros(20000))]
        exchange = tf_topk.SparseExchange(variables, density=0.001, min_size=16, method="exact",
                                          exchange_mode="allgather", selection_scope=scope, density_warmup_steps=0)
        result = exchange([tf.constant(spiky), tf.constant(large)])
        sent[scope] = [g.numpy() for g in result.grads]
        for grad, residual, g in zip((spiky, large), exchange.residuals, sent[scope]):
            np.testing.assert_array_equal(residual.numpy() + g, grad)
    assert [np.count_nonzero(g) for g in sent["variable"]] == [5, 20]
    assert [np.count_nonzero(g) for g in sent["bucket"]] == [7, 18]
    assert sorted(np.flatnonzero(sent["bucket"][0])) == list(range(7))
    largest = np.argsort(-np.abs(large))[:18]
    assert sorted(np.flatnonzero(sent["bucket"][1])) == sorted(largest)


def test_the_ranking_does_not_depend_on_a_variables_scale():
    """A variable's gradients 1,000 times larger (another layer's scale)
    change no choice: each entry is ranked against its own variable."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_t(3, 3000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    selector = TopKSelector("exact")
    plain = select_over_bucket(selector, [tf.constant(a), tf.constant(b)], 40)
    scaled = select_over_bucket(selector, [tf.constant(1000 * a), tf.constant(b)], 40)
    for (_, i), (_, j) in zip(plain, scaled):
        assert sorted(i.numpy().tolist()) == sorted(j.numpy().tolist())
    counts = [int(tf.size(i)) for _, i in plain]
    assert sum(counts) == 40 and counts[0] > 3 * counts[1]  # t(3)'s heavy tail stands out more
    # Within a variable the ranking is by magnitude: its share is its own top entries.
    assert sorted(plain[0][1].numpy().tolist()) == sorted(np.argsort(-np.abs(a))[:counts[0]].tolist())


def test_non_finite_entries_and_empty_variables_are_never_sent_and_spare_slots_send_nothing():
    """A NaN is never sent and does not spoil its variable's ranking; an all-zero variable sends nothing;
    where the bucket has fewer non-zero entries than k, the spare slots (value 0 at index 0) fill k."""
    a = np.array([0.0, 3.0, np.nan, 1.0, -2.0], np.float32)
    selector = TopKSelector("exact")
    (values, indices), (zero_values, zero_indices) = select_over_bucket(selector, [tf.constant(a), tf.zeros(4)], 3)
    assert sorted(indices.numpy().tolist()) == [1, 3, 4] and np.all(np.isfinite(values.numpy()))
    assert zero_values.shape[0] == 0 and zero_indices.shape[0] == 0
    chosen = select_over_bucket(selector, [tf.zeros(4), tf.constant(a)], 8)
    assert sum(int(tf.size(i)) for _, i in chosen) == 8
    sent = [(v.numpy(), i.numpy()) for v, i in chosen]
    assert sorted(sent[1][1][sent[1][0] != 0].tolist()) == [1, 3, 4]
    assert all(np.all(i[v == 0] == 0) for v, i in sent)  # every spare slot: value 0 at index 0


@pytest.mark.parametrize("options, message", [
    (dict(), "needs exchange_mode='allgather'"),
    (dict(exchange_mode="allreduce"), "needs exchange_mode='allgather'"),
    (dict(exchange_mode="allgather", sparse_output=True), "cannot go with sparse_output=True"),
    (dict(exchange_mode="allgather", density="adaptive"), "cannot go with an adaptive density"),
])
def test_what_one_selection_over_the_bucket_cannot_go_with_is_named(options, message):
    with pytest.raises(ValueError, match=message):
        tf_topk.ExchangeConfig(selection_scope="bucket", **options)


def test_a_bad_selection_scope_is_named():
    with pytest.raises(ValueError, match=r"selection_scope must be one of \('variable', 'bucket'\), got 'layer'"):
        tf_topk.TopKOptimizer(keras.optimizers.SGD(0.1), selection_scope="layer")


class AgreedIndicesEverywhere(Router):
    """Agreed indices even on one replica (FixedRouter gathers there)."""

    def route(self, bucket, replicas):
        return AgreedIndexRoute()


def test_a_router_of_agreed_indices_is_refused_with_it():
    exchange = tf_topk.SparseExchange([tf.Variable(tf.zeros(5000))], density=0.01, min_size=16,
                                      exchange_mode="allgather", selection_scope="bucket",
                                      router=AgreedIndicesEverywhere(), density_warmup_steps=0)
    with pytest.raises(ValueError, match="selection_scope='bucket' cannot take the route AgreedIndexRoute"):
        exchange([tf.ones(5000)])


@pytest.mark.slow
def test_the_keras_recipe_trains_with_momentum_correction_and_a_warmup():
    """The documented line: momentum SGD, DGC's warm-up, one selection over the
    bucket; with momentum correction too. It learns, every step sends the
    bucket's k in all, and the option reads back and round-trips."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    y = (x[:, :8].sum(axis=1) > 0).astype(np.int64)
    for correction in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])
        optimizer = tf_topk.TopKOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), density=tf_topk.schedule.dgc_warmup(8, epochs=2, final=0.01),
            min_size=1000, exchange_mode="allgather", selection_scope="bucket", momentum_correction=correction)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        history = model.fit(x, y, batch_size=32, epochs=6, verbose=0)
        assert history.history["loss"][-1] < 0.8 * history.history["loss"][0], (correction, history.history)
        assert optimizer.selection_scope == "bucket"
        stats = optimizer.compression_stats()
        assert stats["selected"] == pytest.approx(41 + 41, abs=0.5)  # ceil(0.01 * 4096) for each of the two kernels
        config = optimizer.get_config()
        assert config["selection_scope"] == "bucket"
        assert type(optimizer).from_config(config).exchange_config == optimizer.exchange_config


@pytest.mark.slow
def test_adams_momentum_correction_takes_its_dense_steps_then_the_shares():
    """Adam's momentum correction under all_gather: dense steps first (every entry through the gather),
    then each variable's share of the bucket's k; it learns and sends the bucket's k in all."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    y = (x[:, :8].sum(axis=1) > 0).astype(np.int64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.003), density=0.05, min_size=1000,
                                      exchange_mode="allgather", selection_scope="bucket",
                                      momentum_correction=True, variance_warmup_steps=8)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=32, epochs=6, verbose=0)
    assert history.history["loss"][-1] < 0.8 * history.history["loss"][0], history.history
    assert optimizer.compression_stats()["selected"] == pytest.approx(205 + 205, abs=0.5)  # ceil(0.05 * 4096) each
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
