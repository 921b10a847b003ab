"""The digits data and the small MLP that the one-process Keras 3 tests train. Not a test module."""

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
