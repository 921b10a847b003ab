"""Decoupled momentum (DeMo) for Adam and AdamW: the transform, the update against a numpy reference on
2 and 3 replicas, when "auto" chooses it, what it refuses, and what it does with a non-finite step.

One process, logical CPUs (MirroredStrategy): each replica gets its own gradients, applied through
`TopKOptimizer(AdamW, ...)`; the reference keeps each replica's momentum in the DCT's space, takes its
exact top-k, and applies the sign of the decoded sum at twice the learning rate (the default
`decoupled_step_scale`) after AdamW's decay; one of the
variables is an embedding table (named `embeddings`), whose DCT runs along each row.
"""

import functools
import json
import math
import re

import keras
import numpy as np
import pytest
import scipy.fft
import tensorflow as tf
import tf_keras

from logical_cpus import mirrored_on_cpus, split_cpu

split_cpu(3)  # before TensorFlow starts

import tf_topk
import tf_topk.tf_keras
from tf_topk.decoupled_momentum import (DEFAULT_DECAY, BlockDCT, DecoupledMomentumMemory, block_sides,
                                        is_embedding_table)

LR, WEIGHT_DECAY, DENSITY, MIN_SIZE, STEPS = 0.01, 0.1, 1 / 128, 1000, 4
STEP_SCALE = 2.0  # the sign step in learning rates: ExchangeConfig.decoupled_step_scale's default
# (shape, sparsified): 2048 and 2304 entries (k = 16 and 18 exactly; blocks 64x32 and 48x48), a bias, and
# an embedding table of 2304 entries (k = 18) named as Keras names one, so its blocks are 1x24.
SHAPES = [((64, 32), True), ((6, 8, 48), True), ((8,), False), ((96, 24), True)]
BIAS, TABLE = 2, 3
SPARSIFIED = [v for v, (_, sparse) in enumerate(SHAPES) if sparse]  # the exchange's slots, in order
NAN_STEP = 2  # one replica's gradient holds a NaN: the step is skipped on every replica


def reference_sides(dimension, chunk=64):
    """ceil(dimension / chunk) block sides, as equal as can be, the larger first."""
    count = -(-dimension // chunk)
    side, larger = divmod(dimension, count)
    return [side + 1] * larger + [side] * (count - larger)


def reference_blocks(shape, rows_apart=False, chunk=64):
    """Each DCT block, in the order of its coefficients, as the flat positions of its entries ([a, b]):
    the variable as a matrix (a 1-D one as rows of `chunk`, the rest a row of its own), each axis cut by
    `reference_sides`, the blocks of one pair of sides (a region) one after another, row-major."""
    size = int(np.prod(shape))
    if len(shape) >= 2:
        views = [(size // shape[-1], shape[-1])]
    elif size > chunk:
        views = [(size // chunk, chunk)] + ([(1, size % chunk)] if size % chunk else [])
    else:
        views = [(1, size)]
    blocks, offset = [], 0
    for rows, columns in views:
        positions = np.arange(offset, offset + rows * columns).reshape(rows, columns)
        offset += rows * columns
        row_runs = runs([1] * rows if rows_apart else reference_sides(rows, chunk))
        for row_run in row_runs:
            for column_run in runs(reference_sides(columns, chunk)):
                blocks += [positions[r:r + a, c:c + b] for r, a in row_run for c, b in column_run]
    return blocks


def runs(sides):
    """Sides grouped into runs of one side, each as (start, side) pairs."""
    grouped, start = [], 0
    for side in sides:
        if not grouped or grouped[-1][0][1] != side:
            grouped.append([])
        grouped[-1].append((start, side))
        start += side
    return grouped


def reference_dct(flat, shape, rows_apart=False):
    """The blockwise orthonormal 2-D DCT-II by scipy, in BlockDCT's layout (each block contiguous)."""
    return np.concatenate([scipy.fft.dctn(flat[block], norm="ortho").reshape(-1)
                           for block in reference_blocks(shape, rows_apart)])


def reference_touched(flat, shape, rows_apart=False):
    """Per entry, in the variable's layout: whether its DCT block holds a nonzero coefficient."""
    touched, start = np.zeros(flat.size, bool), 0
    for block in reference_blocks(shape, rows_apart):
        touched[block] = np.any(flat[start:start + block.size] != 0)
        start += block.size
    return touched


def reference_idct(flat, shape, rows_apart=False):
    out, start = np.zeros(flat.size), 0
    for block in reference_blocks(shape, rows_apart):
        out[block] = scipy.fft.idctn(flat[start:start + block.size].reshape(block.shape), norm="ortho")
        start += block.size
    return out


@pytest.mark.parametrize("shape", [(64, 32), (6, 8, 48), (4096,), (4099,), (100,), (7, 11), (130, 96), (97, 97),
                                   (3, 5, 97), (128, 100)])
def test_the_block_dct_is_scipys_orthonormal_dct_per_block_and_inverts(shape):
    x = np.random.default_rng(0).standard_normal(int(np.prod(shape))).astype(np.float32)
    transform = BlockDCT(shape)
    coefficients = transform.forward(tf.constant(x)).numpy()
    np.testing.assert_allclose(coefficients, reference_dct(x.astype(np.float64), shape), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(transform.inverse(tf.constant(coefficients)).numpy(), x, rtol=1e-4, atol=1e-5)
    # Orthonormal: the energy is kept.
    assert math.isclose(float(np.sum(coefficients ** 2)), float(np.sum(x ** 2)), rel_tol=1e-4)


def test_an_embedding_tables_blocks_are_one_row_high_and_invert():
    x = np.random.default_rng(1).standard_normal(256 * 128).astype(np.float32)
    transform = BlockDCT((256, 128), rows_apart=True)
    assert (transform.row_side, transform.column_side) == (1, 64)
    coefficients = transform.forward(tf.constant(x)).numpy()
    rows = x.astype(np.float64).reshape(256, 2, 64)  # each row's two blocks of 64, in order
    np.testing.assert_allclose(coefficients, scipy.fft.dct(rows, axis=2, norm="ortho").reshape(-1), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(transform.inverse(tf.constant(coefficients)).numpy(), x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variable, table", [
    (keras.layers.Embedding(16, 8, name="tokens"), True),
    (tf.Variable(tf.zeros([16, 8]), name="model/embedding/embeddings"), True),
    (keras.layers.Dense(8, name="embeddings_head"), False),
    (tf.Variable(tf.zeros([16, 8]), name="kernel"), False),
])
def test_embedding_tables_are_found_by_keras_name(variable, table):
    if isinstance(variable, keras.layers.Layer):
        variable.build((None,) if isinstance(variable, keras.layers.Embedding) else (None, 4))
        variable = variable.weights[0]
    assert is_embedding_table(variable) is table


def untouched_rows_move(embedding_rows_apart):
    """One DeMo step on a 64x64 embedding table whose gradient is zero outside rows 0-31 (tokens no
    batch held): the largest move of rows 32-63, and of rows 0-31."""
    model = keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(64, 64)])
    table = model.layers[0].embeddings
    memory = DecoupledMomentumMemory(embedding_rows_apart=embedding_rows_apart)
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.0), density=1 / 64,
                                      density_warmup_steps=0, min_size=1, memory=memory)
    gradient = np.zeros([64, 64], np.float32)
    gradient[:32] = np.random.default_rng(2).standard_normal([32, 64])
    before = table.numpy()
    optimizer.apply_gradients([(tf.constant(gradient), table)])
    move = np.abs(table.numpy() - before)
    return move[32:].max(), move[:32].max()


def test_rows_no_batch_touched_stay_where_they_are():
    """Rows apart, a row whose token was in no batch does not move (as under dense AdamW); in 2-D
    blocks it moves by the full step, the sign of its neighbours' momentum."""
    untouched, touched = untouched_rows_move(embedding_rows_apart=True)
    assert untouched == 0.0 and touched == pytest.approx(STEP_SCALE * 0.01, rel=1e-4)
    untouched, touched = untouched_rows_move(embedding_rows_apart=False)
    assert untouched == pytest.approx(STEP_SCALE * 0.01, rel=1e-4)


def test_block_sides_are_as_equal_as_can_be_and_at_most_the_chunk():
    assert [block_sides(n, 64) for n in (128, 48, 96, 7, 1, 130, 97, 4099)] == [
        [(64, 2)], [(48, 1)], [(48, 2)], [(7, 1)], [(1, 1)], [(44, 1), (43, 2)], [(49, 1), (48, 1)],
        [(64, 4), (63, 61)]]


class Reference:
    """DeMo on numpy: per replica, m <- decay * m + DCT(g), send the exact top-k of |m|, keep the rest;
    sparsified variables move by STEP_SCALE * lr * sign(IDCT(sum sent)) after AdamW's decay; the bias by
    AdamW. The
    embedding table's DCT runs along each row only (`rows_apart`, the default). `ties[v]`: the entries of
    the last step whose decoded sum is zero in exact arithmetic but not in float (a single coefficient's
    cosine at a node, common in a row with one coefficient): their sign is rounding's, either move holds."""

    def __init__(self, start, replicas, rows_apart=True):
        self.weights = [w.astype(np.float64).copy() for w in start]
        self.momenta = [[np.zeros(start[v].size) for v in SPARSIFIED] for _ in range(replicas)]
        self.rows_apart = {v: rows_apart and v == TABLE for v in SPARSIFIED}
        self.adam_m, self.adam_v, self.t = np.zeros(SHAPES[BIAS][0]), np.zeros(SHAPES[BIAS][0]), 0
        self.ties = {}

    def step(self, grads):
        """grads[replica][variable]; a non-finite gradient anywhere skips the step."""
        self.ties = {}
        if not all(np.isfinite(g).all() for replica in grads for g in replica):
            return
        sums = []
        for slot, v in enumerate(SPARSIFIED):
            shape = SHAPES[v][0]
            total = np.zeros(int(np.prod(shape)))
            for replica, replica_grads in enumerate(grads):
                accumulated = DEFAULT_DECAY * self.momenta[replica][slot] + \
                    reference_dct(replica_grads[v].astype(np.float64).reshape(-1), shape, self.rows_apart[v])
                k = round(DENSITY * accumulated.size)
                top = np.argsort(-np.abs(accumulated))[:k]
                sent = np.zeros_like(accumulated)
                sent[top] = accumulated[top]
                total += sent
                self.momenta[replica][slot] = accumulated - sent
            sums.append(total)
        for w in self.weights:  # AdamW's decoupled decay, before the update
            w -= LR * WEIGHT_DECAY * w
        for slot, v in enumerate(SPARSIFIED):
            shape = SHAPES[v][0]
            decoded = reference_idct(sums[slot], shape, self.rows_apart[v])
            self.ties[v] = (reference_touched(sums[slot], shape, self.rows_apart[v])
                            & (np.abs(decoded) < 1e-5 * np.abs(decoded).max())).reshape(shape)
            self.weights[v] -= STEP_SCALE * LR * np.sign(decoded).reshape(shape)
        g = sum(replica[BIAS].astype(np.float64) for replica in grads)
        self.t += 1
        self.adam_m += (g - self.adam_m) * 0.1
        self.adam_v += (g * g - self.adam_v) * 0.001
        alpha = LR * math.sqrt(1 - 0.999 ** self.t) / (1 - 0.9 ** self.t)
        self.weights[BIAS] -= alpha * self.adam_m / (np.sqrt(self.adam_v) + 1e-7)


def gradients(replicas):
    rng = np.random.default_rng(5)
    grads = [[[rng.standard_normal(shape).astype(np.float32) for shape, _ in SHAPES] for _ in range(replicas)]
             for _ in range(STEPS)]
    grads[NAN_STEP][replicas - 1][0][3, 3] = np.nan
    return grads


@functools.lru_cache(maxsize=None)
def strategy_of(replicas):
    """One strategy per replica count in this process, with collective keys of this module's own (two of one
    size would share them, as would another module's)."""
    return mirrored_on_cpus(replicas, 9_000_000 + 100_000 * replicas)


def run_replicas(replicas, exchange_mode, api="keras"):
    """(variables after each step as numpy, per-replica momenta after the last step, the optimizer),
    through the Keras 3 wrapper or tf_keras's."""
    strategy = strategy_of(replicas)
    rng = np.random.default_rng(1)
    start = [rng.standard_normal(shape).astype(np.float32) for shape, _ in SHAPES]
    options = dict(density=DENSITY, method="exact", min_size=MIN_SIZE, density_warmup_steps=0,
                   exchange_mode=exchange_mode)
    with strategy.scope():
        names = ["embeddings" if v == TABLE else f"weights_{v}" for v in range(len(SHAPES))]
        if api == "keras":
            variables = [keras.Variable(w, name=name) for w, name in zip(start, names)]
            optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(LR, weight_decay=WEIGHT_DECAY), **options)
            apply = lambda grads: optimizer.apply(grads, variables)  # noqa: E731
        else:
            variables = [tf.Variable(w, name=name) for w, name in zip(start, names)]
            optimizer = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.AdamW(LR, weight_decay=WEIGHT_DECAY),
                                                       **options)
            apply = lambda grads: optimizer.apply_gradients(zip(grads, variables))  # noqa: E731

    @tf.function
    def step(stacked):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            apply([tf.gather(g, replica) for g in stacked])

        strategy.run(replica_fn)

    history = []
    for step_grads in gradients(replicas):
        step([tf.constant(np.stack([step_grads[r][v] for r in range(replicas)])) for v in range(len(SHAPES))])
        history.append([np.asarray(v.numpy()) for v in variables])
    momenta = [[m.numpy() for m in strategy.experimental_local_results(residual)]
               for residual in optimizer.exchange.memory.residuals]
    return start, history, momenta, optimizer


@pytest.mark.parametrize("replicas,api", [(2, "keras"), (3, "keras"), (2, "tf_keras")])
def test_replicas_match_numpy_demo_through_a_skipped_step(replicas, api):
    start, history, momenta, optimizer = run_replicas(replicas, "allgather", api)
    assert optimizer.decoupled_momentum is True  # chosen by "auto": AdamW at 1/128
    assert isinstance(optimizer.exchange.memory, DecoupledMomentumMemory)
    assert [t.row_side for t in optimizer.exchange.memory.transforms] == [64, 48, 1]  # the table's rows apart
    two_d = Reference(start, replicas, rows_apart=False)  # what 2-D blocks would have done to the table
    two_d.step(gradients(replicas)[0])
    assert not np.allclose(history[0][TABLE], two_d.weights[TABLE], atol=1e-3)
    reference = Reference(start, replicas)
    for s, (step_grads, weights) in enumerate(zip(gradients(replicas), history)):
        reference.step(step_grads)
        for v, (ours, theirs) in enumerate(zip(weights, reference.weights)):
            ties = reference.ties.get(v, np.zeros(ours.shape, bool))
            assert ties.mean() < 0.01, f"step {s}, variable {v}: {ties.sum()} ties"
            np.testing.assert_allclose(ours[~ties], theirs[~ties], rtol=1e-5, atol=1e-5,
                                       err_msg=f"step {s}, variable {v}")
            theirs[ties] = ours[ties]
    for slot in range(len(SPARSIFIED)):  # each replica keeps its own momentum
        for replica in range(replicas):
            np.testing.assert_allclose(momenta[slot][replica].reshape(-1), reference.momenta[replica][slot],
                                       rtol=1e-4, atol=1e-5)
        assert not np.allclose(momenta[slot][0], momenta[slot][1])
    for skipped, before in zip(history[NAN_STEP], history[NAN_STEP - 1]):  # skipped: nothing moved
        np.testing.assert_array_equal(skipped, before)
    assert int(optimizer.skipped_steps.numpy()) == 1


def test_agreed_indices_move_every_sparsified_entry_by_the_sign_step():
    """With agreed indices each replica sends its own values at the leader's: whatever was chosen, every
    entry of a 2-D-blocked variable moves by exactly the sign step (STEP_SCALE * lr) beyond the decay; in
    the embedding table, whole rows move by it, at most k of them, and the others keep their place
    (decay aside)."""
    start, history, _, optimizer = run_replicas(2, "allreduce")
    k_table = round(DENSITY * np.prod(SHAPES[TABLE][0]))
    before = start
    for s, weights in enumerate(history):
        if s == NAN_STEP:
            np.testing.assert_array_equal(weights[0], before[0])
            continue
        moves = {v: np.abs(weights[v] - before[v] * (1 - LR * WEIGHT_DECAY)) for v in SPARSIFIED}
        for v in SPARSIFIED[:2]:
            np.testing.assert_allclose(moves[v], STEP_SCALE * LR, rtol=1e-3)
        moved = moves[TABLE].max(axis=1) > LR / 2
        np.testing.assert_allclose(moves[TABLE][moved], STEP_SCALE * LR, rtol=1e-3)
        np.testing.assert_allclose(moves[TABLE][~moved], 0, atol=1e-6)
        assert 1 <= moved.sum() <= k_table
        before = weights
    assert optimizer.compression_stats()["exchange_mode"] == 2.0  # agreed indices


def digits_model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    return model


def digits_data(samples=None):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32)[:samples], y[:samples]


def fit_digits(optimizer):
    x, y = digits_data()
    return digits_model(optimizer).fit(x, y, batch_size=32, epochs=3, verbose=0).history


def test_a_saved_model_resumes_exactly_where_it_stopped(tmp_path):
    """Two epochs in one go, or one epoch, `model.save`, `load_model`, one more: the same weights and
    momenta (every replica's own state is saved with the optimizer)."""
    x, y = digits_data(320)

    def optimizer():
        return tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.003), density=0.01, density_warmup_steps=0)

    straight = digits_model(optimizer())
    straight.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    first = digits_model(optimizer())
    first.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    first.save(tmp_path / "half.keras")
    resumed = keras.models.load_model(tmp_path / "half.keras")
    assert resumed.optimizer.decoupled_momentum is True
    np.testing.assert_array_equal(resumed.optimizer.residuals[0].numpy(), first.optimizer.residuals[0].numpy())
    resumed.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for ours, theirs in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(resumed.optimizer.residuals[0].numpy(), straight.optimizer.residuals[0].numpy(),
                               rtol=1e-5, atol=1e-7)


def test_auto_on_adamw_at_a_low_fixed_density_trains_and_says_so(capsys):
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.003), density=0.01)
    history = fit_digits(optimizer)
    assert history["accuracy"][-1] > 0.85 and history["loss"][-1] < history["loss"][0]
    assert isinstance(optimizer.exchange.memory, DecoupledMomentumMemory)
    assert "tf_topk: decoupled momentum (DeMo)" in capsys.readouterr().err


@pytest.mark.parametrize("inner,options,expected", [
    (lambda: keras.optimizers.AdamW(1e-3), dict(density=0.01), True),
    (lambda: keras.optimizers.Adam(1e-3), dict(density=0.001), True),
    (lambda: keras.optimizers.Adam(1e-3), dict(density=0.001, density_warmup_steps=0), True),
    (lambda: keras.optimizers.Adam(1e-3), dict(density=0.05), False),  # above DECOUPLED_UP_TO_DENSITY
    (lambda: keras.optimizers.Adam(1e-3), dict(), "auto"),  # the autopilot's plan decides when built
    (lambda: keras.optimizers.Adam(1e-3), dict(density="adaptive"), False),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), dict(density=0.01), False),
    (lambda: keras.optimizers.Adam(1e-3, amsgrad=True), dict(density=0.01), False),
    (lambda: keras.optimizers.Adam(1e-3, clipnorm=1.0), dict(density=0.01), True),  # Keras clips before it
    (lambda: keras.optimizers.AdamW(1e-3, global_clipnorm=1.0, use_ema=True, gradient_accumulation_steps=2,
                                    loss_scale_factor=8.0), dict(density=0.01), True),
    (lambda: keras.optimizers.AdamW(1e-3), dict(density=0.01, exchange_mode="dense_bf16"), False),  # AdamW's
    (lambda: keras.optimizers.SGD(0.1), dict(), False),
    (lambda: keras.optimizers.Adam(1e-3), dict(density=0.01, momentum_correction=True), False),
    (lambda: keras.optimizers.Adam(1e-3), dict(density=0.01, error_feedback=False), False),
    (lambda: keras.optimizers.Adam(1e-3), dict(density=0.01, decoupled_momentum=False), False),
    (lambda: keras.optimizers.Adam(1e-3), dict(density=0.05, decoupled_momentum=True), True),
])
def test_auto_chooses_decoupled_momentum_for_adam_at_a_low_fixed_density(inner, options, expected):
    assert tf_topk.TopKOptimizer(inner(), **options).decoupled_momentum is expected


def test_parts_given_keep_their_method():
    from tf_topk.selector import RandomKSelector

    optimizer = tf_topk.TopKOptimizer(keras.optimizers.Adam(), density=0.01, selector=RandomKSelector())
    assert optimizer.decoupled_momentum is False


@pytest.mark.parametrize("inner,options,message", [
    (lambda: keras.optimizers.SGD(0.1), dict(density=0.01), "needs a keras.optimizers.Adam or AdamW"),
    (lambda: keras.optimizers.Adam(amsgrad=True), dict(density=0.01), "amsgrad=False"),
    (lambda: keras.optimizers.Adam(), dict(density=0.01, exchange_mode="dense_bf16"), "16-bit baseline"),
    (lambda: keras.optimizers.Adam(), dict(density=0.01, momentum_correction=True), "momentum correction"),
    (lambda: keras.optimizers.Adam(), dict(density="adaptive"), "not an adaptive density"),
    (lambda: keras.optimizers.Adam(), dict(density=0.01, error_feedback=False), "error_feedback=True"),
    (lambda: keras.optimizers.Adam(), dict(density=0.01, memory=tf_topk.memory.ErrorFeedbackMemory()),
     "pass one or the other"),
])
def test_decoupled_momentum_refuses_what_it_cannot_honour_by_name(inner, options, message):
    with pytest.raises(ValueError, match=message):
        tf_topk.TopKOptimizer(inner(), decoupled_momentum=True, **options)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="decoupled_momentum must be 'auto', True or False, got 'yes'"):
        tf_topk.ExchangeConfig(decoupled_momentum="yes")
    with pytest.raises(ValueError, match="chunk must be an int >= 1, got 0"):
        DecoupledMomentumMemory(chunk=0)
    with pytest.raises(ValueError, match=r"momentum must be a float in \(0, 1\), got 1.5"):
        DecoupledMomentumMemory(decay=1.5)
    with pytest.raises(ValueError, match="embedding_rows_apart must be True or False, got 'yes'"):
        DecoupledMomentumMemory(embedding_rows_apart="yes")


def test_decoupled_momentum_without_a_density_takes_the_fixed_default():
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.Adam(), decoupled_momentum=True)
    assert optimizer.exchange_config.schedule.settled_density() == tf_topk.config.FIXED_DEFAULT_DENSITY


def test_an_exchange_alone_takes_auto_as_plain_error_feedback():
    variable = tf.Variable(tf.zeros([64, 64]))
    exchange = tf_topk.SparseExchange([variable], density=0.01, density_warmup_steps=0)
    assert type(exchange.memory) is tf_topk.memory.ErrorFeedbackMemory
    exchange = tf_topk.SparseExchange([variable], density=0.01, density_warmup_steps=0, decoupled_momentum=True)
    assert isinstance(exchange.memory, DecoupledMomentumMemory) and exchange.memory.applies_update


def test_a_config_written_before_the_option_loads_as_the_method_it_ran():
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), density=0.01)
    written = optimizer.get_config()
    assert written["decoupled_momentum"] is True
    assert tf_topk.TopKOptimizer.from_config(written).decoupled_momentum is True
    del written["decoupled_momentum"]
    assert tf_topk.TopKOptimizer.from_config(written).decoupled_momentum is False


@pytest.mark.parametrize("scale", [None, 1.0, 3.0])
def test_the_sign_step_is_decoupled_step_scale_learning_rates_and_is_saved(scale):
    """Each sparsified entry moves by decoupled_step_scale times the rate (2.0 unless given), and the
    chief's line says so; the scale is saved with the config, and a config written before it existed loads with DeMo's 1.0, the
    step it ran."""
    given = {} if scale is None else {"decoupled_step_scale": scale}
    config = tf_topk.ExchangeConfig(density=0.01, density_warmup_steps=0, min_size=1, **given)
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.0), config=config)
    variable = keras.Variable(np.zeros((64, 64), np.float32), name="kernel")
    optimizer.apply([tf.constant(np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32))],
                    [variable])
    moved = np.abs(variable.numpy())
    expected = STEP_SCALE if scale is None else scale
    np.testing.assert_allclose(moved[moved != 0], expected * 0.01, rtol=1e-5)
    assert f"applied at {expected:g}x the learning rate" in optimizer.exchange.memory.describe()  # the chief's line
    written = optimizer.get_config()
    assert tf_topk.TopKOptimizer.from_config(written).exchange_config.decoupled_step_scale == expected
    del written["decoupled_step_scale"]
    assert tf_topk.TopKOptimizer.from_config(written).exchange_config.decoupled_step_scale == 1.0


def test_a_subclass_that_hands_the_decoded_sum_to_the_inner_optimizer_hands_it_unscaled():
    """The step is the memory's own only where it applies the update (`applies_update`): a subclass whose
    decoded sum becomes the inner optimizer's gradient gets it as decoded, whatever step_scale says."""

    class ThroughInner(DecoupledMomentumMemory):
        applies_update = False

    summed = tf.constant(np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32))
    directions = {}
    for memory in (DecoupledMomentumMemory(step_scale=3.0, sign=False), ThroughInner(step_scale=3.0, sign=False)):
        memory.build([keras.Variable(np.zeros((64, 64), np.float32), name="kernel")],
                     tf_topk.memory.make_state_variable)
        directions[type(memory).__name__] = memory.apply_sparse(0, summed, tf.constant(True)).numpy()
    np.testing.assert_allclose(directions["DecoupledMomentumMemory"], 3.0 * directions["ThroughInner"], rtol=1e-6)
    decoded = BlockDCT((64, 64)).inverse(tf.reshape(summed, [-1])).numpy().reshape(64, 64)
    np.testing.assert_allclose(directions["ThroughInner"], decoded, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_a_bad_step_scale_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=re.escape(f"decoupled_step_scale must be a finite number > 0, got {bad!r}")):
        tf_topk.ExchangeConfig(density=0.01, decoupled_step_scale=bad)
    with pytest.raises(ValueError, match=re.escape(f"step_scale must be a finite number > 0, got {bad!r}")):
        DecoupledMomentumMemory(step_scale=bad)


@pytest.mark.parametrize("shape", [(97, 97), (96, 97), (128, 100), (4099,), (1000, 97), (50257, 4), (4, 50257),
                                   (3, 3, 64, 97), (64, 64), (4096,)])
def test_every_entry_of_any_shape_moves_each_step(shape):
    """A prime dimension, a 1-D variable or a narrow matrix still gets blocks of about 64 entries a side,
    so one step at density 0.01 gives at least 90% of the entries a direction (a prime 97 had blocks one
    entry wide: 1%). An embedding table, whose rows stay apart, is the exception the docs state: its rows
    move only where a coefficient of their own was sent (`test_rows_no_batch_touched_stay_where_they_are`)."""
    variable = keras.Variable(np.zeros(shape, np.float32), name="kernel")
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.0), density=0.01,
                                      density_warmup_steps=0, min_size=1)
    gradient = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    optimizer.apply([tf.constant(gradient)], [variable])
    moved = np.abs(variable.numpy())
    assert np.mean(moved != 0) >= 0.9
    np.testing.assert_allclose(moved[moved != 0], STEP_SCALE * 0.01, rtol=1e-5)  # the sign step



@pytest.mark.parametrize("shape", [(50257, 4), (1000, 97), (64, 64)])
def test_an_embedding_tables_entries_move_each_step_in_2d_blocks(shape):
    """The coverage an embedding table gets with `embedding_rows_apart=False` (DeMo's 2-D blocks): at least
    90% of its entries a step at 0.01, as a kernel's; rows apart, the default, measured more accurate and
    moves only the rows a coefficient of their own was sent for (benchmarks/dct_coverage.py)."""
    table = keras.Variable(np.zeros(shape, np.float32), name="embeddings")
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.0), density=0.01,
                                      density_warmup_steps=0, min_size=1,
                                      memory=DecoupledMomentumMemory(embedding_rows_apart=False))
    optimizer.apply([tf.constant(np.random.default_rng(0).standard_normal(shape).astype(np.float32))], [table])
    assert np.mean(table.numpy() != 0) >= 0.9

def small_model_variables():
    return [keras.Variable(np.zeros((64, 128), np.float32), name="kernel"),
            keras.Variable(np.zeros(10, np.float32), name="bias")]


def trained(optimizer, variables, steps=2):
    for step in range(steps):
        optimizer.apply([tf.random.stateless_normal((64, 128), [step, 0]), tf.ones(10)], variables)
    return optimizer


@pytest.mark.parametrize("built_by", ["apply", "build"])
def test_the_inner_adamw_keeps_no_moments_of_what_decoupled_momentum_updates(built_by):
    """Decoupled momentum keeps one buffer a sparsified entry (its momentum); the inner AdamW's two
    moments of those variables were two more that nothing read. The bias keeps AdamW's."""
    variables = small_model_variables()
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), density=0.01, density_warmup_steps=0)
    if built_by == "build":
        optimizer.build(variables)
    trained(optimizer, variables)
    paths = [v.path for v in optimizer.inner_optimizer.variables]
    assert not any("kernel_" in path for path in paths) and any("bias_momentum" in path for path in paths)
    floats = sum(int(np.prod(v.shape)) for v in optimizer.variables if v.dtype in ("float32", "float64"))
    assert floats / (64 * 128 + 10) < 1.01  # the momentum, the bias's two moments, a few scalars
    plain = trained(tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), density=0.01, density_warmup_steps=0,
                                          decoupled_momentum=False), small_model_variables())
    assert sum(int(np.prod(v.shape)) for v in plain.variables if v.dtype == "float32") / (64 * 128 + 10) > 2.99


def test_tf_keras_inner_adamw_keeps_no_moments_of_what_decoupled_momentum_updates():
    variables = [tf.Variable(tf.zeros((64, 128)), name="kernel"), tf.Variable(tf.zeros(10), name="bias")]
    optimizer = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.AdamW(1e-3), density=0.01, density_warmup_steps=0)
    optimizer.apply_gradients(zip([tf.ones((64, 128)), tf.ones(10)], variables))
    assert optimizer.decoupled_momentum is True
    assert sorted(tuple(v.shape) for v in optimizer.inner_optimizer.variables if v.shape.rank) == [(10,), (10,)]


def test_a_file_written_before_the_moments_were_left_out_loads():
    """Files of earlier versions held the inner AdamW's moments of every variable and no exchange_method:
    they load, the moments of the sparsified variables passed over."""
    source = trained(tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), density=0.01, density_warmup_steps=0),
                     small_model_variables(), steps=3)
    saved = {}
    source.save_own_variables(saved)
    arrays = [saved[str(i)] for i in range(len(saved))]
    paths = [v.path for v in source.variables]
    method = paths.index(source.exchange_method.path)
    first_slot = next(i for i, path in enumerate(paths) if path.endswith("bias_momentum"))
    earlier = arrays[:method] + arrays[method + 1:first_slot] + [np.full((64, 128), 7.0, np.float32)] * 2 + \
        arrays[first_slot:]
    target = tf_topk.TopKOptimizer(keras.optimizers.AdamW(1e-3), density=0.01, density_warmup_steps=0)
    target.build(small_model_variables())
    target.load_own_variables({str(i): a for i, a in enumerate(earlier)})
    for ours, theirs in zip(target.variables, source.variables):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=ours.path)


def test_a_checkpoint_of_another_method_is_refused_naming_both(tmp_path):
    """A residual of gradients (top-k in front of AdamW) is not a momentum in a DCT's space: a file or a
    tf.train.Checkpoint of one method does not go on under the other; of the same method, it does.
    A tf.train.Checkpoint matches variables by position: where the inner AdamW holds moments of other
    variables (built by the wrapper, which leaves out those decoupled momentum never reads), TensorFlow's
    restore itself fails on their shapes; where they line up (an AdamW built before it was wrapped), the
    first step refuses, naming both methods."""
    def optimizer(decoupled, inner_built_first=False):
        inner = keras.optimizers.AdamW(1e-3)
        variables = small_model_variables()
        if inner_built_first:
            inner.build(variables)
        wrapper = tf_topk.TopKOptimizer(inner, density=0.01, density_warmup_steps=0, decoupled_momentum=decoupled)
        wrapper.build(variables)
        return wrapper, variables

    plain = trained(*optimizer(False))
    saved = {}
    plain.save_own_variables(saved)
    with pytest.raises(ValueError, match="written with error feedback, and this optimizer runs decoupled momentum"):
        optimizer(True)[0].load_own_variables(saved)
    prefix = tf.train.Checkpoint(optimizer=plain).save(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="incompatible"):
        tf.train.Checkpoint(optimizer=optimizer(True)[0]).restore(prefix)
    lined_up = tf.train.Checkpoint(optimizer=trained(*optimizer(False, inner_built_first=True))).save(
        str(tmp_path / "lined_up"))
    target, variables = optimizer(True, inner_built_first=True)
    tf.train.Checkpoint(optimizer=target).restore(lined_up).assert_existing_objects_matched()
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="written with error feedback, and this optimizer runs decoupled momentum"):
        trained(target, variables, steps=1)
    decoupled = trained(*optimizer(True))
    same, variables = optimizer(True)
    tf.train.Checkpoint(optimizer=same).restore(
        tf.train.Checkpoint(optimizer=decoupled).save(str(tmp_path / "decoupled"))).assert_existing_objects_matched()
    np.testing.assert_array_equal(same.residuals[0].numpy(), decoupled.residuals[0].numpy())
    trained(same, variables, steps=1)
    assert int(same.iterations.numpy()) == 3


def test_the_coverage_benchmark_reports_each_shapes_share(capsys):
    """benchmarks/dct_coverage.py (RESULTS' figures): a prime-sided kernel moves whole, its embedding
    table as far as its rows' own coefficients reach."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    import dct_coverage

    assert dct_coverage.main(["--shapes", "97x97,4099", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [row["shape"] for row in rows] == ["97x97", "4099"] and "embedding_table" not in rows[1]
    assert rows[0]["kernel"] == 1.0 and 0.3 < rows[0]["embedding_table"] < 0.5 and rows[1]["kernel"] > 0.99
    with pytest.raises(SystemExit):
        dct_coverage.main(["--shapes", "97x0"])
