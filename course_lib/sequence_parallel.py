"""Megatron tensor parallelism for a whole transformer block, and sequence parallelism on top.

Introduced in notebooks/14_transformers_and_long_sequences.ipynb, on notebook 09's layers.
**Tensor parallelism** (Shoeybi et al. 2019) splits attention by heads: Q, K and V column-wise
(rank r holds its heads' rows of the QKV projection), the output projection row-wise; the MLP
column then row. Each rank computes its heads on the whole sequence, and an allreduce after each
row-parallel layer adds the partial outputs: two allreduces forward, two backward, per block.
LayerNorm and the residual stream stay whole on every rank: each rank keeps its own copy of
those activations, which do not shrink with N.

**Sequence parallelism** (Korthikanti et al. 2022) splits those regions by the sequence: a rank
keeps T/N tokens of the residual stream and runs LayerNorm on them alone. The allreduce becomes
its two halves, an all-gather of the sequence before the column-parallel layer and a
reduce-scatter after the row-parallel one: the same bytes, and the LayerNorm and residual
activations divided by N. A column-parallel layer keeps only its rank's tokens and gathers them
again in backward (:class:`GatheredLinear`), so nothing is kept whole: the bytes each rank keeps
are :func:`activation_bytes_formula`'s, exactly. LayerNorm's weights see only a rank's tokens, so
their gradients are summed over the ranks after backward (:func:`allreduce_replicated_grads`).

**Collective matmul** (:func:`collective_matmul`, :class:`CollectiveLinear`; "async TP" in
torchtitan, micro-pipelined TP in PyTorch): the column-parallel layer need not wait for the whole
all-gather. The ring's N-1 steps each bring one rank's tokens; a rank multiplies the tokens it
holds while the next block travels, so the gather hides behind the matmul when a block's product
takes longer than its message (Wang et al. 2023). Shown in notebooks/09_model_parallelism.ipynb.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.collectives import ring_allgather, ring_reduce_scatter
from course_lib.comm import wait_all
from course_lib.runtime.timeline import DISABLED, Timeline
from course_lib.tensor_parallel import (
    CopyToParallelRegion,
    ReduceFromParallelRegion,
    TensorParallel,
)
from course_lib.transformer import Block, causal_attention


def _split_sequence(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, d) -> (N, B, T/N, d), contiguous: chunk r of the flat buffer is rank r's tokens."""
    B, T, d = x.shape
    return x.reshape(B, n, T // n, d).movedim(1, 0).contiguous()


def gather_sequence(x: torch.Tensor, tp: TensorParallel, phase: str = "forward") -> torch.Tensor:
    """Every rank's tokens ``(B, T/N, d)`` joined in rank order into ``(B, T, d)``: one ring
    all-gather, counted (at world size 1, ``x`` itself: nothing sent, nothing counted).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    n = tp.world_size
    if n == 1:
        return x
    buf = x.new_zeros((n, *x.shape))
    buf[tp.rank] = x
    ring_allgather(buf, tp.comm, check=False)
    tp.counts[phase] += 1
    return buf.movedim(0, 1).reshape(x.shape[0], n * x.shape[1], x.shape[2])


def reduce_scatter_sequence(x: torch.Tensor, tp: TensorParallel,
                            phase: str = "forward") -> torch.Tensor:
    """The sum over the ranks of ``x`` ``(B, T, d)``, of which this rank keeps its T/N tokens:
    one ring reduce-scatter, counted (at world size 1, ``x`` itself: nothing sent, nothing
    counted). Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    if tp.world_size == 1:
        return x
    buf = _split_sequence(x, tp.world_size)
    ring_reduce_scatter(buf, tp.comm, check=False)
    tp.counts[phase] += 1
    return buf[tp.rank].clone()


class ReduceScatterSequence(torch.autograd.Function):
    """Forward: reduce-scatter the row-parallel layer's partial outputs, keeping this rank's
    tokens. Backward: all-gather the gradient of those tokens.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return reduce_scatter_sequence(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_sequence(grad.contiguous(), ctx.tp, "backward"), None


class GatheredLinear(torch.autograd.Function):
    """``linear(all-gather of x along the sequence)``, keeping only this rank's ``x`` for
    backward: backward gathers it again (Korthikanti et al.: the gathered tensor, N times
    larger, is not kept), then reduce-scatters the input's gradient.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        ctx.save_for_backward(x, weight)
        return F.linear(gather_sequence(x, tp), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        full = gather_sequence(x, ctx.tp, "backward")  # once more, instead of keeping it
        grad_x = reduce_scatter_sequence(grad @ weight, ctx.tp, "backward")
        flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), full.reshape(-1, full.shape[-1])
        return grad_x, flat_grad.T @ flat_x, flat_grad.sum(0), None


TAG_BLOCK = 97  # the collective matmul's passes of blocks of tokens


def collective_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      tp: TensorParallel, phase: str = "forward",
                      timeline: Timeline = DISABLED) -> torch.Tensor:
    """``F.linear(gather_sequence(x, tp), weight, bias)`` with the all-gather cut into the ring's
    steps and hidden behind the matmul: at each of N steps this rank multiplies the block of
    tokens it holds; in the first N-1 it first posts that block to its right neighbour (and a
    receive from its left) and waits for both after the product. The same result and the same
    N-1 messages as the ring all-gather; the gather costs only what the products do not cover
    (``timeline``: each product and each wait, as spans).
    Introduced in notebooks/09_model_parallelism.ipynb."""
    comm, n, r = tp.comm, tp.world_size, tp.rank
    t = x.shape[1]  # tokens per rank
    out = x.new_empty(x.shape[0], n * t, weight.shape[0])
    block = x.contiguous()
    for step in range(n):
        owner = (r - step) % n  # whose tokens the block is: ours first, then our left's ...
        if step < n - 1:  # the pass is posted first, so that it travels while we multiply
            incoming = torch.empty_like(block)
            passes = [comm.isend(block, (r + 1) % n, tag=TAG_BLOCK, check_size=False),
                      comm.irecv(incoming, (r - 1) % n, tag=TAG_BLOCK, check_size=False)]
        with timeline.span(f"tokens of rank {owner}", "compute"):
            out[:, owner * t:(owner + 1) * t] = F.linear(block, weight, bias)
        if step < n - 1:
            with timeline.span(f"block {step + 1}", "wait"):  # what the product did not cover
                wait_all(passes, comm.timeout)
            block = incoming
    if n > 1:
        tp.counts[phase] += 1
    return out


class CollectiveLinear(GatheredLinear):
    """:class:`GatheredLinear` whose forward is a :func:`collective_matmul`: the all-gather
    hidden behind the products (backward unchanged).
    Introduced in notebooks/09_model_parallelism.ipynb."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        ctx.save_for_backward(x, weight)
        return collective_matmul(x, weight, bias, tp)


class ParallelBlock(nn.Module):
    """This rank's part of a :class:`transformer.Block`: its heads of attention, its columns of
    the MLP's hidden layer; the LayerNorms whole. ``sequence_parallel=False``: input and output
    ``(B, T, d)``, the same on every rank. ``True``: this rank's ``T/N`` tokens in and out.
    Built from a block (its weights copied, the block unchanged).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    def __init__(self, block: Block, tp: TensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        attn, n, r = block.attn, tp.world_size, tp.rank
        if attn.n_heads % n:
            raise ValueError(f"{attn.n_heads} heads do not split over {n} ranks")
        self.tp, self.sequence_parallel, self.heads = tp, sequence_parallel, attn.n_heads // n
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        full = dict(block.named_parameters())
        for name, attribute in SHARD_NAMES.items():  # this rank's shard of every split tensor
            if "." not in attribute:
                shard = tp_shard(name, full[name].detach(), r, n)
                setattr(self, attribute, nn.Parameter(shard.clone()))
        self.act = block.mlp[1]

    def column(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """A column-parallel layer: f then the linear (TP), or the all-gather of the sequence
        then the linear (SP)."""
        if self.sequence_parallel:
            return GatheredLinear.apply(x, weight, bias, self.tp)
        return F.linear(CopyToParallelRegion.apply(x, self.tp), weight, bias)

    def leave(self, partial: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel layer: g (TP) or the reduce-scatter (SP); then the bias, once."""
        if self.sequence_parallel:
            return ReduceScatterSequence.apply(partial, self.tp) + bias
        return ReduceFromParallelRegion.apply(partial, self.tp) + bias

    def attention(self, h: torch.Tensor, attention: Callable = causal_attention) -> torch.Tensor:
        qkv = self.column(h, self.qkv_weight, self.qkv_bias)  # (B, T, 3 d / N): whole sequence
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        y = attention(q, k, v).transpose(1, 2).reshape(B, T, -1)  # this rank's heads
        return F.linear(y, self.proj_weight)  # a partial sum of the output projection

    def forward(self, x: torch.Tensor, attention: Callable = causal_attention) -> torch.Tensor:
        """As :meth:`transformer.Block.forward`; ``attention`` runs on this rank's heads (ring
        attention there splits the sequence too)."""
        x = x + self.leave(self.attention(self.ln1(x), attention), self.proj_bias)
        hidden = self.act(self.column(self.ln2(x), self.fc_weight, self.fc_bias))
        return x + self.leave(F.linear(hidden, self.out_weight), self.out_bias)

    def replicated(self) -> list[nn.Parameter]:
        """The parameters every rank holds whole (LayerNorms, the row-parallel biases)."""
        return [*self.ln1.parameters(), *self.ln2.parameters(), self.proj_bias, self.out_bias]


SPLITS = ("tp", "tp+sp", "ring", "ulysses")  # the ways notebook 14 splits a block


def activation_bytes_formula(batch: int, length: int, d_model: int, heads: int, world_size: int,
                             split: str, itemsize: int = 8, flash: bool = False) -> int:
    """The bytes one block keeps for backward on each rank, counted tensor by tensor (this
    module's block: no dropout, GELU), for each ``split`` of :data:`SPLITS`.

    * Whole on every rank with TP ("tp"), divided by N otherwise: the LayerNorms' inputs and the
      tensors they hand to the next layer, 4 B T d, and their statistics, 4 B T.
    * Divided by N in every split (by heads and hidden units, or by tokens): Q, K, V (3 B T d),
      the attention output (B T d), the MLP's hidden layer before and after GELU (8 B T d).
    * Attention's probabilities, B h T^2 / N (heads split: TP, TP + SP, Ulysses), plus the causal
      mask, T^2 booleans. Ring attention keeps neither: it recomputes each block's
      probabilities in backward from its log-denominators (B h T / N) and keeps its output a
      second time (B T d / N, the output projection's input is a copy). So its bytes grow as T,
      the others' as T^2 - unless they run FlashAttention (``flash``), which keeps what the
      ring keeps: then every split grows as T.

    Korthikanti et al. count the same way for GPT (with dropout masks, in 16-bit):
    ``s b h (10 + 24/t + 5 a s / (h t))`` for TP and ``s b h / t (34 + 5 a s / h)`` with SP.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: one of {SPLITS}")
    if split == "ring":
        return block_activation_bytes(batch, length, d_model, heads, cp=world_size,
                                      itemsize=itemsize)
    # Ulysses keeps what TP + SP keeps: T/N tokens outside attention, H/N whole heads inside
    return block_activation_bytes(batch, length, d_model, heads, tp=world_size,
                                  sequence_parallel=split != "tp", itemsize=itemsize, flash=flash,
                                  output_heads=heads if split == "ulysses" else None)


def block_activation_bytes(batch: int, length: int, d_model: int, heads: int, tp: int = 1,
                           cp: int = 1, sequence_parallel: bool = False, itemsize: int = 8,
                           recompute: str | None = None, hidden: int | None = None,
                           flash: bool = False, output_heads: int | None = None) -> int:
    """The bytes one block keeps per rank with tensor parallelism over ``tp`` ranks (with
    sequence parallelism or not) and the sequence split over ``cp`` ranks by ring attention,
    at once (see :func:`activation_bytes_formula`): a rank holds T' = T/cp positions; the
    LayerNorm regions are whole over the ``tp`` ranks unless ``sequence_parallel``; the rest
    is divided by ``tp``; attention keeps its probabilities (cp = 1) or its output again and
    its log-denominators (ring attention, cp > 1). ``recompute="full"`` keeps the block's
    input only (B T' d, divided by tp with sequence parallelism); ``"attention"`` keeps
    attention's inputs but not what its core adds (the probabilities and the mask, or ring
    attention's output and log-denominators). ``hidden``: the MLP's width (4 d by default).
    ``flash``: attention's core is FlashAttention, which keeps what ring attention keeps. The
    output kept "again" is a second tensor only when the output projection's input is a copy of
    it: when the rank's attention output holds ``output_heads`` > 1 heads (heads / tp by
    default; Ulysses gathers all of them back), since one head's reshape is a view.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    B, T, d, h = batch, length // cp, d_model, heads
    if recompute == "full":
        return int(itemsize * B * T * d / (tp if sequence_parallel else 1))
    whole = 4 * B * T * d + 4 * B * T
    H = hidden or 4 * d  # the MLP's hidden layer is kept before and after GELU: 2 B T H
    numbers = (whole / tp if sequence_parallel else whole) + (4 * B * T * d + 2 * B * T * H) / tp
    core = recompute != "attention"  # what attention's core keeps beyond its inputs
    if cp > 1 or flash:  # the output again and the log-denominators, no T x T tensor
        again = B * T * d if (output_heads or h // tp) > 1 else 0
        return int(itemsize * (numbers + core * (again + B * h * T) / tp))
    return int(itemsize * (numbers + core * B * h * T * T / tp) + core * T * T)


def allreduce_replicated_grads(blocks: list[ParallelBlock]) -> None:
    """With sequence parallelism a replicated parameter saw only this rank's tokens: sum its
    gradient over the ranks (one allreduce per tensor), as Megatron does after backward.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    for block in blocks:
        if block.sequence_parallel:
            for p in block.replicated():
                p.grad = block.tp.allreduce(p.grad, "backward")


def tp_shard(name: str, full: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """Rank r of n's part of the unsplit block's tensor ``name``: its heads' rows of Q, K and V
    and its columns of the output projection, its hidden units of the MLP, the rest whole.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    if name in ("attn.qkv.weight", "attn.qkv.bias"):  # rows of [Q; K; V]: three pieces
        d = full.shape[0] // 3
        share = d // n
        return torch.cat([full[p * d + r * share:p * d + (r + 1) * share] for p in range(3)])
    if name in ("mlp.0.weight", "mlp.0.bias"):  # column-parallel: this rank's output rows
        hidden = full.shape[0] // n
        return full[r * hidden:(r + 1) * hidden]
    if name in ("attn.proj.weight", "mlp.2.weight"):  # row-parallel: this rank's input columns
        share = full.shape[1] // n
        return full[:, r * share:(r + 1) * share]
    return full  # LayerNorms and the row-parallel biases: whole on every rank


def shard_of(block: ParallelBlock, name: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the unsplit block's tensor ``name`` (as ``Block.named_parameters`` names it)
    that ``block`` holds, to compare gradients with one process. Introduced in
    notebooks/14_transformers_and_long_sequences.ipynb."""
    if name not in SHARD_NAMES:
        raise KeyError(name)
    return tp_shard(name, full, block.tp.rank, block.tp.world_size)


SHARD_NAMES = {"attn.qkv.weight": "qkv_weight", "attn.qkv.bias": "qkv_bias",
               "attn.proj.weight": "proj_weight", "attn.proj.bias": "proj_bias",
               "mlp.0.weight": "fc_weight", "mlp.0.bias": "fc_bias",
               "mlp.2.weight": "out_weight", "mlp.2.bias": "out_bias",
               **{f"{ln}.{p}": f"{ln}.{p}" for ln in ("ln1", "ln2") for p in ("weight", "bias")}}
