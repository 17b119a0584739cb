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


def _warmup_like(mistake: str) -> Callable:
    """The schedule of exercise 1 as written with ``mistake``."""
    def make(base_lr, batch_size, base_batch_size, warmup_epochs, updates_per_epoch):
        k = {"square root": np.sqrt(batch_size / base_batch_size),
             "inverted": base_batch_size / batch_size,
             "whole ratio": batch_size // base_batch_size}.get(mistake,
                                                              batch_size / base_batch_size)
        target = base_lr * k
        w = {"rounded W": int(warmup_epochs * updates_per_epoch),
             "W in epochs": warmup_epochs}.get(mistake, warmup_epochs * updates_per_epoch)

        def schedule(u):
            if mistake == "no clamp":
                return base_lr + (target - base_lr) * u / w if w else target
            if u >= w:
                return target
            if mistake == "one update ahead":
                return base_lr + (target - base_lr) * (u + 1) / w
            if mistake == "W - 1":
                return base_lr + (target - base_lr) * u / max(w - 1, 1)
            if mistake == "geometric":
                return base_lr * (target / base_lr) ** (u / w)
            if mistake == "never below base_lr":
                return max(base_lr, base_lr + (target - base_lr) * u / w)
            return base_lr + (target - base_lr) * u / w
        return schedule
    return make


# The usual mistakes of the schedule, replayed: (mistake, what the student's schedule did).
WARMUP_MISTAKES = [
    ("square root", "your rate after warmup is base_lr x sqrt(batch_size / base_batch_size): "
     "that is the square-root rule; this lab asks for the linear one."),
    ("inverted", "your rate after warmup is base_lr x base_batch_size / batch_size: the ratio "
     "is upside down, so a larger batch gets a smaller rate."),
    ("whole ratio", "your batch ratio was rounded down to a whole number (//): with batch sizes "
     "that do not divide, the scaled rate is off."),
    ("rounded W", "your number of warmup updates was rounded to a whole number: W = "
     "warmup_epochs x updates_per_epoch may be a fraction (half an epoch of 7 updates is 3.5)."),
    ("W in epochs", "your ramp lasts warmup_epochs UPDATES: the warmup is counted in epochs, "
     "each of updates_per_epoch updates."),
    ("no clamp", "your ramp goes on rising past the warmup: from update W on the rate stays at "
     "the scaled one."),
    ("one update ahead", "your ramp is one update ahead: at update 0 the rate is still base_lr "
     "(updates count from 0)."),
    ("W - 1", "your ramp reaches the target one update early (it divides by W - 1): at "
     "update W - 1 the rate is still one step short of the target."),
    ("geometric", "your ramp is geometric (the rate multiplied by the same factor each "
     "update): the warmup rises LINEARLY, by the same amount each update."),
    ("never below base_lr", "when the batch is smaller than the base batch your rate never "
     "goes below base_lr: the ramp goes DOWN then, to a scaled rate below base_lr."),
]


def _diagnose_schedule(expected: tuple, got: Any, args: tuple) -> str | None:
    updates, expected = expected
    try:
        got = [float(v) for v in got[1]]
    except (TypeError, ValueError, IndexError):
        return None
    for mistake, text in WARMUP_MISTAKES:
        try:
            theirs = _values(_warmup_like(mistake), *args)[1]
        except ZeroDivisionError:
            continue
        if np.allclose(got, theirs, rtol=1e-9, atol=1e-12):
            return text
    base_lr, target = expected[0], expected[-1]  # update 0, and update 10**6
    if np.isclose(got[-1], base_lr) and not np.isclose(target, base_lr):
        return ("after warmup your rate is base_lr, unscaled: a batch batch_size / "
                "base_batch_size times larger gets a rate that many times larger (the linear "
                "scaling rule).")
    if not np.isclose(got[-1], target):
        return (f"long after warmup your rate is {got[-1]:.6g}, not the scaled {target:g}: from "
                f"update W on it stays there, whatever the update index.")
    if np.isclose(got[0], 0.0) and not np.isclose(base_lr, 0.0):
        return "your ramp starts at 0: at update 0 the rate is base_lr, not at 0."
    bad = int(np.argmax(~np.isclose(got, expected, rtol=1e-9)))
    return (f"update {updates[bad]} is the first that differs (expected {expected[bad]:.6g}, "
            f"got {got[bad]:.6g}). The ramp moves per UPDATE, not per epoch, over W = "
            f"warmup_epochs x updates_per_epoch updates (not rounded), and there is no warmup "
            f"when W = 0.")


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
        hint="the rate starts at base_lr, moves linearly, update by update, to the scaled "
             "target over the W warmup updates, and stays at the target from update W on (no "
             "warmup at all when W = 0).")


_REFERENCE: dict = {}  # lab setting -> its recomputed answer (the runs are deterministic)
_RUNS: dict = {}  # (arguments, the schedule's rates) -> what large_batch.train_and_test returned


class _SameRuns:
    """Stands in for ``large_batch.train_and_test`` while a check runs: a run is made once per
    batch size, schedule (its rates over the run), seed and setting, and given again after that
    (the runs are deterministic), so the reference's runs and the student's are shared, and the
    student's search can be asked again at other tolerances for free."""

    def __init__(self):
        import inspect

        from course_lib import large_batch
        self.module, self.original = large_batch, large_batch.train_and_test
        self.signature, self.hits = inspect.signature(self.original), 0

    def __call__(self, *args, **kwargs):
        import copy
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        schedule = a.pop("update_schedule")
        n = len(self.module._digits()[0])
        updates = a["num_epochs"] * -(-n // a["batch_size"]) + 1
        key = (repr(sorted(a.items())), tuple(float(schedule(u)) for u in range(updates)))
        if key in _RUNS:
            self.hits += 1
        else:
            _RUNS[key] = self.original(*args, **kwargs)
        return copy.deepcopy(_RUNS[key])

    def __enter__(self):
        self.module.train_and_test = self
        return self

    def __exit__(self, *exc):
        self.module.train_and_test = self.original


class _Swapped(_SameRuns):
    """The same runs, but the accuracies of two batch sizes exchanged (``swap``: batch -> the
    batch whose run it gets, ``runs``: batch -> accuracy per seed of ``seeds``): a larger batch
    then comes back within the tolerance after a smaller one fell out of it."""

    def __init__(self, swap: dict, runs: dict, seeds: tuple):
        super().__init__()
        self.swap, self.runs, self.seeds = swap, runs, list(seeds)

    def __call__(self, *args, **kwargs):
        run = super().__call__(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        b, seed = bound.arguments["batch_size"], bound.arguments["seed"]
        if b in self.swap and seed in self.seeds:
            run["accuracy"] = self.runs[self.swap[b]][self.seeds.index(seed)]
        return run


def _reference(lab=None) -> tuple[int, dict, dict]:
    """The lab's answer recomputed: (largest batch, {batch: mean acc}, {batch: per-seed accs})."""
    from course_lib import large_batch
    lab = {**LAB, **(lab or {})}
    key = repr(sorted(lab.items()))
    if key not in _REFERENCE:
        with _SameRuns():
            rows = large_batch.accuracy_vs_batch(lab["batch_sizes"], variants=("warmup",),
                                                 seeds=lab["seeds"], base_lr=lab["base_lr"],
                                                 warmup_epochs=lab["warmup_epochs"])
        _REFERENCE[key] = (large_batch.largest_batch_within(rows, "warmup", lab["tolerance"]),
                           {r["batch_size"]: r["mean"] for r in rows},
                           {r["batch_size"]: list(r["accuracies"]) for r in rows})
    answer, accuracies, runs = _REFERENCE[key]
    return answer, dict(accuracies), {b: list(a) for b, a in runs.items()}


def reference_largest_batch(lab=None) -> tuple[int, dict]:
    """The lab's answer recomputed with the reference: ``(largest batch, {batch: mean acc})``."""
    answer, accuracies, _ = _reference(lab)
    return answer, accuracies


def _accuracy_hint(got_acc: dict, accuracies: dict, runs: dict) -> str:
    """What the student's accuracies are, told from the reference's runs of every seed."""
    def fits(value):
        return all(b in got_acc and np.isclose(got_acc[b], value(b), rtol=0, atol=1e-9)
                   for b in accuracies)
    for value, text in [
            (lambda b: 100 * accuracies[b], "your accuracies are percentages: keep them as "
             "fractions (0.97, not 97), as train_and_test returns them and the tolerance is "
             "given."),
            (lambda b: runs[b][0], "your accuracies are those of the first seed alone: each is "
             "the mean over ALL the seeds."),
            (lambda b: runs[b][-1], "your accuracies are those of the last seed alone (a value "
             "overwritten at each seed?): each is the mean over all the seeds."),
            (lambda b: float(np.median(runs[b])), "your accuracies are the median over the "
             "seeds: each is their mean."),
            (lambda b: max(runs[b]), "your accuracies are the best seed's: each is the mean over "
             "the seeds."),
            (lambda b: sum(runs[b]), "your accuracies are the SUM over the seeds: divide by how "
             "many there are (the mean)."),
    ]:
        if fits(value):
            return text
    base = min(accuracies)
    right = [b for b in accuracies if b in got_acc
             and np.isclose(got_acc[b], accuracies[b], rtol=0, atol=1e-9)]
    if base in right and len(right) < len(accuracies):
        return (f"batch {base}'s accuracy is right, the larger batches' are not: at batch "
                f"{base} the schedule neither scales nor warms up, so the runs differ where it "
                f"does. Check what you give make_schedule for each batch: the base batch size, "
                f"warmup_epochs, and the updates per epoch of an experiment that drops each "
                f"epoch's incomplete batch.")
    return ("for each batch size the mean over the seeds of the test accuracy of one run of "
            "the lecture's experiment with the schedule make_schedule builds for that batch: "
            "see the cell above the exercise.")


def _answer_rules(accuracies: dict, batches: list, tol: float) -> list[tuple[Any, str]]:
    """(the answer, what the rule did) of the usual wrong ways of choosing the batch."""
    base = accuracies[batches[0]]
    within = lambda b, baseline, t: accuracies[b] >= baseline - t - 1e-12  # noqa: E731
    first_failure = next((i for i, b in enumerate(batches) if not within(b, base, tol)), None)
    return [
        (max(batches, key=lambda b: accuracies[b]), "you returned the batch with the best "
         "accuracy: the question is the LARGEST batch still within the tolerance of the "
         "baseline."),
        (max((b for b in batches if within(b, max(accuracies.values()), tol)), default=None),
         "your baseline is the best accuracy over all the batches: it is the accuracy at the "
         "first (smallest) batch size."),
        (max((b for b in batches if within(b, base, tol * base)), default=None),
         "your tolerance is relative (a fraction of the baseline): it is in accuracy points, "
         "subtracted from the baseline."),
        (min((b for b in batches if b != batches[0] and within(b, base, tol)), default=None),
         "you returned the SMALLEST batch within the tolerance: the question is the largest."),
        (batches[first_failure - 1] if first_failure else None,
         "you stopped at the first batch that falls out of the tolerance: a larger batch may "
         "come back within it, and the largest of all those within counts."),
        (max((b for b in batches if within(b, base, 100 * tol)), default=None),
         "your tolerance is 100 times too large: it is given as a fraction of accuracy (0.01 "
         "= one percentage point), like the accuracies."),
    ]


def _right_answer(accuracies: dict, batches: list, tol: float) -> int:
    base = accuracies[batches[0]]
    return max(b for b in batches if accuracies[b] >= base - tol - 1e-12)


def _answer_hint(answers: dict, accuracies: dict, batches: list) -> str:
    """The usual wrong rule of choosing the batch that gives the student's answer at every
    tolerance asked (``answers``: tolerance -> the student's answer)."""
    rules = {t: _answer_rules(accuracies, batches, t) for t in answers}
    for k, (_, text) in enumerate(next(iter(rules.values()))):
        if all(rules[t][k][0] == got for t, got in answers.items()):
            return text
    return ("keep every batch whose mean accuracy is at least the baseline minus the "
            "tolerance, and return the largest of them.")


def _other_tolerances(accuracies: dict, batches: list, most: int = 24) -> list:
    """Tolerances well away from every accuracy's boundary, one between each two of them, at
    which the usual wrong rules part from the right one and from one another."""
    base, best = accuracies[batches[0]], max(accuracies.values())
    edges = sorted({round(x, 12) for b in batches
                    for x in (base - accuracies[b], best - accuracies[b],
                              (base - accuracies[b]) / base) if x > 0})
    middles = [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:], strict=False)]
    return (middles + ([edges[-1] * 1.5] if edges else []))[:most]


def _check_a_batch_that_comes_back(student_fn, accuracies, runs, batches):
    """Ask the search again with the runs of the last batch within the tolerance and of the
    largest batch exchanged: a batch then comes back within it after one that fell out."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.scaling_rule import linear_scaling_warmup
    lab, base = LAB, accuracies[batches[0]]
    ok = [accuracies[b] >= base - lab["tolerance"] for b in batches]
    first_out = ok.index(False) if not all(ok) else None
    # nothing to exchange: every batch within, only the baseline within, only the largest out,
    # or the lab's runs already come back
    if first_out is None or first_out < 2 or first_out == len(batches) - 1 \
            or any(ok[first_out:]):
        return
    good, far = batches[first_out - 1], batches[-1]
    swap = {good: far, far: good}
    swapped = {b: accuracies[swap.get(b, b)] for b in batches}
    with _Swapped(swap, runs, lab["seeds"]):
        got = student_fn(linear_scaling_warmup, lab["batch_sizes"], lab["base_lr"],
                         lab["warmup_epochs"], lab["seeds"], lab["tolerance"])[0]
    right = _right_answer(swapped, batches, lab["tolerance"])
    if got != right:
        table = ", ".join(f"{b}: {100 * a:.1f}%" for b, a in swapped.items())
        raise CheckFailed(
            f"check_largest_batch: asked again with the runs of batches {good} and {far} "
            f"exchanged, the largest batch within {100 * lab['tolerance']:g} point(s) of the "
            f"baseline is {right}, you returned {got}.\nAccuracies: {table}\nHint: "
            f"{_answer_hint({lab['tolerance']: got}, swapped, batches)}")


def check_largest_batch(student_fn: Callable) -> bool:
    """Lab 07, exercise 2: ``largest_good_batch(make_schedule, batch_sizes, base_lr,
    warmup_epochs, seeds, tolerance) -> (batch, {batch: mean accuracy})``, called with
    ``scaling_rule.linear_scaling_warmup`` on the lab's setting, must give the reference's
    accuracies and the largest batch whose accuracy is within ``tolerance`` of the first batch
    size's."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.scaling_rule import linear_scaling_warmup
    lab = LAB
    answer, accuracies, runs = _reference()
    try:
        with _SameRuns() as same:
            got = student_fn(linear_scaling_warmup, lab["batch_sizes"], lab["base_lr"],
                             lab["warmup_epochs"], lab["seeds"], lab["tolerance"])
    except NotImplementedError:
        return not_implemented("check_largest_batch")
    table = ", ".join(f"{b}: {100 * a:.1f}%" for b, a in accuracies.items())
    try:
        got_answer, got_acc = got
        if isinstance(got_answer, dict) and not isinstance(got_acc, dict):
            raise CheckFailed(f"check_largest_batch: got ({{...}}, {got_acc!r})\nHint: the "
                              f"pair is the other way round: (largest batch, {{batch: mean "
                              f"accuracy}}).")
        got_acc = {int(b): float(a) for b, a in dict(got_acc).items()}
    except (TypeError, ValueError):
        raise CheckFailed(f"check_largest_batch: got {got!r}\nHint: return a pair, (largest "
                          "batch, {batch: mean accuracy}), as the cell above describes") from None
    for b, a in accuracies.items():
        if b not in got_acc or not np.isclose(got_acc[b], a, rtol=0, atol=1e-9):
            raise CheckFailed(
                f"check_largest_batch: the mean accuracy at batch {b} should be {100 * a:.2f}% "
                f"(got {got_acc.get(b)}).\nReference accuracies: {table}\nHint: "
                f"{_accuracy_hint(got_acc, accuracies, runs)}")
    batches = list(lab["batch_sizes"])
    base = 100 * accuracies[batches[0]]
    if got_answer != answer:
        raise CheckFailed(
            f"check_largest_batch: the largest batch within {100 * lab['tolerance']:g} point(s) "
            f"of the baseline ({base:.1f}%) is {answer}, you returned {got_answer}.\n"
            f"Accuracies: {table}\nHint: "
            f"{_answer_hint({lab['tolerance']: got_answer}, accuracies, batches)}")
    # the same runs, other tolerances, where the usual wrong rules part from the right one and
    # from one another (free when the search calls large_batch.train_and_test: the check gives
    # each run again)
    answers = {lab["tolerance"]: got_answer}
    for tol in (_other_tolerances(accuracies, batches) if same.hits else []):
        with _SameRuns():
            answers[tol] = student_fn(linear_scaling_warmup, lab["batch_sizes"], lab["base_lr"],
                                      lab["warmup_epochs"], lab["seeds"], tol)[0]
    wrong = [t for t, got in answers.items() if got != _right_answer(accuracies, batches, t)]
    if wrong:
        tol = wrong[0]
        raise CheckFailed(
            f"check_largest_batch: asked again with tolerance={tol:.4f} ({100 * tol:.2f} "
            f"points; the same runs), the largest batch within it of the baseline ({base:.1f}%) "
            f"is {_right_answer(accuracies, batches, tol)}, you returned {answers[tol]}.\n"
            f"Accuracies: {table}\nHint: {_answer_hint(answers, accuracies, batches)}")
    if same.hits:
        _check_a_batch_that_comes_back(student_fn, accuracies, runs, batches)
    print(f"✓ check_largest_batch: {answer} is the largest batch within "
          f"{100 * lab['tolerance']:g} point(s) of the baseline ({table})")
    return True
