"""A device mesh: the ranks laid out on named dimensions, one communicator per dimension.

Introduced in notebooks/16_planning_a_run.ipynb. Every earlier notebook used one parallelism at
a time over all the ranks. Combining them lays the ranks out on a grid, say 8 ranks as
``{"pp": 2, "dp": 2, "tp": 2}``: rank r has coordinates (its place along each dimension, the
last dimension varying fastest, as in torch's ``init_device_mesh``), and along each dimension
it talks to the ranks that differ from it in that coordinate alone. Tensor parallelism's
allreduce then runs over the ``tp`` ranks, data parallelism's over the ``dp`` ranks::

    mesh = make_mesh({"dp": 2, "tp": 2})      # on each of 4 ranks (every rank calls it)
    mesh.coords                               # rank 3: {'dp': 1, 'tp': 1}
    mesh["tp"].world_size, mesh["tp"].rank    # 2, 1: its place in its tp group
    ring_allreduce(grads, mesh["dp"])         # the course's collectives, on one dimension

Each dimension's communicator is a real group of the transport (``torch.distributed``'s
``new_group``, MPI's ``Split``), so every collective and point-to-point call of the course runs
on it unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from course_lib.collectives import allreduce
from course_lib.comm import DEFAULT_TIMEOUT, Comm, MpiComm, TorchComm, get_comm
from course_lib.context_parallel import ring_attention, zigzag_positions
from course_lib.moe import ExpertParallelMoE, parallelize_experts
from course_lib.sequence_parallel import ParallelBlock
from course_lib.tensor_parallel import TensorParallel
from course_lib.transformer import GPT, causal_attention


def check_shape(shape: dict[str, int], world_size: int) -> None:
    """ValueError unless every dimension of ``shape`` has a size >= 1 and their product is the
    world size. Introduced in notebooks/16_planning_a_run.ipynb."""
    if not shape or any(not isinstance(n, int) or n < 1 for n in shape.values()):
        raise ValueError(f"mesh shape {shape}: every dimension needs a size of at least 1")
    if math.prod(shape.values()) != world_size:
        raise ValueError(f"mesh shape {shape} holds {math.prod(shape.values())} ranks; "
                         f"the world has {world_size}")


def mesh_groups(shape: dict[str, int]) -> dict[str, list[list[int]]]:
    """For each dimension, its groups: the lists of ranks that differ only along it (row-major
    layout: the last dimension varies fastest).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    grid = np.arange(math.prod(shape.values())).reshape(list(shape.values()))
    return {name: np.moveaxis(grid, i, -1).reshape(-1, size).tolist()
            for i, (name, size) in enumerate(shape.items())}


def coordinates(rank: int, shape: dict[str, int]) -> dict[str, int]:
    """Rank ``rank``'s place along each dimension of ``shape``.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return dict(zip(shape, map(int, np.unravel_index(rank, list(shape.values()))), strict=True))


@dataclass
class Mesh:
    """This rank's place on a mesh: the ``shape``, its ``rank`` in the world, its ``coords``
    and one communicator per dimension (``mesh["tp"]``), whose ranks are the group's.
    Introduced in notebooks/16_planning_a_run.ipynb."""

    shape: dict[str, int]
    rank: int
    coords: dict[str, int]
    comms: dict[str, Comm]

    def __getitem__(self, name: str) -> Comm:
        if name not in self.comms:
            raise KeyError(f"the mesh has dimensions {list(self.shape)}, not {name!r}")
        return self.comms[name]

    def group(self, name: str) -> list[int]:
        """The world ranks of this rank's group along ``name``, in the group's order."""
        return next(g for g in mesh_groups(self.shape)[name] if self.rank in g)


def make_mesh(shape: dict[str, int], transport: str = "torch",
              timeout: float = DEFAULT_TIMEOUT) -> Mesh:
    """This rank's mesh of ``shape`` over the whole world of ``transport``. Every rank calls it
    with the same shape: making a group is a call of every rank, those outside it included.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    world = get_comm(transport, timeout=timeout)
    check_shape(shape, world.world_size)
    comms: dict[str, Comm] = {}
    for name, groups in mesh_groups(shape).items():
        mine = next(i for i, g in enumerate(groups) if world.rank in g)
        if transport == "torch":
            made = [world.dist.new_group(g) for g in groups]  # every rank, every group, in order
            comms[name] = TorchComm(made[mine], timeout=timeout)
        else:  # ranks of one colour form a group, ordered by key
            comms[name] = MpiComm(world.mpi.Split(mine, world.rank), timeout=timeout)
    return Mesh(dict(shape), world.rank, coordinates(world.rank, shape), comms)


# ---------------------------------------------------------------- a transformer on a mesh
DATA_DIMS = ("dp", "ep", "cp")  # the dimensions whose ranks hold different tokens


def size(mesh: Mesh, name: str) -> int:
    """The mesh's size along ``name`` (1 when it has no such dimension).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return mesh.shape.get(name, 1)


def parallelize(model: GPT, mesh: Mesh) -> GPT:
    """Split ``model`` in place for ``mesh``: every block by tensor parallelism over ``tp``
    (notebook 14's Megatron block), every mixture of experts over ``ep`` (notebook 15). The
    other dimensions split the data (:func:`share_of_batch`). Returns ``model``.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if size(mesh, "tp") > 1:
        if model.cfg.experts:
            raise ValueError("tensor parallelism splits dense blocks here: split experts by ep")
        tp = TensorParallel(mesh["tp"])
        model.blocks = nn.ModuleList(ParallelBlock(b, tp) for b in model.blocks)
    if size(mesh, "ep") > 1:
        parallelize_experts(model, mesh["ep"])
    return model


def share_of_batch(mesh: Mesh, idx: torch.Tensor, targets: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Callable]:
    """This rank's tokens of a batch ``(B, T)``: the sequences split over ``dp`` then ``ep``,
    each sequence's positions over ``cp`` (zig-zag), and the attention that goes with them
    (ring attention over ``cp``). Returns the tokens, their targets, their positions (None:
    all) and the attention. Introduced in notebooks/16_planning_a_run.ipynb."""
    groups = size(mesh, "dp") * size(mesh, "ep")
    if idx.shape[0] % groups:
        raise ValueError(f"{idx.shape[0]} sequences do not split over dp x ep = {groups}")
    part = mesh.coords.get("dp", 0) * size(mesh, "ep") + mesh.coords.get("ep", 0)
    rows = slice(part * idx.shape[0] // groups, (part + 1) * idx.shape[0] // groups)
    idx, targets = idx[rows].clone(), targets[rows].clone()  # its own rows, as a loader gives
    if size(mesh, "cp") == 1:
        return idx, targets, None, causal_attention
    positions = zigzag_positions(idx.shape[1], size(mesh, "cp"))
    mine = positions[mesh.coords["cp"]]
    attention = functools.partial(ring_attention, comm=mesh["cp"], positions=positions)
    return idx[:, mine], targets[:, mine], mine, attention


def reduce_gradients(model: nn.Module, mesh: Mesh) -> None:
    """Sum every gradient over the ranks that hold the same parameter and other tokens: ``dp``,
    ``ep`` and ``cp`` (an expert's over ``dp`` and ``cp`` only: the other ``ep`` ranks hold
    other experts). Tensor parallelism's ranks hold other parts of the parameters, or whole
    copies whose gradients already agree. Introduced in notebooks/16_planning_a_run.ipynb."""
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE)
               for p in m.experts.parameters()}
    for p in model.parameters():
        if p.grad is None:
            continue
        for dim in DATA_DIMS:
            if size(mesh, dim) > 1 and not (dim == "ep" and id(p) in experts):
                allreduce(p.grad, mesh[dim], check=False)
