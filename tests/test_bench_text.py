"""The convergence benchmark's language-model tasks (`text`, Python source; `prose`, English docstrings): the
corpora, their windows, the transformer, a tiny run of each."""

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from tf_topk.bench import text

UNIFORM_NATS = math.log(256)


def test_corpus_files_sorted_by_relative_path_without_tests_third_party_generated_or_build_files(tmp_path):
    for path in ("b.py", "A.py", "a/z.py", "a/b.py", "a/notes.txt", "site-packages/pkg.py", "test/test_x.py",
                 "a/tests/t.py", "encodings/cp1252.py", "_sysconfigdata__linux.py", "config-3.11/python-config.py",
                 "idlelib/idle.py", "__pycache__/b.py", "_a.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x = 1\n")
    found = [Path(p).relative_to(tmp_path).as_posix() for p in text.stdlib_sources(tmp_path)]
    assert found == ["A.py", "_a.py", "a/b.py", "a/z.py", "b.py"]


def test_corpus_is_the_same_python_source_every_time():
    corpus = text.load_corpus()
    again = text._read_corpus.__wrapped__("text", text.CORPUS_BYTES)[0]  # read the files again, past the cache
    assert corpus is not again and np.array_equal(corpus, again)
    assert corpus.dtype == np.uint8 and len(corpus) == text.CORPUS_BYTES  # the standard library has more
    source = corpus.tobytes()
    assert source.count(b"\ndef ") > 1000 and source.count(b"import ") > 500
    assert np.mean(corpus < 128) > 0.99  # code, not tables of bytes
    assert text.describe_corpus()["sha256"] == hashlib.sha256(again.tobytes()).hexdigest()


def test_docstring_prose_keeps_the_words_and_drops_doctests_and_code_blocks():
    source = b'''"""Module words."""

def f(x):
    """Add one to x.

    >>> f(1)
    2
    >>> f(
    ...     2)
    3

    Also for arrays:

    ```python
    f(np.ones(3))
    ```
    Returns x plus one.
    """

class C:
    """A class."""
    def g(self):
        pass
'''
    # Module, then its functions and classes, then theirs (ast.walk's order).
    assert text.docstring_prose(source) == \
        "Module words.\n\nAdd one to x.\n\nAlso for arrays:\n\nReturns x plus one.\n\nA class."
    assert text.docstring_prose(b"def broken(:\n") == ""  # a file Python cannot parse gives nothing, not an error


def test_package_sources_leave_out_tests_and_vendored_code():
    found = text.package_sources("sklearn")
    import sklearn

    relative = [Path(p).relative_to(Path(sklearn.__file__).parent).as_posix() for p in found]
    assert relative == sorted(relative) and "__init__.py" in relative and len(found) > 100
    parts = [set(Path(p).parts) for p in found]
    assert not any(part & {"tests", "externals", "__pycache__"} for part in parts)
    assert not any(Path(p).name.startswith("test_") for p in found)
    assert any(p.endswith(os.path.join("linear_model", "_logistic.py")) for p in found)
    with pytest.raises(RuntimeError, match="not_a_package_here, which is not installed"):
        text.package_sources("not_a_package_here")


def test_prose_corpus_is_english_from_the_docstrings_and_unlike_the_python_corpus():
    prose = text.load_corpus("prose")
    assert prose.dtype == np.uint8 and len(prose) == text.CORPUS_BYTES
    assert not prose.flags.writeable
    data = prose.tobytes()
    assert b">>>" not in data and b"```" not in data
    assert data.count(b" the ") > 10_000 and data.count(b"\ndef ") < 50
    letters = sum(data.count(bytes([c])) for c in range(ord("a"), ord("z") + 1))
    assert letters / len(data) > 0.55  # words, where source code is about half letters
    assert np.mean(prose < 128) > 0.99
    python = text.load_corpus("text").tobytes()
    assert python.count(b"\ndef ") > 1000 and data[:4096] != python[:4096]
    described = text.describe_corpus("prose")
    assert described["sha256"] == hashlib.sha256(data).hexdigest()
    assert set(described["packages"]) <= {"numpy", "scikit-learn", "keras"} and "numpy" in described["packages"]
    assert described["bytes"] == text.CORPUS_BYTES
    with pytest.raises(ValueError, match="corpus must be one of .*got 'poetry'"):
        text.load_corpus("poetry")
    with pytest.raises(RuntimeError, match=r"the text corpus has [\d,]+ bytes, fewer than the task's 1,000,000,000"):
        text.load_corpus("text", limit=10**9)  # a corpus that cannot fill the task is refused, not cut short


def test_the_reference_corpus_is_pydocs_topics_whole_and_small_enough_for_several_passes():
    import pydoc_data.topics

    reference = text.load_corpus("reference")
    topics = pydoc_data.topics.topics
    data = reference.tobytes()
    assert data == "".join(topics[name] for name in sorted(topics)).encode("utf-8")  # whole, in the names' order
    assert 100_000 < len(data) < 1 << 20 and not reference.flags.writeable
    assert data.count(b" the ") > 2_000 and b"The \"assert\" statement" in data
    # A run of 2,000 steps of 32 windows reads several times its training bytes.
    assert 2000 * 32 * text.CONTEXT / text.split_point(reference) > 4
    described = text.describe_corpus("reference")
    assert described["sha256"] == hashlib.sha256(data).hexdigest() and described["bytes"] == len(data)
    assert "pydoc_data.topics" in described["source"]
    np.testing.assert_array_equal(text.load_corpus("reference", limit=1000), reference[:1000])
    prose, python = text.load_corpus("prose").tobytes(), text.load_corpus("text").tobytes()
    assert data[:4096] not in (prose[:4096], python[:4096])


def test_windows_are_the_corpus_bytes_and_targets_the_next_byte():
    corpus = text.load_corpus()
    starts = np.array([0, 17, len(corpus) - text.CONTEXT - 1])
    x, y = text.windows(corpus, starts)
    assert x.shape == y.shape == (3, text.CONTEXT) and x.dtype == y.dtype == np.int32
    for row, start in enumerate(starts):
        np.testing.assert_array_equal(x[row], corpus[start:start + text.CONTEXT])
        np.testing.assert_array_equal(y[row], corpus[start + 1:start + text.CONTEXT + 1])
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_validation_windows_lie_in_the_held_out_tail_and_training_windows_before_it():
    corpus = text.load_corpus()
    split = text.split_point(corpus)
    assert len(corpus) - split == pytest.approx(text.HELD_OUT * len(corpus), abs=1)
    train, val = text.train_starts(corpus), text.validation_starts(corpus)
    assert len(train) == text.TRAIN_WINDOWS and len(val) == text.VAL_WINDOWS
    # The last byte a training window reads (its last target) comes before the first validation byte.
    assert train.min() >= 0 and train.max() + text.CONTEXT < split
    assert val.min() >= split and val.max() + text.CONTEXT < len(corpus)
    assert len(np.unique(val)) == len(val)
    assert train.max() - train.min() > 0.9 * split  # spread over the whole training part
    x_train, y_train, x_val, y_val = text.load_text(seed=0)
    expected = text.windows(corpus, train) + text.windows(corpus, val)
    for got, want in zip((x_train, y_train, x_val, y_val), expected):
        np.testing.assert_array_equal(got, want)
    # Another seed draws other training windows; validation stays the same windows.
    other = text.load_text(seed=1)
    assert not np.array_equal(other[0], x_train)
    np.testing.assert_array_equal(other[2], x_val)


@pytest.mark.parametrize("dataset", text.LANGUAGE_DATASETS)
def test_the_data_loader_serves_each_language_task(dataset):
    from tf_topk.bench.data import DATASETS, load_data

    assert dataset in DATASETS
    for got, want in zip(load_data(dataset, seed=2), text.load_text(seed=2, corpus=dataset)):
        np.testing.assert_array_equal(got, want)
    corpus = text.load_corpus(dataset)
    np.testing.assert_array_equal(load_data(dataset)[2], text.windows(corpus, text.validation_starts(corpus))[0])


def test_transformer_is_causal():
    """Changing the byte at position p changes the logits from p on, never before."""
    import keras

    keras.utils.set_random_seed(0)
    model = text.make_transformer(keras, layers=2, width=32)
    tokens = np.random.default_rng(0).integers(0, 256, (2, text.CONTEXT)).astype(np.int32)
    changed = tokens.copy()
    changed[:, 40] = (changed[:, 40] + 1) % 256
    before, after = np.asarray(model(tokens)), np.asarray(model(changed))
    assert before.shape == (2, text.CONTEXT, 256)
    np.testing.assert_allclose(after[:, :40], before[:, :40], atol=1e-5)
    assert np.abs(after[:, 40:] - before[:, 40:]).max(axis=-1).min() > 1e-4  # every later position sees it


def test_evaluation_interval_divides_the_steps_into_about_16_evaluations():
    from tf_topk.bench.convergence import evaluation_interval

    assert evaluation_interval(800) == 50
    assert evaluation_interval(1000) == 50  # 20 evaluations (62.5 steps would not divide)
    assert evaluation_interval(30) == 2
    assert evaluation_interval(7) == 1


@pytest.mark.parametrize("args,message", [
    (("--methods", "topk_mc", "--optimizer", "sgd", "--momentum", "0"), "topk_mc .* needs --momentum > 0"),
    (("--epochs", "3"), "--dataset text trains for --steps, not --epochs"),
    (("--steps", "100", "--eval-every", "30"), r"--eval-every must be >= 1 and divide --steps \(100\), got 30"),
    (("--model", "mlp"), "--model transformer goes with --dataset text, prose or reference and only with them"),
    (("--adaptive",), "--adaptive .* not with --dataset text"),
    (("--methods", "demo", "--optimizer", "sgd"), "demo .* is for --optimizer adam or adamw, got --optimizer sgd"),
])
def test_bad_text_arguments_are_refused_before_training(capsys, args, message):
    import re

    from tf_topk.bench import convergence

    with pytest.raises(SystemExit) as exit_info:
        convergence.main(["--dataset", "text", *args])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_steps_are_only_for_the_text_task(capsys):
    from tf_topk.bench import convergence

    with pytest.raises(SystemExit):
        convergence.main(["--steps", "100"])
    assert "--steps and --eval-every are for --dataset text" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["text", "reference"])  # prose's corpus is read as the loader test reads it
def test_tiny_text_run_reports_validation_loss_per_byte(capsys, dataset):
    from tf_topk.bench import convergence

    steps, every = 30, 10
    assert convergence.main(["--dataset", dataset, "--model", "transformer", "--optimizer", "adamw",
                             "--steps", str(steps), "--eval-every", str(every), "--densities", "0.01",
                             "--methods", "topk_ef,demo", "--seeds", "1", "--density-warmup-steps", "0",
                             "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["dataset"], result["steps"], result["eval_every"]) == (dataset, steps, every)
    assert result["optimizer"] == "AdamW(learning_rate=0.001, weight_decay=0.01)"
    assert result["model"] == "transformer 2x128, context 64"
    assert result["corpus"] == text.describe_corpus(dataset)
    assert result["test_samples"] == text.VAL_WINDOWS
    dense, topk, demo = result["configs"]
    assert [(row["method"], row["density"]) for row in result["configs"]] == [
        ("dense", None), ("topk_ef", 0.01), ("demo", 0.01)]
    for row in (dense, topk, demo):
        assert "test_accuracy_mean" not in row and "vs_dense_points" not in row
        curve = row["curves"]["val_loss"]
        assert len(curve) == len(row["curves"]["train_loss"]) == steps // every
        assert row["val_loss_per_seed"] == [pytest.approx(curve[-1], abs=2e-5)]
        assert row["val_loss_mean"] == pytest.approx(curve[-1], abs=2e-5) and row["val_loss_std"] == 0.0
        # It learns: from about ln 256 at the start to well below it, still falling.
        assert curve[-1] < curve[0] < UNIFORM_NATS, (row["method"], curve)
    assert dense["val_loss_mean"] < 0.7 * UNIFORM_NATS, dense["curves"]
    for row in (topk, demo):
        assert row["vs_dense_nats"] == pytest.approx(row["val_loss_mean"] - dense["val_loss_mean"], abs=2e-5)
        assert row["sent_density"] == pytest.approx(0.01, abs=2e-3)
    assert dense["vs_dense_nats"] == 0.0
