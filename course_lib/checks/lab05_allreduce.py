"""Lab 05 checks: a student's ring reduce-scatter, all-gather, allreduce and two-way ring.

Introduced in labs/05_allreduce.ipynb. The student's functions are defined in the notebook and
run on every engine of a small cluster (they are sent with cloudpickle, so the helpers and
imports they use travel with them)::

    from course_lib.checks import lab05_allreduce as checks
    cluster = start_cluster(n=3)
    checks.check_ring_reduce_scatter(ring_reduce_scatter, cluster)
    checks.check_ring_allgather(ring_allgather, cluster)
    checks.check_ring_allreduce(ring_allreduce, cluster)   # against dist.all_reduce
    checks.check_bidirectional_ring_allreduce(two_way_ring_allreduce, cluster)   # stretch

Each case gives every rank a 1-D torch tensor (lengths that do not divide by the world size,
shorter than it, several dtypes). Values are multiples of 1/4 small enough that every sum is
exact in every dtype, so results are compared exactly, and a wrong chunk can be decoded into
"which ranks' data does it hold" to give a targeted hint. The student's comm counts what each
rank sends, so a correct result reached by something other than the ring (too many messages, a
wrong neighbour, whole buffers) fails too. A rank that waits past its deadline (a blocking send
cycle) comes back as a hint, never a hang. Like every check of :mod:`course_lib.checks`, a
function that still raises ``NotImplementedError`` makes the check print a notice and return
False.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from course_lib.checks.framework import (
    Case,
    CheckFailed,
    compare,
    not_implemented,
    pack_function,
)
from course_lib.sharding import shard_bounds

# seconds each point-to-point wait of the student's code may take: a short deadline, so that a
# blocking send cycle comes back as a hint within seconds (the library's waits default to 30 s)
STUDENT_TIMEOUT = 5.0
MARK = -10_000  # placeholder values of the all-gather cases are <= MARK; real sums are not

SCHEDULE = {
    "reduce-scatter": "Work out which chunk moves in step s from the exercise's two rules (a rank "
                      "sends the chunk it added to in the step before; after the last step rank "
                      "r holds chunk r summed over all ranks) and check it on the figure's 3 "
                      "ranks.",
    "all-gather": "Work out which chunk moves in step s from the exercise's rule (a rank sends "
                  "its own chunk first, then always the one it has just received, and an "
                  "arriving chunk goes straight into its place) and check it on the figure.",
    # the stretch exercise: the two halves of the buffer go around in opposite directions
    "two-way": "The second half's schedule is the mirror image of the ring of exercises 1 and "
               "2 (left and right swapped, derived from the same two rules), on its own N "
               "chunks; in each step post both receives and both sends, then wait for all "
               "four.",
}
SENDRECV = ("use comm.sendrecv(sendbuf, right, recvbuf, left) for each step: it posts the "
            "receive before the send, so a ring of them cannot block")


# ---------------------------------------------------------------- on every rank
# ``run_student`` unpacks the student's function (sent by ``pack_function``), builds this rank's
# case from a seed, runs it over a :class:`CountingComm` that records every message, and returns
# what came back and what was sent; ``run_timed`` times it beside ``dist.all_reduce``.
class CountingComm:
    """Forwards everything to ``comm`` and records (peer, bytes) of each message this rank sends."""

    def __init__(self, comm):
        self._comm, self.sent = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _count(self, buf, dst):
        self.sent.append((int(dst), int(buf.numel() * buf.element_size())
                          if hasattr(buf, "numel") else int(buf.nbytes)))

    def send(self, buf, dst, tag=0, timeout=None, **kwargs):
        self._count(buf, dst)
        return self._comm.send(buf, dst, tag, timeout, **kwargs)

    def isend(self, buf, dst, tag=0, **kwargs):  # the library's own ring passes check_size
        self._count(buf, dst)
        return self._comm.isend(buf, dst, tag, **kwargs)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0, timeout=None, **kwargs):
        self._count(sendbuf, dst)
        return self._comm.sendrecv(sendbuf, dst, recvbuf, src, tag, timeout, **kwargs)


def case_inputs(exercise, n, dtype, seed, world_size):
    """Every rank's input buffer as numpy arrays (the same on the client and on every engine).

    Values are multiples of 1/4 (integers for integer dtypes), so every sum is exact. For
    "all-gather" rank r holds the final chunk r and marks element i of every other chunk with
    MARK * (r + 1) - i (no sum is that negative), so an untouched chunk can be recognised."""
    rng = [np.random.default_rng([seed, n, q]) for q in range(world_size)]
    if np.dtype(dtype).kind in "iu":
        data = [g.integers(-1000, 1000, n) for g in rng]
    else:
        data = [g.integers(-64, 64, n) / 4 for g in rng]
    data = [x.astype(dtype) for x in data]
    if exercise != "all-gather":
        return data
    full = np.sum(data, axis=0, dtype=np.float64).astype(dtype)
    out = []
    for r in range(world_size):
        x = (MARK * (r + 1) - np.arange(n)).astype(dtype)
        a, b = shard_bounds(n, r, world_size)
        x[a:b] = full[a:b]
        out.append(x)
    return out


def run_student(payload, exercise, n, dtype, seed, timeout=STUDENT_TIMEOUT):
    """On every rank: run the student's function (cloudpickled) on this rank's case input.

    Returns {"returned": what it returned (a tuple of ints, or a short description), "buf":
    the buffer afterwards, "sent": [(peer, bytes)], "native": dist.all_reduce of the input}."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    from course_lib.comm import get_comm
    fn = cloudpickle.loads(payload)
    comm = CountingComm(get_comm("torch", timeout=timeout))
    x = case_inputs(exercise, n, dtype, seed, comm.world_size)[comm.rank]
    native = None
    if exercise in ("allreduce", "two-way"):  # the production allreduce of the same input
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t)
        native = t.numpy()
    buf = torch.from_numpy(x.copy())
    out = fn(buf, comm)
    returned = None
    if exercise == "reduce-scatter":
        try:
            if hasattr(out, "numel") and out.numel() != 2:
                raise TypeError("a tensor")
            returned = tuple(int(v) for v in out)
        except (TypeError, ValueError):
            returned = "None" if out is None else f"a {type(out).__name__}"
    return {"returned": returned, "buf": buf.numpy().copy(), "sent": comm.sent, "native": native}


def run_timed(payload, sizes, repeats, timeout=STUDENT_TIMEOUT, against="native"):
    """On every rank: for each size (bytes of float32), the median over ``repeats`` rounds of
    the slowest rank's time, for the student's allreduce and for ``dist.all_reduce``
    (``against="native"``) or the course's ring (``against="ring"``, without its agreement
    round: on an emulated link, both pay for every message)."""
    import time

    import cloudpickle
    import torch
    import torch.distributed as dist

    from course_lib.comm import get_comm
    # the student's ring passed the checks: time it without the per-message size check, as
    # the course's own collectives run
    fn = cloudpickle.loads(payload)
    comm = get_comm("torch", timeout=timeout, check_sizes=False)
    if against == "ring":
        from course_lib.collectives import ring_allreduce
        ops = (lambda b: fn(b, comm), lambda b: ring_allreduce(b, comm, check=False))
    else:
        ops = (lambda b: fn(b, comm), dist.all_reduce)
    medians = []
    for size in sizes:
        x, times = torch.ones(max(size // 4, 1)), torch.zeros(2, repeats, dtype=torch.float64)
        for i in range(-1, repeats):  # round -1 warms up
            for k, op in enumerate(ops):
                buf = x.clone()
                comm.barrier()
                t = time.perf_counter()
                op(buf)
                if i >= 0:
                    times[k, i] = time.perf_counter() - t
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        medians.append(times.median(dim=1).values.tolist())
    return medians


# ---------------------------------------------------------------- on the client
def _cases(world_size):
    """(label, n, dtype): ragged, divisible, shorter than the world size, several dtypes."""
    N = world_size
    specs = [(4 * N + 2, "float32", "length not divisible by the world size"),
             (4 * N, "float64", "length divisible by the world size"),
             (N - 1, "float32", "length smaller than the world size: a chunk is empty"),
             (3 * N + 1, "int32", "integers"),
             (5 * N + 2, "float16", "half precision"),
             (10_001, "float32", "a longer buffer")]
    return [Case(f"n={n}, {dtype}, world size {N}: {text}", lambda n=n, dtype=dtype: (n, dtype))
            for n, dtype, text in specs]


def _remote_failure(name, where, err, schedule, world_size, two_way=False, dtype=None):
    """Turn a failure on the engines into False (not implemented) or a CheckFailed with a hint."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import ClusterTimeout, RemoteError
    if isinstance(err, RemoteError):
        errors = err.errors
        if any(text.startswith("NotImplementedError") for text in errors.values()):
            return not_implemented(name)
        lines = "\n  ".join(f"rank {r}: {text.splitlines()[0]}" for r, text in errors.items())
        sizes = [m for m in (MISFIT.search(text) for text in errors.values()) if m]
        crashed = {r: t for r, t in errors.items() if not t.startswith(("CommTimeout",
                                                                          "CommError"))}
        waited = [(int(m.group(1)), int(m.group(2))) for m in
                  (WAITED.match(t) for t in errors.values()) if m]
        if crashed and not any(t.startswith(("NameError", "PicklingError"))
                               for t in crashed.values()):
            hint = _hint_crash(crashed, schedule)
        elif sizes:
            hint = _hint_misfit(sizes[0], world_size, schedule, two_way, dtype)
        elif (not two_way and world_size > 2 and waited
              and all(src == (r + 1) % world_size for r, src in waited)):
            hint = (f"rank(s) {sorted(r for r, _ in waited)} waited for a message from their "
                    f"RIGHT neighbour, which sends to its own right: in this ring every rank "
                    f"receives from the neighbour that sends to it, its left one. {schedule}")
        elif any("CommTimeout" in text for text in errors.values()):
            hint = (f"a rank waited past its deadline. Either every rank sends before anyone "
                    f"receives (a blocking send cycle: comm.send blocks until the peer "
                    f"receives; {SENDRECV}), or every rank waits on a receive before it has "
                    f"posted its sends, or the ranks disagree on peers, on the number of "
                    f"steps or on a chunk's length (a receive buffer must have exactly the "
                    f"length of the chunk sent to it; an empty chunk sends nothing). {schedule}")
        elif any(text.startswith(("NameError", "PicklingError")) for text in errors.values()):
            hint = ("your function runs on the engines: define or import everything it uses "
                    "inside the notebook cells, and do not use the cluster object in it.")
        else:
            hint = f"read the traceback above (cluster.run shows each rank's). {schedule}"
        raise CheckFailed(f"{where}\n  your function raised on rank(s) {sorted(errors)}:\n  "
                          f"{lines}\nHint: {hint}") from None
    if isinstance(err, ClusterTimeout):
        raise CheckFailed(f"{where}\n  {err}\nHint: your function did not return: an endless "
                          f"loop, or a wait without a deadline? {SENDRECV}.") from None
    raise CheckFailed(f"{where}\n  {type(err).__name__}: {err}\nHint: an engine process died "
                      "while running your function (the next call restarts it); run the "
                      "function once by hand on the cluster, with cluster.run(fn, buf), to see "
                      f"where. {schedule}") from None


# "rank 1: sendrecv from rank 2 of 4 x float32 (16 bytes) ...: rank 2 sent 20 bytes (5 x
# float32) but the receive buffer holds 16 bytes" (course_lib.comm's error for a message that
# does not fit), and "rank 1: sendrecv from rank 2 of ... did not complete" (a deadline)
MISFIT = re.compile(r"rank (\d+): \w+ from rank (\d+) of \d+ x (\w+) .*?: rank \d+ sent (\d+) "
                    r"bytes .*?holds (\d+) bytes")
WAITED = re.compile(r"CommTimeout: rank (\d+): \w+ from rank (\d+) ")
SIZES = re.compile(r"The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)")


def _hint_crash(crashed, schedule):
    """What a rank's own error (not a wait for another) says; the others then waited."""
    rank = min(crashed)
    first = crashed[rank].splitlines()[0]
    others = " (the other ranks then waited for it in vain)"
    if SIZES.search(first):
        a, b = SIZES.search(first).groups()
        return (f"rank {rank} added a chunk of {b} elements into a chunk of {a}{others}: what a "
                f"rank adds into must be the chunk that just arrived, at that chunk's place in "
                f"buf. {schedule}")
    return f"rank {rank} raised {first.split(':')[0]}{others}: read its traceback. {schedule}"


def _hint_misfit(match, world_size, schedule, two_way=False, dtype=None):
    """What a message that does not fit its receive buffer says about the student's ring."""
    rank, src = int(match.group(1)), int(match.group(2))
    into, sent, holds = match.group(3), int(match.group(4)), int(match.group(5))
    told = (f"rank {rank} received {sent} bytes from rank {src} into a buffer of {holds} "
            f"bytes: a send and its receive must be the same chunk")
    if dtype is not None and into != str(np.dtype(dtype)):
        return (f"{told}. Rank {rank}'s receive buffer is {into}, the buffer being reduced "
                f"{np.dtype(dtype)}: a receive buffer of another dtype holds another number of "
                f"bytes (make it like the chunk it receives).")
    if two_way:
        return (f"{told}. Each half has its own N chunks (shard_bounds(len(half), c, N)); the "
                f"half that goes to the left needs the ring's chunk indices mirrored, not the "
                f"same ones. {schedule}")
    if world_size > 2 and src == (rank + 1) % world_size:
        return (f"{told}. Rank {rank} receives from rank {src}, its RIGHT neighbour: the ring "
                f"is reversed. {schedule}")
    return (f"{told}. A receive buffer must have exactly the length of the chunk sent to it; "
            f"if yours does, the two ranks disagree on which chunk moves at this step (chunks "
            f"differ in length when N does not divide len(buf)): is a rank sending the same "
            f"chunk at every step? {schedule}")


def _decode(got, parts):
    """Integer weights k (0..2 each) with got == sum_q k[q] * parts[q], or None."""
    weights = (0, 1, 2) if 3 ** len(parts) <= 729 else (0, 1)
    for k in itertools.product(weights, repeat=len(parts)):
        if np.array_equal(got, sum(kq * p for kq, p in zip(k, parts, strict=True))):
            return k
    return None


def _hint_returned(returned, rank, n, N):
    """Why the bounds a rank returned are not its chunk's."""
    floor = n // N
    cut = (rank * floor, n if rank == N - 1 else (rank + 1) * floor)
    if returned == cut:
        return (f"your chunks are cut len(buf) // N = {floor} long, the rest in the last one: "
                f"the chunks are shard_bounds', which hands the len(buf) % N elements left over "
                f"to the first chunks, one each.")
    if isinstance(returned, str):
        return (f"your function returned {returned}: return the pair (start, stop) of the "
                f"chunk this rank owns.")
    if returned in [shard_bounds(n, c, N) for c in range(N)]:
        return "that is another rank's chunk: return the bounds of the chunk this rank owns."
    return "return the pair (start, stop) of the chunk this rank owns."


def _hint_reduce(rank, N, got_buf, inputs, full):
    """Why chunk ``rank`` of rank ``rank`` is not the sum: whose data it holds instead."""
    chunk = rank
    a, b = shard_bounds(len(full), chunk, N)
    parts = [x[a:b].astype(np.float64) for x in inputs]
    for c in range(N):
        c0, c1 = shard_bounds(len(full), c, N)
        if c != chunk and c1 > c0 and np.array_equal(got_buf[c0:c1], full[c0:c1]):
            return (f"rank {rank} holds the full sum in chunk {c}, not in chunk {chunk}: the "
                    f"schedule is shifted. {SCHEDULE['reduce-scatter']}")
    k = _decode(got_buf[a:b].astype(np.float64), parts)
    if k is None:
        return None
    who = [q for q in range(N) if k[q]]
    if N > 2 and who == sorted({rank, (rank - 1) % N}) and max(k) == 1:
        return (f"chunk {chunk} of rank {rank} holds its own data and its left neighbour's "
                f"only: each rank passed on its starting values, not the chunk it had added "
                f"to, so a chunk picks up one rank's data and never more. "
                f"{SCHEDULE['reduce-scatter']}")
    if max(k) == 2:
        twice = [q for q in range(N) if k[q] == 2]
        return (f"chunk {chunk} of rank {rank} counts rank(s) {twice}'s data twice: a chunk was "
                f"added into twice. {SCHEDULE['reduce-scatter']}")
    if who == [rank] and np.array_equal(got_buf, inputs[rank].astype(np.float64)):
        return (f"rank {rank}'s buffer did not change: nothing received was added to it (not "
                f"into buf itself, at least: a copy of buf, or a temporary, is not the caller's "
                f"buffer). {SCHEDULE['reduce-scatter']}")
    if len(who) == 1 and who != [rank]:
        return (f"chunk {chunk} of rank {rank} holds rank {who[0]}'s data only: the received "
                f"chunk replaced the buffer's instead of being added to it (the reduction is "
                f"missing).")
    return (f"chunk {chunk} of rank {rank} holds the data of {len(who)} of {N} ranks {who}: an "
            f"off-by-one in the step schedule (in the number of steps, or in which chunk moves "
            f"when). {SCHEDULE['reduce-scatter']}")


def _hint_gather(rank, N, got_buf, start, full):
    """Which chunks of rank ``rank`` are right, untouched, or hold someone else's marks."""
    missing, foreign, added = [], [], []
    for c in range(N):
        a, b = shard_bounds(len(full), c, N)
        if np.array_equal(got_buf[a:b], full[a:b]):
            continue
        if np.array_equal(got_buf[a:b], start[a:b]):
            missing.append(c)
        elif np.array_equal(got_buf[a:b], start[a:b] + full[a:b]):
            added.append(c)
        elif np.all(got_buf[a:b] <= MARK):
            foreign.append(c)
    if added:
        return (f"rank {rank}'s chunk(s) {added} hold the arriving chunk plus what was there "
                f"before (the placeholders here): the all-gather copies a final chunk into its "
                f"place, it adds nothing.")
    if foreign:
        return (f"rank {rank}'s chunk(s) {foreign} hold another rank's placeholder values: a "
                f"chunk was passed on before it had arrived. {SCHEDULE['all-gather']}")
    if len(missing) == N - 1:
        return (f"rank {rank}'s buffer holds only what it started with: nothing was received "
                f"into it (into a temporary never copied into buf, or into a copy of buf, "
                f"which the caller never sees). {SCHEDULE['all-gather']}")
    if missing:
        return (f"rank {rank} never received chunk(s) {missing}: one step short? "
                f"{SCHEDULE['all-gather']}")
    return (f"rank {rank}'s chunks hold wrong values: an arriving chunk went to another "
            f"chunk's place. {SCHEDULE['all-gather']}")


_PHASES = {"allreduce": ["reduce-scatter", "all-gather"]}


def _check_traffic(where, exercise, rank, N, n, itemsize, sent):
    """The ring sends one chunk per step, to the right neighbour, N-1 times per phase."""
    chunk = [(b - a) * itemsize for a, b in (shard_bounds(n, c, N) for c in range(N))]
    phases = _PHASES.get(exercise, [exercise])
    expected = []
    for phase in phases:
        first = -1 if phase == "reduce-scatter" else 0
        expected += [chunk[(rank + first - s) % N] for s in range(N - 1)]
    right = (rank + 1) % N
    wrong_peer = sorted({dst for dst, _ in sent if dst != right})
    if not sent:
        problem = (f"rank {rank} sent nothing through comm: this is not your ring (a native "
                   f"collective such as dist.all_reduce does not count)")
        hint = " ".join(SCHEDULE[p] for p in phases)
        raise CheckFailed(f"{where}\n  the values are right but {problem}.\nHint: {hint}")
    if wrong_peer:
        problem = f"rank {rank} sent to rank(s) {wrong_peer}; the ring only sends to rank {right}"
    elif N > 2 and all(b == n * itemsize for _, b in sent):
        problem = (f"rank {rank} sent {len(sent)} message(s) of {[b for _, b in sent]} bytes, "
                   f"each the whole buffer; the ring sends one chunk per step, here "
                   f"{expected} bytes")
    elif sorted(b for _, b in sent if b) != sorted(b for b in expected if b):
        problem = (f"rank {rank} sent {len(sent)} message(s) of {[b for _, b in sent]} bytes; "
                   f"the ring sends N-1 = {N - 1} per phase, here {expected} bytes: one chunk "
                   f"per step; check the number of steps")
    else:
        return
    raise CheckFailed(f"{where}\n  the values are right but this is not the ring: {problem}."
                      f"\nHint: {' '.join(SCHEDULE[p] for p in phases)}")


def _check(name, exercise, student_fn, cluster, seed, timeout):
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    try:
        payload = pack_function(student_fn)
    except Exception as e:
        raise CheckFailed(f"{name}: your function cannot be sent to the engines ({e}).\nHint: "
                          "do not refer to the cluster or open files inside it.") from None
    N = cluster.n
    cases = _cases(N)
    for number, case in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({case.label})"
        n, dtype = case.args()
        try:
            results = cluster.run(run_student, payload, exercise, n, dtype, seed, timeout,
                                  timeout=timeout + 20)
        except Exception as err:  # RemoteError, ClusterTimeout, EngineDied
            if _remote_failure(name, where, err, SCHEDULE.get(exercise, ""), N,
                               two_way=exercise == "two-way", dtype=dtype) is False:
                return False
        inputs = case_inputs(exercise, n, dtype, seed, N)
        full = np.sum(case_inputs("reduce-scatter", n, dtype, seed, N), axis=0,
                      dtype=np.float64)
        for rank, res in enumerate(results):
            got = res["buf"].astype(np.float64)
            if exercise == "reduce-scatter":
                a, b = shard_bounds(n, rank, N)
                if res["returned"] != (a, b):
                    raise CheckFailed(f"{where}\n  rank {rank} returned {res['returned']}; it owns "
                                      f"chunk {rank} = shard_bounds({n}, {rank}, {N}) = {(a, b)}"
                                      f"\nHint: {_hint_returned(res['returned'], rank, n, N)}")
                problem = compare(full[a:b], got[a:b], f"rank {rank}: chunk {rank} = buf[{a}:{b}]",
                                  rtol=0, atol=0)
                hint = problem and _hint_reduce(rank, N, got, inputs, full)
            else:
                problem = compare(full, got, f"rank {rank}: buf", rtol=0, atol=0)
                if problem and exercise == "all-gather":
                    hint = _hint_gather(rank, N, got, inputs[rank], full)
                elif problem and exercise == "two-way":
                    hint = _hint_two_way(rank, N, got, full, inputs[rank].astype(np.float64))
                elif problem:
                    hint = _hint_allreduce(rank, N, got, full, inputs)
                if not problem and exercise in ("allreduce", "two-way"):
                    problem = compare(res["native"], got, f"rank {rank}: buf vs dist.all_reduce",
                                      rtol=0, atol=0)
                    hint = None
            if problem:
                fallback = " ".join(SCHEDULE[p] for p in _PHASES.get(exercise, [exercise]))
                raise CheckFailed(f"{where}\n  {problem}\nHint: {hint or fallback}")
            (_check_two_way_traffic if exercise == "two-way" else _check_traffic)(
                where, exercise, rank, N, n, np.dtype(dtype).itemsize, res["sent"])
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match the reference on {N} ranks")
    return True


def _hint_allreduce(rank, world_size, got, full, inputs):
    N, n = world_size, len(full)
    a, b = shard_bounds(n, rank, N)
    mine = inputs[rank].astype(np.float64)
    if np.allclose(got * world_size, full, rtol=1e-3, atol=world_size):
        return (f"rank {rank} holds the sum divided by {world_size}: the average. This allreduce "
                f"sums, like dist.all_reduce's default op (SUM): do not divide by N.")
    if np.array_equal(got, mine):
        return (f"rank {rank}'s buffer did not change: the allreduce works in place, on the "
                f"buffer it is given (a result in a copy, or a new tensor, is not the caller's).")
    if np.array_equal(got[a:b], full[a:b]):
        return (f"rank {rank}'s own chunk {rank} is right but the others are not: run the "
                f"all-gather after the reduce-scatter, on the same buffer.")
    own_chunks = np.concatenate([inputs[c][slice(*shard_bounds(n, c, N))].astype(np.float64)
                                 for c in range(N)])
    if np.array_equal(got, own_chunks):
        return (f"rank {rank}'s buffer holds every rank's own chunk, unreduced: the all-gather "
                f"spread chunks that no reduce-scatter had summed (none ran on this buffer).")
    if b > a and np.array_equal(got[a:b], N * mine[a:b]):
        return (f"rank {rank}'s chunk {rank} is {N} x its own data: the all-gather ran first "
                f"(every rank then held rank {rank}'s chunk), and the reduce-scatter after it "
                f"summed those copies.")
    return (f"even rank {rank}'s own chunk {rank} is not the sum: the reduce-scatter has to run "
            f"once, first, on this buffer (and pass check_ring_reduce_scatter).")


def _hint_two_way(rank, world_size, got, full, mine):
    """Which half of rank ``rank``'s buffer is wrong, and what that says."""
    h = (len(full) + 1) // 2
    first, second = (np.array_equal(got[sl], full[sl]) for sl in (slice(0, h), slice(h, None)))
    if np.allclose(got * world_size, full, rtol=1e-3, atol=world_size):
        return (f"rank {rank} holds the sum divided by {world_size}: the average. Sum, like "
                f"dist.all_reduce's default op (SUM): do not divide by N.")
    if first and not second and np.array_equal(got[h:], mine[h:]):
        return (f"rank {rank}'s first half is right, its second half buf[{h}:] is as it was: "
                f"nothing of the second half went around the ring. {SCHEDULE['two-way']}")
    if first and not second:
        half = full[h:]
        a, b = shard_bounds(len(half), rank, world_size)
        if b > a and np.array_equal(got[h + a:h + b], half[a:b]):
            return (f"rank {rank}'s first half is right, and in the second half its own chunk "
                    f"{rank} is the sum but the other chunks are not: the second half's "
                    f"all-gather is missing or wrong. {SCHEDULE['two-way']}")
        return (f"rank {rank}'s first half buf[:{h}] is right, its second half is not: check "
                f"the mirrored schedule of the half that goes to the left. "
                f"{SCHEDULE['two-way']}")
    if second and not first:
        return (f"rank {rank}'s second half buf[{h}:] is right, its first half buf[:{h}] is "
                f"not: the first half runs the ring of exercises 1 and 2 on its own N chunks. "
                f"{SCHEDULE['two-way']}")
    return None


def _check_two_way_traffic(where, exercise, rank, N, n, itemsize, sent):
    """Each half goes around once, in its own direction: 2(N-1) chunks of a half each way."""
    right, left = (rank + 1) % N, (rank - 1) % N
    largest = -(-((n + 1) // 2) // N) * itemsize  # the largest chunk of a half, in bytes
    wrong_peer = sorted({dst for dst, _ in sent if dst not in (left, right)})
    each_way = 2 * (N - 1) * (1 if right != left else 2)
    to = {peer: [b for dst, b in sent if dst == peer and b] for peer in {left, right}}
    problem = None
    if wrong_peer:
        problem = (f"rank {rank} sent to rank(s) {wrong_peer}; it only sends to its neighbours "
                   f"{right} (right) and {left} (left)")
    elif not to[left] and n >= 2 * N:
        problem = (f"rank {rank} sent nothing to its left neighbour {left}: that is the one-way "
                   f"ring. The second half goes the other way round")
    elif max((b for _, b in sent), default=0) > largest:
        problem = (f"rank {rank} sent a message of {max(b for _, b in sent)} bytes; a chunk of "
                   f"half the buffer holds at most {largest}: cut each half into N chunks")
    elif any(len(to[peer]) > each_way for peer in to) or (
            n >= 2 * N and any(len(to[peer]) != each_way for peer in to)):
        problem = (f"rank {rank} sent {len(to[right])} chunk(s) to the right and "
                   f"{len(to[left])} to the left; each half makes 2(N-1) = {2 * (N - 1)} steps, "
                   f"one chunk per step")
    if problem:
        raise CheckFailed(f"{where}\n  the values are right but this is not the two-way ring: "
                          f"{problem}.\nHint: {SCHEDULE['two-way']}")


def check_ring_reduce_scatter(student_fn, cluster, seed=0, timeout=STUDENT_TIMEOUT):
    """Lab 05, exercise 1: ``student_fn(buf, comm) -> (start, stop)`` on every rank of ``cluster``.

    On each of 6 cases rank r must return ``shard_bounds(len(buf), r, N)`` and hold the exact
    sum over ranks in that chunk, having sent N-1 chunks to rank r+1. Prints a pass line and
    returns True, returns False while the function raises NotImplementedError, and raises
    ``CheckFailed`` with a hint otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    return _check("check_ring_reduce_scatter", "reduce-scatter", student_fn, cluster, seed,
                  timeout)


def check_ring_allgather(student_fn, cluster, seed=0, timeout=STUDENT_TIMEOUT):
    """Lab 05, exercise 2: ``student_fn(buf, comm)``: rank r's chunk r is valid on entry; on exit
    every rank holds every chunk, having sent N-1 chunks to rank r+1."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    return _check("check_ring_allgather", "all-gather", student_fn, cluster, seed, timeout)


def check_ring_allreduce(student_fn, cluster, seed=0, timeout=STUDENT_TIMEOUT):
    """Lab 05, exercise 3: ``student_fn(buf, comm)`` must leave on every rank exactly what
    ``dist.all_reduce`` (sum) gives for the same inputs, in 2(N-1) ring steps."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    return _check("check_ring_allreduce", "allreduce", student_fn, cluster, seed, timeout)


def check_bidirectional_ring_allreduce(student_fn, cluster, seed=0, timeout=STUDENT_TIMEOUT):
    """Lab 05, stretch exercise: ``student_fn(buf, comm)`` must leave on every rank exactly
    what ``dist.all_reduce`` gives, with the buffer's two halves going around the ring in
    opposite directions: 2(N-1) chunks of a half to each neighbour."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    return _check("check_bidirectional_ring_allreduce", "two-way", student_fn, cluster, seed,
                  timeout)


# ---------------------------------------------------------------- use it: how fast is it?


def time_allreduce(student_fn, cluster, sizes=(4096, 65536, 1 << 20), repeats=5):
    """Lab 05, use it: time ``student_fn(buf, comm)`` and ``dist.all_reduce`` side by side.

    Returns one dict per size: size (bytes), yours_us and native_us (microseconds, median over
    ``repeats`` rounds of the slowest rank). A timing, not a check: it asserts nothing."""
    medians = cluster.run(run_timed, pack_function(student_fn), list(sizes), repeats)[0]
    return [{"size": size, "yours_us": 1e6 * yours, "native_us": 1e6 * native}
            for size, (yours, native) in zip(sizes, medians, strict=True)]


def time_against_ring(student_fn, cluster, sizes=(1 << 22, 1 << 24), repeats=3):
    """Lab 05, stretch: time ``student_fn(buf, comm)`` and the course's one-way ring side by
    side, on the cluster's emulated link if it has one (``cluster.set_link``).

    Returns one dict per size: size (bytes), yours_us and ring_us (median over ``repeats``
    rounds of the slowest rank) and, on an emulated link, model_us: the one-way ring on it by
    the alpha-beta model. A timing, not a check: it asserts nothing."""
    from course_lib.runtime import netem
    medians = cluster.run(run_timed, pack_function(student_fn), list(sizes), repeats,
                          against="ring")[0]
    link = getattr(cluster, "link", None)
    return [{"size": size, "yours_us": 1e6 * yours, "ring_us": 1e6 * ring,
             "model_us": (1e6 * netem.predict_allreduce("ring", size, cluster.n, link,
                                                        check=False) if link else None)}
            for size, (yours, ring) in zip(sizes, medians, strict=True)]
