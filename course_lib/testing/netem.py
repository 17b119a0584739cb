"""Timed message patterns on every rank, to hold the emulated network to its model.

Introduced with notebooks/05_allreduce.ipynb; tests/test_netem.py runs these on cluster engines
(with ``cluster.set_link(...)``). Each returns (seconds on this rank, what it received).
"""

from __future__ import annotations

import time

import torch

from course_lib.collectives import allreduce
from course_lib.comm import get_comm, wait_all
from course_lib.runtime import netem


def timed(pattern, n_bytes):
    """Run ``pattern`` ("ring_step", "gather_to_root" or "ring_allreduce") on ``n_bytes``, all
    ranks starting at once; (seconds, result) on this rank."""
    comm = get_comm("torch")
    # from one instant on every rank: a barrier releases ranks milliseconds apart, and a rank
    # released late would see its peers' messages sent before its own clock started
    t = netem.start_clock(comm)
    result = PATTERNS[pattern](comm, n_bytes // 4)
    return time.monotonic() - t, result


def ring_step(comm, count):
    """Every rank sends to its right and receives from its left at once; the left's rank."""
    x, y = torch.full((count,), float(comm.rank)), torch.empty(count)
    comm.sendrecv(x, (comm.rank + 1) % comm.world_size, y, (comm.rank - 1) % comm.world_size)
    return float(y[0])


def gather_to_root(comm, count):
    """Every rank sends to rank 0 at once; rank 0 returns what each sent (their ranks)."""
    if comm.rank == 0:
        bufs = [torch.empty(count) for _ in range(comm.world_size - 1)]
        wait_all([comm.irecv(b, src) for src, b in enumerate(bufs, 1)])
        return [float(b[0]) for b in bufs]
    comm.send(torch.full((count,), float(comm.rank)), 0)
    return None


def ring_allreduce(comm, count):
    """The ring allreduce of rank + 1 everywhere: (min, max) of the result, both p(p+1)/2."""
    buf = torch.full((count,), float(comm.rank + 1))
    allreduce(buf, comm, algorithm="ring")
    return float(buf.min()), float(buf.max())


PATTERNS = {"ring_step": ring_step, "gather_to_root": gather_to_root,
            "ring_allreduce": ring_allreduce}
