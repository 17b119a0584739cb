"""What runs on each engine of a cluster: its rank, its process group, and small rank demos.

Introduced in notebooks/00_welcome_and_cluster.ipynb. ``course_lib.runtime.cluster`` calls
``probe_engine`` and ``setup_engine`` on every engine; the rest are functions a notebook sends
to the ranks with ``cluster.run(...)`` to see ranks, backends and deadlines at work.

This module stays free of torch at import: ``course_lib.runtime.cluster`` (the notebook's kernel)
and ``course_lib.comm`` (which must import without torch under mpiexec) import it, and torch takes
seconds; the functions that run on a rank import torch themselves.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from course_lib.runtime import netem, stacks

ENGINE: dict = {}  # on an engine: this rank's identity, filled in by setup_engine


def probe_engine() -> dict:
    """Report host, pid, GPUs and MPI rank (if any) so the client can assign ranks.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    info = {"host": socket.gethostname(), "pid": os.getpid(), "gpus": 0, "nccl": False,
            "mpi_rank": None}
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        info["mpi_rank"] = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")))
    import torch  # kept off the module's import (see the module docstring)
    import torch.distributed as dist
    if torch.cuda.is_available():
        info["gpus"] = torch.cuda.device_count()
        info["nccl"] = dist.is_nccl_available()
    return info


def setup_engine(rank: int, world_size: int, local_rank: int, backend: str, init_method: str,
                 timeout_s: float, threads: int, loopback: bool,
                 link: netem.Link | None = None) -> int:
    """Give this engine its rank and (re)create its process group; switch its emulated link
    (``course_lib.runtime.netem``) on or off. Runs on every engine.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import torch  # kept off the module's import (see the module docstring)
    import torch.distributed as dist

    netem.set_link(link)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # Gloo's sockets listen on 127.0.0.1 only
    torch.set_num_threads(threads)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    # a repair or a reused engine: the old group goes (a timeout may have closed its Gloo pairs)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    ENGINE.update(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend,
                  device=device, host=socket.gethostname(), pid=os.getpid(), group=init_method)
    stacks.serve(ENGINE)  # where this rank is, asked while a call hangs (course_lib.runtime.stacks)
    ENGINE.pop("broken", None)  # a fresh process group
    ENGINE.pop("subgroups", None)  # groups of the old one (checks/lab02_parallel_computing.py)
    return rank


def mark_group_broken(reason: str) -> None:
    """Remember that this rank's process group may be unusable: a message or collective missed
    its deadline, so a peer may still be inside it, even if the caller caught the error. The
    cluster re-creates the group before its next call. Introduced in
    notebooks/00_welcome_and_cluster.ipynb."""
    ENGINE["broken"] = reason


def call_and_report(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, str | None]:
    """What ``Cluster.run`` runs on every rank: ``fn(*args, **kwargs)``, and whether it left the
    process group broken (see :func:`mark_group_broken`). Introduced in
    notebooks/00_welcome_and_cluster.ipynb."""
    __tracebackhide__ = True  # a rank's traceback starts at fn, not here
    ENGINE.pop("broken", None)
    result = fn(*args, **kwargs)
    return result, ENGINE.pop("broken", None)


def engine_info() -> dict:
    """This engine's rank, world size, local rank, host, pid, backend, device and threads.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import torch  # kept off the module's import (see the module docstring)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    plain = {k: v for k, v in ENGINE.items() if k != "subgroups"}  # process groups: not data
    return dict(plain, threads=torch.get_num_threads(), env=env)


def hello() -> str:
    """A greeting from this rank: who it is, where it runs, which backend it uses.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    e = ENGINE
    return (f"hello from rank {e['rank']} of {e['world_size']} (local rank {e['local_rank']}, "
            f"pid {e['pid']} on {e['host']}, {e['backend']} on {e['device']})")


def allreduce_ranks() -> float:
    """Sum every rank's number with the native allreduce: 0 + 1 + ... + (world_size - 1).

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import torch  # kept off the module's import (see the module docstring)
    import torch.distributed as dist
    t = torch.tensor([float(ENGINE["rank"])], device=ENGINE["device"])
    dist.all_reduce(t)
    return t.item()


def mpi_hello() -> dict:
    """The same ranks seen through MPI (engines started with engines="mpi").

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    from mpi4py import MPI  # optional (the mpi extra): only on engines="mpi"
    comm = MPI.COMM_WORLD
    return {"mpi_rank": comm.Get_rank(), "mpi_size": comm.Get_size(),
            "sum_of_ranks": comm.allreduce(comm.Get_rank())}


def sleep_on(ranks: list[int], seconds: float) -> int:
    """Sleep ``seconds`` on the given ranks (a slow rank, to watch a deadline fire).

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    if ENGINE["rank"] in ranks:
        time.sleep(seconds)
    return ENGINE["rank"]


def skip_collective(rank: int) -> float | None:
    """Every rank but ``rank`` joins an allreduce: the classic hang, bounded by deadlines.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    return allreduce_ranks() if ENGINE["rank"] != rank else None


def exit_on(rank: int, others_sleep: float = 30.0) -> int:
    """The process of ``rank`` exits at once (an engine that dies mid-call); the other ranks
    sleep ``others_sleep`` seconds and return their rank.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    if ENGINE["rank"] == rank:
        os._exit(1)  # no clean-up, no exception: as a crash or an OOM kill looks to its peers
    time.sleep(others_sleep)
    return ENGINE["rank"]


def free_port_and_host() -> tuple[str, int]:
    """Rank 0 of a multi-host cluster: a free TCP port on this host, for the rendezvous.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    with socket.socket() as s:
        s.bind(("", 0))  # port 0: the kernel picks a free one (closed again before rank 0 binds it)
        return socket.gethostbyname(socket.gethostname()), s.getsockname()[1]


def choose_backend(probes: list[dict], backend: str = "auto") -> tuple[str, str]:
    """Return (backend, reason): NCCL when every rank has its own GPU, else Gloo.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    per_host = {}
    for p in probes:
        per_host[p["host"]] = per_host.get(p["host"], 0) + 1
    # hosts with fewer GPUs than ranks: NCCL needs one GPU per rank (pinned by local rank)
    short = [h for h, k in per_host.items() if min(p["gpus"] for p in probes if p["host"] == h) < k]
    own_gpu = not short and all(p["nccl"] for p in probes)
    if backend == "nccl" and not own_gpu:
        raise ValueError("backend='nccl' needs one GPU per rank and NCCL; hosts short of GPUs: "
                         f"{short or 'none (NCCL unavailable)'}")
    if backend == "gloo":
        return "gloo", "Gloo, as asked"
    if own_gpu:
        return "nccl", "NCCL: every rank has a GPU of its own (pinned by local rank)"
    # the GPUs of the machine: each host's once (every rank on a host sees the same ones)
    gpus = sum(min(p["gpus"] for p in probes if p["host"] == h) for h in per_host)
    return "gloo", (f"Gloo: {len(probes)} ranks but {gpus} GPU(s), so not every rank has a "
                    "GPU of its own (NCCL refuses two ranks on one GPU)" if gpus
                    else "Gloo: no GPU visible, CPU tensors")


