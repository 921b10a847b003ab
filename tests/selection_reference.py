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


def chunk_sent(acc, k, value_bits=2, chunk=4096):
    """What `exchange_mode="allgather_chunk"` sends of a flat float32 `acc` asked for k entries (dense, float32):
    in every chunk of `chunk` entries (the last one shorter) the round(k / chunks) largest |acc| (at least 1,
    at most the chunk's length), rounded to c * 2**(e_m - o) with c in [-L, L], L = 2**(value_bits - 1) - 1.
    A chunk's own exponent e: with L = 1 the power of two nearest the mean of its selected nonzero
    magnitudes, else the smallest with max <= L * 2**e; e_m the largest over the member's chunks; o = e_m - e
    clipped to [0, 15]. value_bits None: the selected values as they are."""
    levels = None if value_bits is None else 2 ** (value_bits - 1) - 1
    n = acc.size
    length = min(chunk, n)
    count = -(-n // length)
    per_chunk = int(min(max(np.round(k / count), 1), length))
    padded = np.zeros(length * count, np.float64)
    padded[:n] = acc
    rows = padded.reshape(count, length)
    chosen = np.argsort(-np.abs(rows), axis=1, kind="stable")[:, :per_chunk]
    values = np.take_along_axis(rows, chosen, 1)
    if value_bits is None:
        sent_rows = np.zeros_like(rows)
        np.put_along_axis(sent_rows, chosen, values, 1)
        return sent_rows.reshape(-1)[:n].astype(np.float32)
    exponents = []
    for row in np.abs(values):
        nonzero = row[row > 0]
        if nonzero.size == 0:
            exponents.append(-149)
        elif levels == 1:
            exponents.append(min(max(int(np.round(np.log2(nonzero.mean()))), -149), 127))
        else:
            e = max(int(np.ceil(np.log2(nonzero.max() / levels))), -149)
            while nonzero.max() > levels * 2.0**e:
                e += 1
            while e > -149 and nonzero.max() <= levels * 2.0**(e - 1):
                e -= 1
            exponents.append(e)
    exponents = np.array(exponents)
    member = exponents.max()
    steps = 2.0 ** (member - np.clip(member - exponents, 0, 15))[:, None]
    sent_rows = np.zeros_like(rows)
    np.put_along_axis(sent_rows, chosen, np.clip(np.round(values / steps), -levels, levels) * steps, 1)
    return sent_rows.reshape(-1)[:n].astype(np.float32)
