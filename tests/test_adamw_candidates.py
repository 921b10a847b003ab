"""benchmarks/adamw_candidates.py, which RESULTS' AdamW trials come from: its chunk-wise selection and
quantization, its byte count, its paired summary, and one tiny run of a variant on the text task."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import scipy.fft
import pytest
import tensorflow as tf

from multiworker import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "adamw_candidates.py"
_spec = importlib.util.spec_from_file_location("adamw_candidates", SCRIPT)
candidates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(candidates)


def test_chunk_selection_takes_k_over_chunks_from_each_chunk():
    x = tf.constant([0.1, -3.0, 0.2, 1.0, 5.0, 0.0, -0.5, 0.3, 0.7, 0.01])  # chunks of 4: 3 chunks
    values, indices = candidates.QuantizedChunkSelector(4).select(x, 6)  # 2 a chunk
    assert sorted(indices.numpy().tolist()) == [1, 3, 4, 6, 8, 9]
    np.testing.assert_allclose(values.numpy(), tf.gather(x, indices).numpy())
    values, indices = candidates.QuantizedChunkSelector(4).select(x, 2)  # fewer than the chunks: the largest winners
    assert sorted(indices.numpy().tolist()) == [1, 4]
    values, indices = candidates.QuantizedChunkSelector(4).select(x, 4)  # one a chunk, a spare slot
    assert sorted(indices.numpy().tolist()) == [0, 1, 4, 8]
    np.testing.assert_allclose(sorted(values.numpy().tolist()), [-3.0, 0.0, 0.7, 5.0])


def test_two_bit_values_are_a_third_or_all_of_the_chunks_largest():
    x = tf.constant([4.0, -1.0, 2.9, 0.5, -3.0, 0.2, 0.1, 0.05])  # one chunk of 8, all taken
    values, indices = candidates.QuantizedChunkSelector(8, value_bits=2).select(x, 8)
    by_index = dict(zip(indices.numpy().tolist(), values.numpy().tolist()))
    assert by_index[0] == pytest.approx(4.0) and by_index[4] == pytest.approx(-4.0)
    assert by_index[1] == pytest.approx(-4.0 / 3) and by_index[3] == pytest.approx(4.0 / 3)
    assert by_index[2] == pytest.approx(4.0)  # 2.9 is nearer 4 than 4/3: the upper half of the range
    with pytest.raises(ValueError, match="value_bits must be None, 2, 4 or 8, got 3"):
        candidates.QuantizedChunkSelector(8, value_bits=3)


def test_pair_bytes_count_the_index_within_the_chunk_and_the_scale():
    assert candidates.pair_bytes(8, 4096) == (2.5, 2.0)
    assert candidates.pair_bytes(2, 4096) == (1.75, 2.0)
    assert candidates.pair_bytes(32, 4096) == (5.5, 0.0)


def test_summary_pairs_seeds_with_dense_and_gives_a_t_interval():
    lines = [json.dumps(dict(variant=v, density=0.01, seed=s, dataset="text", steps=800, final=f))
             for v, s, f in [("dense", 0, 1.50), ("dense", 1, 1.52), ("dense", 2, 1.48),
                             ("demo", 0, 1.51), ("demo", 1, 1.54), ("demo", 2, 1.51), ("demo", 3, 9.0)]]
    [row] = candidates.summarize(lines)
    dataset, steps, replicas, variant, density, seeds, dense, mean, low, high = row
    assert (dataset, steps, replicas, variant, seeds) == ("text", 800, 1, "demo", [0, 1, 2])  # seed 3: no pair
    assert dense == pytest.approx(1.50) and mean == pytest.approx(0.02)
    # differences 0.01, 0.02, 0.03: standard deviation 0.01, t(0.975, 2) = 4.303
    assert (low, high) == (pytest.approx(0.02 - 4.303 * 0.01 / 3 ** 0.5, abs=1e-4),
                           pytest.approx(0.02 + 4.303 * 0.01 / 3 ** 0.5, abs=1e-4))


def test_an_unknown_variant_is_named():
    with pytest.raises(SystemExit, match="unknown variant 'nope'"):
        candidates.make_builder("nope:decay=0.9", 0.01)


@pytest.mark.slow
@pytest.mark.parametrize("variant, density, seeds, command_line", [
    ("demoq:bits=8,qchunk=4096", "0.03", [0, 1], True), ("lion", "0.01", [0], False)])
def test_a_tiny_run_prints_one_line_per_seed(variant, density, seeds, command_line, capsys):
    """A compressed variant through the command line, two seeds, and the uncompressed sign baseline (no
    compression statistics to read) through `main` in this process."""
    argv = ["run", variant, density, ",".join(map(str, seeds)), "--",
            "--dataset", "text", "--steps", "20", "--eval-every", "10"]
    if command_line:
        proc = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        output = proc.stdout
    else:
        assert candidates.main(argv) == 0
        output = capsys.readouterr().out
    runs = [json.loads(line) for line in output.splitlines()]
    assert [(r["variant"], r["seed"], r["steps"], len(r["curve"])) for r in runs] == [
        (variant, seed, 20, 2) for seed in seeds]
    assert all(r["final"] < r["curve"][0] < 5.6 for r in runs)


def first_step(variant, gradient):
    """The move of a 64x64 variable by one step of `variant` at density 0.01 on `gradient`, with the
    text task's AdamW (rate 1e-3) and no weight decay, and the optimizer."""
    from tf_topk.bench import convergence

    import keras

    args = convergence.parse_args(["--dataset", "text", "--steps", "20", "--weight-decay", "0"])
    optimizer = candidates.make_builder(variant, 0.01)(keras, args)
    variable = tf.Variable(tf.ones([64, 64]))
    optimizer.apply_gradients([(tf.constant(gradient), variable)])
    return variable.numpy() - 1.0, optimizer


GRADIENT = np.random.default_rng(0).standard_normal([64, 64]).astype(np.float32)


def test_the_root_mean_square_step_moves_the_variable_by_the_rate_in_mean_square():
    move, _ = first_step("demo:rms=1", GRADIENT)
    assert np.sqrt(np.mean(move ** 2)) == pytest.approx(1e-3, rel=1e-3)
    assert len(np.unique(np.round(np.abs(move[move != 0]), 9))) > 2  # magnitudes, not only the sign's


def test_the_smoothed_sign_starts_at_a_tenth_of_the_signs_step():
    move, _ = first_step("demo:smooth=0.9", GRADIENT)
    assert np.count_nonzero(move) > 0
    np.testing.assert_allclose(np.abs(move[move != 0]), 1e-4, rtol=1e-3)


def test_the_decoded_sum_can_go_to_the_inner_adamw():
    move, optimizer = first_step("demo:inner=1", GRADIENT)
    moments = [v for v in optimizer.inner_optimizer.variables if "momentum" in v.name]
    assert moments and any(np.count_nonzero(v.numpy()) for v in moments)  # AdamW saw the decoded sum
    assert np.count_nonzero(move) > 0


def test_lion_is_the_dense_sign_baseline():
    move, optimizer = first_step("lion", GRADIENT)
    assert type(optimizer).__name__ == "Lion"
    np.testing.assert_allclose(np.abs(move), 1e-3, rtol=1e-3)  # Lion's first step: the gradient's sign


def test_adam_then_sign_steps_as_adam_first():
    """adam=W: Adam's first step moves each entry by the rate in magnitude where the decoded sum is not
    zero (m_hat / sqrt(v_hat) = sign at t = 1), as the sign does; its second step on a gradient of the
    other sign, unlike the sign's, is smaller than the rate (the moments remember the first)."""
    from tf_topk.bench import convergence

    import keras

    args = convergence.parse_args(["--dataset", "text", "--steps", "20", "--weight-decay", "0"])
    moves = {}
    for variant in ("demo:adam=5,warm=0", "demo:warm=0,scale=1"):
        optimizer = candidates.make_builder(variant, 1.0)(keras, args)
        variable = tf.Variable(tf.ones([64, 64]))
        steps = []
        for gradient in (GRADIENT, -0.5 * GRADIENT):
            before = variable.numpy()
            optimizer.apply_gradients([(tf.constant(gradient), variable)])
            steps.append(variable.numpy() - before)
        moves[variant] = steps
    adam, sign = moves["demo:adam=5,warm=0"], moves["demo:warm=0,scale=1"]
    np.testing.assert_allclose(adam[0], sign[0], atol=2e-6)  # density 1: the decoded sum is the gradient
    np.testing.assert_allclose(np.abs(sign[1]), 1e-3, rtol=1e-3)
    assert np.max(np.abs(adam[1])) < 0.9e-3


def test_rows_apart_transforms_embedding_tables_along_their_last_axis_only():
    memory = candidates.decoupled_memory({"rows": "embeddings"})
    table = tf.Variable(tf.zeros([256, 128]), name="embeddings")
    kernel = tf.Variable(tf.zeros([128, 512]), name="kernel")
    memory.build([table, kernel], lambda v, dtype, suffix, replicated=False: tf.Variable(tf.zeros(v.shape, dtype)))
    assert [(t.row_side, t.column_side) for t in memory.transforms] == [(1, 64), (64, 64)]
    flat = tf.constant(np.random.default_rng(1).standard_normal(256 * 128).astype(np.float32))
    np.testing.assert_allclose(memory.transforms[0].inverse(memory.transforms[0].forward(flat)), flat, atol=1e-5)
    memory = candidates.decoupled_memory({"vocab": "256"})
    output = tf.Variable(tf.zeros([128, 256]), name="kernel")
    memory.build([table, kernel, output], lambda v, dtype, suffix, replicated=False: tf.Variable(tf.zeros(v.shape, dtype)))
    assert [(t.row_side, t.column_side) for t in memory.transforms] == [(1, 64), (64, 64), (64, 1)]
    flat = tf.reshape(tf.transpose(tf.reshape(flat, [128, 256])), [-1])  # 128x256, the output layer's side
    np.testing.assert_allclose(memory.transforms[2].inverse(memory.transforms[2].forward(flat)), flat, atol=1e-5)
    np.testing.assert_allclose(  # along each column only: a column's 64-blocks are scipy's DCT of that column
        tf.reshape(memory.transforms[2].forward(flat), [2, 256, 64])[:, 5, :],  # blocks [I, J, a, b], b = 1
        scipy.fft.dct(tf.reshape(flat, [2, 64, 256])[:, :, 5].numpy().astype(np.float64), axis=1, norm="ortho"),
        rtol=1e-4, atol=1e-5)
    with pytest.raises(SystemExit, match="at most one of"):
        candidates.decoupled_memory({"rows": "1", "adam": "400"})


def test_dense_adam_first_is_keras_adamw_then_the_sign():
    """dense=W: the first W steps send every entry and move the variable as Keras's AdamW does (the
    residual stays empty); the step after them is DeMo's sign step of the rate."""
    from tf_topk.bench import convergence

    import keras

    args = convergence.parse_args(["--dataset", "text", "--steps", "20", "--weight-decay", "0"])
    gradients = [GRADIENT, -0.5 * GRADIENT, 0.3 * GRADIENT + 0.1, GRADIENT[::-1].copy()]
    trial = candidates.make_builder("demo:dense=3,warm=0", 0.01)(keras, args)
    adamw = keras.optimizers.AdamW(1e-3, weight_decay=0.0)
    ours, theirs = tf.Variable(tf.ones([64, 64])), tf.Variable(tf.ones([64, 64]))
    for gradient in gradients[:3]:
        trial.apply_gradients([(tf.constant(gradient), ours)])
        adamw.apply_gradients([(tf.constant(gradient), theirs)])
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=1e-6)  # steps of 1e-3; the DCT round trip
    residual = next(v for v in trial.variables if "residual" in v.name and tuple(v.shape) == (64, 64))
    assert not np.count_nonzero(residual.numpy())  # every entry was sent
    before = ours.numpy()
    trial.apply_gradients([(tf.constant(gradients[3]), ours)])
    assert np.count_nonzero(residual.numpy())  # from here on, DeMo keeps what it did not send
    move = ours.numpy() - before
    np.testing.assert_allclose(np.abs(move[move != 0]), 1e-3, rtol=1e-3)
    assert np.count_nonzero(move) > 0.9 * move.size  # the sign of a decoded sum moves (almost) every entry
    with pytest.raises(SystemExit, match="at most one of"):
        candidates.decoupled_memory({"dense": "400", "adam": "400"})


def test_the_default_keeps_embedding_rows_apart_and_apart_0_measures_the_old_default():
    table = tf.Variable(tf.zeros([256, 128]), name="embeddings")
    sides = {}
    for text in ("", "apart=0"):
        memory = candidates.decoupled_memory(dict(pair.split("=") for pair in text.split(",") if pair))
        memory.build([table], lambda v, dtype, suffix, replicated=False: tf.Variable(tf.zeros(v.shape, dtype)))
        sides[text] = (memory.transforms[0].row_side, memory.transforms[0].column_side)
    assert sides == {"": (1, 64), "apart=0": (64, 64)}
