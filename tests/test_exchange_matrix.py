"""SparseExchange against a numpy reference, over a matrix of configurations.

One process runs 1, 2 and 3 replicas (MirroredStrategy over logical CPUs).
Each cell is one exchange mode, output form, memory and bucket layout, run
for several steps. The
variables are chosen for the cases where offsets into a bucket and spare
slots matter: sizes that differ inside one bucket, a dense-path variable,
gradients with fewer non-zeros than k, an all-zero gradient and a None
gradient. Every replica's result, residuals and velocities are compared
with `Reference` after every step. The autopilot's parts (the default: its
route and density are its own) are checked for what must hold whatever it
picks: every entry sent or kept whole, the sum the same on every replica.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from selection_reference import chunk_sent, on_grid
from test_exchange_allreduce import top_k_indices

REPLICA_COUNTS = (1, 2, 3)
# Logical CPUs must exist before TensorFlow starts, so they are made when this
# module is imported (at collection, ahead of every test of the run).
try:
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * max(REPLICA_COUNTS))
except RuntimeError:  # TensorFlow already started: the `strategies` fixture says whether enough CPUs exist
    pass

import tf_topk  # noqa: E402
from tf_topk.routes import AUTO_AGREED_SLOTS, MODE_CODES, choose_mode  # noqa: E402
from tf_topk.exchange import SparseGradient, to_dense  # noqa: E402

MIN_SIZE, STEPS, MOMENTUM = 10, 4, 0.9
DENSITY, DENSE_DENSITY = 0.1, 0.6  # k is a handful; at 0.6 "auto" sends the bucket dense
FEW = 3  # non-zeros per replica and step of a "few" gradient, below its k

# (kind, shape) per variable, in the order the gradients are passed.
# full: every entry non-zero; few: FEW non-zeros; zero: all zeros; none: the
# gradient is None; dense: below MIN_SIZE, so on the dense path.
VARIABLES = [("full", (150,)), ("few", (10, 10)), ("dense", (3,)), ("none", (4, 5)), ("full", (7, 30)),
             ("zero", (40,))]
SIZES = [math.prod(shape) for _, shape in VARIABLES]
SPARSE = [v for v, size in enumerate(SIZES) if size >= MIN_SIZE]
DENSE = [v for v in range(len(VARIABLES)) if v not in SPARSE]
PRESENT = [v for v, (kind, _) in enumerate(VARIABLES) if kind != "none"]
NONE = [v for v in range(len(VARIABLES)) if v not in PRESENT]

MEMORIES = {
    "ef": dict(),
    "momentum": dict(momentum=MOMENTUM),  # the default: no momentum factor masking
    "nesterov": dict(momentum=MOMENTUM, nesterov=True, momentum_masking=True),  # DGC's masking
}
LAYOUTS = {"one_bucket": None, "per_variable": 8}  # bucket_bytes
CLOSE = dict(rtol=1e-6, atol=1e-6)
# A bfloat16 sum over replicas against the float32 sum of their rounded
# contributions: each of its P - 1 additions rounds to 8 significant bits, so
# the error is within 2^-8 * (P - 1) of the sum of their magnitudes.
BF16_ROUNDING = 2.0**-8


def gradients(replicas, step):
    """grads[r][v]: flat float32, or None; different per replica and step, no ties in magnitude."""
    grads = []
    for r in range(replicas):
        rng = np.random.default_rng([17, step, r])
        mine = []
        for (kind, _), size in zip(VARIABLES, SIZES):
            if kind == "none":
                mine.append(None)
                continue
            g = np.zeros(size, np.float32)
            if kind in ("full", "dense"):
                g[:] = rng.standard_normal(size)
            elif kind == "few":
                g[rng.choice(size, FEW, replace=False)] = rng.standard_normal(FEW)
            mine.append(g)
        grads.append(mine)
    return grads


def k_of(size, density):
    """The exchange's k: ceil(density * n), clipped to [1, n]."""
    return max(1, min(size, math.ceil(density * size)))


def top_k_non_zero(acc, k):
    """Indices of the k largest |acc|, without the zero entries (they send
    nothing); fails on a tie at the k-th magnitude, where the choice would
    be ambiguous."""
    order = top_k_indices(acc, acc.size)
    magnitudes = np.abs(acc[order])
    if k < acc.size and magnitudes[k - 1] != 0:
        assert magnitudes[k - 1] != magnitudes[k], "tie at the k-th magnitude: choose other gradients"
    chosen = order[:k]
    return chosen[acc[chosen] != 0]


def to_bfloat16(x):
    """float32 `x` rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def nominated(accumulated, k):
    """The agreed indices of one variable: the union of each replica's
    nominations, slot j of k holding replica (j mod P)'s (j // P)-th largest
    non-zero entry."""
    ranked = [top_k_non_zero(acc, k) for acc, _ in accumulated]
    replicas = len(ranked)
    return np.unique([ranked[j % replicas][j // replicas] for j in range(k)
                      if j // replicas < len(ranked[j % replicas])]).astype(np.int64)


class Reference:
    """Top-k exchange with error feedback or momentum correction, in numpy.

    Per replica r and sparsified variable, the accumulation is
      error feedback:      acc = g + residual
      momentum correction: u = m*u + g; acc = residual + u
      Nesterov:            u = m*(u + g); acc = residual + u + g
    and the entries sent depend on the bucket's mode:
      allgather: r's own top-k |acc| (k = ceil(density*n) in [1, n]); with
        selection_scope "bucket", r's top-K of the bucket's entries ranked
        by |acc| / rms(acc of its variable), K the sum of the members' k;
      allreduce: the nominated indices: of each variable's k slots (2k
        under "auto"), slot j holds replica (j mod P)'s (j // P)-th largest
        non-zero |acc| (none if it has fewer), and every replica sends its
        own acc at the union;
      dense:     every entry;
      allgather_int8: as allgather, each variable's sent values rounded to
        their 8-bit grid (`on_grid`; the rounding error stays in the
        residual), on every replica count;
      allgather_chunk: the top entries of every chunk, rounded on the
        chunk's 2-bit grid (`chunk_sent`; the rounding error stays in the
        residual), on every replica count;
      dense_bf16: every entry rounded to bfloat16 (the rounding error
        stays in the residual), summed in bfloat16 (`magnitudes`: the sum of
        the rounded contributions' magnitudes, which bounds that sum's error).
    Zero entries send nothing. The result is the sum over replicas of what
    they sent; r's residual is acc with its sent entries zeroed; with
    masking (where the memory asks for it), u is zeroed where r sent a
    non-zero value. One replica always
    takes the allgather path; "auto" takes per bucket the mode
    `choose_mode` picks for the bucket's pairs and entries.
    Dense-path variables: G = sum over replicas; with momentum the returned
    gradient is U = m*U + G (Nesterov: U = m*(U + G), returned U + G), U the
    same on every replica. A None gradient gives None and changes no state.
    """

    def __init__(self, replicas, mode, memory, layout, density, scope="variable"):
        self.replicas, self.mode, self.density, self.scope = replicas, mode, density, scope
        self.momentum = MEMORIES[memory].get("momentum")
        self.nesterov = MEMORIES[memory].get("nesterov", False)
        self.masking = MEMORIES[memory].get("momentum_masking", False)
        present = [v for v in SPARSE if v in PRESENT]
        self.buckets = [present] if LAYOUTS[layout] is None else [[v] for v in present]
        self.residuals = [{v: np.zeros(SIZES[v], np.float32) for v in SPARSE} for _ in range(replicas)]
        self.velocities = [{v: np.zeros(SIZES[v], np.float32) for v in SPARSE} for _ in range(replicas)]
        self.dense_velocities = {v: np.zeros(SIZES[v], np.float32) for v in DENSE}
        self.magnitudes = {}

    def bucket_mode(self, bucket):
        if self.mode in ("dense_bf16", "allgather_int8", "allgather_chunk"):
            return self.mode
        if self.replicas == 1 or self.mode == "allgather":
            return "allgather"
        if self.mode == "allreduce":
            return "allreduce"
        return choose_mode(self.replicas, sum(k_of(SIZES[v], self.density) for v in bucket),
                           sum(SIZES[v] for v in bucket))

    def accumulate(self, r, v, g):
        """(acc, new velocity) of replica r's variable v."""
        m = np.float32(self.momentum or 0.0)
        u = self.velocities[r][v]
        if self.momentum is None:
            return g + self.residuals[r][v], u
        if self.nesterov:
            u = m * (u + g)
            return (u + g) + self.residuals[r][v], u
        u = m * u + g
        return u + self.residuals[r][v], u

    def over_bucket(self, bucket, accumulations):
        """taken[r][v]: what replica r sends of each member v with selection_scope
        "bucket" (the bucket's K non-zero entries of largest |acc| / rms(acc))."""
        taken = []
        for r in range(self.replicas):
            scores = []
            for v in bucket:
                acc = accumulations[v][r][0]
                rms = np.sqrt(np.mean(np.square(acc)))
                scores.append(acc / rms if rms > 0 else np.zeros_like(acc))
            chosen = top_k_non_zero(np.concatenate(scores), sum(k_of(SIZES[v], self.density) for v in bucket))
            offsets = np.cumsum([0] + [SIZES[v] for v in bucket])
            taken.append({v: chosen[(chosen >= lo) & (chosen < hi)] - lo
                          for v, lo, hi in zip(bucket, offsets[:-1], offsets[1:])})
        return taken

    def step(self, grads, step):
        """The summed gradient of every variable (flat; None for a None
        gradient) and each bucket's mode; updates the state."""
        summed = [None] * len(VARIABLES)
        modes = []
        for bucket in self.buckets:
            mode = self.bucket_mode(bucket)
            modes.append(mode)
            accumulations = {v: [self.accumulate(r, v, grads[r][v]) for r in range(self.replicas)] for v in bucket}
            over_bucket = self.over_bucket(bucket, accumulations) if self.scope == "bucket" else None
            for v in bucket:
                accumulated = accumulations[v]
                k = k_of(SIZES[v], self.density)
                agreed = nominated(accumulated, min(SIZES[v], AUTO_AGREED_SLOTS * k) if self.mode == "auto" else k)
                total, magnitude = np.zeros(SIZES[v], np.float32), np.zeros(SIZES[v], np.float32)
                for r, (acc, u) in enumerate(accumulated):
                    if mode in ("dense", "dense_bf16"):
                        taken = np.arange(SIZES[v])
                    else:
                        taken = agreed if mode == "allreduce" else \
                            over_bucket[r][v] if over_bucket else top_k_non_zero(acc, k)
                    mask = np.zeros(SIZES[v], bool)
                    mask[taken] = True
                    sent = np.where(mask, to_bfloat16(acc) if mode == "dense_bf16" else acc, np.float32(0))
                    if mode == "allgather_int8":
                        sent = on_grid(sent)
                    elif mode == "allgather_chunk":
                        sent = chunk_sent(acc, k)
                    total += sent
                    magnitude += np.abs(sent)
                    self.residuals[r][v] = acc - sent
                    if self.momentum is not None:
                        self.velocities[r][v] = np.where(sent != 0, np.float32(0), u) if self.masking else u
                summed[v], self.magnitudes[v] = total, magnitude
        for v in DENSE:
            total = np.zeros(SIZES[v], np.float32)
            for r in range(self.replicas):
                total += grads[r][v]
            if self.momentum is not None:
                m, velocity = np.float32(self.momentum), self.dense_velocities[v]
                if self.nesterov:
                    self.dense_velocities[v] = m * (velocity + total)
                    total = self.dense_velocities[v] + total
                else:
                    self.dense_velocities[v] = m * velocity + total
                    total = self.dense_velocities[v]
            summed[v] = total
        return summed, modes


def cells():
    """The matrix, one pytest.param per cell, named replicas-mode-output-memory-layout[-density]."""
    params = []

    def add(replicas, mode, sparse_output, memory, layout, density=DENSITY, scope="variable"):
        name = f"P{replicas}-{mode}-{'sparse' if sparse_output else 'dense'}-{memory}-{layout}"
        if density != DENSITY:
            name += f"-d{density}"
        if scope != "variable":
            name += f"-{scope}"
        params.append(pytest.param(replicas, mode, sparse_output, memory, layout, density, scope, id=name))

    for replicas in REPLICA_COUNTS:
        # One replica: every mode takes the same local path, so one mode suffices.
        for mode in ("allreduce",) if replicas == 1 else ("allgather", "allreduce"):
            for sparse_output in (False, True):
                for memory in MEMORIES:
                    for layout in LAYOUTS:
                        add(replicas, mode, sparse_output, memory, layout)
    # "auto" takes one of the paths above (all_gather at P = 2 and 3, where
    # its agreed indices on 2k slots would send more; they are tested in
    # test_exchange_allreduce.py): its choice, with one memory; and at a
    # density where the dense all-reduce is the cheapest, where everything is sent.
    for replicas in (2, 3):
        for sparse_output in (False, True):
            for layout in LAYOUTS:
                add(replicas, "auto", sparse_output, "ef", layout)
            for memory in ("ef", "nesterov"):
                add(replicas, "auto", sparse_output, memory, "one_bucket", DENSE_DENSITY)
    # The 16-bit dense route: every replica count, both outputs (it always
    # hands out dense gradients), with and without momentum.
    for replicas in REPLICA_COUNTS:
        for sparse_output in (False, True):
            add(replicas, "dense_bf16", sparse_output, "ef", "one_bucket")
        add(replicas, "dense_bf16", False, "nesterov", "per_variable")
    # Pairs in 32-bit words: every replica count, both outputs, the three memories, both layouts.
    for replicas in REPLICA_COUNTS:
        for sparse_output in (False, True):
            add(replicas, "allgather_int8", sparse_output, "ef", "one_bucket")
        add(replicas, "allgather_int8", False, "nesterov", "per_variable")
        add(replicas, "allgather_int8", True, "momentum", "per_variable")
    # Each chunk's top entries in 14 bits: every replica count, both outputs, the three memories, both layouts.
    for replicas in REPLICA_COUNTS:
        for sparse_output in (False, True):
            add(replicas, "allgather_chunk", sparse_output, "ef", "one_bucket")
        add(replicas, "allgather_chunk", False, "nesterov", "per_variable")
        add(replicas, "allgather_chunk", True, "momentum", "per_variable")
    # One selection over the bucket: all_gather, dense output, every memory;
    # one variable per bucket is k per variable again.
    for replicas in REPLICA_COUNTS:
        for memory in MEMORIES:
            add(replicas, "allgather", False, memory, "one_bucket", scope="bucket")
        add(replicas, "allgather", False, "ef", "per_variable", scope="bucket")
    return params


def mirrored_strategy(replicas):
    """MirroredStrategy over the first `replicas` logical CPUs, with collective
    keys of its own: every MirroredStrategy numbers its collective groups from
    1, so strategies of different sizes in one process would join the same
    group and abort ("joining a group with size 3, but that group has size
    2"). TensorFlow's own tests separate them the same way
    (tensorflow/python/distribute/strategy_combinations.py)."""

    class Strategy(tf.distribute.MirroredStrategy):
        _collective_key_base = 100_000 * replicas

    return Strategy([f"/cpu:{i}" for i in range(replicas)])


@pytest.fixture(scope="module")
def strategies():
    """One MirroredStrategy per replica count, over logical CPUs of this process."""
    cpus = tf.config.list_logical_devices("CPU")
    assert len(cpus) >= max(REPLICA_COUNTS), (
        f"need {max(REPLICA_COUNTS)} logical CPUs, TensorFlow started with {len(cpus)}: something in this "
        "process initialised TensorFlow before tests/test_exchange_matrix.py was imported")
    return {p: mirrored_strategy(p) for p in REPLICA_COUNTS}


def make_step(strategy, exchange, traced_results):
    """One tf.function for every step of a cell: each replica takes its row of
    the stacked gradients; returns the present variables' results by position."""

    @tf.function
    def step(stacked, s):
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [tf.gather(stacked[v], r) if v in PRESENT else None for v in range(len(VARIABLES))]
            result = exchange(grads, step=s)
            traced_results.append(result)
            return ({v: result.grads[v] for v in PRESENT}, result.all_finite,
                    result.stats["exchange_mode"])

        return strategy.run(replica_fn)

    return step


def check_sparse_gradient(local_grads, shape, expected, where):
    """Every replica's SparseGradient: indices in [0, n), spare slots (value 0)
    at index 0, no index twice in a row (a 1-D one is one row), the same
    pairs bitwise everywhere, and its densified sum equal to the reference."""
    n = math.prod(shape)
    first = None
    for r, grad in enumerate(local_grads):
        assert isinstance(grad, SparseGradient), f"{where}: replica {r} got {type(grad).__name__}"
        values, indices = grad.values.numpy(), grad.indices.numpy()
        assert values.shape == indices.shape, f"{where}: replica {r}: {values.shape} values, {indices.shape} indices"
        bad = indices[(indices < 0) | (indices >= n)]
        assert bad.size == 0, f"{where}: replica {r} has indices outside [0, {n}): {sorted(set(bad.tolist()))}"
        spare = indices[values == 0]
        assert np.all(spare == 0), f"{where}: replica {r} has value 0 at indices {sorted(set(spare.tolist()))}"
        for row, (row_values, row_indices) in enumerate(zip(np.atleast_2d(values), np.atleast_2d(indices))):
            sent = row_indices[row_values != 0]
            assert np.unique(sent).size == sent.size, f"{where}: replica {r} row {row} repeats an index: {sent}"
        if first is None:
            first = values, indices
            np.testing.assert_allclose(to_dense(grad, shape).numpy().reshape(-1), expected, **CLOSE,
                                       err_msg=where)
        else:
            np.testing.assert_array_equal(values, first[0], err_msg=f"{where}: replica {r} values")
            np.testing.assert_array_equal(indices, first[1], err_msg=f"{where}: replica {r} indices")


def check_dense_gradient(local_grads, shape, expected, where, error_bound=None):
    """Every replica's dense gradient: its shape, bitwise the same everywhere,
    equal to the reference (within `error_bound` per entry when given)."""
    first = local_grads[0].numpy()
    assert first.shape == shape, where
    if error_bound is None:
        np.testing.assert_allclose(first.reshape(-1), expected, **CLOSE, err_msg=where)
    else:
        error = np.abs(first.reshape(-1) - expected)
        assert np.all(error <= error_bound + 1e-7), f"{where}: off by {error.max()} (bound {error_bound.max()})"
    for r, grad in enumerate(local_grads[1:], 1):
        np.testing.assert_array_equal(grad.numpy(), first, err_msg=f"{where}: replica {r}")


def check_state(strategy, variables, expected, where):
    """Per-replica state variables against the reference's per-replica arrays."""
    for variable, v in variables:
        for r, local in enumerate(strategy.experimental_local_results(variable)):
            np.testing.assert_allclose(local.numpy().reshape(-1), expected(r, v), **CLOSE,
                                       err_msg=f"{where}: replica {r} variable {v}")


@pytest.mark.slow
@pytest.mark.parametrize("replicas, mode, sparse_output, memory, layout, density, scope", cells())
def test_exchange_matches_numpy(strategies, replicas, mode, sparse_output, memory, layout, density, scope):
    """Every step: each replica's results, bitwise the same on all, and its own
    state equal the reference; the mode statistic says which path was taken."""
    strategy = strategies[replicas]
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(shape), name=f"v{v}") for v, (_, shape) in enumerate(VARIABLES)]
        exchange = tf_topk.SparseExchange(variables, density=density, method="exact", min_size=MIN_SIZE,
                                          exchange_mode=mode, sparse_output=sparse_output,
                                          bucket_bytes=LAYOUTS[layout], selection_scope=scope,
                                          **MEMORIES[memory])
    assert exchange.sparse_positions == SPARSE
    reference = Reference(replicas, mode, memory, layout, density, scope)
    traced = []
    step = make_step(strategy, exchange, traced)
    local = strategy.experimental_local_results
    for s in range(STEPS):
        grads = gradients(replicas, s)
        stacked = {v: tf.constant(np.stack([grads[r][v].reshape(VARIABLES[v][1]) for r in range(replicas)]))
                   for v in PRESENT}
        out, all_finite, exchange_mode = step(stacked, tf.constant(s))
        expected, modes = reference.step(grads, s)
        where = f"step {s}"
        assert [bool(f) for f in local(all_finite)] == [True] * replicas, where
        assert [float(x) for x in local(exchange_mode)] == \
            [np.mean([MODE_CODES[m] for m in modes])] * replicas, f"{where}: modes {modes}"
        bucket_of = {v: i for i, bucket in enumerate(reference.buckets) for v in bucket}
        for v in PRESENT:
            shape = VARIABLES[v][1]
            at = f"{where}, variable {v} {VARIABLES[v][0]}{shape}"
            # A bucket sent dense comes back dense, sparse_output or not.
            bucket_mode = modes[bucket_of[v]] if v in SPARSE else "dense"
            if sparse_output and bucket_mode not in ("dense", "dense_bf16"):
                check_sparse_gradient(local(out[v]), shape, expected[v], at)
            else:
                bound = (BF16_ROUNDING * (replicas - 1) * reference.magnitudes[v]
                         if bucket_mode == "dense_bf16" else None)
                check_dense_gradient(local(out[v]), shape, expected[v], at, bound)
        slot = {v: i for i, v in enumerate(SPARSE)}
        check_state(strategy, [(exchange.residuals[slot[v]], v) for v in SPARSE],
                    lambda r, v: reference.residuals[r][v], f"{where} residual")
        if reference.momentum is not None:
            check_state(strategy, [(exchange.memory.velocities[slot[v]], v) for v in SPARSE],
                        lambda r, v: reference.velocities[r][v], f"{where} velocity")
            check_state(strategy, [(u, v) for u, v in zip(exchange.memory.dense_velocities, DENSE)],
                        lambda r, v: reference.dense_velocities[v], f"{where} dense velocity")
    assert traced and all(result.grads[v] is None for result in traced for v in NONE)
    assert step.experimental_get_tracing_count() == 1  # traced once for every step


# -- the default: the autopilot ---------------------------------------------------------------------


def read_locals(strategy, variables):
    return [[local.numpy().reshape(-1) for local in strategy.experimental_local_results(v)] for v in variables]


@pytest.mark.slow
@pytest.mark.parametrize("replicas, sparse_output, memory, layout, link", [
    pytest.param(p, sparse_output, memory, layout, link,
                 id=f"P{p}-{'sparse' if sparse_output else 'dense'}-{memory}-{layout}-{link}")
    for p in (2, 3)
    for sparse_output, memory, layout in ((False, "ef", "one_bucket"), (True, "ef", "per_variable"),
                                          (True, "momentum", "one_bucket"), (False, "nesterov", "per_variable"))
    for link in ("measured", "100mbit")])
def test_the_autopilot_keeps_every_entry_it_does_not_send(strategies, replicas, sparse_output, memory, layout,
                                                          link):
    """"measured": no density given, so the autopilot measures these replicas and picks the route and the
    density (on logical CPUs usually every entry, dense). "100mbit": the parts its plan makes for a
    typed-in 100 Mbit/s link (a TimedRouter and an adaptive density: sparse). Whatever was picked, each
    step hands every replica the same sum, and that sum is exactly what the replicas accumulated minus
    what they kept: an entry is sent or kept whole (with momentum correction and masking, its velocity
    cleared where it was sent, or, where every entry is sent, kept whole: the momentum of the summed
    gradient; unmasked, kept whole)."""
    from tf_topk.autopilot import Plan
    from tf_topk.cost import CostModel

    strategy = strategies[replicas]
    options = dict(min_size=MIN_SIZE, sparse_output=sparse_output, bucket_bytes=LAYOUTS[layout], **MEMORIES[memory])
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(shape), name=f"v{v}") for v, (_, shape) in enumerate(VARIABLES)]
        if link == "measured":
            exchange = tf_topk.SparseExchange(variables, **options)
            plan = exchange.autopilot_plan
            assert plan is not None and plan.model.replicas == replicas and plan.calibration is not None
        else:
            plan = Plan(CostModel.from_link(replicas, link), None, sum(SIZES[v] for v in SPARSE))
            assert plan.dense_route() is None
            exchange = tf_topk.SparseExchange(variables, density=plan.density(), router=plan.router(), **options)
    assert exchange.sparse_positions == SPARSE
    m = np.float32(MEMORIES[memory].get("momentum", 0.0))
    nesterov = MEMORIES[memory].get("nesterov", False)
    masking = MEMORIES[memory].get("momentum_masking", False)
    velocities = exchange.memory.velocities if m else []
    step = make_step(strategy, exchange, [])
    local = strategy.experimental_local_results
    bf16 = plan.dense_route() == "dense_bf16"
    dense_velocity = {v: np.zeros(SIZES[v], np.float32) for v in DENSE}
    kept_any = False
    for s in range(STEPS):
        grads = gradients(replicas, s)
        residuals_before = read_locals(strategy, exchange.residuals)
        velocities_before = read_locals(strategy, velocities)
        stacked = {v: tf.constant(np.stack([grads[r][v].reshape(VARIABLES[v][1]) for r in range(replicas)]))
                   for v in PRESENT}
        out, all_finite, _ = step(stacked, tf.constant(s))
        assert [bool(f) for f in local(all_finite)] == [True] * replicas
        residuals_after = read_locals(strategy, exchange.residuals)
        velocities_after = read_locals(strategy, velocities)
        for slot, v in enumerate(SPARSE):
            if v not in PRESENT:
                continue
            where = f"step {s}, variable {v} {VARIABLES[v]}, plan: {plan.describe()}"
            expected, magnitude = np.zeros(SIZES[v], np.float32), np.zeros(SIZES[v], np.float32)
            for r in range(replicas):
                if nesterov:
                    u = m * (velocities_before[slot][r] + grads[r][v])
                    accumulated = u + grads[r][v] + residuals_before[slot][r]
                else:
                    u = m * velocities_before[slot][r] + grads[r][v] if m else grads[r][v]
                    accumulated = u + residuals_before[slot][r]
                kept = residuals_after[slot][r]
                sent = accumulated - kept
                if not bf16:  # sent or kept whole; bfloat16 keeps its rounding error
                    np.testing.assert_allclose(np.where(kept != 0, sent, 0), 0, atol=1e-6, err_msg=where)
                if m:  # kept whole where every entry is sent (the plan went dense) or unmasked
                    velocity = u if plan.dense_route() or not masking else np.where(sent != 0, 0, u)
                    np.testing.assert_allclose(velocities_after[slot][r], velocity, **CLOSE, err_msg=where)
                expected += sent
                magnitude += np.abs(sent)
            results = [to_dense(g, VARIABLES[v][1]) if isinstance(g, SparseGradient) else g for g in local(out[v])]
            check_dense_gradient(results, VARIABLES[v][1], expected, where,
                                 BF16_ROUNDING * (replicas - 1) * magnitude if bf16 else None)
            kept_any = kept_any or any(np.any(residuals_after[slot][r] != 0) for r in range(replicas))
        for v in DENSE:
            total = sum(grads[r][v] for r in range(replicas))
            if nesterov:
                dense_velocity[v] = m * (dense_velocity[v] + total)
                total = dense_velocity[v] + total
            elif m:
                dense_velocity[v] = m * dense_velocity[v] + total
                total = dense_velocity[v]
            check_dense_gradient(local(out[v]), VARIABLES[v][1], total, f"step {s}, dense-path variable {v}")
    assert kept_any == (plan.dense_route() is None), plan.describe()  # sparse parts keep entries back
