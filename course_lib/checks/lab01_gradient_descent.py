"""Lab 01's checks (labs/01_gradient_descent.ipynb): a mini-batch SGD epoch and a step-decay
schedule, each compared with :mod:`course_lib.gd` on fresh seeded cases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from course_lib.checks.framework import Case, CheckFailed, run_check


def _minibatch_cases(seed: int) -> list[Case]:
    """Linear-regression cases: even split, ragged last batch, batch > n, batch of 1, ragged."""
    from course_lib.data import make_linear
    from course_lib.models import LinearRegression

    shapes = [  # n, d, batch_size, lr
        (64, 3, 16, 0.1),   # batch_size divides n
        (50, 2, 16, 0.05),  # last batch smaller (50 = 3*16 + 2)
        (10, 4, 32, 0.1),   # batch_size > n: one batch
        (23, 1, 1, 0.02),   # batch_size 1: plain SGD
        (37, 5, 8, 0.2),    # ragged again, more features
    ]
    cases = []
    for k, (n, d, batch_size, lr) in enumerate(shapes):
        case_seed = seed + 1000 * k
        X, y, theta_true = make_linear(n_samples=n, n_features=d, noise=0.1, seed=case_seed)
        theta = np.random.default_rng(case_seed + 1).normal(size=np.shape(theta_true))

        def args(X=X, y=y, theta=theta, lr=lr, batch_size=batch_size, case_seed=case_seed):
            return (LinearRegression(), X.copy(), y.copy(), theta.copy(), lr, batch_size,
                    np.random.default_rng(case_seed + 2))

        label = f"n={n}, n_features={d}, batch_size={batch_size}, lr={lr}, theta {theta.shape}"
        cases.append(Case(label, args))
    return cases


def _diagnose_first_batch(first_loss: float, args: tuple) -> str:
    """What the student's first batch was, found by trying the usual mistakes on the case."""
    problem, X, y, theta, lr, batch_size, rng = args
    perm, b = rng.permutation(len(X)), batch_size
    rows = np.arange(len(X))
    tries = [
        (rows[:b], rows[:b], "you did not shuffle: perm = rng.permutation(len(X)) once, before "
         "the loop; the batches are perm[start:start + batch_size]."),
        (perm[:b], rows[:b], "X was shuffled but y was not: the labels belong to other rows. "
         "Index both with the same idx: X[idx], y[idx]."),
        (rows[:b], perm[:b], "y was shuffled but X was not: the labels belong to other rows. "
         "Index both with the same idx: X[idx], y[idx]."),
        (perm[1:b + 1], perm[1:b + 1], "the first batch starts at perm[1]: off by one. The "
         "batches are perm[start:start + batch_size] for start in range(0, n, batch_size)."),
        (perm[:b + 1], perm[:b + 1], "the first batch has batch_size + 1 rows: off by one in "
         "the slice, perm[start:start + batch_size]."),
        (perm[:b - 1], perm[:b - 1], "the first batch has batch_size - 1 rows: off by one in "
         "the slice, perm[start:start + batch_size]."),
    ]
    for ix, iy, text in tries:
        if len(ix) and np.isclose(problem.loss(theta, X[ix], y[iy]), first_loss, rtol=1e-9):
            return text
    step = theta - lr * problem.grad(theta, X[perm[:b]], y[perm[:b]])
    if np.isclose(problem.loss(step, X[perm[:b]], y[perm[:b]]), first_loss, rtol=1e-9):
        return ("you recorded the loss after the update: record problem.loss on the batch "
                "BEFORE updating theta.")
    return ("the very first batch loss differs: shuffle once with perm = "
            "rng.permutation(len(X)) before the loop, take the first batch_size indices of perm, "
            "and record problem.loss on that batch BEFORE updating theta.")


def _diagnose_minibatch(expected: tuple, got: Any, args: tuple) -> str | None:
    """Map the shape of a mismatch to the usual mini-batch SGD mistakes (``args``: fresh
    arguments of the failing case, to replay them)."""
    theta_e, losses_e = expected
    try:
        theta_g, losses_g = got
        losses_g = np.asarray(losses_g, dtype=float).ravel()
    except (TypeError, ValueError):
        return None
    losses_e = np.asarray(losses_e, dtype=float)
    if len(losses_g) != len(losses_e):
        return (f"expected ceil(n / batch_size) = {len(losses_e)} batches, got {len(losses_g)}. "
                "Off by one in the last batch? Keep the last, smaller batch: "
                "for start in range(0, n, batch_size): idx = perm[start:start + batch_size]")
    if not np.isclose(losses_g[0], losses_e[0], rtol=1e-6):
        return _diagnose_first_batch(losses_g[0], args)
    if np.all(np.isfinite(losses_g)) and losses_g.max() > 100 * losses_e.max():
        return ("your batch losses blow up: each step must use the MEAN gradient over the batch, "
                "problem.grad(theta, Xb, yb), not the sum (problem.grad_sum).")
    if not np.allclose(losses_g, losses_e, rtol=1e-6):
        bad = int(np.argmax(~np.isclose(losses_g, losses_e, rtol=1e-6)))
        return (f"batch {bad} is the first whose loss differs (the ones before match). "
                "Did you shuffle with rng.permutation once per epoch, not once per batch? "
                "Does each step use the batch gradient problem.grad (the mean, not the sum) "
                "and update theta right after each batch?")
    return ("all batch losses match but the returned theta differs: check the last update "
            "(the smaller final batch averages over its own size) and that you return the "
            "theta after the final batch.")


def check_minibatch_epoch(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 01 (gradient descent), exercise 1: one epoch of mini-batch SGD.

    ``student_fn(problem, X, y, theta, lr, batch_size, rng) -> (theta, batch_losses)`` must match
    ``course_lib.gd.minibatch_sgd_epoch`` given an identically seeded rng, on 5 cases. It must
    also leave the caller's ``theta`` (and ``X``, ``y``) unchanged: a training loop that keeps
    its starting point, or compares runs from one start, would silently break otherwise.
    """
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.gd import minibatch_sgd_epoch

    return run_check(
        "check_minibatch_epoch", student_fn, minibatch_sgd_epoch, _minibatch_cases(seed),
        output_names=("theta", "batch_losses"), inputs_unchanged=True,
        arg_names=("problem", "X", "y", "theta", "lr", "batch_size", "rng"),
        diagnose=_diagnose_minibatch,
        hint="shuffle once with rng.permutation(len(X)); for each consecutive batch record "
             "problem.loss(theta, Xb, yb), then theta = theta - lr * problem.grad(theta, Xb, yb).")


def _schedule_values(make_schedule: Callable, lr: float, drop: float, epochs_per_drop: int,
                     num_epochs: int) -> list[float]:
    schedule = make_schedule(lr, drop, epochs_per_drop)
    if not callable(schedule):
        raise CheckFailed(f"step_decay({lr}, {drop}, {epochs_per_drop}) returned "
                          f"{type(schedule).__name__}; it should return a function epoch -> lr")
    return [float(schedule(epoch)) for epoch in range(num_epochs)]


def _diagnose_step_decay(expected: list, got: Any) -> str | None:
    """Tell a smooth decay, an early or a late staircase, and a wrong start apart."""
    try:
        got = [float(v) for v in got]
    except (TypeError, ValueError):
        return None
    bad = int(np.argmax(~np.isclose(got, expected, rtol=1e-9)))
    if bad == 0:
        return "at epoch 0 the schedule must return the initial lr: the first drop comes later."
    formula = "lr * drop ** (epoch // epochs_per_drop)"
    first = f"epoch {bad} is the first that differs (expected {expected[bad]:.6g}, got " \
            f"{got[bad]:.6g}). "
    changes_twice = bad + 1 < len(got) and got[bad - 1] != got[bad] != got[bad + 1]
    if changes_twice and expected[bad + 1] == expected[bad]:
        return (first + "Your rate changes more often than the staircase: use integer division, "
                f"{formula}, so it stays flat for epochs_per_drop epochs.")
    if got[bad] < expected[bad]:
        return (first + "The rate drops too early: epochs count from 0 and the first drop "
                f"comes at epoch == epochs_per_drop. Use {formula}.")
    return first + f"The rate drops too late or not at all. Use {formula}."


def check_step_decay(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 01 (gradient descent), exercise 2: the step-decay learning-rate schedule.

    ``student_fn(lr, drop, epochs_per_drop)`` returns ``schedule(epoch) -> lr``; it must equal
    ``course_lib.gd.step_decay(lr, drop, epochs_per_drop)(epoch)`` for epochs 0..39 on 6 cases.
    """
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.gd import step_decay

    rng = np.random.default_rng(seed)
    params = [(0.1, 0.5, 10), (1.0, 0.1, 3), (0.05, 0.9, 1), (0.3, 0.5, 7), (0.01, 1.0, 4),
              (round(float(rng.uniform(0.01, 1)), 4), round(float(rng.uniform(0.2, 0.9)), 3),
               int(rng.integers(2, 6)))]
    num_epochs = 40
    cases = [Case(f"lr={lr}, drop={drop}, epochs_per_drop={k}, epochs 0..{num_epochs - 1}",
                  lambda lr=lr, drop=drop, k=k: (lr, drop, k, num_epochs))
             for lr, drop, k in params]
    return run_check(
        "check_step_decay",
        lambda *a: _schedule_values(student_fn, *a),
        lambda *a: _schedule_values(step_decay, *a),
        cases, rtol=1e-9, atol=1e-12, result_name="schedule", diagnose=_diagnose_step_decay,
        hint="return a function of epoch: lambda epoch: lr * drop ** (epoch // epochs_per_drop)")
