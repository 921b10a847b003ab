"""Pairwise cells of options: every pair of values of two options in some cell, about a tenth of the full
product, for tests that combine options (tests/test_keras_order.py, tests/test_decoupled_momentum_options.py)."""

import itertools


def pairwise(options):
    """Cells (dicts of option -> value) in which every pair of values of two options appears: greedy,
    deterministic."""
    names = list(options)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va in options[a] for vb in options[b]}
    cells = []
    while uncovered:
        best, best_count = None, -1
        for values in itertools.product(*(options[name] for name in names)):
            cell = dict(zip(names, values))
            count = sum((a, cell[a], b, cell[b]) in uncovered for a, b in itertools.combinations(names, 2))
            if count > best_count:
                best, best_count = cell, count
        cells.append(best)
        uncovered -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(names, 2)}
    return cells


def cell_id(cell):
    """A cell's name for pytest: its options that are set."""
    return "-".join(f"{name}={value}" for name, value in cell.items() if value not in (None, False)) or "plain"
