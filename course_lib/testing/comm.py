"""Self-checks of course_lib.comm on every rank: round trips, errors and deadlines.

Introduced with notebooks/02_parallel_computing.ipynb; tests/test_comm.py runs these on cluster
engines and under mpiexec. Each function returns a list of problems ([] when all is well) or
what an error said, so a test can assert on every rank's report at once.
"""

from __future__ import annotations

import time

import numpy as np

from course_lib.comm import CommError, CommTimeout, get_comm, to_numpy, wait_all
from course_lib.testing.collectives import buffer_kind, make_buffer

P2P_DTYPES = ("float16", "float32", "float64", "int32", "int64", "uint8", "bool")


def p2p_roundtrips(transport="torch", timeout=10.0, kind=None, big_bytes=1 << 20):
    """Exercise every point-to-point operation of course_lib.comm; return the problems found.

    Blocking send/recv between pairs, isend/irecv and sendrecv around a ring (``big_bytes``
    too: it must not deadlock), two tags received in reverse order, every dtype, empty
    buffers, barrier. ``kind``: "numpy" or "torch" buffers. Runs on every rank (world size >= 2).
    Introduced in notebooks/02_parallel_computing.ipynb (tested from tests/test_comm.py).
    """
    comm = get_comm(transport, timeout=timeout)
    kind = kind or buffer_kind(comm)
    rank, world_size = comm.rank, comm.world_size
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    problems = []

    def expect(what, got, want):
        if not np.array_equal(to_numpy(got), want):
            problems.append(f"rank {rank}: {what}: got {to_numpy(got)[:4]}, want {want[:4]}")

    def data(src, n=5, dtype="float32"):
        return (np.arange(n) * 3 + src * 100).astype(dtype)

    partner = rank ^ 1
    if partner < world_size:  # blocking: the even rank of a pair sends first, the odd receives
        recv = make_buffer(np.zeros(5, np.float32), comm, kind)
        if rank % 2 == 0:
            comm.send(make_buffer(data(rank), comm, kind), partner)
            comm.recv(recv, partner)
        else:
            comm.recv(recv, partner)
            comm.send(make_buffer(data(rank), comm, kind), partner)
        expect("send/recv", recv, data(partner))
    recv = make_buffer(np.zeros(5, np.float32), comm, kind)
    reqs = [comm.irecv(recv, left, tag=3), comm.isend(make_buffer(data(rank), comm, kind), right,
                                                      tag=3)]
    wait_all(reqs)
    expect("isend/irecv", recv, data(left))
    first, second = (make_buffer(np.zeros(5, np.float32), comm, kind) for _ in range(2))
    reqs = [comm.isend(make_buffer(data(rank), comm, kind), right, tag=1),
            comm.isend(make_buffer(data(rank + 1), comm, kind), right, tag=2)]
    comm.recv(second, left, tag=2)  # the later tag first: matched by tag, not by order
    comm.recv(first, left, tag=1)
    wait_all(reqs)
    expect("tag 1", first, data(left))
    expect("tag 2", second, data(left + 1))
    n_big = big_bytes // 4
    big = make_buffer(data(rank, n_big), comm, kind)
    recv = make_buffer(np.zeros(n_big, np.float32), comm, kind)
    expect(f"sendrecv ring of {big_bytes} bytes", comm.sendrecv(big, right, recv, left),
           data(left, n_big))
    dtypes = P2P_DTYPES + (("bfloat16",) if kind == "torch" else ())
    for dtype in dtypes:
        if dtype == "bfloat16":
            import torch
            send = torch.arange(7, dtype=torch.bfloat16) + rank
            recv = torch.zeros(7, dtype=torch.bfloat16)
            comm.sendrecv(send, right, recv, left)
            expect("bfloat16", recv.float(), np.arange(7, dtype=np.float32) + left)
            continue
        want = data(left, 7, dtype)
        got = comm.sendrecv(make_buffer(data(rank, 7, dtype), comm, kind), right,
                            make_buffer(np.zeros(7, dtype), comm, kind), left)
        expect(dtype, got, want)
    empty = make_buffer(np.zeros(0, np.float32), comm, kind)
    expect("empty", comm.sendrecv(empty, right, make_buffer(np.zeros(0, np.float32), comm, kind),
                                  left), np.zeros(0, np.float32))
    matrix = make_buffer(np.zeros((3, 4), np.int64), comm, kind)  # any shape, received in place
    comm.sendrecv(make_buffer(np.full((3, 4), rank, np.int64), comm, kind), right, matrix, left)
    expect("(3, 4) matrix", matrix, np.full((3, 4), left, np.int64))
    comm.barrier()
    return problems


def p2p_errors(transport="torch", kind=None):
    """Mistakes caught before anything is sent: a dict naming each and its ValueError message.

    Introduced in notebooks/02_parallel_computing.ipynb (tested from tests/test_comm.py).
    """
    comm = get_comm(transport)
    kind = kind or buffer_kind(comm)
    buf = make_buffer(np.zeros(4, np.float32), comm, kind)
    strided = make_buffer(np.zeros((4, 4), np.float32), comm, kind)[:, 0]
    cases = {"self": lambda: comm.send(buf, comm.rank),
             "out of range": lambda: comm.recv(buf, comm.world_size),
             "negative": lambda: comm.isend(buf, -1),
             "not an int": lambda: comm.irecv(buf, 1.0),
             "non-contiguous": lambda: comm.isend(strided, (comm.rank + 1) % comm.world_size)}
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = f"ValueError: {e}"
    return out


MISMATCH_SIZES = (5, 3, 0, 4)  # float32 elements rank 0 sends; rank 1 receives 4 each time


def p2p_size_mismatch(transport="torch", kind=None, timeout=10.0, check_sizes=True,
                      check_size=None):
    """Messages that do not fit their receive buffers: rank 0 sends ``MISMATCH_SIZES`` float32
    (values: the message's index) and rank 1 receives each into 4 elements, blocking; then
    three messages of 5, 4 and 4 into three receives posted first and waited in reverse order.
    Rank 1 returns, per message, the error it raised or the values it got; rank 0 "sent";
    other ranks None. ``check_sizes`` (of the comm) and ``check_size`` (of every call) as in
    :class:`course_lib.comm.Comm`. Introduced in notebooks/02_parallel_computing.ipynb.
    """
    comm = get_comm(transport, timeout=timeout, check_sizes=check_sizes)
    kind = kind or buffer_kind(comm)
    if comm.rank > 1:
        return None
    if comm.rank == 0:
        for i, n in enumerate(MISMATCH_SIZES):
            comm.send(make_buffer(np.full(n, i, np.float32), comm, kind), 1, tag=3,
                      check_size=check_size)
        for i, n in enumerate((5, 4, 4)):
            comm.send(make_buffer(np.full(n, i, np.float32), comm, kind), 1, tag=4,
                      check_size=check_size)
        return "sent"
    got = []
    for _ in MISMATCH_SIZES:
        buf = make_buffer(np.full(4, -1, np.float32), comm, kind)
        try:
            got.append(to_numpy(comm.recv(buf, 0, tag=3, check_size=check_size)).tolist())
        except CommError as e:
            got.append(str(e))
    bufs = [make_buffer(np.full(4, -1, np.float32), comm, kind) for _ in range(3)]
    requests = [comm.irecv(b, 0, tag=4, check_size=check_size) for b in bufs]
    posted = []
    for r in reversed(requests):  # the last first: the earlier ones still match in order
        try:
            posted.append(to_numpy(r.wait()).tolist())
        except CommError as e:
            posted.append(str(e))
    return got + posted[::-1]


def p2p_timeout(silent_rank=1, op="recv", transport="torch", timeout=1.0, linger=0.0,
                catch=True):
    """Every rank but ``silent_rank`` waits on it (``op``: "recv" or "barrier").

    With ``catch``, returns ``(message, seconds)`` of the CommTimeout on the waiting ranks (else
    it propagates), None on the silent rank, which stays ``linger`` s before returning (a process
    that exits closes its Gloo links). Introduced in notebooks/02_parallel_computing.ipynb.
    """
    comm = get_comm(transport, timeout=timeout)
    if comm.rank == silent_rank:
        time.sleep(linger)
        return None
    t = time.monotonic()
    try:
        if op == "barrier":
            comm.barrier()
        else:
            comm.recv(make_buffer(np.zeros(256, np.float32), comm, "numpy"), silent_rank, tag=9)
    except CommTimeout as e:
        if not catch:
            raise
        return str(e), time.monotonic() - t
    return "no timeout", time.monotonic() - t


def make_subgroup(world_size: int) -> bool:
    """Make (and cache, as lessons and checks do) the subgroup of the first ``world_size`` ranks;
    return whether this rank is in it. Every rank calls it (tests/test_cluster.py)."""
    import torch.distributed as dist

    from course_lib.comm.subgroups import subgroup
    subgroup(world_size)
    return dist.get_rank() < world_size
