"""The checks around torch.distributed's own calls: a process group, equal sizes, deadlines.

Introduced in notebooks/06_data_parallel_sgd.ipynb. The data parallelism of :mod:`course_lib.ddp`
calls torch.distributed's native collectives (broadcast, allreduce, all_gather). Before and
around each one:

    dist = dist_or_fail()                      # torch.distributed, initialised, or a clear error
    agree(layout(tensors), "the tensors", 30)  # every rank holds the same sizes, else DDPError
    wait_work(dist.all_reduce(t, async_op=True), 30, "allreduce of t")   # with a deadline

A native collective given different sizes on two ranks may abort Gloo or return a wrong sum,
so :func:`agree` compares a small fixed-size record first, with one ``all_gather`` of a few
integers on the tensors' device (so it works on NCCL too). The from-scratch collectives use
:func:`course_lib.agreement.check_agreement` instead: it travels over :mod:`course_lib.comm` and
needs no process group (see that module).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.distributed

from course_lib.comm import wait_work as comm_wait_work


class DDPError(RuntimeError):
    """A gradient exchange (or a broadcast of the data-parallel wrappers) failed or missed its
    deadline.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""


def dist_or_fail() -> ModuleType:
    """``torch.distributed``, initialised, or a clear error.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    if not torch.distributed.is_initialized():
        raise DDPError("torch.distributed is not initialised: run on a cluster's ranks "
                       "(start_cluster) or under torchrun / mpiexec")
    return torch.distributed


def wait_work(work: torch.distributed.Work, timeout: float, what: str) -> None:
    """:func:`course_lib.comm.wait_work`, raising :class:`DDPError`.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    comm_wait_work(work, timeout, what, DDPError)


def layout(tensors: Sequence[torch.Tensor]) -> list[int]:
    """``[count, elements, checksum of shapes and dtypes]``: what ranks must agree on.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    text = ";".join(f"{tuple(t.shape)}{t.dtype}" for t in tensors)
    return [len(tensors), sum(t.numel() for t in tensors), zlib.crc32(text.encode())]


def agree(record: Sequence[int], what: str, timeout: float,
          device: torch.device | str = "cpu") -> None:
    """Check that every rank holds the same small int64 ``record`` (sizes, a checksum) before
    a native collective whose sizes must match: a mismatch there can abort Gloo or return a
    wrong sum. Raises :class:`DDPError` on every rank, naming each rank's record.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    dist = dist_or_fail()
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    # the record has the same length on every rank, so this all_gather is safe itself
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    wait_work(dist.all_gather(table, mine, async_op=True), timeout,
              f"agreement on {what} ({len(record)} integers)")
    rows = [t.tolist() for t in table]
    if any(row != rows[0] for row in rows):
        listed = ", ".join(f"rank {r}: {row}" for r, row in enumerate(rows[:8]))
        raise DDPError(f"rank {dist.get_rank()}: the ranks disagree on {what}: {listed}")
