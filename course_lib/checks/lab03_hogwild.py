"""Lab 03 (Hogwild!) checks: the lock-free worker loop and the collision probability.

Use in labs/03_hogwild.ipynb right under each exercise::

    from course_lib.checks import lab03_hogwild as checks
    checks.check_lockfree_epoch(lockfree_epoch)
    checks.check_collision_probability(collision_probability)

The loop runs here, in this process, on seeded sparse data, against
``course_lib.sparse_problem.sparse_sgd_epoch``: with one worker Hogwild is plain SGD, so the
values must match exactly. The parameter vector it gets records which coordinates were written;
a loop that writes a coordinate its samples do not touch (a dense update, or a copy of all the
parameters written back) would, with other workers running, erase their updates, and fails.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from course_lib.checks.framework import Case, CheckFailed, run_check
from course_lib.sparse_problem import (
    collision_probability,
    make_sparse_classification,
    sparse_loss,
    sparse_sgd_epoch,
)


class _WriteLog(np.ndarray):
    """A float vector that records in ``written`` which of its coordinates were assigned.

    Tracks ``w[key] = ...`` (and so ``w[idx] -= ...``), in-place ufuncs (``w -= g``,
    ``np.subtract(..., out=w)``, ``np.add.at(w, idx, ...)``) and ``np.copyto(w, ...)``.
    Copies and views do not carry the log: writing into a private copy is not a shared write.
    """

    def __new__(cls, values):
        obj = np.array(values, dtype=np.float64).view(cls)
        obj.written = np.zeros(obj.shape, dtype=bool)
        return obj

    def __array_finalize__(self, obj):
        self.written = None

    def _mark(self, key=Ellipsis):
        if getattr(self, "written", None) is not None:
            self.written[key] = True

    def __setitem__(self, key, value):
        self._mark(key)
        np.asarray(self)[key] = np.asarray(value) if isinstance(value, _WriteLog) else value

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if method == "at" and isinstance(inputs[0], _WriteLog):
            inputs[0]._mark(inputs[1])
        plain = tuple(np.asarray(x) if isinstance(x, _WriteLog) else x for x in inputs)
        if out is not None:
            for o in out:
                if isinstance(o, _WriteLog):
                    o._mark()
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, _WriteLog) else o for o in out)
        return getattr(ufunc, method)(*plain, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.copyto and args and isinstance(args[0], _WriteLog):
            args[0]._mark()
        args = tuple(np.asarray(a) if isinstance(a, _WriteLog) else a for a in args)
        return func(*args, **kwargs)


def _epoch_cases(seed):
    shapes = [(60, 600, 6, 0.5), (40, 400, 3, 1.0), (80, 1000, 10, 0.2)]  # n, d, nnz, lr
    cases = []
    for k, (n, d, nnz, lr) in enumerate(shapes):
        data = make_sparse_classification(n, d, nnz, seed=seed + k)
        rng = np.random.default_rng(seed + 100 + k)
        w0 = 0.1 * rng.normal(size=d)
        order = rng.permutation(n)[: 3 * n // 4]  # some rows never visited

        def args(data=data, w0=w0, order=order, lr=lr):
            return (w0.copy(), data.indptr.copy(), data.indices.copy(), data.values.copy(),
                    data.y.copy(), order.copy(), lr)

        cases.append(Case(f"{n} rows, {d} features, {nnz} non-zeros per row, lr={lr}", args))
    return cases


def _student_epoch(student_fn):
    def run(w, indptr, indices, values, y, order, lr):
        shared = _WriteLog(w)
        touched = np.zeros(w.shape, dtype=bool)
        for i in order:
            touched[indices[indptr[i]:indptr[i + 1]]] = True
        student_fn(shared, indptr, indices, values, y, order, lr)
        extra = np.flatnonzero(shared.written & ~touched)
        if extra.size:
            raise CheckFailed(
                f"your loop wrote {extra.size} coordinates that none of its samples touches "
                f"(for example w[{extra[0]}]), out of {w.size}. Another worker may have "
                "updated them since you read them: writing them back erases its update.")
        return np.asarray(shared).copy()
    return run


def check_lockfree_epoch(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 03, exercise 1: ``student_fn(w, indptr, indices, values, y, order, lr)`` updates
    ``w`` in place, one sample at a time in ``order``, writing only the touched coordinates.

    Must equal ``sparse_problem.sparse_sgd_epoch`` (one worker = serial SGD) on 3 seeded cases,
    write no coordinate outside the rows it visits, and lower the loss.
    """
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = _epoch_cases(seed)

    def diagnose(expected, got):
        w0, *rest, lr = cases_args[0]
        got = np.asarray(got, dtype=float)
        for wrong_lr, hint in [(1.0, "you step as if lr were 1: multiply the gradient by lr."),
                               (-lr, "you step uphill: the derivative of log(1 + exp(-y m)) "
                                     "in m is -y / (1 + exp(y m)); subtract lr times it (times "
                                     "x).")]:
            if np.allclose(got, sparse_sgd_epoch(w0.copy(), *rest, wrong_lr), rtol=1e-8):
                return hint
        if np.allclose(got, w0):
            return ("w did not change: update the caller's w in place (w[idx] -= ...), "
                    "not a copy of it.")
        return None

    cases_args = []

    def reference(*args):
        cases_args[:] = [(args[0].copy(), *args[1:])]
        return sparse_sgd_epoch(*args)

    ok = run_check(
        "check_lockfree_epoch", _student_epoch(student_fn), reference, cases, diagnose=diagnose,
        rtol=1e-10, atol=1e-12, result_name="w after the epoch",
        hint="for each i in order: idx, v = the CSR row i (indices/values[indptr[i]:indptr[i+1]]); "
             "m = w[idx] @ v; g = -y[i] / (1 + exp(y[i] * m)); then w[idx] -= lr * g * v.")
    if ok:
        data = make_sparse_classification(400, 2000, 8, seed=seed + 7)
        w = np.zeros(data.n_features)
        before = sparse_loss(w, data)
        for _ in range(3):
            student_fn(w, data.indptr, data.indices, data.values, data.y,
                       np.arange(len(data)), 0.5)
        after = sparse_loss(w, data)
        if not after < before:
            raise CheckFailed(f"check_lockfree_epoch: 3 epochs did not lower the loss "
                              f"({before:.4f} -> {after:.4f}).\nHint: each sample's step "
                              "goes DOWN the gradient: w[idx] -= lr * g * x, with g the "
                              "derivative of the loss at this sample.")
        print(f"  and 3 epochs lower the loss from {before:.4f} to {after:.4f}")
    return ok


def check_collision_probability(student_fn: Callable) -> bool:
    """Lab 03, exercise 2: ``student_fn(nnz, n_features)`` = chance that two rows with ``nnz``
    distinct uniform features share at least one (``sparse_problem.collision_probability``)."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [Case(f"nnz={k}, n_features={d}", lambda k=k, d=d: (k, d))
             for k, d in [(1, 10), (2, 10), (32, 20_000), (76, 47_236), (10, 15)]]
    return run_check(
        "check_collision_probability", student_fn, collision_probability, cases, rtol=1e-6,
        result_name="probability",
        hint="count the ways the second row avoids the first row's nnz features: "
             "C(d - nnz, nnz) of C(d, nnz); the answer is 1 minus their ratio "
             "(math.comb, or a product of (d - nnz - j) / (d - j) for j < nnz).")
