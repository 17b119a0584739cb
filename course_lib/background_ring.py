"""The course's ring allreduce on a background thread, started as a native allreduce is.

Introduced in notebooks/06_data_parallel_sgd.ipynb. Horovod runs its collectives on a background
thread: the training thread only starts them, and waits later. :class:`BackgroundRing` does the
same with the course's pipelined ring (notebook 05, :func:`course_lib.collectives.allreduce`).
Its ``all_reduce(tensor, async_op=True)`` is called as ``torch.distributed.all_reduce`` is, and
returns at once with a :class:`RingWork` that has the two methods of torch's ``Work`` that the
reducers of :mod:`course_lib.ddp` call, so they treat both allreduces alike::

    ring = BackgroundRing(timeout=30)
    work = ring.all_reduce(flat, async_op=True)          # summed in place, on the ring's thread
    work.get_future().add_done_callback(lambda _: print("done"))
    work.wait(timedelta(seconds=30))                     # RuntimeError if still running then

One thread per process runs every ring, one after the other, so the ranks' rings run in the order
their training threads started them. The first allreduce of each tensor checks that every rank
holds the same shape (the ring's agreement round); later ones of the same tensor skip it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import torch

from course_lib.collectives import allreduce
from course_lib.comm import DEFAULT_TIMEOUT, TorchComm

_THREAD: dict[str, ThreadPoolExecutor] = {}  # the one thread of this process, made on first use


def _thread() -> ThreadPoolExecutor:
    if "pool" not in _THREAD:
        _THREAD["pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="course-ring")
    return _THREAD["pool"]


class RingWork:
    """A ring allreduce in flight, waited for as torch.distributed's ``Work`` is.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def get_future(self) -> Future:
        """Its future: ``add_done_callback(fn)`` calls ``fn(future)`` once the ring is done."""
        return self.future

    def wait(self, timeout: timedelta) -> bool:
        """Return once the ring is done; an error of the ring is raised here. Still running
        after ``timeout``: a RuntimeError (``comm.wait_work`` names the rank and the deadline)."""
        try:
            self.future.result(timeout.total_seconds())
        except FutureTimeout:
            raise RuntimeError("the course's ring is still running on its background "
                               "thread") from None
        return True


class BackgroundRing:
    """Starts the course's pipelined ring allreduce (a sum, in place) on the process's ring
    thread, over a :class:`course_lib.comm.TorchComm` whose every wait has ``timeout``.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout, self.comm = timeout, None
        self.agreed: set[int] = set()  # the tensors whose shapes every rank agreed on

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = True) -> RingWork:
        """Start summing ``tensor`` over every rank; returns at once (``async_op`` must be
        True: the ring always runs on its thread)."""
        if not async_op:
            raise ValueError("async_op must be True: the ring runs on its background thread")
        return RingWork(_thread().submit(self._run, tensor))

    def _run(self, tensor: torch.Tensor) -> None:
        if self.comm is None:  # made on the ring's thread, where it is used
            self.comm = TorchComm(timeout=self.timeout)
        allreduce(tensor, self.comm, "ring_pipelined", op="sum",
                  check=id(tensor) not in self.agreed)
        self.agreed.add(id(tensor))
