"""Where top-k at 0.1% loses accuracy on a CNN: `python benchmarks/cnn_diagnosis.py [--dataset shapes]`.

Trains the convergence benchmark's CNN (`--dataset shapes`: 2-D; `signals`: 1-D) with
`TopKOptimizer(SGD(lr, momentum=0.9), density=d)`: plain error feedback, momentum correction with DGC's
momentum factor masking, and without it; with DGC's 4-epoch density warm-up. Prints per sparsified
variable:

  entries, k          k = ceil(d * entries) at the final density
  count / k           the gaussian selection's count against k (mean over sampled steps)
  recall              the share of the exact top-k (of gradient + residual) the gaussian selection holds
  energy              its sum of squares against the exact top-k's
  sent once           the share of entries sent at least once after the warm-up
  sends per entry     how many times an entry was sent after the warm-up (mean)
  residual / grad     the residual's norm against the gradient's (how much is waiting to be sent)

Samples every `--every` steps after the warm-up; one seed.
"""

import argparse
import math

import numpy as np
import tensorflow as tf
import keras

import tf_topk
from tf_topk.bench.convergence import make_model
from tf_topk.bench.data import load_data


def _selection_stats(accumulated, k):
    """(count / k, recall of the exact top-k, energy against the exact top-k's) of the gaussian selection."""
    flat = tf.reshape(accumulated, [-1])
    values, indices = tf_topk.approx_topk(flat, k, method="gaussian")
    chosen = indices[tf.not_equal(values, 0)].numpy()
    exact = tf.math.top_k(tf.abs(flat), k).indices.numpy()
    squares = flat.numpy() ** 2
    return (len(chosen) / k, len(np.intersect1d(chosen, exact)) / k,
            float(squares[chosen].sum() / max(squares[exact].sum(), 1e-30)))


def diagnose(dataset, correction, density, learning_rate, epochs, every, masking=False, seed=0, log=print):
    x_train, y_train, x_test, y_test = load_data(dataset)
    keras.utils.set_random_seed(seed)
    model = make_model(keras, x_train.shape[1], None, 10, {"shapes": "cnn", "signals": "cnn1d"}[dataset])
    steps_per_epoch = math.ceil(len(x_train) / 32)
    warmup = 4 * steps_per_epoch
    optimizer = tf_topk.TopKOptimizer(
        keras.optimizers.SGD(learning_rate, momentum=0.9), momentum_correction=correction,
        config=tf_topk.ExchangeConfig(momentum_masking=masking),
        density=tf_topk.schedule.dgc_warmup(steps_per_epoch, epochs=4, final=density))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer.build(model.trainable_variables)
    exchange = optimizer._exchange_object
    slots = {position: exchange._slot[position] for position in exchange.sparse_positions}
    variables = model.trainable_variables
    sends = {p: tf.Variable(tf.zeros(variables[p].shape, tf.int32)) for p in slots}
    counting = tf.Variable(False)

    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, variables)

    @tf.function
    def apply(grads):
        # Sent: the residual is zero after the step where gradient + residual was not (a weight whose
        # gradient is always zero, behind a dead unit, is never counted).
        nonzero = {}
        for p, slot in slots.items():
            compensation = exchange.memory.compensate(slot, grads[p])
            nonzero[p] = tf.not_equal(tf.reshape(compensation.gradient, variables[p].shape) +
                                      tf.reshape(compensation.residual, variables[p].shape), 0.0)
        optimizer.apply(grads, variables)
        if counting:
            for p, slot in slots.items():
                sent = tf.logical_and(tf.equal(exchange.memory.residuals[slot], 0.0), nonzero[p])
                sends[p].assign_add(tf.cast(sent, tf.int32))

    stats = {p: [] for p in slots}
    step = 0
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for start in range(0, len(order), 32):
            batch = order[start:start + 32]
            grads = gradients(x_train[batch], y_train[batch])
            counting.assign(step >= warmup)
            if step >= warmup and step % every == 0:
                for p, slot in slots.items():
                    compensation = exchange.memory.compensate(slot, grads[p])
                    accumulated = tf.reshape(compensation.gradient, [-1]) + tf.reshape(compensation.residual, [-1])
                    k = max(1, math.ceil(density * int(np.prod(variables[p].shape))))
                    residual_ratio = float(tf.norm(compensation.residual) / max(float(tf.norm(grads[p])), 1e-30))
                    stats[p].append((*_selection_stats(accumulated, k), residual_ratio))
            apply(grads)
            step += 1
    accuracy = float(np.mean(np.argmax(model(x_test, training=False).numpy(), axis=1) == y_test))
    rows = []
    for p in slots:
        entries = int(np.prod(variables[p].shape))
        count = sends[p].numpy()
        rows.append({
            "variable": variables[p].path.split("/", 1)[-1], "entries": entries, "k": max(1, math.ceil(density * entries)),
            "count_over_k": float(np.mean([s[0] for s in stats[p]])),
            "recall": float(np.mean([s[1] for s in stats[p]])),
            "energy": float(np.mean([s[2] for s in stats[p]])),
            "sent_once": float(np.mean(count > 0)), "sends_per_entry": float(count.mean()),
            "residual_over_grad": float(np.mean([s[3] for s in stats[p]])),
        })
    log(f"{dataset}, {_memory_name(correction, masking)}, density {density}, "
        f"lr {learning_rate}, {epochs} epochs ({step} steps, warm-up {warmup}): test accuracy {accuracy:.4f}")
    return accuracy, rows


def _memory_name(correction, masking):
    return ("momentum correction" + (" with masking" if masking else "")) if correction else "error feedback"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=("shapes", "signals"), default="shapes")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--every", type=int, default=25, help="steps between sampled selections")
    args = parser.parse_args(argv)
    print("| memory | variable | entries | k | count / k | recall | energy | sent once | sends per entry | "
          "residual / grad |\n|---|---|---|---|---|---|---|---|---|---|")
    for correction, masking in ((False, False), (True, True), (True, False)):
        _, rows = diagnose(args.dataset, correction, args.density, args.learning_rate, args.epochs, args.every,
                           masking=masking, log=lambda m: print(f"<!-- {m} -->", flush=True))
        for r in rows:
            print(f"| {_memory_name(correction, masking)} | `{r['variable']}` | {r['entries']} | {r['k']} | "
                  f"{r['count_over_k']:.2f} | {r['recall']:.2f} | {r['energy']:.2f} | {r['sent_once']:.2f} | "
                  f"{r['sends_per_entry']:.2f} | {r['residual_over_grad']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
