"""Benchmarks: `python -m tf_topk.bench {select,...} --help`.

Speed is reported as medians and as ratios to a baseline measured in the same
process on the same data, never as pass/fail timings.
"""
