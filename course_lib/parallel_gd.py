"""Gradients are embarrassingly parallel: the full gradient is the sum of per-shard gradients.

Introduced in notebooks/00_welcome_and_cluster.ipynb and used again in
notebooks/02_parallel_computing.ipynb. Each rank holds one shard of the data, computes the
*unnormalised* gradient sum over its samples, and an allreduce adds the shards up:

    grad J(theta) = 1/m * sum_k sum_{i in S_k} (h(x_i) - y_i) x_i
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from course_lib import data
from course_lib.comm import Comm, get_comm
from course_lib.models import LinearRegression

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster


def _problem(n_samples, n_features, seed):
    X, y, _ = data.make_linear(n_samples, n_features, noise=0.5, seed=seed)
    theta = np.random.default_rng(seed + 1).normal(size=X.shape[1])
    return X, y, theta


def shard_gradient(n_samples: int = 1000, n_features: int = 8, seed: int = 0) -> dict:
    """On every rank: this rank's shard gradient sum, allreduced into the full gradient.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    # torch takes seconds to import: only on the ranks, not in the notebook that imports this
    import torch
    import torch.distributed as dist
    rank, world_size = dist.get_rank(), dist.get_world_size()
    X, y, theta = _problem(n_samples, n_features, seed)
    X_r, y_r = data.shard(X, y, rank, world_size)
    local = LinearRegression().grad_sum(theta, X_r, y_r)
    total = torch.from_numpy(local.copy())  # float64 on the wire, so nothing is rounded
    dist.all_reduce(total)
    return {"rank": rank, "n_local": len(X_r), "local": local, "full": total.numpy() / n_samples}


def check_full_gradient(cluster: Cluster, n_samples: int = 1000, n_features: int = 8,
                        seed: int = 0) -> tuple[float, list[dict]]:
    """Run :func:`shard_gradient` on every rank; compare with the single-process gradient.

    Returns ``(max_abs_error, results)``; the error is at rounding level when it is right.
    Introduced in notebooks/00_welcome_and_cluster.ipynb.
    """
    results = cluster.run(shard_gradient, n_samples, n_features, seed)
    X, y, theta = _problem(n_samples, n_features, seed)
    expected = LinearRegression().grad(theta, X, y)
    error = max(float(np.max(np.abs(r["full"] - expected))) for r in results)
    return error, results


# ---------------------------------------------------------------- with point-to-point messages
def ring_pass(comm: Comm, value: np.ndarray) -> list[np.ndarray]:
    """Every rank's ``value`` on every rank, passed around the ring; a list in rank order.

    In step ``s`` (``s = 0 .. world_size - 2``) each rank forwards the value it received last
    to its right neighbour and receives the value of rank ``rank - s - 1`` from its left, with
    ``comm.sendrecv`` so that no step can deadlock. Lab 02 asks for this function;
    introduced in notebooks/02_parallel_computing.ipynb.
    """
    value = np.ascontiguousarray(value)
    rank, world_size = comm.rank, comm.world_size
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    values = [None] * world_size
    values[rank] = value.copy()
    outgoing = values[rank]
    for step in range(world_size - 1):
        incoming = np.empty_like(value)  # a fresh buffer: the list keeps every one
        comm.sendrecv(outgoing, right, incoming, left)
        # in step s the value arriving from the left started at rank - s - 1, s + 1 hops away
        values[(rank - step - 1) % world_size] = incoming
        outgoing = incoming  # forwarded next step: the right neighbour has not seen it yet
    return values


def global_gradient(comm: Comm, X_shard: np.ndarray, y_shard: np.ndarray, theta: np.ndarray,
                    n_total: int) -> np.ndarray:
    """The full-data gradient of ``J = 1/(2m) sum (x @ theta - y)^2`` on every rank.

    Each rank sums the gradient over its own shard (possibly empty), :func:`ring_pass` brings
    every partial sum to every rank, and each adds them in rank order and divides by
    ``m = n_total``, so all ranks hold bit-identical results. Lab 02 asks for this function;
    introduced in notebooks/02_parallel_computing.ipynb.
    """
    local = LinearRegression().grad_sum(theta, X_shard, y_shard)
    return sum(ring_pass(comm, local)) / n_total  # the list is in rank order on every rank


def comm_shard_gradient(n_samples: int = 1000, n_features: int = 8, seed: int = 0,
                        timeout: float = 10.0) -> dict:
    """On every cluster rank: :func:`global_gradient` over ``course_lib.comm`` (torch).

    Same data and result layout as :func:`shard_gradient` (which uses the native allreduce),
    so the two can be compared. Introduced in notebooks/02_parallel_computing.ipynb.
    """
    comm = get_comm("torch", timeout=timeout)
    X, y, theta = _problem(n_samples, n_features, seed)
    X_r, y_r = data.shard(X, y, comm.rank, comm.world_size)
    full = global_gradient(comm, X_r, y_r, theta, n_samples)
    return {"rank": comm.rank, "n_local": len(X_r),
            "local": LinearRegression().grad_sum(theta, X_r, y_r), "full": full}


def full_gradient(n_samples: int = 1000, n_features: int = 8, seed: int = 0) -> np.ndarray:
    """The single-process gradient of the problem the two functions above split across ranks.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    X, y, theta = _problem(n_samples, n_features, seed)
    return LinearRegression().grad(theta, X, y)
