"""The sparse problem of notebook 03 (course_lib/sparse_problem.py): its feature distributions."""

import numpy as np
import pytest

from course_lib import sparse_problem

N, D, K = 2000, 4000, 16            # density 0.4 %, k^2/d = 6.4 %


@pytest.fixture(scope="module")
def pair():
    return {dist: sparse_problem.make_sparse_classification(N, D, K, seed=2,
                                                           feature_distribution=dist)
            for dist in ("uniform", "zipf")}


def test_uniform_is_the_default():
    a = sparse_problem.make_sparse_classification(300, 500, 8, seed=4)
    b = sparse_problem.make_sparse_classification(300, 500, 8, seed=4,
                                                  feature_distribution="uniform")
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.y, b.y)


def test_zipf_rows_are_valid_and_deterministic(pair):
    data = pair["zipf"]
    assert len(data) == N and data.indptr[-1] == N * K
    for i in range(0, N, 97):
        idx, v = data.row(i)
        assert len(np.unique(idx)) == K and np.all(np.diff(idx) > 0)
        assert idx.min() >= 0 and idx.max() < D and np.isclose(np.linalg.norm(v), 1.0)
    assert set(np.unique(data.y)) == {-1.0, 1.0}
    again = sparse_problem.make_sparse_classification(N, D, K, seed=2, feature_distribution="zipf")
    assert np.array_equal(data.indices, again.indices)


def test_zipf_features_concentrate_on_low_indices(pair):
    low = D // 100                   # the 1 % most frequent features under Zipf
    share = {dist: np.mean(data.indices < low) for dist, data in pair.items()}
    assert share["uniform"] == pytest.approx(0.01, abs=0.005)
    assert share["zipf"] > 0.3
    counts = np.bincount(pair["zipf"].indices, minlength=D)
    assert counts[0] > 0.7 * N       # feature 0 is in most rows (at most once per row)
    assert counts[:10].mean() > 100 * counts[-1000:].mean()


def test_zipf_rows_collide_far_more_than_uniform(pair):
    rate = {dist: sparse_problem.measured_overlap(data, pairs=2000, seed=1)
            for dist, data in pair.items()}
    assert rate["uniform"] == pytest.approx(sparse_problem.collision_probability(K, D), abs=0.02)
    assert rate["zipf"] > 0.5 > 5 * rate["uniform"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="feature_distribution"):
        sparse_problem.make_sparse_classification(10, 100, 4, feature_distribution="normal")
    with pytest.raises(ValueError, match="do not fit"):
        sparse_problem.make_sparse_classification(10, 4, 5, feature_distribution="zipf")
