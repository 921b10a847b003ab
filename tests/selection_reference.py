"""The numpy reference of the selections the exchange makes, shared by the tests that check it."""

import numpy as np


def top_k_indices(flat, k):
    """The indices of the k largest |x| of `flat` (exact selection; ties by position)."""
    return np.argsort(-np.abs(flat), kind="stable")[:k]


def nominated_indices(accumulated, k):
    """Agreed indices by nomination: slot j holds replica (j mod P)'s (j // P)-th largest entry."""
    ranked = [top_k_indices(a, k) for a in accumulated]
    return np.unique([ranked[j % len(accumulated)][j // len(accumulated)] for j in range(k)])
