"""Tensor parallelism from scratch, Megatron-LM style: each weight matrix cut across ranks.

Introduced in notebooks/09_model_parallelism.ipynb. Data parallelism copies the whole model to
every rank; tensor parallelism splits each weight matrix, so a layer too big for one device fits
on N. For an MLP block ``Y = act(X A) B`` (Shoeybi et al. 2019, "Megatron-LM"), A is split by
columns (output features) and B by rows (input features): rank r computes ``act(X A_r) B_r``
with no communication (an element-wise activation needs only its own hidden units), a partial
sum of Y, and one allreduce adds the N partial sums.

Two conjugate operators carry the communication: ``f`` (identity forward, allreduce of the
gradient backward) where the replicated input enters the column-parallel layer, and ``g``
(allreduce forward, identity backward) where the row-parallel layer leaves. So a block costs one
allreduce in forward and one in backward, each of the activations' size (batch x d_model)::

    tp = TensorParallel(get_comm("torch"))              # all ranks of the process group
    block = ParallelMLP.from_mlp(mlp, tp)               # mlp = Sequential(Linear, GELU, Linear)
    block(x.requires_grad_()).sum().backward()          # x, output: the same on every rank
    tp.counts                                           # {'forward': 1, 'backward': 1}

(The backward allreduce is that of dL/dx: it runs when x needs a gradient, as inside a network.)
Every allreduce is the course's ring (:mod:`course_lib.collectives`), so an emulated link
(:mod:`course_lib.runtime.netem`) prices it. A size the world size does not divide raises
ValueError: every rank holds an equal shard, as in Megatron.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from course_lib.collectives import allreduce, ring_allgather
from course_lib.comm import Comm


class TensorParallel:
    """The ranks that share each layer (``comm``), and a count of the collectives they ran.

    ``counts`` is ``{"forward": n, "backward": n}``: every allreduce (and all-gather) the layers
    built on this object run, by the pass it ran in. At world size 1 nothing is sent and nothing
    counted. Give all layers of a model the same object to count them together.

    Introduced in notebooks/09_model_parallelism.ipynb."""

    def __init__(self, comm: Comm, algorithm: str = "ring") -> None:
        self.comm, self.algorithm = comm, algorithm
        self.counts = {"forward": 0, "backward": 0}

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def reset_counts(self) -> None:
        """Set both counts back to zero."""
        self.counts = {"forward": 0, "backward": 0}

    def allreduce(self, tensor: torch.Tensor, phase: str) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks, as a new tensor; counted under ``phase``."""
        if self.world_size == 1:
            return tensor
        # a contiguous copy: the course's allreduce works in place, and autograd's tensors
        # (the forward's input, the gradient handed to backward) must not change under it
        out = tensor.clone(memory_format=torch.contiguous_format)
        allreduce(out, self.comm, algorithm=self.algorithm, check=False)
        self.counts[phase] += 1
        return out

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on all), joined along the last dimension in rank
        order; one ring all-gather, counted under forward."""
        if self.world_size == 1:
            return tensor
        buf = tensor.new_zeros((self.world_size, *tensor.shape))
        buf[self.rank] = tensor  # chunk r of the flat buffer is rank r's tensor
        ring_allgather(buf, self.comm, check=False)
        self.counts["forward"] += 1
        # (N, ..., k) -> (..., N, k) -> (..., N k): column r k + j is rank r's column j
        return buf.movedim(0, -2).reshape(*tensor.shape[:-1], -1)

    def __repr__(self) -> str:
        return f"<TensorParallel rank {self.rank} of {self.world_size}, counts {self.counts}>"


def _tp(tp):
    """A TensorParallel from a TensorParallel or a bare comm (which then gets its own count)."""
    return tp if isinstance(tp, TensorParallel) else TensorParallel(tp)


def _param(shape, fan_in, dtype, device):
    """A parameter drawn as nn.Linear draws its own: uniform in +-1/sqrt(fan_in)."""
    bound = fan_in ** -0.5
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device).uniform_(-bound, bound))


def _bounds(n, tp, what):
    """(start, stop) of rank r's equal share of ``n`` features."""
    if n % tp.world_size:
        raise ValueError(f"{what}={n} is not divisible by the world size {tp.world_size}: "
                         f"tensor parallelism here gives every rank an equal shard")
    k = n // tp.world_size
    return tp.rank * k, (tp.rank + 1) * k


class CopyToParallelRegion(torch.autograd.Function):
    """Megatron's ``f``: identity in forward, allreduce (sum) of the gradient in backward.

    Where a replicated input enters a column-parallel layer: each rank's slice of the layer sends
    back only its part of dL/dx, and the true gradient is their sum.
    ``CopyToParallelRegion.apply(x, tp)``. Introduced in notebooks/09_model_parallelism.ipynb."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.allreduce(grad, "backward"), None  # None: tp gets no gradient


class ReduceFromParallelRegion(torch.autograd.Function):
    """Megatron's ``g``: allreduce (sum) in forward, identity in backward.

    Where a row-parallel layer's partial sums leave: after the allreduce every rank holds the
    same output, so the gradient arriving from above is already the full one on every rank.
    ``ReduceFromParallelRegion.apply(x, tp)``. Introduced in notebooks/09_model_parallelism.ipynb.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return tp.allreduce(x, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherFromParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension in forward; keep this rank's slice in backward.

    The backward sends nothing: it assumes, as Megatron does, that what follows is replicated,
    so the gradient of the gathered tensor is the same on every rank.
    ``GatherFromParallelRegion.apply(x, tp)``. Introduced in notebooks/09_model_parallelism.ipynb.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp, ctx.k = tp, x.shape[-1]
        return tp.gather_last_dim(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        r, k = ctx.tp.rank, ctx.k
        return grad[..., r * k:(r + 1) * k], None  # rank r's k columns of the gathered tensor


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's rows (the output features) split over the ranks.

    Rank r holds rows ``self.rows = (start, stop)`` of W and the same slice of b; its input ``x``
    is the full one (the same on every rank) and its output is its slice of the output features,
    or all of them with ``gather_output=True`` (one all-gather). Forward: f, then the local
    linear. A new layer draws its shard as nn.Linear draws its weights; ``from_linear`` splits a
    layer that exists.
    Introduced in notebooks/09_model_parallelism.ipynb."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel | Comm,
                 bias: bool = True, gather_output: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp, self.gather_output = _tp(tp), gather_output
        self.in_features, self.out_features = in_features, out_features
        self.rows = _bounds(out_features, self.tp, "out_features")
        n = self.rows[1] - self.rows[0]
        self.weight = _param((n, in_features), in_features, dtype, device)
        self.bias = _param((n,), in_features, dtype, device) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TensorParallel | Comm,
                    gather_output: bool = False) -> ColumnParallelLinear:
        """This rank's shard of an existing ``nn.Linear`` (copied: the original is unchanged)."""
        layer = cls(linear.in_features, linear.out_features, tp, linear.bias is not None,
                    gather_output, linear.weight.dtype, linear.weight.device)
        start, stop = layer.rows
        with torch.no_grad():
            layer.weight.copy_(linear.weight[start:stop])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[start:stop])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(CopyToParallelRegion.apply(x, self.tp), self.weight, self.bias)
        return GatherFromParallelRegion.apply(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(rows {self.rows[0]}:{self.rows[1]} here), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's columns (the input features) split over the ranks.

    Rank r holds columns ``self.cols = (start, stop)`` of W and all of b; its input is already
    split, its slice ``x[..., start:stop]`` (a column-parallel layer's output). Forward: the local
    linear without bias (a partial sum of y), then g (allreduce), then b, added once. The output
    is the full y on every rank. Use ``from_linear`` to split a layer that exists.
    Introduced in notebooks/09_model_parallelism.ipynb."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel | Comm,
                 bias: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = _tp(tp)
        self.in_features, self.out_features = in_features, out_features
        self.cols = _bounds(in_features, self.tp, "in_features")
        n = self.cols[1] - self.cols[0]
        self.weight = _param((out_features, n), in_features, dtype, device)
        self.bias = _param((out_features,), in_features, dtype, device) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TensorParallel | Comm) -> RowParallelLinear:
        """This rank's shard of an existing ``nn.Linear`` (copied: the original is unchanged)."""
        layer = cls(linear.in_features, linear.out_features, tp, linear.bias is not None,
                    linear.weight.dtype, linear.weight.device)
        start, stop = layer.cols
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, start:stop])  # W is (out, in): in = columns
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.linear(x, self.weight)
        # the bias after the sum: added before it, the N ranks would add it N times
        y = ReduceFromParallelRegion.apply(partial, self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (columns {self.cols[0]}:{self.cols[1]} here), "
                f"out_features={self.out_features}")


class ParallelMLP(nn.Sequential):
    """Linear -> activation -> Linear, split column then row: one allreduce forward, one backward.

    ``ParallelMLP(ColumnParallelLinear(d, h, tp), nn.GELU(), RowParallelLinear(h, d, tp))``, or
    ``ParallelMLP.from_mlp(mlp, tp)`` to split an ``nn.Sequential(Linear, GELU, Linear)`` that
    exists. Layers are named "0", "1", "2" as in that Sequential, so parameter names match the
    unsplit MLP's. The activation must be element-wise (GELU, ReLU, ...): each rank applies it to
    its own hidden units, with no communication. Introduced in notebooks/09_model_parallelism.ipynb.
    """

    def __init__(self, column: ColumnParallelLinear, activation: nn.Module,
                 row: RowParallelLinear) -> None:
        if column.tp is not row.tp:
            raise ValueError("the two layers of a ParallelMLP must share one TensorParallel: "
                             "pass the same TensorParallel(comm) to both")
        super().__init__(column, activation, row)
        self.tp = column.tp

    @classmethod
    def from_mlp(cls, mlp: nn.Sequential, tp: TensorParallel | Comm) -> ParallelMLP:
        """This rank's shard of ``nn.Sequential(Linear, activation, Linear)``; the activation
        module is shared, not copied."""
        layers = list(mlp)
        if len(layers) != 3 or not (isinstance(layers[0], nn.Linear)
                                    and isinstance(layers[2], nn.Linear)):
            raise ValueError(f"from_mlp splits Sequential(Linear, activation, Linear), not "
                             f"Sequential({', '.join(type(m).__name__ for m in layers)})")
        tp = _tp(tp)
        return cls(ColumnParallelLinear.from_linear(layers[0], tp), layers[1],
                   RowParallelLinear.from_linear(layers[2], tp))
