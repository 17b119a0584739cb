"""The checks around torch.distributed's own calls: a process group, equal sizes, deadlines.

Introduced in notebooks/06_data_parallel_sgd.ipynb. The data parallelism of :mod:`course_lib.ddp`
calls torch.distributed's native collectives (broadcast, allreduce, all_gather). Before and
around each one:

    dist = dist_or_fail()                      # torch.distributed, initialised, or a clear error
    agree(layout(tensors), "the tensors", 30)  # every rank holds the same sizes, else DDPError
    wait_work(dist.all_reduce(t, async_op=True), 30, "allreduce of t")   # with a deadline

and the same in one call each, as :mod:`course_lib.ddp` uses them:

    params, grads = checked_gradients(params, 30)   # every rank has the same gradients
    agree_layouts(tensors, "the tensors", 30)       # agree(layout(tensors), ...) on their device
    all_reduce(grads[0], 30, "the gradient of parameter 0")   # dist.all_reduce, with a deadline
    broadcast(t, 0, 30, "t")                                  # dist.broadcast, with a deadline

A native collective given different sizes on two ranks may abort Gloo or return a wrong sum,
so :func:`agree` compares a small fixed-size record first, with one ``all_gather`` of a few
integers on the tensors' device (so it works on NCCL too). The from-scratch collectives use
:func:`course_lib.comm.agreement.check_agreement` instead: it travels over :mod:`course_lib.comm`
and needs no process group (see that module).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
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


def checked_gradients(params: Iterable[torch.nn.Parameter],
                      timeout: float) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """The parameters of ``params`` that train, and their gradients, once every rank holds a
    gradient for each of them, of the same shapes and dtypes: else a :class:`DDPError` naming
    the parameters without one, or every rank's layout (raised before any gradient moves).
    What ``ddp.average_gradients_naive`` checks first.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    dist = dist_or_fail()
    params = [p for p in params if p.requires_grad]
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        raise DDPError(f"rank {dist.get_rank()}: parameters {missing[:8]} have no gradient: "
                       "call backward first, or use horovod.average_gradients, which handles them")
    grads = [p.grad for p in params]
    agree_layouts(grads, "the gradients [count, elements, checksum]", timeout)
    return params, grads


def agree_layouts(tensors: Sequence[torch.Tensor], what: str, timeout: float) -> None:
    """:func:`agree` on the :func:`layout` of ``tensors`` (count, elements, shapes and dtypes),
    on the tensors' device. Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    agree(layout(tensors), what, timeout, tensors[0].device if tensors else "cpu")


def all_reduce(tensor: torch.Tensor, timeout: float, what: str) -> None:
    """``dist.all_reduce(tensor)``, a sum in place, with a deadline: past it, or on failure, a
    :class:`DDPError` naming this rank, ``what`` and the tensor's size.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    wait_work(dist_or_fail().all_reduce(tensor, async_op=True), timeout,
              f"allreduce of {what} ({tensor.numel()} elements)")


def broadcast(tensor: torch.Tensor, root: int, timeout: float, what: str) -> None:
    """``dist.broadcast(tensor, src=root)``, in place, with a deadline: past it, or on failure, a
    :class:`DDPError` naming this rank, ``what``, the tensor's size and ``root``.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    wait_work(dist_or_fail().broadcast(tensor, src=root, async_op=True), timeout,
              f"broadcast of {what} ({tensor.numel()} elements) from rank {root}")
