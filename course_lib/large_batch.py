"""Large global mini-batches: fewer updates, the linear scaling rule, and gradual warmup.

Introduced in notebooks/07_large_minibatch.ipynb. With N workers of b samples each, one
synchronous step uses a global batch of B = N b samples, so an epoch has N times fewer updates.
Goyal et al. (2017) keep the accuracy of small batches by scaling the learning rate with B
(``lr = base_lr * B / base_B``) and by ramping it up from ``base_lr`` over the first epochs
(``scaling_rule.linear_scaling_warmup``). This module measures that on real data, the 8x8 digits::

    from course_lib import large_batch
    from course_lib.figures import large_minibatch as figures
    rows = large_batch.accuracy_vs_batch(batch_sizes=(32, 256, 1024))   # fixed / scaled / warmup
    print(large_batch.format_table(rows)); figures.plot_accuracy_vs_batch(rows)

The model is :class:`MLPClassifier`, a small numpy ReLU network (two hidden layers; weights
``init_scale`` times He's scale): unlike a linear model, its early training is unstable at a
large learning rate, which is what warmup is for. Every run trains with ``gd``'s own mini-batch
epoch and reports test accuracy after a fixed number of epochs, for several seeds. It stays one
file: the model, one run and the experiment over batch sizes are one measurement, read in order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from course_lib import data, gd, scaling_rule

VARIANTS = ("fixed", "scaled", "warmup")
SETUP = dict(base_batch_size=32, base_lr=0.1, num_epochs=10, warmup_epochs=3,
             hidden=(64, 64), init_scale=1.4)


class MLPClassifier:
    """A ReLU network ``Linear -> ReLU -> ... -> Linear`` with mean cross-entropy, in numpy,
    following the problem protocol of :mod:`course_lib.models` on a flat float64 ``theta``
    (per layer: weight matrix (fan_in, fan_out) row-major, then bias). ``init`` draws weights
    from N(0, init_scale^2 * 2 / fan_in) (He; the last layer 1 / fan_in) and zero biases.

    Introduced in notebooks/07_large_minibatch.ipynb.
    """

    def __init__(self, n_classes: int = 10, hidden: int | Sequence[int] = (64, 64),
                 init_scale: float = 1.0) -> None:
        self.n_classes, self.init_scale = n_classes, float(init_scale)
        self.hidden = (hidden,) if isinstance(hidden, int) else tuple(hidden)

    def _shapes(self, n_features):
        dims = [n_features, *self.hidden, self.n_classes]
        return [(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)]

    def n_params(self, n_features: int) -> int:
        return sum(a * b + b for a, b in self._shapes(n_features))

    def init(self, n_features: int, seed: int = 0) -> np.ndarray:
        rng, parts = np.random.default_rng(seed), []
        shapes = self._shapes(n_features)
        for i, (a, b) in enumerate(shapes):
            gain = 2.0 if i < len(shapes) - 1 else 1.0
            parts += [self.init_scale * rng.normal(scale=np.sqrt(gain / a), size=a * b),
                      np.zeros(b)]
        return np.concatenate(parts)

    def _layers(self, theta, X):
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2:
            raise ValueError(f"X must be 2-D (samples, features), got shape {X.shape}")
        theta = np.asarray(theta, dtype=np.float64)
        if theta.shape != (self.n_params(X.shape[1]),):
            raise ValueError(f"theta has shape {theta.shape} but X has shape {X.shape}: expected "
                             f"({self.n_params(X.shape[1])},) for hidden={self.hidden}")
        layers, i = [], 0
        for a, b in self._shapes(X.shape[1]):  # views of theta: W (a x b), then its bias (b)
            layers.append((theta[i:i + a * b].reshape(a, b), theta[i + a * b:i + a * b + b]))
            i += a * b + b
        return X, layers

    def _forward(self, theta, X, y=None):
        X, layers = self._layers(theta, X)
        if y is not None and np.shape(y) != (len(X),):
            raise ValueError(f"y has shape {np.shape(y)}, expected ({len(X)},)")
        acts = [X]
        for k, (W, b) in enumerate(layers):
            z = acts[-1] @ W + b
            acts.append(np.maximum(z, 0.0) if k < len(layers) - 1 else z)
        z = acts[-1] - acts[-1].max(axis=1, keepdims=True)  # shifted: exp() cannot overflow
        return layers, acts, z - np.log(np.exp(z).sum(axis=1, keepdims=True))  # log-softmax

    def loss_sum(self, theta: ArrayLike, X: ArrayLike, y: ArrayLike) -> float:
        log_p = self._forward(theta, X, y)[2]
        return -float(log_p[np.arange(len(log_p)), np.asarray(y, dtype=np.int64)].sum())

    def grad_sum(self, theta: ArrayLike, X: ArrayLike, y: ArrayLike) -> np.ndarray:
        layers, acts, log_p = self._forward(theta, X, y)
        y = np.asarray(y, dtype=np.int64)
        delta = np.exp(log_p)
        delta[np.arange(len(y)), y] -= 1.0  # dloss/dlogits, summed over rows below
        grads = []
        for k in range(len(layers) - 1, -1, -1):  # backpropagation, last layer first
            # layer k: dW = input^T delta, db = sum of delta; prepended, to keep theta's order
            grads = [(acts[k].T @ delta).ravel(), delta.sum(axis=0)] + grads
            if k:  # through W_k to the layer's input, then through the ReLU that made it
                delta = (delta @ layers[k][0].T) * (acts[k] > 0)
        return np.concatenate(grads)

    def loss(self, theta: ArrayLike, X: ArrayLike, y: ArrayLike) -> float:
        return self.loss_sum(theta, X, y) / max(len(X), 1)

    def grad(self, theta: ArrayLike, X: ArrayLike, y: ArrayLike) -> np.ndarray:
        return self.grad_sum(theta, X, y) / max(len(X), 1)

    def predict(self, theta: ArrayLike, X: ArrayLike) -> np.ndarray:
        return np.argmax(self._forward(theta, X)[2], axis=1)

    def accuracy(self, theta: ArrayLike, X: ArrayLike, y: ArrayLike) -> float:
        return float(np.mean(self.predict(theta, X) == np.asarray(y)))

    def dead_fraction(self, theta: ArrayLike, X: ArrayLike) -> list[float]:
        """Per hidden layer, the fraction of ReLUs that output 0 on every row of X ("dead":
        no gradient flows through them, so they never come back)."""
        activations = self._forward(theta, X)[1][1:-1]  # the hidden layers' (not X, not logits)
        return [float(np.mean(np.all(a <= 0, axis=0))) for a in activations]


@functools.lru_cache(maxsize=1)
def _digits():
    return data.load_digits()


def _one_blas_thread():
    """Small matrices run fastest on one BLAS thread (several fight over 2 cores)."""
    try:
        from threadpoolctl import threadpool_limits  # optional: not declared by the course
    except ImportError:  # comes with scikit-learn; without it, run as configured
        return contextlib.nullcontext()
    return threadpool_limits(1)


# ---------------------------------------------------------------- one run
def schedule_for(variant: str, batch_size: int, base_lr: float, base_batch_size: int,
                 warmup_epochs: float, n_samples: int) -> Callable[[int], float]:
    """The per-update learning rate of a variant: 'fixed' (``base_lr`` at every batch size),
    'scaled' (linear scaling rule alone) or 'warmup' (linear scaling + gradual warmup).
    Introduced in notebooks/07_large_minibatch.ipynb."""
    per_epoch = gd.updates_per_epoch(n_samples, batch_size, drop_last=True)
    # "fixed" is the rule with the batch as its own reference: target = base_lr, no warmup
    reference_batch_and_warmup = {"fixed": (batch_size, 0), "scaled": (base_batch_size, 0),
                                  "warmup": (base_batch_size, warmup_epochs)}
    if variant not in reference_batch_and_warmup:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    return scaling_rule.linear_scaling_warmup(base_lr, batch_size,
                                              *reference_batch_and_warmup[variant], per_epoch)


def train_and_test(batch_size: int, update_schedule: Callable[[int], float], num_epochs: int = 10,
                   seed: int = 0, hidden: int | Sequence[int] = (64, 64),
                   init_scale: float = 1.4, target: float | None = None) -> dict:
    """Train :class:`MLPClassifier` on the digits' training split with ``gd.minibatch_sgd_epoch``
    (rng seeded by ``seed``, lr of update u = ``update_schedule(u)``; each epoch stops after
    its last FULL batch, as ``drop_last=True`` in a data loader, so that a tiny remainder does
    not make the final step at a large learning rate); return a dict with the
    test ``accuracy`` (0.0 if the run ``diverged``: non-finite parameters), the ``updates``
    made and, when a ``target`` accuracy is given, ``updates_to_target`` (the first update
    after which test accuracy reached it, checked after every update; the run then stops).
    Introduced in notebooks/07_large_minibatch.ipynb."""
    X, y, X_test, y_test = _digits()
    problem = MLPClassifier(10, hidden, init_scale)
    theta, rng = problem.init(X.shape[1], seed), np.random.default_rng(seed)
    state = {"updates": 0, "reached": None}
    full_batches = gd.updates_per_epoch(len(X), batch_size, drop_last=True)

    def after_update(th):
        state["updates"] += 1
        if not np.all(np.isfinite(th)):
            return True
        if target is not None and problem.accuracy(th, X_test, y_test) >= target:
            state["reached"] = state["updates"]
            return True
        return state["updates"] % full_batches == 0  # the last full batch: drop the rest

    with _one_blas_thread(), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for _ in range(num_epochs):
            first = state["updates"]
            # lr 1.0 is a placeholder: lr_at gives every update its rate, counted over the run
            theta, _ = gd.minibatch_sgd_epoch(
                problem, X, y, theta, 1.0, batch_size, rng, callback=after_update,
                lr_at=lambda i, first=first: update_schedule(first + i))
            if state["reached"] is not None or not np.all(np.isfinite(theta)):
                break
        diverged = not np.all(np.isfinite(theta))
        accuracy = 0.0 if diverged else problem.accuracy(theta, X_test, y_test)
    return dict(accuracy=accuracy, diverged=diverged, updates=state["updates"],
                updates_to_target=state["reached"], theta=theta)


# ---------------------------------------------------------------- the experiment
def accuracy_vs_batch(batch_sizes: Sequence[int] = (32, 64, 128, 256, 512, 1024),
                      variants: Sequence[str] = VARIANTS, seeds: Sequence[int] = (0, 1, 2, 3, 4),
                      **setup: Any) -> list[dict]:
    """Test accuracy after ``num_epochs`` for every batch size, variant and seed.

    ``setup`` overrides :data:`SETUP` (base_batch_size, base_lr, num_epochs, warmup_epochs,
    hidden, init_scale). Returns one row per (batch_size, variant): ``lr`` (after warmup),
    ``updates``, per-seed ``accuracies``, their ``mean`` and ``min``, and ``diverged`` (how
    many seeds). At the base batch size the three variants are the same run, made once.
    Introduced in notebooks/07_large_minibatch.ipynb.
    """
    cfg = {**SETUP, **setup}
    unknown = set(cfg) - set(SETUP)
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(SETUP)}")
    n = len(_digits()[0])
    rows, cache = [], {}
    for batch_size in batch_sizes:
        for variant in variants:
            key = "base" if batch_size == cfg["base_batch_size"] else variant
            schedule = schedule_for(variant, batch_size, cfg["base_lr"], cfg["base_batch_size"],
                                    cfg["warmup_epochs"], n)
            if (batch_size, key) not in cache:
                cache[batch_size, key] = [
                    train_and_test(batch_size, schedule, cfg["num_epochs"], seed, cfg["hidden"],
                                   cfg["init_scale"]) for seed in seeds]
            runs = cache[batch_size, key]
            accs = [r["accuracy"] for r in runs]
            rows.append(dict(batch_size=batch_size, variant=variant,
                             # the rate long after any warmup: the variant's target rate
                             lr=schedule(10**9), updates=runs[0]["updates"], accuracies=accs,
                             mean=float(np.mean(accs)), min=float(np.min(accs)),
                             diverged=sum(r["diverged"] for r in runs)))
    return rows


def largest_batch_within(rows: list[dict], variant: str, tolerance: float = 0.01,
                         baseline: float | None = None) -> int:
    """The largest batch size whose mean accuracy (``variant``'s rows) is at least the
    baseline's minus ``tolerance`` (0.01 = one percentage point). ``baseline`` defaults to the
    mean accuracy at the smallest batch size. Introduced in notebooks/07_large_minibatch.ipynb."""
    mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["batch_size"])
    if not mine:
        raise ValueError(f"no rows for variant {variant!r}")
    baseline = mine[0]["mean"] if baseline is None else baseline
    return max(r["batch_size"] for r in mine if r["mean"] >= baseline - tolerance - 1e-12)


def format_table(rows: list[dict]) -> str:
    """Rows of :func:`accuracy_vs_batch` as a table: batch, updates, then each variant's lr
    and mean test accuracy (with how many seeds diverged, if any).
    Introduced in notebooks/07_large_minibatch.ipynb."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = [f"{'batch':>6}{'updates':>9}" + "".join(f"{v + ' lr':>11}{v + ' acc':>13}"
                                                      for v in variants)]
    for b in dict.fromkeys(r["batch_size"] for r in rows):
        mine = {r["variant"]: r for r in rows if r["batch_size"] == b}
        cells = []
        for v in variants:
            r = mine[v]
            flag = f" ({r['diverged']}d)" if r["diverged"] else ""
            cells.append(f"{r['lr']:>11.3g}{100 * r['mean']:>8.1f}%{flag:>5}")
        lines.append(f"{b:>6}{mine[variants[0]]['updates']:>9}" + "".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- why the rule holds, and fails
def linear_scaling_gap(theta: ArrayLike, k: int, batch_size: int, lr: float, seed: int = 0,
                       hidden: int | Sequence[int] = (64, 64), init_scale: float = 1.4) -> float:
    """How far one step with ``k * lr`` on ``k * batch_size`` samples lands from ``k`` steps
    with ``lr`` on the same samples, ``batch_size`` at a time, starting from ``theta``: the
    distance between the two end points divided by the length of the big step. That is
    ``|sum_j g_j(theta_j) - sum_j g_j(theta)| / |sum_j g_j(theta)|``: near 0 when the
    gradients barely change over the k small steps (the rule holds), near 1 when they do.
    Introduced in notebooks/07_large_minibatch.ipynb."""
    X, y, _, _ = _digits()
    problem = MLPClassifier(10, hidden, init_scale)
    idx = np.random.default_rng(seed).permutation(len(X))[:k * batch_size]
    small = np.asarray(theta, dtype=np.float64).copy()
    for j in range(k):
        part = idx[j * batch_size:(j + 1) * batch_size]
        small = small - lr * problem.grad(small, X[part], y[part])
    big = theta - k * lr * problem.grad(theta, X[idx], y[idx])
    return float(np.linalg.norm(small - big) / np.linalg.norm(big - theta))


def updates_to_accuracy(batch_sizes: Sequence[int], target: float = 0.9, variant: str = "warmup",
                        max_epochs: int = 10, seeds: Sequence[int] = (0, 1, 2),
                        **setup: Any) -> list[dict]:
    """Updates (and epochs) until test accuracy first reaches ``target`` with ``variant``'s
    schedule, per batch size (mean over seeds; nan if a seed never gets there).
    Introduced in notebooks/07_large_minibatch.ipynb."""
    cfg = {**SETUP, **setup}
    n = len(_digits()[0])
    rows = []
    for batch_size in batch_sizes:
        schedule = schedule_for(variant, batch_size, cfg["base_lr"], cfg["base_batch_size"],
                                cfg["warmup_epochs"], n)
        runs = [train_and_test(batch_size, schedule, max_epochs, seed, cfg["hidden"],
                               cfg["init_scale"], target=target) for seed in seeds]
        reached = [np.nan if r["updates_to_target"] is None else r["updates_to_target"]
                   for r in runs]
        updates = float(np.mean(reached))
        rows.append(dict(batch_size=batch_size, variant=variant, updates=updates,
                         epochs=updates / gd.updates_per_epoch(n, batch_size, True)))
    return rows
