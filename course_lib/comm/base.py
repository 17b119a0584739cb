"""What every transport of :mod:`course_lib.comm` shares: the deadline, the errors, a request,
and the :class:`Comm` base class with the blocking forms built on the non-blocking ones.

Introduced in notebooks/02_parallel_computing.ipynb. A transport (``torch_transport``,
``mpi_transport``, ``recording``) subclasses :class:`Comm` and implements the transport protocol
written in its docstring; this module imports no transport, and no torch (a torch ``Work`` is
waited on only by :func:`wait_work`, which imports it then).

One file a little over a lesson's length: the protocol's pieces (errors, :class:`Request`,
:class:`Comm`) refer to one another and are read together, once, before any transport.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np

from course_lib.runtime import netem
from course_lib.runtime.engine import mark_group_broken

# The course's one deadline policy: every distributed wait (a message, a collective, a gradient
# bucket, a compressor's exchange) defaults to this many seconds, and every function that waits
# takes ``timeout=`` to change it. Checks of student code pass a shorter one, so that a mistake
# comes back as a hint in seconds.
DEFAULT_TIMEOUT = 30.0

# A checked message's size travels ahead of it under its own tag (the message's tag plus this),
# so that size headers and payloads each match in order, whatever else is in flight. Over MPI
# (tags below 2**29 in MPICH) the emulated link's stamps travel under the tag plus STAMP_TAG.
HEADER_TAG = 1 << 30
STAMP_TAG = 1 << 28


def is_numpy(buf: Any) -> bool:
    """True for a numpy array, False for a torch tensor: the two kinds of buffer ``comm`` moves.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    return isinstance(buf, np.ndarray)


def to_numpy(buf: Any) -> np.ndarray:
    """A numpy view (or a host copy, for a GPU tensor) of a numpy or torch buffer.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    return buf if is_numpy(buf) else buf.detach().cpu().numpy()


class CommError(RuntimeError):
    """A point-to-point operation failed (say, the peer's process exited); names op and ranks.

    Introduced in notebooks/02_parallel_computing.ipynb."""


class CommTimeout(CommError, TimeoutError):
    """A point-to-point wait passed its deadline; the message names op, ranks and size.

    Introduced in notebooks/02_parallel_computing.ipynb."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        mark_group_broken(str(self))  # a peer may still wait: repaired even if caught


def describe(buf: Any) -> str:
    """'1024 x float32 (4096 bytes)': how error messages name a buffer.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    n = buf.numel() if hasattr(buf, "numel") else buf.size
    dtype = str(buf.dtype).replace("torch.", "")
    return f"{n} x {dtype} ({n * buf.itemsize} bytes)"


def nbytes(buf: Any) -> int:
    """The size in bytes of a numpy or torch buffer.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    return buf.nbytes if is_numpy(buf) else buf.numel() * buf.element_size()


class Request:
    """A posted send or receive; ``wait()`` blocks until it is done or its deadline passes.

    Fields a transport fills in: ``handle`` (its own request object), ``posted`` (a checked
    receive is posted once its message's size is known), ``error`` (a size mismatch found then,
    raised by ``wait``), ``header`` (torch: the size header's request and tensor), ``staging``
    (torch on Gloo: the host copy a CUDA tensor is received into), and on an
    emulated link ``end`` (when a send's egress is done), ``stamp`` (when a received message's
    sender started sending) and ``stamp_msg`` (MPI: the stamp's own message).
    Introduced in notebooks/02_parallel_computing.ipynb."""

    def __init__(self, comm: Comm, op: str, kind: str, peer: int, buf: Any, handle: Any,
                 tag: int = 0, checked: bool = False) -> None:
        self.comm, self.op, self.kind, self.peer, self.buf = comm, op, kind, peer, buf
        self.handle, self.tag, self.checked = handle, tag, checked
        self.posted, self.error, self.header = not (checked and kind == "recv"), None, None
        self.done, self.staging = False, None
        self.end, self.stamp, self.stamp_msg = None, None, None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; raise CommTimeout after ``timeout`` s (default: the comm's)."""
        if not self.done:
            timeout = self.comm.timeout if timeout is None else timeout
            try:
                done = self.comm.complete(self, timeout)
            except CommError:
                raise
            except RuntimeError as e:
                raise CommError(f"{self.what()} failed: {str(e).splitlines()[0]}") from e
            if not done:
                self.comm.forget(self)
                raise self.timed_out(timeout)
            self.done = True
            self.comm.emulate(self)
        return self.buf

    def what(self) -> str:
        """'rank 1: recv from rank 0 of 4 x float32 (16 bytes) over torch (world size 2)': how
        every error about this request starts."""
        c, where = self.comm, "to" if self.kind == "send" else "from"
        return (f"rank {c.rank}: {self.op} {where} rank {self.peer} of {describe(self.buf)} "
                f"over {c.transport} (world size {c.world_size})")

    def timed_out(self, timeout: float) -> CommTimeout:
        """The error of this request when it missed a deadline of ``timeout`` seconds."""
        return CommTimeout(f"{self.what()} did not complete within {timeout:g}s; is rank "
                           f"{self.peer} alive and calling the matching "
                           f"{'recv' if self.kind == 'send' else 'send'}?")

    def size_error(self, sent: int) -> CommError:
        """The error of a receive whose message (``sent`` bytes) does not fit its buffer."""
        mine, item = nbytes(self.buf), self.buf.itemsize
        elements = f"{sent // item} x {str(self.buf.dtype).replace('torch.', '')}" \
            if sent % item == 0 else "not a whole number of elements"
        return CommError(f"{self.what()}: rank {self.peer} sent {sent} bytes ({elements}) but "
                         f"the receive buffer holds {mine} bytes: a send and its receive must "
                         f"have the same size (the message was received and dropped)")


@contextmanager
def during(what: str, error: type[CommError] | None = None) -> Iterator[None]:
    """Put who, what and which step in front of a :class:`CommError` raised inside::

        with during(f"ring attention, forward step {step}"):
            request.wait()

    re-raises it as ``error`` (default: the same class, so a timeout stays a
    :class:`CommTimeout`) with ``what`` first and the transport's own message after it.
    Introduced in notebooks/02_parallel_computing.ipynb."""
    try:
        yield
    except CommError as e:
        raise (error or type(e))(f"{what}: {e}") from e


def whole_milliseconds(seconds: float) -> timedelta:
    """``seconds`` rounded up to a whole millisecond, at least one: torch's ``Work.wait`` keeps
    whole milliseconds (0.9999 s would become 999 ms, a deadline fired early) and takes 0 for
    no deadline at all. Introduced in notebooks/02_parallel_computing.ipynb."""
    return timedelta(milliseconds=max(1, math.ceil(seconds * 1000)))


def wait_work(work: Any, timeout: float, what: str, error: type[Exception] | None = None) -> None:
    """Wait for a native collective (a torch.distributed ``Work``) with a deadline. Past it, or
    on failure, raise ``error`` (default :class:`CommTimeout`, or :class:`CommError` when it
    failed otherwise) naming this rank, ``what`` and the deadline.
    Introduced in notebooks/02_parallel_computing.ipynb."""
    try:
        work.wait(whole_milliseconds(timeout))
    except RuntimeError as e:
        import torch.distributed as dist  # only callers holding a torch Work get here (loaded)
        text = str(e)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        cls = error or (CommTimeout if timed_out else CommError)
        first = text.splitlines()[0] if text else type(e).__name__
        mark_group_broken(f"{what}: {first}")  # Gloo closes the pairs it timed out on
        raise cls(f"rank {dist.get_rank()}: {what} did not complete within {timeout:g}s: "
                  f"{first}") from None


def wait_all(requests: Sequence[Request], timeout: float | None = None) -> None:
    """Wait on every request, all under one deadline.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    if requests:
        comm = requests[0].comm
        comm.wait_all(requests, comm.timeout if timeout is None else timeout)


class Comm:
    """What every transport shares: rank, world size, deadline, and the blocking forms.

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

    **The transport protocol.** A transport subclasses ``Comm``, sets ``transport`` (its name in
    error messages) and implements:

    * ``isend(buf, dst, tag=0, check_size=None, op="isend") -> Request`` and
      ``irecv(buf, src, tag=0, check_size=None, op="irecv") -> Request``: post the message and
      return at once. ``op`` is the name errors give the operation (``send`` calls
      ``isend(..., op="send")``). Both validate the peer with :meth:`check_peer`, ask
      :meth:`size_checked` whether the message carries its size, and ``irecv`` returns
      ``self.queue(request)``;
    * ``complete(request, timeout) -> bool``: wait until the request is done: True; False when
      ``timeout`` seconds passed first; raise :class:`CommError` (or the request's ``error``)
      when it failed. :meth:`Request.wait` calls it, then :meth:`forget` on a timeout or
      :meth:`emulate` on success;
    * ``barrier(timeout=None)``: every rank waits until all have arrived, with a deadline.

    and may override :meth:`wait_all` (one loop over many requests), :meth:`stamp` (where a
    received message's emulated-link stamp is), :meth:`emulate` and :meth:`sendrecv`. Checked
    receives not yet posted wait in :attr:`unposted`, in order, for the transport's ``post``
    (``post(request, deadline) -> bool``: post those of the request's peer and tag up to it,
    True once it is posted). :class:`Request` gives every transport its error messages:
    ``what()``, ``timed_out(timeout)`` and ``size_error(sent)``.

    Introduced in notebooks/02_parallel_computing.ipynb."""

    transport = "?"

    def __init__(self, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT,
                 check_sizes: bool | str = True, link: Any = None) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.check_sizes = check_sizes
        # the emulated link: this comm's own, else the process's (start_cluster(link=...))
        self.link = netem.current() if link is None else netem.make_link(link)
        # (peer, tag) -> checked receives waiting for their message's size, in the order posted
        self.unposted: dict[tuple[int, int], list[Request]] = {}
        self.bytes_sent = 0  # payload bytes this comm has sent (size headers not counted)

    # ------------------------------------------------------------ what a transport implements
    def isend(self, buf: Any, dst: int, tag: int = 0, check_size: bool | None = None,
              op: str = "isend") -> Request:
        """Post a send of ``buf`` to rank ``dst``; ``wait()`` on the request before reusing it."""
        raise NotImplementedError(f"{type(self).__name__} implements no isend")

    def irecv(self, buf: Any, src: int, tag: int = 0, check_size: bool | None = None,
              op: str = "irecv") -> Request:
        """Post a receive from rank ``src`` into ``buf``; ``wait()`` returns the filled ``buf``."""
        raise NotImplementedError(f"{type(self).__name__} implements no irecv")

    def complete(self, request: Request, timeout: float) -> bool:
        """Wait for ``request``: True when done, False when ``timeout`` s passed first."""
        raise NotImplementedError(f"{type(self).__name__} implements no complete")

    def barrier(self, timeout: float | None = None) -> None:
        """Every rank waits here until all have arrived (with a deadline)."""
        raise NotImplementedError(f"{type(self).__name__} implements no barrier")

    # ------------------------------------------------------------ what it uses
    def size_checked(self, check_size: bool | None) -> bool:
        """Whether a message carries its size: the call's choice, else the comm's."""
        if self.check_sizes == "always":
            return True
        return self.check_sizes if check_size is None else check_size

    def check_peer(self, peer: Any, op: str) -> int:
        """``peer`` as an int, or ValueError when it is not another rank of this comm."""
        if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.world_size):
            raise ValueError(f"rank {self.rank}: {op} peer must be a rank in "
                             f"0..{self.world_size - 1}, not {peer!r}")
        if peer == self.rank:
            raise ValueError(f"rank {self.rank}: {op} to itself; copy the buffer instead")
        return int(peer)

    def queue(self, request: Request) -> Request:
        """Keep a checked receive in line: messages from one peer and tag match in order."""
        if not request.posted:
            self.unposted.setdefault((request.peer, request.tag), []).append(request)
        return request

    def forget(self, request: Request) -> None:
        """A request that timed out leaves the line of receives waiting for their sizes."""
        line = self.unposted.get((request.peer, request.tag), [])
        if request in line:
            line.remove(request)

    def emulate(self, request: Request) -> None:
        """On an emulated link, a completed request waits until the link would have carried
        its message (see :mod:`course_lib.runtime.netem`)."""
        if self.link is None:
            return
        if request.kind == "send":
            netem.sleep_until(request.end)
        else:
            netem.receive(self.link, self.stamp(request), nbytes(request.buf))

    def stamp(self, request: Request) -> float | None:
        """When a received message's sender started sending it (its emulated-link stamp)."""
        return request.stamp

    def wait_all(self, requests: Sequence[Request], timeout: float) -> None:
        """Wait on every request under one deadline of ``timeout`` s (see :func:`wait_all`)."""
        deadline = time.monotonic() + timeout
        for r in requests:
            try:  # each waits for what is left of the one deadline, not a fresh timeout
                r.wait(max(deadline - time.monotonic(), 0.0))
            except CommTimeout:
                raise r.timed_out(timeout) from None  # name the whole deadline

    # ------------------------------------------------------------ the blocking forms
    def send(self, buf: Any, dst: int, tag: int = 0, timeout: float | None = None,
             check_size: bool | None = None) -> None:
        """Send ``buf`` to rank ``dst``; returns once the buffer may be reused."""
        self.isend(buf, dst, tag, check_size=check_size, op="send").wait(timeout)

    def recv(self, buf: Any, src: int, tag: int = 0, timeout: float | None = None,
             check_size: bool | None = None) -> Any:
        """Receive from rank ``src`` into ``buf`` (in place); returns ``buf``."""
        return self.irecv(buf, src, tag, check_size=check_size, op="recv").wait(timeout)

    def sendrecv(self, sendbuf: Any, dst: int, recvbuf: Any, src: int, tag: int = 0,
                 timeout: float | None = None, check_size: bool | None = None) -> Any:
        """Send to ``dst`` and receive from ``src`` at once: the step of every ring."""
        # the receive is posted before the send: in a ring of blocking sends every rank would
        # wait for its right neighbour to receive, which waits for its own right neighbour...
        reqs = [self.irecv(recvbuf, src, tag, check_size=check_size, op="sendrecv"),
                self.isend(sendbuf, dst, tag, check_size=check_size, op="sendrecv")]
        wait_all(reqs, timeout)
        return recvbuf

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.world_size}>"
