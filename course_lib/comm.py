"""Point-to-point messages between ranks, with a deadline on every wait.

Introduced in notebooks/02_parallel_computing.ipynb; the collectives of
notebooks/05_allreduce.ipynb are built on it. One interface, two transports::

    comm = get_comm("torch")      # torch.distributed: Gloo on CPU tensors, NCCL on CUDA tensors
    comm = get_comm("mpi")        # mpi4py: numpy arrays (or CPU tensors), sent as raw bytes
    comm.sendrecv(x, (comm.rank + 1) % comm.world_size, y, (comm.rank - 1) % comm.world_size)

``send``/``recv`` block, ``isend``/``irecv`` return a :class:`Request` to ``wait`` on, and
``sendrecv`` posts its receive before its send, so a ring of them never deadlocks the way a ring
of blocking sends does. When a wait passes its deadline it raises :class:`CommTimeout` naming the
operation, this rank, the peer and the size, instead of hanging. Works on cluster engines (the
process group ``start_cluster`` made), under ``torchrun`` and under ``mpiexec``.

This module has what the two transports share; each transport is a module of its own:
:mod:`course_lib.comm_torch` (``TorchComm``) and :mod:`course_lib.comm_mpi` (``MpiComm``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np

from course_lib import netem
from course_lib.engine import mark_group_broken

# The course's one deadline policy: every distributed wait (a message, a collective, a gradient
# bucket, a compressor's exchange) defaults to this many seconds, and every function that waits
# takes ``timeout=`` to change it. Checks of student code pass a shorter one, so that a mistake
# comes back as a hint in seconds.
DEFAULT_TIMEOUT = 30.0


def is_numpy(buf):
    """True for a numpy array, False for a torch tensor: the two kinds of buffer ``comm`` moves.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    return isinstance(buf, np.ndarray)


def to_numpy(buf):
    """A numpy view (or a host copy, for a GPU tensor) of a numpy or torch buffer.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    return buf if is_numpy(buf) else buf.detach().cpu().numpy()


class CommError(RuntimeError):
    """A point-to-point operation failed (say, the peer's process exited); names op and ranks.

    Introduced in notebooks/02_parallel_computing.ipynb."""


class CommTimeout(CommError, TimeoutError):
    """A point-to-point wait passed its deadline; the message names op, ranks and size.

    Introduced in notebooks/02_parallel_computing.ipynb."""

    def __init__(self, *args):
        super().__init__(*args)
        mark_group_broken(str(self))  # a peer may still wait: repaired even if caught


def describe(buf):
    """'1024 x float32 (4096 bytes)': how error messages name a buffer.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    n = buf.numel() if hasattr(buf, "numel") else buf.size
    dtype = str(buf.dtype).replace("torch.", "")
    return f"{n} x {dtype} ({n * buf.itemsize} bytes)"


def nbytes(buf):
    """The size in bytes of a numpy or torch buffer.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    return buf.nbytes if is_numpy(buf) else buf.numel() * buf.element_size()


# A checked message's size travels ahead of it under its own tag (the message's tag plus this),
# so that size headers and payloads each match in order, whatever else is in flight. Over MPI
# (tags below 2**29 in MPICH) the emulated link's stamps travel under the tag plus STAMP_TAG.
HEADER_TAG = 1 << 30
STAMP_TAG = 1 << 28


class Request:
    """A posted send or receive; ``wait()`` blocks until it is done or its deadline passes.

    Introduced in notebooks/02_parallel_computing.ipynb."""

    def __init__(self, comm, op, kind, peer, buf, handle, tag=0, checked=False):
        self.comm, self.op, self.kind, self.peer, self.buf = comm, op, kind, peer, buf
        self.handle, self.tag, self.checked = handle, tag, checked
        # a checked receive is posted once its message's size is known (``posted``); a size
        # mismatch found then is kept in ``error`` and raised by ``wait``
        self.posted, self.error, self.header = not (checked and kind == "recv"), None, None
        self.done = False
        # on an emulated link (course_lib.netem): when a send's egress is done; a receive's
        # stamp (when its sender started sending), and over MPI the stamp's own message
        self.end, self.stamp, self.stamp_msg = None, None, None

    def wait(self, timeout=None):
        """Block until complete; raise CommTimeout after ``timeout`` s (default: the comm's)."""
        if not self.done:
            timeout = self.comm.timeout if timeout is None else timeout
            try:
                done = self.comm._complete(self, timeout)
            except CommError:
                raise
            except RuntimeError as e:
                raise CommError(f"{self._what()} failed: {str(e).splitlines()[0]}") from e
            if not done:
                self.comm._forget(self)
                raise self._timed_out(timeout)
            self.done = True
            self.comm._emulate(self)
        return self.buf

    def _what(self):
        c, where = self.comm, "to" if self.kind == "send" else "from"
        return (f"rank {c.rank}: {self.op} {where} rank {self.peer} of {describe(self.buf)} "
                f"over {c.transport} (world size {c.world_size})")

    def _timed_out(self, timeout):
        return CommTimeout(f"{self._what()} did not complete within {timeout:g}s; is rank "
                           f"{self.peer} alive and calling the matching "
                           f"{'recv' if self.kind == 'send' else 'send'}?")

    def _size_error(self, sent):
        """The error of a receive whose message (``sent`` bytes) does not fit its buffer."""
        mine, item = nbytes(self.buf), self.buf.itemsize
        elements = f"{sent // item} x {str(self.buf.dtype).replace('torch.', '')}" \
            if sent % item == 0 else "not a whole number of elements"
        return CommError(f"{self._what()}: rank {self.peer} sent {sent} bytes ({elements}) but "
                         f"the receive buffer holds {mine} bytes: a send and its receive must "
                         f"have the same size (the message was received and dropped)")


def wait_work(work, timeout, what, error=None):
    """Wait for a native collective (a torch.distributed ``Work``) with a deadline. Past it, or
    on failure, raise ``error`` (default :class:`CommTimeout`, or :class:`CommError` when it
    failed otherwise) naming this rank, ``what`` and the deadline.
    Introduced in notebooks/02_parallel_computing.ipynb."""
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        import torch.distributed as dist
        text = str(e)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        cls = error or (CommTimeout if timed_out else CommError)
        first = text.splitlines()[0] if text else type(e).__name__
        mark_group_broken(f"{what}: {first}")  # Gloo closes the pairs it timed out on
        raise cls(f"rank {dist.get_rank()}: {what} did not complete within {timeout:g}s: "
                  f"{first}") from None


def wait_all(requests, timeout=None):
    """Wait on every request, all under one deadline.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    if requests:
        comm = requests[0].comm
        comm._wait_all(requests, comm.timeout if timeout is None else timeout)


class Comm:
    """What both transports share: rank, world size, deadline, and the blocking forms.

    Every message is checked (unless the comm was made with ``check_sizes=False`` or a call
    passes ``check_size=False``): a message longer or shorter than its receive buffer raises
    :class:`CommError` on the receiving rank, naming both ranks and both sizes, and the message
    is drained so that no process dies and the next message arrives intact. (MPI alone would
    truncate a longer message with an error and accept a shorter one silently; Gloo would abort
    the receiving process.) Over torch this costs an 8-byte header message per message and a
    receive posted only once the size is known (about 2x a small message's time on loopback);
    the course's collectives, whose sizes the ranks agree on first, pass ``check_size=False``.
    ``check_sizes="always"`` checks those too (``bench allreduce --check-messages`` measures
    what the check costs). A receive buffer *longer* than its message is an error too: MPI
    would accept it and leave the tail as it was, which hides an off-by-one.
    ``bytes_sent`` counts the payload bytes sent so far (what notebook 10 compares between
    data parallelism and ZeRO).

    Introduced in notebooks/02_parallel_computing.ipynb."""

    transport = "?"

    def __init__(self, rank, world_size, timeout=DEFAULT_TIMEOUT, check_sizes=True, link=None):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.check_sizes = check_sizes
        # the emulated link: this comm's own, else the process's (start_cluster(link=...))
        self.link = netem.current() if link is None else netem.make_link(link)
        self._unposted = {}  # (peer, tag) -> checked receives waiting for their sizes, in order
        self.bytes_sent = 0  # payload bytes this comm has sent (size headers not counted)

    def _checked(self, check_size):
        """Whether a message carries its size: the call's choice, else the comm's."""
        if self.check_sizes == "always":
            return True
        return self.check_sizes if check_size is None else check_size

    def _emulate(self, request):
        """On an emulated link, a completed request waits until the link would have carried
        its message (see :mod:`course_lib.netem`)."""
        if self.link is None:
            return
        if request.kind == "send":
            netem.sleep_until(request.end)
        else:
            netem.receive(self.link, self._stamp(request), nbytes(request.buf))

    def _stamp(self, request):
        return request.stamp

    def _peer(self, peer, op):
        if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.world_size):
            raise ValueError(f"rank {self.rank}: {op} peer must be a rank in "
                             f"0..{self.world_size - 1}, not {peer!r}")
        if peer == self.rank:
            raise ValueError(f"rank {self.rank}: {op} to itself; copy the buffer instead")
        return int(peer)

    def _queue(self, request):
        """Keep a checked receive in line: messages from one peer and tag match in order."""
        if not request.posted:
            self._unposted.setdefault((request.peer, request.tag), []).append(request)
        return request

    def _forget(self, request):
        """A request that timed out leaves the line of receives waiting for their sizes."""
        line = self._unposted.get((request.peer, request.tag), [])
        if request in line:
            line.remove(request)

    def _wait_all(self, requests, timeout):
        deadline = time.monotonic() + timeout
        for r in requests:
            try:
                r.wait(max(deadline - time.monotonic(), 0.0))
            except CommTimeout:
                raise r._timed_out(timeout) from None  # name the whole deadline

    def send(self, buf, dst, tag=0, timeout=None, check_size=None):
        """Send ``buf`` to rank ``dst``; returns once the buffer may be reused."""
        self.isend(buf, dst, tag, check_size=check_size, _op="send").wait(timeout)

    def recv(self, buf, src, tag=0, timeout=None, check_size=None):
        """Receive from rank ``src`` into ``buf`` (in place); returns ``buf``."""
        return self.irecv(buf, src, tag, check_size=check_size, _op="recv").wait(timeout)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0, timeout=None, check_size=None):
        """Send to ``dst`` and receive from ``src`` at once: the step of every ring."""
        reqs = [self.irecv(recvbuf, src, tag, check_size=check_size, _op="sendrecv"),
                self.isend(sendbuf, dst, tag, check_size=check_size, _op="sendrecv")]
        wait_all(reqs, timeout)
        return recvbuf

    def __repr__(self):
        return f"<{type(self).__name__} rank {self.rank} of {self.world_size}>"


# ---------------------------------------------------------------- getting one
def init_torch_from_launcher(backend="gloo", timeout=DEFAULT_TIMEOUT):
    """Create the default process group under ``torchrun`` (env://) or ``mpiexec`` (MPI ranks).

    Under mpiexec, rank 0 picks a free loopback port and MPI tells the others; listeners bind
    127.0.0.1 unless ``MASTER_ADDR`` names another address.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    import torch.distributed as dist
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "MASTER_PORT" in os.environ:  # torchrun
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        return
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = None
    if world.Get_rank() == 0:
        import socket
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    if host == "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size(),
                            timeout=timedelta(seconds=timeout))


def get_comm(transport="torch", timeout=DEFAULT_TIMEOUT, check_sizes=True, link=None):
    """This rank's communicator over ``transport`` ("torch" or "mpi"); ``check_sizes=False``
    sends messages without their size check (for code whose sizes are known to match).
    ``link`` ("1Gbit/s,50us", a preset name of ``netem.PRESETS``): every message pays the time
    of that emulated link (default: the process's, as ``start_cluster(link=...)`` sets it).

    Introduced in notebooks/02_parallel_computing.ipynb."""
    if transport == "torch":
        import torch.distributed as dist
        if not dist.is_initialized():
            init_torch_from_launcher(timeout=timeout)
        from course_lib.comm_torch import TorchComm
        return TorchComm(timeout=timeout, check_sizes=check_sizes, link=link)
    if transport == "mpi":
        from course_lib.comm_mpi import MpiComm
        return MpiComm(timeout=timeout, check_sizes=check_sizes, link=link)
    raise ValueError(f"transport must be 'torch' or 'mpi', not {transport!r}")
