"""What the ranks run to compare the course's compressed data-parallel SGD with torch DDP's hooks.

Introduced in notebooks/08_local_sgd_and_compression.ipynb. ``fp16_against_torch_hook_on_rank``
averages one batch's gradient with :class:`course_lib.compression.FP16` and with torch DDP's
``fp16_compress_hook``; ``torch_ddp_on_rank`` trains the MLP of :mod:`course_lib.local_sgd` under
torch's DistributedDataParallel with the fp16 or PowerSGD communication hook, on the same batches,
and records it in the same form, so that it joins the course's runs in one figure and one table::

    from course_lib.testing import local_sgd as testing
    res = cluster.run(testing.fp16_against_torch_hook_on_rank)[0]  # {"ours", "torch", "float32"}
    run = testing.run_torch_ddp(cluster, "powersgd", rank=1)       # rank 0's record
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from course_lib import compression, models
from course_lib.local_sgd import Replica, powersgd_elements, rank0_result, record_point, run_result

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster

HOOKS = ("none", "fp16", "powersgd")


def torch_ddp_on_rank(hook: str = "fp16", rank: int = 1, start_iter: int = 2, steps: int = 200,
                      batch_size: int = 32, lr: float = 0.2, hidden: Sequence[int] = (64,),
                      eval_every: int = 20, seed: int = 0,
                      dtype: str = "float32") -> dict[str, Any]:
    """On every rank: torch's DistributedDataParallel with a communication hook: "none" (its
    own allreduce), "fp16" (``fp16_compress_hook``) or "powersgd" (``powerSGD_hook`` of
    ``rank``, after ``start_iter`` plain steps). Bytes come from the shapes, priced as a ring."""
    if hook not in HOOKS:
        raise ValueError(f"hook must be 'none', 'fp16' or 'powersgd', not {hook!r}")
    world_size = dist.get_world_size()
    rep = Replica(dist.get_rank(), world_size, batch_size, hidden, seed, dtype)
    net = torch.nn.parallel.DistributedDataParallel(rep.model)
    shapes = [tuple(p.shape) for p in rep.model.parameters()]
    n_params, itemsize = sum(int(np.prod(s)) for s in shapes), rep.theta.element_size()
    state = None
    plain = compression.ring_allreduce_bytes(n_params * itemsize, world_size)
    if hook == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        per_step = compression.ring_allreduce_bytes(n_params * 2, world_size)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start_iter, random_seed=seed)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        per_step = compression.ring_allreduce_bytes(
            powersgd_elements(shapes, rank) * itemsize, world_size)
    else:
        per_step = plain
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    history = {"step": [], "bytes": [], "loss": [], "accuracy": []}
    record_point(history, 0, 0.0, *rep.evaluate())
    sent = 0.0
    for step in range(1, steps + 1):
        idx = rep.next_batch()
        opt.zero_grad()
        F.cross_entropy(net(rep.X[idx]), rep.y[idx]).backward()
        opt.step()
        sent += plain if (hook == "powersgd" and step <= start_iter) else per_step
        if step % eval_every == 0 or step == steps:
            record_point(history, step, sent, *rep.evaluate())
    name = {"none": "torch DDP", "fp16": "torch DDP + fp16_compress_hook",
            "powersgd": f"torch DDP + PowerSGD rank {rank}"}[hook]
    extra = {}
    if state is not None:  # the hook's own count of elements after compression
        extra["hook_elements_per_step"] = (state.total_numel_after_compression
                                           / max(steps - start_iter, 1))
    theta = torch.nn.utils.parameters_to_vector(rep.model.parameters()).detach()
    return run_result(name, history, rep, theta, sent, steps, **extra)


def run_torch_ddp(cluster: Cluster, hook: str = "fp16", rank: int = 1, timeout: float = 120,
                  **kwargs: Any) -> dict[str, Any]:
    """:func:`torch_ddp_on_rank` on every rank of ``cluster``; rank 0's record."""
    return rank0_result(cluster.run(torch_ddp_on_rank, hook, rank, **kwargs, timeout=timeout))


def fp16_against_torch_hook_on_rank(batch_size: int = 32, hidden: Sequence[int] = (64,),
                                    seed: int = 0) -> dict[str, np.ndarray]:
    """On every rank: one batch's gradient averaged three ways, as numpy arrays: ``ours``
    (:class:`compression.FP16`), ``torch`` (DDP + ``fp16_compress_hook``), ``float32``."""
    rep = Replica(dist.get_rank(), dist.get_world_size(), batch_size, hidden, seed, "float32")
    idx = rep.next_batch()
    _, g = rep.grad(rep.theta.clone(), idx)
    net = torch.nn.parallel.DistributedDataParallel(models.mlp(64, hidden, 10, seed=seed))
    net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    F.cross_entropy(net(rep.X[idx]), rep.y[idx]).backward()
    theirs = torch.cat([p.grad.reshape(-1) for p in net.module.parameters()])
    return {"ours": compression.FP16().allreduce(g).numpy(), "torch": theirs.numpy(),
            "float32": compression.NoCompression().allreduce(g).numpy()}
