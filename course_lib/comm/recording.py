"""A transport that records every message: N ranks as threads of one process.

Introduced in notebooks/05_allreduce.ipynb, where it draws the ring allreduce step by step from
the library's own code. :func:`run_ranks` runs ``fn(buffers[r], comm)`` on one thread per rank,
each with a :class:`RecordingComm`, and returns what each returned and every message sent::

    from course_lib.collectives import ring_allreduce
    from course_lib.comm.recording import run_ranks
    buffers = [np.full(6, 10.0 ** r) for r in range(3)]
    results, messages = run_ranks(ring_allreduce, buffers)   # every buffer now holds 111.0
    [(m.step, m.src, m.dst, m.offset, m.count) for m in messages if m.tag == 15]

It is a real transport of the :class:`course_lib.comm.base.Comm` protocol (the same checks,
errors and deadlines) with no network under it: a send copies its buffer into the receiver's
mailbox and completes at once (as an eager MPI send of a small message does), a receive waits,
with a deadline, for the message posted in the same order from its peer and tag. No process
group, no engines: it runs in a notebook's own kernel in milliseconds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from course_lib.comm.base import (
    DEFAULT_TIMEOUT,
    Comm,
    CommError,
    CommTimeout,
    Request,
    nbytes,
    to_numpy,
)


@dataclass(frozen=True)
class Message:
    """One message a :class:`RecordingComm` sent (notebook 05_allreduce).

    ``step``: how many messages its sender had sent on the same tag before it (in a ring, where
    each rank sends one message a step, the step); ``offset``/``count``: where the payload lies
    in the sender's watched buffer, in elements (``offset`` None when it is not a slice of it);
    ``sender_state``: a copy of the sender's watched buffer when it sent (None without one).
    Introduced in notebooks/05_allreduce.ipynb."""

    step: int
    src: int
    dst: int
    tag: int
    offset: int | None
    count: int
    nbytes: int
    sender_state: np.ndarray | None = field(default=None, compare=False, repr=False)


def _address(buf: Any) -> int:
    return buf.__array_interface__["data"][0] if isinstance(buf, np.ndarray) else buf.data_ptr()


def _raw(buf: Any) -> np.ndarray:
    """The bytes of a contiguous numpy or CPU torch buffer, as a flat uint8 view."""
    flat = to_numpy(buf)
    if not flat.flags.c_contiguous:
        raise ValueError(f"buffers must be contiguous, got strides {flat.strides}")
    return flat.reshape(-1).view(np.uint8)


class Network:
    """The mailboxes the :class:`RecordingComm` s of one run share, and the record of messages.

    Introduced in notebooks/05_allreduce.ipynb."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.messages: list[Message] = []  # every message, in the order sent
        self.failed: str | None = None  # why the run stopped: the first rank that raised
        self._cond = threading.Condition()
        self._barrier = threading.Barrier(world_size)
        # (src, dst, tag) -> {sequence number: payload}; a receive takes the number of messages
        # posted before it on its channel, so messages match receives in order, as MPI's do
        self._mail: dict[tuple[int, int, int], dict[int, np.ndarray]] = {}
        self._sent: dict[tuple[int, int, int], int] = {}
        self._taken: dict[tuple[int, int, int], int] = {}
        self._steps: dict[tuple[int, int], int] = {}

    def deliver(self, message: Message, payload: np.ndarray) -> None:
        """Put ``payload`` in its receiver's mailbox and record ``message``."""
        key = (message.src, message.dst, message.tag)
        with self._cond:
            seq = self._sent.get(key, 0)
            self._sent[key] = seq + 1
            self._mail.setdefault(key, {})[seq] = payload
            self.messages.append(message)
            self._cond.notify_all()

    def next_step(self, src: int, tag: int) -> int:
        """The step of ``src``'s next message on ``tag`` (its count of earlier ones)."""
        with self._cond:
            step = self._steps.get((src, tag), 0)
            self._steps[(src, tag)] = step + 1
            return step

    def ticket(self, src: int, dst: int, tag: int) -> int:
        """A receive's place in line on its channel: which message of it the receive gets."""
        with self._cond:
            seq = self._taken.get((src, dst, tag), 0)
            self._taken[(src, dst, tag)] = seq + 1
            return seq

    def take(self, src: int, dst: int, tag: int, seq: int, timeout: float) -> np.ndarray | None:
        """Message ``seq`` of the channel, once it is there; None past ``timeout`` seconds.
        Raises :class:`CommError` once another rank has failed (its message will never come)."""
        box = (src, dst, tag)
        with self._cond:
            if not self._cond.wait_for(lambda: seq in self._mail.get(box, {}) or self.failed,
                                       timeout):
                return None
            if seq not in self._mail.get(box, {}):
                raise CommError(self.failed)
            return self._mail[box].pop(seq)

    def barrier(self, timeout: float) -> bool:
        """Wait until every rank has arrived: False past ``timeout`` or after a failure."""
        try:
            self._barrier.wait(timeout)
        except threading.BrokenBarrierError:
            return False
        return True

    def fail(self, why: str) -> None:
        """Stop the run: every wait of every rank raises instead of waiting for its deadline."""
        with self._cond:
            self.failed = self.failed or why
            self._cond.notify_all()
        self._barrier.abort()


class RecordingComm(Comm):
    """A rank of an in-process run (one thread each) that records every message it sends.

    ``network`` is shared by the run's ranks; ``watch`` (the rank's main buffer, optional) is
    what each :class:`Message` locates its payload in and copies as ``sender_state``.
    Normally made by :func:`run_ranks`. Introduced in notebooks/05_allreduce.ipynb."""

    transport = "recording"

    def __init__(self, rank: int, network: Network, timeout: float = DEFAULT_TIMEOUT,
                 check_sizes: bool | str = True, watch: Any = None) -> None:
        super().__init__(rank, network.world_size, timeout, check_sizes)
        self.link = None  # ranks are threads of one process: no emulated interface of their own
        self.network, self.watch = network, watch

    def _locate(self, buf: Any) -> int | None:
        """Where ``buf`` starts in the watched buffer, in elements; None if it is not in it."""
        if self.watch is None or buf.dtype != self.watch.dtype:
            return None
        # bytes from the watched buffer's start, in whole elements; ``size``, the remainder, is 0
        # when ``buf`` starts on an element of it (a slice does; an unrelated buffer need not)
        offset, size = divmod(_address(buf) - _address(self.watch), buf.itemsize)
        inside = 0 <= offset and offset + nbytes(buf) // buf.itemsize <= nbytes(self.watch) \
            // buf.itemsize
        return offset if size == 0 and inside else None

    def isend(self, buf: Any, dst: int, tag: int = 0, check_size: bool | None = None,
              op: str = "isend") -> Request:
        """Copy ``buf`` into ``dst``'s mailbox and record it; the send is complete at once."""
        dst = self.check_peer(dst, op)
        payload = _raw(buf).copy()  # a copy: the sender may reuse its buffer once the send is done
        req = Request(self, op, "send", dst, buf, None, tag, self.size_checked(check_size))
        self.bytes_sent += payload.nbytes
        state = None if self.watch is None else to_numpy(self.watch).copy()
        self.network.deliver(Message(self.network.next_step(self.rank, tag), self.rank, dst, tag,
                                     self._locate(buf), payload.nbytes // buf.itemsize,
                                     payload.nbytes, state), payload)
        return req

    def irecv(self, buf: Any, src: int, tag: int = 0, check_size: bool | None = None,
              op: str = "irecv") -> Request:
        """Take a place in line for the next message from ``src`` on ``tag``."""
        src = self.check_peer(src, op)
        _raw(buf)  # contiguous, or ValueError now
        req = Request(self, op, "recv", src, buf, self.network.ticket(src, self.rank, tag), tag,
                      self.size_checked(check_size))
        req.posted = True  # its place in line is its ticket: nothing waits in ``unposted``
        return req

    def complete(self, req: Request, timeout: float) -> bool:
        """A send is done; a receive waits for its message and copies it into its buffer."""
        if req.kind == "send":
            return True
        try:
            payload = self.network.take(req.peer, self.rank, req.tag, req.handle, timeout)
        except CommError as e:
            raise CommError(f"{req.what()} failed: {e}") from None
        if payload is None:
            return False
        if payload.nbytes != nbytes(req.buf):  # dropped, checked or not: nothing to copy into
            raise req.size_error(payload.nbytes)
        _raw(req.buf)[:] = payload
        return True

    def barrier(self, timeout: float | None = None) -> None:
        """Every rank (thread) waits here until all have arrived, with a deadline."""
        timeout = self.timeout if timeout is None else timeout
        if not self.network.barrier(timeout):
            raise CommTimeout(f"rank {self.rank}: barrier over recording did not complete "
                              f"within {timeout:g}s (world size {self.world_size}): a rank is "
                              "missing")


def run_ranks(fn: Callable[..., Any], buffers: Sequence[Any], *args: Any,
              timeout: float = DEFAULT_TIMEOUT, check_sizes: bool | str = True,
              **kwargs: Any) -> tuple[list[Any], list[Message]]:
    """Run ``fn(buffers[r], comm, *args, **kwargs)`` for every rank r on a thread of its own,
    ``comm`` a :class:`RecordingComm` watching ``buffers[r]``; returns (what each rank returned,
    every message in the order sent). The first rank to raise stops the others (their waits
    raise at once) and its exception is raised here.
    Introduced in notebooks/05_allreduce.ipynb."""
    network = Network(len(buffers))
    results: list[Any] = [None] * len(buffers)
    failures: list[BaseException] = []  # in the order raised: the first is the cause

    def rank_main(rank: int) -> None:
        comm = RecordingComm(rank, network, timeout, check_sizes, watch=buffers[rank])
        try:
            results[rank] = fn(buffers[rank], comm, *args, **kwargs)
        except BaseException as e:  # handed to the caller below
            failures.append(e)
            network.fail(f"rank {rank} failed: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank {r}", daemon=True)
               for r in range(len(buffers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return results, network.messages
