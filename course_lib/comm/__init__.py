"""Point-to-point messages between ranks, with a deadline on every wait.

Introduced in notebooks/02_parallel_computing.ipynb; the collectives of
notebooks/05_allreduce.ipynb are built on it. One interface, several transports::

    comm = get_comm("torch")      # torch.distributed: Gloo on CPU tensors, NCCL on CUDA tensors
    comm = get_comm("mpi")        # mpi4py: numpy arrays (or CPU tensors), sent as raw bytes
    comm.sendrecv(x, (comm.rank + 1) % comm.world_size, y, (comm.rank - 1) % comm.world_size)

``send``/``recv`` block, ``isend``/``irecv`` return a :class:`Request` to ``wait`` on, and
``sendrecv`` posts its receive before its send, so a ring of them never deadlocks the way a ring
of blocking sends does. When a wait passes its deadline it raises :class:`CommTimeout` naming the
operation, this rank, the peer and the size, instead of hanging. Works on cluster engines (the
process group ``start_cluster`` made), under ``torchrun`` and under ``mpiexec``.

The package, one module per part:

* ``base``: the deadline, the errors (and :func:`during`, which puts a lesson's "who, what,
  which step" in front of one), :class:`Request` and the :class:`Comm` base class, whose
  docstring writes down the protocol a transport implements;
* ``torch_transport``: :class:`TorchComm` (and :func:`init_torch_from_launcher`);
* ``mpi_transport``: :class:`MpiComm`;
* ``recording``: :class:`RecordingComm`, ranks as threads of one process with every message
  recorded (:func:`run_ranks`: how notebook 05 draws the ring from the library's own code);
* ``subgroups``: the comm of the first ``world_size`` ranks, so one cluster runs several sizes.

The transports import ``base``; ``base`` imports none of them. torch and mpi4py are imported
only when a comm of theirs is made (torch takes seconds; mpi4py is optional).
"""

from __future__ import annotations

from typing import Any

from course_lib.comm.base import (
    DEFAULT_TIMEOUT,
    HEADER_TAG,
    STAMP_TAG,
    Comm,
    CommError,
    CommTimeout,
    Request,
    describe,
    during,
    is_numpy,
    nbytes,
    to_numpy,
    wait_all,
    wait_work,
)
from course_lib.comm.mpi_transport import MpiComm
from course_lib.comm.recording import Message, RecordingComm, run_ranks
from course_lib.comm.torch_transport import TorchComm, init_torch_from_launcher

__all__ = ["DEFAULT_TIMEOUT", "HEADER_TAG", "STAMP_TAG", "Comm", "CommError", "CommTimeout",
           "Message", "MpiComm", "RecordingComm", "Request", "TorchComm", "describe",
           "during", "get_comm", "init_torch_from_launcher", "is_numpy", "nbytes", "run_ranks",
           "to_numpy", "wait_all", "wait_work"]


def get_comm(transport: str = "torch", timeout: float = DEFAULT_TIMEOUT,
             check_sizes: bool | str = True, link: Any = None) -> Comm:
    """This rank's communicator over ``transport`` ("torch" or "mpi"); ``check_sizes=False``
    sends messages without their size check (for code whose sizes are known to match).
    ``link`` ("1Gbit/s,50us", a preset name of ``netem.PRESETS``): every message pays the time
    of that emulated link (default: the process's, as ``start_cluster(link=...)`` sets it).

    Introduced in notebooks/02_parallel_computing.ipynb."""
    if transport == "torch":
        import torch.distributed as dist  # torch takes seconds to import: only when asked for
        if not dist.is_initialized():
            init_torch_from_launcher(timeout=timeout)
        return TorchComm(timeout=timeout, check_sizes=check_sizes, link=link)
    if transport == "mpi":
        return MpiComm(timeout=timeout, check_sizes=check_sizes, link=link)
    raise ValueError(f"transport must be 'torch' or 'mpi', not {transport!r}")
