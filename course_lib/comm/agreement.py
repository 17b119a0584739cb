"""Do all ranks agree? The check every collective runs before any data moves.

Introduced in notebooks/05_allreduce.ipynb. A native collective given a different shape on one
rank may abort the process or silently return a wrong sum; here every rank first sends a small
fixed-size record (shape, dtype, collective, op, contiguity) to every other rank, and if any
record differs EVERY rank raises the same ``ValueError`` naming the ranks and their shapes. A
rank that never calls is named by the others' ``CommTimeout``. It costs one message round.

Why two agreement checks in the course: this one travels over :mod:`course_lib.comm`
(point-to-point, torch or MPI, numpy or torch buffers) and guards the from-scratch collectives,
which may run where no process group exists (under mpiexec).
:func:`course_lib.comm.dist_checks.agree` uses one native ``all_gather`` of a few integers and
guards torch.distributed's own collectives (DDP's broadcasts and gradient buckets, on the
buffers' device, so it works on NCCL too).

Like the collectives it guards, this module imports no torch at the top: they run under
mpiexec on numpy buffers, where torch need not be loaded (it takes seconds).
"""

from __future__ import annotations

import functools
import zlib
from typing import TYPE_CHECKING

import numpy as np

from course_lib.comm import Comm, is_numpy, to_numpy, wait_all

if TYPE_CHECKING:  # for the annotations only (see the module docstring)
    import torch

OPS = ("sum", "average", "max", "min")
TAG_CHECK = 11
_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
           "int64", "bool", "complex64", "complex128")
_NAMES = ("allreduce", "naive_allreduce", "tree_allreduce", "ring_allreduce",
          "ring_allreduce_pipelined", "ring_reduce_scatter", "ring_allgather")
_META, _MAXDIM = 15, 8  # int64 slots exchanged; shape dims spelled out
# a record: [0] ndim, [1] crc(dtype), [2] crc(what), [3] crc(op), [4] contiguous,
# [5] crc(dims past _MAXDIM), [6] extra, [7:15] the first _MAXDIM dims (zero-padded)


@functools.lru_cache(maxsize=256)
def _name(dtype):  # str() of a numpy dtype takes microseconds: cached
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=256)
def _crc(text):  # names travel as crc32s: every record is the same fixed number of int64s
    return zlib.crc32(text.encode())


def _meta(buf, what, op, extra):
    """This rank's record: ndim, dtype, what, op, contiguous, crc of dims past 8, extra, dims."""
    shape, contiguous = tuple(buf.shape), (buf.flags.c_contiguous if is_numpy(buf)
                                           else buf.is_contiguous())
    head = [len(shape), _crc(_name(buf.dtype)), _crc(what), _crc(str(op)), contiguous,
            _crc(str(shape[_MAXDIM:])), extra]
    dims = list(shape[:_MAXDIM])
    return np.array(head + dims + [0] * (_MAXDIM - len(dims)), np.int64)


def _describe(row, fields):
    """'(1000,) float32' (and the op, collective, segment size when those differ)."""
    decode = {_crc(str(v)): v for v in (*_DTYPES, *OPS, None, *_NAMES)}  # crc32 -> the name
    ndim = int(row[0])
    dims = [str(d) for d in row[7:7 + min(ndim, _MAXDIM)]] + ["..."] * (ndim > _MAXDIM)
    text = f"({', '.join(dims)}{',' if ndim == 1 else ''}) {decode.get(row[1], '?')}"
    extras = {"ops": f" op={decode.get(row[3], '?')!r}", "collectives": f" {decode.get(row[2])}",
              "segment sizes": f" segment_bytes={row[6]}"}
    return text + "".join(extras[f] for f in fields if f in extras)


def check_agreement(buf: np.ndarray | torch.Tensor, comm: Comm, what: str = "allreduce",
                    op: str | None = None, extra: int = 0) -> None:
    """Check, before any data moves, that every rank called ``what`` on a matching buffer.

    Every rank sends a fixed-size int64 record (shape, dtype, ``what``, ``op``, contiguity,
    ``extra``: an integer all must share, e.g. a segment size) straight to every other rank, so
    a rank that never calls is named by the others' ``CommTimeout``. If any record differs, EVERY
    rank raises the same ``ValueError`` naming the ranks and their shapes/dtypes; it also raises
    for an op not in ``OPS`` or a non-contiguous buffer. World size 1: nothing is sent.
    Introduced in notebooks/05_allreduce.ipynb.
    """
    mine = _meta(buf, what, op, extra)
    table = np.empty((comm.world_size, _META), np.int64)
    table[comm.rank] = mine
    if comm.world_size > 1:
        send, recv = mine, table
        if not is_numpy(buf):  # a tensor on the buffer's device: NCCL moves only CUDA tensors
            import torch  # a tensor was passed, so torch is loaded (see the module docstring)
            send, recv = (torch.from_numpy(a).to(buf.device) for a in (mine, table))
        recvs, sends = [], []
        for p in (q for q in range(comm.world_size) if q != comm.rank):
            # per pair the lower rank sends first, the higher receives first: NCCL runs a
            # pair's operations in the order posted, and two receives first would deadlock
            if comm.rank < p:
                sends.append(comm.isend(send, p, tag=TAG_CHECK, check_size=False))
            recvs.append(comm.irecv(recv[p], p, tag=TAG_CHECK, check_size=False))
            if comm.rank > p:
                sends.append(comm.isend(send, p, tag=TAG_CHECK, check_size=False))
        wait_all(recvs + sends)  # receives first, in rank order: a missing rank is named
        table = to_numpy(recv)
    same = table.tobytes() == mine.tobytes() * len(table)  # the common case, decided fast
    differ = [] if same else [
        name for name, cols in (("shapes/dtypes", [0, 1, 5, *range(7, _META)]), ("ops", [3]),
                                ("collectives", [2]), ("segment sizes", [6]))
        if (table[:, cols] != mine[cols]).any()]
    if differ:
        odd = [r for r in range(len(table)) if (table[r] != table[0]).any()]
        shown = list(range(len(table))) if len(table) <= 8 else [0] + odd[:7]  # 8 at most
        ranks = ", ".join(f"rank {r}: {_describe(table[r], differ)}" for r in shown)
        more = f" (and {len(odd) - 7} more)" if len(shown) <= len(odd) else ""
        raise ValueError(f"{what}: {'/'.join(differ)} differ across ranks: {ranks}{more}")
    if not (mine[4] if same else table[:, 4].all()):  # slot 4: contiguous
        raise ValueError(f"{what}: buffers must be contiguous, rank(s) "
                         f"{np.flatnonzero(table[:, 4] == 0).tolist()[:8]} passed a strided view: "
                         "pass x.contiguous() / np.ascontiguousarray(x)")
    if op is not None and op not in OPS:
        raise ValueError(f"{what}: op must be one of {OPS}, not {op!r}")
