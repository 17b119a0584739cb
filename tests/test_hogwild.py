"""Hogwild (course_lib/hogwild.py): correctness only, never timings."""

import numpy as np
import pytest

from course_lib import hogwild, sparse_problem


@pytest.fixture(scope="module")
def data():
    return sparse_problem.make_sparse_classification(n_samples=4000, n_features=4000, nnz=16,
                                                     seed=1)


def test_sparse_data_is_rcv1_like(data):
    assert len(data) == 4000 and data.indptr[-1] == 4000 * 16
    for i in range(0, 4000, 397):
        idx, v = data.row(i)
        assert len(np.unique(idx)) == 16 and np.isclose(np.linalg.norm(v), 1.0)
    assert set(np.unique(data.y)) == {-1.0, 1.0}


def test_collision_probability_matches_the_data(data):
    p = sparse_problem.collision_probability(16, 4000)
    assert p == pytest.approx(1 - (1 - 16 / 4000) ** 16, rel=0.02)
    assert sparse_problem.measured_overlap(data, pairs=4000) == pytest.approx(p, abs=0.015)
    assert sparse_problem.collision_probability(3, 5) == 1.0


def test_one_worker_equals_serial_sgd_exactly(data):
    w, losses = sparse_problem.serial_sgd(data, lr=0.5, num_epochs=2, seed=3)
    result = hogwild.run_sparse(data, num_workers=1, lr=0.5, num_epochs=2, seed=3)
    np.testing.assert_array_equal(result.params, w)
    assert result.losses == pytest.approx(losses, rel=1e-12)
    assert result.conflicts == 0 and result.worker_samples == [2 * len(data)]
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("lock", [False, True])
def test_two_workers_converge_like_serial(data, lock):
    _, serial = sparse_problem.serial_sgd(data, lr=0.5, num_epochs=3)
    result = hogwild.run_sparse(data, num_workers=2, lock=lock, lr=0.5, num_epochs=3)
    assert result.worker_samples == [3 * 2000, 3 * 2000]
    assert len(result.losses) == 4 and result.losses[-1] < result.losses[0]
    assert result.final_loss == pytest.approx(serial[-1], rel=0.05)
    if lock:
        assert result.conflicts == 0  # the lock serialises read and write


def test_dense_problem_conflicts():
    one = hogwild.run_dense(num_workers=1, num_epochs=1, hidden=16)
    assert one.conflicts == 0 and one.losses[-1] < one.losses[0]
    two = hogwild.run_dense(num_workers=2, num_epochs=2, hidden=16)
    assert two.conflicts > 0 and two.conflicted_updates > 0
    assert two.losses[-1] < 0.5 * two.losses[0]
