"""A transformer trained on a device mesh against one process: what tests, the demo and
notebook 16 run on every rank (real Gloo messages, float64)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from course_lib import mesh as M
from course_lib import planner
from course_lib import transformer as tf
from course_lib.collectives import allreduce
from course_lib.moe import ExpertParallelMoE, MoEConfig
from course_lib.pipeline import pipeline_step, schedule_order
from course_lib.sequence_parallel import SHARD_NAMES, ParallelBlock, shard_of
from course_lib.zero import ZeroDataParallel
from course_lib.zero_optimizer import ShardedOptimizer

UNSHARDED = {attribute: name for name, attribute in SHARD_NAMES.items()}  # qkv_weight -> ...


def model_config(length: int, experts: int, recompute: str | None = None) -> tf.GPTConfig:
    """The meshes' small transformer: dense, or ``experts`` experts, top-2, no balance loss."""
    if experts:
        return MoEConfig(context=length, d_model=16, n_heads=4, recompute=recompute,
                         experts=experts, top_k=2, aux_weight=0.0)
    return tf.GPTConfig(context=length, d_model=16, n_heads=4, recompute=recompute)


def mesh_training_on_rank(shape: dict[str, int], steps: int = 3, experts: int = 0,
                          batch: int = 8, length: int = 16, seed: int = 0,
                          timeout: float = 30.0, recompute: str | None = None, zero: int = 0,
                          microbatches: int = 4) -> dict:
    """The transformer (float64, small) trained ``steps`` AdamW steps on a mesh of ``shape``
    (:func:`mesh.parallelize`, :func:`mesh.share_of_batch`, :func:`mesh.reduce_gradients`)
    and the same model in one process on the same global batches. With ``pp`` in the shape,
    each rank keeps its stage (:func:`mesh.pipeline_stage`) and a step is
    :func:`pipeline.pipeline_step`'s 1F1B over ``microbatches``. ``zero=1``: the optimizer
    state sharded over dp (:class:`zero_optimizer.ShardedOptimizer`, after the gradients'
    sum); ``zero=3``: the model in :class:`zero.ZeroDataParallel` over dp, its units the
    stage's ends and blocks. Returns the mesh's loss per step (all tokens), the largest
    difference of the losses, of this rank's parameters (its part of each) after the last
    step and of its first gradients from one process's, its coordinates, the bytes it held in
    the first step by kind (``memory``: parameters, gradients, optimizer, activations) and
    the bytes it sent in the first step along each dimension (``sent``)."""
    mesh = M.make_mesh(shape, timeout=timeout)
    cfg = model_config(length, experts)
    pp, dp = M.size(mesh, "pp"), M.size(mesh, "dp")
    if zero not in (0, 1, 3) or zero == 3 and pp > 1:
        raise ValueError(f"zero={zero}: 0, 1 or 3 (ZeRO-3 without pp)")
    if pp > 1 and not 1 <= microbatches <= batch // dp:  # on every rank: none waits for it
        raise ValueError(f"{microbatches} micro-batches of {batch // dp} sequences per rank")
    one = tf.GPT(cfg, seed=seed).double()  # recomputation changes no number: only the memory
    model = M.parallelize(tf.GPT(replace(cfg, recompute=recompute), seed=seed).double(), mesh)
    if pp > 1 or zero == 3:  # ZeRO-3 gathers the stage's children one at a time
        model = M.pipeline_stage(model, mesh)
    if zero == 3:
        model = ZeroDataParallel(model, lambda shards: torch.optim.AdamW(shards, lr=1e-2),
                                 mesh["dp"], stage=3)
        opt = model.optimizer
    elif zero == 1:
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, mesh["dp"], lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_one = torch.optim.AdamW(one.parameters(), lr=1e-2)
    # ZeroDataParallel averages the gradients over dp where reduce_gradients sums them: its
    # ranks backpropagate their tokens' sum over the global count times dp
    tokens = batch * length
    scale = tokens / dp if zero == 3 else tokens
    data = tf.encode(tf.load_text()[:20_000])
    rng, losses, errors = np.random.default_rng(seed), [], []
    memory = {}
    for _ in range(steps):
        x, y = tf.get_batch(data, batch, length, rng)
        opt_one.zero_grad()
        _, whole = one(x, y)
        (whole / tokens).backward()
        xi, yi, positions, attention = M.share_of_batch(mesh, x, y)
        before = {dim: mesh[dim].bytes_sent for dim in mesh.shape}
        opt.zero_grad()
        if pp > 1:
            kept, part = pipeline_kept(model, mesh, xi, yi, tokens, microbatches)
        else:
            kept, part = forward_kept(model, xi, yi, positions, attention)
            (part / scale).backward()
        M.reduce_gradients(model, mesh)
        if not memory:  # Adam would hide a gradient scaled wrong: compare the first ones
            grad_error = max(float((g - want).abs().max())
                             for g, want in gradient_pairs(model, one))
            memory = held_bytes(model)
        opt_one.step()
        (model if zero == 3 else opt).step()  # ZeroDataParallel steps its optimizer itself
        if "optimizer" not in memory:  # the state exists from the first update on
            memory.update(optimizer=optimizer_bytes(opt), activations=kept)
            # the bytes this rank sent in the first step, along each dimension
            sent = {dim: mesh[dim].bytes_sent - before[dim] for dim in mesh.shape
                    if mesh.shape[dim] > 1}
        total = part.detach().reshape(1).clone()
        for dim in ("pp", *M.DATA_DIMS):  # the last stage's loss to every stage, then the sum
            if M.size(mesh, dim) > 1:
                allreduce(total, mesh[dim], check=False)
        losses.append(float(total) / tokens)
        errors.append(abs(float(total) - float(whole)) / tokens)
    if zero == 3:  # the whole parameters, gathered over dp, beside the stage's names
        pairs = zip(model.full_parameters(),
                    (want for _, want in matching_parameters(model.module, one)), strict=True)
    else:
        pairs = matching_parameters(model, one)
    return dict(losses=losses, coords=mesh.coords, loss_error=max(errors), memory=memory,
                grad_error=grad_error, sent=sent,
                param_error=max(float((p - want).abs().max()) for p, want in pairs))


def pipeline_kept(stage: M.PipelineStage, mesh: M.Mesh, idx: torch.Tensor,
                  targets: torch.Tensor, tokens: int, num_microbatches: int
                  ) -> tuple[int, torch.Tensor]:
    """One 1F1B step of this rank's stage over ``pp`` (forward and backward): the most bytes
    its micro-batches kept for backward at once (each counted as :func:`forward_kept` counts a
    forward, the schedule replayed), and its loss summed over the tokens (0 but on the last
    stage)."""
    kept: list[dict[int, int]] = []  # per micro-batch: storage -> bytes

    class Counted(torch.nn.Module):  # the stage, each forward's saved tensors counted
        def __init__(self) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            kept.append({})
            with saved_storages(stage, kept[-1]):
                return self.stage(x)

    loss_fn = M.pipeline_loss(targets.numel() / tokens)

    def counted_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with saved_storages(stage, kept[-1]):  # the last stage: its micro-batch's loss
            return loss_fn(logits, y)
    result = pipeline_step(Counted(), mesh["pp"], num_microbatches,
                           idx if stage.first else None, targets if stage.last else None,
                           counted_loss if stage.last else None)
    live: dict[int, dict[int, int]] = {}
    peak = 0
    for op, m in schedule_order("1f1b", stage.stage, stage.num_stages, num_microbatches):
        if op == "F":
            live[m] = kept[m]
        else:
            del live[m]
        union = {ptr: n for one in live.values() for ptr, n in one.items()}  # a storage once
        peak = max(peak, sum(union.values()))
    return peak, torch.tensor(result.loss * tokens if stage.last else 0.0, dtype=torch.float64)


@contextmanager
def saved_storages(module: torch.nn.Module, kept: dict[int, int]) -> Iterator[None]:
    """Record in ``kept`` (storage -> bytes) what autograd saves for backward inside the
    block, each storage once, ``module``'s parameters left out: those of the moment, as ZeRO-3
    allocates them again at every gather (``transformer.activation_bytes_of`` takes them once,
    before)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if all(ptr != p.untyped_storage().data_ptr() for p in module.parameters()):
            kept[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def forward_kept(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, positions,
                 attention) -> tuple[int, torch.Tensor]:
    """The bytes one forward keeps for backward, and its loss (summed over the tokens):
    ``model`` a GPT, or a :class:`mesh.PipelineStage` holding it all (in ZeroDataParallel)."""
    kept: dict[int, int] = {}
    with saved_storages(model, kept):
        if isinstance(model, tf.GPT):
            _, loss = model(idx, targets, positions=positions, attention=attention)
        else:
            logits = model(idx, positions=positions, attention=attention)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   reduction="sum")  # as GPT.forward
    return sum(kept.values()), loss


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """The bytes of the parameters and gradients this rank holds: ZeRO-3's shards (its full
    parameters are freed outside a unit's forward and backward)."""
    if isinstance(model, ZeroDataParallel):
        shards = [unit.shard for unit in model.units]
        freed = sum(p.untyped_storage().nbytes() for p in model.module.parameters())
        return dict(parameters=freed + sum(bytes_of(s) for s in shards),
                    gradients=sum(bytes_of(s.grad) for s in shards))
    return dict(parameters=sum(bytes_of(p) for p in model.parameters()),
                gradients=sum(bytes_of(p.grad) for p in model.parameters()))


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes of the optimizer's state on this rank (ZeRO-1: of the parameters it owns)."""
    state = opt.local.state if isinstance(opt, ShardedOptimizer) else opt.state
    return sum(bytes_of(t) for s in state.values() for t in s.values() if torch.is_tensor(t))


def gradient_pairs(model: torch.nn.Module, one: tf.GPT) -> list[tuple]:
    """This rank's gradients beside the one process's part of them: ZeRO-3's are its shard of
    each unit's flat vector."""
    if not isinstance(model, ZeroDataParallel):
        return matching_parameters(model, one, grads=True)
    want = dict(zip(map(id, model.module.parameters()),
                    (w for _, w in matching_parameters(model.module, one, grads=True)),
                    strict=True))
    return [(unit.shard.grad,
             torch.cat([want[id(p)].reshape(-1) for p in unit.params])[unit.start:unit.stop])
            for unit in model.units]


def bytes_of(t: torch.Tensor) -> int:
    """The bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def groups_beside_torch(shape: dict[str, int], timeout: float = 10.0) -> dict:
    """On every rank: each dimension's group from the course's mesh and from torch's
    ``init_device_mesh`` (world ranks), and a ring allreduce of the world ranks over each of
    this rank's groups."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = M.make_mesh(shape, timeout=timeout)
    torch_mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
    out = {}
    for name in shape:
        comm = mesh[name]
        total = allreduce(torch.tensor([float(mesh.rank)]), comm, check=False)
        out[name] = dict(ours=[comm.global_rank(i) for i in range(comm.world_size)],
                         torch=dist.get_process_group_ranks(torch_mesh.get_group(name)),
                         group=mesh.group(name), total=float(total))
    return out


def threads_after_meshes(shapes: list[dict[str, int]], timeout: float = 10.0) -> list[int]:
    """On every rank: this process's thread count (Gloo's loop threads included) after making
    each mesh of ``shapes`` in turn, with an allreduce over each group of each."""
    import os
    counts = []
    for shape in shapes:
        mesh = M.make_mesh(shape, timeout=timeout)
        for name in shape:
            allreduce(torch.ones(1), mesh[name], check=False)
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


def matching_parameters(model: tf.GPT | M.PipelineStage, one: tf.GPT,
                        grads: bool = False) -> list[tuple]:
    """Each parameter of the split ``model`` (a GPT or a pipeline stage), in its order, beside
    the part of ``one``'s it must equal: a tensor-parallel block's shards, a rank's own
    experts, the rest whole (``grads``: their gradients instead)."""
    def value(t):
        return t.grad if grads else t.detach()

    ref = {name: value(p) for name, p in one.named_parameters()}
    pairs = []
    for name, p in model.named_parameters():
        whole = model.global_name(name) if isinstance(model, M.PipelineStage) else name
        if not whole.startswith("blocks."):
            pairs.append((value(p), ref[whole]))
            continue
        i, rest = whole[len("blocks."):].split(".", 1)
        prefix = f"blocks.{i}."
        block = model.get_submodule(name[:-len(rest) - 1])  # the same suffix in both names
        if isinstance(block, ParallelBlock):
            full = UNSHARDED[rest]
            pairs.append((value(p), shard_of(block, full, ref[prefix + full])))
        elif isinstance(block.mlp, ExpertParallelMoE) and rest.startswith("mlp.experts."):
            e, tail = rest[len("mlp.experts."):].split(".", 1)
            pairs.append((value(p), ref[f"{prefix}mlp.experts.{block.mlp.first + int(e)}.{tail}"]))
        else:
            pairs.append((value(p), ref[whole]))
    return pairs


def plan_differences(rows: list[dict], shape: dict[str, int], experts: int = 0,
                     batch: int = 8, length: int = 16, recompute: str | None = None,
                     zero: int = 0, microbatches: int = 4) -> list[str]:
    """Where the planner's bytes per rank (:func:`planner.memory_per_rank`) differ from what
    the ranks of :func:`mesh_training_on_rank` held, kind by kind, and its bytes sent per
    dimension (:func:`planner.bytes_per_step`) from what they sent (activations and bytes
    sent: dense blocks only); [] when every count is exact."""
    cfg = model_config(length, experts, recompute=recompute)
    layout = planner.Layout.from_shape(shape, zero=zero,
                                       microbatches=microbatches if "pp" in shape else 1)
    wrong = []
    for r, row in enumerate(rows):
        if experts:
            n = planner.parameters_per_rank(cfg, layout)
            predicted = dict(parameters=8 * n, gradients=8 * n,
                             optimizer=16 * n + 4 * planner.tensors_per_rank(cfg, layout))
        else:
            predicted = planner.memory_per_rank(cfg, layout, batch, length, coords=row["coords"])
        wrong += [f"rank {r}: {kind} held {row['memory'][kind]}, planned {predicted[kind]}"
                  for kind in row["memory"]
                  if kind in predicted and row["memory"][kind] != predicted[kind]]
    if not experts:  # the bytes sent along each dimension (experts': as the router decides)
        for r, row in enumerate(rows):
            plan = planner.bytes_per_step(cfg, layout, batch, length, row["coords"])
            if row["sent"] != plan:
                wrong.append(f"rank {r}: sent {row['sent']}, planned {plan}")
    return wrong
