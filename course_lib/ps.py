"""The parameter server: servers hold the parameters, workers pull them, compute, push gradients.

Introduced in notebooks/04_parameter_server.ipynb. Roles are given to a cluster's ranks by a
mapping like TensorFlow's ClusterSpec; the flat float64 parameter vector is split into
contiguous shards, one per server (``sharding.shard_bounds``)::

    from course_lib import ps
    spec = ps.make_spec(num_servers=1, num_workers=3)   # {"ps": [0], "worker": [1, 2, 3]}
    result = ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, num_epochs=5,
                      batch_size=64, mode="async", staleness_aware=True)
    result.theta, result.staleness_histogram(), result.pushes_per_s

Synchronous mode equals single-process mini-batch SGD on the global batch: every worker takes
its slice (``shard_bounds``) of each global batch, pushes the gradient SUM and the sample count,
and each server divides the summed sums by the global batch size. Asynchronous mode applies each
push at once; its staleness (server version at apply minus the version the worker computed on)
is recorded, and the staleness-aware step divides the learning rate by it (Zhang et al. 2016).
What a server does with a push is a *policy*, and both are here side by side:
:class:`Synchronous` (one step from every worker's push; with ``backup_workers=b``, notebook
07, from the first N - b, dropping late ones: Chen et al. 2016) and :class:`Asynchronous` (each
push at once; bounded staleness; the staleness-aware step). The server loop that asks them, with
its sockets, deadlines, restarts and checkpoints, is :mod:`course_lib.ps_server`; it never
calls back into this module. Options (:class:`PSConfig`) include stragglers (``slow=``) and
faults (``faults=``). One file for the lesson (roles, policies, the worker, the run, the
one-process simulation): it runs over ~300 lines to keep them together.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from course_lib.ps_server import (
    PSError,
    ServerConnections,
    Shard,
    bind_server,
    serve,
    serve_restarting,
)
from course_lib.runtime import fault_points
from course_lib.runtime.engine import ENGINE
from course_lib.sharding import shard_bounds

if TYPE_CHECKING:  # for the hints only: the cluster imports ipyparallel
    from course_lib.runtime.cluster import Cluster

__all__ = ["Asynchronous", "PSConfig", "PSError", "PSResult", "Policy", "Shard", "Synchronous",
           "apply_push", "make_spec", "run_role", "simulate_async", "train", "worker_step"]


def make_spec(num_servers: int = 1, num_workers: int = 3,
              world_size: int | None = None) -> dict[str, list[int]]:
    """A ClusterSpec-like role map: servers first, then workers, the remaining ranks idle.

    Introduced in notebooks/04_parameter_server.ipynb."""
    world_size = num_servers + num_workers if world_size is None else world_size
    if num_servers < 1 or num_workers < 1 or num_servers + num_workers > world_size:
        raise ValueError(f"num_servers and num_workers must be >= 1 and fit in world_size="
                         f"{world_size} ranks, got num_servers={num_servers}, "
                         f"num_workers={num_workers}")
    ranks = list(range(world_size))
    return {"ps": ranks[:num_servers], "worker": ranks[num_servers:num_servers + num_workers],
            "idle": ranks[num_servers + num_workers:]}


def role_of(spec: dict, rank: int) -> str:
    """'ps', 'worker' or 'idle': the job of ``rank`` in ``spec``.

    Introduced in notebooks/04_parameter_server.ipynb."""
    found = [job for job, ranks in spec.items() if rank in ranks]
    if len(found) > 1:
        raise ValueError(f"rank {rank} has several roles in {spec}: {found}")
    return found[0] if found else "idle"


# ---------------------------------------------------------------- what a server does with a push
def apply_push(theta: np.ndarray, version: int, grad: np.ndarray, pulled_version: int,
               lr: float, staleness_aware: bool = False) -> tuple[np.ndarray, int, int]:
    """Server side of one asynchronous push: return ``(new_theta, version + 1, staleness)``.

    ``grad`` is a mean gradient computed by a worker on parameters of version
    ``pulled_version``; ``staleness = version - pulled_version`` counts the updates applied
    since. The staleness-aware step uses ``lr / max(staleness, 1)``. ``theta`` is not modified.
    Introduced in notebooks/04_parameter_server.ipynb.
    """
    staleness = int(version - pulled_version)
    step = lr / max(staleness, 1) if staleness_aware else lr
    return theta - step * np.asarray(grad, dtype=np.float64), version + 1, staleness


class Policy:
    """What a server decides for each push. ``push`` answers ``"held"`` (answer after the step),
    ``"applied"``, ``"dropped"`` or ``"rejected"``; a synchronous policy steps when ``ready``.
    The counters are the server's statistics of its decisions.
    Introduced in notebooks/04_parameter_server.ipynb."""

    can_lose_workers = True  # may a worker go silent while the others go on?

    def __init__(self) -> None:
        self.staleness: list[int] = []  # of each gradient applied
        self.rejected = 0               # pushes too stale to apply
        self.dropped: list[tuple[int, int]] = []  # (worker, version) of late pushes
        self.from_lost = 0              # pushes computed on versions a killed server lost

    def counts(self) -> dict:
        return dict(staleness=self.staleness, rejected=self.rejected, dropped=self.dropped,
                    from_lost=self.from_lost)

    def ready(self, running: set[int]) -> bool:
        return False


class Synchronous(Policy):
    """Wait for one push from every running worker, then apply
    ``theta -= lr * (sum of gradient sums) / (sum of sample counts)`` once: mini-batch SGD on
    the global batch. With ``backup_workers = b`` the step goes on with the first N - b pushes
    of the current version; a later push of an older version is dropped (Chen et al. 2016).
    Introduced in notebooks/04_parameter_server.ipynb (backup workers: notebook 07)."""

    def __init__(self, lr: float, num_workers: int, backup_workers: int = 0) -> None:
        super().__init__()
        self.lr, self.num_workers, self.backup_workers = lr, num_workers, backup_workers
        self.can_lose_workers = backup_workers > 0
        self.held: dict[int, tuple[np.ndarray, int]] = {}  # worker -> (grad sum, count)

    def push(self, shard: Shard, worker: int, grad_sum: np.ndarray, count: int,
             pulled: int) -> str:
        if self.backup_workers and pulled != shard.version:  # late: the step went on
            self.dropped.append((worker, pulled))
            return "dropped"
        self.held[worker] = (grad_sum, count)
        return "held"

    def ready(self, running: set[int]) -> bool:
        if not self.held:
            return False
        if self.backup_workers:  # the first N - b (fewer, once workers have finished)
            return len(self.held) >= min(self.num_workers - self.backup_workers, len(running))
        return set(self.held) >= running

    def step(self, shard: Shard) -> list[int]:
        """Apply the held pushes as one step; return the workers whose pushes it used."""
        total = sum(count for _, count in self.held.values())
        if total:
            grad_sum = sum(g for g, _ in self.held.values())
            shard.theta, shard.version = shard.theta - self.lr * grad_sum / total, shard.version + 1
            self.staleness += [0] * len(self.held)
        elif self.backup_workers:  # the first gradients held no sample: an empty step, still a step
            shard.version += 1
        used, self.held = sorted(self.held), {}
        return used


class Asynchronous(Policy):
    """Apply each push at once (Hogwild-style SGD on a server, Dean et al. 2012) with
    :func:`apply_push`; with ``staleness_aware`` the step is divided by the staleness (Zhang et
    al. 2016); with ``max_staleness`` a push staler than that is rejected (bounded staleness).
    Introduced in notebooks/04_parameter_server.ipynb."""

    def __init__(self, lr: float, max_staleness: int | None = None,
                 staleness_aware: bool = False) -> None:
        super().__init__()
        self.lr, self.max_staleness, self.staleness_aware = lr, max_staleness, staleness_aware

    def push(self, shard: Shard, worker: int, grad_sum: np.ndarray, count: int,
             pulled: int) -> str:
        if pulled > shard.version:  # computed on versions a killed server lost: fresh now
            self.from_lost += 1
            pulled = shard.version
        if self.max_staleness is not None and shard.version - pulled > self.max_staleness:
            self.rejected += 1
            return "rejected"
        if count:  # a worker's slice of the batch can be empty
            shard.theta, shard.version, staleness = apply_push(
                shard.theta, shard.version, grad_sum / count, pulled, self.lr,
                self.staleness_aware)
            self.staleness.append(staleness)
        return "applied"


def worker_step(problem: Any, pull: Callable[[], tuple], push: Callable[..., None],
                Xb: np.ndarray, yb: np.ndarray) -> float:
    """One worker step: ``theta, version = pull()``; push the gradient SUM over the batch and its
    size: ``push(grad_sum, len(Xb), version)``. Returns the batch loss sum at the pulled theta.
    Introduced in notebooks/04_parameter_server.ipynb."""
    theta, version = pull()
    push(problem.grad_sum(theta, Xb, yb), len(Xb), version)
    return problem.loss_sum(theta, Xb, yb)


# ---------------------------------------------------------------- running on a cluster
@dataclass(frozen=True)
class PSConfig:
    """Every option of a parameter-server run (:func:`train` takes them as keywords).

    ``mode`` 'sync' or 'async'; ``delay``: mean of a random sleep (s) before each push, to make
    staleness; ``slow={rank: seconds}`` adds that sleep to every step of those workers
    (stragglers); ``backup_workers``, ``max_staleness``, ``staleness_aware``: the policies'.
    Every wait has a deadline of ``timeout`` s, the whole run ``time_limit`` s.
    ``checkpoints``: a :class:`course_lib.checkpoint.Store` (notebook 11) where each server
    checkpoints its shard (``server-{s}/``) at init, every ``checkpoint_every`` updates and
    when a worker finishes. ``server_restarts=r``
    (async; notebook 11): a server that is killed is started again, at most r times, on the
    same address, from its last checkpoint; the workers resend what went unanswered.
    ``faults``: fault points (:mod:`course_lib.runtime.fault_points` syntax) armed on every rank
    they name: ``"ps-worker-step:stop@6:rank=2"`` (worker rank 2 goes silent at its 6th step;
    ``kill``: its process dies), ``"ps-server-update:kill@60"`` (a server dies at its 60th update);
    with ``checkpoints`` each fires once in its life. Introduced in
    notebooks/04_parameter_server.ipynb."""

    lr: float
    mode: str = "sync"
    num_epochs: int = 1
    batch_size: int = 32
    seed: int = 0
    staleness_aware: bool = False
    max_staleness: int | None = None
    backup_workers: int = 0
    delay: float = 0.0
    slow: dict = field(default_factory=dict)
    timeout: float = 10.0
    time_limit: float = 120.0
    checkpoints: Any = None  # a checkpoint.Store (notebook 11)
    checkpoint_every: int = 20
    server_restarts: int = 0
    faults: tuple = ()

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', not {self.mode!r}")
        if not isinstance(self.backup_workers, (int, np.integer)) or self.backup_workers < 0:
            raise ValueError(f"backup_workers must be an integer >= 0, got "
                             f"{self.backup_workers!r}")
        if self.server_restarts and (self.mode != "async" or self.checkpoints is None):
            raise ValueError(f"server_restarts={self.server_restarts} needs mode='async' (a sync "
                             f"step waits for every worker) and checkpoints (a "
                             f"checkpoint.Store) to restart from; got mode={self.mode!r}, "
                             f"checkpoints={self.checkpoints!r}")
        object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "slow", {int(r): float(s) for r, s in self.slow.items()})

    @property
    def retry(self) -> float | None:
        """A worker's first wait for a reply before it sends again (a server may restart)."""
        return 0.5 if self.server_restarts else None

    def policy(self, num_workers: int) -> Policy:
        if self.mode == "sync":
            return Synchronous(self.lr, num_workers, self.backup_workers)
        return Asynchronous(self.lr, self.max_staleness, self.staleness_aware)


def _work(spec: dict, addresses: list[str], problem, X, y, theta0, cfg: PSConfig) -> dict:
    """A worker's loop: its slice of each global batch, pull (the last push's reply), push."""
    w, num_workers = spec["worker"].index(ENGINE["rank"]), len(spec["worker"])
    conn = ServerConnections(addresses, len(theta0), 2 * cfg.timeout + 5, retry=cfg.retry)
    rng, delay_rng = np.random.default_rng(cfg.seed), np.random.default_rng([cfg.seed, w])
    log = dict(worker=ENGINE["rank"], steps=0, rejected=0, loss_sums=[], counts=[], times=[],
               dropped=0, step_ids=[], versions=[])
    slow_s = cfg.slow.get(ENGINE["rank"], 0.0)
    try:
        state = {}
        state["theta"], state["versions"] = conn.init(theta0) if w == 0 else conn.pull()

        def pull():
            return state["theta"], state["versions"]

        def push(grad_sum, count, versions):
            if cfg.delay:
                time.sleep(delay_rng.exponential(cfg.delay))
            if slow_s:
                time.sleep(slow_s)  # a straggler: this worker's step takes longer
            state["theta"], state["versions"], rejected = conn.push(grad_sum, count, versions)
            log["rejected"] += rejected
            log["dropped"] += conn.dropped

        # "times" count from t0; the server's restarts use the same clock: CLOCK_MONOTONIC is
        # one clock for every process of a machine, and never stepped as the wall clock can be
        t0 = log["t0"] = time.monotonic()
        per_epoch = -(-len(X) // cfg.batch_size)
        total, epoch, order = cfg.num_epochs * per_epoch, -1, None
        step = state["versions"][0] if cfg.backup_workers else 0  # a late starter skips
        while step < total:  # global steps; with backup workers a late worker skips ahead
            while epoch < step // per_epoch:
                order, epoch = rng.permutation(len(X)), epoch + 1
            start = (step % per_epoch) * cfg.batch_size
            batch = order[start:start + cfg.batch_size]
            a, b = shard_bounds(len(batch), w, num_workers)
            try:
                fault_points.point("ps-worker-step")  # armed: this worker dies or goes silent here
            except fault_points.FaultStop:
                conn.close(linger=0)  # silent, as a crashed worker would be
                return dict(log, stopped=True, bytes=conn.bytes)
            loss = worker_step(problem, pull, push, X[batch[a:b]], y[batch[a:b]])
            log["loss_sums"].append(float(loss))
            log["counts"].append(b - a)
            log["times"].append(time.monotonic() - t0)
            log["step_ids"].append(step)
            log["versions"].append(state["versions"][0])  # server 0's, after this push
            log["steps"] += 1
            step = state["versions"][0] if cfg.backup_workers else step + 1
        conn.done()
        return dict(log, stopped=False, bytes=conn.bytes, theta=state["theta"],
                    resent=conn.resent)
    finally:
        conn.close()


def run_role(spec: dict, addresses: list[str], problem: Any, X: np.ndarray, y: np.ndarray,
             theta0: np.ndarray, cfg: PSConfig) -> dict:
    """Runs on every rank (``cluster.run``): serve, work, or stay idle, as ``spec`` says.

    Introduced in notebooks/04_parameter_server.ipynb."""
    role, policy = role_of(spec, ENGINE["rank"]), cfg.policy(len(spec["worker"]))
    if role == "ps" and cfg.server_restarts:  # the server runs in a child process that restarts
        return dict(serve_restarting(spec, len(theta0), cfg, policy), role="ps")
    if role == "idle":
        return {"role": "idle"}
    fault_points.arm_once(cfg.faults, cfg.checkpoints and cfg.checkpoints.directory,
                          ENGINE["rank"])
    try:
        if role == "ps":
            return dict(serve(spec, len(theta0), cfg, policy), role="ps")
        return dict(_work(spec, addresses, problem, X, y, theta0, cfg), role="worker")
    finally:
        fault_points.disarm()


@dataclass
class PSResult:
    """What a parameter-server run returns: the final theta, per-server and per-worker stats.

    Introduced in notebooks/04_parameter_server.ipynb."""

    theta: np.ndarray
    servers: list
    workers: list
    mode: str
    elapsed: float
    extra: dict = field(default_factory=dict)

    @property
    def staleness(self) -> np.ndarray:
        return np.concatenate([np.asarray(s["staleness"], int) for s in self.servers])

    def staleness_histogram(self) -> np.ndarray:
        """Counts of applied gradients by staleness 0, 1, 2, ... (all servers together)."""
        return np.bincount(self.staleness) if len(self.staleness) else np.zeros(1, int)

    @property
    def pushes(self) -> int:
        return sum(s["pushes"] for s in self.servers)

    @property
    def pushes_per_s(self) -> float:
        """Worker pushes (one per worker step, counted once, not per server) per second."""
        return sum(w["steps"] for w in self.workers) / self.elapsed

    @property
    def step_rate(self) -> float:
        """Sync steps per second between the first and the last step the servers applied."""
        ends = self.servers[0]["step_ends"]
        return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else float("nan")

    @property
    def lost_workers(self) -> list[int]:
        return sorted({w for s in self.servers for w in s["lost"]})

    def bytes_per_server(self) -> list[int]:
        return [s["bytes_in"] + s["bytes_out"] for s in self.servers]


def train(cluster: Cluster, spec: dict, problem: Any, X: np.ndarray, y: np.ndarray,
          theta0: np.ndarray, host: str = "127.0.0.1", **options: Any) -> PSResult:
    """Train ``problem`` on (X, y) with the servers and workers of ``spec`` on ``cluster``;
    ``options`` are :class:`PSConfig`'s (``lr`` at least).

    Sync mode equals ``gd.minibatch_sgd`` with the same seed and global ``batch_size``. A worker
    made silent or killed by a fault (``faults=``): in async mode the others go on and the lost
    worker is reported; in sync mode the step fails with an error naming it.
    ``backup_workers=b`` (sync, one server; notebook 07): each step averages the first
    N - b gradients; late ones are dropped (``servers[0]["dropped"]``, ``["used"]``) and a
    late worker goes on with the server's current step.
    Introduced in notebooks/04_parameter_server.ipynb.
    """
    try:
        cfg = PSConfig(**options)
    except TypeError as err:  # an unknown option: say which ones there are
        raise TypeError(f"ps.train: {err}; the options are PSConfig's: "
                        f"{', '.join(PSConfig.__dataclass_fields__)}") from None
    if cfg.backup_workers and (cfg.mode != "sync" or len(spec["ps"]) != 1
                               or cfg.backup_workers >= len(spec["worker"])):
        raise ValueError(f"backup_workers={cfg.backup_workers} needs mode='sync', one server "
                         f"(each shard would pick its own first gradients) and more workers than "
                         f"backups; got mode={cfg.mode!r}, spec {spec}")
    if set(spec["ps"]) & set(spec["worker"]) or max(spec["ps"] + spec["worker"]) >= cluster.n:
        raise ValueError(f"spec {spec} needs distinct ranks below {cluster.n}")
    if cfg.checkpoints is not None:
        directory = os.path.abspath(cfg.checkpoints.directory)
        old = sorted(p for p in os.listdir(directory) if p.startswith("server-")) \
            if os.path.isdir(directory) else []
        if old:
            raise ValueError(f"{directory} holds the servers' checkpoints of another run "
                             f"({', '.join(old)}): a restarted server would resume from them; "
                             "pass a new directory")
        os.makedirs(directory, exist_ok=True)
        cfg = replace(cfg, checkpoints=replace(cfg.checkpoints, directory=directory))
    bound = cluster.run(bind_server, spec, host)  # in rank order; None on non-servers
    # server s of the spec (``spec["ps"][s]``) holds shard s: its address goes to place s
    addresses = [bound[r] for r in spec["ps"]]
    t0 = time.perf_counter()
    results = cluster.run(run_role, spec, addresses, problem, X, y,
                          np.asarray(theta0, np.float64), cfg, timeout=cfg.time_limit + 30,
                          allow_dead=cfg.mode == "async")
    results = [{"role": "worker", "died": True, "steps": 0} if isinstance(r, Exception) else r
               for r in results]  # async: a worker whose process died
    elapsed = time.perf_counter() - t0
    servers = sorted((r for r in results if r["role"] == "ps"),  # shard order = spec order
                     key=lambda r: spec["ps"].index(r["server"]))
    workers = [r for r in results if r["role"] == "worker"]
    theta = np.concatenate([s["theta"] for s in servers])
    return PSResult(theta, servers, workers, cfg.mode, elapsed)


# ---------------------------------------------------------------- in one process, for plots
def simulate_async(problem: Any, X: np.ndarray, y: np.ndarray, theta0: np.ndarray, lr: float,
                   num_workers: int, num_updates: int, batch_size: int = 32,
                   staleness_aware: bool = False, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Asynchronous SGD simulated in one process: ``num_workers`` workers with random compute
    times; each pushes a gradient computed on the parameters it last pulled, applied by
    :func:`apply_push`. Staleness is about ``num_workers - 1`` on average. Returns
    ``(losses, staleness)``: the full-data loss after every update and each update's staleness.
    Introduced in notebooks/04_parameter_server.ipynb.
    """
    rng = np.random.default_rng(seed)
    theta, version = np.asarray(theta0, np.float64).copy(), 0
    # each worker: (finish time, worker id, pulled theta, pulled version)
    queue = [(rng.exponential(), k, theta, version) for k in range(num_workers)]
    heapq.heapify(queue)
    losses, staleness = [problem.loss(theta, X, y)], []
    for _ in range(num_updates):
        finish, k, pulled, pulled_version = heapq.heappop(queue)
        idx = rng.integers(0, len(X), batch_size)
        grad = problem.grad(pulled, X[idx], y[idx])
        theta, version, tau = apply_push(theta, version, grad, pulled_version, lr,
                                         staleness_aware)
        losses.append(problem.loss(theta, X, y))
        staleness.append(tau)
        if not np.isfinite(losses[-1]) or losses[-1] > 1e12:
            break
        heapq.heappush(queue, (finish + rng.exponential(), k, theta, version))
    return np.array(losses), np.array(staleness)
