"""Benchmarks in the style of nccl-tests: ``python -m course_lib bench allreduce ...``.

Introduced in notebooks/05_allreduce.ipynb. Each allreduce of :mod:`course_lib.collectives` runs
side by side with the native one (``dist.all_reduce`` over Gloo or NCCL, ``MPI.Allreduce`` over
mpi4py) in the same run, and one table per world size shows how they compare::

    python -m course_lib bench allreduce --world-size 2,4 --sizes 1K-1M       # a local cluster
    python -m course_lib bench allreduce --transport mpi --sizes 1M,16M --launcher mpiexec
    mpiexec -n 2 python -m course_lib bench allreduce --transport mpi           # already launched

Method. Rank r fills element i with r + 1 + (i mod 13), so the exact sum is a small integer that
every dtype holds. After ``warmup`` untimed rounds, ``iters`` rounds run the algorithms round-robin
(native, naive, ..., native, naive, ...) so that drift on a shared machine hits them all alike.
Before each operation a rank refills its buffer (untimed) and waits at a barrier; its time runs
from leaving the barrier to the end of its operation. Reported: the median over rounds of the
MAXIMUM over ranks (a collective ends when its slowest rank does). After the timed rounds each
algorithm runs once more and its result is compared with the exact sum: #wrong counts the
elements that differ, summed over ranks.

Columns: algbw = size / time; busbw = algbw * 2(N-1)/N, what each rank's link must carry per
second in a bandwidth-optimal allreduce, comparable across N (nccl-tests' definition). On one
machine the links are memory copies, so the ceiling printed is single-core memcpy bandwidth
(a large numpy copy, bytes copied per second). "vs native" = native time / this time.
"""

import csv
import re
import time

import numpy as np

from course_lib.costmodel import algbw, busbw

COLUMNS = ["world_size", "transport", "backend", "algorithm", "size", "count", "type", "time_us",
           "algbw", "busbw", "busbw_of_memcpy", "wrong", "vs_native", "memcpy", "iters", "warmup"]
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32"]


class BenchError(RuntimeError):
    """A benchmark could not run (bad setting, missing GPU, a launcher that failed)."""


# ---------------------------------------------------------------- sizes, bandwidths, the table
def parse_size(text):
    """'4K' -> 4096: bytes with an optional binary unit K, M or G (nccl-tests' -b / -e)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"bad size {text!r}: use bytes with an optional unit, like 512, 4K, 64M")
    return int(m.group(1)) * UNITS[m.group(2)]


def parse_sizes(text):
    """'1K-64M' -> 1K, 2K, 4K, ..., 64M (doubling, like ``-b 1K -e 64M -f 2``); '1M,16M' -> both."""
    sizes = []
    for item in text.split(","):
        lo, dash, hi = item.partition("-")
        lo = parse_size(lo)
        hi = parse_size(hi) if dash else lo
        if lo < 1 or hi < lo:
            raise ValueError(f"bad size range {item!r}: need 1 <= first <= last")
        while lo <= hi:
            sizes.append(lo)
            lo *= 2
    return sizes


def format_size(n_bytes):
    """4194304 -> '4 MiB', 1536 -> '1536 B': the largest binary unit that divides it exactly."""
    for unit in ("GiB", "MiB", "KiB"):
        if n_bytes >= UNITS[unit[0]] and n_bytes % UNITS[unit[0]] == 0:
            return f"{n_bytes // UNITS[unit[0]]} {unit}"
    return f"{n_bytes} B"


def memcpy_bandwidth(n_bytes=64 * 2**20, repeats=9):
    """Single-core memcpy bandwidth in GB/s: bytes copied per second, median of ``repeats``."""
    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats + 1):  # the first copy also faults the pages in: not counted
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return n_bytes / float(np.median(times[1:])) / 1e9


def format_table(rows, memcpy=None):
    """Rows of :func:`allreduce_rank_bench` as nccl-tests-style text, one table per world size."""
    line = "{:>12} {:>11} {:>8}  {:<15}{:>10} {:>8} {:>8} {:>7} {:>7} {:>9}".format
    groups, out = {}, []
    for r in rows:
        groups.setdefault((r["world_size"], r["transport"], r["backend"], r["type"]), []).append(r)
    for (world_size, transport, backend, dtype), group in groups.items():
        out.append(f"# allreduce over {transport} ({backend}), world size {world_size}, {dtype}: "
                   f"median of {group[0]['iters']} rounds after {group[0]['warmup']} warm-up(s),"
                   " algorithms interleaved, time of the slowest rank")
        if memcpy:
            out.append(f"# ceiling: single-core memcpy {memcpy:.2f} GB/s")
        out += ["#" + line("size", "count", "type", "algorithm", "time", "algbw", "busbw",
                           "busbw/", "#wrong", "vs")[1:],
                "#" + line("(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "memcpy", "",
                           "native")[1:]]
        for i, r in enumerate(group):
            if i and r["size"] != group[i - 1]["size"]:
                out.append("")
            out.append(line(r["size"], r["count"], r["type"], r["algorithm"],
                            f"{r['time_us']:.1f}", f"{r['algbw']:.3f}", f"{r['busbw']:.3f}",
                            f"{r['busbw'] / memcpy:.1%}" if memcpy else "-", r["wrong"],
                            f"{r['vs_native']:.2f}x" if r.get("vs_native") else "-"))
        out.append("")
    return "\n".join(out)


def write_csv(rows, path, memcpy=None):
    """One CSV row per (world size, algorithm, size) with every column of :data:`COLUMNS`."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, memcpy=memcpy or "",
                            busbw_of_memcpy=r["busbw"] / memcpy if memcpy else ""))


# ---------------------------------------------------------------- what every rank runs
def allreduce_rank_bench(transport, algorithms, sizes, dtype="float32", iters=10, warmup=2,
                         timeout=30.0, check=True):
    """Time ``algorithms`` ("native" or keys of collectives.ALGORITHMS) at ``sizes`` (bytes).

    Runs on every rank (a cluster engine, or a process under mpiexec / torchrun); returns the
    same rows on every rank: dicts with the keys of :data:`COLUMNS` but memcpy (bandwidths in
    GB/s). ``timeout``: deadline of each point-to-point wait and barrier, in seconds.
    ``check=False`` times the algorithms without their agreement round (native has none).
    """
    from course_lib.collectives import allreduce
    from course_lib.comm import get_comm
    comm = get_comm(transport, timeout=timeout)
    p, device, backend = comm.world_size, *_device(comm)
    ops = {name: _native(comm) if name == "native" else
           (lambda buf, name=name: allreduce(buf, comm, algorithm=name, check=check))
           for name in algorithms}
    rows = []
    for size in sizes:
        src, buf, expected = _buffers(transport, dtype, device, size, comm.rank, p)
        times, wrong = np.zeros((len(algorithms), iters)), np.zeros(len(algorithms))
        for it in range(-warmup, iters):
            for k, name in enumerate(algorithms):  # round-robin: drift hits every algorithm
                _copy(buf, src)
                comm.barrier()
                _sync(device)
                t = time.perf_counter()
                ops[name](buf)
                _sync(device)
                if it >= 0:
                    times[k, it] = time.perf_counter() - t
        for k, name in enumerate(algorithms):  # after the timed rounds: is each result exact?
            _copy(buf, src)
            ops[name](buf)
            wrong[k] = int((buf != expected).sum())
        median = np.median(_reduce(comm, times, "max"), axis=1)
        wrong = _reduce(comm, wrong, "sum")
        n_bytes, count = buf.nbytes, len(buf)
        for k, name in enumerate(algorithms):
            rows.append(dict(
                world_size=p, transport=transport, backend=backend, algorithm=name, size=n_bytes,
                count=count, type=dtype, time_us=median[k] * 1e6,
                algbw=algbw(n_bytes, median[k]) / 1e9, busbw=busbw(n_bytes, median[k], p) / 1e9,
                wrong=int(wrong[k]), iters=iters, warmup=warmup,
                vs_native=(float(median[algorithms.index("native")] / median[k])
                           if "native" in algorithms else None)))
        del src, buf, expected
    return rows


def fusion_rank_bench(transport, algorithm="native", count=256, tensor_bytes=4096, iters=5,
                      warmup=1, timeout=30.0):
    """The tiny-allreduce problem, measured on every rank: ``count`` float32 tensors of
    ``tensor_bytes`` each, allreduced one after another, against tensor fusion (copy them into
    one buffer, one allreduce, copy back). Returns ``{"separate_s", "fused_s"}``: medians over
    rounds of the slowest rank. Introduced in notebooks/05_allreduce.ipynb."""
    from course_lib.collectives import allreduce
    from course_lib.comm import get_comm
    comm = get_comm(transport, timeout=timeout)
    device = _device(comm)[0]
    op = _native(comm) if algorithm == "native" else \
        (lambda buf: allreduce(buf, comm, algorithm=algorithm))
    n = max(tensor_bytes // 4, 1)
    if transport == "mpi":
        tensors, fused = [np.ones(n, np.float32) for _ in range(count)], np.empty(n * count,
                                                                                  np.float32)
    else:
        import torch
        tensors = [torch.ones(n, device=device) for _ in range(count)]
        fused = torch.empty(n * count, device=device)

    def separate():
        for t in tensors:
            op(t)

    def fuse():
        for i, t in enumerate(tensors):
            _copy(fused[i * n:(i + 1) * n], t)
        op(fused)
        for i, t in enumerate(tensors):
            _copy(t, fused[i * n:(i + 1) * n])

    times = np.zeros((2, iters))
    for it in range(-warmup, iters):
        for k, fn in enumerate((separate, fuse)):
            comm.barrier()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if it >= 0:
                times[k, it] = time.perf_counter() - t0
    separate_s, fused_s = np.median(_reduce(comm, times, "max"), axis=1)
    return {"separate_s": float(separate_s), "fused_s": float(fused_s)}


def _device(comm):
    """(device of the buffers, backend name) of a comm."""
    if getattr(comm, "backend", "") == "nccl":
        import torch
        return f"cuda:{torch.cuda.current_device()}", "nccl"
    return "cpu", getattr(comm, "backend", comm.transport)


def _native(comm):
    if comm.transport == "mpi":
        return lambda buf: comm.mpi.Allreduce(comm.MPI.IN_PLACE, buf, op=comm.MPI.SUM)
    return lambda buf: comm.dist.all_reduce(buf, group=comm.group)


def _buffers(transport, dtype, device, size, rank, p):
    """This rank's input, a buffer to reduce in place, and the exact sum over ranks."""
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    if size < itemsize:
        raise BenchError(f"size {size} B is smaller than one {dtype}")
    pattern = np.arange(size // itemsize, dtype=np.int64) % 13
    src, expected = pattern + (rank + 1), pattern * p + p * (p + 1) // 2
    if transport == "mpi":
        if dtype == "bfloat16":
            raise BenchError("numpy has no bfloat16: use --transport torch for it")
        return src.astype(dtype), np.empty(len(src), dtype), expected.astype(dtype)
    import torch
    src, expected = (torch.from_numpy(a).to(device, getattr(torch, dtype)) for a in (src, expected))
    return src, torch.empty_like(src), expected


def _copy(dst, src):
    np.copyto(dst, src) if isinstance(dst, np.ndarray) else dst.copy_(src)


def _sync(device):
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _reduce(comm, values, op):
    """Max or sum of a small float64 array over ranks, by the transport's native collective."""
    values = np.ascontiguousarray(values, dtype=np.float64)
    if comm.transport == "mpi":
        comm.mpi.Allreduce(comm.MPI.IN_PLACE, values, op=getattr(comm.MPI, op.upper()))
        return values
    import torch
    t = torch.from_numpy(values).to(_device(comm)[0])
    comm.dist.all_reduce(t, op=getattr(comm.dist.ReduceOp, op.upper()), group=comm.group)
    return t.cpu().numpy()


# ---------------------------------------------------------------- the command line
