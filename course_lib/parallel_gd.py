"""Gradients are embarrassingly parallel: the full gradient is the sum of per-shard gradients.

Introduced in notebooks/00_welcome_and_cluster.ipynb and used again in
notebooks/02_parallel_computing.ipynb. Each rank holds one shard of the data, computes the
*unnormalised* gradient sum over its samples, and an allreduce adds the shards up:

    grad J(theta) = 1/m * sum_k sum_{i in S_k} (h(x_i) - y_i) x_i
"""

import numpy as np

from course_lib import data
from course_lib.models import LinearRegression


def _problem(n_samples, n_features, seed):
    X, y, _ = data.make_linear(n_samples, n_features, noise=0.5, seed=seed)
    theta = np.random.default_rng(seed + 1).normal(size=X.shape[1])
    return X, y, theta


def shard_gradient(n_samples=1000, n_features=8, seed=0):
    """On every rank: this rank's shard gradient sum, allreduced into the full gradient."""
    import torch
    import torch.distributed as dist
    rank, world_size = dist.get_rank(), dist.get_world_size()
    X, y, theta = _problem(n_samples, n_features, seed)
    X_r, y_r = data.shard(X, y, rank, world_size)
    local = LinearRegression().grad_sum(theta, X_r, y_r)
    total = torch.from_numpy(local.copy())  # float64 on the wire, so nothing is rounded
    dist.all_reduce(total)
    return {"rank": rank, "n_local": len(X_r), "local": local, "full": total.numpy() / n_samples}


def check_full_gradient(cluster, n_samples=1000, n_features=8, seed=0):
    """Run :func:`shard_gradient` on every rank; compare with the single-process gradient.

    Returns ``(max_abs_error, results)``; the error is at rounding level when it is right.
    """
    results = cluster.run(shard_gradient, n_samples, n_features, seed)
    X, y, theta = _problem(n_samples, n_features, seed)
    expected = LinearRegression().grad(theta, X, y)
    error = max(float(np.max(np.abs(r["full"] - expected))) for r in results)
    return error, results
