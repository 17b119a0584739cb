"""Messages over torch.distributed (:class:`TorchComm`): Gloo for CPU tensors, NCCL for CUDA
tensors, and CUDA tensors over Gloo staged through host memory; the interface is
:class:`course_lib.comm.base.Comm`'s. Also the process group under a
launcher (:func:`init_torch_from_launcher`).

Introduced in notebooks/02_parallel_computing.ipynb. torch is imported where a comm or a
group is made, not at the top: :mod:`course_lib.comm` imports this module and must import
without torch (under mpiexec, and because torch takes seconds).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import numpy as np

from course_lib.comm.base import (
    DEFAULT_TIMEOUT,
    HEADER_TAG,
    Comm,
    CommError,
    CommTimeout,
    Request,
    nbytes,
    wait_all,
    whole_milliseconds,
)
from course_lib.runtime import netem


def init_torch_from_launcher(backend: str = "gloo", timeout: float = DEFAULT_TIMEOUT) -> None:
    """Create the default process group under ``torchrun`` (env://) or ``mpiexec`` (MPI ranks).

    Under mpiexec, rank 0 picks a free loopback port and MPI tells the others; listeners bind
    127.0.0.1 unless ``MASTER_ADDR`` names another address.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    import torch.distributed as dist  # not at the top (see the module docstring)
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "MASTER_PORT" in os.environ:  # torchrun
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        return
    from course_lib.comm.mpi_transport import mpi_world  # only under mpiexec (the mpi extra)
    world = mpi_world()
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind((host, 0))  # port 0: the kernel picks a free one; closed before the store binds
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)  # MPI is already connected: it tells every rank the port
    if host == "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size(),
                            timeout=timedelta(seconds=timeout))


class TorchComm(Comm):
    """Messages over torch.distributed: Gloo for CPU tensors, NCCL for CUDA tensors.

    Gloo's point-to-point messages read and write host memory only (its ``send`` hands the
    tensor's address to a socket), so a CUDA tensor on Gloo travels through a host copy: a send
    copies it out first, a receive lands in host memory and is copied into the CUDA tensor when
    it completes (as NCCL-less clusters of one GPU, many ranks, need; ``start_cluster`` picks
    Gloo there).

    A Gloo wait that times out closes the connection to that peer, so the process group has to
    be re-created afterwards (``Cluster.run`` does this on its next call). A checked message
    (the default; not on NCCL) is an 8-byte size header under its own tag, then the data; the
    receive of the data is posted once its size is known to fit.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """

    transport = "torch"

    def __init__(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT,
                 check_sizes: bool | str = True, link: Any = None) -> None:
        import torch.distributed as dist  # not at the top (see the module docstring)
        self.dist, self.group = dist, group
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout, check_sizes,
                         link)
        self.backend = dist.get_backend(group)
        if self.link is not None and self.backend == "nccl":
            raise CommError("the emulated link (course_lib.runtime.netem) runs over gloo and mpi, "
                            "not nccl: a GPU has a real interconnect to measure")

    @staticmethod
    def _tensor(buf):
        import torch  # loaded already (a TorchComm exists); not at the top (module docstring)
        t = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
        if not t.is_contiguous():
            raise ValueError(f"buffers must be contiguous, got strides {tuple(t.stride())}")
        return t

    def _wire(self, req: Request, t):
        """What Gloo moves for ``t``: ``t`` itself, or for a CUDA tensor a host copy (a send's
        copy is made now; a receive's is copied into ``req.buf`` when it completes)."""
        if self.backend != "gloo" or t.device.type == "cpu":
            return t
        if req.kind == "send":
            return t.cpu()  # waits for the kernels that wrote t: the copy is of the final data
        req.staging = t.new_empty(t.shape, device="cpu")
        return req.staging

    def size_checked(self, check_size: bool | None) -> bool:
        """As :meth:`Comm.size_checked`; never on NCCL, where sizes are the caller's to agree."""
        return super().size_checked(check_size) and self.backend != "nccl"

    def isend(self, buf: Any, dst: int, tag: int = 0, check_size: bool | None = None,
              op: str = "isend") -> Request:
        """Post a send; a checked one (or one on an emulated link) sends its header first."""
        dst = self.check_peer(dst, op)
        t = self._tensor(buf)
        req = Request(self, op, "send", dst, buf, None, tag, self.size_checked(check_size))
        self.bytes_sent += nbytes(t)
        if req.checked or self.link is not None:  # header: [bytes, emulated link's stamp in ns]
            import torch  # loaded already; not at the top (see the module docstring)
            stamp = 0
            if self.link is not None:
                start, req.end = netem.send_stamp(self.link, nbytes(t))
                stamp = round(start * 1e9)  # int64 ns: the header is one int64 tensor
            size = torch.tensor([nbytes(t), stamp], dtype=torch.int64)
            req.header = (self._start(req, self.dist.isend, size, tag + HEADER_TAG), size)
        req.handle = None if t.numel() == 0 else self._start(req, self.dist.isend,
                                                             self._wire(req, t), tag)
        return req

    def global_rank(self, peer: int) -> int:
        """The rank in the whole world of this comm's rank ``peer`` (torch's point-to-point
        calls name peers by world rank, whatever the group: a mesh's groups are not prefixes)."""
        return peer if self.group is None else self.dist.get_global_rank(self.group, peer)

    def _start(self, req, post, t, tag):
        """Post one isend/irecv of ``req``: Gloo raises at once when the peer's connection is
        already gone (a crashed process), which becomes a CommError naming both ranks."""
        try:
            return post(t, self.global_rank(req.peer), group=self.group, tag=tag)
        except RuntimeError as e:
            raise CommError(f"{req.what()} failed: {str(e).splitlines()[0]}") from e

    def irecv(self, buf: Any, src: int, tag: int = 0, check_size: bool | None = None,
              op: str = "irecv") -> Request:
        """Post a receive; a checked one posts its header's receive and waits in line."""
        src = self.check_peer(src, op)
        t = self._tensor(buf)
        req = Request(self, op, "recv", src, buf, None, tag, self.size_checked(check_size))
        if req.checked or self.link is not None:
            import torch  # loaded already; not at the top (see the module docstring)
            size = torch.zeros(2, dtype=torch.int64)
            req.header = (self._start(req, self.dist.irecv, size, tag + HEADER_TAG), size)
        # checked: the data is received once its size is known to fit (``post``); else it
        # is received at once (on an emulated link, side by side with its stamp)
        if not req.checked and t.numel():
            req.handle = self._start(req, self.dist.irecv, self._wire(req, t), tag)
        return self.queue(req)

    def post(self, req: Request, deadline: float) -> bool:
        """Post the checked receives from ``req``'s peer and tag, in order, up to ``req``: each
        waits for its size; a mismatched message is received into scratch and dropped. False
        when a size did not arrive before ``deadline`` (a ``time.monotonic()`` reading)."""
        import torch  # loaded already; not at the top (see the module docstring)
        line = self.unposted[(req.peer, req.tag)]
        while not req.posted:
            r = line[0]
            work, size = r.header
            if not self._wait(work, deadline - time.monotonic()):
                return False
            line.pop(0)
            sent, t = int(size[0]), self._tensor(r.buf)
            r.stamp = int(size[1]) / 1e9
            if sent != nbytes(t):
                # the message must still be received (into scratch of its own size): Gloo would
                # abort the process on a size mismatch, and the next message must not read it
                r.error = r.size_error(sent)
                r.handle = self.dist.irecv(torch.empty(sent, dtype=torch.uint8),
                                           self.global_rank(r.peer), group=self.group,
                                           tag=r.tag) if sent else None
            elif sent:
                r.handle = self.dist.irecv(self._wire(r, t), self.global_rank(r.peer),
                                           group=self.group, tag=r.tag)
            r.posted = True
        return True

    def complete(self, req: Request, timeout: float) -> bool:
        """Post ``req`` if it waits for its size, then wait for its header and its data."""
        deadline = time.monotonic() + timeout
        if not req.posted and not self.post(req, deadline):
            return False
        # a send's header must be delivered too; an unchecked receive on an emulated link reads
        # its stamp from the header here (a checked one read it in ``post``)
        if req.header is not None and (req.kind == "send" or req.stamp is None):
            if not self._wait(req.header[0], deadline - time.monotonic()):
                return False
            req.stamp = int(req.header[1][1]) / 1e9
        if not self._wait(req.handle, deadline - time.monotonic()):
            return False
        if req.error is not None:
            raise req.error
        if req.staging is not None:  # a CUDA tensor received over Gloo: copy it in from host
            self._tensor(req.buf).copy_(req.staging)
        return True

    def sendrecv(self, sendbuf: Any, dst: int, recvbuf: Any, src: int, tag: int = 0,
                 timeout: float | None = None, check_size: bool | None = None) -> Any:
        """As :meth:`Comm.sendrecv`; on NCCL both go in one group (``batch_isend_irecv``), since
        NCCL runs a pair of ranks' separate operations in order and two receives first deadlock."""
        if self.backend != "nccl":
            return super().sendrecv(sendbuf, dst, recvbuf, src, tag, timeout, check_size)
        pairs = [(self.dist.irecv, self._tensor(recvbuf), self.check_peer(src, "sendrecv"),
                  "recv", recvbuf),
                 (self.dist.isend, self._tensor(sendbuf), self.check_peer(dst, "sendrecv"),
                  "send", sendbuf)]
        live = [self.dist.P2POp(op, t, self.global_rank(peer), self.group, tag)
                for op, t, peer, _, _ in pairs if t.numel()]
        works = iter(self.dist.batch_isend_irecv(live) if live else ())
        wait_all([Request(self, "sendrecv", kind, peer, buf, next(works) if t.numel() else None,
                          tag)
                  for _, t, peer, kind, buf in pairs], timeout)
        return recvbuf

    def _wait(self, work, timeout):
        if work is None:
            return True
        try:
            work.wait(whole_milliseconds(timeout))  # never shorter than what is left
        except RuntimeError as e:
            if "imed out" in str(e) or "timeout" in str(e).lower():  # Gloo's "Timed out ..."
                return False
            raise
        return True

    def barrier(self, timeout: float | None = None) -> None:
        """Every rank waits here until all have arrived (native barrier, with a deadline)."""
        work = self.dist.barrier(group=self.group, async_op=True)
        timeout = self.timeout if timeout is None else timeout
        if not self._wait(work, timeout):
            raise CommTimeout(f"rank {self.rank}: barrier over torch did not complete within "
                              f"{timeout:g}s (world size {self.world_size}): a rank is missing")
