"""Lab checks: run a student's function and the reference side by side on seeded random cases.

Use in a lab notebook right under the exercise cell::

    from course_lib import checks
    ok_epoch = checks.check_minibatch_epoch(minibatch_epoch)

A check prints ``✓ check_name: 5/5 cases match the reference`` and returns True, or raises
``CheckFailed`` (an ``AssertionError``) whose message names the case, the input sizes, what was
expected and what came back, and a hint. A function that still raises ``NotImplementedError``
gets a friendly notice and the check returns False without raising, so the generated student
notebook runs from top to bottom.

Adding a check for a new lab: build a list of ``Case`` (a label and a function returning fresh
arguments) and call ``run_check``; pass ``diagnose`` to turn a mismatch into a targeted hint.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


class CheckFailed(AssertionError):
    """A student's function disagrees with the reference; the message says where and why."""


@dataclass
class Case:
    """One test case: ``args()`` returns fresh positional arguments (new arrays, new rng)."""

    label: str
    args: Callable[[], tuple]


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _as_array(x: Any) -> np.ndarray:
    if _is_tensor(x):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=float)


def _summary(a: np.ndarray) -> str:
    """A short human summary of an array: shape and (first) values."""
    flat = a.ravel()
    head = np.array2string(flat[:4], precision=5, separator=", ")
    more = " ..." if flat.size > 4 else ""
    return f"shape {a.shape}, values {head}{more}"


def compare(expected: Any, got: Any, name: str = "output", rtol: float = 1e-6,
            atol: float = 1e-9) -> str | None:
    """Describe the first difference between ``expected`` and ``got``, or return None.

    Tuples and lists are compared element by element (length first); numbers, numpy arrays and
    torch tensors by shape and ``np.allclose(got, expected, rtol, atol)``.
    """
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list, np.ndarray)) and not _is_tensor(got):
            return (f"{name}: expected a sequence of length {len(expected)}, "
                    f"got {type(got).__name__}")
        if len(got) != len(expected):
            return f"{name}: expected length {len(expected)}, got length {len(got)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            problem = compare(e, g, f"{name}[{i}]", rtol, atol)
            if problem:
                return problem
        return None
    try:
        e, g = _as_array(expected), _as_array(got)
    except (TypeError, ValueError):
        return f"{name}: expected a number or an array, got {type(got).__name__}"
    if e.shape != g.shape:
        return f"{name}: expected shape {e.shape}, got shape {g.shape}"
    if not np.allclose(g, e, rtol=rtol, atol=atol):
        if e.ndim == 0:
            return f"{name}: expected {e.item():.6g}, got {g.item():.6g}"
        worst = np.unravel_index(np.argmax(np.abs(g - e)), e.shape)
        return (f"{name}: values differ (largest difference at index {tuple(map(int, worst))}: "
                f"expected {e[worst]:.6g}, got {g[worst]:.6g})\n"
                f"  expected {_summary(e)}\n  got      {_summary(g)}")
    return None


def _changed_inputs(before: tuple, after: tuple) -> list[int]:
    """Positions of array/tensor arguments whose values differ between two argument tuples."""
    changed = []
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if (isinstance(b, np.ndarray) or _is_tensor(b)) and compare(b, a, rtol=0, atol=0):
            changed.append(i)
    return changed


def not_implemented(name: str) -> bool:
    """Print the friendly 'not implemented yet' notice; return False."""
    print(f"… {name}: not implemented yet — fill in the cell above, then run this check again.")
    return False


def run_check(name: str, student_fn: Callable, reference_fn: Callable, cases: Sequence[Case],
              *, hint: str, output_names: Sequence[str] | None = None, rtol: float = 1e-6,
              atol: float = 1e-9, result_name: str = "result", arg_names: Sequence[str] = (),
              inputs_unchanged: bool = False,
              diagnose: Callable[[Any, Any], str | None] | None = None) -> bool:
    """Compare ``student_fn(*case.args())`` with ``reference_fn(*case.args())`` on every case.

    Each side gets its own fresh arguments. ``output_names`` labels the parts of a tuple
    result (``result_name`` a single result); ``inputs_unchanged`` makes it an error to modify
    an array argument in place (``arg_names`` names them in the message);
    ``diagnose(expected, got)`` may return a hint more specific than ``hint``. Prints the pass
    line and returns True; returns False if the student function raises NotImplementedError;
    raises CheckFailed otherwise.
    """
    for number, case in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({case.label})"
        expected = reference_fn(*case.args())
        args = case.args()
        try:
            got = student_fn(*args)
        except NotImplementedError:
            return not_implemented(name)
        except CheckFailed as err:  # raised by a wrapper around the student's function
            raise CheckFailed(f"{where}\n  {err}\nHint: {hint}") from None
        except Exception as err:  # a crash in the student's code: report it as a failed check
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}"
                              f"\nHint: {hint}") from err
        if inputs_unchanged:
            for i in _changed_inputs(case.args(), args):
                arg = arg_names[i] if i < len(arg_names) else f"argument {i}"
                raise CheckFailed(f"{where}\n  your function modified its input '{arg}' in place."
                                  f"\nHint: make a new array ({arg} = {arg} - ...) instead of "
                                  f"changing the caller's ({arg} -= ...).")
        parts = list(output_names or [])
        if parts and isinstance(expected, tuple):
            if not isinstance(got, (tuple, list)) or len(got) != len(expected):
                raise CheckFailed(f"{where}\n  expected a tuple ({', '.join(parts)}), got "
                                  f"{type(got).__name__}\nHint: return {', '.join(parts)}")
            problem = "\n  ".join(filter(None, (compare(e, g, n, rtol, atol) for e, g, n
                                                 in zip(expected, got, parts, strict=True))))
        else:
            problem = compare(expected, got, result_name, rtol, atol)
        if problem:
            specific = diagnose(expected, got) if diagnose else None
            raise CheckFailed(f"{where}\n  {problem}\nHint: {specific or hint}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match the reference")
    return True


# --------------------------------------------------------------------------- lab 01


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


def _diagnose_minibatch(expected: tuple, got: Any) -> str | None:
    """Map the shape of a mismatch to the usual mini-batch SGD mistakes."""
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
        return ("the very first batch loss differs: shuffle once with "
                "perm = rng.permutation(len(X)) before the loop, take the first batch_size "
                "indices of perm, and record problem.loss on that batch BEFORE updating theta.")
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


def pack_function(fn: Callable) -> bytes:
    """A student's function as bytes that engines can load (``cloudpickle.loads``): by value,
    with the globals it uses, unless it comes from course_lib or an installed package.
    (ipyparallel's own pickling drops a notebook function's globals such as ``np``.)"""
    import cloudpickle
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    file = getattr(module, "__file__", None) or ""
    by_value = (module is not None and module.__name__ != "__main__"
                and not module.__name__.startswith("course_lib")
                and not file.startswith((sys.prefix, sys.base_prefix)))
    if by_value:  # a module of the student's own: the engines may not be able to import it
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
