"""A dry run: one rank of a mesh of a thousand ranks, in one CPU process, in seconds.

Introduced in notebooks/16_planning_a_run.ipynb. A plan for 1,024 GPUs is checked before the
GPUs are booked, the way torchtitan dry-runs its configurations: torch's **fake process group**
(``backend="fake"``) makes this process rank ``r`` of a world of any size, where every
collective returns at once and moves nothing, and **fake tensors** (``FakeTensorMode``) carry
shapes and dtypes without data, so a real model's step costs no memory and no arithmetic.
Everything else is the production code: ``init_device_mesh`` lays out the mesh, torch's tensor
parallelism (``ColwiseParallel``/``RowwiseParallel``, Megatron's split) and FSDP2
(``fully_shard`` per block and at the root, ZeRO-3) split the course's transformer, and one
step runs forward and backward. :func:`dry_run` records every collective the rank issues (its
kind, mesh dimension and elements), the bytes it holds (its shards, their gradients, Adam's
state) and the activations kept for backward; :func:`planned_collectives` is what the planner
(:mod:`course_lib.planner`) expects, collective by collective. A layout the planner says cannot
fit is refused before anything is built (:func:`check_fits`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib import planner
from course_lib.planner import Layout
from course_lib.scale_plan import breaks
from course_lib.sequence_parallel import tp_shard
from course_lib.transformer import GPT, GPTConfig

# torch's collectives as the dispatcher names them (c10d's in-place ops, FSDP2's; functional
# collectives, DTensor's), under the names the course uses
KINDS = {"all_reduce": "allreduce", "allreduce_": "allreduce",
         "_allgather_base_": "all-gather", "all_gather_into_tensor": "all-gather",
         "_reduce_scatter_base_": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter"}


@dataclass(frozen=True)
class Collective:
    """One collective of a step: its ``kind`` (allreduce, all-gather, reduce-scatter), the mesh
    dimension whose group it runs on and the ``elements`` of the whole tensor (an allreduce's
    buffer, an all-gather's output, a reduce-scatter's input).
    Introduced in notebooks/16_planning_a_run.ipynb."""

    kind: str
    dim: str
    elements: int


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` on torch's fake process group, destroyed
    on exit. Introduced in notebooks/16_planning_a_run.ipynb."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised here: a dry run needs a "
                           "process of its own (run it in the notebook's kernel, not on an engine)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches its sharding decisions by mesh, and a new world's mesh of the same shape
    equals the old one: clear them, or the next run would talk on the destroyed groups."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


class Recorder(TorchDispatchMode):
    """Every torch collective dispatched while it is on, as :class:`Collective` s; ``dims``
    names the mesh dimension of each process group's name.
    Introduced in notebooks/16_planning_a_run.ipynb."""

    def __init__(self, dims: dict[str, str]) -> None:
        super().__init__()
        self.dims, self.calls = dims, []  # group name -> mesh dimension

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = KINDS.get(func.overloadpacket.__name__)
        if kind:
            if func.namespace == "c10d":  # (output, input, group, ...): FSDP2's
                big = args[0] if kind == "all-gather" else args[1]
                group = dist.ProcessGroup.unbox(args[2]).group_name
            else:  # functional: (input, op?, group name): DTensor's
                big, group = args[0], args[-1]
            self.calls.append(Collective(kind, self.dims[group], big.numel()))
        return func(*args, **(kwargs or {}))


def qkv_rows_by_rank(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """The rows of a block's [Q; K; V] projection reordered so that rank t's contiguous share
    (what ``ColwiseParallel`` gives it) holds its heads of Q, of K and of V, as the course's
    tensor parallelism splits them (notebook 14). Introduced in
    notebooks/16_planning_a_run.ipynb."""
    return torch.cat([tp_shard("attn.qkv.weight", weight, r, tp) for r in range(tp)])


def parallelize_with_torch(model: GPT, mesh) -> GPT:
    """``model`` split by torch: each block's attention and MLP by ``parallelize_module`` over
    ``tp`` (Q, K, V and the MLP's first layer column-parallel, the projections after them
    row-parallel), then ``fully_shard`` over ``dp`` for each block and for the whole model (its
    root: embeddings and final LayerNorm). Introduced in notebooks/16_planning_a_run.ipynb."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    names = mesh.mesh_dim_names
    for block in model.blocks:
        if "tp" in names and mesh["tp"].size() > 1:
            with torch.no_grad():
                for p in (block.attn.qkv.weight, block.attn.qkv.bias):
                    p.data = qkv_rows_by_rank(p.data, mesh["tp"].size())
            parallelize_module(block, mesh["tp"], {
                "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def check_fits(cfg: GPTConfig, layout: Layout, batch: int, length: int, memory: float,
               itemsize: int = 4) -> dict[str, float]:
    """The planner's bytes per rank (:func:`planner.memory_per_rank`) for ``layout``; a
    ValueError naming the largest kind when they exceed ``memory`` (bytes), before anything is
    built. Introduced in notebooks/16_planning_a_run.ipynb."""
    held = planner.memory_per_rank(cfg, layout, batch, length, itemsize=itemsize)
    if held["total"] > memory:
        raise ValueError(f"{describe(layout)} does not fit: {breaks(held, memory)} per rank")
    return held


def describe(layout: Layout) -> str:
    """'dp128 x tp8, ZeRO-3 (1,024 ranks)'. Introduced in notebooks/16_planning_a_run.ipynb."""
    dims = " x ".join(f"{d}{getattr(layout, d)}" for d in ("dp", "tp")
                      if getattr(layout, d) > 1) or "1 rank"
    zero = f", ZeRO-{layout.zero}" if layout.zero else ""
    return f"{dims}{zero} ({layout.world_size:,} ranks)"


def dry_run(cfg: GPTConfig, layout: Layout, batch: int, length: int, rank: int = 0,
            memory: float | None = None) -> dict:
    """One training step (forward, backward; Adam's state) of rank ``rank`` of ``layout``
    (dp x tp, ZeRO-3: FSDP2 over dp) on ``batch`` sequences of ``length`` tokens, on the fake
    process group with fake tensors. ``memory``: refused first if the plan says it does not fit
    (:func:`check_fits`). Returns the ``collectives`` it issued in order, the bytes it
    ``held`` by kind (parameters, gradients, optimizer: its shards; activations: what
    autograd kept for backward, gathered parameters left out), and the ``seconds`` it took.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    if layout.world_size != layout.dp * layout.tp or layout.zero != 3 or layout.dp < 2:
        raise ValueError(f"{describe(layout)}: the dry run splits dp x tp with ZeRO-3 (FSDP2) "
                         "over dp >= 2; pipelines, cp and ep are not built here")
    if cfg.recompute or cfg.experts:
        raise ValueError("the dry run builds dense blocks without recomputation")
    if batch % layout.dp or cfg.n_heads % layout.tp:
        raise ValueError(f"{batch} sequences over dp={layout.dp}, {cfg.n_heads} heads over "
                         f"tp={layout.tp}: each must divide")
    if memory is not None:
        check_fits(cfg, layout, batch, length, memory)
    start = time.perf_counter()
    with fake_world(rank, layout.world_size):
        mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = GPT(cfg)
        model = parallelize_with_torch(model, mesh)
        model.to_empty(device="cpu")  # this rank's shards only: real, small, never read
        dims = {mesh[d].get_group().group_name: d for d in ("dp", "tp")}
        recorder = Recorder(dims)
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            for harmless in ("FSDP2-wrapped module", "Full backward hook"):  # notes on hooks
                warnings.filterwarnings("ignore", message=harmless)
            idx, targets = (torch.randint(0, cfg.vocab_size, (batch // layout.dp, length))
                            for _ in range(2))
            with recorder:
                kept = _kept_bytes(lambda: model(idx, targets)[1])
                kept["loss"].backward()
        shards = [p.to_local() for p in model.parameters()]  # real tensors: this rank's own
        held = {"parameters": sum(_local_bytes(p) for p in shards),
                "gradients": sum(_local_bytes(p.grad) for p in model.parameters()),
                "optimizer": _adam_state_bytes(shards), "activations": kept["bytes"]}
    held["total"] = math.fsum(held.values())
    return dict(collectives=recorder.calls, held=held, seconds=time.perf_counter() - start,
                coords=dict(zip(("dp", "tp"), divmod(rank, layout.tp), strict=True)))


def _adam_state_bytes(shards: list[torch.Tensor]) -> int:
    """The bytes of the state Adam keeps for ``shards`` after a step (the update of FSDP2's
    sharded parameters runs on each rank's local shards; here on copies, gradients zero)."""
    copies = [nn.Parameter(torch.zeros_like(s)) for s in shards]
    for c in copies:
        c.grad = torch.zeros_like(c)
    optimizer = torch.optim.Adam(copies, lr=1e-3)
    optimizer.step()
    return sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values())


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _kept_bytes(forward) -> dict:
    """What autograd keeps while ``forward()`` runs (each storage once; the parameters FSDP2
    gathered, which it frees and gathers again for backward, left out)."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
            local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own part
            base = local if local._base is None else local._base  # views share its storage
            kept[id(base)] = local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    return {"loss": loss, "bytes": sum(kept.values())}


def planned_collectives(cfg: GPTConfig, layout: Layout, batch: int, length: int,
                        ends_gathered: int = 1) -> list[Collective]:
    """The collectives one step of ``layout`` issues by the planner's count: four allreduces
    per block of the rank's b x T x d activations over tp (two forward, two backward); over
    dp, each block's unit (:func:`planner.tensor_units`) all-gathered for its forward and again
    for its backward and its gradients reduce-scattered once; the ends (embeddings, final
    LayerNorm) ``ends_gathered`` times (FSDP2 keeps its root gathered from forward to the end
    of backward: 1; the course's ZeroDataParallel gathers them for the embedding and the head,
    forward and backward: 4) and reduce-scattered once. Introduced in
    notebooks/16_planning_a_run.ipynb."""
    b, out = batch // layout.dp, []
    ends, *blocks = planner.tensor_units(cfg, layout)
    if layout.tp > 1:
        out += 4 * cfg.n_layers * [Collective("allreduce", "tp", b * length * cfg.d_model)]
    if layout.zero == 3 and layout.dp > 1:
        out += (ends_gathered * [Collective("all-gather", "dp", sum(ends))]
                + [Collective("reduce-scatter", "dp", sum(ends))])
        for unit in blocks:
            out += (2 * [Collective("all-gather", "dp", sum(unit))]
                    + [Collective("reduce-scatter", "dp", sum(unit))])
    return out


def ring_bytes(collectives: list[Collective], layout: Layout, coords: dict[str, int],
               itemsize: int = 4) -> dict[str, int]:
    """The bytes the rank at ``coords`` sends for ``collectives`` when each runs as the
    course's ring (:func:`planner.ring_allreduce_elements`; an all-gather sends all but its
    right neighbour's chunk, a reduce-scatter the rest of an allreduce), by dimension.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    out: Counter = Counter()
    for c in collectives:
        n, r = getattr(layout, c.dim), coords.get(c.dim, 0)
        gather = planner.ring_allgather_elements(c.elements, n, r)
        whole = planner.ring_allreduce_elements(c.elements, n, r)
        out[c.dim] += itemsize * {"allreduce": whole, "all-gather": gather,
                                  "reduce-scatter": whole - gather}[c.kind]
    return dict(out)


def compare(recorded: list[Collective], planned: list[Collective]) -> dict:
    """Recorded against planned, as counts of each (kind, dim, elements): ``same`` when they
    agree, else what was recorded and not planned (``unplanned``) and planned and not seen
    (``missing``). Introduced in notebooks/16_planning_a_run.ipynb."""
    seen, want = Counter(recorded), Counter(planned)
    return dict(same=seen == want, unplanned=dict(seen - want), missing=dict(want - seen))


def gpt_config(model, context: int = 2048) -> GPTConfig:
    """The course's transformer with the sizes of ``scale_plan.MODELS``'s GPT ``model`` (its
    layers, width, heads and vocabulary; a tied head, GELU MLP of 4 d).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if model.gated or model.kv_heads or not model.tied or model.ffn != 4 * model.d_model:
        raise ValueError(f"{model.name}: the course's transformer has a tied head, full "
                         "attention heads and a GELU MLP of 4 d")
    return GPTConfig(vocab_size=model.vocab, context=context, d_model=model.d_model,
                     n_heads=model.heads, n_layers=model.layers)


__all__ = ["Collective", "Recorder", "check_fits", "compare", "describe", "dry_run", "fake_world",
           "gpt_config", "parallelize_with_torch", "planned_collectives", "qkv_rows_by_rank",
           "ring_bytes"]
