"""The numpy reference of the selections the exchange makes, shared by the tests that check it."""

import numpy as np


def top_k_indices(flat, k):
    """The indices of the k largest |x| of `flat` (exact selection; ties by position)."""
    return np.argsort(-np.abs(flat), kind="stable")[:k]


def nominated_indices(accumulated, k):
    """Agreed indices by nomination: slot j holds replica (j mod P)'s (j // P)-th largest entry."""
    ranked = [top_k_indices(a, k) for a in accumulated]
    return np.unique([ranked[j % len(accumulated)][j // len(accumulated)] for j in range(k)])


def on_grid(values):
    """`values` (float32) rounded to c * 2**e, c in [-127, 127], e the smallest with max |values| <= 127 * 2**e."""
    largest = float(np.max(np.abs(values))) if values.size else 0.0
    if largest == 0.0:
        return np.zeros_like(values)
    e = max(int(np.ceil(np.log2(largest / 127.0))), -149)
    while largest > 127.0 * 2.0**e:
        e += 1
    while e > -149 and largest <= 127.0 * 2.0**(e - 1):
        e -= 1
    return (np.round(values.astype(np.float64) / 2.0**e) * 2.0**e).astype(np.float32)
