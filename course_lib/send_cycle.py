"""A ring of blocking sends: it works for small messages and deadlocks for large ones.

Introduced in notebooks/02_parallel_computing.ipynb. Every rank sends a message to its right
neighbour, then receives one from its left. MPI may copy a small message into a buffer and let
``Send`` return at once (the *eager* protocol); above the eager limit ``Send`` waits until the
receiver has posted the matching ``Recv`` (the *rendezvous* protocol). In a ring every rank is
then waiting in ``Send`` and none reaches its ``Recv``: a deadlock. Run it yourself::

    mpiexec -n 2 python -m course_lib.send_cycle --bytes 1024,65536 --mode send --deadline 2

Rank 0 prints one JSON line per completed size. Each rank arms a watchdog before each exchange;
when the exchange is not done by ``--deadline`` seconds the rank prints a "deadlocked" line and
exits, and ``mpiexec`` tears the job down. From Python, :func:`run_cycle`, :func:`sweep` and
:func:`find_eager_limit` launch that command with a deadline of their own and kill ``mpiexec``
and every rank if it is ever passed, so nothing is left running.

Modes (``MODES``): ``send`` (Send then Recv: the bug), ``ssend`` (synchronous send: the bug at
every size), and three fixes, ``sendrecv`` (MPI's combined call), ``oddeven`` (even ranks send
first, odd ranks receive first) and ``isend`` (a non-blocking send, then Recv, then Wait).
:func:`ring_exchange` runs the same ring over the course's own ``course_lib.comm`` on cluster
engines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from course_lib.comm import get_comm
from course_lib.runtime import launch

if TYPE_CHECKING:
    from mpi4py import MPI

MODES = ("send", "ssend", "sendrecv", "oddeven", "isend")
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- on every MPI rank
def exchange(comm: MPI.Comm, sendbuf: np.ndarray, recvbuf: np.ndarray, mode: str) -> None:
    """One step of the ring on this rank: send to the right, receive from the left.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    if mode == "send":  # the classic bug: fine while MPI buffers the message
        comm.Send(sendbuf, dest=right)
        comm.Recv(recvbuf, source=left)
    elif mode == "ssend":  # a synchronous send never buffers: the bug shows at every size
        comm.Ssend(sendbuf, dest=right)
        comm.Recv(recvbuf, source=left)
    elif mode == "sendrecv":  # MPI pairs the two so that they cannot block each other
        comm.Sendrecv(sendbuf, dest=right, recvbuf=recvbuf, source=left)
    elif mode == "oddeven":  # break the cycle: half the ranks receive first
        if rank % 2 == 0:
            comm.Send(sendbuf, dest=right)
            comm.Recv(recvbuf, source=left)
        else:
            comm.Recv(recvbuf, source=left)
            comm.Send(sendbuf, dest=right)
    elif mode == "isend":  # start the send, receive, then wait for the send to finish
        request = comm.Isend(sendbuf, dest=right)
        comm.Recv(recvbuf, source=left)
        request.Wait()
    else:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")


def _report(**fields):
    """One JSON line on stdout in a single write, so lines of several ranks never mix."""
    os.write(1, (json.dumps(fields) + "\n").encode())


def _watchdog_fired(rank, right, nbytes, mode, deadline):
    """The exchange passed its deadline: say so on stdout and end this rank (and so the job)."""
    _report(status="deadlocked", nbytes=nbytes, rank=rank, mode=mode, seconds=deadline,
            detail=f"rank {rank} still in its {mode} to rank {right} of {nbytes} bytes "
                   f"after {deadline:g}s")
    os._exit(3)


def main(argv: Sequence[str] | None = None) -> None:
    """The program each rank runs under ``mpiexec``: the ring for each size, in order.

    Introduced in notebooks/02_parallel_computing.ipynb."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", required=True, help="message sizes, comma separated")
    parser.add_argument("--mode", choices=MODES, default="send")
    parser.add_argument("--deadline", type=float, default=2.0, help="seconds per exchange")
    parser.add_argument("--repeats", type=int, default=1, help="timed exchanges per size")
    args = parser.parse_args(argv)
    from mpi4py import MPI  # optional (the mpi extra): only under mpiexec
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise SystemExit("the ring needs at least 2 ranks: mpiexec -n 2 ...")
    for nbytes in (int(b) for b in args.bytes.split(",")):
        sendbuf = np.full(nbytes, rank % 256, dtype=np.uint8)
        recvbuf = np.zeros(nbytes, dtype=np.uint8)
        times = []
        for _ in range(args.repeats):
            comm.Barrier()  # start together: the deadline covers the exchange only
            # a thread, not a signal: the main thread sits inside MPI's C code, where a
            # Python signal handler would not run until the call returns (which it never does)
            watchdog = threading.Timer(args.deadline, _watchdog_fired, (
                rank, (rank + 1) % size, nbytes, args.mode, args.deadline))
            watchdog.daemon = True
            watchdog.start()
            start = time.perf_counter()
            exchange(comm, sendbuf, recvbuf, args.mode)  # mpi4py releases the GIL while blocked
            times.append(time.perf_counter() - start)
            watchdog.cancel()
        seconds = min(times)  # the least disturbed run (other processes share the cores)
        ok = bool(np.all(recvbuf == (rank - 1) % size % 256))  # the left rank's fill byte
        reports = comm.gather((seconds, ok), root=0)
        if rank == 0:
            _report(status="completed", nbytes=nbytes, mode=args.mode,
                    seconds=max(s for s, _ in reports), correct=all(o for _, o in reports))


# ---------------------------------------------------------------- from Python: launch and watch
@dataclass(frozen=True)
class CycleResult:
    """How the ring went for one message size: "completed", "deadlocked" or "not run".

    Introduced in notebooks/02_parallel_computing.ipynb."""

    mode: str
    nbytes: int
    world_size: int
    status: str
    seconds: float  # the exchange time, or the deadline that passed
    detail: str = ""


class SendCycleError(RuntimeError):
    """The ring program failed for another reason than a deadlock (stderr is in the message).

    Introduced in notebooks/02_parallel_computing.ipynb."""


def json_objects(text: str) -> Iterator[dict]:
    """Every JSON object in ``text`` (the ranks' reports), whatever else is around them.
    Introduced in notebooks/02_parallel_computing.ipynb."""
    decoder, pos = json.JSONDecoder(), text.find("{")
    while pos >= 0:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            end = pos + 1
        else:
            if isinstance(obj, dict) and "status" in obj:
                yield obj
        pos = text.find("{", end)


def run_cycle(sizes: int | Sequence[int], mode: str = "send", world_size: int = 2,
              deadline: float = 2.0, timeout: float | None = None,
              repeats: int = 1) -> list[CycleResult]:
    """Launch ``mpiexec -n world_size`` once and run the ring for each size in order.

    Returns one :class:`CycleResult` per size: "completed" (with the exchange time) up to the
    first size that deadlocks, that one "deadlocked" (seconds = ``deadline``), the rest
    "not run". Each size is exchanged ``repeats`` times; the time is the fastest of them
    (on the slowest rank). ``timeout`` bounds the whole launch (default: 30 s of start-up plus the
    deadline); past it mpiexec and every rank are killed and SendCycleError is raised.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    sizes = [int(s) for s in np.atleast_1d(sizes)]
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if world_size < 2 or not sizes or min(sizes) < 0:
        raise ValueError("need world_size >= 2 and at least one size >= 0")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    # start-up (mpiexec, Python, mpi4py) + one deadlock at most + the completed exchanges
    limit = 30.0 + deadline + 0.05 * len(sizes) * repeats if timeout is None else timeout
    # MPIEXEC_TIMEOUT: mpiexec ends the job itself just after our limit, should this process die
    env = dict(os.environ, **launch.MPI_LOOPBACK, MPIEXEC_TIMEOUT=str(int(limit) + 2),
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    mpiexec = launch.mpiexec_path(required=True, error=SendCycleError)
    cmd = [mpiexec, "-n", str(world_size), sys.executable, "-m", "course_lib.send_cycle",
           "--bytes", ",".join(map(str, sizes)), "--mode", mode, "--deadline", str(deadline),
           "--repeats", str(repeats)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    out, err, late = launch.finish_within(proc, limit)
    if late:
        raise SendCycleError(f"mpiexec -n {world_size} ({mode}) did not finish within "
                             f"{limit:g}s and was killed\n{err[-2000:]}")
    done, stuck = {}, None
    for report in json_objects(out):
        if report["status"] == "completed":
            if not report["correct"]:
                raise SendCycleError(f"{mode}, {report['nbytes']} bytes: wrong data arrived")
            done[report["nbytes"]] = report["seconds"]
        elif stuck is None:
            stuck = report
    results, status = [], "completed"
    for nbytes in sizes:
        if status == "completed" and nbytes in done:
            results.append(CycleResult(mode, nbytes, world_size, status, done[nbytes]))
        elif status == "completed" and stuck is not None and stuck["nbytes"] == nbytes:
            results.append(CycleResult(mode, nbytes, world_size, "deadlocked", deadline,
                                       stuck["detail"]))
            status = "not run"
        elif status == "not run":
            results.append(CycleResult(mode, nbytes, world_size, status, float("nan")))
        else:
            raise SendCycleError(f"mpiexec -n {world_size} ({mode}) exited with code "
                                 f"{proc.returncode} before reporting {nbytes} bytes\n"
                                 f"{err[-2000:]}")
    return results


def sweep(sizes: Sequence[int], mode: str = "send", world_size: int = 2, deadline: float = 2.0,
          max_deadlocks: int | None = None) -> list[CycleResult]:
    """Run the ring at every size, launching again after each deadlock.

    After ``max_deadlocks`` deadlocks the remaining sizes are reported "not run" (each deadlock
    costs ``deadline`` seconds). Introduced in notebooks/02_parallel_computing.ipynb.
    """
    results, todo, deadlocks = [], [int(s) for s in sizes], 0
    while todo and (max_deadlocks is None or deadlocks < max_deadlocks):
        batch = run_cycle(todo, mode, world_size, deadline)
        ran = [r for r in batch if r.status != "not run"]
        results += ran
        deadlocks += ran[-1].status == "deadlocked"
        todo = todo[len(ran):]
    return results + [CycleResult(mode, n, world_size, "not run", float("nan")) for n in todo]


def find_eager_limit(lo: int, hi: int, resolution: int = 64, world_size: int = 2,
                     deadline: float = 1.0) -> tuple[int | None, int | None]:
    """Largest message (to ``resolution`` bytes) for which the ring of blocking sends completes.

    Runs sizes ``lo, lo + resolution, ...`` up to ``hi`` in one launch; returns
    ``(largest_completed, smallest_deadlocked)``; the latter is None if none deadlocked.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    results = run_cycle(list(range(lo, hi + 1, resolution)), "send", world_size, deadline)
    completed = [r.nbytes for r in results if r.status == "completed"]
    stuck = [r.nbytes for r in results if r.status == "deadlocked"]
    return (completed[-1] if completed else None), (stuck[0] if stuck else None)


# ---------------------------------------------------------------- the same ring on course_lib.comm
def ring_exchange(nbytes: int, mode: str = "sendrecv", timeout: float = 5.0) -> dict:
    """On every cluster rank: one ring step of ``nbytes`` over ``course_lib.comm`` (torch).

    mode "sendrecv" uses ``comm.sendrecv``; "send" does ``comm.send`` then ``comm.recv``, which
    over Gloo waits for the matching receive at every size and ends in a ``CommTimeout``
    naming this rank, the operation, the peer and the size. Returns this rank's report.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    comm = get_comm("torch", timeout=timeout)
    rank, world_size = comm.rank, comm.world_size
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    sendbuf = np.full(max(nbytes // 8, 1), float(rank))
    recvbuf = np.empty_like(sendbuf)
    start = time.perf_counter()
    if mode == "sendrecv":
        comm.sendrecv(sendbuf, right, recvbuf, left)
    elif mode == "send":
        comm.send(sendbuf, right)
        comm.recv(recvbuf, left)
    else:
        raise ValueError(f"mode must be 'sendrecv' or 'send', not {mode!r}")
    return {"rank": rank, "from": left, "got": float(recvbuf[0]), "nbytes": sendbuf.nbytes,
            "seconds": time.perf_counter() - start}


if __name__ == "__main__":
    main()
