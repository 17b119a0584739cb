"""Lab 04 checks pass the reference and fail realistic wrong solutions with a useful hint."""

import numpy as np
import pytest

from course_lib import ps
from course_lib.checks import CheckFailed
from course_lib.checks import lab04_parameter_server as checks_ps


def test_reference_passes():
    assert checks_ps.check_apply_push(ps.apply_push) is True
    assert checks_ps.check_worker_step(ps.worker_step) is True


def test_not_implemented_returns_false():
    def todo(*args):
        raise NotImplementedError
    assert checks_ps.check_apply_push(todo) is False
    assert checks_ps.check_worker_step(todo) is False


def _apply(divide_by=lambda s: max(s, 1), sign=1, bump=1, inplace=False):
    def apply_push(theta, version, grad, pulled_version, lr, staleness_aware=False):
        staleness = sign * (version - pulled_version)
        step = lr / divide_by(staleness) if staleness_aware else lr
        if inplace:
            theta -= step * grad
            return theta, version + bump, staleness
        return theta - step * grad, version + bump, staleness
    return apply_push


@pytest.mark.parametrize("wrong,hint", [
    (_apply(divide_by=lambda s: s), "ZeroDivisionError"),
    (_apply(sign=-1), "not the reverse"),
    (_apply(bump=0), "version + 1"),
    (_apply(divide_by=lambda s: 1), "lr / max(staleness, 1)"),
    (_apply(inplace=True), "in place"),
])
def test_apply_push_catches_mistakes(wrong, hint):
    with np.errstate(divide="ignore", invalid="ignore"), \
            pytest.raises(CheckFailed, match=r"(?s)" + hint.replace("(", r"\(").replace(")", r"\)")
                          .replace("+", r"\+")):
        checks_ps.check_apply_push(wrong)


def _mean_grad(problem, pull, push, Xb, yb):
    theta, version = pull()
    push(problem.grad(theta, Xb, yb), len(Xb), version)
    return problem.loss_sum(theta, Xb, yb)


def _pull_twice(problem, pull, push, Xb, yb):
    theta, version = pull()
    push(problem.grad_sum(theta, Xb, yb), len(Xb), version)
    return problem.loss_sum(pull()[0], Xb, yb)


def _version_zero(problem, pull, push, Xb, yb):
    theta, _ = pull()
    push(problem.grad_sum(theta, Xb, yb), len(Xb), 0)
    return problem.loss_sum(theta, Xb, yb)


def _no_return(problem, pull, push, Xb, yb):
    theta, version = pull()
    push(problem.grad_sum(theta, Xb, yb), len(Xb), version)


@pytest.mark.parametrize("wrong,hint", [
    (_mean_grad, "MEAN gradient"), (_pull_twice, "pull once"),
    (_version_zero, "version that pull"), (_no_return, "loss_sum"),
])
def test_worker_step_catches_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks_ps.check_worker_step(wrong)
