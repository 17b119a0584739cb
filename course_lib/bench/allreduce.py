"""Benchmarks in the style of nccl-tests: ``python -m course_lib bench allreduce ...``.

Introduced in notebooks/05_allreduce.ipynb. Each allreduce of :mod:`course_lib.collectives` runs
side by side with the native one (``dist.all_reduce`` over Gloo or NCCL, ``MPI.Allreduce`` over
mpi4py) in the same run, and one table per world size shows how they compare::

    python -m course_lib bench allreduce --world-size 2,4 --sizes 1K-1M       # a local cluster
    python -m course_lib bench allreduce --transport mpi --sizes 1M,16M --launcher mpiexec
    mpiexec -n 2 python -m course_lib bench allreduce --transport mpi           # already launched
    python -m course_lib bench allreduce --link 1Gbit/s,50us --world-size 2,4,8 --sizes 1M,16M

Method. Rank r fills element i with r + 1 + (i mod 13), so the exact sum is a small integer that
every dtype holds. After ``warmup`` untimed rounds, ``iters`` rounds run the algorithms round-robin
(native, naive, ..., native, naive, ...) so that drift on a shared machine hits them all alike.
Before each operation a rank refills its buffer (untimed) and waits at a barrier; its time runs
from leaving the barrier to the end of its operation (on an emulated link, from a start instant
all ranks agree on, since a barrier releases ranks milliseconds apart on a busy machine).
Reported: the median over rounds of the MAXIMUM over ranks (a collective ends when its slowest
rank does). After the timed rounds each algorithm runs once more and its result is compared with
the exact sum: #wrong counts the elements that differ, summed over ranks.

Columns: algbw = size / time; busbw = algbw * 2(N-1)/N, what each rank's link must carry per
second in a bandwidth-optimal allreduce, comparable across N (nccl-tests' definition). On one
machine the links are memory copies, so the ceiling printed is single-core memcpy bandwidth
(a large numpy copy, bytes copied per second). "vs native" = native time / this time.

With ``--link`` every message crosses an emulated network (:mod:`course_lib.runtime.netem`): the
ceiling is then the link's bandwidth, and each row carries the time the alpha-beta model predicts
for it (``predicted_us``; ``netem.predict_allreduce``) and measured / predicted. The native
allreduce runs inside Gloo or MPI, off the emulated link, and is left out.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from course_lib.bench import common
from course_lib.bench.common import (
    BenchError,
    argtype,
    format_size,  # noqa: F401 - notebook 05 calls bench.format_size
    memcpy_bandwidth,
    parse_list,
    parse_size,  # noqa: F401 - part of this benchmark's interface
    parse_sizes,
    text_table,
)
from course_lib.costmodel import algbw, busbw
from course_lib.runtime import hosts, netem
from course_lib.runtime.launch import launched_rank, run_ranks

HELP = "every allreduce algorithm against the native one"

COLUMNS = ["world_size", "transport", "backend", "algorithm", "size", "count", "type", "time_us",
           "predicted_us", "algbw", "busbw", "busbw_of_memcpy", "wrong", "vs_native", "memcpy",
           "link", "checks", "iters", "warmup"]
CHECKS = {True: "agreement round", False: "none", "messages": "size header per message"}
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32"]


def format_table(rows, memcpy=None):
    """Rows of :func:`allreduce_rank_bench` as nccl-tests-style text, one table per world size.
    On an emulated link the ceiling is the link's bandwidth and the prediction stands beside."""
    groups, out = {}, []
    for r in rows:
        groups.setdefault((r["world_size"], r["transport"], r["backend"], r["type"]), []).append(r)
    for (world_size, transport, backend, dtype), group in groups.items():
        link = group[0].get("link")
        out.append(f"# allreduce over {transport} ({backend}), world size {world_size}, {dtype}: "
                   f"median of {group[0]['iters']} rounds after {group[0]['warmup']} warm-up(s),"
                   " algorithms interleaved, time of the slowest rank")
        if group[0].get("checks"):
            out.append(f"# checks of the from-scratch algorithms: {group[0]['checks']}")
        ceiling = netem.make_link(link).bandwidth / 1e9 if link else memcpy
        if link:
            out.append(f"# emulated link {netem.make_link(link)}: ceiling {ceiling:.3f} GB/s "
                       "per direction; predicted = the alpha-beta model on it")
        elif memcpy:
            out.append(f"# ceiling: single-core memcpy {memcpy:.2f} GB/s")
        cells = []
        for i, r in enumerate(group):
            if i and r["size"] != group[i - 1]["size"]:
                cells.append(None)  # a blank line between sizes
            last = (f"{r['time_us'] / r['predicted_us']:.2f}" if link else
                    f"{r['vs_native']:.2f}x" if r.get("vs_native") else "-")
            cells.append([r["size"], r["count"], r["type"], r["algorithm"], f"{r['time_us']:.1f}",
                          f"{r['predicted_us']:.1f}" if link else "-",
                          f"{r['algbw']:.3f}", f"{r['busbw']:.3f}",
                          f"{r['busbw'] / ceiling:.1%}" if ceiling else "-", r["wrong"], last])
        out += text_table([["size", "count", "type", "algorithm", "time", "predicted", "algbw",
                            "busbw", "busbw/", "#wrong", "measured/" if link else "vs"],
                           ["(B)", "(elements)", "", "", "(us)", "(us)", "(GB/s)", "(GB/s)",
                            "link" if link else "memcpy", "",
                            "predicted" if link else "native"]], cells, ">>><>>>>>>>")
        out.append("")
    return "\n".join(out)


def write_csv(rows, path, memcpy=None):
    """One CSV row per (world size, algorithm, size) with every column of :data:`COLUMNS`;
    ``busbw_of_memcpy`` is busbw over the ceiling (the link's bandwidth on an emulated link)."""
    def extra(r):
        ceiling = netem.make_link(r["link"]).bandwidth / 1e9 if r.get("link") else memcpy
        return dict(memcpy=memcpy or "", busbw_of_memcpy=r["busbw"] / ceiling if ceiling else "",
                    link=r.get("link") or "", checks=r.get("checks") or "")
    common.write_csv(rows, path, COLUMNS, extra)


# ---------------------------------------------------------------- what every rank runs
def allreduce_rank_bench(transport, algorithms, sizes, dtype="float32", iters=10, warmup=2,
                         timeout=30.0, check=True, link=None, world_size=None):
    """Time ``algorithms`` ("native" or keys of collectives.ALGORITHMS) at ``sizes`` (bytes).

    Runs on every rank (a cluster engine, or a process under mpiexec / torchrun); returns the
    same rows on every rank: dicts with the keys of :data:`COLUMNS` but memcpy (bandwidths in
    GB/s). ``timeout``: deadline of each point-to-point wait and barrier, in seconds.
    ``check=False`` times the algorithms without their agreement round (native has none);
    ``check="messages"``: without it, but every message carries its size header instead.
    ``link``: an emulated network for the messages (default: the process's, see netem).
    ``world_size``: run on the first ``world_size`` ranks only (torch transport; a subgroup,
    so one cluster measures several world sizes); the other ranks return None.
    """
    from course_lib.collectives import allreduce
    from course_lib.comm import TorchComm, get_comm
    from course_lib.comm.subgroups import subgroup
    comm = get_comm(transport, timeout=timeout, link=link,
                    check_sizes="always" if check == "messages" else True)
    if world_size is not None and world_size != comm.world_size:
        if transport != "torch" or not 1 < world_size <= comm.world_size:
            raise BenchError(f"world_size={world_size}: a torch subgroup of 2 to "
                             f"{comm.world_size} ranks")
        group = subgroup(world_size)  # every rank must call this
        if comm.rank >= world_size:
            return None
        comm = TorchComm(group, timeout=timeout, link=link, check_sizes=comm.check_sizes)
    if comm.link is not None and "native" in algorithms:
        raise BenchError("the native allreduce runs inside Gloo/MPI, off the emulated link: "
                         "leave 'native' out of the algorithms with a link")
    p, device, backend = comm.world_size, *_device(comm)
    ops = {name: _native(comm) if name == "native" else
           (lambda buf, name=name: allreduce(buf, comm, algorithm=name, check=check is True))
           for name in algorithms}
    rows = []
    for size in sizes:
        src, buf, expected = _buffers(transport, dtype, device, size, comm.rank, p)
        times, wrong = np.zeros((len(algorithms), iters)), np.zeros(len(algorithms))
        for it in range(-warmup, iters):
            for k, name in enumerate(algorithms):  # round-robin: drift hits every algorithm
                _copy(buf, src)
                _sync(device)
                t = netem.start_clock(comm)
                ops[name](buf)
                _sync(device)
                if it >= 0:
                    times[k, it] = time.monotonic() - t
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
                link=comm.link.text if comm.link else None, checks=CHECKS[check],
                predicted_us=(netem.predict_allreduce(name, n_bytes, p, comm.link, check is True)
                              * 1e6 if comm.link else None),
                vs_native=(float(median[algorithms.index("native")] / median[k])
                           if "native" in algorithms else None)))
        del src, buf, expected
    return rows



def tc_versus_emulated(machines, cluster, local, rate="200Mbit/s", size=2 << 20,
                       world_sizes=(2, 4), algorithms=("naive", "ring"), iters=2, progress=False):
    """The same allreduces of ``size`` bytes timed three ways: on ``cluster``, whose ranks live
    on ``machines`` (one each) with their cables slowed by tc to ``rate`` (the real kernel: TCP,
    queues, Gloo); on ``local``, one machine's cluster, on the emulated link of that rate
    (:mod:`course_lib.runtime.netem`); and by the alpha-beta model of that link. Returns one dict
    per world size and algorithm: seconds "tc", "emulated" and "model". ``progress=True`` shows a
    bar (``tqdm.auto``) naming the run under way, removed when done.
    Introduced in notebooks/12_scaling_out.ipynb."""
    from tqdm.auto import tqdm  # only when timing: a progress bar
    link, before = netem.make_link(rate, "50us"), local.link
    times = {}
    bar = tqdm(total=2 * len(world_sizes), desc="timing allreduces", disable=not progress,
               leave=False)
    try:
        for h in machines:
            hosts.shape(h, rate=rate)
        local.set_link(link)
        for way, on in (("tc", cluster), ("emulated", local)):
            for n in world_sizes:
                bar.set_postfix_str(f"{way}, N = {n}")
                rows = on.run(allreduce_rank_bench, "torch", list(algorithms), [size],
                              iters=iters, warmup=1, check=False, world_size=n)[0]
                times.update({(way, n, r["algorithm"]): r["time_us"] / 1e6 for r in rows})
                bar.update()
    finally:
        bar.close()
        for h in machines:
            hosts.shape(h)
        local.set_link(before)
    return [{"world_size": n, "algorithm": a, "bytes": size, "rate": rate,
             "model": netem.predict_allreduce(a, size, n, link, check=False),
             "tc": float(times["tc", n, a]), "emulated": float(times["emulated", n, a])}
            for n in world_sizes for a in algorithms]

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
DEFAULT_ALGORITHMS = "native,naive,tree,ring,ring_pipelined"


def arguments(parser):
    """The options of ``python -m course_lib bench allreduce``."""
    a = parser.add_argument
    a("--transport", choices=["torch", "mpi"], default="torch",
      help="torch.distributed (Gloo / NCCL) or mpi4py (default torch)")
    a("--backend", choices=["gloo", "nccl"], default="gloo",
      help="torch transport: Gloo on CPU, or NCCL with one GPU per rank (default gloo)")
    a("--world-size", type=argtype(_world_sizes), default="2", help="ranks, a comma list like 2,4")
    a("--sizes", type=argtype(parse_sizes), default="1K-1M",
      help="bytes: a doubling range like 1K-64M or a list like 1M,16M (default 1K-1M)")
    a("--algorithms", type=argtype(_algorithms), default=None,
      help=f"comma list (default {DEFAULT_ALGORITHMS}; with --link, all but native)")
    a("--dtype", choices=DTYPES, default="float32")
    a("--iters", type=int, default=10, help="timed rounds (default 10)")
    a("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    a("--no-check", dest="check", action="store_false",
      help="skip the agreement round (shapes, dtypes) that guards every from-scratch call")
    a("--check-messages", dest="check", action="store_const", const="messages",
      help="instead of that round, check every message's size (a header per message, as "
           "comm does for a student's own sends): what the check costs")
    a("--link", type=argtype(netem.make_link), default=None,
      help="an emulated network for every message: 'bandwidth,latency' like 1Gbit/s,50us or a "
           f"preset ({', '.join(netem.PRESETS)}); default: none (loopback as it is)")
    a("--csv", help="also write one row per world size, algorithm and size to this file")
    a("--launcher", choices=["cluster", "mpiexec", "torchrun", "inside"], default="cluster",
      help="how ranks start: a local ipyparallel cluster (default), mpiexec or torchrun; "
           "'inside': this process is a rank already (found out by itself under mpiexec/torchrun)")
    a("--timeout", type=float, default=30.0, help="deadline of each operation, s (default 30)")
    a("--time-limit", type=float, default=600.0,
      help="deadline of the whole run of one world size, s (default 600)")
    a("--rows-json", help=argparse.SUPPRESS)  # where a launched rank 0 leaves its rows


def _world_sizes(text):
    values = parse_list(text, what="--world-size", example="2,4")
    if min(values) < 2:
        raise ValueError(f"expected rank counts >= 2 like 2,4 (an allreduce needs 2), not {text!r}")
    return values


def _algorithms(text):
    from course_lib.collectives import ALGORITHMS
    names = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in names if a != "native" and a not in ALGORITHMS]
    if bad or not names:
        raise ValueError(f"unknown algorithm(s) {bad}: choose from native, {', '.join(ALGORITHMS)}")
    return names


def main(args):
    """Run ``bench allreduce`` with parsed ``args``; 0 when it ran and every result was exact."""
    try:
        if args.iters < 1 or args.warmup < 0:
            raise BenchError("--iters must be >= 1 and --warmup >= 0")
        if args.algorithms is None:
            args.algorithms = [a for a in _algorithms(DEFAULT_ALGORITHMS)
                               if not (args.link and a == "native")]
        if args.link and "native" in args.algorithms:
            raise BenchError("--link: the native allreduce runs inside Gloo/MPI, off the "
                             "emulated link; leave native out of --algorithms")
        if args.launcher == "inside" or launched_rank():
            return _inside(args)
        _check_backend(args, max(args.world_size))
        memcpy, rows = memcpy_bandwidth(), []
        for world_size in args.world_size:
            print(f"# world size {world_size}: starting ranks ({args.launcher})", file=sys.stderr)
            rows += (_on_cluster if args.launcher == "cluster" else _launch)(args, world_size,
                                                                               memcpy)
    except (RuntimeError, TimeoutError, ValueError) as e:  # BenchError, ClusterError, CommError
        print(f"bench allreduce: {e}", file=sys.stderr)
        return 1
    return _report(rows, memcpy, args.csv)


def _report(rows, memcpy, csv_path):
    print(format_table(rows, memcpy))
    if csv_path:
        write_csv(rows, csv_path, memcpy)
    wrong = sorted({r["algorithm"] for r in rows if r["wrong"]})
    if wrong:
        print(f"bench allreduce: WRONG results from {', '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


def _check_backend(args, gpus_needed):
    if args.backend != "nccl":
        return
    if args.transport != "torch":
        raise BenchError("--backend nccl goes with --transport torch (mpi moves CPU buffers)")
    import torch
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < gpus_needed:
        raise BenchError(f"--backend nccl needs one CUDA GPU per rank ({gpus_needed}); this "
                         f"machine has {found}. On CPU use --backend gloo.")


def _bench_args(args):
    return (args.transport, args.algorithms, args.sizes, args.dtype, args.iters, args.warmup,
            args.timeout, args.check, args.link)


def _on_cluster(args, world_size, memcpy):
    from course_lib.runtime.cluster import start_cluster
    with start_cluster(n=world_size, backend=args.backend, timeout=args.time_limit,
                       engines="mpi" if args.transport == "mpi" else "local",
                       pg_timeout=args.timeout) as cluster:
        return cluster.run(allreduce_rank_bench, *_bench_args(args))[0]


def _launch(args, world_size, memcpy):
    """Start ``world_size`` copies of this command under mpiexec or torchrun; rank 0's rows."""
    with tempfile.TemporaryDirectory(prefix="course_lib-bench-") as tmp:
        out = os.path.join(tmp, "rows.json")
        inner = ["-m", "course_lib", "bench", "allreduce", "--launcher", "inside",
                 "--rows-json", out, "--world-size", str(world_size),
                 "--sizes", ",".join(map(str, args.sizes)),
                 "--algorithms", ",".join(args.algorithms)]
        for opt in ("transport", "backend", "dtype", "iters", "warmup", "timeout"):
            inner += [f"--{opt}", str(getattr(args, opt))]
        inner += {True: [], False: ["--no-check"], "messages": ["--check-messages"]}[args.check]
        inner += ["--link", args.link.text] if args.link else []
        env = dict(os.environ, MPIEXEC_TIMEOUT=str(int(args.time_limit)), OMP_NUM_THREADS="1",
                   COURSE_LIB_MEMCPY_GBS=repr(memcpy))
        run_ranks(args.launcher, world_size, inner, env, args.time_limit)
        with open(out) as f:
            return json.load(f)


def _inside(args):
    """This process is one rank, started by mpiexec or torchrun: run; rank 0 reports."""
    if launched_rank() is None:
        raise BenchError("--launcher inside is for ranks started by mpiexec or torchrun")
    rank, local_rank = launched_rank()
    import torch
    torch.set_num_threads(1)
    memcpy = os.environ.get("COURSE_LIB_MEMCPY_GBS")
    memcpy = float(memcpy) if memcpy else memcpy_bandwidth() if rank == 0 else None
    if args.transport == "torch":
        from course_lib.comm import init_torch_from_launcher
        if os.environ.get("MASTER_ADDR", "localhost") in ("localhost", "127.0.0.1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
        if args.backend == "nccl":
            _check_backend(args, local_rank + 1)
            torch.cuda.set_device(local_rank)
        init_torch_from_launcher(args.backend, timeout=args.timeout)
    elif "RANK" in os.environ and "MASTER_PORT" in os.environ:
        raise BenchError("--transport mpi needs ranks started by mpiexec, not torchrun")
    rows = allreduce_rank_bench(*_bench_args(args))
    if args.transport == "torch":
        torch.distributed.destroy_process_group()
    if rank != 0:
        return 0
    if args.rows_json:
        with open(args.rows_json, "w") as f:
            json.dump(rows, f)
        return 0
    return _report(rows, memcpy, args.csv)
