"""A transformer trained on a device mesh against one process: what tests, the demo and
notebook 16 run on every rank (real Gloo messages, float64)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from course_lib import mesh as M
from course_lib import planner
from course_lib import transformer as tf
from course_lib.collectives import allreduce
from course_lib.moe import ExpertParallelMoE
from course_lib.sequence_parallel import SHARD_NAMES, ParallelBlock, shard_of

UNSHARDED = {attribute: name for name, attribute in SHARD_NAMES.items()}  # qkv_weight -> ...


def mesh_training_on_rank(shape: dict[str, int], steps: int = 3, experts: int = 0,
                          batch: int = 8, length: int = 16, seed: int = 0,
                          timeout: float = 30.0, recompute: str | None = None) -> dict:
    """The transformer (float64, small) trained ``steps`` AdamW steps on a mesh of ``shape``
    (:func:`mesh.parallelize`, :func:`mesh.share_of_batch`, :func:`mesh.reduce_gradients`)
    and the same model in one process on the same global batches. Returns the mesh's loss per
    step (all tokens), the largest difference of the losses and of this rank's parameters
    (its part of each) from one process's, its coordinates, and the bytes it held in the
    first step by kind (``memory``: parameters, gradients, optimizer, activations)."""
    mesh = M.make_mesh(shape, timeout=timeout)
    cfg = tf.GPTConfig(context=length, d_model=16, n_heads=4, experts=experts,
                       top_k=2 if experts else 1, aux_weight=0.0)
    one = tf.GPT(cfg, seed=seed).double()  # recomputation changes no number: only the memory
    model = M.parallelize(tf.GPT(replace(cfg, recompute=recompute), seed=seed).double(), mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (one, model)]
    data = tf.encode(tf.load_text()[:20_000])
    rng, losses, errors = np.random.default_rng(seed), [], []
    tokens, memory = batch * length, {}
    for _ in range(steps):
        x, y = tf.get_batch(data, batch, length, rng)
        _, whole = one(x, y)
        xi, yi, positions, attention = M.share_of_batch(mesh, x, y)
        before = {dim: mesh[dim].bytes_sent for dim in mesh.shape}
        kept, part = forward_kept(model, xi, yi, positions, attention)
        for loss, opt in ((whole, opts[0]), (part, opts[1])):
            opt.zero_grad()
            (loss / tokens).backward()
        M.reduce_gradients(model, mesh)
        if not memory:  # the bytes this rank sent in the first step, along each dimension
            sent = {dim: mesh[dim].bytes_sent - before[dim] for dim in mesh.shape
                    if mesh.shape[dim] > 1}
        if not memory:  # Adam would hide a gradient scaled wrong: compare the first ones
            grad_error = max(float((p - want).abs().max())
                             for p, want in matching_parameters(model, one, grads=True))
        for opt in opts:
            opt.step()
        if not memory:  # what this rank holds, by kind, in the first step
            memory = dict(parameters=sum(bytes_of(p) for p in model.parameters()),
                          gradients=sum(bytes_of(p.grad) for p in model.parameters()),
                          optimizer=sum(bytes_of(t) for state in opts[1].state.values()
                                        for t in state.values() if torch.is_tensor(t)),
                          activations=kept)
        total = part.detach().reshape(1).clone()
        for dim in M.DATA_DIMS:
            if M.size(mesh, dim) > 1:
                allreduce(total, mesh[dim], check=False)
        losses.append(float(total) / tokens)
        errors.append(abs(float(total) - float(whole)) / tokens)
    return dict(losses=losses, coords=mesh.coords, loss_error=max(errors), memory=memory,
                grad_error=grad_error, sent=sent,
                param_error=max(float((p - want).abs().max())
                                for p, want in matching_parameters(model, one)))


def forward_kept(model: tf.GPT, idx: torch.Tensor, targets: torch.Tensor, positions, attention
                 ) -> tuple[int, torch.Tensor]:
    """The bytes one forward keeps for backward, and its loss (summed over the tokens)."""
    out: list = []
    kept = tf.activation_bytes_of(
        lambda: out.append(model(idx, targets, positions=positions, attention=attention)), model)
    return kept, out[0][1]


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


def matching_parameters(model: tf.GPT, one: tf.GPT, grads: bool = False) -> list[tuple]:
    """Each parameter of the split ``model`` beside the part of ``one``'s it must equal: a
    tensor-parallel block's shards, a rank's own experts, the rest whole (``grads``: their
    gradients instead)."""
    def value(t):
        return t.grad if grads else t.detach()

    ref = {name: value(p) for name, p in one.named_parameters()}
    pairs = []
    for i, block in enumerate(model.blocks):
        prefix = f"blocks.{i}."
        for name, p in block.named_parameters():
            if isinstance(block, ParallelBlock):
                full = UNSHARDED[name]
                pairs.append((value(p), shard_of(block, full, ref[prefix + full])))
            elif isinstance(block.mlp, ExpertParallelMoE) and name.startswith("mlp.experts."):
                e, rest = name[len("mlp.experts."):].split(".", 1)
                global_name = f"{prefix}mlp.experts.{block.mlp.first + int(e)}.{rest}"
                pairs.append((value(p), ref[global_name]))
            else:
                pairs.append((value(p), ref[prefix + name]))
    for name, p in model.named_parameters():
        if not name.startswith("blocks."):
            pairs.append((value(p), ref[name]))
    return pairs


def plan_differences(rows: list[dict], shape: dict[str, int], experts: int = 0,
                     batch: int = 8, length: int = 16, recompute: str | None = None
                     ) -> list[str]:
    """Where the planner's bytes per rank (:func:`planner.memory_per_rank`) differ from what
    the ranks of :func:`mesh_training_on_rank` held, kind by kind, and its bytes sent per
    dimension (:func:`planner.bytes_per_step`) from what they sent (activations and bytes
    sent: dense blocks only); [] when every count is exact."""
    cfg = tf.GPTConfig(context=length, d_model=16, n_heads=4, experts=experts,
                       top_k=2 if experts else 1, recompute=recompute)
    layout = planner.Layout.from_shape(shape)
    if experts:
        n = planner.parameters_per_rank(cfg, layout)
        predicted = dict(parameters=8 * n, gradients=8 * n,
                         optimizer=16 * n + 4 * planner.tensors_per_rank(cfg, layout))
    else:
        predicted = planner.memory_per_rank(cfg, layout, batch, length)
    wrong = [f"rank {r}: {kind} held {row['memory'][kind]}, planned {predicted[kind]}"
             for r, row in enumerate(rows) for kind in row["memory"]
             if kind in predicted and row["memory"][kind] != predicted[kind]]
    if not experts:  # the bytes sent along each dimension (experts': as the router decides)
        for r, row in enumerate(rows):
            plan = planner.bytes_per_step(cfg, layout, batch, length, row["coords"])
            if row["sent"] != plan:
                wrong.append(f"rank {r}: sent {row['sent']}, planned {plan}")
    return wrong
