"""Mixture of experts: a router sends each token to k of E expert MLPs, and expert parallelism
puts the experts on different ranks, moving the tokens to them with two all-to-alls.

Introduced in notebooks/15_mixture_of_experts.ipynb. A mixture-of-experts layer (Switch
Transformer, GShard, Mixtral) replaces a block's MLP by E MLPs, the *experts*, and a *router*:
a linear layer whose softmax over the experts picks the k most probable for each token (top-1
as in Switch, top-2 as in GShard and Mixtral). The token's output is the experts' outputs
weighted by their probabilities (top-1: its expert's probability; top-2: the two renormalised
to add up to 1). The parameters grow with E; the computation per token only with k.

**Capacity.** An expert takes at most ``ceil(capacity_factor * k * T / E)`` of a group's T
tokens; the rest of its choices are *dropped*: they add nothing to their tokens' outputs, and a
token whose k choices are all dropped skips the layer, carried by the residual.
Slots go to the tokens' first choices in token order, then to their second choices (GShard).
With expert parallelism each rank's tokens are one group, so one process routes N groups to
drop the same tokens.

**Load balance.** A router left alone collapses onto a few experts. Switch's auxiliary loss
``E sum_i f_i P_i`` (f_i: the share of the tokens' choices that picked expert i; P_i: the mean
probability the router gives it) is 1 when the load is even and grows as it concentrates. The
losses here are *sums* over tokens (as :mod:`course_lib.transformer`'s): :func:`balance_loss_sum`
is T times Switch's mean, so a rank's share adds up with the others' to one process's.

**Expert parallelism** (:class:`ExpertParallelMoE`): rank r holds experts r E/N ... (r+1) E/N - 1
and its own tokens. Each forward: route; exchange per-expert counts (a small all-to-all);
dispatch every kept token to its expert's rank (an all-to-all of uneven blocks); run the local
experts; send the outputs back (the reverse all-to-all); weight them by the router. Backward runs
the two all-to-alls the other way. :class:`TensorParallelMoE` splits every expert's hidden units
over the ranks instead: every rank holds every token, and one allreduce adds the partial outputs.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.collectives import all_to_all, allreduce
from course_lib.comm import Comm, during
from course_lib.tensor_parallel import (
    CopyToParallelRegion,
    ReduceFromParallelRegion,
    TensorParallel,
)
from course_lib.transformer import GPTConfig, mlp


# ---------------------------------------------------------------- routing
@dataclass
class Routing:
    """Where a batch of tokens goes. ``probs``: (T, E) the router's softmax; ``expert``, ``gate``,
    ``kept``: (T, k) each token's chosen experts, their weights, and whether it got a slot;
    ``load``: (E,) the choices that picked each expert, kept or not (for the balance loss).
    Introduced in notebooks/15_mixture_of_experts.ipynb."""

    probs: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor
    kept: torch.Tensor
    load: torch.Tensor

    @property
    def dropped(self) -> int:
        """Choices that found their expert full."""
        return int((~self.kept).sum())

    def assigned(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens expert ``e`` computes (in token order) and their gates."""
        token, slot = ((self.expert == e) & self.kept).nonzero(as_tuple=True)
        return token, self.gate[token, slot]


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> int:
    """The most tokens an expert takes from a group of ``tokens``: ``ceil(factor k T / E)``, or
    every choice when ``capacity_factor`` is None (nothing dropped). The factor is read as the
    decimal it prints as: in floats, ``1.1 * 50 / 5`` is 11.000000000000002, whose ceiling is 12.
    Introduced in notebooks/15_mixture_of_experts.ipynb."""
    if capacity_factor is None:
        return tokens * top_k
    return math.ceil(Fraction(str(capacity_factor)) * top_k * tokens / experts)


def keep_within_capacity(expert: torch.Tensor, experts: int, limit: int) -> torch.Tensor:
    """(T, k) booleans: which choices get a slot when each expert takes ``limit`` of them,
    first choices before second ones, each in token order (GShard's priority).
    Introduced in notebooks/15_mixture_of_experts.ipynb."""
    order = expert.T.reshape(-1)                         # choice j of every token, then j + 1
    queue = F.one_hot(order, experts).cumsum(0)          # place in each expert's queue, from 1
    place = queue.gather(1, order[:, None]).squeeze(1)
    return (place <= limit).reshape(expert.shape[1], -1).T


def route(logits: torch.Tensor, top_k: int = 1, capacity_factor: float | None = None,
          groups: int = 1) -> Routing:
    """Softmax over the experts, the ``top_k`` most probable per token, and the capacity counted
    per group (the tokens cut into ``groups`` equal runs, in order).
    Introduced in notebooks/15_mixture_of_experts.ipynb."""
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k}: between 1 and the {E} experts")
    if T % groups:
        raise ValueError(f"{T} tokens do not split into {groups} equal groups")
    probs = torch.softmax(logits, dim=-1)
    top, expert = probs.topk(top_k, dim=-1)
    gate = top if top_k == 1 else top / top.sum(-1, keepdim=True)
    limit = capacity(T // groups, E, top_k, capacity_factor)
    kept = torch.cat([keep_within_capacity(part, E, limit) for part in expert.chunk(groups)])
    load = torch.bincount(expert.reshape(-1), minlength=E)
    return Routing(probs, expert, gate, kept, load)


def balance_loss_sum(probs: torch.Tensor, load: torch.Tensor, tokens: int | torch.Tensor,
                     top_k: int) -> torch.Tensor:
    """Switch's load-balancing loss times the tokens: ``E sum_i f_i S_i``, with f_i =
    load_i / (k tokens) the share of the choices that picked expert i and S_i the sum of the
    router's probabilities for it over ``probs``' tokens. With the whole batch's ``load`` and
    ``tokens``, each rank's share (its own ``probs``) adds up to one process's.
    Introduced in notebooks/15_mixture_of_experts.ipynb."""
    f = load.to(probs.dtype) / (top_k * tokens)
    return probs.shape[1] * (f * probs.sum(0)).sum()


# ---------------------------------------------------------------- one process
@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    """A transformer (:class:`course_lib.transformer.GPT`) whose every block's MLP is a mixture
    of ``experts`` MLPs, ``top_k`` of them per token.
    Introduced in notebooks/15_mixture_of_experts.ipynb."""

    experts: int = 4
    top_k: int = 1            # experts per token
    capacity_factor: float | None = None  # None: no expert ever full, no token dropped
    aux_weight: float = 0.01  # the load-balancing loss's weight in the training loss

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..experts={self.experts}")

    def feed_forward(self) -> nn.Module:
        return MoE(self.d_model, self.experts, self.top_k, self.capacity_factor,
                   self.hidden or 4 * self.d_model)


class MoE(nn.Module):
    """A mixture-of-experts MLP on one process: the router and ``experts`` MLPs of ``hidden``
    units. ``groups``: how many groups capacity is counted in (N, to match N ranks of expert
    parallelism). After each forward: ``aux_sum`` (:func:`balance_loss_sum`) and ``routing``.
    Introduced in notebooks/15_mixture_of_experts.ipynb."""

    def __init__(self, d_model: int, experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, hidden: int | None = None) -> None:
        super().__init__()
        self.top_k, self.capacity_factor, self.groups = top_k, capacity_factor, 1
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(mlp(d_model, hidden or 4 * d_model)
                                     for _ in range(experts))
        self.aux_sum: torch.Tensor | None = None
        self.routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        r = route(self.router(h), self.top_k, self.capacity_factor, self.groups)
        self.routing, self.aux_sum = r, balance_loss_sum(r.probs, r.load, h.shape[0], self.top_k)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, gate = r.assigned(e)
            y = y.index_add(0, token, gate[:, None] * expert(h[token]))
        return y.reshape(x.shape)


# ---------------------------------------------------------------- expert parallelism
class AllToAll(torch.autograd.Function):
    """An all-to-all of rows, blocks of ``send_counts`` out and ``recv_counts`` in (agreed
    already: the counts were exchanged just before); its gradient goes back by the reverse
    all-to-all. ``AllToAll.apply(x, comm, send_counts, recv_counts)``.
    Introduced in notebooks/15_mixture_of_experts.ipynb."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, send_counts: list[int],
                recv_counts: list[int]) -> torch.Tensor:
        ctx.comm, ctx.counts = comm, (recv_counts, send_counts)
        recv = x.new_empty((sum(recv_counts), *x.shape[1:]))
        return all_to_all(x.contiguous(), recv, comm, send_counts, recv_counts, check=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return AllToAll.apply(grad, ctx.comm, *ctx.counts), None, None, None


class ExpertParallelMoE(nn.Module):
    """``moe``'s experts split over ``comm``'s ranks (rank r: experts r E/N to (r+1) E/N - 1),
    its router on every rank; each rank routes its own tokens. After each forward: ``aux_sum``
    (this rank's share of the whole batch's), ``routing`` and ``received`` (rows each local
    expert computed: its work). Introduced in notebooks/15_mixture_of_experts.ipynb."""

    def __init__(self, moe: MoE, comm: Comm) -> None:
        super().__init__()
        E, N = len(moe.experts), comm.world_size
        if E % N:
            raise ValueError(f"{E} experts do not split over {N} ranks")
        self.comm, self.top_k, self.capacity_factor = comm, moe.top_k, moe.capacity_factor
        self.per_rank, self.first = E // N, comm.rank * (E // N)
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e])
                                     for e in range(self.first, self.first + self.per_rank))
        self.aux_sum: torch.Tensor | None = None
        self.routing: Routing | None = None
        self.received: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm, N, E = self.comm, self.comm.world_size, self.router.out_features
        h = x.reshape(-1, x.shape[-1])
        r = route(self.router(h), self.top_k, self.capacity_factor)
        # the balance loss needs the whole batch's load and token count: E + 1 numbers
        totals = torch.cat([r.load, torch.tensor([h.shape[0]])]).double()
        where = f"expert parallelism, rank {comm.rank}"  # what a failed exchange names
        with during(f"{where}, the load's allreduce"):
            allreduce(totals, comm, check=False)
        self.routing, self.aux_sum = r, balance_loss_sum(r.probs, totals[:E], totals[E],
                                                         self.top_k)
        # this rank's kept choices, grouped by expert (so by the rank that holds it)
        token, slot = r.kept.nonzero(as_tuple=True)
        expert = r.expert[token, slot]
        order = torch.argsort(expert * h.shape[0] + token)
        token, slot, expert = token[order], slot[order], expert[order]
        per_expert = torch.bincount(expert, minlength=E).reshape(N, self.per_rank)
        # 1. counts: row q of what comes back = how many rows rank q sends each local expert
        with during(f"{where}, the counts' all-to-all"):
            counts = all_to_all(per_expert.contiguous(), torch.empty_like(per_expert), comm)
        send_counts, recv_counts = per_expert.sum(1).tolist(), counts.sum(1).tolist()
        # 2. dispatch the tokens to their experts' ranks, 3. compute, 4. send the outputs back
        with during(f"{where}, dispatch"):
            rows = AllToAll.apply(h[token], comm, send_counts, recv_counts)
        local = torch.repeat_interleave(torch.arange(self.per_rank).repeat(N), counts.reshape(-1))
        out = torch.zeros_like(rows)
        self.received = []
        for e, expert in enumerate(self.experts):
            mine = (local == e).nonzero().squeeze(1)
            out = out.index_copy(0, mine, expert(rows[mine]))
            self.received.append(len(mine))
        with during(f"{where}, combine"):
            back_rows = AllToAll.apply(out, comm, recv_counts, send_counts)
        y = torch.zeros_like(h).index_add(0, token, r.gate[token, slot][:, None] * back_rows)
        return y.reshape(x.shape)


class TensorParallelMoE(nn.Module):
    """``moe`` with every expert's hidden units split over ``tp``'s ranks (Megatron's column
    then row split, per expert), the router whole: every rank holds every token, computes its
    share of each chosen expert, and one allreduce adds the shares (of every kept choice's
    output, before the gates: each rank's router then sees whole outputs).
    Introduced in notebooks/15_mixture_of_experts.ipynb."""

    def __init__(self, moe: MoE, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.top_k, self.capacity_factor = tp, moe.top_k, moe.capacity_factor
        self.router = copy.deepcopy(moe.router)
        N, r = tp.world_size, tp.rank
        hidden = moe.experts[0][0].out_features
        if hidden % N:
            raise ValueError(f"{hidden} hidden units do not split over {N} ranks")
        cut = slice(r * hidden // N, (r + 1) * hidden // N)
        self.w1 = nn.ParameterList(nn.Parameter(m[0].weight[cut].detach().clone())
                                   for m in moe.experts)
        self.b1 = nn.ParameterList(nn.Parameter(m[0].bias[cut].detach().clone())
                                   for m in moe.experts)
        self.w2 = nn.ParameterList(nn.Parameter(m[2].weight[:, cut].detach().clone())
                                   for m in moe.experts)
        self.b2 = nn.ParameterList(nn.Parameter(m[2].bias.detach().clone()) for m in moe.experts)
        self.aux_sum: torch.Tensor | None = None
        self.routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole_x = x.reshape(-1, x.shape[-1])
        # the router reads x outside the parallel region: its part of x's gradient is whole on
        # every rank already; only the experts' shares of it must be added up
        r = route(self.router(whole_x), self.top_k, self.capacity_factor)
        self.routing = r
        self.aux_sum = balance_loss_sum(r.probs, r.load, whole_x.shape[0], self.top_k)
        h = CopyToParallelRegion.apply(whole_x, self.tp)
        token, slot = r.kept.nonzero(as_tuple=True)
        expert = r.expert[token, slot]
        share = torch.zeros(len(token), h.shape[1], dtype=h.dtype)
        for e in range(len(self.w1)):
            mine = (expert == e).nonzero().squeeze(1)
            hidden = F.gelu(h[token[mine]] @ self.w1[e].T + self.b1[e])
            share = share.index_copy(0, mine, hidden @ self.w2[e].T)
        whole = ReduceFromParallelRegion.apply(share, self.tp) + torch.stack(list(self.b2))[expert]
        y = torch.zeros_like(h).index_add(0, token, r.gate[token, slot][:, None] * whole)
        return y.reshape(x.shape)


# ---------------------------------------------------------------- a whole model
def count_groups(model: nn.Module, groups: int) -> nn.Module:
    """Count every MoE layer's capacity in ``groups`` groups of tokens (the one-process model
    that drops what ``groups`` ranks of expert parallelism drop). Returns ``model``.
    Introduced in notebooks/15_mixture_of_experts.ipynb."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.groups = groups
    return model


def parallelize_experts(model: nn.Module, comm: Comm) -> nn.Module:
    """Replace, in place, every MoE layer of ``model`` by its expert-parallel version on
    ``comm`` (this rank's experts; the rest of the model stays whole on every rank). Returns
    ``model``. Introduced in notebooks/15_mixture_of_experts.ipynb."""
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    ExpertParallelMoE(module, comm))
    return model
