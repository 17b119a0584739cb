"""Loss functions with hand-written gradients ("problems"), and a small torch model.

A *problem* is any object with these methods (numpy float64, theta a 1-D vector):

    loss(theta, X, y)      mean loss over the rows of X           J(theta)
    grad(theta, X, y)      its gradient                           dJ/dtheta, same shape as theta
    loss_sum(theta, X, y)  the loss summed (not averaged) over rows
    grad_sum(theta, X, y)  the gradient summed over rows, so that for any split of the data
                           into shards S_1..S_k:  grad(theta, X, y) = sum_r grad_sum(S_r) / m
    init(n_features, seed) a starting theta for data with n_features columns

That last identity is what makes data parallelism work: each rank sums the gradient over its
own shard, one allreduce adds the k partial sums, and dividing by m gives the full gradient
(notebook 02). `course_lib.gd` trains any problem; `mlp` is the torch model of later notebooks.

    from course_lib import models
    problem = models.LinearRegression()
    g = problem.grad(theta, X, y)

Introduced in notebooks/01_gradient_descent.ipynb.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from torch import nn


def _check(theta, X, y, n_params):
    """Validate shapes; return float64 arrays. ``n_params`` is the theta length X implies."""
    theta, X, y = np.asarray(theta, dtype=np.float64), np.asarray(X), np.asarray(y)
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D (samples, features), got shape {X.shape}")
    if theta.shape != (n_params,):
        raise ValueError(
            f"theta has shape {theta.shape} but X has shape {X.shape}: "
            f"expected theta of shape ({n_params},)"
        )
    if y.shape != (X.shape[0],):
        raise ValueError(f"y has shape {y.shape} but X has shape {X.shape}: expected "
                         f"({X.shape[0]},)")
    return theta, X.astype(np.float64, copy=False), y


def _mean(total, m):
    if m == 0:
        raise ValueError("the mean loss/gradient of an empty batch is undefined (0 samples); "
                         "use loss_sum/grad_sum for possibly empty shards")
    return total / m


class LinearRegression:
    """Least squares: ``J(theta) = 1/(2m) * sum_i (x_i @ theta - y_i)^2``.

    The model is ``h(x) = x @ theta``; put a column of ones in X for an intercept
    (``data.make_linear`` does). Gradient: ``X.T @ (X @ theta - y) / m``.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """

    def n_params(self, n_features: int) -> int:
        return n_features

    def init(self, n_features: int, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).normal(scale=0.01, size=n_features)

    def loss_sum(self, theta: ArrayLike, X: np.ndarray, y: ArrayLike) -> float:
        # -1 when X is not 2-D: _check then rejects X before comparing theta with it
        theta, X, y = _check(theta, X, y, X.shape[1] if np.ndim(X) == 2 else -1)
        r = X @ theta - y
        return 0.5 * float(r @ r)

    def grad_sum(self, theta: ArrayLike, X: np.ndarray, y: ArrayLike) -> np.ndarray:
        theta, X, y = _check(theta, X, y, X.shape[1] if np.ndim(X) == 2 else -1)
        return X.T @ (X @ theta - y)

    def loss(self, theta: ArrayLike, X: np.ndarray, y: ArrayLike) -> float:
        return _mean(self.loss_sum(theta, X, y), len(X))

    def grad(self, theta: ArrayLike, X: np.ndarray, y: ArrayLike) -> np.ndarray:
        return _mean(self.grad_sum(theta, X, y), len(X))

    def predict(self, theta: ArrayLike, X: ArrayLike) -> np.ndarray:
        return np.asarray(X, dtype=np.float64) @ theta


class SoftmaxRegression:
    """Multinomial logistic regression with mean cross-entropy loss.

    ``theta`` is a flat vector of length ``(n_features + 1) * n_classes``: the first
    ``n_features * n_classes`` entries are the weight matrix W (n_features, n_classes) in
    row-major order, the last ``n_classes`` the bias b. Logits ``X @ W + b``; ``y`` holds
    integer class labels. Gradient of the mean loss: ``W: X.T @ (P - Y) / m``,
    ``b: mean(P - Y)``, with P the softmax probabilities and Y the one-hot labels.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """

    def __init__(self, n_classes: int) -> None:
        if n_classes < 2:
            raise ValueError(f"n_classes must be >= 2, got {n_classes}")
        self.n_classes = n_classes

    def n_params(self, n_features: int) -> int:
        return (n_features + 1) * self.n_classes

    def init(self, n_features: int, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).normal(scale=0.01, size=self.n_params(n_features))

    def unpack(self, theta: np.ndarray, n_features: int) -> tuple[np.ndarray, np.ndarray]:
        """Split a flat theta into ``(W, b)`` (views)."""
        k = self.n_classes
        return theta[: n_features * k].reshape(n_features, k), theta[n_features * k:]

    def _forward(self, theta, X, y):
        d = X.shape[1] if np.ndim(X) == 2 else -1
        theta, X, y = _check(theta, X, y, self.n_params(d) if d >= 0 else -1)
        if y.size and (y.min() < 0 or y.max() >= self.n_classes):
            raise ValueError(f"labels must lie in [0, {self.n_classes - 1}]")
        W, b = self.unpack(theta, d)
        z = X @ W + b
        z = z - z.max(axis=1, keepdims=True)  # softmax is shift-invariant: exp() cannot overflow
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))  # log-softmax
        return X, y.astype(np.int64), log_p

    def loss_sum(self, theta: ArrayLike, X: np.ndarray, y: ArrayLike) -> float:
        _, y, log_p = self._forward(theta, X, y)
        return -float(log_p[np.arange(len(y)), y].sum())  # row i's log-probability of its label

    def grad_sum(self, theta: ArrayLike, X: np.ndarray, y: ArrayLike) -> np.ndarray:
        X, y, log_p = self._forward(theta, X, y)
        delta = np.exp(log_p)
        delta[np.arange(len(y)), y] -= 1.0  # P - Y
        # W's gradient flattened row-major, then b's: the layout unpack() reads
        return np.concatenate([(X.T @ delta).ravel(), delta.sum(axis=0)])

    def loss(self, theta: ArrayLike, X: np.ndarray, y: ArrayLike) -> float:
        return _mean(self.loss_sum(theta, X, y), len(X))

    def grad(self, theta: ArrayLike, X: np.ndarray, y: ArrayLike) -> np.ndarray:
        return _mean(self.grad_sum(theta, X, y), len(X))

    def predict(self, theta: ArrayLike, X: ArrayLike) -> np.ndarray:
        """Most probable class for each row of X."""
        X = np.asarray(X, dtype=np.float64)
        W, b = self.unpack(np.asarray(theta, dtype=np.float64), X.shape[1])
        return np.argmax(X @ W + b, axis=1)

    def accuracy(self, theta: ArrayLike, X: ArrayLike, y: ArrayLike) -> float:
        """Fraction of rows whose predicted class equals the label."""
        return float(np.mean(self.predict(theta, X) == np.asarray(y)))


class Quadratic:
    """``loss = |theta - 1|^2 / 2`` per sample, whatever the data: a gradient as cheap as
    reading theta once, so that a run times the communication, not the computation.

    Introduced in notebooks/12_scaling_out.ipynb (the parameter server against the ring)."""

    def loss_sum(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray | None) -> float:
        return len(X) * 0.5 * float(np.dot(theta - 1.0, theta - 1.0))

    def grad_sum(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray | None) -> np.ndarray:
        return len(X) * (theta - 1.0)

    def loss(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray | None) -> float:
        return self.loss_sum(theta, X, y) / max(len(X), 1)


class DoubleWell:
    """A non-convex toy: ``f(w) = (w^2 - 1)^2 + tilt * w``, summed over the entries of theta.

    With the default tilt it has a global minimum near w = -1.04 and a worse local minimum near
    w = +0.96, separated by a hump near w = 0.08: gradient descent ends in whichever valley it
    starts in. The data are ignored (pass ``X=None, y=None``); to keep the problem protocol,
    ``loss_sum``/``grad_sum`` count each row of X as one copy of f (one copy when X is None).

    Introduced in notebooks/01_gradient_descent.ipynb.
    """

    def __init__(self, tilt: float = 0.3) -> None:
        self.tilt = tilt

    def init(self, n_features: int = 1, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).uniform(-1.5, 1.5, size=n_features)

    def loss(self, theta: ArrayLike, X: np.ndarray | None = None,
             y: ArrayLike | None = None) -> float:
        w = np.asarray(theta, dtype=np.float64)
        return float(np.sum((w**2 - 1.0) ** 2 + self.tilt * w))

    def grad(self, theta: ArrayLike, X: np.ndarray | None = None,
             y: ArrayLike | None = None) -> np.ndarray:
        w = np.asarray(theta, dtype=np.float64)
        return 4.0 * w * (w**2 - 1.0) + self.tilt  # f'(w), entry by entry

    def loss_sum(self, theta: ArrayLike, X: np.ndarray | None = None,
                 y: ArrayLike | None = None) -> float:
        return (1 if X is None else len(X)) * self.loss(theta)

    def grad_sum(self, theta: ArrayLike, X: np.ndarray | None = None,
                 y: ArrayLike | None = None) -> np.ndarray:
        return (1 if X is None else len(X)) * self.grad(theta)

    def minima(self) -> np.ndarray:
        """The two local minima, sorted (roots of f'(w) = 0 where f'' > 0)."""
        # f'(w) = 4w^3 - 4w + tilt: three real roots, the middle one the hump (a maximum)
        roots = np.roots([4.0, 0.0, -4.0, self.tilt])
        roots = np.sort(roots[np.abs(roots.imag) < 1e-12].real)
        return roots[[0, -1]]


def mlp(in_features: int, hidden: int | Sequence[int], out_features: int,
        seed: int = 0) -> nn.Sequential:
    """A small multilayer perceptron ``Linear -> ReLU -> ... -> Linear`` (torch, float32).

    ``hidden`` is an int or a sequence of ints (one per hidden layer). The weights depend only
    on ``seed`` and the global torch RNG is left untouched, so every rank building
    ``mlp(..., seed=0)`` starts from identical parameters.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """
    import torch  # torch takes seconds to import: the numpy problems above, and the
    from torch import nn  # spawned Hogwild workers that import this module, never need it

    sizes = [in_features, *([hidden] if isinstance(hidden, int) else list(hidden)), out_features]
    layers = []
    with torch.random.fork_rng(devices=[]):  # seed a copy of the global RNG, restored after
        torch.manual_seed(seed)
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
    return nn.Sequential(*layers)
