"""Training inside a SavedModel: weights, step and the exchange's state travel together.

A `tf.Module` owns a small MLP for scikit-learn's digits and a
`tf_topk.SparseExchange` with momentum correction (so its residuals and
velocities are saved too). Its `train_step` signature computes gradients, runs
top-k selection of the accumulated velocity (one replica, no strategy:
nothing is sent, but what is not applied this step waits in the residual),
applies the result with plain SGD (the exchange applied the momentum) and
returns the loss.

    python examples/saved_model_training.py train --steps 100 --export /tmp/digits_sm
    python examples/saved_model_training.py resume --steps 100 --export /tmp/digits_sm
    python examples/saved_model_training.py resume --steps 1 --export /tmp/digits_sm --no-import  # shows the error

`resume` runs in a new process: it imports tf_topk (which registers the
selection op), loads the SavedModel, continues training by calling the loaded
`train_step` and saves again. A SavedModel that uses the op cannot be loaded
without `import tf_topk` first.
"""

import argparse
import json
import sys

from tf_topk.cli import density, positive_int

OP_PREFIX = "ImportTfTopk>"  # the registered names of tf_topk's ops start with it
FEATURES, CLASSES, HIDDEN = 64, 10, 256


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a digits MLP through a SavedModel signature with tf_topk error feedback.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,resume}")
    train = commands.add_parser("train", help="train from scratch and export a SavedModel")
    resume = commands.add_parser("resume", help="load a SavedModel in this new process, train on, export again")
    for sub in (train, resume):
        sub.add_argument("--steps", type=positive_int, default=100, help="training steps to run (default 100)")
        sub.add_argument("--export", required=True, metavar="DIR",
                         help="SavedModel directory (train: written; resume: read, then rewritten)")
        sub.add_argument("--batch-size", type=positive_int, default=64)
        sub.add_argument("--log-every", type=positive_int, default=10, help="print the loss every N steps")
        sub.add_argument("--summary-json", default=None, metavar="PATH",
                         help="also write the numbers printed (losses per step, residual norm) as JSON")
    train.add_argument("--density", type=density, default=0.01,
                       help="fraction of the large weight's gradient entries applied per step (default 0.01)")
    train.add_argument("--method", choices=("gaussian", "exact"), default="gaussian")
    train.add_argument("--learning-rate", type=float, default=0.1)
    train.add_argument("--momentum", type=float, default=0.9)
    train.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    resume.add_argument("--no-import", action="store_true",
                        help="skip `import tf_topk` before loading, to show the error that gives")
    args = parser.parse_args(argv)
    if args.command == "train":
        if args.learning_rate <= 0:
            parser.error(f"--learning-rate must be positive, got {args.learning_rate}")
        if not 0.0 <= args.momentum < 1.0:
            parser.error(f"--momentum must be in [0, 1), got {args.momentum}")
    return args


def load_digits():
    """All 1797 digits as float32 features in [0, 1] and int32 labels."""
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_digits

    x, y = sklearn_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int32)


def batch_at(x, y, step, batch_size, seed):
    """The batch of global step `step`: a fixed order per epoch, so a resumed run continues it."""
    import numpy as np

    per_epoch = len(x) // batch_size
    epoch, position = divmod(int(step), per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(x))
    chosen = order[position * batch_size:(position + 1) * batch_size]
    return x[chosen], y[chosen]


def dataset_loss(predict, x, y):
    """Mean cross-entropy of the whole data set, from the `predict` function's logits."""
    import numpy as np

    logits = predict(x=x)["logits"].numpy().astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(y)), y].mean())


def make_module(args):
    """Build the trainer module; defined here so `resume --no-import` never imports tf_topk."""
    import tensorflow as tf

    import tf_topk

    class DigitsTrainer(tf.Module):
        """Model, optimizer state and residuals in one module, so one SavedModel holds them all."""

        def __init__(self, density, method, learning_rate, momentum, seed):
            super().__init__(name="digits_trainer")
            init = tf.keras.initializers.GlorotUniform
            self.w1 = tf.Variable(init(seed=seed)([FEATURES, HIDDEN]), name="w1")
            self.b1 = tf.Variable(tf.zeros([HIDDEN]), name="b1")
            self.w2 = tf.Variable(init(seed=seed + 1)([HIDDEN, CLASSES]), name="w2")
            self.b2 = tf.Variable(tf.zeros([CLASSES]), name="b2")
            self.params = [self.w1, self.b1, self.w2, self.b2]
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self.seed = tf.Variable(seed, dtype=tf.int64, trainable=False, name="seed")  # batch order on resume
            self.learning_rate = learning_rate
            # w1 (16384 entries) is sparsified; the small ones take the dense path. The
            # exchange keeps the momentum (DGC's momentum correction; none for momentum 0).
            self.exchange = tf_topk.SparseExchange(self.params, density=density, method=method,
                                                   momentum=momentum or None)

        def logits(self, x):
            hidden = tf.nn.relu(tf.matmul(x, self.w1) + self.b1)
            return tf.matmul(hidden, self.w2) + self.b2

        @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32),
                                      tf.TensorSpec([None], tf.int32)])
        def train_step(self, x, y):
            """One momentum-corrected step: plain SGD on what the exchange returns."""
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, self.logits(x)))
            grads = tape.gradient(loss, self.params)
            result = self.exchange(grads, step=self.step)

            def apply():
                for param, grad in zip(self.params, result.grads):
                    param.assign_sub(self.learning_rate * grad)
                self.step.assign_add(1)
                return tf.constant(True)

            # A non-finite gradient skips the update (the exchange left the residuals alone).
            applied = tf.cond(result.all_finite, apply, lambda: tf.constant(False))
            return {"loss": loss, "applied": applied, "residual_norm": result.stats["residual_norm"],
                    "step": self.step.read_value()}

        @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32)])
        def predict(self, x):
            logits = self.logits(x)
            return {"logits": logits, "classes": tf.argmax(logits, -1, output_type=tf.int32)}

        @tf.function(input_signature=[])
        def residual_norm(self):
            """L2 norm of all residuals: the gradient mass selected but not yet applied."""
            return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(r)) for r in self.exchange.residuals]))

    return DigitsTrainer(args.density, args.method, args.learning_rate, args.momentum, args.seed)


def run_steps(train_step, x, y, first_step, steps, batch_size, seed, log_every):
    """Call `train_step` (a signature function) `steps` times; return the losses."""
    import tensorflow as tf

    losses = []
    for i in range(steps):
        bx, by = batch_at(x, y, first_step + i, batch_size, seed)
        out = train_step(x=tf.constant(bx), y=tf.constant(by))
        losses.append(float(out["loss"]))
        if not bool(out["applied"]):
            print(f"step {first_step + i}: non-finite gradient, update skipped")
        if i == 0 or (i + 1) % log_every == 0 or i == steps - 1:
            print(f"step {first_step + i}: loss {losses[-1]:.4f}", flush=True)
    return losses


def save(module, export_dir, signatures):
    import tensorflow as tf

    tf.saved_model.save(module, export_dir, signatures=signatures)
    print(f"saved to {export_dir}")


def train(args):
    x, y = load_digits()
    module = make_module(args)
    print(f"training from scratch: {len(module.exchange.sparse_positions)} sparsified variable(s) at density "
          f"{args.density:g} ({args.method}), SGD lr {args.learning_rate:g} momentum {args.momentum:g}")
    module.exchange.say_if_run_ends_in_warmup(args.steps)  # as fit says it
    losses = run_steps(module.train_step, x, y, 0, args.steps, args.batch_size, args.seed, args.log_every)
    summary = {"losses": losses, "step": int(module.step.numpy()),
               "residual_norm": float(module.residual_norm()),
               "dataset_loss": dataset_loss(module.predict, x, y)}
    print(f"after {summary['step']} steps: data-set loss {summary['dataset_loss']:.6f}, "
          f"residual norm {summary['residual_norm']:.9g}")
    save(module, args.export, {"train_step": module.train_step, "predict": module.predict})
    return summary


# What `resume --no-import` loads with: a process that never imported tf_topk.
# This one did (its argument types, tf_topk.cli), and the tf_topk package
# registers its ops once TensorFlow starts, so here the load would succeed.
LOAD_WITHOUT_TF_TOPK = "import sys, tensorflow as tf; tf.saved_model.load(sys.argv[1])"


def load(export_dir, import_tf_topk):
    """tf.saved_model.load, with a clear message when the op library was not imported first."""
    import tensorflow as tf

    if import_tf_topk:
        import tf_topk.ops  # noqa: F401  registers tf_topk's ops (ImportTfTopk>...), which train_step uses
        error = None
    else:
        import subprocess

        child = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_TF_TOPK, export_dir], capture_output=True, text=True)
        error = next((line for line in child.stderr.splitlines() if OP_PREFIX in line), None)
    if error is None:
        try:
            return tf.saved_model.load(export_dir)
        except Exception as raised:  # NotFoundError in TF 2.21; matched by message to be safe across versions
            if OP_PREFIX not in str(raised):
                raise
            error = str(raised).splitlines()[0]
    sys.exit(f"error: {export_dir} uses tf_topk's ops ({OP_PREFIX}...), which are registered only once tf_topk.ops is "
             f"imported.\nRun `import tf_topk.ops` before tf.saved_model.load(...)"
             f"{' (this run skipped it: --no-import)' if not import_tf_topk else ''}.\n"
             f"TensorFlow said: {error}")


def resume(args):
    x, y = load_digits()
    loaded = load(args.export, import_tf_topk=not args.no_import)
    train_step = loaded.signatures["train_step"]
    first_step, seed = int(loaded.step.numpy()), int(loaded.seed.numpy())
    summary = {"restored_step": first_step,
               "restored_residual_norm": float(loaded.residual_norm()),
               "restored_dataset_loss": dataset_loss(loaded.signatures["predict"], x, y)}
    print(f"restored {args.export} at step {first_step}: data-set loss {summary['restored_dataset_loss']:.6f}, "
          f"residual norm {summary['restored_residual_norm']:.9g}")
    summary["losses"] = run_steps(train_step, x, y, first_step, args.steps, args.batch_size, seed,
                                  args.log_every)
    summary.update(step=int(loaded.step.numpy()), residual_norm=float(loaded.residual_norm()),
                   dataset_loss=dataset_loss(loaded.signatures["predict"], x, y))
    print(f"after {summary['step']} steps: data-set loss {summary['dataset_loss']:.6f}, "
          f"residual norm {summary['residual_norm']:.9g}")
    save(loaded, args.export, dict(loaded.signatures))
    return summary


def main(argv=None):
    args = parse_args(argv)
    summary = train(args) if args.command == "train" else resume(args)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
