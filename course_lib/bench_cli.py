"""The command line of the benchmarks: ``python -m course_lib bench allreduce ...``.

Introduced in notebooks/05_allreduce.ipynb; what is measured and how is in :mod:`course_lib.bench`.
This module parses the options, starts the ranks (a local cluster, ``mpiexec`` or ``torchrun``;
or finds that it is a rank already) and prints rank 0's table::

    python -m course_lib bench allreduce --world-size 2,4 --sizes 1K-1M       # a local cluster
    python -m course_lib bench allreduce --transport mpi --sizes 1M,16M --launcher mpiexec
    mpiexec -n 2 python -m course_lib bench allreduce --transport mpi           # already launched
"""

import argparse
import json
import os
import sys
import tempfile

from course_lib.bench import (
    DTYPES,
    BenchError,
    allreduce_rank_bench,
    format_table,
    memcpy_bandwidth,
    parse_sizes,
    write_csv,
)
from course_lib.launch import launched_rank, run_ranks

DEFAULT_ALGORITHMS = "native,naive,tree,ring,ring_pipelined"


def allreduce_arguments(parser):
    """The options of ``python -m course_lib bench allreduce``."""
    a = parser.add_argument
    a("--transport", choices=["torch", "mpi"], default="torch",
      help="torch.distributed (Gloo / NCCL) or mpi4py (default torch)")
    a("--backend", choices=["gloo", "nccl"], default="gloo",
      help="torch transport: Gloo on CPU, or NCCL with one GPU per rank (default gloo)")
    a("--world-size", type=_arg(_world_sizes), default="2", help="ranks, a comma list like 2,4")
    a("--sizes", type=_arg(parse_sizes), default="1K-1M",
      help="bytes: a doubling range like 1K-64M or a list like 1M,16M (default 1K-1M)")
    a("--algorithms", type=_arg(_algorithms), default=DEFAULT_ALGORITHMS,
      help=f"comma list (default {DEFAULT_ALGORITHMS})")
    a("--dtype", choices=DTYPES, default="float32")
    a("--iters", type=int, default=10, help="timed rounds (default 10)")
    a("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    a("--no-check", dest="check", action="store_false",
      help="skip the agreement round (shapes, dtypes) that guards every from-scratch call")
    a("--csv", help="also write one row per world size, algorithm and size to this file")
    a("--launcher", choices=["cluster", "mpiexec", "torchrun", "inside"], default="cluster",
      help="how ranks start: a local ipyparallel cluster (default), mpiexec or torchrun; "
           "'inside': this process is a rank already (found out by itself under mpiexec/torchrun)")
    a("--timeout", type=float, default=30.0, help="deadline of each operation, s (default 30)")
    a("--time-limit", type=float, default=600.0,
      help="deadline of the whole run of one world size, s (default 600)")
    a("--rows-json", help=argparse.SUPPRESS)  # where a launched rank 0 leaves its rows


def _arg(parse):
    def parse_arg(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse_arg


def _world_sizes(text):
    values = [int(v) if v.strip().isdigit() else 0 for v in text.split(",")]
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


def allreduce_main(args):
    """Run ``bench allreduce`` with parsed ``args``; 0 when it ran and every result was exact."""
    try:
        if args.iters < 1 or args.warmup < 0:
            raise BenchError("--iters must be >= 1 and --warmup >= 0")
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
        print(f"# {len(rows)} rows written to {csv_path}")
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
            args.timeout, args.check)


def _on_cluster(args, world_size, memcpy):
    from course_lib.cluster import start_cluster
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
        inner += [] if args.check else ["--no-check"]
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
