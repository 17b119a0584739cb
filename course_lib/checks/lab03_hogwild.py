"""Lab 03 (Hogwild!) checks: the lock-free loop, the worker process on shared memory, and the
collision probability.

Use in labs/03_hogwild.ipynb right under each exercise::

    from course_lib.checks import lab03_hogwild as checks
    checks.check_lockfree_epoch(lockfree_epoch)
    checks.check_hogwild_worker(hogwild_worker)
    checks.check_collision_probability(collision_probability)
    w = checks.run_workers(hogwild_worker, data, world_size=2)   # the student's workers, for real

The loop runs here, in this process, on seeded sparse data, against
``course_lib.sparse_problem.sparse_sgd_epoch``: with one worker Hogwild is plain SGD, so the
values must match exactly. The parameter vector it gets records which coordinates were written;
a loop that writes a coordinate its samples do not touch (a dense update, or a copy of all the
parameters written back) would, with other workers running, erase their updates, and fails.

The worker runs in real processes (``launch.worker_context``: forked from a warm server, or
spawned with ``COURSE_LIB_WARM=0``), sent there with cloudpickle. :func:`run_workers` creates
the parameter vector in a named ``SharedMemory`` block, puts the data in shared memory too, and
``launch.supervise`` watches the workers with a deadline: a worker that raises, dies or never
returns comes back as a hint naming it, never a hang. The cases: one worker (serial SGD, exactly);
each worker of two alone, on data whose two shards touch disjoint features, so what one worker
writes is known exactly and a wrong shard, order, step or number of epochs is decoded by
replaying the usual mistakes here; then both workers at once on the same data, where every
coordinate still has a single writer, so the result is exact again and an update that the other
worker erased shows up.
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

from course_lib.checks.framework import (
    Case,
    CheckFailed,
    compare,
    not_implemented,
    pack_function,
    run_check,
)
from course_lib.runtime.launch import supervise, worker_context
from course_lib.sharding import shard_bounds
from course_lib.sparse_problem import (
    SparseData,
    collision_probability,
    make_sparse_classification,
    serial_sgd,
    sparse_loss,
    sparse_sgd_epoch,
)


# ---------------------------------------------------------------- exercise 1: the loop
class _WriteLog(np.ndarray):
    """A float vector that records in ``written`` which of its coordinates were assigned.

    Tracks ``w[key] = ...`` (and so ``w[idx] -= ...``), in-place ufuncs (``w -= g``,
    ``np.subtract(..., out=w)``, ``np.add.at(w, idx, ...)``) and ``np.copyto(w, ...)``.
    Copies and views do not carry the log: writing into a private copy is not a shared write.
    """

    def __new__(cls, values):
        obj = np.array(values, dtype=np.float64).view(cls)
        obj.written = np.zeros(obj.shape, dtype=bool)
        return obj

    def __array_finalize__(self, obj):
        self.written = None

    def _mark(self, key=Ellipsis):
        if getattr(self, "written", None) is not None:
            self.written[key] = True

    def __setitem__(self, key, value):
        self._mark(key)
        np.asarray(self)[key] = np.asarray(value) if isinstance(value, _WriteLog) else value

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if method == "at" and isinstance(inputs[0], _WriteLog):
            inputs[0]._mark(inputs[1])
        plain = tuple(np.asarray(x) if isinstance(x, _WriteLog) else x for x in inputs)
        if out is not None:
            for o in out:
                if isinstance(o, _WriteLog):
                    o._mark()
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, _WriteLog) else o for o in out)
        return getattr(ufunc, method)(*plain, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.copyto and args and isinstance(args[0], _WriteLog):
            args[0]._mark()
        args = tuple(np.asarray(a) if isinstance(a, _WriteLog) else a for a in args)
        return func(*args, **kwargs)


def _epoch_cases(seed):
    shapes = [(60, 600, 6, 0.5), (40, 400, 3, 1.0), (80, 1000, 10, 0.2)]  # n, d, nnz, lr
    cases = []
    for k, (n, d, nnz, lr) in enumerate(shapes):
        data = make_sparse_classification(n, d, nnz, seed=seed + k)
        rng = np.random.default_rng(seed + 100 + k)
        w0 = 0.1 * rng.normal(size=d)
        order = rng.permutation(n)[: 3 * n // 4]  # some rows never visited

        def args(data=data, w0=w0, order=order, lr=lr):
            return (w0.copy(), data.indptr.copy(), data.indices.copy(), data.values.copy(),
                    data.y.copy(), order.copy(), lr)

        cases.append(Case(f"{n} rows, {d} features, {nnz} non-zeros per row, lr={lr}", args))
    return cases


# The usual mistakes of the loop, replayed on a case: (mistake, what the loop did). Those that
# visit other rows than ``order`` write coordinates the rows of ``order`` do not touch.
EPOCH_ROW_MISTAKES = [
    ("range", "your loop visited rows 0, 1, ..., len(order) - 1, not the rows listed in order "
     "(order holds row numbers: it is what to iterate over)."),
    ("all rows", "your loop visited every row of the data, not the rows listed in order."),
    ("slice + 1", "your loop read one entry past each row, the first feature of row i + 1 "
     "too: row i ends where row i + 1 begins."),
]
EPOCH_MISTAKES = [
    ("lr 1", "you step as if lr were 1: the learning rate is missing from the update."),
    ("uphill", "your steps go uphill (the loss grows): the sign of g, or of the update, is "
     "flipped."),
    ("exp sign", "your g has the wrong sign inside the exponential: with it, rows the model "
     "already gets right (y m large) get the largest steps, and rows it gets wrong the "
     "smallest."),
    ("no y", "your g leaves y out of the numerator: every row then pushes the margin up, "
     "whatever its label."),
    ("0/1 labels", "your g is the gradient for labels 0 and 1 (sigmoid(m) - y): here the labels "
     "are -1 and +1, and the loss is log(1 + exp(-y m))."),
    ("no v", "your update leaves out the row's values: the gradient of the margin x.w in w_j "
     "is x_j, so each feature's step is scaled by its value."),
    ("margins first", "your loop read every row's margin before any update: SGD updates w after "
     "each row, and the next row reads the updated w."),
    ("mean", "your steps are divided by the number of rows in order: each row's step is its "
     "own gradient times lr, not an average over the epoch."),
]


def _epoch_variant(w, indptr, indices, values, y, order, lr, mistake):
    """One epoch of the loop as written with ``mistake`` (see EPOCH_MISTAKES), on ``w``."""
    rows = {"range": range(len(order)), "all rows": range(len(y))}.get(mistake, order)
    extra = 1 if mistake == "slice + 1" else 0
    step = {"lr 1": 1.0, "uphill": -lr, "mean": lr / max(len(order), 1)}.get(mistake, lr)
    later = []
    for i in rows:
        a, b = indptr[i], min(indptr[i + 1] + extra, len(indices))
        idx, v = indices[a:b], values[a:b]
        yi, m = y[i], float(w[idx] @ v)
        g = {"exp sign": -yi / (1 + math.exp(min(-yi * m, 700.0))),
             "no y": -1 / (1 + math.exp(min(yi * m, 700.0))),
             "0/1 labels": 1 / (1 + math.exp(min(-m, 700.0))) - yi,
             }.get(mistake, -yi / (1 + math.exp(min(yi * m, 700.0))))
        update = step * g * (1.0 if mistake == "no v" else v)
        if mistake == "margins first":
            later.append((idx, update))
        else:
            w[idx] -= update
    for idx, update in later:
        w[idx] -= update
    return w


def _replays(mistakes, w0, got, args):
    """The text of the first mistake whose replay from ``w0`` gives ``got``, else None."""
    for mistake, text in mistakes:
        with np.errstate(all="ignore"):
            try:
                replay = _epoch_variant(w0.copy(), *args, mistake)
            except (IndexError, OverflowError, ValueError):
                continue
        if np.allclose(got, replay, rtol=1e-8, atol=1e-12):
            return text
    return None


def _student_epoch(student_fn):
    def run(w, indptr, indices, values, y, order, lr):
        shared = _WriteLog(w)
        touched = np.zeros(w.shape, dtype=bool)
        for i in order:
            touched[indices[indptr[i]:indptr[i + 1]]] = True
        student_fn(shared, indptr, indices, values, y, order, lr)
        extra = np.flatnonzero(shared.written & ~touched)
        if extra.size:
            rows = _replays(EPOCH_ROW_MISTAKES, w, np.asarray(shared),
                            (indptr, indices, values, y, order, lr))
            if rows:
                raise CheckFailed(f"your loop wrote {extra.size} coordinates that none of the "
                                  f"rows in order touches (for example w[{extra[0]}]): {rows}")
            raise CheckFailed(
                f"your loop wrote {extra.size} coordinates that none of its samples touches "
                f"(for example w[{extra[0]}]), out of {w.size}. Another worker may have "
                "updated them since you read them: writing them back erases its update.")
        return np.asarray(shared).copy()
    return run


def check_lockfree_epoch(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 03, exercise 1: ``student_fn(w, indptr, indices, values, y, order, lr)`` updates
    ``w`` in place, one sample at a time in ``order``, writing only the touched coordinates.

    Must equal ``sparse_problem.sparse_sgd_epoch`` (one worker = serial SGD) on 3 seeded cases,
    write no coordinate outside the rows it visits, and lower the loss.
    """
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = _epoch_cases(seed)

    def diagnose(expected, got):
        w0, *rest = cases_args[0]
        got = np.asarray(got, dtype=float)
        if np.allclose(got, w0):
            return ("w did not change: update the caller's w in place, not a copy of it (a "
                    "new array made inside the loop is not the caller's).")
        return _replays(EPOCH_MISTAKES, w0, got, rest)

    cases_args = []

    def reference(*args):
        cases_args[:] = [(args[0].copy(), *args[1:])]
        return sparse_sgd_epoch(*args)

    ok = run_check(
        "check_lockfree_epoch", _student_epoch(student_fn), reference, cases, diagnose=diagnose,
        rtol=1e-10, atol=1e-12, result_name="w after the epoch",
        hint="go through the three steps above the exercise for each row of order: the row's "
             "features and values, its margin and g from the current w, then the update of "
             "those features alone.")
    if ok:
        data = make_sparse_classification(400, 2000, 8, seed=seed + 7)
        w = np.zeros(data.n_features)
        before = sparse_loss(w, data)
        for _ in range(3):
            student_fn(w, data.indptr, data.indices, data.values, data.y,
                       np.arange(len(data)), 0.5)
        after = sparse_loss(w, data)
        if not after < before:
            raise CheckFailed(f"check_lockfree_epoch: 3 epochs did not lower the loss "
                              f"({before:.4f} -> {after:.4f}).\nHint: each sample's step "
                              "must go DOWN its gradient.")
        print(f"  and 3 epochs lower the loss from {before:.4f} to {after:.4f}")
    return ok


# ---------------------------------------------------------------- exercise 2: the worker process
WORKER_TIMEOUT = 20.0  # seconds a launch of the student's workers may take, start-up included
DATA_FIELDS = ("indptr", "indices", "values", "y")


class WorkerFailed(RuntimeError):
    """A worker process raised, died, missed its deadline or unlinked the parameters' block.

    ``kind`` is "raised", "died", "late" or "unlinked"; ``ranks`` the workers concerned;
    ``error`` the exception a worker raised (``"TypeError: ..."``), with ``lines`` the student's
    own lines that led to it."""

    def __init__(self, message: str, kind: str = "died", ranks: list[int] | None = None,
                 error: str = "", lines: list[str] | None = None):
        super().__init__(message)  # (``launch.supervise`` raises it with the message alone)
        self.kind, self.ranks, self.error, self.lines = kind, ranks or [], error, lines or []


def _share_array(arr):
    """A copy of ``arr`` in a new named SharedMemory block: (block, (name, dtype, shape))."""
    arr = np.ascontiguousarray(arr)
    block = shared_memory.SharedMemory(create=True, size=max(arr.nbytes, 1))
    np.ndarray(arr.shape, arr.dtype, buffer=block.buf)[...] = arr  # a temporary view
    return block, (block.name, arr.dtype.str, arr.shape)


def _student_frames(tb):
    """(file, line, function) of the traceback's frames outside the library and Python itself:
    the student's code, which the parent (holding the notebook's cells) can print."""
    library = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [(f.f_code.co_filename, line, f.f_code.co_name) for f, line in traceback.walk_tb(tb)
            if not f.f_code.co_filename.startswith((library, sys.prefix, sys.base_prefix))]


def _worker_main(payload, rank, world_size, shm_name, spec, lr, num_epochs, seed, errors,
                 barrier):
    """In the worker process: the data as read-only views of shared memory, then the student's
    ``worker(rank, world_size, shm_name, data, lr, num_epochs, seed)``; an exception is sent to
    the parent (``errors``) and ends the process with code 1."""
    import cloudpickle  # here: only the workers unpickle
    blocks = [shared_memory.SharedMemory(name=spec[k][0]) for k in DATA_FIELDS]
    views = []
    for block, k in zip(blocks, DATA_FIELDS, strict=True):
        views.append(np.ndarray(spec[k][2], spec[k][1], buffer=block.buf))
        views[-1].flags.writeable = False  # the data is read-only for the workers
    data = SparseData(*views, spec["n_features"])
    try:
        worker = cloudpickle.loads(payload)
    except Exception as err:  # noqa: BLE001 - e.g. a module of the student's that is not here
        errors.put((rank, f"{type(err).__name__} while your function was loaded in the "
                          f"worker process: {err}", []))
        sys.exit(1)
    try:
        barrier.wait(timeout=WORKER_TIMEOUT)  # every worker set up: start together
    except threading.BrokenBarrierError:  # another worker failed first: it is the one named
        sys.exit(2)
    try:
        worker(rank, world_size, shm_name, data, lr, num_epochs, seed)
    except BaseException as err:  # noqa: BLE001 - anything the student's code raises
        errors.put((rank, f"{type(err).__name__}: {err}", _student_frames(err.__traceback__)))
        sys.exit(1)
    finally:
        del data, views
        for block in blocks:
            with contextlib.suppress(BufferError):  # a view the student kept: exit unmaps it
                block.close()


def _exists(name):
    """Whether a SharedMemory block of this name can still be attached."""
    try:
        block = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    block.close()
    return True


def _failure(err, procs, ranks, errors, timeout):
    """The WorkerFailed for a launch that ``supervise`` stopped: who raised, died or ran late."""
    raised = {}
    while not errors.empty():
        rank, text, frames = errors.get()
        raised[rank] = (text, [f"  {file}, line {line}, in {name}\n"
                               f"    {linecache.getline(file, line).strip()}"
                               for file, line, name in frames])
    if raised:
        rank = min(raised)
        text, lines = raised[rank]
        return WorkerFailed(f"worker {rank} raised {text}", "raised", sorted(raised), text, lines)
    if "still running" in str(err):
        late = [r for r, p in zip(ranks, procs, strict=True) if p.exitcode == -signal.SIGKILL]
        return WorkerFailed(f"worker(s) {late} did not return within {timeout:g} s and were "
                            "killed", "late", late)
    dead = [(r, p) for r, p in zip(ranks, procs, strict=True) if p.exitcode not in (0, None)]
    return WorkerFailed("; ".join(f"worker {r} (pid {p.pid}) exited with code {p.exitcode}"
                                  for r, p in dead), "died", [r for r, _ in dead])


def run_workers(worker: Callable, data: SparseData, world_size: int = 2, lr: float = 0.5,
                num_epochs: int = 3, seed: int = 0, ranks: list[int] | None = None,
                w0: np.ndarray | None = None, timeout: float = WORKER_TIMEOUT) -> np.ndarray:
    """Run ``worker(rank, world_size, shm_name, data, lr, num_epochs, seed)`` in one process per
    rank (all of ``range(world_size)``, or only ``ranks``) on one parameter vector of float64 in
    the SharedMemory block named ``shm_name`` (``w0``, zeros by default); return its final value.

    The data reaches the workers through shared memory as well (read-only views). The workers
    start together (a barrier); past ``timeout`` seconds, or when one raises or dies, every
    worker is killed and a :class:`WorkerFailed` names it, with the exception it raised. A
    worker must not unlink the block: the parent reads it afterwards (WorkerFailed "unlinked").
    Every block is unlinked here at the end. Lab 03, exercise 2 (labs/03_hogwild.ipynb).
    """
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    w0 = np.zeros(data.n_features) if w0 is None else np.asarray(w0, dtype=np.float64)
    payload = pack_function(worker)
    ctx = worker_context()  # forked from a warm server (or spawned with COURSE_LIB_WARM=0)
    blocks = []
    try:
        params, _ = _share_array(w0)
        blocks.append(params)
        spec = {"n_features": data.n_features}
        for k in DATA_FIELDS:
            block, spec[k] = _share_array(getattr(data, k))
            blocks.append(block)
        errors, barrier = ctx.SimpleQueue(), ctx.Barrier(len(ranks))
        procs = [ctx.Process(target=_worker_main, name=f"hogwild-worker-{rank}", daemon=True,
                             args=(payload, rank, world_size, params.name, spec, lr, num_epochs,
                                   seed, errors, barrier))
                 for rank in ranks]
        try:
            supervise(procs, timeout, f"hogwild_worker on {len(ranks)} process(es)",
                      WorkerFailed, barrier)
        except WorkerFailed as err:
            raise _failure(err, procs, ranks, errors, timeout) from None
        if not _exists(params.name):
            raise WorkerFailed(
                f"after worker(s) {ranks} ended, the parameters' block {params.name!r} was gone: "
                "SharedMemory(name=...) in the parent raised FileNotFoundError", "unlinked", ranks)
        return np.ndarray(w0.shape, np.float64, buffer=params.buf).copy()
    finally:
        for block in blocks:
            block.close()
            with contextlib.suppress(FileNotFoundError):  # a worker unlinked it already
                block.unlink()


def _disjoint_shards(seed, rows=(2501, 2500), features=(300, 300), nnz=5):
    """Data whose two shards (``shard_bounds(n, r, 2)``) touch disjoint features: shard 0 rows
    the first ``features[0]``, shard 1 rows the rest. Each feature then has one writer."""
    parts = [make_sparse_classification(n, d, nnz, seed=seed + k)
             for k, (n, d) in enumerate(zip(rows, features, strict=True))]
    indices = np.concatenate([parts[0].indices, parts[1].indices + features[0]])
    indptr = np.concatenate([parts[0].indptr, parts[1].indptr[1:] + parts[0].indptr[-1]])
    return SparseData(indptr, indices, np.concatenate([p.values for p in parts]),
                      np.concatenate([p.y for p in parts]), sum(features))


# The usual mistakes of a worker, replayed here: (name, what the worker did, how to fix it).
# The name selects the rows, the order, the number of epochs, the step or the view of w.
WORKER_MISTAKES = [
    ("unchanged", "the shared vector did not change at all: your worker updated a private copy",
     "np.array(shm.buf), np.frombuffer(...).copy() and w.copy() are copies that vanish with "
     "the process. Make w a view of the block: np.ndarray((data.n_features,), dtype=np.float64, "
     "buffer=shm.buf), and update it in place."),
    ("float32", "your worker read and wrote the block as float32: the parent's float64 values "
     "were reinterpreted and overwritten byte by byte",
     "the view must have the parent's dtype and shape: np.ndarray((data.n_features,), "
     "dtype=np.float64, buffer=shm.buf) (np.frombuffer's default dtype is float64 too)."),
    ("all rows", "your worker visited all the rows, not only its shard",
     "take start, stop = shard_bounds(len(data), rank, world_size) and visit rows start .. "
     "stop - 1 only: order = start + rng.permutation(stop - start)."),
    ("no offset", "your worker visited rows 0 .. stop - start - 1, the first rows of the data, "
     "instead of its own shard", "the permutation numbers the rows of the shard from 0: add "
     "start (order = start + rng.permutation(stop - start))."),
    ("strided", "your worker visited rows rank, rank + world_size, ... (a strided split)",
     "the shards are contiguous: start, stop = shard_bounds(len(data), rank, world_size)."),
    ("seed only", "your worker's order came from np.random.default_rng(seed), whatever its "
     "rank (the stream of default_rng([seed, 0])): every rank shuffles alike",
     "use rng = np.random.default_rng([seed, rank]), created once, before the epochs."),
    ("seed + rank", "your worker's order came from np.random.default_rng(seed + rank)",
     "use rng = np.random.default_rng([seed, rank]) (a list: [0, 1] is a different stream "
     "from 1), created once, before the epochs."),
    ("one order", "your worker visited its rows in the same order in every epoch",
     "create the generator once, before the epochs, and draw a new rng.permutation(stop - start) "
     "in each epoch."),
    ("sorted", "your worker visited its rows in their stored order, without shuffling",
     "draw order = start + rng.permutation(stop - start) in each epoch, rng = "
     "np.random.default_rng([seed, rank])."),
    ("missing epoch", "your worker ran one epoch fewer than num_epochs",
     "for epoch in range(num_epochs): one permutation and one pass each."),
    ("extra epoch", "your worker ran one epoch more than num_epochs",
     "for epoch in range(num_epochs): one permutation and one pass each."),
    ("lr 1", "your worker stepped as if lr were 1", "pass lr to your loop."),
    ("lr / world_size", "your worker stepped with lr / world_size",
     "every worker takes whole steps of lr: Hogwild! runs plain SGD in each worker, with no "
     "average over the workers."),
    ("filtered", "your worker's order was a permutation of ALL the rows with the rows outside "
     "its shard left out", "that is another order than the permutation of the shard's own "
     "stop - start rows (and it draws a permutation of the whole data set every epoch)."),
    ("floor split", "your worker's shard was len(data) // world_size rows from rank * "
     "(len(data) // world_size): the last rows (len(data) % world_size of them) belong to no "
     "worker", "the shards come from shard_bounds, which spreads the remainder over the first "
     "ranks."),
    ("zeroed", "your worker set the shared vector to zeros before its epochs: the parent's "
     "starting values are gone (and with more workers, so are the updates of those that "
     "started first)", "the parent has filled the block already: a worker only reads and "
     "updates it."),
    ("uphill", "your worker stepped uphill (lr with the wrong sign)",
     "w[idx] -= lr * g * v: subtract the gradient step."),
]


def _orders(n, rank, world_size, num_epochs, seed, mistake=""):
    """The rows a worker visits, one array per epoch, correct or with ``mistake``."""
    start, stop = shard_bounds(n, rank, world_size)
    if mistake == "floor split":
        start = rank * (n // world_size)
        stop = start + n // world_size
    rows = {"all rows": np.arange(n), "no offset": np.arange(stop - start),
            "strided": np.arange(rank, n, world_size)}.get(mistake, np.arange(start, stop))
    key = {"seed only": seed, "seed + rank": seed + rank}
    rng = np.random.default_rng(key.get(mistake, [seed, rank]))
    epochs = num_epochs + {"missing epoch": -1, "extra epoch": 1}.get(mistake, 0)
    if mistake == "filtered":
        return [[i for i in rng.permutation(n) if start <= i < stop] for _ in range(epochs)]
    if mistake == "sorted":
        return [rows] * epochs
    if mistake == "one order":
        return [rows[rng.permutation(len(rows))]] * epochs
    return [rows[rng.permutation(len(rows))] for _ in range(epochs)]


def _replay(data, w0, world_size, ranks, lr, num_epochs, seed, mistake=""):
    """What the workers ``ranks`` leave in the shared vector, one after the other (exact when
    their shards touch disjoint features), each correct or making ``mistake``."""
    w = np.zeros_like(w0) if mistake == "zeroed" else w0.copy()
    if mistake == "unchanged":
        return w
    view = w.view(np.float32)[: w.size] if mistake == "float32" else w
    step = {"lr 1": 1.0, "uphill": -lr, "lr / world_size": lr / world_size}.get(mistake, lr)
    with np.errstate(all="ignore"):  # a float32 view of float64 bytes holds any number
        for rank in ranks:
            for order in _orders(len(data), rank, world_size, num_epochs, seed, mistake):
                sparse_sgd_epoch(view, data.indptr, data.indices, data.values, data.y, order,
                                 step)
    return w


def _same(a, b):
    return np.allclose(a, b, rtol=1e-10, atol=1e-12, equal_nan=True)


def _worker_cases(seed):
    """(label, data, w0, world_size, ranks, lr, num_epochs) of each launch, in order."""
    rng = np.random.default_rng(seed + 300)
    small = make_sparse_classification(400, 300, 5, seed=seed + 20)
    shards = _disjoint_shards(seed + 30)
    w_small, w_shards = 0.1 * rng.normal(size=300), 0.1 * rng.normal(size=shards.n_features)
    return [
        ("1 worker: serial SGD", small, w_small, 1, [0], 0.5, 3),
        ("worker 0 of 2, alone", shards, w_shards, 2, [0], 0.3, 2),
        ("worker 1 of 2, alone", shards, w_shards, 2, [1], 0.3, 2),
        ("workers 0 and 1 of 2 at the same time", shards, w_shards, 2, [0, 1], 0.3, 2),
    ]


def _worker_failure_hint(err, name):
    """The CheckFailed for a launch whose workers raised, died, ran late or unlinked."""
    if err.kind == "unlinked":
        return ("your worker unlinked the shared memory (shm.unlink()): the block's name is "
                "gone, and a parent that attaches by name to read the result, or a worker that "
                "starts later, finds nothing. The parent created the block and owns it: a worker "
                "only detaches with shm.close(); the parent unlinks once everybody is done.")
    if err.kind == "late":
        return ("your worker did not return before the deadline and was killed: an endless loop "
                "(a while loop whose condition never changes?), or a wait for something that "
                "never comes.")
    if err.kind == "died":
        return ("the worker process ended without an exception: os._exit, or a crash in native "
                "code (code -11 is a segmentation fault). Using a view after shm.close() does "
                "that: close() unmaps the block, and an np.ndarray(..., buffer=shm.buf) view "
                "does not stop it, so the next w[idx] touches memory that is gone. del w first, "
                "close last.")
    if err.error.startswith("BufferError"):
        return ("shm.close() refuses while a numpy array still points into the block: delete "
                "your view first (del w), then call shm.close().")
    if err.error.startswith("FileExistsError"):
        return ("your worker asked for a NEW block under the parent's name (create=True): "
                "that name is taken, by the block the parent made for the workers to share.")
    if err.error.startswith("FileNotFoundError"):
        return ("attach to the block the parent created, by the name you are given: "
                "SharedMemory(name=shm_name) (create=False, the default).")
    if err.error.startswith("IndexError"):
        return ("a row or feature number out of range: rows start .. stop - 1 of "
                "shard_bounds(len(data), rank, world_size), and a view of data.n_features "
                "float64 values.")
    if err.error.startswith("ValueError") and "read-only" in err.error:
        return "the data is read-only: only the shared vector w is yours to write."
    return ("attach with SharedMemory(name=shm_name), view it with np.ndarray((data.n_features,), "
            "dtype=np.float64, buffer=shm.buf), run your shard's epochs with your lockfree_epoch, "
            "then del the view and shm.close().")


def check_hogwild_worker(student_fn: Callable, seed: int = 0,
                         timeout: float = WORKER_TIMEOUT) -> bool:
    """Lab 03, exercise 2: ``student_fn(rank, world_size, shm_name, data, lr, num_epochs,
    seed)``, run in real worker processes by :func:`run_workers`, attaches to the float64
    vector in the SharedMemory block ``shm_name``, runs lock-free SGD on its shard of
    ``data`` (``sharding.shard_bounds``, order ``start + rng.permutation(stop - start)`` per
    epoch, ``rng = np.random.default_rng([seed, rank])``) and detaches without unlinking.

    Four launches (see the module docstring) must leave exactly the values that
    ``sparse_problem.sparse_sgd_epoch`` gives; then two workers on overlapping features must
    reach the loss of serial SGD."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_hogwild_worker"
    cases = _worker_cases(seed)
    for number, (label, data, w0, world_size, ranks, lr, num_epochs) in enumerate(cases, 1):
        where = (f"{name}: case {number}/{len(cases)} ({label}; {len(data)} rows, "
                 f"{data.n_features} features, lr={lr}, num_epochs={num_epochs})")
        try:
            got = run_workers(student_fn, data, world_size, lr, num_epochs, seed, ranks, w0,
                              timeout)
        except WorkerFailed as err:
            if err.error.startswith("NotImplementedError"):
                return not_implemented(name)
            lines = "\n".join(["", "  Your code in the worker (most recent call last):",
                               *err.lines]) if err.lines else ""
            raise CheckFailed(f"{where}\n  {err}{lines}\nHint: "
                              f"{_worker_failure_hint(err, name)}") from None
        expected = _replay(data, w0, world_size, ranks, lr, num_epochs, seed)
        if _same(got, expected):
            continue
        problem = compare(expected, got, "the shared vector after the workers", 1e-10, 1e-12)
        if len(ranks) > 1:  # each worker passed alone: together, one erased the other's updates
            lost = _lost_updates(data, w0, expected, got, ranks)
            raise CheckFailed(f"{where}\n  {problem}\n{lost}")
        for mistake, did, fix in WORKER_MISTAKES:
            if _same(got, _replay(data, w0, world_size, ranks, lr, num_epochs, seed, mistake)):
                raise CheckFailed(f"{where}\n  {problem}\n  {did}.\nHint: {fix}")
        raise CheckFailed(
            f"{where}\n  {problem}\nHint: none of the usual mistakes gives these values; go "
            "through steps 2 to 4 above the exercise again: the view of the block, the rows "
            "of the shard, the order of each epoch and its generator, the number of epochs and "
            "the step of each row.")
    print(f"✓ {name}: {len(cases)}/{len(cases)} launches leave exactly the values of serial SGD")
    data = make_sparse_classification(4000, 2000, 10, seed=seed + 40)
    _, serial = serial_sgd(data, lr=0.5, num_epochs=2, seed=seed)
    two = sparse_loss(run_workers(student_fn, data, 2, 0.5, 2, seed, timeout=timeout), data)
    if not abs(two - serial[-1]) <= 0.05 * serial[-1]:
        raise CheckFailed(f"{name}: 2 workers on rows that share features reach loss {two:.4f}, "
                          f"serial SGD {serial[-1]:.4f}.\nHint: with few collisions the two "
                          "should be within a few per cent; are both workers' updates kept?")
    print(f"  and 2 workers on rows that share features reach loss {two:.4f} "
          f"(serial SGD: {serial[-1]:.4f})")
    return True


def _lost_updates(data, w0, expected, got, ranks):
    """What a run of two workers with disjoint features lost: whose coordinates differ."""
    lines = []
    for rank in ranks:
        start, stop = shard_bounds(len(data), rank, 2)
        mine = np.unique(data.indices[data.indptr[start]:data.indptr[stop]])
        if _same(got[mine], expected[mine]):
            continue
        if _same(got[mine], w0[mine]):
            lines.append(f"  every update of worker {rank} is missing: its coordinates hold "
                         "their values from before the run")
        else:
            lines.append(f"  some updates of worker {rank} are missing or wrong: its "
                         "coordinates differ from what it wrote when it ran alone")
    return "\n".join(lines + [
        "Hint: each worker alone was right, and each feature here has one writer, so together "
        "the result must be the same: another worker overwrote these coordinates with old "
        "values. A worker that keeps a copy of w (w_local = w.copy(), np.array(shm.buf)) and "
        "writes it back (w[:] = w_local) erases every update the others made meanwhile; write "
        "only the touched coordinates, w[idx] -= ..., straight into the shared view."])


# ---------------------------------------------------------------- exercise 3: collisions
# The usual mistakes of the collision probability: (what it computes, what it is).
COLLISION_MISTAKES = [
    (lambda k, d: math.comb(d - k, k) / math.comb(d, k),
     "that is the probability that the two rows share NO feature: the complement of what is "
     "asked."),
    (lambda k, d: 1 - (1 - k / d) ** k,
     "that treats the second row's features as independent draws (with replacement): the "
     "nnz features of a row are distinct, so each draw leaves one feature fewer to choose from."),
    (lambda k, d: 1 - math.exp(-k * k / d),
     "that is an approximation (exp(-nnz^2 / n_features)), not the exact count: count the ways "
     "exactly."),
    (lambda k, d: k * k / d, "that is the approximation nnz^2 / n_features, good only when it "
     "is small: count the ways exactly."),
    (lambda k, d: k / d, "that is the chance that ONE given feature of the second row is one "
     "of the first row's: the second row has nnz features, and any of them may collide."),
    (lambda k, d: 1 - (d - k) / d, "that is the chance that ONE given feature of the second "
     "row is one of the first row's: the second row has nnz features, and any of them may "
     "collide."),
    (lambda k, d: 1 - math.prod((d - k - j) / (d - j) for j in range(k + 1)),
     "your count of the ways to avoid the first row is one step short (a product of nnz + 1 "
     "factors, or one free feature too few): the second row draws nnz features from the "
     "n_features - nnz the first one left free."),
    (lambda k, d: 1 - math.prod((d - k - j) / (d - j) for j in range(1, k)),
     "your product has nnz - 1 factors: the second row draws nnz features, one factor each, "
     "starting from the first draw."),
    (lambda k, d: 1 - math.comb(d - k, k) // math.comb(d, k),
     "your ratio was rounded down to a whole number (//): a probability needs the true "
     "division."),
    (lambda k, d: 100 * (1 - math.comb(d - k, k) / math.comb(d, k)),
     "that is a percentage: return the probability, a number between 0 and 1."),
]


def _diagnose_collision(expected, got, args):
    k, d = args
    for formula, text in COLLISION_MISTAKES:
        try:
            theirs = float(formula(k, d))
        except (ValueError, ZeroDivisionError, OverflowError):
            continue
        if np.isclose(float(got), theirs, rtol=1e-6, atol=1e-12):
            return text
    return None


def check_collision_probability(student_fn: Callable) -> bool:
    """Lab 03, exercise 3: ``student_fn(nnz, n_features)`` = chance that two rows with ``nnz``
    distinct uniform features share at least one (``sparse_problem.collision_probability``)."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [Case(f"nnz={k}, n_features={d}", lambda k=k, d=d: (k, d))
             for k, d in [(1, 10), (2, 10), (32, 20_000), (76, 47_236), (10, 15)]]
    return run_check(
        "check_collision_probability", student_fn, collision_probability, cases, rtol=1e-6,
        result_name="probability", diagnose=_diagnose_collision,
        hint="count the ways the second row can pick its nnz features among those the first "
             "row left free, against all the ways it can pick them; the rows collide in the "
             "other cases.")
