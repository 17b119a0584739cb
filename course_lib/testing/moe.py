"""Mixture of experts on a cluster's ranks: what tests, the demo, ``bench moe`` and notebook 15
run on every rank (real Gloo messages), each against one process or timed."""

from __future__ import annotations

import time

import numpy as np
import torch

from course_lib import collectives
from course_lib import moe as M
from course_lib.comm import get_comm
from course_lib.runtime import netem
from course_lib.tensor_parallel import TensorParallel


def reference_layer(world_size: int, experts: int = 4, top_k: int = 1,
                    capacity_factor: float | None = None, tokens: int = 16, d_model: int = 8,
                    hidden: int = 16, seed: int = 0, skew: float = 0.0,
                    dtype: torch.dtype = torch.float64) -> tuple:
    """A seeded MoE layer (the router pushed towards expert 0 by ``skew``), the whole batch of
    ``world_size * tokens`` tokens and an output gradient: the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    layer = M.MoE(d_model, experts, top_k, capacity_factor, hidden=hidden).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.5 * torch.randn(p.shape, dtype=dtype, generator=gen))
    x = torch.randn(world_size * tokens, d_model, dtype=dtype, generator=gen)
    x[:, 0] = 1.0  # a feature every token has: what the skewed router keys on
    with torch.no_grad():
        layer.router.weight[0, 0] += skew
    dy = torch.randn(world_size * tokens, d_model, dtype=dtype, generator=gen)
    return layer, x, dy


def expert_parallel_error_on_rank(experts: int = 4, top_k: int = 2,
                                  capacity_factor: float | None = 1.0, tokens: int = 16,
                                  seed: int = 0, timeout: float = 20.0) -> dict:
    """Expert parallelism over this cluster's ranks against the same layer in one process
    (float64): this rank's largest error (output, input and router gradients, its experts'
    gradients, the balance loss), whether it dropped the same tokens, and how many."""
    comm = get_comm("torch", timeout=timeout)
    N, r = comm.world_size, comm.rank
    layer, x, dy = reference_layer(N, experts, top_k, capacity_factor, tokens, seed=seed)
    x.requires_grad_()
    layer.groups = N
    y = layer(x)
    ((y * dy).sum() + layer.aux_sum).backward()
    ep = M.ExpertParallelMoE(layer, comm)
    t = slice(r * tokens, (r + 1) * tokens)
    mine = x.detach()[t].clone().requires_grad_()
    out = ep(mine)
    ((out * dy[t]).sum() + ep.aux_sum).backward()
    with torch.no_grad():
        router = collectives.allreduce(ep.router.weight.grad.clone(), comm, check=False)
        aux = collectives.allreduce(ep.aux_sum.detach().reshape(1).clone(), comm, check=False)
        errors = [(out - y[t]).abs().max(), (mine.grad - x.grad[t]).abs().max(),
                  (router - layer.router.weight.grad).abs().max(),
                  (aux - layer.aux_sum).abs().max()]
        for e, mlp in enumerate(ep.experts):
            for a, b in zip(mlp.parameters(), layer.experts[ep.first + e].parameters(),
                            strict=True):
                errors.append((a.grad - b.grad).abs().max())
    return dict(error=float(torch.stack(errors).max()),
                same_dropped=bool(torch.equal(ep.routing.kept, layer.routing.kept[t])),
                dropped=ep.routing.dropped)


def moe_step_on_rank(method: str = "ep", skew: float = 0.0, capacity_factor: float | None = None,
                     experts: int = 4, tokens: int = 1024, d_model: int = 64, hidden: int = 4096,
                     repeats: int = 3, timeout: float = 60.0) -> dict:
    """One forward and backward of the MoE layer on this rank, float32, on the process's
    emulated link if any, median of ``repeats`` started together: "ep" (experts split, this
    rank's ``tokens``) or "tp" (every expert's hidden units split, every rank all
    ``N * tokens``). Returns the seconds, this rank's CPU seconds in its experts (``busy_s``,
    EP: where a hot expert makes a straggler), the rows its experts computed (EP), the choices
    it dropped, and the bytes it sent in the step."""
    comm = get_comm("torch", timeout=timeout)
    N, r = comm.world_size, comm.rank
    layer, x, dy = reference_layer(N, experts, 1, capacity_factor, tokens, d_model, hidden,
                                   skew=skew, dtype=torch.float32)
    if method == "ep":
        part = M.ExpertParallelMoE(layer, comm)
        x, dy = x[r * tokens:(r + 1) * tokens], dy[r * tokens:(r + 1) * tokens]
    else:
        part = M.TensorParallelMoE(layer, TensorParallel(comm))
    busy = {"s": 0.0}

    def timed(module):  # the experts' own CPU time, forward and backward
        def pre(*_):
            busy["start"] = time.thread_time()

        def post(*_):
            busy["s"] += time.thread_time() - busy["start"]
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        module.register_full_backward_pre_hook(pre)
        module.register_full_backward_hook(post)

    if method == "ep":
        for mlp in part.experts:
            timed(mlp)
    times, busy_s = [], []
    for _ in range(repeats + 1):  # the first one warms up
        busy["s"] = 0.0
        mine = x.clone().requires_grad_()
        start = netem.start_clock(comm)
        sent = comm.bytes_sent
        (part(mine) * dy).sum().backward()
        times.append(time.monotonic() - start)
        busy_s.append(busy["s"])
        sent = comm.bytes_sent - sent
    out = dict(seconds=float(np.median(times[1:])), busy_s=float(np.median(busy_s[1:])),
               dropped=part.routing.dropped, sent=sent)
    if method == "ep":
        out["rows"] = sum(part.received)
    return out


def all_to_all_time_on_rank(algorithm: str, n_bytes: int, repeats: int = 3,
                            timeout: float = 60.0) -> float:
    """Seconds of one all-to-all of ``n_bytes`` per rank in N equal blocks (float32), median of
    ``repeats`` started together, on the process's emulated link if any: "pairwise" and "naive"
    from :mod:`course_lib.collectives`, "native" Gloo's ``all_to_all_single`` (not on the
    emulated link: it runs inside Gloo)."""
    comm = get_comm("torch", timeout=timeout)
    n = comm.world_size
    rows = max(n, n_bytes // 4 // n * n)
    send, recv = torch.randn(rows), torch.empty(rows)
    times = []
    for _ in range(repeats + 1):
        start = netem.start_clock(comm)
        if algorithm == "native":
            comm.dist.all_to_all_single(recv, send, group=comm.group)
        else:
            collectives.ALL_TO_ALL[algorithm](send, recv, comm)
        times.append(time.monotonic() - start)
    return float(np.median(times[1:]))
