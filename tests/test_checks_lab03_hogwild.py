"""Lab 03 checks (course_lib/checks_hogwild.py): pass the reference, fail realistic mistakes."""

import math

import numpy as np
import pytest

from course_lib.checks import CheckFailed
from course_lib.checks import lab03_hogwild as checks_hogwild
from course_lib.sparse_problem import collision_probability, sparse_sgd_epoch


def _row(indptr, indices, values, i):
    return indices[indptr[i]:indptr[i + 1]], values[indptr[i]:indptr[i + 1]]


def add_at(w, indptr, indices, values, y, order, lr):  # another correct style
    for i in order:
        idx, v = _row(indptr, indices, values, i)
        g = -y[i] / (1 + np.exp(y[i] * np.dot(w[idx], v)))
        np.add.at(w, idx, -lr * g * v)


def dense_update(w, indptr, indices, values, y, order, lr):
    for i in order:
        idx, v = _row(indptr, indices, values, i)
        g = np.zeros_like(w)
        g[idx] = -y[i] / (1 + math.exp(y[i] * float(w[idx] @ v))) * v
        w -= lr * g  # writes every coordinate


def stale_copy(w, indptr, indices, values, y, order, lr):
    for i in order:
        local = w.copy()
        idx, v = _row(indptr, indices, values, i)
        local[idx] -= lr * (-y[i] / (1 + math.exp(y[i] * float(local[idx] @ v)))) * v
        w[:] = local  # writes a stale copy of all parameters back


def stale_copyto(w, indptr, indices, values, y, order, lr):
    local = np.array(w)
    sparse_sgd_epoch(local, indptr, indices, values, y, order, lr)
    np.copyto(w, local)


def no_lr(w, indptr, indices, values, y, order, lr):
    sparse_sgd_epoch(w, indptr, indices, values, y, order, 1.0)


def uphill(w, indptr, indices, values, y, order, lr):
    sparse_sgd_epoch(w, indptr, indices, values, y, order, -lr)


def returns_copy(w, indptr, indices, values, y, order, lr):
    return sparse_sgd_epoch(w.copy(), indptr, indices, values, y, order, lr)


def todo(*args):
    raise NotImplementedError


def test_reference_and_other_correct_styles_pass(capsys):
    assert checks_hogwild.check_lockfree_epoch(sparse_sgd_epoch)
    assert checks_hogwild.check_lockfree_epoch(add_at)
    assert "lower the loss" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (dense_update, "none of its samples touches"),
    (stale_copy, "none of its samples touches"),
    (stale_copyto, "none of its samples touches"),
    (no_lr, "as if lr were 1"),
    (uphill, "uphill"),
    (returns_copy, "in place"),
])
def test_mistakes_fail_with_a_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        checks_hogwild.check_lockfree_epoch(wrong)


def test_not_implemented_returns_false(capsys):
    assert checks_hogwild.check_lockfree_epoch(todo) is False
    assert checks_hogwild.check_collision_probability(todo) is False
    assert "not implemented" in capsys.readouterr().out


def test_collision_probability_check():
    def comb(nnz, d):
        return 1 - math.comb(d - nnz, nnz) / math.comb(d, nnz)
    assert checks_hogwild.check_collision_probability(comb)
    assert checks_hogwild.check_collision_probability(collision_probability)
    with pytest.raises(CheckFailed):
        checks_hogwild.check_collision_probability(lambda nnz, d: nnz * nnz / d)
