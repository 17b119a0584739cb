"""Messages over torch.distributed (:class:`TorchComm`): Gloo for CPU tensors, NCCL for CUDA
tensors; the interface is :class:`course_lib.comm.Comm`'s.

Introduced in notebooks/02_parallel_computing.ipynb.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np

from course_lib import netem
from course_lib.comm import (
    DEFAULT_TIMEOUT,
    HEADER_TAG,
    Comm,
    CommError,
    CommTimeout,
    Request,
    nbytes,
    wait_all,
)


class TorchComm(Comm):
    """Messages over torch.distributed: Gloo for CPU tensors, NCCL for CUDA tensors.

    A Gloo wait that times out closes the connection to that peer, so the process group has to
    be re-created afterwards (``Cluster.run`` does this on its next call). A checked message
    (the default; not on NCCL) is an 8-byte size header under its own tag, then the data; the
    receive of the data is posted once its size is known to fit.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """

    transport = "torch"

    def __init__(self, group=None, timeout=DEFAULT_TIMEOUT, check_sizes=True, link=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout, check_sizes,
                         link)
        self.backend = dist.get_backend(group)
        if self.link is not None and self.backend == "nccl":
            raise CommError("the emulated link (course_lib.netem) runs over gloo and mpi, not "
                            "nccl: a GPU has a real interconnect to measure")

    @staticmethod
    def _tensor(buf):
        import torch
        t = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
        if not t.is_contiguous():
            raise ValueError(f"buffers must be contiguous, got strides {tuple(t.stride())}")
        return t

    def _checked(self, check_size):
        # NCCL: sizes are the caller's to agree
        return super()._checked(check_size) and self.backend != "nccl"

    def isend(self, buf, dst, tag=0, check_size=None, _op="isend"):
        dst = self._peer(dst, _op)
        t = self._tensor(buf)
        req = Request(self, _op, "send", dst, buf, None, tag, self._checked(check_size))
        self.bytes_sent += nbytes(t)
        if req.checked or self.link is not None:  # header: [bytes, emulated link's stamp in ns]
            import torch
            stamp = 0
            if self.link is not None:
                start, req.end = netem.send_stamp(self.link, nbytes(t))
                stamp = round(start * 1e9)
            size = torch.tensor([nbytes(t), stamp], dtype=torch.int64)
            req.header = (self._start(req, self.dist.isend, size, tag + HEADER_TAG), size)
        req.handle = None if t.numel() == 0 else self._start(req, self.dist.isend, t, tag)
        return req

    def _start(self, req, post, t, tag):
        """Post one isend/irecv of ``req``: Gloo raises at once when the peer's connection is
        already gone (a crashed process), which becomes a CommError naming both ranks."""
        try:
            return post(t, req.peer, group=self.group, tag=tag)
        except RuntimeError as e:
            raise CommError(f"{req._what()} failed: {str(e).splitlines()[0]}") from e

    def irecv(self, buf, src, tag=0, check_size=None, _op="irecv"):
        src = self._peer(src, _op)
        t = self._tensor(buf)
        req = Request(self, _op, "recv", src, buf, None, tag, self._checked(check_size))
        if req.checked or self.link is not None:
            import torch
            size = torch.zeros(2, dtype=torch.int64)
            req.header = (self._start(req, self.dist.irecv, size, tag + HEADER_TAG), size)
        # checked: the data is received once its size is known to fit (``_post``); else it
        # is received at once (on an emulated link, side by side with its stamp)
        if not req.checked and t.numel():
            req.handle = self._start(req, self.dist.irecv, t, tag)
        return self._queue(req)

    def _post(self, req, deadline):
        """Post the checked receives from ``req``'s peer and tag, in order, up to ``req``: each
        waits for its size; a mismatched message is received into scratch and dropped. False
        when a size did not arrive before ``deadline``."""
        import torch
        line = self._unposted[(req.peer, req.tag)]
        while not req.posted:
            r = line[0]
            work, size = r.header
            if not self._wait(work, deadline - time.monotonic()):
                return False
            line.pop(0)
            sent, t = int(size[0]), self._tensor(r.buf)
            r.stamp = int(size[1]) / 1e9
            if sent != nbytes(t):
                r.error = r._size_error(sent)
                r.handle = self.dist.irecv(torch.empty(sent, dtype=torch.uint8), r.peer,
                                           group=self.group, tag=r.tag) if sent else None
            elif sent:
                r.handle = self.dist.irecv(t, r.peer, group=self.group, tag=r.tag)
            r.posted = True
        return True

    def _complete(self, req, timeout):
        deadline = time.monotonic() + timeout
        if not req.posted and not self._post(req, deadline):
            return False
        if req.header is not None and (req.kind == "send" or req.stamp is None):
            if not self._wait(req.header[0], deadline - time.monotonic()):
                return False
            req.stamp = int(req.header[1][1]) / 1e9
        if not self._wait(req.handle, deadline - time.monotonic()):
            return False
        if req.error is not None:
            raise req.error
        return True

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0, timeout=None, check_size=None):
        """As :meth:`Comm.sendrecv`; on NCCL both go in one group (``batch_isend_irecv``), since
        NCCL runs a pair of ranks' separate operations in order and two receives first deadlock."""
        if self.backend != "nccl":
            return super().sendrecv(sendbuf, dst, recvbuf, src, tag, timeout, check_size)
        pairs = [(self.dist.irecv, self._tensor(recvbuf), self._peer(src, "sendrecv"), "recv",
                  recvbuf),
                 (self.dist.isend, self._tensor(sendbuf), self._peer(dst, "sendrecv"), "send",
                  sendbuf)]
        live = [self.dist.P2POp(op, t, peer, self.group, tag) for op, t, peer, _, _ in pairs
                if t.numel()]
        works = iter(self.dist.batch_isend_irecv(live) if live else ())
        wait_all([Request(self, "sendrecv", kind, peer, buf, next(works) if t.numel() else None,
                          tag)
                  for _, t, peer, kind, buf in pairs], timeout)
        return recvbuf

    def _wait(self, work, timeout):
        if work is None:
            return True
        try:
            work.wait(timedelta(seconds=max(timeout, 1e-3)))
        except RuntimeError as e:
            if "imed out" in str(e) or "timeout" in str(e).lower():
                return False
            raise
        return True

    def barrier(self, timeout=None):
        """Every rank waits here until all have arrived (native barrier, with a deadline)."""
        work = self.dist.barrier(group=self.group, async_op=True)
        timeout = self.timeout if timeout is None else timeout
        if not self._wait(work, timeout):
            raise CommTimeout(f"rank {self.rank}: barrier over torch did not complete within "
                              f"{timeout:g}s (world size {self.world_size}): a rank is missing")
