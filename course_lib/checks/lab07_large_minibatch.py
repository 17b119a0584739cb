"""Lab 07 (large mini-batches) checks: the warmup + linear-scaling schedule, and the largest batch
that keeps the small-batch accuracy.

Used in labs/07_large_minibatch.ipynb, on the framework of :mod:`course_lib.checks`::

    from course_lib.checks import lab07_large_minibatch as checks
    checks.check_warmup_schedule(linear_scaling_warmup)
    checks.check_largest_batch(largest_good_batch)

The first compares a student's schedule with ``scaling_rule.linear_scaling_warmup`` update by
update; the second calls the student's search with the reference schedule on the lab's setting
(:data:`LAB`) and recomputes every accuracy with :mod:`course_lib.large_batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from course_lib.checks.framework import Case, CheckFailed, not_implemented, run_check

# The lab's setting: a base learning rate high enough that the scaling rule hits its ceiling.
LAB = dict(batch_sizes=(32, 64, 128, 256, 512, 1024), base_lr=0.14, warmup_epochs=3,
           seeds=(0, 1, 2), tolerance=0.01)

# (base_lr, batch_size, base_batch_size, warmup_epochs, updates_per_epoch): the edge cases
_SCHEDULES = [
    (0.1, 1024, 32, 3, 10),     # k = 32, warmup of 30 updates
    (0.05, 256, 256, 2, 7),     # k = 1: a flat schedule, warmup or not
    (0.2, 64, 32, 0, 5),        # no warmup: the scaled rate from update 0
    (0.1, 512, 32, 0.5, 7),     # fractional warmup: W = 3.5 updates
    (0.4, 16, 64, 2, 4),        # k = 1/4: the rate ramps DOWN to the scaled one
    (0.1, 8192, 256, 5, 156),   # Goyal et al.: 0.1 -> 3.2 over 5 epochs of 156 updates
    (0.3, 100, 30, 1, 3),       # k = 10/3, not a power of two
]


def _updates(warmup_updates: float) -> list[int]:
    """Update indices around every interesting point of a schedule with W warmup updates."""
    w = int(np.floor(warmup_updates))
    points = {0, 1, 2, w - 1, w, w + 1, int(np.ceil(warmup_updates)), 2 * w + 3, 1000, 10**6}
    points |= {int(warmup_updates * f) for f in (0.25, 0.5, 0.75)}
    return sorted(p for p in points if p >= 0)


def _values(make_schedule: Callable, base_lr, batch_size, base_batch_size, warmup_epochs,
            updates_per_epoch) -> tuple[list[int], list[float]]:
    schedule = make_schedule(base_lr, batch_size, base_batch_size, warmup_epochs,
                             updates_per_epoch)
    if not callable(schedule):
        raise CheckFailed(f"linear_scaling_warmup(...) returned {type(schedule).__name__}; it "
                          "should return a function update -> lr")
    updates = _updates(warmup_epochs * updates_per_epoch)
    return updates, [float(schedule(u)) for u in updates]


def _diagnose_schedule(expected: tuple, got: Any) -> str | None:
    updates, expected = expected
    try:
        got = [float(v) for v in got[1]]
    except (TypeError, ValueError, IndexError):
        return None
    base_lr, target = expected[0], expected[-1]  # update 0, and update 10**6
    if np.isclose(got[-1], base_lr) and not np.isclose(target, base_lr):
        return ("after warmup the rate must be the SCALED one, base_lr * batch_size / "
                "base_batch_size (the linear scaling rule).")
    if not np.isclose(got[-1], target):
        return (f"after warmup the rate stays at base_lr * batch_size / base_batch_size = "
                f"{target:g}, whatever the update index (clamp the ramp).")
    if np.isclose(got[0], 0.0) and not np.isclose(base_lr, 0.0):
        return "the ramp starts at base_lr at update 0, not at 0."
    bad = int(np.argmax(~np.isclose(got, expected, rtol=1e-9)))
    return (f"update {updates[bad]} is the first that differs (expected {expected[bad]:.6g}, "
            f"got {got[bad]:.6g}). Ramp per UPDATE, not per epoch: lr(u) = base_lr + (target - "
            "base_lr) * u / W with W = warmup_epochs * updates_per_epoch (not rounded), and "
            "target from update W on (no warmup when W = 0).")


def check_warmup_schedule(student_fn: Callable) -> bool:
    """Lab 07, exercise 1: ``linear_scaling_warmup(base_lr, batch_size, base_batch_size,
    warmup_epochs, updates_per_epoch)`` returns ``schedule(update) -> lr`` equal to
    ``scaling_rule.linear_scaling_warmup``'s at every update around the warmup's start and end, on 7
    cases (no warmup, fractional warmup, k = 1, k < 1, k = 32 ...)."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.scaling_rule import linear_scaling_warmup
    cases = [Case("base_lr={}, batch_size={}, base_batch_size={}, warmup_epochs={}, "
                  "updates_per_epoch={}".format(*params), lambda params=params: params)
             for params in _SCHEDULES]
    return run_check(
        "check_warmup_schedule", lambda *a: _values(student_fn, *a),
        lambda *a: _values(linear_scaling_warmup, *a), cases, output_names=("updates", "rates"),
        rtol=1e-9, atol=1e-12, diagnose=_diagnose_schedule,
        hint="target = base_lr * batch_size / base_batch_size; W = warmup_epochs * "
             "updates_per_epoch; lr(u) = base_lr + (target - base_lr) * u / W for u < W, "
             "else target.")


_REFERENCE: dict = {}  # lab setting -> its recomputed answer (the runs are deterministic)


def reference_largest_batch(lab=None) -> tuple[int, dict]:
    """The lab's answer recomputed with the reference: ``(largest batch, {batch: mean acc})``."""
    from course_lib import large_batch
    lab = {**LAB, **(lab or {})}
    key = repr(sorted(lab.items()))
    if key not in _REFERENCE:
        rows = large_batch.accuracy_vs_batch(lab["batch_sizes"], variants=("warmup",),
                                             seeds=lab["seeds"], base_lr=lab["base_lr"],
                                             warmup_epochs=lab["warmup_epochs"])
        _REFERENCE[key] = (large_batch.largest_batch_within(rows, "warmup", lab["tolerance"]),
                           {r["batch_size"]: r["mean"] for r in rows})
    answer, accuracies = _REFERENCE[key]
    return answer, dict(accuracies)


def check_largest_batch(student_fn: Callable) -> bool:
    """Lab 07, exercise 2: ``largest_good_batch(make_schedule, batch_sizes, base_lr,
    warmup_epochs, seeds, tolerance) -> (batch, {batch: mean accuracy})``, called with
    ``scaling_rule.linear_scaling_warmup`` on the lab's setting, must give the reference's
    accuracies and the largest batch whose accuracy is within ``tolerance`` of the first batch
    size's."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.scaling_rule import linear_scaling_warmup
    lab = LAB
    try:
        got = student_fn(linear_scaling_warmup, lab["batch_sizes"], lab["base_lr"],
                         lab["warmup_epochs"], lab["seeds"], lab["tolerance"])
    except NotImplementedError:
        return not_implemented("check_largest_batch")
    answer, accuracies = reference_largest_batch()
    table = ", ".join(f"{b}: {100 * a:.1f}%" for b, a in accuracies.items())
    try:
        got_answer, got_acc = got
        got_acc = {int(b): float(a) for b, a in dict(got_acc).items()}
    except (TypeError, ValueError):
        raise CheckFailed(f"check_largest_batch: got {got!r}\nHint: return a pair, (largest "
                          "batch, {batch: mean accuracy}), as the cell above describes") from None
    for b, a in accuracies.items():
        if b not in got_acc or not np.isclose(got_acc[b], a, rtol=0, atol=1e-9):
            raise CheckFailed(
                f"check_largest_batch: the mean accuracy at batch {b} should be {100 * a:.2f}% "
                f"(got {got_acc.get(b)}).\nReference accuracies: {table}\nHint: for each batch "
                "size build the schedule with make_schedule(base_lr, batch, 32, warmup_epochs, "
                "gd.updates_per_epoch(n, batch, drop_last=True)) and average "
                "large_batch.train_and_test(batch, schedule, seed=seed)['accuracy'] over seeds.")
    if got_answer != answer:
        raise CheckFailed(
            f"check_largest_batch: the largest batch within {100 * lab['tolerance']:g} point(s) "
            f"of the baseline ({100 * accuracies[lab['batch_sizes'][0]]:.1f}%) is {answer}, "
            f"you returned {got_answer}.\nAccuracies: {table}\nHint: keep every batch whose "
            "accuracy >= baseline - tolerance, and return the LARGEST of them.")
    print(f"✓ check_largest_batch: {answer} is the largest batch within "
          f"{100 * lab['tolerance']:g} point(s) of the baseline ({table})")
    return True
