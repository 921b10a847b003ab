"""Timing helpers shared by the benchmarks."""

import statistics
import time


def median_seconds(fn, repeats, warmup=2):
    """Median wall time of fn() over `repeats` runs after `warmup` runs.

    fn must block until its result is ready (call .numpy() or similar)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
