"""Decoupled momentum keeps every option of the inner AdamW (Keras 3): the exchange runs inside AdamW's
own `apply`, so the loss scale is taken off, the gradient clipped (clipnorm, clipvalue, global_clipnorm)
and accumulated before each replica's momentum takes it, and the constraint and the EMA act on the
variables after the sign step, in Keras's order.

Each cell of options (pairwise, tests/pairwise.py) runs on one device and on two replicas
(MirroredStrategy over logical CPUs, eagerly, as Keras's own distribute tests run) against a numpy
reference that does each option by hand: unscale, accumulate, clip each replica's gradient, decay,
DeMo's momentum in DCT space with its exact top-k and the sign of the decoded sum for the kernel, AdamW
for the bias, then the EMA, then the constraint. tf_keras, whose exchange runs before the inner
optimizer's own apply, refuses the options by name.
"""

import functools
import math

import keras
import numpy as np
import pytest
import scipy.fft
import tensorflow as tf
import tf_keras

from logical_cpus import mirrored_on_cpus, split_cpu, strategy_for

split_cpu(3)  # before TensorFlow starts

import tf_topk  # noqa: E402
import tf_topk.tf_keras  # noqa: E402
from pairwise import cell_id, pairwise  # noqa: E402
from tf_topk.decoupled_momentum import DEFAULT_DECAY  # noqa: E402

LR, WEIGHT_DECAY, DENSITY, STEPS, REPLICAS = 0.01, 0.1, 1 / 128, 6, 2
STEP_SCALE = 2.0  # the sign step in learning rates: ExchangeConfig.decoupled_step_scale's default
KERNEL, BIAS = (64, 48), (8,)  # the kernel is sparsified (3,072 entries: k = 24, one 64x48 block), the bias dense
OPTIONS = {
    "loss_scale_factor": (None, 64.0),
    "clip": (None, "clipnorm", "clipvalue", "global_clipnorm"),
    "gradient_accumulation_steps": (None, 2),
    "use_ema": (False, True),
    "constraint": (False, True),
}
CLIPPING = {None: {}, "clipnorm": {"clipnorm": 0.5}, "clipvalue": {"clipvalue": 0.05},
            "global_clipnorm": {"global_clipnorm": 0.7}}
CELLS = pairwise(OPTIONS)


@functools.cache
def two_replicas():
    return mirrored_on_cpus(REPLICAS, 11_000_000)


def gradients(cell, step, replica):
    """This replica's gradients at `step`, as `fit` hands them (times the loss scale factor), large
    enough to be clipped."""
    rng = np.random.default_rng(100 * step + replica)
    scale = cell["loss_scale_factor"] or 1.0
    return [rng.normal(0.0, 0.3 + step % 3, KERNEL).astype(np.float32) * scale,
            rng.normal(0.0, 0.2, BIAS).astype(np.float32) * scale]


def start_values():
    rng = np.random.default_rng(1)
    return [rng.normal(0.0, 0.5, KERNEL).astype(np.float32), rng.normal(0.0, 0.5, BIAS).astype(np.float32)]


def clip(cell, grads):
    """Keras's `_clip_gradients` of one replica's gradients."""
    if cell["clip"] == "clipnorm":
        return [g * 0.5 / max(np.linalg.norm(g), 0.5) for g in grads]
    if cell["clip"] == "global_clipnorm":
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
        return [g * 0.7 / max(norm, 0.7) for g in grads]
    if cell["clip"] == "clipvalue":
        return [np.clip(g, -0.05, 0.05) for g in grads]
    return grads


class Reference:
    """The cell's AdamW with decoupled momentum on the kernel, in float64, Keras's order per `apply`:
    unscale, accumulate (an update every `gradient_accumulation_steps` micro-steps, of their mean), clip
    each replica's gradient, decay both variables, then the kernel's DeMo step (each replica's momentum
    of the block DCT, its exact top-k sent, the sign of the decoded sum at STEP_SCALE learning rates) and the
    bias's AdamW on the sum, then the EMA of the weights (the first update's weights where Keras's
    iterations are 0), then the constraint (non-negative kernel)."""

    def __init__(self, cell, replicas):
        self.cell, self.replicas = cell, replicas
        self.weights = [w.astype(np.float64) for w in start_values()]
        self.momenta = [np.zeros(KERNEL) for _ in range(replicas)]
        self.accumulated = [[np.zeros(KERNEL), np.zeros(BIAS)] for _ in range(replicas)]
        self.adam_m, self.adam_v = np.zeros(BIAS), np.zeros(BIAS)
        self.ema = [w.copy() for w in self.weights]
        self.iterations = 0
        self.ties = np.zeros(KERNEL, bool)

    def step(self, grads):
        cell, steps = self.cell, self.cell["gradient_accumulation_steps"]
        scale = cell["loss_scale_factor"] or 1.0
        grads = [[g.astype(np.float64) / scale for g in replica] for replica in grads]
        update = True
        if steps:
            update = (self.iterations + 1) % steps == 0
            if update:
                grads = [[(g + a) / steps for g, a in zip(replica, acc)]
                         for replica, acc in zip(grads, self.accumulated)]
                self.accumulated = [[np.zeros(KERNEL), np.zeros(BIAS)] for _ in range(self.replicas)]
            else:
                self.accumulated = [[g + a for g, a in zip(replica, acc)]
                                    for replica, acc in zip(grads, self.accumulated)]
        if update:
            grads = [clip(cell, replica) for replica in grads]
            for w in self.weights:
                w -= LR * WEIGHT_DECAY * w
            total = np.zeros(KERNEL[0] * KERNEL[1])
            for replica in range(self.replicas):
                accumulated = DEFAULT_DECAY * self.momenta[replica].reshape(-1) + scipy.fft.dctn(
                    grads[replica][0], norm="ortho").reshape(-1)  # one block: the whole kernel
                top = np.argsort(-np.abs(accumulated))[:round(DENSITY * accumulated.size)]
                sent = np.zeros_like(accumulated)
                sent[top] = accumulated[top]
                total += sent
                self.momenta[replica] = (accumulated - sent).reshape(KERNEL)
            decoded = scipy.fft.idctn(total.reshape(KERNEL), norm="ortho")
            self.ties = np.abs(decoded) < 1e-6 * np.abs(decoded).max()
            self.weights[0] -= STEP_SCALE * LR * np.sign(decoded)
            g = sum(replica[1] for replica in grads)
            t = self.keras_iterations() + 1
            self.adam_m += (g - self.adam_m) * 0.1
            self.adam_v += (g * g - self.adam_v) * 0.001
            self.weights[1] -= LR * math.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t) * self.adam_m / (
                np.sqrt(self.adam_v) + 1e-7)
        if cell["use_ema"]:
            momentum = 0.99 if self.keras_iterations() else 0.0
            self.ema = [momentum * a + (1 - momentum) * w for a, w in zip(self.ema, self.weights)]
        if cell["constraint"]:
            self.weights[0] = np.maximum(self.weights[0], 0.0)
        self.iterations += 1

    def keras_iterations(self):
        """Keras's `iterations`: the updates so far (micro-steps // accumulation steps)."""
        return self.iterations // (self.cell["gradient_accumulation_steps"] or 1)


def make_optimizer(cell):
    inner = keras.optimizers.AdamW(LR, weight_decay=WEIGHT_DECAY, loss_scale_factor=cell["loss_scale_factor"],
                                   gradient_accumulation_steps=cell["gradient_accumulation_steps"],
                                   use_ema=cell["use_ema"], **CLIPPING[cell["clip"]])
    return tf_topk.TopKOptimizer(inner, density=DENSITY, method="exact", min_size=1000, density_warmup_steps=0)


def run(cell, strategy=None):
    """(the variables after each step, the EMA after the last, the optimizer)."""
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        variables = [keras.Variable(start_values()[0], name="kernel"), keras.Variable(start_values()[1], name="bias")]
        if cell["constraint"]:
            variables[0].constraint = keras.constraints.NonNeg()
        optimizer = make_optimizer(cell)
        optimizer.build(variables)
    history = []
    for step in range(STEPS):
        if strategy is None:
            optimizer.apply([tf.constant(g) for g in gradients(cell, step, 0)], variables)
        else:
            def replica_step():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                per_replica = [gradients(cell, step, r) for r in range(REPLICAS)]
                optimizer.apply([tf.gather(tf.constant(np.stack([g[i] for g in per_replica])), replica)
                                 for i in range(2)], variables)

            strategy.run(replica_step)
        history.append([v.numpy() for v in variables])
    inner = optimizer.inner_optimizer
    ema = [v.numpy() for v in inner._model_variables_moving_average] if cell["use_ema"] else []
    return history, ema, optimizer


@pytest.mark.parametrize("replicas", [1, REPLICAS])
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_each_option_acts_as_on_adamw_alone(cell, replicas):
    strategy = strategy_for(replicas, two_replicas)
    history, ema, optimizer = run(cell, strategy)
    assert optimizer.decoupled_momentum is True  # "auto" keeps it with every option
    reference = Reference(cell, replicas)
    for step, weights in enumerate(history):
        reference.step([gradients(cell, step, r) for r in range(replicas)])
        ties = reference.ties
        assert ties.mean() < 0.01, f"step {step}: {ties.sum()} ties"
        np.testing.assert_allclose(weights[0][~ties], reference.weights[0][~ties], rtol=1e-5, atol=1e-5,
                                   err_msg=f"step {step}, kernel")
        reference.weights[0][ties] = weights[0][ties]  # a sign at a node of the cosines is rounding's
        np.testing.assert_allclose(weights[1], reference.weights[1], rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
    for ours, theirs in zip(ema, reference.ema):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    momenta = [m.numpy() for m in (optimizer.exchange.memory.residuals[0].values if strategy
                                   else [optimizer.exchange.memory.residuals[0]])]
    for ours, theirs in zip(momenta, reference.momenta):
        np.testing.assert_allclose(ours.reshape(-1), theirs.reshape(-1), rtol=1e-4, atol=1e-5)


def test_the_cells_cover_every_pair_of_options():
    assert any(cell["gradient_accumulation_steps"] and cell["clip"] for cell in CELLS)
    assert len(CELLS) < 64 / 3


def test_after_one_step_each_momentum_is_the_dct_of_the_clipped_gradient():
    """With global_clipnorm=1.0 (the transformer recipe), the momentum after one step plus what it sent
    is the DCT of the gradient clipped to norm 1, not of the gradient as given."""
    variable = keras.Variable(np.zeros(KERNEL, np.float32), name="kernel")
    optimizer = tf_topk.TopKOptimizer(keras.optimizers.AdamW(LR, global_clipnorm=1.0), density=0.01,
                                      density_warmup_steps=0, min_size=1000)
    gradient = np.random.default_rng(3).normal(0.0, 1.0, KERNEL).astype(np.float32)
    optimizer.apply([tf.constant(gradient)], [variable])
    assert optimizer.decoupled_momentum is True
    kept = optimizer.exchange.memory.residuals[0].numpy().reshape(-1)
    clipped = scipy.fft.dctn(gradient.astype(np.float64) / np.linalg.norm(gradient), norm="ortho").reshape(-1)
    unsent = kept != 0
    assert unsent.mean() > 0.98
    np.testing.assert_allclose(kept[unsent], clipped[unsent], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("option", [{"clipnorm": 1.0}, {"clipvalue": 0.1}, {"global_clipnorm": 1.0},
                                    {"use_ema": True}])
def test_tf_keras_refuses_what_it_would_skip_by_name(option, capsys):
    name, value = next(iter(option.items()))
    with pytest.raises(ValueError, match=f"{name}={value!r}.*Keras 3's tf_topk.TopKOptimizer"):
        tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.AdamW(1e-3, **option), density=0.01,
                                       decoupled_momentum=True)
    optimizer = tf_topk.tf_keras.TopKOptimizer(tf_keras.optimizers.AdamW(1e-3, **option), density=0.01,
                                               min_size=1000)
    assert optimizer.decoupled_momentum is False  # "auto": top-k in front of AdamW, and the chief says why
    optimizer.build([tf.Variable(tf.zeros(KERNEL), name="kernel")])
    assert f"not decoupled momentum: tf_keras's AdamW with {name}={value!r}" in capsys.readouterr().err
