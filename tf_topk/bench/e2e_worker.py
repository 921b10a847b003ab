"""One worker of the end-to-end benchmark (`python -m tf_topk.bench e2e`); not run by hand.

Started by `tf_topk.bench.e2e` through `tf_topk.launch.run_workers`, with
TF_CONFIG set, inside its network namespace (`ip netns exec <ns> python -m
tf_topk.bench.e2e_worker ...`) or on localhost (`--no-netns`). It trains one
configuration under MultiWorkerMirroredStrategy with a custom loop:

    dense         the plain optimizer: Keras's dense all-reduce of every gradient
    topk:<d>      tf_topk.TopKOptimizer(same optimizer, density=d, density_warmup_steps=0):
                  the density's own steps timed (a run's steps after its warm-up)
    topk:<d>@<m>  the same with exchange_mode=m (allgather, allreduce, auto)
    dgc:<d>       the same with momentum_correction=True, sparse_updates=True:
                  the momentum moves into the exchange, and the update touches
                  only the entries sent
    adaptive      TopKOptimizer(same optimizer, density="adaptive"): the density
                  chosen every step with the default link model
                  (tf_topk.schedule.AdaptiveDensity)
    dense_bf16    TopKOptimizer(same optimizer, exchange_mode="dense_bf16"):
                  every gradient entry all-reduced in bfloat16, the rounding
                  error kept in the residuals (the 16-bit baseline)
    autopilot     TopKOptimizer(same optimizer, density="autopilot"): the link
                  measured when the optimizer is built, routes and density
                  chosen by predicted time (tf_topk.autopilot)
    calibrate:<n> no training: the autopilot's measurement of the cluster
                  (tf_topk.autopilot.measure) for the model's sizes, n times
                  in a row, each run's fitted links written to the result

on generated data (a fixed random teacher labels Gaussian inputs; each worker
has its own batches), `--warmup` steps, then `--steps` timed steps, each
ended by reading the local loss (so each step's time includes its exchange).
Before and after the timed steps, each time after a barrier, it reads the
interface counters (/sys/class/net/<iface>/statistics/{tx,rx}_bytes: inside
the namespace, the worker's own veth) and the TCP payload counters of its own
sockets (`ss`), then writes `result_<index>.json` to `--out` and exits.
"""

import argparse
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time

_START = time.monotonic()
PR_SET_PDEATHSIG = 1

MODELS = ("wide", "cnn", "tiny", "transformer")
OPTIMIZERS = ("sgd", "adamw")


def die_with_parent(parent_pid):
    """SIGKILL this worker when the benchmark process dies (also by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid and os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(3)


def read_iface(iface):
    """(tx_bytes, rx_bytes) of `iface` in this namespace, or None."""
    if not iface:
        return None
    base = f"/sys/class/net/{iface}/statistics"
    try:
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())
    except OSError:
        return None


def read_tcp(pid):
    """(bytes_sent, bytes_received) summed over this process's TCP sockets (`ss -tinp`), or None."""
    try:
        out = subprocess.run(["ss", "-tinpH"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sent = received = 0
    mine = False
    for line in out.splitlines():
        if not line[:1].isspace():
            mine = f"pid={pid}," in line
        elif mine:
            m = re.search(r"\bbytes_sent:(\d+)", line)
            sent += int(m.group(1)) if m else 0
            m = re.search(r"\bbytes_received:(\d+)", line)
            received += int(m.group(1)) if m else 0
    return sent, received


def build_model(keras, name, seed):
    """(model, input shape, classes). `wide`: 12.6M parameters, little compute; `transformer`: the
    convergence benchmark's byte-level language model (`tf_topk.bench.text.make_transformer`, 2 blocks of
    width 128, 64-byte windows: logits for the next byte at every position)."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    if name == "wide":
        shape = (1024,)
        model = keras.Sequential([keras.Input(shape), layers.Dense(4096, activation="relu"),
                                  layers.Dense(2048, activation="relu"), layers.Dense(10)])
    elif name == "cnn":
        shape = (28, 28, 1)
        model = keras.Sequential([keras.Input(shape), layers.Conv2D(16, 3, activation="relu"),
                                  layers.MaxPooling2D(), layers.Conv2D(32, 3, activation="relu"),
                                  layers.MaxPooling2D(), layers.Flatten(), layers.Dense(256, activation="relu"),
                                  layers.Dense(10)])
    elif name == "transformer":
        from tf_topk.bench import text

        shape = (text.CONTEXT,)
        return text.make_transformer(keras), shape, text.VOCAB
    elif name == "tiny":
        shape = (256,)
        model = keras.Sequential([keras.Input(shape), layers.Dense(256, activation="relu"), layers.Dense(10)])
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return model, shape, 10


def make_batches(np, shape, classes, batch_size, seed, index, count=4, tokens=False):
    """`count` batches for this worker; labels from a random linear teacher shared by all workers.
    `tokens`: random bytes and a random next byte at each position (the language model's shapes; what
    is timed is the same whatever the bytes)."""
    if tokens:
        rng = np.random.default_rng(seed + 1000 + index)
        return [(rng.integers(0, classes, (batch_size,) + tuple(shape)).astype(np.int32),
                 rng.integers(0, classes, (batch_size,) + tuple(shape)).astype(np.int32)) for _ in range(count)]
    dim = int(np.prod(shape))
    teacher = np.random.default_rng(seed).standard_normal((dim, classes)).astype(np.float32)
    rng = np.random.default_rng(seed + 1000 + index)
    batches = []
    for _ in range(count):
        x = rng.standard_normal((batch_size, dim)).astype(np.float32)
        y = np.argmax(x @ teacher, axis=1).astype(np.int32)
        batches.append((x.reshape((batch_size,) + tuple(shape)), y))
    return batches


def parse_config(text):
    """(kind, density, exchange mode or None for the library's default):
    'dense' -> (None, None, None); 'topk:0.001' -> ('topk', 0.001, None);
    'dgc:0.001@allreduce' -> ('dgc', 0.001, 'allreduce'); 'adaptive' -> ('adaptive', 'adaptive', None);
    'autopilot' -> ('autopilot', 'autopilot', None); 'dense_bf16' -> ('dense_bf16', 1.0, 'dense_bf16');
    'calibrate:10' -> ('calibrate', 10, None)."""
    if text == "dense":
        return None, None, None
    m = re.match(r"^calibrate:([1-9]\d*)$", text)
    if m:
        return "calibrate", int(m.group(1)), None
    if text in ("adaptive", "autopilot"):
        return text, text, None
    if text == "dense_bf16":
        return "dense_bf16", 1.0, "dense_bf16"
    m = re.match(r"^(topk|dgc):(\d*\.?\d+(?:e-?\d+)?)(?:@(\w+))?$", text)
    if not m or not 0 < float(m.group(2)) <= 1:  # the mode is checked by TopKOptimizer (no TF here yet)
        raise ValueError(f"config must be 'dense', 'dense_bf16', 'topk:<density in (0, 1]>', 'dgc:<density>', "
                         f"'adaptive' or 'autopilot', optionally with '@<exchange mode>', or 'calibrate:<runs>', "
                         f"got {text!r}")
    return m.group(1), float(m.group(2)), m.group(3)


def parse_args(argv=None):
    """The worker's options; tf_topk.bench.e2e writes this command line, so the two change together."""
    p = argparse.ArgumentParser(prog="python -m tf_topk.bench.e2e_worker")
    p.add_argument("--config", required=True, help="dense, topk:<density>, dgc:<density>, adaptive, autopilot, "
                   "dense_bf16 or calibrate:<runs>")
    p.add_argument("--model", choices=MODELS, default="wide")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="sgd: SGD with momentum 0.9; adamw: AdamW with weight decay 0.01")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--learning-rate", type=float, default=0.01)
    p.add_argument("--method", default="gaussian")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="TF intra-op threads")
    p.add_argument("--iface", default="", help="interface whose counters are read ('' for none)")
    p.add_argument("--out", required=True)
    p.add_argument("--heartbeat-timeout", type=float, default=600.0,
                   help="seconds; TF's coordination service heartbeat (MWMS default: 10), "
                        "see tf_topk.distribute.configure_coordination")
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--run-id", default="", help="tag of the benchmark run (for finding leftovers)")
    return p.parse_args(argv)


def start_strategy(tf, args):
    """MultiWorkerMirroredStrategy, after TF's thread pools and coordination
    service are configured: both are fixed once the runtime starts, so this
    comes before any other TF work."""
    from tf_topk.distribute import configure_coordination

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, args.threads))
    # A longer heartbeat timeout: on a slow link heartbeats queue behind the
    # bulk collective traffic and the default 10 s aborts healthy workers.
    configure_coordination(heartbeat_timeout_s=args.heartbeat_timeout)
    return tf.distribute.MultiWorkerMirroredStrategy()


def build_training(keras, tf_topk, strategy, args, kind, density, exchange_mode=None):
    """(model, optimizer, input shape, classes), created in the strategy's scope
    so their variables are mirrored: the plain SGD for `dense` (Keras's dense
    all-reduce), TopKOptimizer around the same SGD for `topk:<d>`, with
    momentum correction and sparse updates for `dgc:<d>`, by `exchange_mode`
    when given."""
    with strategy.scope():
        model, shape, classes = build_model(keras, args.model, args.seed)
        inner = keras.optimizers.AdamW(args.learning_rate, weight_decay=0.01) if args.optimizer == "adamw" else \
            keras.optimizers.SGD(args.learning_rate, momentum=0.9)
        if kind is None:
            optimizer = inner
        elif kind in ("adaptive", "autopilot"):
            optimizer = tf_topk.TopKOptimizer(inner, density=kind, method=args.method)
        elif kind == "dense_bf16":
            optimizer = tf_topk.TopKOptimizer(inner, exchange_mode="dense_bf16", method=args.method)
        else:
            dgc = kind == "dgc"
            mode = {} if exchange_mode is None else {"exchange_mode": exchange_mode}
            optimizer = tf_topk.TopKOptimizer(inner, density=density, method=args.method, momentum_correction=dgc,
                                              sparse_updates=dgc, density_warmup_steps=0, **mode)
        if kind is not None:  # built here, eagerly, so the autopilot can measure the cluster
            optimizer.build(model.trainable_variables)
    return model, optimizer, shape, classes


def make_train_step(tf, strategy, model, optimizer, replicas, global_batch):
    """The tf.function of one step on every replica (the optimizer does the
    exchange); returns this worker's mean loss, which the caller reads so that
    the step's time includes its exchange."""
    @tf.function
    def train_step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)) / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss * replicas  # this worker's mean loss

        per_replica = strategy.run(replica_step, args=(x, y))
        return strategy.experimental_local_results(per_replica)[0]

    return train_step


def make_barrier(tf, strategy):
    """A tf.function that returns once every worker has called it: none leaves while peers still need it."""
    @tf.function
    def barrier():
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)

    return barrier


def traffic_delta(before, after):
    """{'sent', 'received'} between two counter reads, or None where either read failed."""
    if before is None or after is None:
        return None
    return {"sent": after[0] - before[0], "received": after[1] - before[1]}


def measure(args, train_step, barrier, batches):
    """Warm-up steps, then the timed steps between two reads of the traffic
    counters (so the counts cover only those), then a barrier. Returns the
    measured fields of the result: step_times, losses, ready_s, iface, wire, tcp.

    Each read follows a barrier: a worker's step returns once it holds its
    peers' parts, while they may still be fetching its own: a read right
    after the last timed step once counted 0.92x a dense step's bytes
    (2 workers, 3 steps)."""
    losses, times = [], []
    for step in range(args.warmup):
        losses.append(float(train_step(*batches[step % len(batches)]).numpy()))
    warm_s = time.monotonic() - _START
    barrier().numpy()
    iface_before, tcp_before = read_iface(args.iface), read_tcp(os.getpid())
    for step in range(args.warmup, args.warmup + args.steps):
        start = time.perf_counter()
        losses.append(float(train_step(*batches[step % len(batches)]).numpy()))
        times.append(time.perf_counter() - start)
    barrier().numpy()
    iface_after, tcp_after = read_iface(args.iface), read_tcp(os.getpid())
    barrier().numpy()
    return {"step_times": times, "losses": losses, "ready_s": warm_s,
            "iface": args.iface or None, "wire": traffic_delta(iface_before, iface_after),
            "tcp": traffic_delta(tcp_before, tcp_after)}


def estimate_bytes(tf_topk, optimizer, density, params, replicas):
    """Bytes per step the exchange should send (TopKOptimizer's own count, or a
    ring all-reduce's for dense), for comparison with the measured traffic."""
    stats = optimizer.compression_stats() if density is not None else {}
    dense_bytes = tf_topk.routes.ring_all_reduce_bytes(4.0 * params, replicas)
    return {"estimated_bytes_sent": stats.get("bytes_sent", dense_bytes),
            "estimated_bytes_dense": dense_bytes,
            "compression_stats": stats}


def autopilot_facts(optimizer):
    """What the autopilot measured and predicted (None for other configurations)."""
    plan = getattr(getattr(optimizer, "exchange", None), "autopilot_plan", None)
    if plan is None:
        return None
    import dataclasses

    measured = {"calibration_s": "seconds", "dense_allreduce_s": "dense_s",
                "dense_allreduce_predicted_s": "dense_predicted_s", "sparse_step_s": "sparse_s",
                "sparse_step_predicted_s": "sparse_predicted_s", "trial_k": "trial_k"}
    calibration = plan.calibration
    return {"line": plan.describe(), "model": dataclasses.asdict(plan.model),
            **{key: getattr(calibration, field, None) for key, field in measured.items()}}


def calibrations(tf_topk, strategy, model, runs):
    """The autopilot's measurement for `model`'s sizes, `runs` times: per run
    its seconds and each collective's fitted link (every worker agreed on
    it), this worker's timed points and seconds per phase, the timed dense all-reduce and what the
    line predicted for it."""
    from tf_topk.config import DEFAULT_MIN_SIZE

    sizes = [int(v.shape.num_elements()) for v in model.trainable_variables]
    entries = sum(n for n in sizes if n >= DEFAULT_MIN_SIZE)
    small = sum(n for n in sizes if n < DEFAULT_MIN_SIZE) + 1  # + the non-finite count, as the exchange sends
    found = []
    for _ in range(runs):
        calibration = tf_topk.autopilot.measure(strategy, entries, small)
        link = {kind: getattr(calibration.model, kind) for kind in ("all_reduce", "all_gather")}
        found.append({"seconds": calibration.seconds, "dense_s": calibration.dense_s,
                      "dense_predicted_s": calibration.dense_predicted_s,
                      "refit_from_s": calibration.refit_from_s, "line": calibration.describe(),
                      "points": calibration.points, "phases": calibration.phases,
                      **{f"{kind}_latency_s": line.latency_s for kind, line in link.items()},
                      **{f"{kind}_bytes_per_s": (1.0 / line.seconds_per_byte if line.seconds_per_byte else None)
                         for kind, line in link.items()}})
    return found


def write_result(out, index, result):
    """result_<index>.json in `out`, written whole (through a rename): the benchmark reads it once it appears."""
    path = os.path.join(out, f"result_{index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def exit_without_teardown():
    """Let peers finish pulling this worker's last buffers, then skip TF's
    teardown (a gRPC server shutting down under MWMS can hang)."""
    time.sleep(1.5)
    os._exit(0)


def main(argv=None):
    args = parse_args(argv)
    die_with_parent(args.parent_pid)
    kind, density, exchange_mode = parse_config(args.config)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    import numpy as np
    import tensorflow as tf

    strategy = start_strategy(tf, args)  # before any other TF work
    import keras

    import tf_topk

    replicas = strategy.num_replicas_in_sync
    if kind == "calibrate":
        with strategy.scope():
            model, _, _ = build_model(keras, args.model, args.seed)
        write_result(args.out, index, {
            "index": index, "config": args.config, "model": args.model, "replicas": replicas,
            "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
            "calibrations": calibrations(tf_topk, strategy, model, density),
            "tf_version": tf.__version__, "keras_version": keras.__version__})
        print(f"worker {index}: {args.config} done", flush=True)
        exit_without_teardown()
    model, optimizer, shape, classes = build_training(keras, tf_topk, strategy, args, kind, density,
                                                      exchange_mode)
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    global_batch = args.batch_size * replicas
    batches = [(tf.constant(x), tf.constant(y)) for x, y in
               make_batches(np, shape, classes, args.batch_size, args.seed, index, tokens=args.model == "transformer")]
    train_step = make_train_step(tf, strategy, model, optimizer, replicas, global_batch)
    barrier = make_barrier(tf, strategy)

    measured = measure(args, train_step, barrier, batches)
    result = {
        "index": index, "config": args.config, "model": args.model, "params": params,
        "optimizer": args.optimizer, "decoupled_momentum": bool(getattr(optimizer, "decoupled_momentum", False)),
        "replicas": replicas, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
        **measured,
        **estimate_bytes(tf_topk, optimizer, density, params, replicas),
        "autopilot": autopilot_facts(optimizer),
        "tf_version": tf.__version__, "keras_version": keras.__version__,
    }
    write_result(args.out, index, result)
    times = measured["step_times"]
    print(f"worker {index}: {args.config} median step {sorted(times)[len(times) // 2]:.3f}s", flush=True)
    sys.stderr.flush()
    exit_without_teardown()


if __name__ == "__main__":
    main()
