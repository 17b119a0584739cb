"""The gradient descent family: batch GD, SGD and mini-batch SGD, learning-rate schedules,
and two update rules that go beyond the plain step (momentum, Adagrad).

The three methods differ only in how many samples feed each gradient:

    batch_gd       all m samples        one update per epoch, smooth, expensive
    sgd            one sample           m updates per epoch, cheap, noisy
    minibatch_sgd  batch_size samples   the compromise used in practice (and on every GPU)

Each takes a *problem* from `course_lib.models` (loss/grad on numpy arrays) and returns a
`History` whose ``losses`` are the full-data loss after every update (initial loss first), so
curves of different methods can be drawn on one epoch axis.

    from course_lib import data, gd, models
    X, y, _ = data.make_linear()
    hist = gd.minibatch_sgd(models.LinearRegression(), X, y, theta0=[0.0, 0.0], lr=0.1,
                            num_epochs=20, batch_size=32, schedule=gd.step_decay(0.1))
    hist.final_theta, hist.final_loss

It stays one file: the three methods share the History, the schedules and the update rules, and
notebook 01 reads them top to bottom.

Introduced in notebooks/01_gradient_descent.ipynb.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from course_lib.runtime.arguments import check_count, check_lr

# A run counts as diverged once the full loss is non-finite or this many times the start.
DIVERGENCE_FACTOR = 1e10

Schedule = Callable[[int], float]  # epoch (or update) index -> learning rate


@dataclass
class History:
    """What a run recorded. ``losses``/``thetas``: full-data loss and parameters at the start
    and after every update (length = updates + 1); ``lrs``/``epochs``: learning rate and epoch
    index of each update (length = updates); ``batch_losses``: the loss on each mini-batch just
    before its update (SGD / mini-batch only). ``thetas`` stays empty when
    ``record_thetas=False``; ``diverged`` is True when the run stopped early because the loss
    blew up (its last entry is then the non-finite or huge value).

    Introduced in notebooks/01_gradient_descent.ipynb.
    """

    losses: list[float] = field(default_factory=list)
    thetas: list[np.ndarray] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    batch_losses: list[float] = field(default_factory=list)
    diverged: bool = False
    record_thetas: bool = True
    last_theta: np.ndarray | None = field(default=None, repr=False)

    @property
    def final_theta(self) -> np.ndarray | None:
        return self.last_theta

    @property
    def final_loss(self) -> float:
        return self.losses[-1]

    @property
    def epochs_elapsed(self) -> np.ndarray:
        """Fractional epochs at each entry of ``losses`` (0 at the start), for a common x-axis."""
        ep = np.asarray(self.epochs)
        x = np.zeros(len(ep) + 1)
        for e in np.unique(ep):
            where = np.flatnonzero(ep == e)
            # update j of k in epoch e ends at e + j/k; losses[i + 1] follows update i
            x[where + 1] = e + np.arange(1, len(where) + 1) / len(where)
        return x

    def _record(self, theta, loss, lr=None, epoch=None):
        """Append one entry; True when the run has diverged (the caller stops)."""
        self.losses.append(float(loss))
        self.last_theta = theta.copy()
        if self.record_thetas:
            self.thetas.append(self.last_theta)
        if lr is not None:
            self.lrs.append(float(lr))
            self.epochs.append(int(epoch))
        bad = not math.isfinite(loss) or loss > DIVERGENCE_FACTOR * (abs(self.losses[0]) + 1.0)
        self.diverged = bad
        return bad


# ---------------------------------------------------------------- learning-rate schedules
def constant(lr: float) -> Schedule:
    """Schedule ``epoch -> lr``. Introduced in notebooks/01_gradient_descent.ipynb."""
    lr = check_lr(lr)
    return lambda epoch: lr


def step_decay(lr: float, drop: float = 0.5, epochs_per_drop: int = 10) -> Schedule:
    """Schedule ``epoch -> lr * drop ** (epoch // epochs_per_drop)``: a staircase.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    lr = check_lr(lr)
    if not 0 < drop <= 1 or epochs_per_drop < 1:
        raise ValueError(f"need 0 < drop <= 1 and epochs_per_drop >= 1, got {drop}, "
                         f"{epochs_per_drop}")
    return lambda epoch: lr * drop ** (epoch // epochs_per_drop)


def exponential_decay(lr: float, k: float) -> Schedule:
    """Schedule ``epoch -> lr * exp(-k * epoch)``. Introduced in
    notebooks/01_gradient_descent.ipynb."""
    lr = check_lr(lr)
    if k < 0:
        raise ValueError(f"decay rate k must be >= 0, got {k}")
    return lambda epoch: lr * math.exp(-k * epoch)


def inverse_time_decay(lr: float, k: float) -> Schedule:
    """Schedule ``epoch -> lr / (1 + k * epoch)``, the classic 1/t annealing.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    lr = check_lr(lr)
    if k < 0:
        raise ValueError(f"decay rate k must be >= 0, got {k}")
    return lambda epoch: lr / (1.0 + k * epoch)


def updates_per_epoch(n_samples: int, batch_size: int, drop_last: bool = False) -> int:
    """Mini-batch updates in one pass over ``n_samples``: ``ceil(n_samples / batch_size)`` (the
    last batch may be smaller), or with ``drop_last`` only the full batches,
    ``max(n_samples // batch_size, 1)`` (one batch of everything when batch_size > n_samples).

    Introduced in notebooks/07_large_minibatch.ipynb.
    """
    check_count("batch_size", batch_size)
    if drop_last:
        return max(int(n_samples) // int(batch_size), 1)
    return -(-int(n_samples) // int(batch_size))  # ceiling division in integers: -floor(-a/b)


class SGD:
    """The plain step ``theta - lr * grad`` (no state). Introduced in
    notebooks/01_gradient_descent.ipynb."""

    def reset(self) -> None:
        pass

    def step(self, theta: np.ndarray, grad: np.ndarray, lr: float) -> np.ndarray:
        return theta - lr * grad


class Momentum:
    """Heavy-ball momentum with the rate inside (Ruder's form; Goyal et al. 2017, eq. 10):
    ``v <- beta * (lr / lr_prev) * v + lr * grad``; ``theta <- theta - v``.

    ``v`` starts at zero, so the first step equals plain SGD. torch.optim.SGD keeps the rate
    outside instead (their eq. 9): ``u <- beta * u + grad``; ``theta <- theta - lr * u``. The two
    agree while ``v = lr * u``. When the rate changes (a warmup, a decay), ``v`` still holds the
    old rate, so the *momentum correction* ``lr / lr_prev`` rescales it first: then both take
    the same steps under any schedule. At a constant rate the factor is exactly 1.
    ``correction=False`` leaves it out (notebook 07 shows what that does during a warmup).

    Introduced in notebooks/01_gradient_descent.ipynb.
    """

    def __init__(self, beta: float = 0.9, correction: bool = True) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.beta, self.correction = beta, bool(correction)
        self.reset()

    def reset(self) -> None:
        self.v, self.lr = None, None

    def step(self, theta: np.ndarray, grad: np.ndarray, lr: float) -> np.ndarray:
        if self.v is None:
            self.v = lr * grad
        else:  # v was built with the previous rate: rescale it to this one
            factor = lr / self.lr if self.correction else 1.0
            self.v = self.beta * factor * self.v + lr * grad
        self.lr = lr
        return theta - self.v


class Adagrad:
    """One learning rate per parameter: ``G <- G + grad**2``;
    ``theta <- theta - lr * grad / (sqrt(G) + eps)`` (elementwise, as torch.optim.Adagrad).

    Parameters with rarely non-zero (sparse) gradients keep a small G and so take large steps.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps
        self.reset()

    def reset(self) -> None:
        self.G = None

    def step(self, theta: np.ndarray, grad: np.ndarray, lr: float) -> np.ndarray:
        self.G = grad**2 if self.G is None else self.G + grad**2
        return theta - lr * grad / (np.sqrt(self.G) + self.eps)


# what the methods accept as ``optimizer`` (None: the plain step, without an object)
Optimizer = SGD | Momentum | Adagrad


# ---------------------------------------------------------------- the three methods

def _setup(problem, X, y, theta0, lr, num_epochs, optimizer, record_thetas):
    """Validate arguments, reset the optimizer, record the initial loss."""
    check_lr(lr)
    check_count("num_epochs", num_epochs, least=0)
    if X is not None and len(X) != len(y):
        raise ValueError(f"X and y disagree on the number of samples: {len(X)} vs {len(y)}")
    theta = np.array(theta0, dtype=np.float64)  # a copy: the caller's theta0 is never changed
    hist = History(record_thetas=record_thetas)
    hist._record(theta, problem.loss(theta, X, y))  # also checks theta against X
    if optimizer is not None:
        optimizer.reset()
    return theta, hist


def _lr_for(epoch, lr, schedule):
    return check_lr(schedule(epoch)) if schedule is not None else lr


def _step(theta, g, lr, optimizer):
    return theta - lr * g if optimizer is None else optimizer.step(theta, g, lr)


def batch_gd(problem: Any, X: np.ndarray | None, y: np.ndarray | None, theta0: ArrayLike,
             lr: float, num_epochs: int, schedule: Schedule | None = None,
             optimizer: Optimizer | None = None, *, record_thetas: bool = True) -> History:
    """Batch gradient descent: each epoch is ONE update with the gradient over all of X.

    ``theta <- theta - lr_e * problem.grad(theta, X, y)`` with ``lr_e = schedule(e)`` when a
    schedule is given, else ``lr``; ``optimizer`` (e.g. ``Momentum()``) replaces the plain step.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    theta, hist = _setup(problem, X, y, theta0, lr, num_epochs, optimizer, record_thetas)
    with np.errstate(over="ignore", invalid="ignore"):
        for epoch in range(num_epochs):
            lr_e = _lr_for(epoch, lr, schedule)
            theta = _step(theta, problem.grad(theta, X, y), lr_e, optimizer)
            if hist._record(theta, problem.loss(theta, X, y), lr_e, epoch):
                break
    return hist


def sgd(problem: Any, X: np.ndarray, y: np.ndarray, theta0: ArrayLike, lr: float,
        num_epochs: int, seed: int = 0, schedule: Schedule | None = None,
        optimizer: Optimizer | None = None, *, record_thetas: bool = True) -> History:
    """Stochastic gradient descent: one sample per update, in a fresh random order each epoch.

    ``rng = np.random.default_rng(seed)``; every epoch visits ``rng.permutation(len(X))`` and
    for each index i steps with ``problem.grad(theta, X[i:i+1], y[i:i+1])``. This is the same
    rng contract as ``minibatch_sgd``, so ``sgd`` == ``minibatch_sgd(batch_size=1)``.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    theta, hist = _setup(problem, X, y, theta0, lr, num_epochs, optimizer, record_thetas)
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore", invalid="ignore"):
        for epoch in range(num_epochs):
            lr_e = _lr_for(epoch, lr, schedule)
            for i in rng.permutation(len(X)):
                xi, yi = X[i:i + 1], y[i:i + 1]  # a slice, not X[i]: still a 2-D batch of one
                hist.batch_losses.append(problem.loss(theta, xi, yi))
                theta = _step(theta, problem.grad(theta, xi, yi), lr_e, optimizer)
                if hist._record(theta, problem.loss(theta, X, y), lr_e, epoch):
                    return hist
    return hist


def minibatch_sgd_epoch(problem: Any, X: np.ndarray, y: np.ndarray, theta: ArrayLike, lr: float,
                        batch_size: int, rng: np.random.Generator,
                        optimizer: Optimizer | None = None, *,
                        callback: Callable[[np.ndarray], bool] | None = None,
                        lr_at: Schedule | None = None) -> tuple[np.ndarray, list[float]]:
    """One epoch of mini-batch SGD. Returns ``(theta, batch_losses)``.

    The exact contract (lab 01 checks a student's version against this one):

    1. ``order = rng.permutation(len(X))`` -- exactly one call on ``rng`` per epoch;
    2. for ``start = 0, batch_size, 2 * batch_size, ...``: ``idx = order[start:start +
       batch_size]`` (the last batch may be smaller), append
       ``problem.loss(theta, X[idx], y[idx])`` to ``batch_losses``, then update
       ``theta <- theta - lr * problem.grad(theta, X[idx], y[idx])``
       (or ``optimizer.step(theta, grad, lr)`` when an optimizer is given).

    The input ``theta`` is not modified. ``callback(theta)``, if given, is called after every
    update; when it returns True the epoch stops early. ``lr_at(i)``, if given, replaces ``lr``
    for the i-th update of the epoch (a per-update schedule, notebook 07).

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    lr = check_lr(lr)
    check_count("batch_size", batch_size)
    if len(X) != len(y):
        raise ValueError(f"X and y disagree on the number of samples: {len(X)} vs {len(y)}")
    theta = np.array(theta, dtype=np.float64)
    batch_losses = []
    order = rng.permutation(len(X))
    for i, start in enumerate(range(0, len(X), batch_size)):
        idx = order[start:start + batch_size]
        batch_losses.append(problem.loss(theta, X[idx], y[idx]))
        lr_i = lr if lr_at is None else check_lr(lr_at(i))
        theta = _step(theta, problem.grad(theta, X[idx], y[idx]), lr_i, optimizer)
        if callback is not None and callback(theta):
            break
    return theta, batch_losses


def minibatch_sgd(problem: Any, X: np.ndarray, y: np.ndarray, theta0: ArrayLike, lr: float,
                  num_epochs: int, batch_size: int = 32, seed: int = 0,
                  schedule: Schedule | None = None, optimizer: Optimizer | None = None, *,
                  record_thetas: bool = True, update_schedule: Schedule | None = None) -> History:
    """Mini-batch SGD: ``num_epochs`` calls of ``minibatch_sgd_epoch`` with one shared
    ``rng = np.random.default_rng(seed)`` and ``lr_e = schedule(e)`` (or ``lr``) in epoch e.

    ``batch_size=1`` is SGD; ``batch_size >= len(X)`` is batch GD (the gradient then sums the
    same rows, only in shuffled order). ``update_schedule(u)``, if given, is the rate of update
    u (counted from 0 over the whole run) instead, e.g. ``linear_scaling_warmup`` (notebook 07).

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    check_count("batch_size", batch_size)
    if schedule is not None and update_schedule is not None:
        raise ValueError("give schedule (per epoch) or update_schedule (per update), not both")
    theta, hist = _setup(problem, X, y, theta0, lr, num_epochs, optimizer, record_thetas)
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore", invalid="ignore"):
        for epoch in range(num_epochs):
            lr_e = _lr_for(epoch, lr, schedule)
            # updates made before this epoch: update i of the epoch is update first + i of the
            # run. (Defaults bind this epoch's values: a closure would see the loop's last.)
            first, lr_at = len(hist.lrs), None
            if update_schedule is not None:
                def lr_at(i, first=first):
                    return update_schedule(first + i)

            def record(th, lr_e=lr_e, epoch=epoch, lr_at=lr_at, first=first):
                # called after each update, so len(hist.lrs) - first is the index just used
                lr_u = lr_e if lr_at is None else lr_at(len(hist.lrs) - first)
                return hist._record(th, problem.loss(th, X, y), lr_u, epoch)

            theta, batch_losses = minibatch_sgd_epoch(problem, X, y, theta, lr_e, batch_size,
                                                      rng, optimizer, callback=record,
                                                      lr_at=lr_at)
            hist.batch_losses.extend(batch_losses)
            if hist.diverged:
                break
    return hist
