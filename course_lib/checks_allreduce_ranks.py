"""What runs on every rank while course_lib.checks_allreduce checks a student's lab 05 code.

Introduced in labs/05_allreduce.ipynb. ``run_student`` unpacks the student's function (sent by
``checks.pack_function``), builds this rank's case from a seed, runs it over a
:class:`CountingComm` that records every message, and returns what came back and what was sent;
``run_timed`` times the student's allreduce beside ``dist.all_reduce``.
"""

from __future__ import annotations

import numpy as np

from course_lib.data import shard_bounds

DEFAULT_TIMEOUT = 5.0  # seconds each point-to-point wait of the student's code may take
MARK = -10_000  # placeholder values of the all-gather cases are <= MARK; real sums are not


class CountingComm:
    """Forwards everything to ``comm`` and records (peer, bytes) of each message this rank sends."""

    def __init__(self, comm):
        self._comm, self.sent = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _count(self, buf, dst):
        self.sent.append((int(dst), int(buf.numel() * buf.element_size())
                          if hasattr(buf, "numel") else int(buf.nbytes)))

    def send(self, buf, dst, tag=0, timeout=None):
        self._count(buf, dst)
        return self._comm.send(buf, dst, tag, timeout)

    def isend(self, buf, dst, tag=0):
        self._count(buf, dst)
        return self._comm.isend(buf, dst, tag)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0, timeout=None):
        self._count(sendbuf, dst)
        return self._comm.sendrecv(sendbuf, dst, recvbuf, src, tag, timeout)


def case_inputs(exercise, n, dtype, seed, world_size):
    """Every rank's input buffer as numpy arrays (the same on the client and on every engine).

    Values are multiples of 1/4 (integers for integer dtypes), so every sum is exact. For
    "all-gather" rank r holds the final chunk r and marks element i of every other chunk with
    MARK * (r + 1) - i (no sum is that negative), so an untouched chunk can be recognised."""
    rng = [np.random.default_rng([seed, n, q]) for q in range(world_size)]
    if np.dtype(dtype).kind in "iu":
        data = [g.integers(-1000, 1000, n) for g in rng]
    else:
        data = [g.integers(-64, 64, n) / 4 for g in rng]
    data = [x.astype(dtype) for x in data]
    if exercise != "all-gather":
        return data
    full = np.sum(data, axis=0, dtype=np.float64).astype(dtype)
    out = []
    for r in range(world_size):
        x = (MARK * (r + 1) - np.arange(n)).astype(dtype)
        a, b = shard_bounds(n, r, world_size)
        x[a:b] = full[a:b]
        out.append(x)
    return out


def run_student(payload, exercise, n, dtype, seed, timeout=DEFAULT_TIMEOUT):
    """On every rank: run the student's function (cloudpickled) on this rank's case input.

    Returns {"returned": what it returned (a tuple of ints, or a short description), "buf":
    the buffer afterwards, "sent": [(peer, bytes)], "native": dist.all_reduce of the input}."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    from course_lib.comm import get_comm
    fn = cloudpickle.loads(payload)
    comm = CountingComm(get_comm("torch", timeout=timeout))
    x = case_inputs(exercise, n, dtype, seed, comm.world_size)[comm.rank]
    native = None
    if exercise == "allreduce":  # the production allreduce of the same input, first
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t)
        native = t.numpy()
    buf = torch.from_numpy(x.copy())
    out = fn(buf, comm)
    returned = None
    if exercise == "reduce-scatter":
        try:
            returned = tuple(int(v) for v in out)
        except (TypeError, ValueError):
            returned = "None" if out is None else f"a {type(out).__name__}"
    return {"returned": returned, "buf": buf.numpy().copy(), "sent": comm.sent, "native": native}


def run_timed(payload, sizes, repeats, timeout=DEFAULT_TIMEOUT):
    """On every rank: for each size (bytes of float32), the median over ``repeats`` rounds of
    the slowest rank's time, for the student's allreduce and for ``dist.all_reduce``."""
    import time

    import cloudpickle
    import torch
    import torch.distributed as dist

    from course_lib.comm import get_comm
    fn, comm = cloudpickle.loads(payload), get_comm("torch", timeout=timeout)
    ops = (lambda b: fn(b, comm), dist.all_reduce)
    medians = []
    for size in sizes:
        x, times = torch.ones(max(size // 4, 1)), torch.zeros(2, repeats, dtype=torch.float64)
        for i in range(-1, repeats):  # round -1 warms up
            for k, op in enumerate(ops):
                buf = x.clone()
                comm.barrier()
                t = time.perf_counter()
                op(buf)
                if i >= 0:
                    times[k, i] = time.perf_counter() - t
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        medians.append(times.median(dim=1).values.tolist())
    return medians
