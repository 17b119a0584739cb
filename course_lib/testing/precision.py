"""What notebook 16 runs on every rank: ZeRO-3's all-gather of a weight in bf16 and in FP8,
on the emulated link, bytes counted by the communicator.
Introduced in notebooks/16_planning_a_run.ipynb."""

from __future__ import annotations

import time

import torch

from course_lib import precision
from course_lib.collectives import ring_allgather
from course_lib.comm import get_comm


def _shard(rank, numel):
    return 0.02 * torch.randn(numel, generator=torch.Generator().manual_seed(rank))


def all_gather_fp8_on_rank(numel=1 << 19, link="1GbE", repeats=3):
    """On every rank: a weight of ``numel`` numbers per rank all-gathered (the ring) in bf16
    and in FP8 (as :func:`precision.fp8_all_gather`) over the emulated ``link``. For each: the
    bytes this rank sent; its fastest time of ``repeats`` on the wire (the ring alone) and in
    all (with the casts to and from 16 or 8 bits); the gathered weight's relative error
    against float32. Introduced in notebooks/16_planning_a_run.ipynb."""
    comm = get_comm("torch", link=link)
    rank, world = comm.rank, comm.world_size
    full = torch.cat([_shard(r, numel) for r in range(world)])
    mine = _shard(rank, numel)

    def pack_bf16():
        buf = torch.zeros(world, numel, dtype=torch.bfloat16)
        buf[rank] = mine.bfloat16()
        return buf

    ways = {"bf16": (pack_bf16, lambda buf: buf.float().flatten()),
            "fp8": (lambda: precision.fp8_pack(mine, rank, world), precision.fp8_unpack)}
    out = {}
    for name, (pack, unpack) in ways.items():
        wire_s, total_s = [], []
        for _ in range(repeats):
            comm.barrier()
            sent, start = comm.bytes_sent, time.perf_counter()
            buf = pack()
            ring_start = time.perf_counter()
            ring_allgather(buf.view(-1), comm, check=False)  # equal sizes: no check's messages
            ring_end = time.perf_counter()
            gathered = unpack(buf)
            wire_s.append(ring_end - ring_start)
            total_s.append(time.perf_counter() - start)
            bytes_sent = comm.bytes_sent - sent
        out[name] = {"bytes": bytes_sent, "wire_s": min(wire_s), "total_s": min(total_s),
                     "error": precision.relative_error(gathered, full), "numbers": numel * world}
    return out
