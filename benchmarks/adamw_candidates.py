"""Trials of methods for AdamW at a low density on the language tasks, one JSON line per seed, and the
paired summary of such lines (benchmarks/RESULTS.md, "Decoupled momentum for AdamW (DeMo)").

    python benchmarks/adamw_candidates.py run VARIANT DENSITY SEEDS -- CONVERGENCE ARGUMENTS
    python benchmarks/adamw_candidates.py summarize FILE.jsonl

`run` trains with `tf_topk.bench.convergence`'s model, data and loop (`train_one`; the arguments after
`--` are the benchmark's own, e.g. `--dataset prose --steps 2000 --replicas 2`), the optimizer made by
VARIANT, and prints {"variant", "density", "seed", "dataset", "steps", "replicas", "inner", "final", "curve"}
per seed ("inner": the inner optimizer, e.g. with `--global-clipnorm 1.0`). VARIANT is a name and options, `name:key=value,...`:

    dense                      the inner AdamW alone
    lion                       Keras's Lion at AdamW's rate and weight decay, dense (a sign method
                               with no compression: what the sign step costs by itself)
    topk_ef                    top-k + error feedback in front of AdamW (decoupled_momentum=False)
    mc                         Adam's momentum correction (vw=: its variance warm-up, default 10%)
    demo                       decoupled momentum (the library's DecoupledMomentumMemory); options:
                               decay=, chunk= (the DCT's block side), sign=0 (the decoded sum, not its
                               sign), scale= (its step_scale: the sign step in units of the rate;
                               demo and demoq take the library's, 2.0 since 2026-12-07 and
                               1.0 in every line before; with an option below 1.0, as it was
                               measured), and at most one of rms=1 (the
                               decoded sum over its root mean square), smooth=B (a moving average of
                               the sign), inner=1 (the decoded sum as the inner AdamW's gradient),
                               adam=W (Adam's direction of the decoded sum for the first W steps, then
                               the sign), dense=W (every entry sent and dense AdamW for the first W
                               steps, then DeMo), rows=1 or rows=embeddings (the DCT along the last axis only,
                               for every variable or for embedding tables), vocab=N (no DCT along a
                               side of N entries: an embedding table's rows, the output's columns),
                               apart=0 (2-D blocks for embedding tables too: the default until
                               2026-12-04, which every demo figure before that date measured)
    default                    `TopKOptimizer(AdamW, density=DENSITY)` as a user writes it, whatever the library
                               chooses (decoupled momentum at 0.01 or less); link=R: no density given,
                               the autopilot's plan for the stated link R (e.g. link=100mbit; DENSITY is
                               then only the line's label)
    demoq                      demo with a chunk-wise selection (QuantizedChunkSelector: qchunk= entries a
                               chunk, bits= 8, 4 or 2 for quantized values)

and for every variant but dense: warm= the density warm-up ("auto", the library's default, or steps), and
mode= the exchange_mode (e.g. mode=allgather_int8: values in 8 bits, the rounding error kept); demo
also takes vbits=B: the allgather_chunk route with B-bit values (2, 3, 4 or 8; its default is 2).

`summarize` pairs each variant's seeds with dense's of the same dataset, steps, replicas and inner
optimizer's clipping, and prints
the mean difference in nats/byte with its 95% t-interval.
"""

import collections
import json
import math
import statistics
import sys
import time

import tensorflow as tf

import tf_topk.memory
import tf_topk.selector
from tf_topk.decoupled_momentum import DEFAULT_STEP_SCALE, BlockDCT, DecoupledMomentumMemory
from tf_topk.bench.suite import paired_interval

class QuantizedChunkSelector(tf_topk.selector.Selector):
    """The largest magnitudes of each fixed-size chunk of the flat tensor, k / chunks of them per chunk
    (SparseLoCo's and DeMo's chunk-wise top-k), their values optionally quantized to `value_bits`.

    Why chunks: an index within a chunk of `chunk` entries takes log2(chunk) bits (12 for 4096), not
    32, and where the chunks tile a blockwise transform (`tf_topk.decoupled_momentum`), each block sends
    as many components. Why quantize: a value in 8 or 2 bits beside a 12-bit index sends 2.5 or 1.75
    bytes a pair where float32 and an int32 index send 8, so the same bytes carry 3.2x or 4.6x the
    entries. The values returned are the quantized ones, so the quantization's error stays in the
    residual (error feedback), as what was not sent does. Quantization is symmetric and uniform per
    chunk, scaled by the chunk's largest selected magnitude: 2**bits levels without zero, the largest
    exact (2 bits: +-1/3 and +-1 times it).

    k below the number of chunks: one per chunk, then the k largest of those. Spare slots (k beyond
    what the chunks give) hold value 0 at index 0. Unlike `tf_topk.selector.ChunkTopKSelector` (each
    chunk offers ceil(k / chunks), the k largest of all offered are sent), each chunk sends k // chunks
    of its own, so that every chunk's pairs share one scale and one index width.
    """

    def __init__(self, chunk=4096, value_bits=None):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        if value_bits is not None and (isinstance(value_bits, bool) or value_bits not in (2, 4, 8)):
            raise ValueError(f"value_bits must be None, 2, 4 or 8, got {value_bits!r}")
        self.chunk, self.value_bits = chunk, value_bits

    def select(self, accumulated, k):
        n = int(accumulated.shape[0])
        chunks = -(-n // self.chunk)
        padded = tf.reshape(tf.pad(accumulated, [[0, chunks * self.chunk - n]]), [chunks, self.chunk])
        k = tf.convert_to_tensor(k, tf.int32)
        per_chunk = tf.maximum(1, k // chunks)
        _, local = tf.math.top_k(tf.abs(padded), per_chunk, sorted=False)
        values = tf.gather(padded, local, batch_dims=1)
        if self.value_bits is not None:
            values = _quantized(values, self.value_bits)
        indices = tf.reshape(local + self.chunk * tf.range(chunks)[:, None], [-1])
        values = tf.reshape(values, [-1])
        taken = tf.minimum(k, tf.size(values))
        _, order = tf.math.top_k(tf.abs(values), taken, sorted=False)
        values, indices = tf.gather(values, order), tf.gather(indices, order)
        spare = k - taken
        return (tf.concat([values, tf.zeros([spare], values.dtype)], 0),
                tf.concat([indices, tf.zeros([spare], tf.int32)], 0))

    def __repr__(self):
        return f"QuantizedChunkSelector(chunk={self.chunk}, value_bits={self.value_bits})"


def _quantized(values, bits):
    """Each row of `values` on 2**bits symmetric uniform levels without zero, the largest magnitude of
    the row exact: levels (2i + 1) * step / 2 for i < 2**(bits-1), step = 2 * max / (2**bits - 1)."""
    half = 2 ** (bits - 1)
    largest = tf.reduce_max(tf.abs(values), axis=1, keepdims=True)
    step = 2.0 * largest / (2 * half - 1)
    level = tf.clip_by_value(tf.floor(tf.math.divide_no_nan(tf.abs(values), step)), 0, half - 1)
    quantized = tf.sign(values) * (level + 0.5) * step
    return tf.where(tf.equal(values, 0), tf.zeros_like(values), quantized)


def pair_bytes(value_bits, chunk, scale_bits=16):
    """Bytes a (value, index) pair of QuantizedChunkSelector would take on a wire, and a chunk's scale:
    value_bits (32 unquantized) and log2(chunk) bits of index within the chunk."""
    return (value_bits + math.ceil(math.log2(chunk))) / 8.0, scale_bits / 8.0 if value_bits < 32 else 0.0



class ThroughInner(DecoupledMomentumMemory):
    """inner=1: the decoded sum goes to the inner optimizer as the gradient."""

    applies_update = False


class RootMeanSquare(DecoupledMomentumMemory):
    """rms=1: the decoded sum over its root mean square on the variable (built with sign=False), times
    scale=."""

    def apply_sparse(self, slot, summed, keep):
        decoded = super().apply_sparse(slot, summed, keep)
        return self.step_scale * decoded * tf.math.rsqrt(tf.reduce_mean(tf.square(decoded)) + 1e-30)


class SmoothedSign(DecoupledMomentumMemory):
    """smooth=B: a moving average (B) of the sign, per replica."""

    def __init__(self, smooth, **options):
        super().__init__(**options)
        self.smooth = smooth

    def build(self, variables, make_state):
        super().build(variables, make_state)
        self.smoothed = [make_state(v, tf.float32, "smoothed_sign", True) for v in variables]

    def apply_sparse(self, slot, summed, keep):
        average = self.smoothed[slot]
        new = self.smooth * average + (1.0 - self.smooth) * tf.cast(super().apply_sparse(slot, summed, keep),
                                                                    tf.float32)
        with tf.control_dependencies([average.assign(new)]):
            return tf.cast(tf.identity(new), summed.dtype)


class AdamThenSign(DecoupledMomentumMemory):
    """adam=W: for the first W kept steps the direction is Adam's (Keras's AdamW defaults: beta_1 0.9,
    beta_2 0.999, epsilon 1e-7, bias-corrected) of the decoded sum, with moments the same on every
    replica; then the sign, as by default. Why: early in a run an entry whose gradient is noise moves
    lr a step under the sign and much less under Adam, and the early steps are where the default falls
    behind dense AdamW (prose, 8 seeds: +0.127 nats/byte at step 250, +0.023 at 2,000)."""

    BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7

    def __init__(self, adam_steps, **options):
        super().__init__(**options)
        self.adam_steps = adam_steps

    def build(self, variables, make_state):
        super().build(variables, make_state)
        self.first = [make_state(v, tf.float32, "adam_m", True) for v in variables]
        self.second = [make_state(v, tf.float32, "adam_v", True) for v in variables]
        self.steps = make_state(tf_topk.memory._Shaped(None, [], name="adam_then_sign"), tf.int64, "adam_steps", True)

    @property
    def state_variables(self):
        return super().state_variables + self.first + self.second + [self.steps]

    def finish_step(self):
        self.steps.assign_add(1)

    def adam_direction(self, first, second, t):
        """Adam's direction from the moments after step t (1 for the first), epsilon bias-corrected."""
        return (first / (1.0 - self.BETA_1 ** t)) / (tf.sqrt(second / (1.0 - self.BETA_2 ** t)) + self.EPSILON)

    def apply_sparse(self, slot, summed, keep):
        decoded = self.transforms[slot].inverse(tf.cast(tf.reshape(summed, [-1]), tf.float32))
        first, second = self.first[slot], self.second[slot]
        new_first = self.BETA_1 * tf.reshape(first, [-1]) + (1.0 - self.BETA_1) * decoded
        new_second = self.BETA_2 * tf.reshape(second, [-1]) + (1.0 - self.BETA_2) * tf.square(decoded)
        adam = self.adam_direction(new_first, new_second, tf.cast(self.steps, tf.float32) + 1.0)
        direction = tf.where(self.steps < self.adam_steps, adam, tf.sign(decoded))
        with tf.control_dependencies([first.assign(tf.reshape(tf.where(keep, new_first, tf.reshape(first, [-1])),
                                                              first.shape)),
                                      second.assign(tf.reshape(tf.where(keep, new_second, tf.reshape(second, [-1])),
                                                               second.shape))]):
            return tf.reshape(tf.cast(direction, summed.dtype), tf.shape(summed))


class DenseAdamFirst(AdamThenSign):
    """dense=W: for the first W kept steps every entry is sent (the exchange's dense steps, as Adam's
    momentum correction warms up) and the direction is Adam's of the summed gradient: dense AdamW
    exactly, since the residual stays empty; then DeMo from an empty momentum. Why: on prose the
    default's gap to dense AdamW is widest at step 250 (+0.127 nats/byte at 0.01, 8 seeds), inside its
    density warm-up and at densities (0.05) that do not set it, and what it lags by then is still being
    made up at step 2,000; the dense all-reduce costs those W steps dense's bytes."""

    may_send_every_entry = True

    def sends_every_entry(self):
        return self.steps < self.adam_steps

    def adam_direction(self, first, second, t):
        """Keras's: epsilon added to sqrt(v) before the bias correction."""
        return first * (tf.sqrt(1.0 - self.BETA_2 ** t) / (1.0 - self.BETA_1 ** t)) / (tf.sqrt(second) + self.EPSILON)


class RowsApart(DecoupledMomentumMemory):
    """rows=1: every variable's DCT along its last axis only; rows=embeddings: only embedding tables'
    (a variable whose path names "embeddings"), whose rows are unrelated tokens that a 2-D block mixes,
    so that a row no batch touched moves by the sign of its neighbours' momentum; vocab=N: no DCT
    along a matrix's side of N entries (the vocabulary: an embedding table's rows, the output
    layer's columns)."""

    def __init__(self, rows=None, vocabulary=None, **options):
        super().__init__(**{**options, "embedding_rows_apart": False})  # these rules alone, as measured
        if rows not in (None, "1", "embeddings"):
            raise SystemExit(f"rows= takes 1 or embeddings, got {rows!r}")
        self.rows, self.vocabulary = rows, vocabulary

    def build(self, variables, make_state):
        super().build(variables, make_state)
        for slot, variable in enumerate(variables):
            shape = [int(d) for d in variable.shape]
            if self.vocabulary is not None:
                if len(shape) == 2 and shape[0] == self.vocabulary:
                    self.transforms[slot] = BlockDCT(shape, self.chunk, rows_apart=True)
                elif len(shape) >= 2 and shape[-1] == self.vocabulary:
                    self.transforms[slot] = BlockDCT(shape, self.chunk, columns_apart=True)
            elif self.rows == "1" or "embeddings" in (getattr(variable, "path", None) or variable.name):
                self.transforms[slot] = BlockDCT(shape, self.chunk, rows_apart=True)


def decoupled_memory(options):
    """The DecoupledMomentumMemory, or the trial's subclass of it, that `options` ask for (at most one
    of inner=, rms=, smooth=, adam=, dense=, rows=, vocab=; scale= with any of them)."""
    special = [key for key in ("inner", "rms", "smooth", "adam", "dense", "rows", "vocab") if key in options]
    if len(special) > 1:
        raise SystemExit(f"at most one of inner=, rms=, smooth=, adam=, dense=, rows=, vocab= at a time, got "
                         f"{', '.join(special)}")
    through_inner, rms = options.get("inner", "0") == "1", options.get("rms", "0") == "1"
    common = dict(decay=float(options.get("decay", 0.999)), chunk=int(options.get("chunk", 64)),
                  sign=options.get("sign", "0" if through_inner or rms else "1") == "1",
                  embedding_rows_apart=options.get("apart", "1") == "1",
                  step_scale=float(options.get("scale", 1.0 if special else DEFAULT_STEP_SCALE)))
    if through_inner:
        return ThroughInner(**common)
    if rms:
        return RootMeanSquare(**common)
    if "smooth" in options:
        return SmoothedSign(float(options["smooth"]), **common)
    if "adam" in options:
        return AdamThenSign(int(options["adam"]), **common)
    if "dense" in options:
        return DenseAdamFirst(int(options["dense"]), **common)
    if "rows" in options or "vocab" in options:
        return RowsApart(options.get("rows"), int(options["vocab"]) if "vocab" in options else None, **common)
    return DecoupledMomentumMemory(**common)


UNCOMPRESSED = ("dense", "lion")  # Keras's optimizers alone: no TopKOptimizer, no compression statistics


def make_builder(variant, density):
    """optimizer_for(keras, args) of one variant (see the module's docstring)."""
    name, _, text = variant.partition(":")
    options = dict(pair.split("=") for pair in text.split(",") if pair)
    known = {"dense", "lion", "topk_ef", "mc", "demo", "demoq", "default"}
    if name not in known:
        raise SystemExit(f"unknown variant {name!r}: one of {', '.join(sorted(known))}")

    def build(keras, args):
        import tf_topk
        from tf_topk.bench import convergence
        inner = convergence.make_inner(keras, args, args.steps)
        if name == "dense":
            return inner
        if name == "lion":
            return keras.optimizers.Lion(args.learning_rate, weight_decay=args.weight_decay)
        warm = options.get("warm", "auto")
        common = dict(density=density, density_warmup_steps=warm if warm == "auto" else int(warm),
                      exchange_mode=options.get("mode", "auto"))
        if name == "default":
            if "link" in options:
                return tf_topk.TopKOptimizer(inner, link=options["link"],
                                             exchange_mode=options.get("mode", "auto"))
            return tf_topk.TopKOptimizer(inner, **common)
        if name == "topk_ef":
            return tf_topk.TopKOptimizer(inner, decoupled_momentum=False, **common)
        if name == "mc":
            return tf_topk.TopKOptimizer(inner, momentum_correction=True,
                                         variance_warmup_steps=int(options.get("vw", args.steps // 10)), **common)
        memory = decoupled_memory(options)
        if name == "demo" and "vbits" in options:  # the chunk route at another value width
            from tf_topk.routes import ChunkAllGatherRoute, FixedRouter
            common.pop("exchange_mode")
            router = FixedRouter(ChunkAllGatherRoute(value_bits=int(options["vbits"])))
            return tf_topk.TopKOptimizer(inner, memory=memory, router=router, **common)
        if name == "demo":
            return tf_topk.TopKOptimizer(inner, memory=memory, **common)
        selector = QuantizedChunkSelector(int(options.get("qchunk", 4096)), int(options["bits"]) if "bits" in options
                                     else None)
        return tf_topk.TopKOptimizer(inner, memory=memory, selector=selector, **common)

    return build


def run(variant, density, seeds, argv):
    from tf_topk.bench import convergence

    args = convergence.parse_args(argv)
    if args.replicas > 1:
        convergence.split_cpu(args.replicas)
    data = convergence.load_data(args.dataset)
    strategy = convergence.replica_strategy(args.replicas)
    build = make_builder(variant, density)
    for seed in seeds:
        started = time.monotonic()
        uncompressed = variant.partition(":")[0] in UNCOMPRESSED
        result = convergence.train_one("dense" if uncompressed else "trial", density, seed, data, args,
                                       strategy, optimizer_for=build)
        print(json.dumps({"variant": variant, "density": density, "seed": seed, "dataset": args.dataset,
                          "steps": args.steps, "replicas": args.replicas, "inner": convergence.optimizer_name(args),
                          "final": result["val_loss"][-1],
                          "curve": [round(v, 4) for v in result["val_loss"]],
                          "seconds": round(time.monotonic() - started, 1)}), flush=True)


def summarize(lines):
    """Rows (dataset, steps, replicas, variant, density, seeds, dense mean, mean difference, low, high)."""
    runs = [json.loads(line) for line in lines if line.strip()]
    # The inner optimizer's options (a line written before they were recorded ran the default AdamW's).
    dense = {(r["dataset"], r["steps"], r.get("replicas", 1), _inner_options(r), r["seed"]): r["final"]
             for r in runs if r["variant"] == "dense"}
    groups = collections.defaultdict(dict)
    for r in runs:
        if r["variant"] != "dense":
            key = (r["dataset"], r["steps"], r.get("replicas", 1), r["variant"], r["density"], _inner_options(r))
            groups[key][r["seed"]] = r["final"]
    rows = []
    for (dataset, steps, replicas, variant, density, inner), finals in sorted(groups.items(), key=str):
        # One replica's dense run is dense at any replica count (the same global batch and update).
        paired = sorted(seed for seed in finals if (dataset, steps, 1, inner, seed) in dense)
        if not paired:
            continue
        differences = [finals[seed] - dense[(dataset, steps, 1, inner, seed)] for seed in paired]
        mean, low, high = paired_interval(differences)
        shown = variant if not inner else f"{variant} [{inner}]"
        rows.append((dataset, steps, replicas, shown, density, paired,
                     statistics.fmean(dense[(dataset, steps, 1, inner, seed)] for seed in paired), mean, low, high))
    return rows


def _inner_options(run):
    """What a run's inner optimizer adds to the default AdamW (its clipping), "" for none."""
    inner = run.get("inner", "")
    return inner[inner.index("global_clipnorm"):].rstrip(")") if "global_clipnorm" in inner else ""


def main(argv):
    if len(argv) >= 2 and argv[0] == "summarize":
        with open(argv[1]) as lines:
            for dataset, steps, replicas, variant, density, seeds, dense, mean, low, high in summarize(lines):
                print(f"{dataset:6} {steps:5} steps {replicas} replica(s) {variant:32} {density:<7g} seeds "
                      f"{','.join(map(str, seeds)):8} dense {dense:.4f}  {mean:+.3f} ({low:+.3f} to {high:+.3f})")
        return 0
    if len(argv) < 4 or argv[0] != "run":
        raise SystemExit(__doc__)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    run(argv[1], float(argv[2]), [int(s) for s in argv[3].split(",")], rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
