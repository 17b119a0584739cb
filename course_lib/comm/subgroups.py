"""The process group (and comm) of the first ``world_size`` ranks of a cluster, so that one
cluster checks several world sizes. Introduced in notebooks/09_model_parallelism.ipynb.

torch is imported in the functions, not at the top, so that importing this module costs no
torch's seconds (:mod:`course_lib.staging` imports it and is itself free of torch at import).
"""

from __future__ import annotations

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
    if world_size is None or world_size == world:
        return None
    if not 1 <= world_size <= world:
        raise ValueError(f"world_size must be in 1..{world}, not {world_size!r}")
    groups = ENGINE.setdefault("subgroups", {})  # shared with checks/lab02: the same groups
    # new_group is a call of the whole world: every rank makes it, even those left outside
    if world_size not in groups:
        groups[world_size] = dist.new_group(list(range(world_size)))
    return groups[world_size]


def subgroup_comm(world_size: int | None = None,
                  timeout: float = DEFAULT_TIMEOUT) -> TorchComm | None:
    """This rank's comm over the first ``world_size`` ranks, or None on the ranks outside them.
    Every rank must call it. Introduced in notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist  # not at the top (see the module docstring)
    group = subgroup(world_size)
    if group is None:
        return get_comm("torch", timeout=timeout)
    return TorchComm(group, timeout=timeout) if dist.get_rank() < world_size else None
