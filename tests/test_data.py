"""Tests of course_lib.data: synthetic and bundled data sets, sharding by rank, batching."""

import numpy as np
import pytest

from course_lib import data


def test_make_linear_shapes_bias_and_determinism():
    X, y, theta_true = data.make_linear(n_samples=50, n_features=3, noise=0.0, seed=1)
    assert X.shape == (50, 4) and y.shape == (50,) and theta_true.shape == (4,)
    assert X.dtype == y.dtype == theta_true.dtype == np.float64
    np.testing.assert_array_equal(X[:, 0], 1.0)
    np.testing.assert_allclose(y, X @ theta_true)  # noise=0: exactly linear
    X2, y2, t2 = data.make_linear(n_samples=50, n_features=3, noise=0.0, seed=1)
    np.testing.assert_array_equal(X, X2)
    np.testing.assert_array_equal(t2, theta_true)
    Xn, _, tn = data.make_linear(n_samples=50, n_features=3, bias=False)
    assert Xn.shape == (50, 3) and tn.shape == (3,)
    assert not np.allclose(data.make_linear(seed=2)[1], data.make_linear(seed=3)[1])


def test_make_sparse_linear_frequencies():
    X, y, theta_true = data.make_sparse_linear(n_samples=2000, frequencies=(1.0, 0.1, 0.01))
    freq = (X != 0).mean(axis=0)
    np.testing.assert_allclose(freq, [1.0, 0.1, 0.01], atol=0.02)
    assert (X != 0).any(axis=0).all()
    np.testing.assert_allclose(y, X @ theta_true, atol=0.5)


def test_load_digits_offline_scaled_deterministic():
    X_train, y_train, X_test, y_test = data.load_digits()
    assert X_train.shape[1] == X_test.shape[1] == 64
    assert len(X_train) + len(X_test) == 1797 and len(X_test) == 450
    assert X_train.dtype == np.float64 and y_train.dtype == y_test.dtype == np.int64
    np.testing.assert_allclose(X_train.mean(axis=0), 0.0, atol=1e-12)
    assert set(np.unique(y_test)) == set(range(10))
    again = data.load_digits()
    np.testing.assert_array_equal(again[0], X_train)
    np.testing.assert_array_equal(again[3], y_test)
    raw = data.load_digits(standardize=False)[0]
    assert raw.min() >= 0.0 and raw.max() <= 1.0


@pytest.mark.parametrize("n", [0, 1, 3, 10, 11, 17])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_shard_sizes_and_coverage(n, world_size):
    X = np.arange(2 * n).reshape(n, 2)
    y = np.arange(n)
    parts = [data.shard(X, y, rank, world_size) for rank in range(world_size)]
    sizes = [len(p[1]) for p in parts]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first ranks hold the extra rows
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)  # in order, once
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]).reshape(n, 2), X)
    assert sizes == [len(a) for a in np.array_split(y, world_size)]


def test_shard_bad_arguments():
    X, y = np.zeros((5, 2)), np.zeros(5)
    with pytest.raises(ValueError, match="rank"):
        data.shard(X, y, rank=3, world_size=3)
    with pytest.raises(ValueError, match="rank"):
        data.shard(X, y, rank=-1, world_size=3)
    with pytest.raises(ValueError, match="world_size"):
        data.shard(X, y, rank=0, world_size=0)
    with pytest.raises(ValueError, match="number of samples"):
        data.shard(X, y[:4], rank=0, world_size=2)


def test_batches_cover_once():
    idx = list(data.batches(10, 4))
    assert [len(b) for b in idx] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate(idx), np.arange(10))
    shuffled = list(data.batches(10, 3, rng=np.random.default_rng(0)))
    np.testing.assert_array_equal(np.concatenate(shuffled),
                                  np.random.default_rng(0).permutation(10))
    assert sorted(np.concatenate(shuffled).tolist()) == list(range(10))
    assert list(data.batches(0, 4)) == []
    assert [len(b) for b in data.batches(3, 8)] == [3]
    with pytest.raises(ValueError, match="batch_size"):
        list(data.batches(10, 0))
