"""The digits data, the small MLP that the one-process Keras 3 tests train, and how they train it. Not a
test module."""

import keras
from sklearn.datasets import load_digits


def digits(n=512):
    """The first `n` of scikit-learn's digits: features in [0, 1] (float32), labels (int32)."""
    x, y = load_digits(return_X_y=True)
    return (x[:n] / 16.0).astype("float32"), y[:n].astype("int32")


def mlp(seed=0):
    """MLP 64-128-10: the 64x128 kernel (8,192 entries) is the one above the default min_size."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])


def train(optimizer, model=None, epochs=2, n=320):
    """`model` (default `mlp()`) compiled with `optimizer` and fit on the first `n` digits, batches of 32 in
    order: 10 steps an epoch at the default n."""
    x, y = digits(n)
    model = model or mlp()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False)
    return model
