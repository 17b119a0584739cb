"""Allreduce built from scratch on point-to-point messages: naive, binomial tree and ring.

Introduced in notebooks/05_allreduce.ipynb. Every allreduce here reduces a contiguous torch
tensor or numpy array (any shape, any dtype) IN PLACE over a :mod:`course_lib.comm` communicator
and returns it, so the same call runs on cluster engines (Gloo / NCCL), under torchrun or mpiexec::

    from course_lib.comm import get_comm
    from course_lib.collectives import allreduce
    comm = get_comm("mpi")                                    # or "torch"
    allreduce(grads, comm, algorithm="ring", op="average")   # every rank now holds the mean

Cost for n elements on N ranks (alpha-beta model: course_lib.costmodel)::

    naive  2(N-1) steps at the root, each n elements: the root's link carries 2(N-1)n
    tree   2 ceil(log2 N) steps, each n elements: few messages, but all of the buffer each time
    ring   2(N-1) steps, each n/N elements: 2(N-1)n/N < 2n per rank whatever N (bandwidth optimal)

Before any data moves, every collective checks that all ranks called it with the same shape,
dtype, op and algorithm (:func:`course_lib.comm.agreement.check_agreement`): a mismatch raises
``ValueError`` on every rank instead of a wrong result or a hang. A rank that never calls makes
the others raise ``comm.CommTimeout`` naming it. ``op="average"`` sums and then divides by the
world size; for integer dtypes that division rounds down (floor division). Each phase uses its
own tag; NCCL ignores tags, which is fine because messages between two ranks arrive in order.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import numpy as np

from course_lib.comm import Comm, is_numpy, wait_all
from course_lib.comm.agreement import OPS, check_agreement
from course_lib.sharding import shard_bounds

if TYPE_CHECKING:  # for the annotations only: torch takes seconds to import
    import torch

Buffer = Union[np.ndarray, "torch.Tensor"]  # what every collective reduces in place

TAG_NAIVE, TAG_TREE_UP, TAG_TREE_DOWN, TAG_RS, TAG_AG = 12, 13, 14, 15, 16
TAG_A2A = 17
_NUMPY_OPS = {"sum": np.add, "average": np.add, "max": np.maximum, "min": np.minimum}
_SCRATCH = threading.local()  # receive buffers, reused from call to call


# ---------------------------------------------------------------- buffers and reductions
def _flat(buf):
    """A 1-D view of a contiguous buffer (no copy): what the algorithms index into."""
    return buf.reshape(-1) if is_numpy(buf) else buf.view(-1)


def _scratch(like, n):
    """A receive buffer of ``n`` elements like ``like``, kept from call to call (one per thread,
    dtype and device): fresh memory costs a page fault per 4 KiB, which at megabytes takes
    longer than the reduction itself. Gloo and NCCL keep their buffers for the same reason."""
    key = (is_numpy(like), like.dtype, None if is_numpy(like) else like.device)
    buf = _SCRATCH.__dict__.get(key)
    if buf is None or buf.shape[0] < n:
        buf = np.empty(n, like.dtype) if is_numpy(like) else like.new_empty(n)
        _SCRATCH.__dict__[key] = buf
    return buf[:n]


def _reduce_into(a, b, op):
    """``a = a op b`` in place: no temporary the size of ``a`` is allocated."""
    if is_numpy(a):
        return _NUMPY_OPS[op](a, b, out=a)
    import torch
    return {"max": torch.maximum, "min": torch.minimum}.get(op, torch.add)(a, b, out=a)


def divide(a: Buffer, world_size: int) -> None:
    """The second half of "average": divide in place; integer dtypes round down (floor).

    Introduced in notebooks/05_allreduce.ipynb."""
    if is_numpy(a):
        (np.floor_divide if a.dtype.kind in "iub" else np.divide)(a, world_size, out=a)
    elif a.is_floating_point() or a.is_complex():
        a.div_(world_size)
    else:
        a.div_(world_size, rounding_mode="floor")


def _begin(buf, comm, what, op, check, extra=0):
    """Start of every collective: agree across ranks (``check=True``), else just validate op.
    ``check=False`` saves one message round per call, for callers that already agreed (a
    training loop whose gradient shapes never change)."""
    if check:
        check_agreement(buf, comm, what, op, extra)
    elif op is not None and op not in OPS:
        raise ValueError(f"{what}: op must be one of {OPS}, not {op!r}")


# ---------------------------------------------------------------- naive and tree
def naive_allreduce(buf: Buffer, comm: Comm, op: str = "sum", check: bool = True) -> Buffer:
    """Every rank sends its buffer to rank 0, which reduces and sends the result to every rank.

    The root receives and sends N-1 full buffers one after another: 2(N-1) steps of n elements
    through one link, so time grows linearly with N. Introduced in notebooks/05_allreduce.ipynb.
    """
    _begin(buf, comm, "naive_allreduce", op, check)
    flat = _flat(buf)
    if comm.world_size == 1 or flat.shape[0] == 0:
        return buf
    if comm.rank == 0:
        tmp = _scratch(flat, flat.shape[0])
        for src in range(1, comm.world_size):
            _reduce_into(flat, comm.recv(tmp, src, tag=TAG_NAIVE, check_size=False), op)
        if op == "average":
            divide(flat, comm.world_size)
        wait_all([comm.isend(flat, dst, tag=TAG_NAIVE, check_size=False)
                  for dst in range(1, comm.world_size)])
    else:
        comm.send(flat, 0, tag=TAG_NAIVE, check_size=False)
        comm.recv(flat, 0, tag=TAG_NAIVE, check_size=False)
    return buf


def tree_allreduce(buf: Buffer, comm: Comm, op: str = "sum", check: bool = True) -> Buffer:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast back.

    In round k (k = 0, 1, ...) rank r with bit k set sends its partial result to r - 2^k and
    drops out; the broadcast retraces the tree. 2 ceil(log2 N) steps, each of n elements:
    few messages (good for small buffers), but every step moves the whole buffer.
    Introduced in notebooks/05_allreduce.ipynb.
    """
    _begin(buf, comm, "tree_allreduce", op, check)
    rank, world_size, flat = comm.rank, comm.world_size, _flat(buf)
    if world_size == 1 or flat.shape[0] == 0:
        return buf
    tmp = _scratch(flat, flat.shape[0])
    mask = 1
    while mask < world_size:  # reduce: leaves first, partial results flow towards rank 0
        if rank & mask:
            comm.send(flat, rank - mask, tag=TAG_TREE_UP, check_size=False)
            break
        if rank + mask < world_size:
            _reduce_into(flat, comm.recv(tmp, rank + mask, tag=TAG_TREE_UP, check_size=False), op)
        mask <<= 1
    if rank == 0 and op == "average":
        divide(flat, world_size)
    if rank != 0:  # broadcast: receive from the parent, then serve the subtree below
        comm.recv(flat, rank - mask, tag=TAG_TREE_DOWN, check_size=False)
    children = []
    while mask > 1:
        mask >>= 1
        if rank + mask < world_size:
            children.append(comm.isend(flat, rank + mask, tag=TAG_TREE_DOWN, check_size=False))
    wait_all(children)
    return buf


# ---------------------------------------------------------------- ring
def _segments(start, stop, size):
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


def _pipelined_step(flat, comm, op, send, recv, seg, tmp):
    """One reduce-scatter step in segments of ``seg`` elements. Every segment's receive is
    posted at once, each into its own slice of ``tmp``; a segment is reduced as soon as it has
    landed, while the later ones are still on their way."""
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size

    def post_sends():
        return [comm.isend(flat[a:b], right, tag=TAG_RS, check_size=False)
                for a, b in _segments(*send, seg)]

    sends = post_sends() if comm.rank < right else None  # one rank of a pair sends first:
    receives = [(a, b, comm.irecv(tmp[a - recv[0]:b - recv[0]], left, tag=TAG_RS, check_size=False))
                for a, b in _segments(*recv, seg)]  # NCCL runs a pair's operations in order
    sends = post_sends() if sends is None else sends
    for a, b, request in receives:
        _reduce_into(flat[a:b], request.wait(), op)
    wait_all(sends)


def ring_reduce_scatter(buf: Buffer, comm: Comm, op: str = "sum", check: bool = True,
                        segment_bytes: int = 0) -> tuple[int, int]:
    """Ring reduce-scatter: N-1 steps; in each, send one chunk right and add the one from the left.

    Returns ``(start, stop)``: on exit rank r holds the fully reduced chunk r, i.e.
    ``buf.reshape(-1)[start:stop]`` with chunks from ``sharding.shard_bounds``; the other chunks
    hold partial sums. Each step sends n/N elements; ``segment_bytes`` > 0 sends them as
    messages of that many bytes, each reduced as soon as it lands (the pipelined ring).
    Introduced in notebooks/05_allreduce.ipynb.
    """
    if not (isinstance(segment_bytes, (int, np.integer)) and segment_bytes >= 0):
        raise ValueError(f"segment_bytes must be an integer >= 0, not {segment_bytes!r}")
    _begin(buf, comm, "ring_reduce_scatter", op, check)
    rank, world_size, flat = comm.rank, comm.world_size, _flat(buf)
    # chunk c is flat[chunks[c][0]:chunks[c][1]]: N contiguous pieces, sizes differing by <= 1
    chunks = [shard_bounds(flat.shape[0], c, world_size) for c in range(world_size)]
    if world_size == 1 or flat.shape[0] == 0:
        return chunks[rank]
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # An arriving chunk is added to this rank's own copy of it, so it cannot land in place: it
    # lands in tmp, one chunk's worth (chunk 0 is a largest) reused at every step.
    tmp = _scratch(flat, chunks[0][1] - chunks[0][0])
    segment = max(1, segment_bytes // flat.itemsize) if segment_bytes else 0
    for step in range(world_size - 1):
        # Send the chunk this rank added into at the previous step (at step 0, chunk r-1: its
        # own data only); receive the one its left neighbour added into, chunk r-step-2, and
        # add it into place. So each chunk moves one hop right per step, one rank's data richer
        # each time; the chunk added into at the last step, r-(N-2)-2 = r-N = r (mod N), then
        # holds all N ranks' data: rank r ends with chunk r reduced.
        send = chunks[(rank - step - 1) % world_size]
        recv = chunks[(rank - step - 2) % world_size]
        if segment:
            _pipelined_step(flat, comm, op, send, recv, segment, tmp)
            continue
        (s0, s1), (r0, r1) = send, recv
        # Receive and send at once. Were every rank to send first with a blocking send (which
        # may wait until its receiver receives), each would wait on its right neighbour, all
        # the way round the ring: a deadlock. sendrecv posts the receive before the send.
        comm.sendrecv(flat[s0:s1], right, tmp[:r1 - r0], left, tag=TAG_RS, check_size=False)
        _reduce_into(flat[r0:r1], tmp[:r1 - r0], op)
    start, stop = chunks[rank]
    if op == "average":  # divide only the chunk this rank owns: 1/N of the work
        divide(flat[start:stop], world_size)
    return start, stop


def ring_allgather(buf: Buffer, comm: Comm, check: bool = True) -> Buffer:
    """Ring all-gather: N-1 steps; in each, pass the chunk received last step on to the right.

    On entry rank r's chunk r (``sharding.shard_bounds``) is valid; on exit every chunk is on every
    rank. Each step sends n/N elements. Introduced in notebooks/05_allreduce.ipynb.
    """
    _begin(buf, comm, "ring_allgather", None, check)
    rank, world_size = comm.rank, comm.world_size
    if world_size == 1:
        return buf
    flat = _flat(buf)
    chunks = [shard_bounds(flat.shape[0], c, world_size) for c in range(world_size)]
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):
        # Send chunk r-step: its own at step 0, then the one that arrived at the previous step.
        # Receive chunk r-step-1 straight into place: this phase only copies, and the chunk
        # arriving is never the one being sent, so nothing in flight is overwritten.
        s0, s1 = chunks[(rank - step) % world_size]
        r0, r1 = chunks[(rank - step - 1) % world_size]
        comm.sendrecv(flat[s0:s1], right, flat[r0:r1], left, tag=TAG_AG, check_size=False)
    return buf


def ring_allreduce(buf: Buffer, comm: Comm, op: str = "sum", check: bool = True) -> Buffer:
    """Ring allreduce = ring reduce-scatter + ring all-gather (Baidu; Patarasuk & Yuan 2009).

    2(N-1) steps, each sending n/N elements to the right neighbour and receiving n/N from the
    left: each rank sends 2(N-1)n/N < 2n elements whatever N, which is bandwidth optimal.
    Introduced in notebooks/05_allreduce.ipynb.
    """
    _begin(buf, comm, "ring_allreduce", op, check)
    if comm.world_size > 1 and _flat(buf).shape[0] > 0:
        ring_reduce_scatter(buf, comm, op, check=False)  # agreed above: no second round
        ring_allgather(buf, comm, check=False)
    return buf


def ring_allreduce_pipelined(buf: Buffer, comm: Comm, op: str = "sum",
                             segment_bytes: int = 1 << 20, check: bool = True) -> Buffer:
    """The ring allreduce with each reduce-scatter step cut into segments of ``segment_bytes``.

    The plain ring receives a whole chunk and only then reduces it, while the link sits idle.
    Here all segments of a step are in flight at once and each is reduced as soon as it lands,
    so reduction overlaps transfer (as in NCCL and Gloo). Same 2(N-1) steps of n/N elements,
    each sent as ceil(n/N / segment) messages. Introduced in notebooks/05_allreduce.ipynb.
    """
    if not (isinstance(segment_bytes, (int, np.integer)) and segment_bytes > 0):
        raise ValueError(f"segment_bytes must be a positive integer, not {segment_bytes!r}")
    _begin(buf, comm, "ring_allreduce_pipelined", op, check, extra=segment_bytes)
    if comm.world_size > 1 and _flat(buf).shape[0] > 0:
        ring_reduce_scatter(buf, comm, op, check=False, segment_bytes=segment_bytes)
        ring_allgather(buf, comm, check=False)
    return buf


ALGORITHMS = {"naive": naive_allreduce, "tree": tree_allreduce, "ring": ring_allreduce,
              "ring_pipelined": ring_allreduce_pipelined}


def allreduce(buf: Buffer, comm: Comm, algorithm: str = "ring", op: str = "sum",
              check: bool = True) -> Buffer:
    """Allreduce ``buf`` in place with one of ``ALGORITHMS``; returns ``buf``.

    ``check=False`` skips the agreement round (shapes, dtypes, op) that guards every call.

    Introduced in notebooks/05_allreduce.ipynb.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {tuple(ALGORITHMS)}, not {algorithm!r}")
    return ALGORITHMS[algorithm](buf, comm, op=op, check=check)


def _all_to_all_offsets(send, recv, comm, send_counts, recv_counts, check):
    """Where each rank's block starts in ``send`` and ``recv`` (rows; N + 1 offsets each), after
    checking the counts: each list has N blocks adding up to its buffer's rows, and (``check``,
    counts given) every rank receives what the others declare they send it, one small
    all-gather of the counts before any data moves (a count that disagrees would otherwise reach
    the transport as a size mismatch; equal blocks need no round of their own)."""
    n, r = comm.world_size, comm.rank
    given = send_counts is not None or recv_counts is not None
    send_counts = list(send_counts) if send_counts is not None else [send.shape[0] // n] * n
    recv_counts = list(recv_counts) if recv_counts is not None else [recv.shape[0] // n] * n
    if len(send_counts) != n or sum(send_counts) != send.shape[0]:
        raise ValueError(f"rank {r}: send_counts {send_counts} must give {n} blocks that add "
                         f"up to send's {send.shape[0]} rows")
    if len(recv_counts) != n or sum(recv_counts) != recv.shape[0]:
        raise ValueError(f"rank {r}: recv_counts {recv_counts} must give {n} blocks that add "
                         f"up to recv's {recv.shape[0]} rows")
    if send.shape[1:] != recv.shape[1:] or send.dtype != recv.dtype:
        raise ValueError(f"rank {r}: send rows {tuple(send.shape[1:])} {send.dtype} and recv "
                         f"rows {tuple(recv.shape[1:])} {recv.dtype} differ")
    if n > 1 and given and check:
        gathered = np.zeros((n, n), np.int64)  # row q: what rank q sends to each rank
        gathered[r] = send_counts
        ring_allgather(gathered, comm, check=False)
        expected = gathered[:, r].tolist()
        if expected != recv_counts:
            raise ValueError(f"rank {r}: recv_counts {recv_counts}, but the ranks send it "
                             f"{expected} rows")
    return (np.concatenate([[0], np.cumsum(send_counts)]).tolist(),
            np.concatenate([[0], np.cumsum(recv_counts)]).tolist())


def all_to_all(send: Buffer, recv: Buffer, comm: Comm, send_counts: Sequence[int] | None = None,
               recv_counts: Sequence[int] | None = None, check: bool = True) -> Buffer:
    """All-to-all by pairwise exchange: rank r's block for rank q (rows of ``send``, its first
    dimension cut into N blocks of ``send_counts`` rows, equal by default) lands in rank q's
    ``recv`` as block r (``recv_counts`` rows). N - 1 steps: at step s rank r sends to r + s and
    receives from r - s, so every pair meets once and nobody waits on a rank that is busy with
    another (its own block is copied). Each step moves one block: about (N-1)/N of the buffer
    in all, with N - 1 latencies. Uneven counts (a mixture of experts' tokens per expert) are
    checked against the ones the other ranks declare before anything moves (``check=False``
    skips that round when the counts were just exchanged).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    n, r = comm.world_size, comm.rank
    send_at, recv_at = _all_to_all_offsets(send, recv, comm, send_counts, recv_counts, check)
    recv[recv_at[r]:recv_at[r + 1]] = send[send_at[r]:send_at[r + 1]]  # its own block: a copy
    for step in range(1, n):
        to, frm = (r + step) % n, (r - step) % n
        comm.sendrecv(send[send_at[to]:send_at[to + 1]], to,
                      recv[recv_at[frm]:recv_at[frm + 1]], frm, tag=TAG_A2A, check_size=False)
    return recv


def naive_all_to_all(send: Buffer, recv: Buffer, comm: Comm,
                     send_counts: Sequence[int] | None = None,
                     recv_counts: Sequence[int] | None = None, check: bool = True) -> Buffer:
    """All-to-all through rank 0, the naive way: every rank sends its whole buffer (and its
    counts) to rank 0, which cuts every buffer into blocks and sends each rank the blocks for
    it. Rank 0's link carries everything, twice: 2 (N-1) messages of a whole buffer, where the
    pairwise exchange (:func:`all_to_all`) sends N - 1 blocks per rank, all links at once.
    Introduced in notebooks/15_mixture_of_experts.ipynb."""
    n, r = comm.world_size, comm.rank
    send_at, recv_at = _all_to_all_offsets(send, recv, comm, send_counts, recv_counts, check)
    if n == 1:
        recv[:] = send
        return recv
    counts = np.diff(np.asarray([send_at], np.int64), axis=1)  # (1, N): what this rank sends
    if r != 0:
        comm.send(counts, 0, tag=TAG_A2A, check_size=False)
        comm.send(send, 0, tag=TAG_A2A, check_size=False)
        comm.recv(recv, 0, tag=TAG_A2A, check_size=False)
        return recv
    table = np.zeros((n, n), np.int64)  # row q: what rank q sends to each rank
    table[0] = counts[0]
    buffers = [send]
    for src in range(1, n):
        comm.recv(table[src:src + 1], src, tag=TAG_A2A, check_size=False)
        whole = _rows_like(send, int(table[src].sum()))
        buffers.append(comm.recv(whole, src, tag=TAG_A2A, check_size=False))
    starts = np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(table, axis=1)], axis=1)
    for dst in range(n):  # dst's buffer: block dst of every rank's, in rank order
        blocks = _concat([buffers[src][starts[src, dst]:starts[src, dst + 1]]
                          for src in range(n)])
        if dst == 0:
            recv[:] = blocks
        else:
            comm.send(blocks, dst, tag=TAG_A2A, check_size=False)
    return recv


def _rows_like(like, rows):
    """An empty buffer of ``rows`` rows shaped, typed and placed like ``like``'s."""
    if is_numpy(like):
        return np.empty((rows, *like.shape[1:]), like.dtype)
    return like.new_empty((rows, *like.shape[1:]))


def _concat(parts):
    if is_numpy(parts[0]):
        return np.concatenate(parts)
    import torch  # a torch buffer's process has torch loaded already
    return torch.cat(parts)


ALL_TO_ALL = {"pairwise": all_to_all, "naive": naive_all_to_all}
