"""Lab 01's checks (course_lib/checks/lab01_gradient_descent.py): each check passes the reference,
fails realistic bugs with a CheckFailed that carries a useful hint, and returns False (no
exception) when unimplemented."""

import math

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
    (no_shuffle, "in the random order drawn from rng"),
    (shuffle_each_batch, "once per epoch"),
    (sum_not_mean, "SUM of the batch's per-row gradients"),
    (divide_by_batch_size, "divided by batch_size, not by its own number of rows"),
    (drop_last_batch, "last, smaller batch"),
    (loss_after_update, "loss after its update"),
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


def epoch_with(stop=None, step=-1.0, lr_in_step=True, grad_rows="batch", loss_rows="batch",
               y_order="perm", batches="slices", slice_end="moves", generator="rng",
               divide="rows", losses="list", returned="last"):
    """One epoch of mini-batch SGD, with knobs that put the usual mistakes into it."""
    def epoch(problem, X, y, theta, lr, batch_size, rng):
        n, b = len(X), batch_size
        perm = (rng if generator == "rng" else np.random.default_rng(12345)).permutation(n)
        perm_y = rng.permutation(n) if y_order == "own" else perm
        if batches == "array_split":
            parts = np.array_split(np.arange(n), max(n // b, 1))
        else:
            parts = [np.arange(s, min(n, s + b if slice_end == "moves" else b))
                     for s in range(0, n - b if stop == "early" else n, b)]
        start, recorded = theta, []
        for rows in parts:
            if generator == "choice per batch":
                perm = perm_y = rng.choice(n, size=len(rows), replace=False)
                rows = np.arange(len(rows))
            Xb, yb = X[perm[rows]], y[perm_y[rows]]
            on = (X, y) if loss_rows == "all" else (Xb, yb)
            recorded.append(problem.loss(theta, *on) if len(Xb) else float("nan"))
            if not len(Xb):
                continue
            rows_g = (X, y) if grad_rows == "all" else (Xb, yb)
            g = problem.grad_sum(theta, *rows_g) / (n if divide == "n" else len(rows_g[0]))
            theta = theta + step * (lr if lr_in_step else 1.0) * g
        out = {"list": recorded, "last": recorded[-1], "mean": float(np.mean(recorded))}[losses]
        return (start if returned == "start" else theta), out
    return epoch


def slice_assigned(problem, X, y, theta, lr, batch_size, rng):
    perm, recorded = rng.permutation(len(X)), []
    for start in range(0, len(X), batch_size):
        idx = perm[start:start + batch_size]
        recorded.append(problem.loss(theta, X[idx], y[idx]))
        theta[:] = theta - lr * problem.grad(theta, X[idx], y[idx])  # the caller's theta
    return theta, recorded


def shuffles_the_data_in_place(problem, X, y, theta, lr, batch_size, rng):
    perm, recorded = rng.permutation(len(X)), []
    X[:], y[:] = X[perm], y[perm]  # the caller's data, reordered
    for start in range(0, len(X), batch_size):
        Xb, yb = X[start:start + batch_size], y[start:start + batch_size]
        recorded.append(problem.loss(theta, Xb, yb))
        theta = theta - lr * problem.grad(theta, Xb, yb)
    return theta, recorded


@pytest.mark.parametrize("bug, hint", [
    (epoch_with(stop="early"), r"case 1/5 [\s\S]*Hint: your loop stopped one batch early"),
    (epoch_with(lr_in_step=False), r"Hint: your steps leave out the learning rate"),
    (epoch_with(step=+1.0), r"Hint: your steps go UP the gradient"),
    (epoch_with(grad_rows="all"), r"Hint: each step followed the gradient of all the data, not "
                                  r"of its batch"),
    (epoch_with(loss_rows="all"), r"Hint: you recorded the loss of all the data at each step"),
    (epoch_with(y_order="own"), r"Hint: X and y were shuffled with two different permutations"),
    (epoch_with(batches="array_split"), r"case 2/5 [\s\S]*Hint: you cut the rows into len\(X\) "
                                        r"// batch_size parts of near-equal size"),
    (epoch_with(slice_end="fixed"), r"Hint: every batch after the first is empty \(its loss is "
                                    r"nan\): the end of your slice does not move"),
    (epoch_with(generator="np.random"), r"batch_losses\[0\][\s\S]*Hint: your very first batch "
                                        r"loss differs: .*a permutation from np.random"),
    (epoch_with(generator="choice per batch"), r"Hint: your very first batch loss differs"),
    (epoch_with(divide="n"), r"Hint: your steps are divided by the number of rows of ALL the "
                             r"data"),
    (epoch_with(losses="last"), r"batch_losses: expected a sequence of length 4, got float\n"
                                r"Hint: batch_losses is a single number"),
    (epoch_with(losses="mean"), r"Hint: batch_losses is a single number: it must be a list"),
    (epoch_with(returned="start"), r"theta: values differ[\s\S]*Hint: the batch losses are "
                                   r"right, but the theta you returned is the one you started"),
    (slice_assigned, r"your function modified its input 'theta' in place"),
    (shuffles_the_data_in_place, r"your function reordered the rows of its input 'X' in place"
                                 r"[\s\S]*Hint: the caller's X must keep its order"),
], ids=["stops a batch early", "no lr", "uphill", "gradient of all the data",
        "loss of all the data", "y shuffled on its own", "array_split", "slice end fixed",
        "np.random's order", "rng.choice per batch", "divided by n", "last loss only",
        "mean loss", "starting theta returned", "theta[:] =", "X shuffled in place"])
def test_more_minibatch_mistakes(bug, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_minibatch_epoch(bug)
    said = str(failed.value).split("Hint:")[1]
    assert "problem.grad(theta" not in said and "perm[start:start" not in said, said


def test_minibatch_passes_the_right_epoch_written_with_the_knobs():
    assert checks.check_minibatch_epoch(epoch_with()) is True


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
    (lambda lr, d, k: lambda e: lr * d ** e, "drops at every epoch"),
    (lambda lr, d, k: lr * d, "it should return a function epoch -> lr"),
])
def test_step_decay_catches_bugs(bug, hint):
    with pytest.raises(CheckFailed) as info:
        checks.check_step_decay(bug)
    assert hint in str(info.value)
    assert "check_step_decay: case" in str(info.value)


def stateful_step_decay(lr, drop, epochs_per_drop):
    state = {"lr": lr}

    def schedule(epoch):
        if epoch and epoch % epochs_per_drop == 0:
            state["lr"] *= drop  # right when asked once per epoch, in order
        return state["lr"]
    return schedule


@pytest.mark.parametrize("bug, hint", [
    (lambda lr, d, k: lambda e: lr * d * (e // k), r"lr x drop x the number of periods"),
    (lambda lr, d, k: lambda e: lr * (1 - d) ** (e // k), r"multiplies your rate by 1 - drop"),
    (lambda lr, d, k: lambda e: lr - d * (e // k), r"goes down by drop at each drop"),
    (lambda lr, d, k: lambda e: lr * d ** round(e / k), r"drops half-way through each period"),
    (lambda lr, d, k: lambda e: lr * d ** math.ceil(e / k), r"drops already at epoch 1"),
    (lambda lr, d, k: lambda e: lr * d ** (e % k), r"comes back up to lr at the start of every "
                                                   r"period"),
    (lambda lr, d, k: lambda e: lr * d ** ((e - 1) // k), r"at epoch 0 your rate is lr / drop: "
                                                          r"you count epochs from 1"),
    (lambda lr, k, d: lambda e: lr * d ** (e // k), r"reads drop and epochs_per_drop the other "
                                                    r"way round"),
    (lambda lr, d, k: lambda e: lr * d ** (e // k * k), r"falls by drop \*\* epochs_per_drop"),
    (lambda lr, d, k: lambda e: lr * math.exp(-d * (e // k)), r"by exp\(-drop\)"),
    (lambda lr, d, k: lambda e: lr / d ** (e // k), r"your rate grows at each drop"),
    (stateful_step_decay, r"your schedule gave epoch 0 0.0125 \(first 0.1\)[\s\S]*keeps state "
                          r"between calls"),
], ids=["times the count", "1 - drop", "minus drop", "round", "ceil", "remainder",
        "epochs from 1", "arguments swapped", "drop ** epochs_per_drop", "exp", "divided",
        "stateful"])
def test_more_step_decay_mistakes(bug, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_step_decay(bug)
    assert "epoch // epochs_per_drop" not in str(failed.value)


def test_every_check_docstring_names_its_lab():
    for name in dir(checks):
        if name.startswith("check_"):
            assert "Lab " in getattr(checks, name).__doc__, name
