"""The process group (and comm) of the first ``world_size`` ranks of a cluster, so that one
cluster checks several world sizes, and the cache of process groups that makes each group of ranks
once per engine (a mesh reuses them). Introduced in notebooks/09_model_parallelism.ipynb.

torch is imported in the functions, not at the top, so that importing this module costs no
torch's seconds (:mod:`course_lib.staging` imports it and is itself free of torch at import).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from course_lib.comm import DEFAULT_TIMEOUT, TorchComm, get_comm
from course_lib.runtime.engine import ENGINE

if TYPE_CHECKING:  # for the annotations only (see the module docstring)
    from torch.distributed import ProcessGroup


def subgroup(world_size: int | None = None) -> ProcessGroup | None:
    """The process group of ranks ``0 .. world_size-1`` (None: the whole world). Every rank must
    call it; a subgroup is made once per size and kept until the process group is made again.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist  # not at the top (see the module docstring)
    world = dist.get_world_size()
    if world_size is None:
        return None
    if not 1 <= world_size <= world:
        raise ValueError(f"world_size must be in 1..{world}, not {world_size!r}")
    return group_of(range(world_size))


def group_of(ranks: Iterable[int]) -> ProcessGroup | None:
    """The process group of ``ranks`` (None: the whole world), made at the first call and kept
    until the process group is made again. ``new_group`` is a call of the whole world: every
    rank must call this with the same ranks in the same order, those left outside included.
    Each group Gloo makes keeps threads and sockets for the life of the process, so a group of
    the same ranks is made once.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist  # not at the top (see the module docstring)
    key = tuple(ranks)
    if key == tuple(range(dist.get_world_size())):
        return None
    groups = ENGINE.setdefault("subgroups", {})  # every lesson's and check's groups, by ranks
    if key not in groups:
        groups[key] = dist.new_group(list(key))
    return groups[key]


def subgroup_comm(world_size: int | None = None,
                  timeout: float = DEFAULT_TIMEOUT) -> TorchComm | None:
    """This rank's comm over the first ``world_size`` ranks, or None on the ranks outside them.
    Every rank must call it. Introduced in notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist  # not at the top (see the module docstring)
    group = subgroup(world_size)
    if group is None:
        return get_comm("torch", timeout=timeout)
    return TorchComm(group, timeout=timeout) if dist.get_rank() < world_size else None
