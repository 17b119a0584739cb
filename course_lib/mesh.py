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
on it unchanged. Along ``pp`` each rank keeps its stage of the model (:func:`pipeline_stage`)
and a step is notebook 09's ``pipeline_step``; over ``dp`` the optimizer state can be sharded
(notebook 10's ``ShardedOptimizer``, ZeRO-1) or the whole state (``ZeroDataParallel``, ZeRO-3).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.collectives import allreduce
from course_lib.comm import DEFAULT_TIMEOUT, Comm, MpiComm, TorchComm, get_comm
from course_lib.comm.subgroups import group_of
from course_lib.context_parallel import ring_attention, zigzag_positions
from course_lib.moe import ExpertParallelMoE, parallelize_experts
from course_lib.sequence_parallel import ParallelBlock
from course_lib.sharding import shard_bounds
from course_lib.tensor_parallel import TensorParallel
from course_lib.transformer import GPT, causal_attention, recomputed
from course_lib.zero import ZeroDataParallel


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
            made = [group_of(g) for g in groups]  # every rank, every group, in order
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
    copies whose gradients already agree. A pipeline's first and last stages hold the tied
    token embedding each: its two gradients are summed first (Megatron's embedding group). A
    :class:`zero.ZeroDataParallel` model reduce-scatters over ``dp`` itself, during backward.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if isinstance(model, ZeroDataParallel):
        if size(mesh, "ep") > 1 or size(mesh, "cp") > 1:
            raise ValueError("ZeRO-3 shards over dp here: its gradients leave backward "
                             "reduce-scattered, with no sum over ep or cp")
        return
    if isinstance(model, PipelineStage) and model.num_stages > 1 and (model.first or model.last):
        comm, grad = mesh["pp"], model.ends.tok.weight.grad
        peer = comm.world_size - 1 if model.first else 0
        other = comm.sendrecv(grad, peer, torch.empty_like(grad), peer, tag=TAG_TIED)
        grad += other  # a + b == b + a: both copies get the same sum, and stay equal
    experts = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE)
               for p in m.experts.parameters()}
    for dim in DATA_DIMS:  # one bucket per dimension, as DDP's: one latency, not one a tensor
        grads = [p.grad for p in model.parameters() if p.grad is not None
                 and not (dim == "ep" and id(p) in experts)]
        if size(mesh, dim) == 1 or not grads:
            continue
        bucket = allreduce(torch.cat([g.reshape(-1) for g in grads]), mesh[dim], check=False)
        for g, summed in zip(grads, bucket.split([g.numel() for g in grads]), strict=True):
            g.copy_(summed.view_as(g))


# ---------------------------------------------------------------- pipeline stages
TAG_TIED = 94  # the tied embedding's gradient between the first and the last stage


class Ends(nn.Module):
    """The transformer's two ends in one module: the token and position embeddings
    (``head=False``), and the final LayerNorm with the output head, the token embedding read
    backwards (``head=True``). A pipeline's first stage holds the embeddings, its last the head
    with its own copy of the token embedding; a stage holding both calls this one module
    twice, so that ZeRO-3 gathers the tied weight as one unit's (FSDP's rule: a shared
    parameter in one unit). Introduced in notebooks/16_planning_a_run.ipynb."""

    def __init__(self, model: GPT, embeddings: bool, head: bool) -> None:
        super().__init__()
        self.context, self.tok = model.cfg.context, model.tok
        self.pos = model.pos if embeddings else None
        self.ln_f = model.ln_f if head else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                head: bool = False) -> torch.Tensor:
        if head:
            return self.ln_f(x) @ self.tok.weight.T  # as GPT.forward: the tied head
        if positions is None:
            positions = torch.arange(x.shape[-1], device=x.device)
        if int(positions.max()) >= self.context:
            raise ValueError(f"position {int(positions.max())} is beyond the model's context "
                             f"{self.context}")
        return self.tok(x) + self.pos(positions)


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of a :class:`transformer.GPT`: its share of the blocks
    (:func:`sharding.shard_bounds`, the first stages one more when they do not divide), the
    embeddings on the first stage, the final LayerNorm and the tied head on the last
    (:class:`Ends`). ``forward(x)`` takes tokens (first stage) or the previous stage's
    activations and returns activations, or the logits (last stage): what
    :func:`pipeline.pipeline_step` runs. Its children, the ends and each block, are also the
    units ZeRO-3 gathers one at a time (a GPT's are not: its blocks sit in a list that nothing
    calls, and its head reads the embedding outside the embedding's module).
    Introduced in notebooks/16_planning_a_run.ipynb."""

    def __init__(self, model: GPT, stage: int = 0, num_stages: int = 1) -> None:
        super().__init__()
        self.cfg, self.stage, self.num_stages = model.cfg, stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        start, stop = shard_bounds(model.cfg.n_layers, stage, num_stages)
        if start == stop:
            raise ValueError(f"{model.cfg.n_layers} blocks do not make {num_stages} stages")
        if self.first or self.last:
            self.ends = Ends(model, embeddings=self.first, head=self.last)
        self.layers = list(range(start, stop))  # its blocks' places in the whole model
        for i in self.layers:
            self.add_module(f"block{i}", model.blocks[i])

    @property
    def blocks(self) -> list[nn.Module]:
        """This stage's blocks, in order (as a GPT's ``blocks``)."""
        return [getattr(self, f"block{i}") for i in self.layers]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                attention: Callable = causal_attention) -> torch.Tensor:
        if self.first:
            x = self.ends(x, positions)
        if self.cfg.recompute == "attention":  # as GPT.forward
            attention = recomputed(attention)
        for block in self.blocks:
            if self.cfg.recompute == "full":
                x = checkpoint(block, x, attention, use_reentrant=False)
            else:
                x = block(x, attention)
        return self.ends(x, head=True) if self.last else x

    def global_name(self, name: str) -> str:
        """The name a parameter of this stage has in the whole model (``block1.ln1.weight``:
        ``blocks.1.ln1.weight``; ``ends.tok.weight``: ``tok.weight``)."""
        first, rest = name.split(".", 1)
        return rest if first == "ends" else f"blocks.{first[len('block'):]}.{rest}"


def pipeline_stage(model: GPT, mesh: Mesh) -> PipelineStage:
    """This rank's stage of ``model`` (split by :func:`parallelize` first: its blocks are then
    tensor-parallel over ``tp``) along ``pp``; with no ``pp``, the one stage that holds it all.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if model.cfg.experts:
        raise ValueError("pipeline stages of expert blocks are not written here")
    if size(mesh, "pp") > 1 and (size(mesh, "cp") > 1 or size(mesh, "ep") > 1):
        raise ValueError("a pipeline stage runs plain attention on whole sequences here: "
                         "no cp or ep with pp")
    return PipelineStage(model, mesh.coords.get("pp", 0), size(mesh, "pp"))


def pipeline_loss(share: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last stage's ``loss_fn`` for :func:`pipeline.pipeline_step`: the cross-entropy's
    mean over a micro-batch's tokens (pipeline_step weighs the micro-batches into the mean over
    this rank's batch), times ``share``, this rank's tokens over the global batch's. The step
    then backpropagates this rank's sum over its tokens divided by the global count, as on
    every other mesh, and :func:`reduce_gradients` sums over dp to the global batch's gradient
    (exactly, when the counts are powers of two).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                reduction="sum")
        return total / targets.numel() * share
    return loss_fn
