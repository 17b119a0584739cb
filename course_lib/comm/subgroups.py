"""The process group (and comm) of the first ``world_size`` ranks of a cluster, so that one
cluster checks several world sizes. Introduced in notebooks/09_model_parallelism.ipynb."""

from __future__ import annotations

from course_lib.comm import DEFAULT_TIMEOUT, TorchComm, get_comm
from course_lib.engine import ENGINE


def subgroup(world_size=None):
    """The process group of ranks ``0 .. world_size-1`` (None: the whole world). Every rank must
    call it; a subgroup is made once per size and kept until the process group is made again.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist
    world = dist.get_world_size()
    if world_size is None or world_size == world:
        return None
    if not 1 <= world_size <= world:
        raise ValueError(f"world_size must be in 1..{world}, not {world_size!r}")
    groups = ENGINE.setdefault("subgroups", {})  # shared with checks/lab02: the same groups
    if world_size not in groups:
        groups[world_size] = dist.new_group(list(range(world_size)))
    return groups[world_size]


def subgroup_comm(world_size=None, timeout=DEFAULT_TIMEOUT):
    """This rank's comm over the first ``world_size`` ranks, or None on the ranks outside them.
    Every rank must call it. Introduced in notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist
    group = subgroup(world_size)
    if group is None:
        return get_comm("torch", timeout=timeout)
    return TorchComm(group, timeout=timeout) if dist.get_rank() < world_size else None
