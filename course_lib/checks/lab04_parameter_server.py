"""Lab 04 (parameter server) checks: the server's staleness-aware apply and the worker's step.

Used in labs/04_parameter_server.ipynb, on the framework of :mod:`course_lib.checks`; both run
in the notebook's process against :mod:`course_lib.ps` on seeded cases (the logic is local: the
same functions then run inside the real servers and workers)::

    from course_lib.checks import lab04_parameter_server as checks
    checks.check_apply_push(apply_push)
    checks.check_worker_step(worker_step)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from course_lib.checks.framework import Case, run_check


def _apply_cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for n, version, staleness, aware in [(3, 5, 0, True), (4, 9, 4, False), (4, 9, 4, True),
                                         (6, 1, 1, True), (2, 20, 7, True), (5, 12, 3, False)]:
        case_seed = int(rng.integers(2**31))

        def args(n=n, version=version, staleness=staleness, aware=aware, case_seed=case_seed):
            r = np.random.default_rng(case_seed)
            return (r.normal(size=n), version, r.normal(size=n), version - staleness,
                    float(np.round(r.uniform(0.05, 0.5), 3)), aware)
        cases.append(Case(f"{n} parameters, version {version}, staleness {staleness}, "
                          f"staleness_aware={aware}", args))
    return cases


def _diagnose_apply(expected: tuple, got: Any) -> str | None:
    try:
        theta_g, version_g, staleness_g = got
        theta_g = np.asarray(theta_g, dtype=float)
    except (TypeError, ValueError):
        return "return three things: new_theta, new_version, staleness"
    theta_e, version_e, staleness_e = expected
    if staleness_g == -staleness_e and staleness_e:
        return ("staleness is version - pulled_version (updates applied since the pull), "
                "not the reverse.")
    if staleness_g != staleness_e:
        return "staleness = version - pulled_version, measured BEFORE this update is counted."
    if version_g != version_e:
        return "every applied push makes a new version: return version + 1."
    if not np.all(np.isfinite(theta_g)):
        return ("a fresh gradient (staleness 0) must not divide by zero: use "
                "lr / max(staleness, 1).")
    return ("the step is lr * grad, or lr / max(staleness, 1) * grad when staleness_aware; "
            "subtract it (gradient DEScent) from theta.")


def check_apply_push(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 04, exercise 1: ``apply_push(theta, version, grad, pulled_version, lr,
    staleness_aware) -> (new_theta, version + 1, staleness)`` as ``course_lib.ps.apply_push``,
    without modifying ``theta``, on 6 cases."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.ps import apply_push
    return run_check(
        "check_apply_push", student_fn, apply_push, _apply_cases(seed),
        output_names=("new_theta", "new_version", "staleness"), inputs_unchanged=True,
        arg_names=("theta", "version", "grad", "pulled_version", "lr", "staleness_aware"),
        diagnose=_diagnose_apply, rtol=1e-9, atol=1e-12,
        hint="staleness = version - pulled_version; step = lr / max(staleness, 1) if "
             "staleness_aware else lr; return theta - step * grad, version + 1, staleness.")


def _run_worker_step(step_fn: Callable, problem, theta, version, Xb, yb) -> tuple:
    """Call ``step_fn`` with a recording pull/push; return what it pushed and returned."""
    calls = {"pull": 0, "push": []}

    def pull():
        calls["pull"] += 1
        return theta.copy(), version

    def push(grad_sum, count, pushed_version):
        calls["push"].append((np.array(grad_sum, dtype=float), count, pushed_version))

    loss_sum = step_fn(problem, pull, push, Xb, yb)
    grad_sum, count, pushed_version = calls["push"][0] if calls["push"] else (theta * 0, -1, -1)
    return (float(calls["pull"]), float(len(calls["push"])), grad_sum, float(count),
            float(pushed_version), np.nan if loss_sum is None else float(loss_sum))


def _step_cases(seed: int) -> list[Case]:
    from course_lib import data, models
    rng = np.random.default_rng(seed)
    cases = []
    for n, label in [(8, "linear"), (1, "linear"), (20, "linear"), (12, "softmax")]:
        case_seed = int(rng.integers(2**31))

        def args(n=n, label=label, case_seed=case_seed):
            r = np.random.default_rng(case_seed)
            if label == "softmax":
                X, y = r.normal(size=(n, 4)), r.integers(0, 3, n)
                problem = models.SoftmaxRegression(3)
            else:
                X, y, _ = data.make_linear(n_samples=n, n_features=3, seed=case_seed)
                problem = models.LinearRegression()
            theta = problem.init(X.shape[1], seed=case_seed) + r.normal(size=problem.n_params(
                X.shape[1]))
            return problem, theta, int(r.integers(0, 50)), X, y
        cases.append(Case(f"{label} regression, batch of {n}", args))
    return cases


def _diagnose_step(expected: tuple, got: Any) -> str | None:
    if tuple(got[:2]) != (1.0, 1.0):
        return (f"your step pulled {int(got[0])} time(s) and pushed {int(got[1])} time(s): pull "
                "once, push once.")
    _, _, grad_e, count_e, version_e, loss_e = expected
    _, _, grad_g, count_g, version_g, loss_g = got
    if version_g != version_e:
        return "push the version that pull() returned with the parameters you computed on."
    if count_g != count_e:
        return "push the number of samples in the batch, len(Xb), as count."
    if count_e and np.allclose(grad_g * count_e, grad_e):
        return ("you pushed the MEAN gradient: push the SUM, problem.grad_sum, so the server can "
                "divide the sum over all workers by the global batch size.")
    if not np.allclose(grad_g, grad_e):
        return "compute problem.grad_sum on the theta returned by pull(), on (Xb, yb)."
    return "return problem.loss_sum(theta, Xb, yb) at the pulled theta."


def check_worker_step(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 04, exercise 2: ``worker_step(problem, pull, push, Xb, yb)`` pulls once, pushes
    ``(grad_sum, len(Xb), version)`` once and returns the batch loss sum, as
    ``course_lib.ps.worker_step``, on 4 cases."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.ps import worker_step
    return run_check(
        "check_worker_step", lambda *a: _run_worker_step(student_fn, *a),
        lambda *a: _run_worker_step(worker_step, *a), _step_cases(seed),
        output_names=("pulls", "pushes", "grad_sum", "count", "version", "loss_sum"),
        diagnose=_diagnose_step, rtol=1e-9, atol=1e-12,
        hint="theta, version = pull(); push(problem.grad_sum(theta, Xb, yb), len(Xb), version); "
             "return problem.loss_sum(theta, Xb, yb).")
