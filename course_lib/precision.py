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
                      batch: int = 8, lr: float = 2e-3, seed: int = 0) -> dict:
    """The transformer of notebook 14 trained ``steps`` Adam steps in ``dtype`` (float32, or
    mixed precision with bf16 or fp16) on the same batches whatever the dtype. Returns the
    loss of each step, whether each step was taken, the loss scale after each (fp16) and the
    bytes per parameter held (mixed precision).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    model, data = tf.GPT(tf.GPTConfig(), seed=seed), tf.encode(tf.load_text()[:100_000])
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
