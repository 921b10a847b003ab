"""The selection op: loading the library once, argument checks, the signature.

The op library (`_tf_topk_ops.so`, built from `cc/` by `pip install -e .` or
`python cc/build_ops.py`) is loaded when this module is imported: by the first
use of a tf_topk name, or by `import tf_topk` after TensorFlow. Set
TF_TOPK_LIBRARY to load another build of it (for example the one Bazel
produces).
"""

import collections
import json
import os

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

OP_NAME = "ImportTfTopk>ApproxTopK"
ERROR_FEEDBACK_OP_NAME = "ImportTfTopk>ErrorFeedbackTopK"
CHUNK_OP_NAME = "ImportTfTopk>ErrorFeedbackChunkTopK"
CHUNK_PACK_OP_NAME = "ImportTfTopk>ChunkPack"
CHUNK_UNPACK_OP_NAME = "ImportTfTopk>ChunkUnpack"
METHODS = ("gaussian", "exact")
SUPPORTED_DTYPES = (tf.float32, tf.float16, tf.bfloat16, tf.float64)
MAX_SIZE = 2**31 - 1
REBUILD_COMMAND = "pip install --no-build-isolation -e .  (or: python cc/build_ops.py)"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_DEFAULT_LIBRARY = os.path.join(_PACKAGE_DIR, "_tf_topk_ops.so")


class LibraryVersionError(ImportError):
    """The op library was built against another TensorFlow than the running one."""


def library_path():
    """The op library `tf_topk.ops` loads on import (TF_TOPK_LIBRARY overrides)."""
    return os.environ.get("TF_TOPK_LIBRARY") or _DEFAULT_LIBRARY


def check_build_version(built_against, running):
    """Raise LibraryVersionError unless the library matches this TensorFlow."""
    if built_against != running:
        raise LibraryVersionError(
            f"tf_topk's op library was built against TensorFlow {built_against}, but TensorFlow "
            f"{running} is running. Rebuild it with: {REBUILD_COMMAND}"
        )


def _load_library(path):
    if not os.path.exists(path):
        raise ImportError(f"tf_topk's op library is missing ({path}). Build it with: {REBUILD_COMMAND}")
    info_path = os.path.splitext(path)[0] + ".json"
    if os.path.exists(info_path):
        with open(info_path) as f:
            check_build_version(json.load(f).get("tensorflow_version"), tf.__version__)
    try:
        return tf.load_op_library(path)
    except tf.errors.NotFoundError as error:  # undefined symbols: another TF build
        raise LibraryVersionError(
            f"tf_topk's op library at {path} does not load into TensorFlow {tf.__version__} ({error}). "
            f"Rebuild it with: {REBUILD_COMMAND}"
        ) from error


_library = _load_library(library_path())
# Generated wrapper name of "ImportTfTopk>ApproxTopK".
_approx_topk_raw = _library.import_tf_topk_approx_top_k
_error_feedback_topk_raw = _library.import_tf_topk_error_feedback_top_k
_error_feedback_chunk_topk_raw = _library.import_tf_topk_error_feedback_chunk_top_k
_chunk_pack_raw = _library.import_tf_topk_chunk_pack
_chunk_unpack_raw = _library.import_tf_topk_chunk_unpack
tf.no_gradient(OP_NAME)
tf.no_gradient(ERROR_FEEDBACK_OP_NAME)
tf.no_gradient(CHUNK_OP_NAME)
tf.no_gradient(CHUNK_PACK_OP_NAME)
tf.no_gradient(CHUNK_UNPACK_OP_NAME)


def check_method(method):
    """ValueError unless `method` is one of METHODS."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def _invalid(message):
    return tf.errors.InvalidArgumentError(None, None, message)


def _refuse_xla():
    """Fail at trace time, with the fix, rather than with XLA's error at run time.

    Keras's `model.compile` resolves `jit_compile="auto"` to XLA on a machine
    with a GPU when no distribution strategy is used, so a one-GPU TopKOptimizer
    run lands here unless the model is compiled with `jit_compile=False`.
    """
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise tf.errors.UnimplementedError(
            None, None,
            "tf_topk.approx_topk has no XLA kernel, so it cannot run in a function compiled with "
            "jit_compile=True. Use tf.function(jit_compile=False); with Keras, model.compile(..., "
            "jit_compile=False) (Keras picks XLA by default on a GPU machine without a distribution strategy)")


def _check_k(k, size, what):
    """k as an int32 tensor, after the checks a Python int allows at trace time."""
    if isinstance(k, bool) or not (isinstance(k, int) or tf.is_tensor(k)):
        if hasattr(k, "__index__"):  # numpy integers
            k = int(k)
        else:
            raise _invalid(f"k must be an int or an int32 scalar tensor, got {k!r}")
    if isinstance(k, int):
        if k < 0:
            raise _invalid(f"k must be >= 0, got k = {k}")
        if size is not None and k > size:
            raise _invalid(f"k must be <= the number of entries of {what} ({size}), got k = {k}")
    return tf.cast(k, tf.int32) if tf.is_tensor(k) else tf.constant(k, tf.int32)


def _check_size(size, what):
    if size is not None and size > MAX_SIZE:
        raise _invalid(f"{what} has {size} entries; at most 2^31 - 1 are supported (indices are int32)")


def _gradient_and_residual(gradient, residual):
    """The two as tensors, after the dtype checks the error-feedback ops share: a float gradient, and a
    residual in float32 (float64 for a float64 gradient)."""
    gradient = tf.convert_to_tensor(gradient)
    residual = tf.convert_to_tensor(residual)
    if gradient.dtype not in SUPPORTED_DTYPES:
        raise _invalid(f"gradient must be float32, float16, bfloat16 or float64, got dtype {gradient.dtype.name}")
    wanted = tf.float64 if gradient.dtype == tf.float64 else tf.float32
    if residual.dtype != wanted:
        raise _invalid(f"residual must be {wanted.name} for a {gradient.dtype.name} gradient, got dtype "
                       f"{residual.dtype.name}")
    return gradient, residual


def approx_topk(x, k, method="gaussian", name=None):
    """Select the ~k entries of largest magnitude of `x` (treated as flat).

    Args:
      x: a float32, float16, bfloat16 or float64 tensor of any shape.
      k: number of entries to return: a Python int (the outputs then have the
        static shape [k]) or an int32 scalar tensor. 0 <= k <= size(x).
      method: "gaussian" (default) or "exact". Both locate the threshold in a
        2048-bin logarithmic histogram of magnitudes (bins 1/8 octave wide)
        and return exactly min(k, number of finite non-zero entries) entries,
        on every device. "exact" returns the k largest magnitudes (ties broken
        any way). "gaussian" fits a normal distribution to the data's mean and
        standard deviation to place the threshold inside the threshold bin,
        takes the bin's entries above it, then fills any slots left with the
        rest of the bin: every returned entry lies within one bin (12.5%) of
        the exact threshold, and recall against "exact" is typically above
        0.98. On the GPU, "gaussian" needs fewer passes over memory than
        "exact" when the input is small or k is large.
      name: optional op name.

    Returns:
      (values, indices): `values` has the dtype of `x`, `indices` is int32, both
      of shape [k]. values[i] == reshape(x, [-1])[indices[i]], signed.

    Only finite, non-zero entries are selected: NaN, +Inf, -Inf and zeros never
    are. When fewer than k entries qualify, the spare slots hold value 0 at
    index 0, which adds nothing when scattered back with a scatter-add.
    The CPU kernel is deterministic. The GPU kernel is not (output order,
    and which tied entries fill the last slots, vary between runs): under
    `tf.config.experimental.enable_op_determinism()` it raises
    UnimplementedError; place the op on the CPU there.
    The op has no gradient and no XLA kernel: inside
    `tf.function(jit_compile=True)` (or a Keras model compiled with XLA) it
    raises UnimplementedError when traced.

    Example:
      >>> x = tf.constant([[0.1, -3.0], [2.0, 0.5]])
      >>> values, indices = tf_topk.approx_topk(x, 2, method="exact")
      >>> sorted(values.numpy().tolist())
      [-3.0, 2.0]
    """
    check_method(method)
    with tf.name_scope(name or "approx_topk"):
        x = tf.convert_to_tensor(x)
        if x.dtype not in SUPPORTED_DTYPES:
            raise _invalid(
                f"x must be float32, float16, bfloat16 or float64, got dtype {x.dtype.name}")
        size = x.shape.num_elements()
        _check_size(size, "x")
        k = _check_k(k, size, "x")
        _refuse_xla()
        return _approx_topk_raw(x, k, method=method)


ErrorFeedbackSelection = collections.namedtuple("ErrorFeedbackSelection",
                                                ["values", "indices", "remaining", "stats", "profile"])
ErrorFeedbackSelection.__doc__ = """What `error_feedback_topk` returns.

values, indices: the selection of `approx_topk` on gradient + residual
  (values in the residual's dtype), both of shape [k].
remaining: gradient + residual with the selected entries set to 0, flat,
  in the residual's dtype: the next residual.
stats: float64 [3]: sum of squares of the finite entries of gradient +
  residual, the same of `remaining`, and the number of non-finite entries
  of gradient + residual (see ERROR_FEEDBACK_STATS).
profile: with `with_profile=True`, float64 [2, 2048]: per magnitude bin of
  the selection (`PROFILE_BINS`, logarithmic, 1/8 octave wide, ascending),
  the number and the sum of squares of the finite non-zero entries of
  gradient + residual; else [2, 0].
"""

PROFILE_BINS = 2048

ERROR_FEEDBACK_STATS = ("accumulated_squares", "remaining_squares", "non_finite")


def error_feedback_topk(gradient, residual, k, method="gaussian", with_profile=False, profile_density=1.0,
                        name=None):
    """Error feedback and top-k selection in one pass over the gradient.

    Computes accumulated = gradient + residual (in the residual's dtype), the
    ~k entries of largest magnitude of it exactly as `approx_topk` selects
    them, what remains once they are taken out, and the statistics of both,
    without a dozen separate passes: the CPU kernel reads gradient and
    residual once and writes `remaining` once (plus O(candidates) work).

    The residual is not modified: assign `remaining` to it when the step is
    kept (an assignment takes over the buffer; nothing is copied). Non-finite
    entries of gradient + residual are never selected; they stay in
    `remaining` and are counted in stats[2], so a caller that skips such a
    step simply does not assign.

    Called again with the same size (a training step), the op writes
    `remaining` into a buffer it kept from an earlier call that nobody else
    holds any more, instead of allocating one. It keeps at most three
    buffers, all of its last call's size, and lets them go at a call of
    another size: eager calls of varying sizes keep nothing.

    Args:
      gradient: float32, float16, bfloat16 or float64 tensor of any shape.
      residual: tensor with as many entries; float32 for a float32, float16
        or bfloat16 gradient, float64 for a float64 one.
      k: int or int32 scalar tensor, 0 <= k <= size(gradient).
      method: "gaussian" (default) or "exact", as in `approx_topk`.
      with_profile: also return the magnitude profile (count and energy per
        bin) of gradient + residual, from the same pass: what an adaptive
        choice of k needs (`tf_topk.schedule.AdaptiveDensity`).
      profile_density: in (0, 1]; the profile need only be exact from the
        largest magnitudes down to rank profile_density * size (the CPU kernel
        then skips the entries well below it, which makes profiling cheap).
      name: optional op name.

    Returns:
      An ErrorFeedbackSelection (values, indices, remaining, stats, profile).

    Example:
      >>> g = tf.constant([0.5, -1.0, 0.25, 0.0])
      >>> r = tf.constant([1.0, 0.0, 0.0, 0.0])
      >>> out = tf_topk.error_feedback_topk(g, r, 1, method="exact")
      >>> out.values.numpy().tolist(), out.indices.numpy().tolist()
      ([1.5], [0])
      >>> out.remaining.numpy().tolist()
      [0.0, -1.0, 0.25, 0.0]
    """
    check_method(method)
    with tf.name_scope(name or "error_feedback_topk"):
        gradient, residual = _gradient_and_residual(gradient, residual)
        if isinstance(profile_density, bool) or not isinstance(profile_density, (int, float)) or \
                not 0.0 < profile_density <= 1.0:
            raise ValueError(f"profile_density must be a float in (0, 1], got {profile_density!r}")
        size = gradient.shape.num_elements()
        residual_size = residual.shape.num_elements()
        if size is not None and residual_size is not None and size != residual_size:
            raise _invalid(f"residual must have as many entries as gradient ({size}), got shape {residual.shape}")
        _check_size(size, "gradient")
        k = _check_k(k, size, "gradient")
        _refuse_xla()
        return ErrorFeedbackSelection(*_error_feedback_topk_raw(gradient, residual, k, method=method,
                                                                with_profile=bool(with_profile),
                                                                profile_density=float(profile_density)))


def error_feedback_chunk_topk(gradient, residual, k, chunk, value_bits=0, name=None):
    """Error feedback and a chunk-wise selection in one pass: the same number of entries from every
    chunk, as the chunk route (`exchange_mode="allgather_chunk"`) sends them.

    accumulated = gradient + residual (in the residual's dtype) is cut into chunks of `chunk` entries,
    the last one shorter; chunk c's k entries of largest magnitude (finite and non-zero, largest first,
    ties to the earlier index) fill slots c*k to c*k + k - 1, spare slots holding value 0 at the chunk's
    first index; `remaining` is accumulated with them zeroed. With `value_bits` (2, 3, 4 or 8) the
    selected values come back rounded on their chunk's grid (`tf_topk.routes.chunked`), each rounding
    error left in `remaining` and a slot rounded to 0 made spare. A CPU kernel only: on a GPU the route
    selects with TensorFlow's top_k.

    Args:
      gradient, residual: as `error_feedback_topk`'s.
      k: int or int32 scalar tensor, 1 <= k <= chunk: entries per chunk.
      chunk: int >= 1, entries per chunk.
      value_bits: 0 (the values as they are), or 2, 3, 4 or 8: rounded as the chunk route sends them.

    Returns:
      An ErrorFeedbackSelection: values and (flat) indices of ceil(n / chunk) * k slots, remaining,
      stats as `error_feedback_topk`'s, and an empty profile.

    Example:
      >>> g = tf.constant([0.5, -1.0, 0.25, 0.0, 2.0])
      >>> out = tf_topk.ops.error_feedback_chunk_topk(g, tf.zeros([5]), 1, chunk=2)
      >>> out.values.numpy().tolist(), out.indices.numpy().tolist()
      ([-1.0, 0.25, 2.0], [1, 2, 4])
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    if isinstance(value_bits, bool) or value_bits not in (0, 2, 3, 4, 8):
        raise ValueError(f"value_bits must be one of (0, 2, 3, 4, 8), got {value_bits!r}")
    with tf.name_scope(name or "error_feedback_chunk_topk"):
        gradient, residual = _gradient_and_residual(gradient, residual)
        size = gradient.shape.num_elements()
        _check_size(size, "gradient")
        if isinstance(k, int) and not isinstance(k, bool) and not 1 <= k <= chunk:
            raise _invalid(f"k must be in [1, chunk={chunk}], got k = {k}")
        k = _check_k(k, None, "gradient")
        _refuse_xla()
        values, indices, remaining, stats = _error_feedback_chunk_topk_raw(
            tf.reshape(gradient, [-1]), tf.reshape(residual, [-1]), k, chunk=chunk, value_bits=value_bits)
        return ErrorFeedbackSelection(values, indices, remaining, stats, tf.zeros([2, 0], tf.float64))


def _wire_layout(sizes, starts, chunk, value_bits):
    """The chunk wire ops' attributes, checked: a ValueError names the bad one."""
    sizes, starts = [int(size) for size in sizes], [int(start) for start in starts]
    if not sizes or len(sizes) != len(starts) or min(sizes) < 1 or min(starts) < 0:
        raise ValueError(f"sizes and starts must name the same members, sizes >= 1 and starts >= 0, got "
                         f"sizes={sizes!r} and starts={starts!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 2 <= chunk <= 2**24:
        raise ValueError(f"chunk must be an int in [2, 2**24], got {chunk!r}")
    if isinstance(value_bits, bool) or value_bits not in (2, 3, 4, 8):
        raise ValueError(f"value_bits must be one of (2, 3, 4, 8), got {value_bits!r}")
    return dict(sizes=sizes, starts=starts, chunk=chunk, value_bits=value_bits)


def chunk_pack(values, indices, lengths, sizes, starts, chunk, value_bits, name=None):
    """A bucket's selected slots as the chunk route's words (`tf_topk.routes.chunked`'s format),
    in one pass on a CPU: each chunk's grid rebuilt from its rounded values, then the members'
    exponents, the chunks' offsets and each slot's chunk-local index and code packed.

    Args:
      values: float32 or float64 [slots], member after member, already on their chunks' grid (as
        `error_feedback_chunk_topk(..., value_bits=value_bits)` returns them).
      indices: int32 [slots], flat indices into the bucket.
      lengths: int32 [members], the slots of each member (the same number in each of its chunks).
      sizes, starts: each member's entries and its first flat index in the bucket.
      chunk: entries a chunk (a member of fewer is one chunk); value_bits: 2, 3, 4 or 8.

    Returns:
      float32 [members + packed words] (bit-cast words; `chunk_unpack` reads them).

    Example:
      >>> words = tf_topk.ops.chunk_pack([1.0, -2.0], [0, 5], [2], sizes=[8], starts=[0], chunk=4,
      ...                                value_bits=2)
      >>> tf_topk.ops.chunk_unpack(words[None], [2], sizes=[8], starts=[0], chunk=4,
      ...                          value_bits=2)[0].numpy().tolist()
      [[1.0, -2.0]]
    """
    layout = _wire_layout(sizes, starts, chunk, value_bits)
    with tf.name_scope(name or "chunk_pack"):
        values = tf.convert_to_tensor(values)
        if values.dtype not in (tf.float32, tf.float64):
            raise TypeError(f"values must be float32 or float64, got {values.dtype.name}")
        return _chunk_pack_raw(tf.reshape(values, [-1]), tf.reshape(tf.cast(indices, tf.int32), [-1]),
                               tf.cast(lengths, tf.int32), **layout)


def chunk_unpack(rows, lengths, sizes, starts, chunk, value_bits, name=None):
    """`chunk_pack`'s words of every replica (rows, float32 [replicas, words]) read back: (values
    float32 [replicas, slots], c * 2**(e_m - o) each, and their flat indices int32 [replicas, slots]),
    in one pass on a CPU. The arguments are `chunk_pack`'s."""
    layout = _wire_layout(sizes, starts, chunk, value_bits)
    with tf.name_scope(name or "chunk_unpack"):
        return tuple(_chunk_unpack_raw(tf.convert_to_tensor(rows, tf.float32), tf.cast(lengths, tf.int32),
                                       **layout))
