"""Stragglers in synchronous training, and backup workers: measured on the cluster, then modelled.

Introduced in notebooks/07_large_minibatch.ipynb. A synchronous step ends when the LAST rank's
gradient is in, so one slow rank (a straggler: a busy machine, a slow disk, a noisy neighbour)
sets everyone's pace. Three views of it::

    from course_lib import stragglers
    rows = stragglers.straggler_experiment(cluster, delays=(0.0, 0.2))   # measured, per rank
    stragglers.expected_step_time(num_workers=64, backup=2, mean_delay=1.0)  # order statistics
    stragglers.backup_worker_runs(cluster, problem, X, y, theta0, lr=0.5, slow={3: 0.1})

``straggler_steps`` runs on every rank: a compute phase of fixed length (a sleep, so ranks that
share a core do not slow each other), then ``dist.all_reduce`` of a gradient, with a deadline.
The time a rank spends inside the allreduce is mostly *waiting* for the slowest rank.
Backup workers (Chen et al. 2016) live in the parameter server: ``ps.train(...,
backup_workers=b)`` steps with the first N - b gradients and drops the late ones.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from course_lib import ps
from course_lib.comm import wait_work
from course_lib.runtime.engine import ENGINE

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster


# ---------------------------------------------------------------- measured on the cluster
def _allreduce_with_deadline(tensor, timeout, what):
    wait_work(dist.all_reduce(tensor, async_op=True), timeout, what)


def straggler_steps(num_steps: int, n_params: int, compute_s: float,
                    slow: dict[int, float] | None = None, jitter: float = 0.0, seed: int = 0,
                    timeout: float = 10.0) -> dict:
    """Runs on every rank: ``num_steps`` synchronous steps of compute, then allreduce.

    Compute is ``time.sleep(compute_s + slow.get(rank, 0) + Exp(jitter))`` (``jitter`` = mean
    of a random extra delay, 0 for none); the gradient is ``n_params`` float32 ones, summed by
    ``dist.all_reduce`` (checked: every entry must equal the world size). Returns this rank's
    ``compute``, ``wait`` (time inside the allreduce) and ``step`` times, one per step.
    Introduced in notebooks/07_large_minibatch.ipynb.
    """
    rank, world = ENGINE["rank"], ENGINE["world_size"]
    extra = float((slow or {}).get(rank, 0.0))
    rng = np.random.default_rng([seed, rank])
    grad = torch.ones(n_params, device=ENGINE.get("device", "cpu"))
    what = f"all_reduce of {n_params} float32 ({4 * n_params} bytes) over {world} ranks"
    _allreduce_with_deadline(grad, timeout, f"warm-up {what}")  # connect, and line ranks up
    out = {"rank": rank, "compute": [], "wait": [], "step": []}
    for step in range(num_steps):
        grad.fill_(1.0)
        t0 = time.perf_counter()
        time.sleep(compute_s + extra + (rng.exponential(jitter) if jitter > 0 else 0.0))
        t1 = time.perf_counter()
        _allreduce_with_deadline(grad, timeout, f"step {step}: {what}")
        t2 = time.perf_counter()
        if float(grad[0]) != world or float(grad[-1]) != world:
            raise RuntimeError(f"rank {rank}: step {step}: allreduce gave {float(grad[0])}, "
                               f"expected {world}")
        out["compute"].append(t1 - t0)
        out["wait"].append(t2 - t1)
        out["step"].append(t2 - t0)
    return out


def straggler_experiment(cluster: Cluster, delays: Sequence[float] = (0.0, 0.2),
                         slow_rank: int | None = None, num_steps: int = 5,
                         compute_s: float = 0.05, n_params: int = 100_000, jitter: float = 0.0,
                         seed: int = 0, timeout: float = 10.0) -> list[dict]:
    """Run :func:`straggler_steps` once per straggler delay in ``delays`` (0 = none) with rank
    ``slow_rank`` (default: the last) slowed by it. Returns one row per (delay, rank): mean
    ``compute_s``, ``wait_s`` and ``step_s`` over the steps, and whether the rank was slowed.
    Introduced in notebooks/07_large_minibatch.ipynb."""
    slow_rank = cluster.n - 1 if slow_rank is None else slow_rank
    if not 0 <= slow_rank < cluster.n:
        raise ValueError(f"slow_rank must be a rank of the cluster (0..{cluster.n - 1}), "
                         f"got {slow_rank}")
    if num_steps < 1 or compute_s < 0 or min(delays) < 0 or jitter < 0:
        raise ValueError("need num_steps >= 1 and non-negative compute_s, delays and jitter")
    rows = []
    for delay in delays:
        # the warm-up, then per step its compute, the delay, a generous 10x the mean jitter
        # (an exponential rarely exceeds that) and the allreduce's own deadline
        deadline = timeout + num_steps * (compute_s + delay + 10 * jitter + timeout)
        results = cluster.run(straggler_steps, num_steps, n_params, compute_s,
                              {slow_rank: delay}, jitter, seed, timeout, timeout=deadline)
        for r in results:
            rows.append(dict(delay=delay, rank=r["rank"],
                             slowed=bool(delay) and r["rank"] == slow_rank,
                             compute_s=float(np.mean(r["compute"])),
                             wait_s=float(np.mean(r["wait"])), step_s=float(np.mean(r["step"]))))
    return rows


def format_straggler_table(rows: list[dict]) -> str:
    """The rows of :func:`straggler_experiment` as an aligned table (times in ms).

    Introduced in notebooks/07_large_minibatch.ipynb."""
    lines = [f"{'straggler':>10}{'rank':>6}{'compute':>10}{'wait':>10}{'step':>10}  (ms)"]
    for r in rows:
        mark = " <- slowed" if r["slowed"] else ""
        lines.append(f"{r['delay'] * 1e3:>8.0f}ms{r['rank']:>6d}{r['compute_s'] * 1e3:>10.1f}"
                     f"{r['wait_s'] * 1e3:>10.1f}{r['step_s'] * 1e3:>10.1f}{mark}")
    return "\n".join(lines)


# ---------------------------------------------------------------- order statistics
def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n (H_0 = 0). Introduced in notebooks/07_large_minibatch.ipynb."""
    return float(np.sum(1.0 / np.arange(1, int(n) + 1))) if n > 0 else 0.0


def expected_step_time(num_workers: int, backup: int = 0, mean_delay: float = 1.0,
                       compute_s: float = 0.0) -> float:
    """Expected step time when each of N workers takes ``compute_s + Exp(mean_delay)`` and the
    step waits for the first ``N - backup`` of them: the (N-b)-th order statistic,
    ``compute_s + mean_delay * (H_N - H_b)`` (exact for exponential delays). With b = 0 it is
    the expected maximum, which grows like ``log N``: more workers, slower steps.
    Introduced in notebooks/07_large_minibatch.ipynb."""
    if not 0 <= backup < num_workers:
        raise ValueError(f"need 0 <= backup < num_workers, got backup={backup}, "
                         f"num_workers={num_workers}")
    # E[k-th smallest of N Exp(1)] = H_N - H_(N-k) (Renyi's representation); k = N - b
    return compute_s + mean_delay * (harmonic(num_workers) - harmonic(backup))


def simulate_step_times(num_workers: int, backup: int = 0, mean_delay: float = 1.0,
                        compute_s: float = 0.0, num_steps: int = 10_000,
                        seed: int = 0) -> np.ndarray:
    """Monte Carlo of the same: ``num_steps`` steps, each the (N-b)-th smallest of N draws of
    ``compute_s + Exp(mean_delay)``. Returns the array of step times.
    Introduced in notebooks/07_large_minibatch.ipynb."""
    if not 0 <= backup < num_workers:
        raise ValueError(f"need 0 <= backup < num_workers, got {backup}, {num_workers}")
    draws = compute_s + np.random.default_rng(seed).exponential(mean_delay,
                                                                (num_steps, num_workers))
    return np.sort(draws, axis=1)[:, num_workers - backup - 1]  # (N-b)-th smallest, 0-based


# ---------------------------------------------------------------- backup workers on the PS
def backup_worker_runs(cluster: Cluster, problem: Any, X: np.ndarray, y: np.ndarray,
                       theta0: np.ndarray, lr: float, slow: dict[int, float],
                       backups: Sequence[int] = (0, 1), num_epochs: int = 1,
                       batch_size: int = 128, seed: int = 0, timeout: float = 10.0) -> list[dict]:
    """Train with the synchronous parameter server (1 server, the other ranks workers) once per
    number of backup workers in ``backups``, with the workers in ``slow={rank: seconds}``
    slowed. Returns one row per run: steps, steps per second, mean gradients used per step,
    gradients dropped, and the final full-data loss.
    Introduced in notebooks/07_large_minibatch.ipynb."""
    spec = ps.make_spec(1, cluster.n - 1, world_size=cluster.n)
    rows = []
    for b in backups:
        result = ps.train(cluster, spec, problem, X, y, theta0, lr=lr, num_epochs=num_epochs,
                          batch_size=batch_size, seed=seed, timeout=timeout,
                          backup_workers=b, slow=slow)
        server = result.servers[0]
        rows.append(dict(backup=b, steps=server["version"], step_rate=result.step_rate,
                         used=float(np.mean([len(u) for u in server["used"]])),
                         dropped=len(server["dropped"]),
                         dropped_by={w["worker"]: w["dropped"] for w in result.workers},
                         loss=float(problem.loss(result.theta, X, y)), theta=result.theta))
    return rows
