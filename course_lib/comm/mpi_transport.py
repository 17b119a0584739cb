"""Messages over MPI (:class:`MpiComm`, with mpi4py): numpy arrays or CPU tensors, sent as
bytes; the interface is :class:`course_lib.comm.base.Comm`'s.

Introduced in notebooks/02_parallel_computing.ipynb. mpi4py is optional (the mpi extra) and
torch not needed here: both are imported where they are used, not at the top.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from course_lib.comm.base import (
    DEFAULT_TIMEOUT,
    STAMP_TAG,
    Comm,
    CommError,
    CommTimeout,
    Request,
    nbytes,
)
from course_lib.runtime import netem

LAUNCHED_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")  # MPICH's (Hydra, PMI) and Open MPI's


def mpi_world() -> Any:
    """``MPI.COMM_WORLD``, after checking that it holds every process ``mpiexec`` started: an
    mpi4py built for another MPI than the ``mpiexec`` that launched it sees a world of 1 on
    every process (each its own rank 0), and would compute alone without a word.
    Introduced in notebooks/02_parallel_computing.ipynb."""
    from mpi4py import MPI  # optional (the mpi extra)
    world = MPI.COMM_WORLD
    launched = next((int(os.environ[k]) for k in LAUNCHED_SIZE if k in os.environ), None)
    if launched is not None and launched != world.Get_size():
        library = " ".join(MPI.Get_library_version().splitlines()[0].strip("\x00").split())
        raise CommError(f"mpiexec started {launched} processes but MPI sees a world of "
                        f"{world.Get_size()}: mpi4py runs on {library}, another MPI than the "
                        "mpiexec that started it. Use that MPI's own mpiexec (the course's: "
                        "pip install mpi4py mpich, and the mpiexec beside that Python)")
    return world


class MpiComm(Comm):
    """Messages over MPI: numpy arrays or CPU tensors, sent as bytes (any dtype, fp16 too).

    Waits poll ``Test`` (MPI progresses inside MPI calls), so a deadline or a Ctrl-C can stop them.
    A checked receive probes its message's size (``Iprobe``) before it is posted.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """

    transport = "mpi"

    def __init__(self, mpi_comm: Any = None, timeout: float = DEFAULT_TIMEOUT,
                 check_sizes: bool | str = True, link: Any = None) -> None:
        from mpi4py import MPI  # optional (the mpi extra): only when an MpiComm is made
        self.MPI = MPI
        self.mpi = mpi_world() if mpi_comm is None else mpi_comm
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size(), timeout, check_sizes, link)

    def _bytes(self, buf):
        if isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous:
                raise ValueError(f"buffers must be contiguous, got strides {buf.strides}")
            return [buf.reshape(-1).view(np.uint8), self.MPI.BYTE]
        import torch  # a tensor was passed, so torch is loaded; not at the top (module docstring)
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("the mpi transport takes contiguous CPU buffers")
        if buf.numel() == 0:  # an empty tensor may have stride 0, which view(uint8) rejects
            return [np.empty(0, np.uint8), self.MPI.BYTE]
        # the tensor's bytes, viewed (no copy) as a numpy array MPI can read and write
        return [buf.reshape(-1).view(torch.uint8).numpy(), self.MPI.BYTE]

    def isend(self, buf: Any, dst: int, tag: int = 0, check_size: bool | None = None,
              op: str = "isend") -> Request:
        """Post a send (``Isend``); on an emulated link its stamp goes first."""
        dst = self.check_peer(dst, op)  # an MPI message carries its size: nothing to add
        req = Request(self, op, "send", dst, buf, None, tag)
        self.bytes_sent += nbytes(buf)
        if self.link is not None:  # the stamp goes first, in a message of its own
            start, req.end = netem.send_stamp(self.link, nbytes(buf))
            stamp = np.array([start])
            req.stamp_msg = (self.mpi.Isend(stamp, dst, tag + STAMP_TAG), stamp)
        req.handle = self.mpi.Isend(self._bytes(buf), dst, tag)
        return req

    def irecv(self, buf: Any, src: int, tag: int = 0, check_size: bool | None = None,
              op: str = "irecv") -> Request:
        """Post a receive (``Irecv``); a checked one waits in line until its size is probed."""
        src = self.check_peer(src, op)
        data = self._bytes(buf)
        check_size = self.size_checked(check_size)
        req = Request(self, op, "recv", src, buf, None, tag, check_size)
        if self.link is not None:
            stamp = np.zeros(1)
            req.stamp_msg = (self.mpi.Irecv(stamp, src, tag + STAMP_TAG), stamp)
        if not check_size:
            req.handle = self.mpi.Irecv(data, src, tag)
        return self.queue(req)

    def stamp(self, request: Request) -> float | None:
        """The stamp's message left before its data did: it is here, or arrives at once."""
        handle, stamp = request.stamp_msg
        deadline = time.monotonic() + self.timeout
        while not handle.Test():
            if time.monotonic() > deadline:
                handle.Cancel()
                raise request.timed_out(self.timeout)
            os.sched_yield()
        return float(stamp[0]) if request.kind == "recv" else None

    def emulate(self, request: Request) -> None:
        """As :meth:`Comm.emulate`, after a send's stamp message has completed too."""
        if request.stamp_msg is not None and request.kind == "send":
            self.stamp(request)  # the stamp's send buffer is free once it completed
        super().emulate(request)

    def post(self, req: Request, deadline: float | None = None) -> bool:
        """Post the checked receives from ``req``'s peer and tag, in order, whose messages have
        arrived (``Iprobe`` tells their size); a mismatched one is received and dropped. True
        once ``req`` is posted. One probe each, whatever ``deadline``: the caller polls."""
        line = self.unposted[(req.peer, req.tag)]
        status = self.MPI.Status()
        while not req.posted:
            r = line[0]
            if not self.mpi.Iprobe(r.peer, r.tag, status):
                return False
            line.pop(0)
            sent = status.Get_count(self.MPI.BYTE)
            if sent != nbytes(r.buf):
                self.mpi.Recv([np.empty(sent, np.uint8), self.MPI.BYTE], r.peer, r.tag)
                r.error = r.size_error(sent)
            else:
                r.handle = self.mpi.Irecv(self._bytes(r.buf), r.peer, r.tag)
            r.posted = True
        return True

    def complete(self, req: Request, timeout: float) -> bool:
        """Poll ``req`` (posting it first if it waits for its size) until done or past
        ``timeout``; a request past its deadline is cancelled."""
        deadline = time.monotonic() + timeout
        spins = 0
        while True:
            if req.posted or self.post(req, deadline):
                if req.error is not None:
                    raise req.error
                if req.handle.Test():
                    return True
            spins += 1
            if spins % 64 == 0:  # every 64 tries: look at the clock, give up the core
                if time.monotonic() > deadline:
                    if req.handle is not None:
                        req.handle.Cancel()
                    return False
                os.sched_yield()  # let a rank sharing this core run

    def wait_all(self, requests: Sequence[Request], timeout: float) -> None:
        """One polling loop over all requests (``Testall``): a ring step pays one loop, not two.
        Checked receives not posted yet are completed one by one instead."""
        pending = [r for r in requests if not r.done]
        if not all(r.posted and r.error is None for r in pending):
            return super().wait_all(requests, timeout)
        handles = [r.handle for r in pending]
        deadline = time.monotonic() + timeout
        spins = 0
        while not self.MPI.Request.Testall(handles):
            spins += 1
            if spins % 64 == 0:
                if time.monotonic() > deadline:
                    for r in pending:
                        if not r.handle.Test():
                            r.handle.Cancel()
                            raise r.timed_out(timeout)
                os.sched_yield()
        for r in pending:
            r.done = True
            self.emulate(r)

    def barrier(self, timeout: float | None = None) -> None:
        """Every rank waits here until all have arrived (``Ibarrier``, with a deadline)."""
        timeout = self.timeout if timeout is None else timeout
        barrier, deadline = self.mpi.Ibarrier(), time.monotonic() + timeout
        while not barrier.Test():
            if time.monotonic() > deadline:  # an Ibarrier cannot be cancelled
                raise CommTimeout(f"rank {self.rank}: barrier over mpi did not complete within "
                                  f"{timeout:g}s (world size {self.world_size}): a rank is "
                                  "missing")
            os.sched_yield()
