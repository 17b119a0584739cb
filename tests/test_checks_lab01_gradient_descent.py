"""Lab 01's checks (course_lib/checks/lab01_gradient_descent.py): each check passes the reference,
fails realistic bugs with a CheckFailed that carries a useful hint, and returns False (no
exception) when unimplemented."""

import numpy as np
import pytest

from course_lib.checks import CheckFailed
from course_lib.checks import lab01_gradient_descent as checks

# ---------------------------------------------------------------- mini-batch epoch variants


def good_epoch(problem, X, y, theta, lr, batch_size, rng):
    """A correct solution written independently of course_lib.gd."""
    perm = rng.permutation(len(X))
    losses = []
    for start in range(0, len(X), batch_size):
        idx = perm[start:start + batch_size]
        losses.append(problem.loss(theta, X[idx], y[idx]))
        theta = theta - lr * problem.grad(theta, X[idx], y[idx])
    return theta, losses


def no_shuffle(problem, X, y, theta, lr, batch_size, rng):
    losses = []
    for start in range(0, len(X), batch_size):
        Xb, yb = X[start:start + batch_size], y[start:start + batch_size]
        losses.append(problem.loss(theta, Xb, yb))
        theta = theta - lr * problem.grad(theta, Xb, yb)
    return theta, losses


def shuffle_each_batch(problem, X, y, theta, lr, batch_size, rng):
    losses = []
    for start in range(0, len(X), batch_size):
        idx = rng.permutation(len(X))[start:start + batch_size]
        losses.append(problem.loss(theta, X[idx], y[idx]))
        theta = theta - lr * problem.grad(theta, X[idx], y[idx])
    return theta, losses


def sum_not_mean(problem, X, y, theta, lr, batch_size, rng):
    perm = rng.permutation(len(X))
    losses = []
    for start in range(0, len(X), batch_size):
        idx = perm[start:start + batch_size]
        losses.append(problem.loss(theta, X[idx], y[idx]))
        theta = theta - lr * problem.grad_sum(theta, X[idx], y[idx])
    return theta, losses


def divide_by_batch_size(problem, X, y, theta, lr, batch_size, rng):
    """Averages the last, smaller batch over batch_size instead of its own length."""
    perm = rng.permutation(len(X))
    losses = []
    for start in range(0, len(X), batch_size):
        idx = perm[start:start + batch_size]
        losses.append(problem.loss(theta, X[idx], y[idx]))
        theta = theta - lr * problem.grad_sum(theta, X[idx], y[idx]) / batch_size
    return theta, losses


def drop_last_batch(problem, X, y, theta, lr, batch_size, rng):
    perm = rng.permutation(len(X))
    losses = []
    for b in range(max(len(X) // batch_size, 1)):
        idx = perm[b * batch_size:(b + 1) * batch_size]
        losses.append(problem.loss(theta, X[idx], y[idx]))
        theta = theta - lr * problem.grad(theta, X[idx], y[idx])
    return theta, losses


def loss_after_update(problem, X, y, theta, lr, batch_size, rng):
    perm = rng.permutation(len(X))
    losses = []
    for start in range(0, len(X), batch_size):
        idx = perm[start:start + batch_size]
        theta = theta - lr * problem.grad(theta, X[idx], y[idx])
        losses.append(problem.loss(theta, X[idx], y[idx]))
    return theta, losses


def in_place_update(problem, X, y, theta, lr, batch_size, rng):
    perm = rng.permutation(len(X))
    losses = []
    for start in range(0, len(X), batch_size):
        idx = perm[start:start + batch_size]
        losses.append(problem.loss(theta, X[idx], y[idx]))
        theta -= lr * problem.grad(theta, X[idx], y[idx])
    return theta, losses


def labels_not_shuffled(problem, X, y, theta, lr, batch_size, rng):
    perm = rng.permutation(len(X))
    X, losses = X[perm], []
    for start in range(0, len(X), batch_size):
        Xb, yb = X[start:start + batch_size], y[start:start + batch_size]  # y in the old order
        losses.append(problem.loss(theta, Xb, yb))
        theta = theta - lr * problem.grad(theta, Xb, yb)
    return theta, losses


def slice_off_by_one(problem, X, y, theta, lr, batch_size, rng):
    perm = rng.permutation(len(X))
    losses = []
    for start in range(0, len(X), batch_size):
        idx = perm[start + 1:start + batch_size + 1]
        losses.append(problem.loss(theta, X[idx], y[idx]))
        theta = theta - lr * problem.grad(theta, X[idx], y[idx])
    return theta, losses


def only_theta(problem, X, y, theta, lr, batch_size, rng):
    return good_epoch(problem, X, y, theta, lr, batch_size, rng)[0]


def crashes(problem, X, y, theta, lr, batch_size, rng):
    return theta @ np.ones(len(theta) + 1), []


def unimplemented(*args):
    raise NotImplementedError


def test_minibatch_passes_reference_and_independent_solution(capsys):
    from course_lib.gd import minibatch_sgd_epoch

    assert checks.check_minibatch_epoch(minibatch_sgd_epoch) is True
    assert checks.check_minibatch_epoch(good_epoch, seed=123) is True
    out = capsys.readouterr().out
    assert "✓ check_minibatch_epoch: 5/5 cases match the reference" in out


def test_minibatch_accepts_numpy_losses():
    def as_array(*args):
        theta, losses = good_epoch(*args)
        return theta, np.array(losses)

    assert checks.check_minibatch_epoch(as_array) is True


@pytest.mark.parametrize("bug, hint", [
    (no_shuffle, "rng.permutation"),
    (shuffle_each_batch, "once per epoch"),
    (sum_not_mean, "MEAN gradient"),
    (divide_by_batch_size, "smaller final batch"),
    (drop_last_batch, "last, smaller batch"),
    (loss_after_update, "BEFORE updating"),
    (labels_not_shuffled, "X was shuffled but y was not"),
    (slice_off_by_one, "the first batch starts at perm[1]: off by one"),
    (in_place_update, "modified its input 'theta' in place"),
    (only_theta, "return theta, batch_losses"),
    (crashes, "your function raised ValueError"),
])
def test_minibatch_catches_bugs(bug, hint):
    with pytest.raises(CheckFailed) as info:
        checks.check_minibatch_epoch(bug)
    message = str(info.value)
    assert hint in message
    assert "check_minibatch_epoch: case" in message and "n=" in message and "Hint:" in message


def test_minibatch_failure_reports_expected_and_got():
    with pytest.raises(CheckFailed, match=r"batch_losses: expected (length|shape) \(?4"):
        checks.check_minibatch_epoch(drop_last_batch)
    with pytest.raises(CheckFailed, match=r"batch_losses\[0\]: expected .*, got "):
        checks.check_minibatch_epoch(no_shuffle)


def test_unimplemented_returns_false_without_raising(capsys):
    assert checks.check_minibatch_epoch(unimplemented) is False
    assert checks.check_step_decay(unimplemented) is False
    out = capsys.readouterr().out
    assert out.count("not implemented yet — fill in the cell above") == 2


# ---------------------------------------------------------------- step decay variants


def good_step_decay(lr, drop, epochs_per_drop):
    return lambda epoch: lr * drop ** (epoch // epochs_per_drop)


def test_step_decay_passes_reference_and_independent_solution(capsys):
    from course_lib.gd import step_decay

    assert checks.check_step_decay(step_decay) is True
    assert checks.check_step_decay(good_step_decay, seed=7) is True
    assert "✓ check_step_decay: 6/6 cases match the reference" in capsys.readouterr().out


def schedule_returns_lazily_unimplemented(lr, drop, epochs_per_drop):
    def schedule(epoch):
        raise NotImplementedError
    return schedule


def test_step_decay_unimplemented_inner_function():
    assert checks.check_step_decay(schedule_returns_lazily_unimplemented) is False


@pytest.mark.parametrize("bug, hint", [
    (lambda lr, d, k: lambda e: lr * d ** (e / k), "integer division"),
    (lambda lr, d, k: lambda e: lr * d ** ((e + 1) // k), "drops too early"),
    (lambda lr, d, k: lambda e: lr, "not at all"),
    (lambda lr, d, k: lambda e: lr * d ** (1 + e // k), "at epoch 0"),
    (lambda lr, d, k: lambda e: lr * d ** (e // (k + 1)), "drops too late"),
    (lambda lr, d, k: lambda e: lr * d ** e, "epoch 1 is the first that differs"),
    (lambda lr, d, k: lr * d, "it should return a function epoch -> lr"),
])
def test_step_decay_catches_bugs(bug, hint):
    with pytest.raises(CheckFailed) as info:
        checks.check_step_decay(bug)
    assert hint in str(info.value)
    assert "check_step_decay: case" in str(info.value)


def test_every_check_docstring_names_its_lab():
    for name in dir(checks):
        if name.startswith("check_"):
            assert "Lab " in getattr(checks, name).__doc__, name
