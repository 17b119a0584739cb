"""Mixed precision: compute in 16 bits, keep the master weights and Adam's state in 32.

Introduced in notebooks/16_planning_a_run.ipynb. A 16-bit number takes half the bytes of a
32-bit one and runs faster on hardware built for it, but an update of 1e-4 of a weight of 1
disappears in bf16 (8 bits of mantissa) and a small fp16 gradient underflows to 0. Mixed
precision (Micikevicius et al. 2018) keeps both:

* the model's parameters and gradients in 16 bits (2 + 2 bytes per parameter): the forward
  and backward compute in them;
* a 32-bit **master** copy of every parameter (4 bytes) that the optimizer updates, with
  Adam's two moments (4 + 4): 2 + 2 + 12 = 16 bytes per parameter, the ZeRO paper's K = 12;
* for fp16 (5 bits of exponent), **dynamic loss scaling**: the loss is multiplied by S before
  backward so that small gradients stay representable; the gradients are divided by S before
  the update; a step whose gradients overflowed (inf or nan) is skipped and S halved, and S
  doubles after ``growth_interval`` good steps (torch's ``GradScaler``). bf16 has fp32's
  exponent and needs none.

    trainer = MixedPrecision(model, torch.optim.Adam, dtype=torch.float16, lr=1e-3)
    trainer.backward(loss)          # loss x S, backward in fp16
    trainer.step()                  # unscale into the masters, skip on overflow, copy back
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from course_lib import transformer as tf


class LossScaler:
    """Dynamic loss scaling, as ``torch.amp.GradScaler``: start at ``init_scale``; a step with
    inf or nan gradients is skipped and the scale multiplied by ``backoff_factor``; after
    ``growth_interval`` steps in a row without, it is multiplied by ``growth_factor``.
    Introduced in notebooks/16_planning_a_run.ipynb."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale, self.growth_factor = init_scale, growth_factor
        self.backoff_factor, self.growth_interval = backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped = 0  # steps skipped so far

    def unscale(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients by the scale, in place; True when one is inf or nan."""
        found = False
        for g in grads:
            g.div_(self.scale)
            found = found or not bool(torch.isfinite(g).all())
        return found

    def update(self, found_inf: bool) -> None:
        """The new scale after a step with (or without) an overflow."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


class MixedPrecision:
    """Train ``model`` in ``dtype`` (bf16 or fp16: its parameters are cast) with 32-bit master
    weights updated by ``optimizer_class(masters, **kwargs)``, and (fp16) dynamic loss
    scaling. Introduced in notebooks/16_planning_a_run.ipynb."""

    def __init__(self, model: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                 dtype: torch.dtype = torch.bfloat16, scaler: LossScaler | None = None,
                 **kwargs: Any) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype}: bfloat16 or float16")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        model.to(dtype)
        self.model, self.dtype = model, dtype
        self.optimizer = optimizer_class(self.masters, **kwargs)
        self.scaler = scaler if scaler is not None else (
            LossScaler() if dtype == torch.float16 else None)
        self.gradient_bytes = 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (times the scale, for fp16) into the 16-bit gradients."""
        (loss.float() * (self.scaler.scale if self.scaler else 1.0)).backward()

    def step(self) -> bool:
        """The 16-bit gradients into the masters (in fp32, unscaled), the optimizer's step on
        them unless one overflowed, and the masters back into the model. Returns whether the
        step was taken."""
        self.gradient_bytes = sum(p.grad.numel() * p.grad.element_size() for p in self.params
                                  if p.grad is not None)  # what backward held, 16-bit
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        grads = [m.grad for m in self.masters if m.grad is not None]
        overflow = self.scaler.unscale(grads) if self.scaler else False
        if self.scaler:
            self.scaler.update(overflow)
        if not overflow:
            self.optimizer.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)  # rounded to 16 bits
        self.optimizer.zero_grad()
        return not overflow

    def bytes_per_parameter(self) -> dict[str, float]:
        """What the run held per parameter, by kind, measured from the tensors after a step:
        16-bit parameters, the 16-bit gradients backward made, 32-bit masters, the optimizer's
        state (Adam's step counters, one number per tensor, left out)."""
        n = sum(p.numel() for p in self.params)
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return {"parameters": sum(p.numel() * p.element_size() for p in self.params) / n,
                "gradients": self.gradient_bytes / n,
                "master weights": sum(m.numel() * m.element_size() for m in self.masters) / n,
                "optimizer": state / n}


def train_transformer(dtype: torch.dtype, steps: int = 40, scaler: LossScaler | None = None,
                      batch: int = 8, lr: float = 2e-3, seed: int = 0, fp8: bool = False) -> dict:
    """The transformer of notebook 14 trained ``steps`` Adam steps in ``dtype`` (float32, or
    mixed precision with bf16 or fp16) on the same batches whatever the dtype; ``fp8``: every
    Linear's products in FP8 (:func:`fp8_linears`). Returns the loss of each step, whether
    each step was taken, the loss scale after each (fp16) and the bytes per parameter held
    (mixed precision). Introduced in notebooks/16_planning_a_run.ipynb."""
    model, data = tf.GPT(tf.GPTConfig(), seed=seed), tf.encode(tf.load_text()[:100_000])
    if fp8:
        fp8_linears(model)
    rng = np.random.default_rng(seed)
    out: dict = dict(losses=[], taken=[], scales=[])
    if dtype == torch.float32:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        trainer = MixedPrecision(model, torch.optim.Adam, dtype=dtype, scaler=scaler, lr=lr)
    for _ in range(steps):
        x, y = tf.get_batch(data, batch, model.cfg.context, rng)
        loss = model(x, y)[1] / y.numel()
        if dtype == torch.float32:
            opt.zero_grad()
            loss.backward()
            opt.step()
            out["taken"].append(True)
        else:
            trainer.backward(loss)
            out["taken"].append(trainer.step())
            out["scales"].append(trainer.scaler.scale if trainer.scaler else None)
        out["losses"].append(loss.item())
    out["bytes"] = None if dtype == torch.float32 else trainer.bytes_per_parameter()
    return out


# ---------------------------------------------------------------- eight bits
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # forward; gradients


def fp8_max(fmt: str) -> float:
    """The largest finite number of an FP8 format: 448 (e4m3), 57,344 (e5m2).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if fmt not in FP8:
        raise ValueError(f"fmt {fmt!r}: one of {sorted(FP8)}")
    return torch.finfo(FP8[fmt]).max


def to_fp8(x: torch.Tensor, fmt: str = "e4m3", block: int | None = None,
           amax: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in FP8 with its scale, x ~ q.float() * scale: the scale maps the largest
    magnitude (amax) onto the format's largest number, so the format's range is used and
    nothing overflows. ``block``: one scale for each ``block`` consecutive numbers of a row
    (the last dimension; DeepSeek-V3 uses 128), else one for the tensor. ``amax``: scale by
    this one instead of ``x``'s own (*delayed* scaling passes the largest of the last steps');
    numbers beyond it saturate at the format's largest.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    top = fp8_max(fmt)
    x = x.float()
    if block is not None:
        if x.shape[-1] % block:
            raise ValueError(f"the last dimension ({x.shape[-1]}) is not a multiple of block "
                             f"{block}")
        x = x.unflatten(-1, (x.shape[-1] // block, block))
    if amax is None:
        amax = x.abs().amax(-1, keepdim=True) if block is not None else x.abs().max()
    scale = (torch.as_tensor(amax, dtype=torch.float32) / top).clamp(
        min=torch.finfo(torch.float32).tiny)  # an all-zero block keeps a usable scale
    q = (x / scale).clamp(-top, top).to(FP8[fmt])  # saturate, as torch's delayed scaling does
    if block is not None:
        return q.flatten(-2), scale.squeeze(-1)
    return q, scale


def from_fp8(q: torch.Tensor, scale: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The float32 numbers an FP8 tensor and its scale(s) stand for.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if block is None:
        return q.float() * scale
    return (q.float().unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``a @ b.T`` with both operands in e4m3 (per tensor, or per ``block``), the products
    summed in float32: what ``torch._scaled_mm`` computes on a CPU (Hopper's FP8 tensor cores
    sum in less precision unless the library promotes the partial sums).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return from_fp8(*to_fp8(a, "e4m3", block), block) @ from_fp8(*to_fp8(b, "e4m3", block),
                                                                  block).T


class _FP8Linear(torch.autograd.Function):
    """y = x W^T + b with x and W in e4m3 (current scaling, per tensor) and, in backward, the
    output's gradient in e5m2 (range before precision: gradients span more decades)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        qx, sx = to_fp8(x, "e4m3")
        qw, sw = to_fp8(weight, "e4m3")
        ctx.save_for_backward(qx, sx, qw, sw)  # the input is kept in one byte, not four
        y = from_fp8(qx, sx) @ from_fp8(qw, sw).T
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        qx, sx, qw, sw = ctx.saved_tensors
        g = from_fp8(*to_fp8(grad, "e5m2"))
        grad_x = g @ from_fp8(qw, sw)
        grad_w = g.flatten(0, -2).T @ from_fp8(qx, sx).flatten(0, -2)
        return grad_x, grad_w, grad.flatten(0, -2).sum(0)


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose three matrix products (forward, and the two of backward) take FP8
    operands: e4m3 inputs and weights, e5m2 output gradients, float32 sums. A simulation
    (the numbers are rounded to FP8 and computed in float32), bitwise what
    ``torch._scaled_mm`` computes from them. Introduced in notebooks/16_planning_a_run.ipynb."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8Linear.apply(x, self.weight, self.bias)


def fp8_linears(model: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` made an :class:`FP8Linear` in place (parameters
    kept): the recipe of torchao's ``convert_to_float8_training``, simulated.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FP8Linear
    return model


def fp8_pack(shard: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The buffer of an FP8 all-gather with this rank's row filled: its shard in e4m3 bytes,
    then the 4 bytes of its scale (a row of ``shard.numel() + 4`` bytes per rank).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    q, scale = to_fp8(shard, "e4m3")
    wire = torch.zeros(world, shard.numel() + 4, dtype=torch.uint8)
    wire[rank, :-4] = q.flatten().view(torch.uint8)
    wire[rank, -4:] = scale.reshape(1).view(torch.uint8)
    return wire


def fp8_unpack(wire: torch.Tensor) -> torch.Tensor:
    """Every rank's row of a gathered :func:`fp8_pack` buffer back in float32, end to end.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    scales = wire[:, -4:].contiguous().view(torch.float32)  # (world, 1)
    return (wire[:, :-4].contiguous().view(FP8["e4m3"]).float() * scales).flatten()


def fp8_all_gather(shard: torch.Tensor, comm: Any) -> torch.Tensor:
    """ZeRO-3's all-gather of a weight, in FP8: each rank sends its shard as e4m3 bytes (one
    byte a number, half of bf16's two) and its scale, in one ring all-gather, and every rank
    rebuilds the full weight in float32. All ranks' shards must have the same length.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    from course_lib.collectives import ring_allgather
    wire = fp8_pack(shard, comm.rank, comm.world_size)
    ring_allgather(wire.view(-1), comm)
    return fp8_unpack(wire)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact||. Introduced in notebooks/16_planning_a_run.ipynb."""
    return float((approx.float() - exact).norm() / exact.norm())


def outlier_errors(outliers: Iterable[float], block: int = 128, seed: int = 0) -> dict:
    """Activations (256 x 1024, normal) with one column ``outlier`` times larger, as large
    language models' activations have, cast to bf16, to e4m3 with one scale for the tensor,
    and to e4m3 with one scale per ``block`` of a row: for each, the relative error of the
    *other* numbers after the round trip. Introduced in notebooks/16_planning_a_run.ipynb."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(seed))
    others = torch.ones(1024, dtype=torch.bool)
    others[7] = False
    out: dict = {"bf16": [], "e4m3, a scale per tensor": [], f"e4m3, a scale per {block}": []}
    for outlier in outliers:
        xo = x.clone()
        xo[:, 7] *= outlier
        for name, back in (("bf16", xo.bfloat16()),
                           ("e4m3, a scale per tensor", from_fp8(*to_fp8(xo))),
                           (f"e4m3, a scale per {block}", from_fp8(*to_fp8(xo, block=block),
                                                                   block))):
            out[name].append(relative_error(back[:, others], x[:, others]))
    return out


def scaling_errors(steps: int = 30, jump_at: int = 20, jump: float = 16.0, history: int = 16,
                   seed: int = 0) -> dict:
    """Activations whose largest magnitude grows ``jump`` times at step ``jump_at``, cast to
    e4m3 each step with *current* scaling (this step's amax) and *delayed* scaling (the
    largest amax of the last ``history`` steps, as Transformer Engine's recipe keeps): the
    relative error of each step, and the share of numbers that saturated.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    g = torch.Generator().manual_seed(seed)
    seen: list[float] = []
    out: dict = {"current": [], "delayed": [], "saturated": []}
    for step in range(steps):
        x = torch.randn(64, 256, generator=g) * (jump if step >= jump_at else 1.0)
        amax = max(seen[-history:]) if seen else float(x.abs().max())
        out["current"].append(relative_error(from_fp8(*to_fp8(x)), x))
        out["delayed"].append(relative_error(from_fp8(*to_fp8(x, amax=amax)), x))
        out["saturated"].append(float((x.abs() > amax).float().mean()))
        seen.append(float(x.abs().max()))  # recorded after use: the next steps scale by it
    return out
