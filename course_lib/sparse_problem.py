"""The sparse problem of Hogwild!: RCV1-like data, its loss, serial SGD, and collisions.

Introduced in notebooks/03_hogwild.ipynb. Hogwild! works because each sparse update touches few
coordinates, so two workers rarely write the same one; this module holds the problem and the
arithmetic of that claim, :mod:`course_lib.hogwild` the worker processes that race on it::

    from course_lib import sparse_problem
    data = sparse_problem.make_sparse_classification()        # 0.16 % dense, like RCV1
    w, losses = sparse_problem.serial_sgd(data)                # the serial reference
    sparse_problem.collision_probability(32, 20_000)           # ~ nnz**2 / d
    sparse_problem.measured_overlap(data)                      # the same, counted on the data
    sparse_problem.make_sparse_classification(feature_distribution="zipf")  # like words
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class SparseData:
    """Rows in CSR form (``indptr``, ``indices``, ``values``), labels ``y`` in {-1, +1}.

    Introduced in notebooks/03_hogwild.ipynb."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    y: np.ndarray
    n_features: int

    def __len__(self) -> int:
        return len(self.y)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(feature indices, values) of row ``i``: entries ``indptr[i]`` to ``indptr[i + 1]``."""
        a, b = self.indptr[i], self.indptr[i + 1]
        return self.indices[a:b], self.values[a:b]


def make_sparse_classification(n_samples: int = 20_000, n_features: int = 20_000, nnz: int = 32,
                               label_noise: float = 0.05, seed: int = 0,
                               feature_distribution: str = "uniform",
                               zipf_exponent: float = 1.0) -> SparseData:
    """Sparse binary classification: each row has ``nnz`` distinct features.

    Density ``nnz / n_features`` = 0.16 % by default, as in RCV1 (47,236 features, about 76
    non-zeros per document); values are positive with unit norm per row (like tf-idf), labels
    are ``sign(x . w_true)`` with a fraction ``label_noise`` flipped.
    ``feature_distribution="uniform"`` draws every feature equally often;
    ``"zipf"`` draws feature ``j`` with weight ``1 / (j + 1) ** zipf_exponent``, like word
    frequencies in text (Zipf's law), so low indices are common and rows share them far more
    often. Introduced in notebooks/03_hogwild.ipynb.
    """
    if feature_distribution not in ("uniform", "zipf"):
        raise ValueError(f"feature_distribution must be 'uniform' or 'zipf', "
                         f"not {feature_distribution!r}")
    if nnz > n_features:
        raise ValueError(f"nnz={nnz} distinct features do not fit in n_features={n_features}")
    rng = np.random.default_rng(seed)
    # every row has nnz entries: row i is indices[i * nnz:(i + 1) * nnz], so the CSR indptr
    # (built last) is simply 0, nnz, 2 nnz, ...
    indices = np.empty(n_samples * nnz, dtype=np.int64)
    if feature_distribution == "zipf":
        cdf = np.cumsum(1.0 / np.arange(1, n_features + 1) ** zipf_exponent)
        cdf /= cdf[-1]
    for i in range(n_samples):
        if feature_distribution == "uniform":
            row = rng.choice(n_features, nnz, replace=False)
        else:
            row = _distinct_draws(rng, cdf, nnz)
        indices[i * nnz:(i + 1) * nnz] = np.sort(row)
    values = np.abs(rng.normal(size=(n_samples, nnz)))
    values /= np.linalg.norm(values, axis=1, keepdims=True)
    values = values.ravel()
    w_true = rng.normal(size=n_features)
    # reduceat sums each row's segment: margin[i] = x_i . w_true
    margin = np.add.reduceat(values * w_true[indices], np.arange(0, n_samples * nnz, nnz))
    y = np.where(margin >= np.median(margin), 1.0, -1.0)  # cut at the median: balanced classes
    y[rng.random(n_samples) < label_noise] *= -1
    indptr = np.arange(0, n_samples * nnz + 1, nnz, dtype=np.int64)
    return SparseData(indptr, indices, values, y, n_features)


def _distinct_draws(rng, cdf, nnz):
    """``nnz`` distinct features: draw from ``cdf`` with replacement, keep each first hit (the
    same law as drawing one at a time without replacement)."""
    seen = np.empty(0, dtype=np.int64)
    while True:
        draws = np.concatenate([seen, np.searchsorted(cdf, rng.random(2 * nnz), side="right")])
        _, first = np.unique(draws, return_index=True)
        seen = draws[np.sort(first)]        # distinct, in the order they were drawn
        if len(seen) >= nnz:
            return seen[:nnz]


def sparse_loss(w: np.ndarray, data: SparseData) -> float:
    """Mean logistic loss ``log(1 + exp(-y x.w))`` over all rows.

    Introduced in notebooks/03_hogwild.ipynb."""
    counts = np.diff(data.indptr)
    # reduceat sums each row's segment; an empty row's "segment" would be the next entry alone,
    # so its margin is zeroed by (counts > 0)
    margin = np.add.reduceat(data.values * w[data.indices], data.indptr[:-1]) * (counts > 0)
    return float(np.mean(np.logaddexp(0.0, -data.y * margin)))  # log(1 + e^-z) without overflow


def sparse_sgd_epoch(w: np.ndarray, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray,
                     y: np.ndarray, order: np.ndarray, lr: float) -> np.ndarray:
    """One pass of plain SGD over ``order``, updating ``w`` in place (the serial reference).

    Per sample: read the touched coordinates ``w[idx]``, take the logistic gradient
    ``-y sigma(-y x.w) x`` (non-zero only on ``idx``) and subtract ``lr`` times it there. Run
    by many processes on one shared ``w`` this *is* the lock-free worker loop (lab 03).
    Introduced in notebooks/03_hogwild.ipynb.
    """
    for i in order:
        a, b = indptr[i], indptr[i + 1]
        idx, v = indices[a:b], values[a:b]
        yi = y[i]
        margin = float(w[idx] @ v)                       # read
        # -y sigma(-y margin) = -y / (1 + exp(y margin)); min(): exp(710) overflows a float
        scale = -yi / (1.0 + math.exp(min(yi * margin, 700.0)))
        w[idx] -= (lr * scale) * v                       # write only the touched coordinates
    return w


def serial_sgd(data: SparseData, lr: float = 0.5, num_epochs: int = 3,
               seed: int = 0) -> tuple[np.ndarray, list[float]]:
    """Serial SGD with the order one Hogwild worker would use: ``(w, losses per epoch)``.

    Introduced in notebooks/03_hogwild.ipynb."""
    w = np.zeros(data.n_features)
    losses = [sparse_loss(w, data)]
    rng = np.random.default_rng([seed, 0])  # Hogwild worker 0's seed: the same order
    for _ in range(num_epochs):
        sparse_sgd_epoch(w, data.indptr, data.indices, data.values, data.y,
                         rng.permutation(len(data)), lr)
        losses.append(sparse_loss(w, data))
    return w, losses


def collision_probability(nnz: int, n_features: int) -> float:
    """Chance that two rows with ``nnz`` uniform distinct features share at least one:
    ``1 - C(d - nnz, nnz) / C(d, nnz)``, about ``nnz**2 / d`` when that is small.
    Introduced in notebooks/03_hogwild.ipynb."""
    if 2 * nnz > n_features:
        return 1.0
    # C(d - k, k) / C(d, k) = (d - k)!^2 / (d! (d - 2k)!), in logs (lgamma(n + 1) = log n!)
    return 1.0 - math.exp(math.lgamma(n_features - nnz + 1) * 2 - math.lgamma(n_features + 1)
                          - math.lgamma(n_features - 2 * nnz + 1))


def measured_overlap(data: SparseData, pairs: int = 20_000, seed: int = 0) -> float:
    """Fraction of random pairs of distinct rows of ``data`` that share a feature.

    Introduced in notebooks/03_hogwild.ipynb."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(pairs):
        i, j = rng.choice(len(data), 2, replace=False)
        hits += bool(np.intersect1d(data.row(i)[0], data.row(j)[0], assume_unique=True).size)
    return hits / pairs
