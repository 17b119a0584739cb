"""Hogwild!: asynchronous SGD on parameters in shared memory, without a lock and with one.

Introduced in notebooks/03_hogwild.ipynb (Niu, Recht, Re and Wright, NIPS 2011). Worker
processes (forked from a server, :func:`launch.worker_context`) share one parameter vector;
each takes one sample at a time from its own shard, reads the parameters, computes the
gradient and subtracts it in place. Nobody waits::

    from course_lib import hogwild, sparse_problem
    data = sparse_problem.make_sparse_classification()      # RCV1-like density: 0.16 %
    hogwild.run_sparse(data, num_workers=2)                  # lock-free
    hogwild.run_sparse(data, num_workers=2, lock=True)       # the locked twin
    hogwild.run_dense(num_workers=2)     # an MLP on digits: every update collides

A **conflict** is a coordinate that another worker wrote between this worker's read of it and
its own write. Each coordinate (each tensor, for the MLP, whose coordinates are all written at
once) has a write counter in shared memory: a worker reads the counters with the parameters and
compares them just before writing. The counters are bumped without a lock, so they can
themselves lose a bump now and then: the counts are a lower bound. Every wait has a deadline; a
worker that dies is named in a :class:`HogwildError` within a fraction of a second, and no
process outlives the call.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from course_lib.data import load_digits
from course_lib.models import mlp
from course_lib.race import RaceError
from course_lib.runtime.arguments import check_count
from course_lib.runtime.launch import supervise, worker_context
from course_lib.sharding import shard_bounds
from course_lib.sparse_problem import SparseData, sparse_loss

# torch (seconds to import) is imported only inside the functions of the dense problem: a
# worker forked from launch.worker_context's server finds it imported; a spawned one
# (COURSE_LIB_WARM=0) then starts the sparse problem without it.


class HogwildError(RaceError):
    """A worker died or missed its deadline; the message names it and its exit code.

    Introduced in notebooks/03_hogwild.ipynb."""


@dataclass
class HogwildResult:
    """One run: throughput, loss per epoch (index 0 = start), conflicts, per-worker progress.

    Introduced in notebooks/03_hogwild.ipynb."""

    problem: str
    num_workers: int
    lock: bool
    seconds: float                 # slowest worker, from the common start to its last update
    worker_samples: list[int]
    worker_seconds: list[float]
    losses: list[float]
    conflicts: int                 # coordinates written by another worker between read and write
    conflicted_updates: int        # updates with at least one such coordinate
    params: np.ndarray = field(repr=False)

    @property
    def samples(self) -> int:
        return int(sum(self.worker_samples))

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def conflict_rate(self) -> float:
        """Fraction of updates that collided with another worker's write."""
        return self.conflicted_updates / max(self.samples, 1)

    @property
    def final_loss(self) -> float:
        return self.losses[-1]


# ---------------------------------------------------------------- the worker loop
def _sparse_loop(w, counts, rows, y, order, lr, lock):
    """:func:`sparse_problem.sparse_sgd_epoch` with conflict counting (and an optional lock
    around each step)."""
    conflicts = conflicted = 0
    for i in order:
        idx, v = rows[i]
        if lock is not None:
            lock.acquire()
        seen = counts[idx]                               # write counters at read time
        yi = y[i]
        margin = float(w[idx] @ v)                       # read
        # d/dmargin of log(1 + exp(-y margin)); min(): exp(710) would overflow a float
        scale = -yi / (1.0 + math.exp(min(yi * margin, 700.0)))
        changed = np.count_nonzero(counts[idx] != seen)  # written by someone else since the read
        w[idx] -= (lr * scale) * v                       # write
        counts[idx] += 1
        if lock is not None:
            lock.release()
        if changed:
            conflicts += changed
            conflicted += 1
    return conflicts, conflicted


# ---------------------------------------------------------------- the workers
def _share(ctx, arr):
    """A copy of ``arr`` in shared memory, as (raw buffer, dtype, shape): cheap to send to a
    spawned worker (big arguments pickled into a dying child's pipe can block the parent)."""
    arr = np.ascontiguousarray(arr)
    raw = ctx.RawArray("b", max(arr.nbytes, 1))
    np.frombuffer(raw, dtype=arr.dtype, count=arr.size)[:] = arr.ravel()
    return raw, arr.dtype.str, arr.shape


def _view(shared):
    raw, dtype, shape = shared
    return np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


def _worker(problem, wid, spec, shared, lock, barrier, num_epochs, fail):
    """One Hogwild worker: wait for the start, run its epochs, report its own timings."""
    if fail:
        os._exit(fail)  # a crash, for the tests: the parent must name this worker
    w, counts, snaps = _view(shared["w"]), _view(shared["counts"]), _view(shared["snaps"])
    stats = _view(shared["stats"])  # per worker: samples, seconds, conflicts, conflicted
    step = _sparse_setup(spec, shared) if problem == "sparse" else _dense_setup(spec, shared, w)
    rng = np.random.default_rng([spec["seed"], wid])  # worker 0's order is serial_sgd's
    shard = spec["stop"] - spec["start"]
    barrier.wait(timeout=60)  # everybody imported and set up: start together
    began = time.perf_counter()
    for epoch in range(num_epochs):
        c, u = step(w, counts, rng, lock)
        stats[wid, 0] += shard  # a row per worker, written by it alone: no race on the stats
        stats[wid, 2] += c
        stats[wid, 3] += u
        barrier.wait(timeout=60)  # end of the epoch: worker 0 keeps a copy for the loss curve
        if wid == 0:
            snaps[epoch] = w
    stats[wid, 1] = time.perf_counter() - began


def _sparse_setup(spec, shared):
    indptr, indices, values = (_view(shared[k]) for k in ("indptr", "indices", "values"))
    start, stop = spec["start"], spec["stop"]
    rows = [(indices[indptr[i]:indptr[i + 1]], values[indptr[i]:indptr[i + 1]])
            for i in range(start, stop)]   # CSR rows split once: no slicing per sample
    y, lr, n = _view(shared["y"])[start:stop].tolist(), spec["lr"], stop - start

    def step(w, counts, rng, lock):
        return _sparse_loop(w, counts, rows, y, rng.permutation(n), lr, lock)
    return step


def _dense_setup(spec, shared, w):
    import torch  # here, not at the top: see the note on the imports
    torch.set_num_threads(1)  # one thread per worker: the workers are the parallelism
    X = torch.from_numpy(_view(shared["X"])[spec["start"]:spec["stop"]])
    y = torch.from_numpy(_view(shared["y"])[spec["start"]:spec["stop"]])
    model = mlp(X.shape[1], spec["hidden"], 10, seed=spec["seed"])
    flat = torch.from_numpy(w)
    offset, sizes = 0, []
    for p in model.parameters():   # every parameter becomes a view of the shared vector
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        sizes.append(p.numel())
    lr, batch_size, params = spec["lr"], spec["batch_size"], list(model.parameters())

    def step(w, counts, rng, lock):
        conflicts = conflicted = 0
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), batch_size):
            idx = order[start:start + batch_size]
            if lock is not None:
                lock.acquire()
            seen = counts.copy()  # a copy: counts is shared memory, other workers bump it
            loss = torch.nn.functional.cross_entropy(model(X[idx]), y[idx])   # read
            grads = torch.autograd.grad(loss, params)
            changed = [k for k in range(len(params)) if counts[k] != seen[k]]
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.sub_(g, alpha=lr)                                        # write
            counts += 1
            if lock is not None:
                lock.release()
            if changed:
                conflicts += sum(sizes[k] for k in changed)
                conflicted += 1
        return conflicts, conflicted
    return step


def _run(problem, spec, arrays, w0, n_counters, num_workers, lock, num_epochs, timeout,
         fail_worker):
    ctx = worker_context()  # forked from a server that imported numpy and torch once
    shared = {k: _share(ctx, a) for k, a in arrays.items()}
    shared["w"] = _share(ctx, w0)
    shared["counts"] = _share(ctx, np.zeros(n_counters, dtype=np.int64))
    shared["snaps"] = _share(ctx, np.zeros((num_epochs, w0.size), dtype=w0.dtype))
    shared["stats"] = _share(ctx, np.zeros((num_workers, 4)))
    barrier = ctx.Barrier(num_workers)
    the_lock = ctx.Lock() if lock else None
    n, procs = len(arrays["y"]), []
    for wid in range(num_workers):
        start, stop = shard_bounds(n, wid, num_workers)
        procs.append(ctx.Process(target=_worker, daemon=True, name=f"hogwild-worker-{wid}",
                                 args=(problem, wid, dict(spec, start=start, stop=stop), shared,
                                       the_lock, barrier, num_epochs,
                                       3 if wid == fail_worker else 0)))
    supervise(procs, timeout, f"{problem} Hogwild ({'locked' if lock else 'lock-free'}, "
                              f"{num_workers} workers)", HogwildError, barrier)
    return _view(shared["stats"]).copy(), _view(shared["snaps"]).copy(), _view(shared["w"]).copy()


def _result(problem, num_workers, lock, stats, losses, params):
    return HogwildResult(problem, num_workers, lock, float(stats[:, 1].max()),
                         [int(s) for s in stats[:, 0]], [float(s) for s in stats[:, 1]],
                         losses, int(stats[:, 2].sum()), int(stats[:, 3].sum()), params)


def run_sparse(data: SparseData, num_workers: int = 2, lock: bool = False, lr: float = 0.5,
               num_epochs: int = 3, seed: int = 0, timeout: float = 60.0,
               fail_worker: int | None = None) -> HogwildResult:
    """Hogwild (``lock=False``) or its locked twin on sparse logistic regression.

    Worker ``k`` takes shard ``k`` of the rows (``sharding.shard_bounds``) and visits it in the
    order of ``np.random.default_rng([seed, k])``, one permutation per epoch; so one worker
    repeats :func:`sparse_problem.serial_sgd` exactly. Returns a :class:`HogwildResult`.
    Notebook 03. Introduced in notebooks/03_hogwild.ipynb.
    """
    check_count("num_workers", num_workers)
    check_count("num_epochs", num_epochs)
    arrays = {"indptr": data.indptr, "indices": data.indices, "values": data.values, "y": data.y}
    stats, snaps, w = _run("sparse", {"lr": lr, "seed": seed}, arrays, np.zeros(data.n_features),
                           data.n_features, num_workers, lock, num_epochs, timeout, fail_worker)
    losses = [sparse_loss(np.zeros(data.n_features), data)] + [sparse_loss(s, data)
                                                               for s in snaps]
    return _result("sparse", num_workers, lock, stats, losses, w)


def run_dense(num_workers: int = 2, lock: bool = False, hidden: int = 32, lr: float = 0.02,
              batch_size: int = 1, num_epochs: int = 2, seed: int = 0, timeout: float = 120.0,
              fail_worker: int | None = None) -> HogwildResult:
    """Hogwild on an MLP (``models.mlp``) classifying digits: every update writes every weight,
    so concurrent updates always collide. Loss = mean cross-entropy on the training set.
    Introduced in notebooks/03_hogwild.ipynb."""
    check_count("num_workers", num_workers)
    check_count("num_epochs", num_epochs)
    import torch  # here, not at the top: see the note on the imports
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    X, y, _, _ = load_digits(seed=seed)
    model = mlp(X.shape[1], hidden, 10, seed=seed)
    w0 = parameters_to_vector(model.parameters()).detach().numpy().astype(np.float32)
    spec = {"hidden": hidden, "lr": lr, "seed": seed, "batch_size": batch_size}
    arrays = {"X": X.astype(np.float32), "y": y}
    n_tensors = len(list(model.parameters()))
    stats, snaps, w = _run("dense", spec, arrays, w0, n_tensors, num_workers, lock, num_epochs,
                           timeout, fail_worker)
    Xt, yt, losses = torch.from_numpy(X).float(), torch.from_numpy(y), []
    for vec in [w0, *snaps]:
        vector_to_parameters(torch.from_numpy(vec.copy()), model.parameters())
        with torch.no_grad():
            losses.append(float(torch.nn.functional.cross_entropy(model(Xt), yt)))
    return _result("dense", num_workers, lock, stats, losses, w)
