"""Lab 01's checks (labs/01_gradient_descent.ipynb): a mini-batch SGD epoch and a step-decay
schedule, each compared with :mod:`course_lib.gd` on fresh seeded cases."""

from __future__ import annotations

import copy
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


# The usual mistakes of an epoch, replayed on the failing case: (mistake, what it did). A
# mistake is named only when its replay gives the student's theta and batch losses both.
EPOCH_MISTAKES = [
    ("no shuffle", "your batches are the rows in their stored order: the epoch must visit them "
     "in the random order drawn from rng."),
    ("perm per batch", "each batch came from a new permutation: drawn once per epoch, the "
     "batches visit every row exactly once; drawn per batch, some rows come twice, others "
     "never."),
    ("y not shuffled", "X was shuffled but y was not: the labels belong to other rows."),
    ("X not shuffled", "y was shuffled but X was not: the labels belong to other rows."),
    ("two perms", "X and y were shuffled with two different permutations: the labels belong "
     "to other rows."),
    ("start + 1", "the first batch starts at perm[1]: off by one in where each batch starts, "
     "and perm[0] is never visited."),
    ("end + 1", "each batch has one row more than batch_size: off by one at the end of the "
     "slice."),
    ("end - 1", "each batch has one row fewer than batch_size: off by one at the end of the "
     "slice."),
    ("fixed end", "every batch after the first is empty (its loss is nan): the end of your "
     "slice does not move with its start."),
    ("loss after", "you recorded each batch's loss after its update: the loss belongs to the "
     "theta the step starts from."),
    ("loss on all", "you recorded the loss of all the data at each step, not the loss of the "
     "batch."),
    ("grad on all", "each step followed the gradient of all the data, not of its batch: that "
     "is batch gradient descent, run once per batch."),
    ("sum", "your steps follow the SUM of the batch's per-row gradients, batch_size times too "
     "long: problem.grad is a mean over the rows."),
    ("divide by batch_size", "the last, smaller batch's summed gradient was divided by "
     "batch_size, not by its own number of rows: its step is too short."),
    ("divide by n", "your steps are divided by the number of rows of ALL the data: n / "
     "batch_size times too short."),
    ("no lr", "your steps leave out the learning rate: each is 1 / lr times too long."),
    ("uphill", "your steps go UP the gradient: the loss grows."),
    ("drop last", "your epoch skipped the last, smaller batch: its rows were never visited."),
    ("stop early", "your loop stopped one batch early: the rows of the last batch were never "
     "visited."),
    ("equal parts", "you cut the rows into len(X) // batch_size parts of near-equal size: "
     "the batches must have batch_size rows each, only the last one smaller."),
    ("first theta", "the batch losses are right, but the theta you returned is the one you "
     "started from, not the one after the last step."),
]


def _epoch_variant(problem, X, y, theta, lr, batch_size, rng, mistake):
    """One epoch of mini-batch SGD as written with ``mistake`` (see EPOCH_MISTAKES)."""
    n, b = len(X), batch_size
    perm = np.arange(n) if mistake in ("no shuffle", "perm per batch") else rng.permutation(n)
    perm_y = (np.arange(n) if mistake == "y not shuffled" else
              rng.permutation(n) if mistake == "two perms" else perm)
    perm_x = np.arange(n) if mistake == "X not shuffled" else perm
    if mistake == "equal parts":
        batches = np.array_split(np.arange(n), max(n // b, 1))
    else:
        stop = {"drop last": max(n // b, 1) * b, "stop early": n - b}.get(mistake, n)
        first = 1 if mistake == "start + 1" else 0
        ends = {"end + 1": 1, "end - 1": -1}.get(mistake, first)
        batches = [np.arange(s + first, min(n, b if mistake == "fixed end" else s + b + ends))
                   for s in range(0, stop, b)]
    start, losses = theta, []
    with np.errstate(all="ignore"):
        for rows in batches:
            if mistake == "perm per batch":
                perm_x = perm_y = rng.permutation(n)
            ix, iy = perm_x[rows], perm_y[rows]
            Xb, yb = X[ix], y[iy]
            if not len(Xb):
                losses.append(np.nan)
                continue
            if mistake == "loss on all":
                losses.append(problem.loss(theta, X, y))
            elif mistake != "loss after":
                losses.append(problem.loss(theta, Xb, yb))
            if mistake == "grad on all":
                step = problem.grad(theta, X, y)
            else:
                step = problem.grad_sum(theta, Xb, yb) / {
                    "sum": 1, "divide by batch_size": b, "divide by n": n}.get(mistake, len(Xb))
            theta = theta - {"no lr": 1.0, "uphill": -lr}.get(mistake, lr) * step
            if mistake == "loss after":
                losses.append(problem.loss(theta, Xb, yb))
    return (start if mistake == "first theta" else theta), losses


def _same(a, b) -> bool:
    try:
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    except (TypeError, ValueError):
        return False
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True))


def _diagnose_minibatch(expected: tuple, got: Any, args: tuple) -> str | None:
    """Replay the usual mini-batch SGD mistakes on the failing case (``args``: fresh arguments)
    and name the one that gives the student's theta and batch losses; else say what differs."""
    theta_e, losses_e = expected
    try:
        theta_g, losses_g = got
    except (TypeError, ValueError):
        return None
    if np.ndim(losses_g) == 0:
        return ("batch_losses is a single number: it must be a list with one loss per batch, "
                "in the order of the batches.")
    for mistake, text in EPOCH_MISTAKES:
        problem, X, y, theta, lr, batch_size, rng = copy.deepcopy(args)  # a fresh rng each
        with np.errstate(all="ignore"):
            replay = _epoch_variant(problem, X, y, theta, lr, batch_size, rng, mistake)
        if _same(replay[0], theta_g) and _same(replay[1], losses_g):
            return text
    losses_g = np.asarray(losses_g, dtype=float).ravel()
    losses_e = np.asarray(losses_e, dtype=float)
    n, b = len(args[1]), args[5]
    if len(losses_g) != len(losses_e):
        way = "stops early" if len(losses_g) < len(losses_e) else "runs too far"
        return (f"your epoch has {len(losses_g)} batches, not {len(losses_e)}: {n} rows in "
                f"batches of {b} (the last one smaller if need be) are {len(losses_e)}, and "
                f"your loop {way}.")
    if not np.isclose(losses_g[0], losses_e[0], rtol=1e-6):
        return ("your very first batch loss differs: the first batch is not the first "
                "batch_size positions of the one permutation drawn from rng (a permutation from "
                "np.random, or from a generator of your own, is another order), or its loss was "
                "not taken on that batch before the step.")
    if not np.allclose(losses_g, losses_e, rtol=1e-6):
        bad = int(np.argmax(~np.isclose(losses_g, losses_e, rtol=1e-6)))
        return (f"batch {bad} is the first whose loss differs (the ones before match): the "
                f"step after batch {bad - 1} (or the rows of batch {bad}) is not right.")
    return ("all batch losses match but the returned theta differs: the last step (on the "
            "smaller final batch, whose mean is over its own rows) is missing or wrong.")


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
        hint="go through the three steps above the exercise again: one permutation of the rows "
             "per epoch, consecutive batches, the loss of each batch before its step.")


def _schedule_values(make_schedule: Callable, lr: float, drop: float, epochs_per_drop: int,
                     num_epochs: int) -> list[float]:
    schedule = make_schedule(lr, drop, epochs_per_drop)
    if not callable(schedule):
        raise CheckFailed(f"step_decay({lr}, {drop}, {epochs_per_drop}) returned "
                          f"{type(schedule).__name__}; it should return a function epoch -> lr")
    values = [float(schedule(epoch)) for epoch in range(num_epochs)]
    again = [float(schedule(epoch)) for epoch in (0, num_epochs - 1, 1)]
    if again != [values[0], values[-1], values[1]]:
        raise CheckFailed(
            f"asked again after epochs 0..{num_epochs - 1}, your schedule gave epoch 0 "
            f"{again[0]:.6g} (first {values[0]:.6g}), epoch {num_epochs - 1} {again[1]:.6g} "
            f"(first {values[-1]:.6g}), epoch 1 {again[2]:.6g} (first {values[1]:.6g}): it "
            f"keeps state between calls (a rate it multiplies as it goes, a counter). The rate "
            f"of an epoch must depend on that epoch alone: a training loop may ask twice, or "
            f"start again from a checkpoint.")
    return values


# The usual mistakes of a step-decay schedule: (mistake, rate at an epoch, what it did).
STEP_DECAY_MISTAKES = [
    ("true division", lambda lr, d, k, e: lr * d ** (e / k),
     "your rate changes at every epoch (a smooth decay): a staircase stays flat for "
     "epochs_per_drop epochs, since only whole periods count (integer division)."),
    ("constant", lambda lr, d, k, e: lr, "your rate never drops: it is lr at every epoch "
     "(drops not at all)."),
    ("every epoch", lambda lr, d, k, e: lr * d ** e,
     "your rate drops at every epoch, not once every epochs_per_drop epochs."),
    ("from 1", lambda lr, d, k, e: lr * d ** ((e - 1) // k),
     "at epoch 0 your rate is lr / drop: you count epochs from 1, but they count from 0."),
    ("already dropped", lambda lr, d, k, e: lr * d ** (1 + e // k),
     "your rate has dropped once already at epoch 0: the first drop comes after "
     "epochs_per_drop epochs."),
    ("one early", lambda lr, d, k, e: lr * d ** ((e + 1) // k),
     "your rate drops too early, one epoch before each period ends: epochs count from 0, so "
     "the first period is epochs 0 .. epochs_per_drop - 1."),
    ("period + 1", lambda lr, d, k, e: lr * d ** (e // (k + 1)),
     "your rate drops too late: every epochs_per_drop + 1 epochs, a period one epoch too long."),
    ("ceil", lambda lr, d, k, e: lr * d ** -(-e // k),
     "your rate drops already at epoch 1: the number of periods is rounded up, but only "
     "complete periods count."),
    ("round", lambda lr, d, k, e: lr * d ** round(e / k),
     "your rate drops half-way through each period: the number of periods is rounded to the "
     "nearest, but only complete periods count."),
    ("within period", lambda lr, d, k, e: lr * d ** (e % k),
     "your rate comes back up to lr at the start of every period: its exponent is the epoch "
     "within the period (a remainder), not the number of periods gone by."),
    ("times count", lambda lr, d, k, e: lr * d * (e // k),
     "your rate is lr x drop x the number of periods gone by (0 at epoch 0): the drops "
     "compound, each multiplying the rate by drop once more."),
    ("1 - drop", lambda lr, d, k, e: lr * (1 - d) ** (e // k),
     "each drop multiplies your rate by 1 - drop: drop is the factor itself (drop = 0.5 "
     "halves the rate)."),
    ("minus", lambda lr, d, k, e: lr - d * (e // k),
     "your rate goes down by drop at each drop (and turns negative): drop is a factor the "
     "rate is multiplied by, not an amount taken off."),
    ("divide", lambda lr, d, k, e: lr / d ** (e // k),
     "your rate grows at each drop: it is divided by drop, where a drop multiplies by it."),
    ("exp", lambda lr, d, k, e: lr * np.exp(-d * (e // k)),
     "each drop multiplies your rate by exp(-drop): drop is the factor itself."),
    ("k drops", lambda lr, d, k, e: lr * d ** (e // k * k),
     "at each drop your rate falls by drop ** epochs_per_drop: one drop multiplies it by drop "
     "once."),
    ("swapped", lambda lr, d, k, e: lr * k ** (e // d),
     "your function reads drop and epochs_per_drop the other way round: the order is "
     "step_decay(lr, drop, epochs_per_drop)."),
]


def _diagnose_step_decay(expected: list, got: Any, args: tuple) -> str | None:
    """Name the usual mistake whose rates are the student's, else where the two part."""
    try:
        got = [float(v) for v in got]
    except (TypeError, ValueError):
        return None
    lr, drop, k, num_epochs = args
    for _, rate, text in STEP_DECAY_MISTAKES:
        with np.errstate(all="ignore"):
            try:
                theirs = [float(rate(lr, drop, k, e)) for e in range(num_epochs)]
            except (ZeroDivisionError, OverflowError, ValueError):
                continue
        if np.allclose(got, theirs, rtol=1e-9, atol=1e-12):
            return text
    bad = int(np.argmax(~np.isclose(got, expected, rtol=1e-9)))
    first = (f"epoch {bad} is the first that differs (expected {expected[bad]:.6g}, got "
             f"{got[bad]:.6g}). ")
    if bad == 0:
        return first + "At epoch 0 the schedule gives the initial lr: no drop has come yet."
    if got[bad] < expected[bad]:
        return first + "Your rate drops too early or too far."
    return first + "Your rate drops too late, too little, or not at all."


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
        hint="the schedule is a function of the epoch: flat for epochs_per_drop epochs, then "
             "multiplied by drop, flat again, and so on; epochs count from 0.")
