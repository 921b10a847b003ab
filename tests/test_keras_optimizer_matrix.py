"""Every Keras optimizer, alone and in TopKOptimizer at density 1.0, with its defaults and with each inner
option turned on one at a time: the same weights (one replica; two replicas:
tests/test_keras_contract.py::test_density_one_is_the_inner_optimizer_with_two_replicas).

Density 1.0 sends every entry, so the wrapped optimizer must train exactly as the inner one alone. The
model has a kernel above min_size (the top-k path) and variables below it (the dense path).
"""

import keras
import numpy as np
import pytest

from digits_models import train

import tf_topk

INNER_OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.05),
    "SGD momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "SGD Nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "Adam": lambda: keras.optimizers.Adam(0.003),
    "AdamW": lambda: keras.optimizers.AdamW(0.003, weight_decay=0.01),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.001),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "Adamax": lambda: keras.optimizers.Adamax(0.003),
    "Nadam": lambda: keras.optimizers.Nadam(0.003),
    "Lion": lambda: keras.optimizers.Lion(0.0003),
    # Keras's default epsilon_1 (1e-30) makes 0/0 where a kernel row and column both get no gradient (a
    # blank pixel and a dead ReLU unit of the digits MLP: their second-moment estimate, 1e-30 * 1e-30 over
    # a mean, underflows to 0), and the NaN weights that follow make the wrapper skip every later step.
    "Adafactor": lambda: keras.optimizers.Adafactor(0.01, epsilon_1=1e-15),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.05),
}


# Each inner option, one at a time (with every optimizer of INNER_OPTIMIZERS).
OPTIONS_ONE_AT_A_TIME = {
    "clipnorm": dict(clipnorm=0.1), "clipvalue": dict(clipvalue=0.01), "global_clipnorm": dict(global_clipnorm=0.1),
    "weight_decay": dict(weight_decay=0.05), "use_ema": dict(use_ema=True, ema_overwrite_frequency=3),
    "gradient_accumulation_steps": dict(gradient_accumulation_steps=2),
}


def with_option(name, option):
    """INNER_OPTIMIZERS[name] made with the option `option` of OPTIONS_ONE_AT_A_TIME added."""
    optimizer = INNER_OPTIMIZERS[name]()
    config = {**optimizer.get_config(), **OPTIONS_ONE_AT_A_TIME[option]}
    return type(optimizer).from_config(config)


@pytest.mark.slow
@pytest.mark.parametrize("option", OPTIONS_ONE_AT_A_TIME)
@pytest.mark.parametrize("name", INNER_OPTIMIZERS)
def test_each_option_of_each_optimizer_acts_as_without_the_wrapper(name, option):
    """20 steps, density 1.0, one option turned on: the same weights as the inner optimizer alone."""
    alone = train(with_option(name, option))
    wrapped = train(tf_topk.TopKOptimizer(with_option(name, option), density=1.0))
    for a, b in zip(alone.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", INNER_OPTIMIZERS)
def test_density_one_is_the_inner_optimizer(name):
    """160 steps of the digits MLP (its 64x128 kernel on the top-k path, the rest below min_size):
    the wrapper at density 1.0, with its defaults otherwise, trains as the inner optimizer alone."""
    make = INNER_OPTIMIZERS[name]
    alone = train(make(), epochs=10, n=512)
    wrapped = train(tf_topk.TopKOptimizer(make(), density=1.0), epochs=10, n=512)
    for a, b in zip(alone.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
