"""The parameter server: servers hold the parameters, workers pull them, compute, push gradients.

Introduced in notebooks/04_parameter_server.ipynb. Roles are given to a cluster's ranks by a
mapping like TensorFlow's ClusterSpec; the flat float64 parameter vector is split into
contiguous shards, one per server (``data.shard_bounds``)::

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
With ``backup_workers=b`` (notebook 07) a sync step goes on with the first N - b gradients and
drops late ones (Chen et al. 2016); ``slow={rank: seconds}`` makes stragglers.
The wire (ZeroMQ) and the server loop are in :mod:`course_lib.ps_server`.
"""

from __future__ import annotations

import heapq
import os
import time
from dataclasses import dataclass, field

import numpy as np

from course_lib import faults
from course_lib.data import shard_bounds
from course_lib.engine import ENGINE
from course_lib.ps_server import PSError, ServerConnections, bind_server, serve, serve_restarting

__all__ = ["PSError", "PSResult", "apply_push", "make_spec", "run_role", "simulate_async",
           "train", "worker_step"]


def make_spec(num_servers=1, num_workers=3, world_size=None):
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


def role_of(spec, rank):
    """'ps', 'worker' or 'idle': the job of ``rank`` in ``spec``.

    Introduced in notebooks/04_parameter_server.ipynb."""
    found = [job for job, ranks in spec.items() if rank in ranks]
    if len(found) > 1:
        raise ValueError(f"rank {rank} has several roles in {spec}: {found}")
    return found[0] if found else "idle"


# ---------------------------------------------------------------- the two small pieces of logic
def apply_push(theta, version, grad, pulled_version, lr, staleness_aware=False):
    """Server side of one asynchronous push: return ``(new_theta, version + 1, staleness)``.

    ``grad`` is a mean gradient computed by a worker on parameters of version
    ``pulled_version``; ``staleness = version - pulled_version`` counts the updates applied
    since. The staleness-aware step uses ``lr / max(staleness, 1)``. ``theta`` is not modified.
    Introduced in notebooks/04_parameter_server.ipynb.
    """
    staleness = int(version - pulled_version)
    step = lr / max(staleness, 1) if staleness_aware else lr
    return theta - step * np.asarray(grad, dtype=np.float64), version + 1, staleness


def worker_step(problem, pull, push, Xb, yb):
    """One worker step: ``theta, version = pull()``; push the gradient SUM over the batch and its
    size: ``push(grad_sum, len(Xb), version)``. Returns the batch loss sum at the pulled theta.
    Introduced in notebooks/04_parameter_server.ipynb."""
    theta, version = pull()
    push(problem.grad_sum(theta, Xb, yb), len(Xb), version)
    return problem.loss_sum(theta, Xb, yb)


# ---------------------------------------------------------------- running on a cluster
def _worker(spec, addresses, problem, X, y, theta0, cfg):
    w, num_workers = spec["worker"].index(ENGINE["rank"]), len(spec["worker"])
    conn = ServerConnections(addresses, len(theta0), 2 * cfg["timeout"] + 5,
                             retry=cfg["retry"])
    rng, delay_rng = np.random.default_rng(cfg["seed"]), np.random.default_rng([cfg["seed"], w])
    log = dict(worker=ENGINE["rank"], steps=0, rejected=0, loss_sums=[], counts=[], times=[],
               dropped=0, step_ids=[], versions=[])
    slow_s = cfg["slow"].get(ENGINE["rank"], 0.0)
    try:
        state = {}
        state["theta"], state["versions"] = conn.init(theta0) if w == 0 else conn.pull()

        def pull():
            return state["theta"], state["versions"]

        def push(grad_sum, count, versions):
            if cfg["delay"]:
                time.sleep(delay_rng.exponential(cfg["delay"]))
            if slow_s:
                time.sleep(slow_s)  # a straggler: this worker's step takes longer
            state["theta"], state["versions"], rejected = conn.push(grad_sum, count, versions)
            log["rejected"] += rejected
            log["dropped"] += conn.dropped

        # "times" count from t0; the server's restarts use the same clock: CLOCK_MONOTONIC is
        # one clock for every process of a machine, and never stepped as the wall clock can be
        t0 = log["t0"] = time.monotonic()
        per_epoch = -(-len(X) // cfg["batch_size"])
        total, epoch, order = cfg["num_epochs"] * per_epoch, -1, None
        step = state["versions"][0] if cfg["backup_workers"] else 0  # a late starter skips
        while step < total:  # global steps; with backup workers a late worker skips ahead
            while epoch < step // per_epoch:
                order, epoch = rng.permutation(len(X)), epoch + 1
            start = (step % per_epoch) * cfg["batch_size"]
            batch = order[start:start + cfg["batch_size"]]
            a, b = shard_bounds(len(batch), w, num_workers)
            if log["steps"] == cfg["crash_after"].get(ENGINE["rank"], -1):
                os._exit(1)  # this worker's process dies, mid-training
            if log["steps"] == cfg["stop_after"].get(ENGINE["rank"], -1):
                conn.close(linger=0)  # this worker goes silent, as a crashed one would
                return dict(log, stopped=True, bytes=conn.bytes)
            loss = worker_step(problem, pull, push, X[batch[a:b]], y[batch[a:b]])
            log["loss_sums"].append(float(loss))
            log["counts"].append(b - a)
            log["times"].append(time.monotonic() - t0)
            log["step_ids"].append(step)
            log["versions"].append(state["versions"][0])  # server 0's, after this push
            log["steps"] += 1
            step = state["versions"][0] if cfg["backup_workers"] else step + 1
        conn.done()
        return dict(log, stopped=False, bytes=conn.bytes, theta=state["theta"],
                    resent=conn.resent)
    finally:
        conn.close()


def run_role(spec, addresses, problem, X, y, theta0, cfg):
    """Runs on every rank (``cluster.run``): serve, work, or stay idle, as ``spec`` says.

    Introduced in notebooks/04_parameter_server.ipynb."""
    role = role_of(spec, ENGINE["rank"])
    if role == "ps" and cfg["server_restarts"]:
        return dict(serve_restarting(spec, len(theta0), cfg, apply_push), role="ps")
    if role == "ps":
        faults.arm_once(cfg["faults"], cfg["checkpoint_dir"], ENGINE["rank"])
        try:
            return dict(serve(spec, len(theta0), cfg, apply_push), role="ps")
        finally:
            faults.disarm()
    if role == "worker":
        return dict(_worker(spec, addresses, problem, X, y, theta0, cfg), role="worker")
    return {"role": "idle"}


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
    def staleness(self):
        return np.concatenate([np.asarray(s["staleness"], int) for s in self.servers])

    def staleness_histogram(self):
        """Counts of applied gradients by staleness 0, 1, 2, ... (all servers together)."""
        return np.bincount(self.staleness) if len(self.staleness) else np.zeros(1, int)

    @property
    def pushes(self):
        return sum(s["pushes"] for s in self.servers)

    @property
    def pushes_per_s(self):
        """Worker pushes (one per worker step, counted once, not per server) per second."""
        return sum(w["steps"] for w in self.workers) / self.elapsed

    @property
    def step_rate(self):
        """Sync steps per second between the first and the last step the servers applied."""
        ends = self.servers[0]["step_ends"]
        return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else float("nan")

    @property
    def lost_workers(self):
        return sorted({w for s in self.servers for w in s["lost"]})

    def bytes_per_server(self):
        return [s["bytes_in"] + s["bytes_out"] for s in self.servers]


def train(cluster, spec, problem, X, y, theta0, lr, num_epochs=1, batch_size=32, mode="sync",
          staleness_aware=False, max_staleness=None, seed=0, timeout=10.0, time_limit=120.0,
          delay=0.0, stop_after=None, crash_after=None, host="127.0.0.1", backup_workers=0,
          slow=None, checkpoint_dir=None, checkpoint_every=20, server_restarts=0, faults=()):
    """Train ``problem`` on (X, y) with the servers and workers of ``spec`` on ``cluster``.

    ``mode`` 'sync' (equal to ``gd.minibatch_sgd`` with the same seed and global ``batch_size``)
    or 'async'. ``delay``: mean of a random sleep (s) before each push, to make staleness.
    ``stop_after={rank: steps}`` makes a worker go silent after that many steps;
    ``crash_after={rank: steps}`` makes its process exit. In async mode the others go on and the
    lost worker is reported; in sync mode the step fails with an error naming it.
    ``slow={rank: seconds}`` adds that sleep to every step of those workers (stragglers).
    ``backup_workers=b`` (sync, one server; notebook 07): each step averages the first
    N - b gradients; late ones are dropped (``servers[0]["dropped"]``, ``["used"]``) and a
    late worker goes on with the server's current step. Every wait has a deadline of
    ``timeout`` s; the whole run ``time_limit`` s.
    ``checkpoint_dir``: each server checkpoints its shard there (``server-{s}/``) at init,
    every ``checkpoint_every`` updates and when a worker finishes. ``server_restarts=r``
    (async; notebook 11): a server that is killed is started again, at most r times, on the
    same address, from its last checkpoint; the workers resend what went unanswered.
    ``faults``: fault points armed on the servers (``"ps-server-update:kill@60"``: a server
    dies after its 60th update), each firing once per ``checkpoint_dir``.
    Introduced in notebooks/04_parameter_server.ipynb.
    """
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', not {mode!r}")
    if not isinstance(backup_workers, (int, np.integer)) or backup_workers < 0:
        raise ValueError(f"backup_workers must be an integer >= 0, got {backup_workers!r}")
    if backup_workers and (mode != "sync" or len(spec["ps"]) != 1
                           or backup_workers >= len(spec["worker"])):
        raise ValueError(f"backup_workers={backup_workers} needs mode='sync', one server (each "
                         f"shard would pick its own first gradients) and more workers than "
                         f"backups; got mode={mode!r}, spec {spec}")
    if set(spec["ps"]) & set(spec["worker"]) or max(spec["ps"] + spec["worker"]) >= cluster.n:
        raise ValueError(f"spec {spec} needs distinct ranks below {cluster.n}")
    if server_restarts and (mode != "async" or checkpoint_dir is None):
        raise ValueError(f"server_restarts={server_restarts} needs mode='async' (a sync step "
                         f"waits for every worker) and a checkpoint_dir to restart from; got "
                         f"mode={mode!r}, checkpoint_dir={checkpoint_dir!r}")
    if faults and checkpoint_dir is None:
        raise ValueError("faults= need a checkpoint_dir= (where each one records that it fired)")
    if checkpoint_dir is not None:
        checkpoint_dir = os.path.abspath(checkpoint_dir)
        old = sorted(p for p in os.listdir(checkpoint_dir) if p.startswith("server-")) \
            if os.path.isdir(checkpoint_dir) else []
        if old:
            raise ValueError(f"{checkpoint_dir} holds the servers' checkpoints of another run "
                             f"({', '.join(old)}): a restarted server would resume from them; "
                             "pass a new directory")
        os.makedirs(checkpoint_dir, exist_ok=True)
    cfg = dict(mode=mode, lr=lr, num_epochs=num_epochs, batch_size=batch_size, seed=seed,
               staleness_aware=staleness_aware, max_staleness=max_staleness, timeout=timeout,
               time_limit=time_limit, delay=delay, stop_after=dict(stop_after or {}),
               crash_after=dict(crash_after or {}), backup_workers=int(backup_workers),
               slow={int(r): float(s) for r, s in (slow or {}).items()},
               checkpoint_dir=checkpoint_dir, checkpoint_every=int(checkpoint_every),
               server_restarts=int(server_restarts), faults=tuple(faults),
               retry=0.5 if server_restarts else None)  # a worker's first wait for a reply
    bound = cluster.run(bind_server, spec, host)  # in rank order; None on non-servers
    # server s of the spec (``spec["ps"][s]``) holds shard s: its address goes to place s
    addresses = [bound[r] for r in spec["ps"]]
    t0 = time.perf_counter()
    results = cluster.run(run_role, spec, addresses, problem, X, y,
                          np.asarray(theta0, np.float64), cfg, timeout=time_limit + 30,
                          allow_dead=mode == "async")
    results = [{"role": "worker", "died": True, "steps": 0} if isinstance(r, Exception) else r
               for r in results]  # async: a worker whose process died
    elapsed = time.perf_counter() - t0
    servers = sorted((r for r in results if r["role"] == "ps"),  # shard order = spec order
                     key=lambda r: spec["ps"].index(r["server"]))
    workers = [r for r in results if r["role"] == "worker"]
    theta = np.concatenate([s["theta"] for s in servers])
    return PSResult(theta, servers, workers, mode, elapsed)


# ---------------------------------------------------------------- in one process, for plots
def simulate_async(problem, X, y, theta0, lr, num_workers, num_updates, batch_size=32,
                   staleness_aware=False, seed=0):
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
