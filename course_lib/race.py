"""Shared memory: what this machine has, and the lost-update race when workers share a variable.

Introduced in notebooks/02_parallel_computing.ipynb. Real worker processes (spawned, one per
core or more) add into one integer that lives in shared memory::

    from course_lib import race
    race.shared_counter(num_workers=4, increments=20_000, mode="unlocked")   # lost > 0
    race.shared_counter(num_workers=4, increments=20_000, mode="locked")     # exact
    race.parallel_for_sum(n=200_000, num_workers=4, mode="reduction")        # exact and fast

An update ``total = total + v`` is three steps: read the shared value, add, write it back. When
two workers read the same value before either writes, one write overwrites the other and an
update is lost. Modes: ``unlocked`` (the race), ``locked`` (a lock around the read-modify-write;
the role ``#pragma omp atomic`` plays in OpenMP), ``reduction`` (each worker adds into a private
partial sum and writes it once; the partial sums are added at the end, the pattern that data
parallel training uses for gradients). ``window=True`` yields the CPU between the read and the
write, as if the worker were descheduled there: this makes lost updates show up even on one core.
Every wait has a deadline; a worker that dies or hangs is named in a :class:`RaceError`, and no
process outlives the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

MODES = ("unlocked", "locked", "reduction")


class RaceError(RuntimeError):
    """A worker died or missed its deadline; the message names it."""


@dataclass(frozen=True)
class RaceResult:
    """Outcome of one run: what the total should be, what it is, and the parallel time."""

    kind: str          # "counter" (each update adds 1) or "sum" (worker adds its values)
    mode: str
    num_workers: int
    expected: int
    got: int
    seconds: float     # slowest worker, from the common start to its last update

    @property
    def lost(self):
        """How much went missing: the number of lost updates for a counter."""
        return self.expected - self.got


# ---------------------------------------------------------------- in each worker process
def _add_worker(worker, total, partials, seconds, lock, barrier, start, stop, ones, mode,
                window):
    """Add ``1`` (ones) or ``a`` for every ``a`` in ``range(start, stop)`` into ``total``."""
    barrier.wait(timeout=60)  # all workers start together (spawning takes a while)
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
                os.sched_yield()        # let another process run between read and write
            total.value = old + v       # write: an update made since the read is lost
            if mode == "locked":
                lock.release()
    seconds[worker] = time.perf_counter() - began


# ---------------------------------------------------------------- from the notebook
def supervise(procs, timeout, what, error=RaceError, barrier=None):
    """Start worker processes and sleep until all finish, one dies, or ``timeout`` s pass.

    A dead worker or a late one raises ``error`` naming it (worker index, pid, exit code); the
    ``barrier`` the others may wait at is aborted; every process is killed and joined, so none
    is left behind. Used by every module that spawns workers (notebooks 02 and 03)."""
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = [p.sentinel for p in procs if p.is_alive()]
            if not alive or any(p.exitcode not in (None, 0) for p in procs):
                break  # all done, or one died: the others would wait for it in vain
            wait(alive, timeout=max(min(0.1, deadline - time.monotonic()), 0.0))
        dead = [f"worker {w} (pid {p.pid}) exited with code {p.exitcode}"
                for w, p in enumerate(procs) if p.exitcode not in (None, 0)]
        late = [w for w, p in enumerate(procs) if p.is_alive()]
        if dead or late:
            if barrier is not None:
                barrier.abort()
            raise error(f"{what}: " + "; ".join(dead + (
                [f"worker(s) {late} of {len(procs)} still running after {timeout:g}s were "
                 "killed"] if late and not dead else [])))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(5)


def _run(kind, ranges, ones, mode, window, timeout):
    """Spawn one process per range, wait with a deadline, and collect the total."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    ctx = mp.get_context("spawn")  # no fork of a process with threads (Jupyter, torch)
    n = len(ranges)
    total = ctx.RawValue("q", 0)           # int64 in shared memory, no lock of its own
    partials = ctx.RawArray("q", n)
    seconds = ctx.RawArray("d", n)
    lock, barrier = ctx.Lock(), ctx.Barrier(n)
    procs = [ctx.Process(target=_add_worker, daemon=True, name=f"race-worker-{w}",
                         args=(w, total, partials, seconds, lock, barrier, start, stop, ones,
                               mode, window))
             for w, (start, stop) in enumerate(ranges)]
    supervise(procs, timeout, f"{kind}, mode {mode}")
    got = sum(partials) if mode == "reduction" else total.value
    expected = sum((stop - start) if ones else sum(range(start, stop)) for start, stop in ranges)
    return RaceResult(kind, mode, n, expected, int(got), max(seconds))


def shared_counter(num_workers=4, increments=20_000, mode="unlocked", window=False,
                   timeout=60.0):
    """Each of ``num_workers`` processes adds 1 to a shared counter ``increments`` times.

    Expected total: ``num_workers * increments``; ``result.lost`` counts the lost updates.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    if num_workers < 1 or increments < 0:
        raise ValueError(f"need num_workers >= 1 and increments >= 0, got {num_workers}, "
                         f"{increments}")
    return _run("counter", [(0, increments)] * num_workers, True, mode, window, timeout)


def parallel_for_sum(n=200_000, num_workers=4, mode="reduction", window=False, timeout=60.0):
    """A parallel for loop: ``total += a`` for ``a in range(n)``, iterations split by worker.

    Each worker takes a contiguous block (``data.shard_bounds``); expected ``n (n - 1) / 2``.
    Introduced in notebooks/02_parallel_computing.ipynb.
    """
    from course_lib.data import shard_bounds  # imported here: workers start without numpy
    if num_workers < 1 or n < 0:
        raise ValueError(f"need num_workers >= 1 and n >= 0, got {num_workers}, {n}")
    ranges = [shard_bounds(n, w, num_workers) for w in range(num_workers)]
    return _run("sum", ranges, False, mode, window, timeout)


# ---------------------------------------------------------------- this machine
def _read(path):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def machine_info():
    """Cores, sockets, memory and NUMA nodes (CPUs, distances) of this machine, where it can tell.

    Reads Linux's /proc and /sys; on other systems the NUMA fields are None. The NUMA distance
    is the relative cost of a memory access (10 = local). Introduced in notebook 02.
    """
    info = {"cpu_count": os.cpu_count(), "usable_cpus": None, "model": None, "sockets": None,
            "memory_gib": None, "numa_nodes": None}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    cpuinfo = _read("/proc/cpuinfo") or ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
              if line.startswith("model name")]
    info["model"] = models[0] if models else None
    sockets = {line for line in cpuinfo.splitlines() if line.startswith("physical id")}
    info["sockets"] = len(sockets) or None
    try:
        import psutil
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"),
                   key=lambda p: int(p.name[4:]))
    if nodes:
        info["numa_nodes"] = []
        for node in nodes:
            info["numa_nodes"].append({
                "node": int(node.name[4:]), "cpus": _read(node / "cpulist"),
                "distances": [int(d) for d in (_read(node / "distance") or "").split()]})
    return info


# ---------------------------------------------------------------- the figure
def plot_memory_architectures(path=None):
    """Four sketches: shared memory (UMA), NUMA, distributed memory, hybrid. Returns a Figure."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    fig = Figure(figsize=(12, 3.4), layout="constrained")
    axes = fig.subplots(1, 4)

    def box(ax, x, y, w, h, text, color):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color,
                                    ec="black", lw=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def line(ax, x0, y0, x1, y1, **kw):
        ax.plot([x0, x1], [y0, y1], color=kw.get("color", "black"), lw=kw.get("lw", 1.5),
                ls=kw.get("ls", "-"))

    cpu, mem, net = "#cfe2f3", "#fce5cd", "#d9ead3"
    ax = axes[0]  # UMA: every CPU reaches one memory over one bus, at the same cost
    box(ax, 0.1, 0.72, 0.8, 0.16, "memory", mem)
    line(ax, 0.1, 0.55, 0.9, 0.55, lw=3)
    line(ax, 0.5, 0.55, 0.5, 0.72)
    for i in range(4):
        box(ax, 0.05 + 0.235 * i, 0.2, 0.19, 0.16, "CPU", cpu)
        line(ax, 0.145 + 0.235 * i, 0.36, 0.145 + 0.235 * i, 0.55)
    ax.text(0.5, 0.48, "bus", ha="center", fontsize=8)
    ax.set_title("shared memory: UMA (SMP)\nevery CPU reaches memory\nin the same time", fontsize=9)
    ax = axes[1]  # NUMA: two SMPs, each with its own memory, joined by a slower link
    for k, x in enumerate((0.02, 0.53)):
        box(ax, x, 0.72, 0.45, 0.16, f"memory {k}", mem)
        for i in range(2):
            box(ax, x + 0.01 + 0.23 * i, 0.25, 0.2, 0.16, "CPU", cpu)
            line(ax, x + 0.11 + 0.23 * i, 0.41, x + 0.11 + 0.23 * i, 0.72)
    line(ax, 0.47, 0.33, 0.53, 0.33, color="C3", lw=3)
    ax.text(0.5, 0.12, "interconnect: remote memory\nis slower", ha="center", fontsize=8,
            color="C3")
    ax.set_title("shared memory: NUMA\none address space,\nunequal access times", fontsize=9)
    ax = axes[2]  # distributed: each CPU has its own memory; messages cross a network
    box(ax, 0.05, 0.05, 0.9, 0.14, "network", net)
    for i in range(4):
        x = 0.03 + 0.24 * i
        box(ax, x, 0.62, 0.2, 0.14, "mem", mem)
        box(ax, x, 0.35, 0.2, 0.14, "CPU", cpu)
        line(ax, x + 0.1, 0.49, x + 0.1, 0.62)
        line(ax, x + 0.1, 0.19, x + 0.1, 0.35, ls="--")
    ax.set_title("distributed memory\nprivate memories,\nmessages over a network", fontsize=9)
    ax = axes[3]  # hybrid: shared-memory nodes (CPUs + GPUs) joined by a network
    box(ax, 0.05, 0.05, 0.9, 0.14, "network", net)
    for k, x in enumerate((0.03, 0.52)):
        ax.add_patch(FancyBboxPatch((x, 0.3), 0.45, 0.6, boxstyle="round,pad=0.01", fc="white",
                                    ec="grey", ls=":"))
        box(ax, x + 0.03, 0.72, 0.39, 0.12, f"node {k} memory", mem)
        box(ax, x + 0.03, 0.5, 0.17, 0.12, "CPU", cpu)
        box(ax, x + 0.25, 0.5, 0.17, 0.12, "CPU", cpu)
        box(ax, x + 0.03, 0.34, 0.39, 0.1, "GPU  GPU", "#ead1dc")
        line(ax, x + 0.225, 0.19, x + 0.225, 0.3, ls="--")
    ax.set_title("hybrid\nshared memory in a node,\na network between nodes", fontsize=9)
    for ax in axes:
        ax.set(xlim=(0, 1), ylim=(0, 1))
        ax.axis("off")
    if path is not None:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


def save_all(out_dir):
    """Write notebook 02's figure(s) into ``out_dir`` (``python -m course_lib images``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "02_memory_architectures.png"
    plot_memory_architectures(path)
    return [path]
