"""Shared memory: what this machine has, and the lost-update race when workers share a variable.

Introduced in notebooks/02_parallel_computing.ipynb. Real worker processes (forked from a
server, :func:`launch.worker_context`; one per core or more) add into one integer that lives
in shared memory::

    from course_lib import race
    race.shared_counter(num_workers=4, increments=20_000, mode="unlocked")   # lost > 0
    race.shared_counter(num_workers=4, increments=20_000, mode="locked")     # exact
    race.parallel_for_sum(n=200_000, num_workers=4, mode="reduction")        # exact and fast

An update ``total = total + v`` is three steps: read the shared value, add, write it back. When
two workers read the same value before either writes, one write overwrites the other and an
update is lost. Modes: ``unlocked`` (the race), ``locked`` (a lock around the read-modify-write;
the role ``#pragma omp atomic`` plays in OpenMP), ``reduction`` (each worker adds into a private
partial sum and writes it once; the partial sums are added at the end, the pattern that data
parallel training uses for gradients). ``window=True`` sleeps between the read and the write, as
if the worker were descheduled there: the workers then overlap in time and lost updates show up on
any machine, one core or many, idle or loaded.
Every wait has a deadline; a worker that dies or hangs is named in a :class:`RaceError`, and no
process outlives the call.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from course_lib.runtime.launch import supervise, worker_context

if TYPE_CHECKING:
    import ctypes
    from multiprocessing.synchronize import Barrier, Lock

# A spawned worker (COURSE_LIB_WARM=0) starts a fresh interpreter and imports this module to
# find add_worker: keep its top-level imports to the standard library (no numpy).

MODES = ("unlocked", "locked", "reduction")
WINDOW_SECONDS = 1e-6  # a real sleep: the kernel deschedules the worker for ~50-100 us


class RaceError(RuntimeError):
    """A worker died or missed its deadline; the message names it.

    Introduced in notebooks/02_parallel_computing.ipynb."""


@dataclass(frozen=True)
class RaceResult:
    """Outcome of one run: what the total should be, what it is, and the parallel time.

    Introduced in notebooks/02_parallel_computing.ipynb."""

    kind: str          # "counter" (each update adds 1) or "sum" (worker adds its values)
    mode: str
    num_workers: int
    expected: int
    got: int
    seconds: float     # slowest worker, from the common start to its last update

    @property
    def lost(self) -> int:
        """How much went missing: the number of lost updates for a counter."""
        return self.expected - self.got


# ---------------------------------------------------------------- in each worker process
def add_worker(worker: int, total: ctypes.c_int64, partials: ctypes.Array,
               seconds: ctypes.Array, lock: Lock, barrier: Barrier, start: int, stop: int,
               ones: bool, mode: str, window: bool) -> None:
    """Add ``1`` (ones) or ``a`` for every ``a`` in ``range(start, stop)`` into ``total``: what
    each worker process runs. ``total``, ``partials`` and ``seconds`` are shared memory
    (``RawValue``/``RawArray``), ``lock`` and ``barrier`` those of the workers' context.
    Introduced in notebooks/02_parallel_computing.ipynb."""
    barrier.wait(timeout=60)  # all workers start together (starting takes a while)
    began = time.perf_counter()
    if mode == "reduction":
        partial = 0
        for a in range(start, stop):
            partial += 1 if ones else a
        partials[worker] = partial  # a slot of its own: no one else writes here
    else:
        for a in range(start, stop):
            v = 1 if ones else a
            if mode == "locked":
                lock.acquire()
            old = total.value           # read
            if window:
                time.sleep(WINDOW_SECONDS)  # descheduled between read and write
            total.value = old + v       # write: an update made since the read is lost
            if mode == "locked":
                lock.release()
    seconds[worker] = time.perf_counter() - began


# ---------------------------------------------------------------- from the notebook
def run_workers(kind: str, ranges: list[tuple[int, int]], ones: bool, mode: str, window: bool,
                timeout: float) -> RaceResult:
    """Start one process per range (``add_worker``), wait with a deadline, collect the total.
    Introduced in notebooks/02_parallel_computing.ipynb."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    ctx = worker_context()  # forked from a server that imported numpy and torch once
    n = len(ranges)
    total = ctx.RawValue("q", 0)           # int64 in shared memory, no lock of its own
    partials = ctx.RawArray("q", n)
    seconds = ctx.RawArray("d", n)
    lock, barrier = ctx.Lock(), ctx.Barrier(n)  # passed to the workers at start: shared objects
    procs = [ctx.Process(target=add_worker, daemon=True, name=f"race-worker-{w}",
                         args=(w, total, partials, seconds, lock, barrier, start, stop, ones,
                               mode, window))
             for w, (start, stop) in enumerate(ranges)]
    supervise(procs, timeout, f"{kind}, mode {mode}", RaceError)
    got = sum(partials) if mode == "reduction" else total.value
    expected = sum((stop - start) if ones else sum(range(start, stop)) for start, stop in ranges)
    return RaceResult(kind, mode, n, expected, int(got), max(seconds))


def shared_counter(num_workers: int = 4, increments: int = 20_000, mode: str = "unlocked",
                   window: bool = False, timeout: float = 60.0) -> RaceResult:
    """Each of ``num_workers`` processes adds 1 to a shared counter ``increments`` times.

    Expected total: ``num_workers * increments``; ``result.lost`` counts the lost updates.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    if num_workers < 1 or increments < 0:
        raise ValueError(f"need num_workers >= 1 and increments >= 0, got {num_workers}, "
                         f"{increments}")
    return run_workers("counter", [(0, increments)] * num_workers, True, mode, window, timeout)


def parallel_for_sum(n: int = 200_000, num_workers: int = 4, mode: str = "reduction",
                     window: bool = False, timeout: float = 60.0) -> RaceResult:
    """A parallel for loop: ``total += a`` for ``a in range(n)``, iterations split by worker.

    Each worker takes a contiguous block (``sharding.shard_bounds``); expected ``n (n - 1) / 2``.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    from course_lib.sharding import shard_bounds  # imported here: workers start without numpy
    if num_workers < 1 or n < 0:
        raise ValueError(f"need num_workers >= 1 and n >= 0, got {num_workers}, {n}")
    ranges = [shard_bounds(n, w, num_workers) for w in range(num_workers)]
    return run_workers("sum", ranges, False, mode, window, timeout)


# ---------------------------------------------------------------- this machine
def _read(path):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def machine_info() -> dict:
    """Cores, sockets, memory and NUMA nodes (CPUs, distances) of this machine, where it can tell.

    Reads Linux's /proc and /sys; on other systems the NUMA fields are None. The NUMA distance
    is the relative cost of a memory access (10 = local). Introduced in
    notebooks/02_parallel_computing.ipynb.
    """
    info = {"cpu_count": os.cpu_count(), "usable_cpus": None, "model": None, "sockets": None,
            "memory_gib": None, "numa_nodes": None}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cpus"] = len(os.sched_getaffinity(0))  # taskset/cgroup may allow fewer
    cpuinfo = _read("/proc/cpuinfo") or ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
              if line.startswith("model name")]
    info["model"] = models[0] if models else None
    sockets = {line for line in cpuinfo.splitlines() if line.startswith("physical id")}
    info["sockets"] = len(sockets) or None
    try:
        import psutil  # here, not at the top: the spawned workers import this module
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"),
                   key=lambda p: int(p.name[4:]))  # "node10" after "node2": by number
    if nodes:
        info["numa_nodes"] = []
        for node in nodes:
            info["numa_nodes"].append({
                "node": int(node.name[4:]), "cpus": _read(node / "cpulist"),
                "distances": [int(d) for d in (_read(node / "distance") or "").split()]})
    return info
