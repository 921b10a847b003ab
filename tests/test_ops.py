"""The selection op against a numpy reference: every method, dtype, edge case."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tf_topk
from tf_topk import ops

DTYPES = [tf.float32, tf.float16, tf.bfloat16, tf.float64]
METHODS = ["exact", "gaussian"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qualifying_magnitudes(x):
    flat = np.abs(np.asarray(x, dtype=np.float64).reshape(-1))
    return flat[np.isfinite(flat) & (flat != 0)]


def check_common(x, k, values, indices):
    """What both methods promise: shapes, values == x[indices], spare slots."""
    flat = np.asarray(x).reshape(-1)
    values, indices = np.asarray(values), np.asarray(indices)
    assert values.shape == (k,) and indices.shape == (k,)
    assert indices.dtype == np.int32
    assert np.all((indices >= 0) & (indices < max(1, flat.size)))
    filled = values != 0
    np.testing.assert_array_equal(values[filled], flat[indices[filled]])
    assert np.all(indices[~filled] == 0)
    assert np.all(np.isfinite(values.astype(np.float64)))
    assert len(set(indices[filled].tolist())) == int(filled.sum()), "an entry was selected twice"
    expected_count = min(k, qualifying_magnitudes(flat).size)
    return filled, expected_count


def check_exact(x, k, values, indices):
    filled, expected_count = check_common(x, k, values, indices)
    assert filled.sum() == expected_count
    got = np.sort(np.abs(np.asarray(values, dtype=np.float64)[filled]))
    want = np.sort(qualifying_magnitudes(x))[::-1][:expected_count][::-1]
    np.testing.assert_array_equal(got, want)


def make(shape, dtype, seed=0, dist="normal"):
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shape) if dist == "normal" else rng.standard_t(3, size=shape)
    return tf.constant(data.astype(np.float32), dtype=dtype) if dtype != tf.float64 else tf.constant(data)


# Sizes cover the small-input path (two passes) and the sampled prefilter path
# (n >= 262144), several shapes, and k from 1 to n.
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape,k", [((1,), 1), ((7,), 3), ((10, 100), 10), ((1000,), 1000),
                                      ((300_000,), 300), ((512, 1024), 5243), ((400_001,), 4000)])
def test_exact_matches_numpy(dtype, shape, k):
    x = make(shape, dtype, seed=k)
    values, indices = tf_topk.approx_topk(x, k, method="exact")
    check_exact(x.numpy(), k, values.numpy(), indices.numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("dist", ["normal", "student_t"])
@pytest.mark.parametrize("n,k", [(1000, 10), (300_000, 300), (1_000_000, 1000), (1_000_000, 100_000)])
def test_gaussian_recall_and_count(dtype, dist, n, k):
    x = make((n,), dtype, seed=n + k, dist=dist)
    values, indices = tf_topk.approx_topk(x, k, method="gaussian")
    filled, expected_count = check_common(x.numpy(), k, values.numpy(), indices.numpy())
    assert filled.sum() == expected_count  # k slots are filled whenever k entries qualify
    _, exact_indices = tf_topk.approx_topk(x, k, method="exact")
    recall = len(set(exact_indices.numpy().tolist()) & set(indices.numpy()[filled].tolist())) / k
    assert recall >= 0.9, recall
    # Every selected magnitude is at least the exact threshold's bin's lower edge.
    threshold = np.sort(qualifying_magnitudes(x.numpy()))[-k]
    assert np.abs(values.numpy()[filled].astype(np.float64)).min() >= threshold * 0.89


@pytest.mark.parametrize("method", METHODS)
def test_non_finite_entries_are_never_selected(method):
    x = np.random.default_rng(1).standard_normal(500_000).astype(np.float32)
    x[::1000] = np.nan
    x[7::1000] = np.inf
    x[9::1000] = -np.inf
    k = 2000  # fewer than the 1500 non-finite entries would not test much
    values, indices = tf_topk.approx_topk(tf.constant(x), k, method=method)
    assert np.all(np.isfinite(values.numpy()))
    assert np.all(np.isfinite(x[indices.numpy()]))
    if method == "exact":
        check_exact(x, k, values.numpy(), indices.numpy())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [100, 400_000])
def test_fewer_qualifying_than_k_fills_spare_slots_with_zero(method, n):
    x = np.zeros(n, np.float32)
    x[[3, 50, 77]] = [1.0, -2.0, np.nan]
    values, indices = tf_topk.approx_topk(tf.constant(x), 10, method=method)
    assert sorted(values.numpy().tolist()) == [-2.0] + [0.0] * 8 + [1.0]
    assert sorted(indices.numpy()[values.numpy() != 0].tolist()) == [3, 50]
    assert np.all(indices.numpy()[values.numpy() == 0] == 0)


@pytest.mark.parametrize("method", METHODS)
def test_all_zero_and_all_nan_give_only_spare_slots(method):
    for fill in (0.0, np.nan):
        x = tf.fill([1000], tf.constant(fill, tf.float32))
        values, indices = tf_topk.approx_topk(x, 5, method=method)
        np.testing.assert_array_equal(values.numpy(), np.zeros(5, np.float32))
        np.testing.assert_array_equal(indices.numpy(), np.zeros(5, np.int32))


@pytest.mark.parametrize("n", [1000, 500_000])
def test_exact_with_many_ties(n):
    x = np.where(np.arange(n) % 3 == 0, 2.0, -1.0).astype(np.float32)
    k = n // 2  # all the 2.0s (a third of n) and some of the -1.0s
    values, indices = tf_topk.approx_topk(tf.constant(x), k, method="exact")
    check_exact(x, k, values.numpy(), indices.numpy())


def test_outputs_are_deterministic():
    x = make((600_000,), tf.float32, seed=3)
    for method in METHODS:
        first = tf_topk.approx_topk(x, 6000, method=method)
        second = tf_topk.approx_topk(x, 6000, method=method)
        np.testing.assert_array_equal(first[1].numpy(), second[1].numpy())


@pytest.mark.parametrize("method", METHODS)
def test_k_zero_and_empty_input_give_empty_outputs(method):
    values, indices = tf_topk.approx_topk(tf.constant([1.0, 2.0]), 0, method=method)
    assert values.shape == (0,) and indices.shape == (0,)
    values, indices = tf_topk.approx_topk(tf.zeros([0, 3]), 0, method=method)
    assert values.shape == (0,) and indices.shape == (0,)


def test_bad_arguments_name_the_argument_and_value():
    x = tf.constant([1.0, 2.0, 3.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be >= 0, got k = -1"):
        tf_topk.approx_topk(x, -1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be <= .*\(3\), got k = 4"):
        tf_topk.approx_topk(x, 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"x must be .* got dtype int32"):
        tf_topk.approx_topk(tf.constant([1, 2]), 1)
    with pytest.raises(ValueError, match=r"method must be one of .* got 'median'"):
        tf_topk.approx_topk(x, 1, method="median")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be an int"):
        tf_topk.approx_topk(x, 1.5)


def test_bad_k_tensor_is_checked_by_the_kernel():
    x = tf.constant([1.0, 2.0, 3.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be <= .*\(3\), got k = 5"):
        tf_topk.approx_topk(x, tf.constant(5))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be >= 0, got k = -2"):
        tf_topk.approx_topk(x, tf.constant(-2))


def test_size_limit_is_checked_from_the_static_shape():
    # A placeholder shape, never materialised: 2^31 entries.
    @tf.function(input_signature=[tf.TensorSpec([2**16, 2**15], tf.float32)])
    def select(x):
        return tf_topk.approx_topk(x, 1)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"2147483648 entries; at most 2\^31 - 1"):
        select.get_concrete_function()


def test_static_shape_in_tf_function_and_dynamic_k():
    @tf.function
    def static(x):
        values, indices = tf_topk.approx_topk(x, 4)
        assert values.shape.as_list() == [4] and indices.shape.as_list() == [4]
        return values

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int32)])
    def dynamic(x, k):
        values, _ = tf_topk.approx_topk(x, k, method="exact")
        assert values.shape.as_list() == [None]
        return values

    x = make((100,), tf.float32)
    assert static(x).shape == (4,)
    check_exact(x.numpy(), 7, dynamic(x, tf.constant(7)).numpy(),
                tf_topk.approx_topk(x, 7, method="exact")[1].numpy())


def test_op_is_not_differentiable():
    x = tf.Variable([1.0, -5.0, 2.0])
    with tf.GradientTape() as tape:
        values, _ = tf_topk.approx_topk(x, 2)
        loss = tf.reduce_sum(values)
    assert tape.gradient(loss, x) is None


def test_version_check_names_both_versions_and_the_rebuild_command():
    with pytest.raises(ops.LibraryVersionError) as info:
        ops.check_build_version("2.20.0", "2.21.0")
    message = str(info.value)
    assert "2.20.0" in message and "2.21.0" in message and "build_ops.py" in message
    ops.check_build_version(tf.__version__, tf.__version__)  # no error


def _run_python(code, cwd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_saved_model_runs_in_a_fresh_process_after_import(tmp_path):
    export = str(tmp_path / "model")

    class Selector(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
        def select(self, x):
            return tf_topk.approx_topk(x, 2, method="exact")

    tf.saved_model.save(Selector(), export)
    loaded_ok = _run_python(f"""
        import tensorflow as tf, tf_topk
        m = tf.saved_model.load({export!r})
        v, i = m.select(tf.constant([0.5, -4.0, 3.0, 1.0]))
        print(sorted(i.numpy().tolist()))
    """, cwd=str(tmp_path))
    assert loaded_ok.returncode == 0, loaded_ok.stderr[-3000:]
    assert loaded_ok.stdout.strip().splitlines()[-1] == "[1, 2]"
    without_import = _run_python(f"""
        import tensorflow as tf
        tf.saved_model.load({export!r})
    """, cwd=str(tmp_path))
    assert without_import.returncode != 0
    assert "ImportTfTopk>ApproxTopK" in without_import.stderr


def test_jit_compile_is_refused_with_the_fix():
    @tf.function(jit_compile=True)
    def select(x):
        return tf_topk.approx_topk(x, 1)

    @tf.function(jit_compile=True)
    def outer(x):  # a plain tf.function called from an XLA one is compiled too
        return tf.function(lambda y: tf_topk.approx_topk(y, 1))(x)

    for function in (select, outer):
        with pytest.raises(tf.errors.UnimplementedError, match=r"no XLA kernel.*jit_compile=False"):
            function(tf.constant([1.0, 2.0]))
    values, _ = tf.function(lambda x: tf_topk.approx_topk(x, 1), jit_compile=False)(tf.constant([1.0, -2.0]))
    assert values.numpy().tolist() == [-2.0]


@pytest.mark.slow
def test_op_determinism_cpu_runs_and_gpu_refuses(tmp_path):
    """Under op determinism the CPU kernel (deterministic) runs and repeats
    itself bit for bit; the GPU kernel (atomic slot order) refuses to run
    with UnimplementedError. The GPU half runs where TensorFlow sees a GPU."""
    result = _run_python("""
        import numpy as np, tensorflow as tf, tf_topk
        tf.config.experimental.enable_op_determinism()
        x = tf.constant(np.random.default_rng(0).standard_normal(400_000).astype(np.float32))
        with tf.device("/CPU:0"):
            runs = [tf_topk.approx_topk(x, 400) for _ in range(3)]
        same = all(np.array_equal(v.numpy(), runs[0][0].numpy()) and
                   np.array_equal(i.numpy(), runs[0][1].numpy()) for v, i in runs)
        print("cpu", same)
        if tf.config.list_physical_devices("GPU"):
            try:
                with tf.device("/GPU:0"):
                    tf_topk.approx_topk(x, 400)
                print("gpu ran")
            except tf.errors.UnimplementedError as e:
                print("gpu refused", "enable_op_determinism" in str(e) and "CPU" in str(e))
    """, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "cpu True"
    if len(lines) > 1:
        assert lines[1] == "gpu refused True"


def chunk_reference(accumulated, k, chunk):
    """(values, indices, remaining) of the chunk-wise selection in numpy: per chunk its k largest finite
    non-zero magnitudes, largest first, ties to the earlier index; spare slots 0 at the chunk's start."""
    flat = np.asarray(accumulated).reshape(-1)
    values, indices, remaining = [], [], flat.copy()
    for start in range(0, flat.size, chunk):
        part = flat[start:start + chunk]
        magnitude = np.abs(part.astype(np.float64))
        eligible = [i for i in np.lexsort((np.arange(part.size), -magnitude))
                    if np.isfinite(magnitude[i]) and magnitude[i] != 0][:k]
        values += [part[i] for i in eligible] + [0] * (k - len(eligible))
        indices += [start + i for i in eligible] + [start] * (k - len(eligible))
        remaining[[start + i for i in eligible]] = 0
    return np.array(values, flat.dtype), np.array(indices, np.int32), remaining


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("size, k, chunk", [(9_000, 30, 4096), (4096, 1, 4096), (10, 2, 3), (100, 100, 100)])
def test_error_feedback_chunk_topk_matches_numpy(dtype, size, k, chunk):
    rng = np.random.default_rng(size + k)
    gradient = tf.constant(rng.normal(size=size), dtype)
    residual_dtype = tf.float64 if dtype == tf.float64 else tf.float32
    residual = tf.constant(rng.normal(size=size) * (rng.random(size) < 0.5), residual_dtype)
    out = ops.error_feedback_chunk_topk(gradient, residual, k, chunk)
    accumulated = tf.cast(gradient, residual_dtype).numpy() + residual.numpy()
    values, indices, remaining = chunk_reference(accumulated, k, chunk)
    assert out.values.shape == out.indices.shape == [-(-size // chunk) * k]  # static, k a Python int
    np.testing.assert_array_equal(out.indices.numpy(), indices)
    np.testing.assert_array_equal(out.values.numpy(), values)
    np.testing.assert_array_equal(out.remaining.numpy(), remaining)
    # float32 sums of squares per chunk, then in double, as the fused op sums them, and the remaining's
    # as the accumulated's less the selected's: within about 1e-7 of the accumulated's.
    total = np.sum(accumulated.astype(np.float64) ** 2)
    np.testing.assert_allclose(out.stats.numpy(), [total, np.sum(remaining.astype(np.float64) ** 2), 0], rtol=1e-6,
                               atol=1e-7 * total)


def test_error_feedback_chunk_topk_spare_slots_ties_and_non_finite_entries():
    gradient = tf.constant([0.0, 0.0, 3.0, np.nan, -3.0, 1.0, np.inf, 0.0, 0.0], tf.float32)
    out = ops.error_feedback_chunk_topk(gradient, tf.zeros([9]), tf.constant(2), 3)
    # Chunk 0: one non-zero (a spare slot at its start); chunk 1: NaN never selected, the tie to the earlier
    # index; chunk 2: the infinity never selected, nothing else qualifies.
    assert out.values.numpy().tolist() == [3.0, 0.0, -3.0, 1.0, 0.0, 0.0]
    assert out.indices.numpy().tolist() == [2, 0, 4, 5, 6, 6]
    assert out.stats.numpy()[2] == 2  # the NaN and the infinity, left in remaining
    remaining = out.remaining.numpy()
    assert np.isnan(remaining[3]) and remaining[6] == np.inf and remaining[[2, 4, 5]].tolist() == [0, 0, 0]


def test_error_feedback_chunk_topk_refuses_bad_arguments_by_name():
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be in \[1, chunk=4\], got k = 5"):
        ops.error_feedback_chunk_topk(tf.zeros([8]), tf.zeros([8]), 5, 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be in \[1, chunk=4\], got 0"):
        ops.error_feedback_chunk_topk(tf.zeros([8]), tf.zeros([8]), tf.constant(0), 4)
    with pytest.raises(ValueError, match=r"chunk must be an int >= 1, got 0"):
        ops.error_feedback_chunk_topk(tf.zeros([8]), tf.zeros([8]), 1, 0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"residual must be float32 for a float16 gradient"):
        ops.error_feedback_chunk_topk(tf.zeros([8], tf.float16), tf.zeros([8], tf.float16), 1, 4)


@pytest.mark.parametrize("value_bits", [2, 3, 4, 8])
@pytest.mark.parametrize("quiet", [1e-3, 1e-7], ids=["own-grid", "member-grid"])
def test_error_feedback_chunk_topk_rounds_as_the_chunk_route_sends(value_bits, quiet):
    """With value_bits the selected values come back on their chunk's grid (the numpy reference of the
    route), the rounding errors stay in remaining, and a slot rounded to 0 is spare. A chunk `quiet`
    times the others' scale: 1e-7 puts it more than 2**15 below its member's grid, so it rounds on the
    coarsest grid its offset reaches, not its own."""
    from selection_reference import chunk_sent

    rng = np.random.default_rng(value_bits)
    gradient = (rng.normal(size=9_000) * np.repeat([1.0, quiet, 30.0], [4096, 4096, 808])).astype(np.float32)
    out = ops.error_feedback_chunk_topk(tf.constant(gradient), tf.zeros([9_000]), 30, 4096, value_bits=value_bits)
    sent = np.zeros(9_000, np.float32)
    np.add.at(sent, out.indices.numpy(), out.values.numpy())
    np.testing.assert_array_equal(sent, chunk_sent(gradient, 90, value_bits))
    np.testing.assert_array_equal(out.remaining.numpy(), gradient - sent)  # each error exact in float32
    spare = out.values.numpy() == 0
    assert np.all(out.indices.numpy()[spare] == np.repeat([0, 4096, 8192], 30)[spare])
    np.testing.assert_allclose(out.stats.numpy()[1], np.sum((gradient - sent).astype(np.float64) ** 2), rtol=1e-6)
    with pytest.raises(ValueError, match=r"value_bits must be one of \(0, 2, 3, 4, 8\), got 5"):
        ops.error_feedback_chunk_topk(tf.constant(gradient), tf.zeros([9_000]), 30, 4096, value_bits=5)


def test_error_feedback_chunk_topk_never_changes_a_remaining_it_handed_out_earlier():
    """The op recycles its `remaining` buffers as the fused op does (cc/kernels/remaining_buffers.h): one
    still held by a tensor or a variable is never written again, and a variable that takes each step's
    buffer over holds the reference's residual."""
    size, k = 50_000, 8
    rng = np.random.default_rng(3)
    residual = tf.Variable(rng.standard_normal(size).astype(np.float32))
    before = residual.numpy().copy()
    held = []
    for _ in range(5):
        out = ops.error_feedback_chunk_topk(tf.constant(rng.standard_normal(size).astype(np.float32)), residual, k,
                                            4096, value_bits=2)
        held.append((out.remaining, out.remaining.numpy().copy()))
    np.testing.assert_array_equal(residual.numpy(), before)
    for tensor, copy in held:
        np.testing.assert_array_equal(tensor.numpy(), copy)

    @tf.function
    def step(gradient):
        out = ops.error_feedback_chunk_topk(gradient, residual, k, 4096)
        residual.assign(out.remaining)  # takes the buffer over
        return out.values

    expected = residual.numpy()
    for _ in range(4):
        gradient = rng.standard_normal(size).astype(np.float32)
        _, _, expected = chunk_reference(gradient + expected, k, 4096)
        step(tf.constant(gradient))
        np.testing.assert_array_equal(residual.numpy(), expected)


def rounded_bucket(value_bits, seed=0):
    """A bucket of three members (9,000 entries in chunks of 4,096, 4,096 and 808; 300 in one chunk; 4,096,
    a chunk of zeros in the first), each chunk's top entries rounded on its grid by the selection op:
    (values, indices into the bucket, lengths, sizes, starts)."""
    rng = np.random.default_rng(seed)
    sizes, starts, per_chunk = [9_000, 300, 4_096], [0, 9_000, 9_300], [30, 5, 64]
    values, indices, lengths = [], [], []
    for size, start, k in zip(sizes, starts, per_chunk):
        gradient = (rng.normal(size=size) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
        if size == 9_000:
            gradient[4096:8192] = 0.0
        out = ops.error_feedback_chunk_topk(tf.constant(gradient), tf.zeros([size]), k, min(size, 4096),
                                            value_bits=value_bits)
        values.append(out.values)
        indices.append(out.indices + start)
        lengths.append(int(out.values.shape[0]))
    return tf.concat(values, 0), tf.concat(indices, 0), lengths, sizes, starts


@pytest.mark.parametrize("value_bits", [2, 3, 4, 8])
def test_chunk_pack_and_unpack_give_every_replicas_slots_back(value_bits):
    """chunk_unpack(chunk_pack(...)) is each slot's rounded value and flat index, for every replica's row;
    the words are one exponent a member and the packed fields, 4 bits a chunk and 12 + value_bits a slot."""
    rows, expected = [], []
    for replica in range(3):
        values, indices, lengths, sizes, starts = rounded_bucket(value_bits, seed=replica)
        layout = dict(sizes=sizes, starts=starts, chunk=4096, value_bits=value_bits)
        words = ops.chunk_pack(values, indices, lengths, **layout)
        bits = 4 * (3 + 1 + 1) + (12 + value_bits) * sum(lengths)
        assert words.shape == [3 + -(-bits // 32)]
        rows.append(words)
        expected.append((values.numpy(), indices.numpy()))
    values, indices = ops.chunk_unpack(tf.stack(rows), lengths, **layout)
    assert values.shape == indices.shape == [3, sum(lengths)]
    for replica, (sent_values, sent_indices) in enumerate(expected):
        np.testing.assert_array_equal(values.numpy()[replica], sent_values)
        np.testing.assert_array_equal(indices.numpy()[replica], sent_indices)
    assert np.count_nonzero(expected[0][0][30:60]) == 0  # the chunk of zeros: spare slots at its start
    np.testing.assert_array_equal(expected[0][1][30:60], 4096)


def test_chunk_pack_and_unpack_refuse_bad_arguments_by_name():
    values, indices, lengths, sizes, starts = rounded_bucket(2)
    layout = dict(sizes=sizes, starts=starts, chunk=4096, value_bits=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"member 0 has 91 slots: not the same number"):
        ops.chunk_pack(values[1:], indices[1:], [91] + lengths[1:], **layout)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"values and indices must have the 159 slots"):
        ops.chunk_pack(values[1:], indices[1:], lengths, **layout)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"lengths must have one entry per member \(3\)"):
        ops.chunk_pack(values, indices, lengths[:2], **layout)
    words = ops.chunk_pack(values, indices, lengths, **layout)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rows must be \[replicas, \d+\] for this layout"):
        ops.chunk_unpack(words[None, 1:], tf.constant(lengths), **layout)
    with pytest.raises(ValueError, match=r"value_bits must be one of \(2, 3, 4, 8\), got 5"):
        ops.chunk_pack(values, indices, lengths, **{**layout, "value_bits": 5})
    with pytest.raises(ValueError, match=r"sizes and starts must name the same members"):
        ops.chunk_unpack(words[None], lengths, **{**layout, "starts": [0, 9_000]})
    with pytest.raises(ValueError, match=r"chunk must be an int in \[2, 2\*\*24\], got 1"):
        ops.chunk_pack(values, indices, lengths, **{**layout, "chunk": 1})
    with pytest.raises(TypeError, match=r"values must be float32 or float64, got float16"):
        ops.chunk_pack(tf.cast(values, tf.float16), indices, lengths, **layout)


def test_a_chunks_exponent_stops_at_float32s_largest_power_of_two():
    """A chunk whose mean magnitude is beyond 2**127.5 is sent on the grid 2**127, not 2**128 (which would
    round its values to infinity); the rest stays in remaining."""
    gradient = np.full(8, 3.0e38, np.float32)
    out = ops.error_feedback_chunk_topk(tf.constant(gradient), tf.zeros([8]), 2, 4, value_bits=2)
    np.testing.assert_array_equal(out.values.numpy(), np.full(4, 2.0**127, np.float32))
    np.testing.assert_allclose(out.remaining.numpy()[[0, 1, 4, 5]], 3.0e38 - 2.0**127, rtol=1e-6)
    words = ops.chunk_pack(out.values, out.indices, [4], sizes=[8], starts=[0], chunk=4, value_bits=2)
    np.testing.assert_array_equal(ops.chunk_unpack(words[None], [4], sizes=[8], starts=[0], chunk=4,
                                                   value_bits=2)[0].numpy()[0], np.full(4, 2.0**127, np.float32))
