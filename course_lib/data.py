"""Small data sets that ship offline, and how to cut them into one shard per rank.

Everything here is numpy float64 and deterministic given a seed, so a notebook cell, a test
and a lab check see exactly the same numbers. Nothing is downloaded: the synthetic sets are
generated, and the handwritten digits come inside the scikit-learn wheel.

    from course_lib import data
    X, y, theta_true = data.make_linear(n_samples=200)        # X[:, 0] is all ones
    X_train, y_train, X_test, y_test = data.load_digits()     # 8x8 digits, 64 features
    X_r, y_r = data.shard(X, y, rank=1, world_size=4)         # this rank's slice
    for idx in data.batches(len(X), batch_size=32, rng=np.random.default_rng(0)):
        ...                                                   # X[idx], y[idx]

Introduced in notebooks/01_gradient_descent.ipynb.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from course_lib.sharding import shard_bounds


def make_linear(n_samples: int = 200, n_features: int = 1, noise: float = 0.5, seed: int = 0,
                bias: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic linear-regression data ``y = X @ theta_true + noise``.

    Features are drawn uniformly from [0, 2) (not centred, as raw features usually are, which
    makes the loss surface an elongated valley rather than a round bowl). With ``bias=True``
    a leading column of ones is prepended, so ``theta[0]`` is the intercept and
    ``X.shape == (n_samples, n_features + 1)``. ``theta_true`` has one entry per column of X.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    if n_samples < 1 or n_features < 1:
        raise ValueError(f"need n_samples >= 1 and n_features >= 1, got {n_samples}, {n_features}")
    rng = np.random.default_rng(seed)
    features = rng.uniform(0.0, 2.0, size=(n_samples, n_features))
    X = np.hstack([np.ones((n_samples, 1)), features]) if bias else features
    theta_true = rng.uniform(-3.0, 3.0, size=X.shape[1]).round(1)
    if bias:
        theta_true[0] = 4.0  # a fixed, memorable intercept
    y = X @ theta_true + noise * rng.normal(size=n_samples)
    return X.astype(np.float64), y.astype(np.float64), theta_true.astype(np.float64)


def make_sparse_linear(n_samples: int = 500, frequencies: Sequence[float] = (1.0, 0.2, 0.04),
                       noise: float = 0.05,
                       seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Linear data whose features are non-zero with very different frequencies (no bias).

    Column ``j`` is non-zero in about ``frequencies[j]`` of the rows (values N(0, 1) there,
    each column has at least one non-zero). Rare features get small averaged gradients, so
    one learning rate for all parameters learns them slowly: the motivation for Adagrad.
    Returns ``(X, y, theta_true)`` with ``theta_true = [1, 1, ...]``.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    rng = np.random.default_rng(seed)
    freq = np.asarray(frequencies, dtype=np.float64)
    mask = rng.random(size=(n_samples, len(freq))) < freq
    # one random row per column switched on, so that no feature is all zeros
    mask[rng.integers(n_samples, size=len(freq)), np.arange(len(freq))] = True
    X = np.where(mask, rng.normal(size=mask.shape), 0.0)
    theta_true = np.ones(len(freq))
    y = X @ theta_true + noise * rng.normal(size=n_samples)
    return X, y, theta_true


def load_digits(standardize: bool = True, seed: int = 0,
                test_size: float = 0.25) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 8x8 handwritten digits bundled with scikit-learn (1797 images, 10 classes).

    Returns ``(X_train, y_train, X_test, y_test)``: float64 features (64 pixels, scaled with
    the *training* mean and standard deviation when ``standardize``, else divided by 16 into
    [0, 1]) and int64 labels. The split is stratified and fixed by ``seed``; nothing is
    downloaded.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    # scikit-learn takes a second to import: only when the digits are asked for (the
    # synthetic sets, and every process that imports this module for them, do without it)
    from sklearn.datasets import load_digits as _sk_load_digits
    from sklearn.model_selection import train_test_split

    digits = _sk_load_digits()
    X = digits.data.astype(np.float64)
    y = digits.target.astype(np.int64)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=test_size, random_state=seed, stratify=y
    )
    if standardize:
        mean = X_train.mean(axis=0)
        std = X_train.std(axis=0)
        std[std == 0] = 1.0  # border pixels that are always blank
        X_train, X_test = (X_train - mean) / std, (X_test - mean) / std
    else:
        X_train, X_test = X_train / 16.0, X_test / 16.0
    return X_train, y_train, X_test, y_test


def shard(X: np.ndarray, y: np.ndarray, rank: int,
          world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The rank's contiguous shard ``(X_r, y_r)`` of a data set (views, not copies).

    Every sample lands in exactly one shard, in order; shard sizes differ by at most one.
    Rank r of world_size ranks trains on ``shard(X, y, r, world_size)``.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    if len(X) != len(y):
        raise ValueError(f"X and y disagree on the number of samples: {len(X)} vs {len(y)}")
    start, stop = shard_bounds(len(X), rank, world_size)
    return X[start:stop], y[start:stop]


def batches(n: int, batch_size: int,
            rng: np.random.Generator | None = None) -> Iterator[np.ndarray]:
    """Yield index arrays of consecutive batches covering ``0 .. n-1`` exactly once.

    With ``rng`` (a ``np.random.Generator``) the order is ``rng.permutation(n)``, else
    ``0, 1, ..., n-1``. All batches have ``batch_size`` indices except possibly the last.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]
