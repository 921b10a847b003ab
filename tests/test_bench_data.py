"""tf_topk.bench.data: the one loader of the examples and benchmarks."""

import numpy as np
import pytest

from tf_topk.bench.data import load_data


@pytest.mark.parametrize("name,features", [("digits", 64), ("synthetic", 64)])
def test_offline_data_sets_split_and_types(name, features):
    x_train, y_train, x_test, y_test = load_data(name, seed=3)
    assert x_train.dtype == x_test.dtype == np.float32 and y_train.dtype == y_test.dtype == np.int32
    assert x_train.shape[1] == x_test.shape[1] == features
    total = len(x_train) + len(x_test)
    assert len(x_test) == pytest.approx(0.2 * total, abs=1)
    assert set(np.unique(y_train)) == set(np.unique(y_test)) == set(range(10))  # stratified
    again = load_data(name, seed=3)
    np.testing.assert_array_equal(again[0], x_train)
    other = load_data(name, seed=4)
    assert not np.array_equal(other[0], x_train)
    if name == "digits":
        assert 0.0 <= x_train.min() and x_train.max() <= 1.0


def test_unknown_data_set_is_named():
    with pytest.raises(ValueError, match=r"dataset must be one of .*'imagenet'"):
        load_data("imagenet")
