"""Every from-scratch allreduce against the native one, on the same inputs, on every rank.

Introduced in notebooks/05_allreduce.ipynb, where one cell shows that each algorithm of
:mod:`course_lib.collectives` agrees with ``dist.all_reduce`` (or MPI ``Allreduce``) for every
length, dtype and op. On a cluster, or as a script under a launcher::

    cluster.run(compare_with_native, ["naive", "tree", "ring"])   # [] on every rank: all agree
    mpiexec -n 4 python -m course_lib.testing.collectives --transport mpi --mismatch

Rank r's input is drawn from a generator seeded with (seed, r, length, dtype), so every rank can
rebuild every other rank's input and knows the magnitude sum_r |x_r| that rounding is relative
to. Integers and max/min must match exactly; float sums to within 2 N eps(dtype) sum_r |x_r|
(reduction order differs between algorithms, and fp16 rounds after every addition), far below
the error of a dropped or doubled contribution.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from course_lib import collectives as C
from course_lib.comm import get_comm, to_numpy
from course_lib.sharding import shard_bounds

DTYPES = ("float16", "float32", "float64", "int32", "int64")
COMPOSED = "reduce_scatter+allgather"  # ring_reduce_scatter, then ring_allgather, by hand
ALL = (*C.ALGORITHMS, "ring_pipelined:200", COMPOSED)  # 200-byte segments: several per chunk


def rank_input(seed, rank, shape, dtype):
    """The input of ``rank`` in a check: seeded by everything that names the case, so every
    rank (and the reference) can make anyone's."""
    n = int(np.prod(shape))
    rng = np.random.default_rng([seed, rank, n, DTYPES.index(dtype)])
    x = rng.integers(-1000, 1000, n) if dtype.startswith("int") else rng.standard_normal(n)
    return x.astype(dtype).reshape(shape)


def make_buffer(x, comm, kind):
    """A copy of numpy ``x`` as a numpy array ("numpy"), a torch tensor ("torch": on the GPU
    under NCCL) or a CUDA tensor whatever the backend ("cuda": Gloo moves it through host
    memory)."""
    if kind == "numpy":
        return x.copy()
    import torch
    t = torch.from_numpy(x.copy())
    on_gpu = kind == "cuda" or comm.transport == "torch" and comm.backend == "nccl"
    return t.cuda() if on_gpu else t


def buffer_kind(comm):
    """The kind of buffer a test gives this transport: torch tensors, or numpy arrays for MPI."""
    return "torch" if comm.transport == "torch" else "numpy"


def _native(comm, x, op):
    """The production allreduce of numpy array ``x`` (on a copy), as float64 numpy."""
    native_op = "sum" if op == "average" else op
    if comm.transport == "mpi":
        MPI = comm.MPI
        send = x.astype(np.float64) if x.dtype == np.float16 else x.copy()  # MPI has no fp16
        out = np.empty_like(send)
        comm.mpi.Allreduce(send, out, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[
            native_op])
        out = out.astype(x.dtype)
    else:
        dist, t = comm.dist, make_buffer(x, comm, "torch")
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(t, op=ops[native_op], group=comm.group)
        out = t.cpu().numpy()
    if op == "average":  # Gloo and MPI have no average: the sum, then divide (floor for ints)
        C.divide(out, comm.world_size)
    return out.astype(np.float64)


def _tolerance(world_size, seed, shape, dtype, op):
    if op in ("max", "min") or dtype.startswith("int"):
        return 0.0  # exact
    scale = sum(np.abs(rank_input(seed, r, shape, dtype).astype(np.float64))
                for r in range(world_size))
    scale = scale / world_size if op == "average" else scale
    return 2 * world_size * float(np.finfo(dtype).eps) * scale


def _differ(got, expected, tol):
    got = to_numpy(got).astype(np.float64)
    if got.shape != expected.shape:
        return f"shape {got.shape} != {expected.shape}"
    bad = np.abs(got - expected) > tol
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    return (f"{int(bad.sum())} of {bad.size} elements differ; first at flat index {i}: got "
            f"{got.flat[i]:.6g}, native {expected.flat[i]:.6g} (tolerance "
            f"{float(np.broadcast_to(tol, bad.shape).flat[i]):.3g})")


def run_algorithm(algorithm, buf, comm, op="sum"):
    """Run one algorithm by name: a key of ``ALGORITHMS``, "ring_pipelined:<segment bytes>"
    or "reduce_scatter+allgather"; return what it returned."""
    if algorithm == COMPOSED:
        C.ring_reduce_scatter(buf, comm, op)
        return C.ring_allgather(buf, comm)
    if algorithm.startswith("ring_pipelined:"):
        return C.ring_allreduce_pipelined(buf, comm, op, segment_bytes=int(algorithm[15:]))
    return C.allreduce(buf, comm, algorithm, op)


def _compare_one(comm, algorithm, x, expected, tol, op, kind):
    buf = make_buffer(x, comm, kind)
    if algorithm == COMPOSED:  # also check the middle: rank r holds reduced chunk r
        start, stop = C.ring_reduce_scatter(buf, comm, op)
        if (start, stop) != shard_bounds(x.size, comm.rank, comm.world_size):
            return f"ring_reduce_scatter returned chunk {(start, stop)}"
        tol_chunk = np.broadcast_to(tol, expected.shape).reshape(-1)[start:stop]
        problem = _differ(to_numpy(buf).reshape(-1)[start:stop],
                          expected.reshape(-1)[start:stop], tol_chunk)
        if problem:
            return f"after ring_reduce_scatter, chunk {comm.rank}: {problem}"
        out = C.ring_allgather(buf, comm)
    else:
        out = run_algorithm(algorithm, buf, comm, op)
    return "did not return its input buffer" if out is not buf else _differ(buf, expected, tol)


def compare_with_native(algorithms, lengths=None, dtypes=DTYPES, ops=C.OPS, seed=0,
                        transport="torch", timeout=30.0, containers=None):
    """Run each of ``algorithms`` and the native allreduce on the same inputs; return mismatches.

    ``algorithms``: a name (see :func:`run_algorithm`) or a list of names; the native result is
    computed once per case. Cases: each length in ``lengths`` (default 0, 1, 3, N-1, 1000, 1001)
    and a (3, 7) matrix, for every dtype and op. ``containers``: "numpy", "torch" and/or "cuda"
    (see :func:`make_buffer`; default: the transport's own kind, and the other kind too for the
    longest length). Returns one string
    per case that differs; empty when all agree. Runs on every rank.
    Introduced in notebooks/05_allreduce.ipynb.
    """
    algorithms = [algorithms] if isinstance(algorithms, str) else list(algorithms)
    comm = get_comm(transport, timeout=timeout)
    lengths = (0, 1, 3, comm.world_size - 1, 1000, 1001) if lengths is None else lengths
    kind = buffer_kind(comm)
    containers = containers or (kind, "numpy" if kind == "torch" else "torch")
    shapes = [(n,) for n in lengths] + [(3, 7)]
    longest = max(range(len(lengths)), key=lambda k: lengths[k]) if lengths else -1
    mismatches = []
    for dtype in dtypes:
        for op in ops:
            for k, shape in enumerate(shapes):
                x = rank_input(seed, comm.rank, shape, dtype)
                expected = _native(comm, x, op)
                tol = _tolerance(comm.world_size, seed, shape, dtype, op)
                for kind in containers if k == longest else containers[:1]:
                    for algorithm in algorithms:
                        problem = _compare_one(comm, algorithm, x, expected, tol, op, kind)
                        if problem:
                            mismatches.append(f"rank {comm.rank}: {algorithm} op={op} {dtype} "
                                              f"{kind} shape {shape}: {problem}")
    return mismatches


# ---------------------------------------------------------------- failures on purpose
def mismatched_allreduce(algorithm="ring", odd_rank=1, n=1000, odd_n=None, odd_dtype=None,
                         op="sum", odd_op=None, transport="torch", timeout=10.0):
    """Every rank calls ``algorithm``; ``odd_rank`` passes another length, dtype or op.

    Every rank should raise the same ValueError naming the ranks and shapes; nothing moves
    after the agreement check, so the communicator stays usable. Introduced in
    notebooks/05_allreduce.ipynb.
    """
    comm = get_comm(transport, timeout=timeout)
    if comm.rank == odd_rank:
        n, op = odd_n or n, odd_op or op
    x = np.ones(n, odd_dtype if comm.rank == odd_rank and odd_dtype else np.float32)
    return run_algorithm(algorithm, make_buffer(x, comm, buffer_kind(comm)), comm, op)


def allreduce_without(missing_rank, algorithm="ring", n=1000, transport="torch", timeout=2.0):
    """Every rank but ``missing_rank`` calls ``algorithm``: the others' CommTimeout names it.

    Introduced in notebooks/05_allreduce.ipynb.
    """
    comm = get_comm(transport, timeout=timeout)
    if comm.rank == missing_rank:
        return None
    buf = make_buffer(np.ones(n, np.float32), comm, buffer_kind(comm))
    return run_algorithm(algorithm, buf, comm)


def _mismatch_report(comm, algorithms):
    """Every rank must raise ValueError for each mismatch, and a correct call work right after."""
    problems = []
    cases = [({"odd_n": 999}, "rank 1: (999,) float32"),
             ({"odd_dtype": "float64"}, "rank 1: (1000,) float64"),
             ({"odd_op": "max"}, "rank 1: (1000,) float32 op='max'"),
             ({"op": "avg"}, "op must be one of")]
    for algorithm in algorithms if comm.world_size > 1 else []:
        for kwargs, words in cases:
            try:
                mismatched_allreduce(algorithm, transport=comm.transport, **kwargs)
                problems.append(f"rank {comm.rank}: {algorithm} {kwargs}: no ValueError")
            except ValueError as e:
                if words not in str(e):
                    problems.append(f"rank {comm.rank}: {algorithm}: {words!r} not in: {e}")
        buf = make_buffer(np.full(10, comm.rank, np.float32), comm, buffer_kind(comm))
        run_algorithm(algorithm, buf, comm)
        if (buf != comm.world_size * (comm.world_size - 1) / 2).any():
            problems.append(f"rank {comm.rank}: {algorithm} wrong right after a mismatch")
    return problems


def compare_all_to_all_with_native(seed: int = 0, transport: str = "torch",
                                   timeout: float = 30.0, container: str | None = None
                                   ) -> list[str]:
    """Each all-to-all of :data:`collectives.ALL_TO_ALL` (pairwise, naive) against the native
    one on the same uneven blocks (some empty): ``dist.all_to_all_single`` (torch) or
    ``Alltoallv`` (MPI), int64 and float64, single values and rows of 3. Returns one string
    per case that differs; runs on every rank. ``container``: the kind of buffer ours are given
    (:func:`make_buffer`; default the transport's own).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    comm = get_comm(transport, timeout=timeout)
    n, r = comm.world_size, comm.rank
    counts = np.random.default_rng([seed, n]).integers(0, 4, size=(n, n))  # [s, q]: s sends q
    send_counts, recv_counts = counts[r], counts[:, r]
    kind, problems = container or buffer_kind(comm), []
    for dtype in ("int64", "float64"):
        for width in (1, 3):
            x = (np.arange(send_counts.sum() * width) + 1000 * r).astype(dtype).reshape(-1, width)
            empty = np.zeros((recv_counts.sum(), width), dtype)
            ours = [C.ALL_TO_ALL[a](make_buffer(x, comm, kind), make_buffer(empty, comm, kind),
                                    comm,
                                    send_counts.tolist(), recv_counts.tolist())
                    for a in C.ALL_TO_ALL]
            if comm.transport == "mpi":
                theirs = empty.copy()
                comm.mpi.Alltoallv([x, (send_counts * width).tolist()],
                                   [theirs, (recv_counts * width).tolist()])
            else:
                send, theirs = make_buffer(x, comm, "torch"), make_buffer(empty, comm, "torch")
                comm.dist.all_to_all_single(theirs, send, recv_counts.tolist(),
                                            send_counts.tolist(), group=comm.group)
            for algorithm, got in zip(C.ALL_TO_ALL, ours, strict=True):
                if not np.array_equal(to_numpy(got), to_numpy(theirs)):
                    problems.append(f"rank {r}: {algorithm} all_to_all {dtype} rows of {width}, "
                                    f"counts {counts.tolist()}: {to_numpy(got).ravel().tolist()} "
                                    f"!= native {to_numpy(theirs).ravel().tolist()}")
    return problems


# ---------------------------------------------------------------- under a launcher
def main(argv=None):
    """Under mpiexec / torchrun: check the algorithms on every rank; report as JSON per rank."""
    p = argparse.ArgumentParser(prog="python -m course_lib.testing.collectives")
    a = p.add_argument
    a("--transport", default="mpi", choices=["mpi", "torch"])
    a("--backend", default="gloo", choices=["gloo", "nccl"], help="torch transport only")
    a("--algorithms", default=",".join(ALL))
    a("--lengths", default=None, help="comma-separated (default: 0,1,3,N-1,1000,1001)")
    a("--dtypes", default=",".join(DTYPES))
    a("--ops", default=",".join(C.OPS))
    a("--containers", default=None, help="numpy,torch (default: by transport)")
    a("--mismatch", action="store_true", help="also check the errors of mismatched calls")
    a("--all-to-all", action="store_true",
      help="also check all_to_all against Alltoallv / all_to_all_single, uneven blocks")
    a("--timeout", type=float, default=30.0)
    a("--out", default=None, help="write rank<r>.json into this folder instead of printing")
    args = p.parse_args(argv)
    if args.transport == "torch":
        from course_lib.comm import init_torch_from_launcher
        if args.backend == "nccl":
            import torch
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        init_torch_from_launcher(args.backend, timeout=args.timeout)
    comm = get_comm(args.transport, timeout=args.timeout)
    algorithms = args.algorithms.split(",")
    problems = compare_with_native(
        algorithms, None if args.lengths is None else [int(n) for n in args.lengths.split(",")],
        args.dtypes.split(","), args.ops.split(","), transport=args.transport,
        timeout=args.timeout, containers=args.containers and tuple(args.containers.split(",")))
    if args.all_to_all:
        problems += compare_all_to_all_with_native(transport=args.transport, timeout=args.timeout)
    if args.mismatch:
        problems += _mismatch_report(comm, [x for x in algorithms if x in C.ALGORITHMS])
    comm.barrier()
    report = json.dumps({"rank": comm.rank, "world_size": comm.world_size,
                         "transport": args.transport, "algorithms": algorithms,
                         "problems": problems})
    if args.out:
        Path(args.out, f"rank{comm.rank}.json").write_text(report)
    else:
        print(report, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
