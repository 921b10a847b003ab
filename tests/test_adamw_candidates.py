"""benchmarks/adamw_candidates.py, which RESULTS' AdamW trials come from: its chunk-wise selection and
quantization, its byte count, its paired summary, and one tiny run of a variant on the text task."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from multiworker import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "adamw_candidates.py"
_spec = importlib.util.spec_from_file_location("adamw_candidates", SCRIPT)
candidates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(candidates)


def test_chunk_selection_takes_k_over_chunks_from_each_chunk():
    x = tf.constant([0.1, -3.0, 0.2, 1.0, 5.0, 0.0, -0.5, 0.3, 0.7, 0.01])  # chunks of 4: 3 chunks
    values, indices = candidates.QuantizedChunkSelector(4).select(x, 6)  # 2 a chunk
    assert sorted(indices.numpy().tolist()) == [1, 3, 4, 6, 8, 9]
    np.testing.assert_allclose(values.numpy(), tf.gather(x, indices).numpy())
    values, indices = candidates.QuantizedChunkSelector(4).select(x, 2)  # fewer than the chunks: the largest winners
    assert sorted(indices.numpy().tolist()) == [1, 4]
    values, indices = candidates.QuantizedChunkSelector(4).select(x, 4)  # one a chunk, a spare slot
    assert sorted(indices.numpy().tolist()) == [0, 1, 4, 8]
    np.testing.assert_allclose(sorted(values.numpy().tolist()), [-3.0, 0.0, 0.7, 5.0])


def test_two_bit_values_are_a_third_or_all_of_the_chunks_largest():
    x = tf.constant([4.0, -1.0, 2.9, 0.5, -3.0, 0.2, 0.1, 0.05])  # one chunk of 8, all taken
    values, indices = candidates.QuantizedChunkSelector(8, value_bits=2).select(x, 8)
    by_index = dict(zip(indices.numpy().tolist(), values.numpy().tolist()))
    assert by_index[0] == pytest.approx(4.0) and by_index[4] == pytest.approx(-4.0)
    assert by_index[1] == pytest.approx(-4.0 / 3) and by_index[3] == pytest.approx(4.0 / 3)
    assert by_index[2] == pytest.approx(4.0)  # 2.9 is nearer 4 than 4/3: the upper half of the range
    with pytest.raises(ValueError, match="value_bits must be None, 2, 4 or 8, got 3"):
        candidates.QuantizedChunkSelector(8, value_bits=3)


def test_pair_bytes_count_the_index_within_the_chunk_and_the_scale():
    assert candidates.pair_bytes(8, 4096) == (2.5, 2.0)
    assert candidates.pair_bytes(2, 4096) == (1.75, 2.0)
    assert candidates.pair_bytes(32, 4096) == (5.5, 0.0)


def test_summary_pairs_seeds_with_dense_and_gives_a_t_interval():
    lines = [json.dumps(dict(variant=v, density=0.01, seed=s, dataset="text", steps=800, final=f))
             for v, s, f in [("dense", 0, 1.50), ("dense", 1, 1.52), ("dense", 2, 1.48),
                             ("demo", 0, 1.51), ("demo", 1, 1.54), ("demo", 2, 1.51), ("demo", 3, 9.0)]]
    [row] = candidates.summarize(lines)
    dataset, steps, replicas, variant, density, seeds, dense, mean, low, high = row
    assert (dataset, steps, replicas, variant, seeds) == ("text", 800, 1, "demo", [0, 1, 2])  # seed 3: no pair
    assert dense == pytest.approx(1.50) and mean == pytest.approx(0.02)
    # differences 0.01, 0.02, 0.03: standard deviation 0.01, t(0.975, 2) = 4.303
    assert (low, high) == (pytest.approx(0.02 - 4.303 * 0.01 / 3 ** 0.5, abs=1e-4),
                           pytest.approx(0.02 + 4.303 * 0.01 / 3 ** 0.5, abs=1e-4))


def test_an_unknown_variant_is_named():
    with pytest.raises(SystemExit, match="unknown variant 'nope'"):
        candidates.make_builder("nope:decay=0.9", 0.01)


@pytest.mark.slow
def test_a_tiny_run_prints_one_line_per_seed():
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "demoq:bits=8,qchunk=4096", "0.03", "0,1", "--",
                           "--dataset", "text", "--steps", "20", "--eval-every", "10"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["variant"], r["seed"], r["steps"], len(r["curve"])) for r in runs] == [
        ("demoq:bits=8,qchunk=4096", 0, 20, 2), ("demoq:bits=8,qchunk=4096", 1, 20, 2)]
    assert all(r["final"] < r["curve"][0] < 5.6 for r in runs)
