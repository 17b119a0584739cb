"""A small decoder-only transformer (in the style of nanoGPT), trained on text every Python has.

Introduced in notebooks/14_transformers_and_long_sequences.ipynb. Tokens are bytes; each block is
pre-LayerNorm causal multi-head self-attention, then an MLP, each added back to the residual
stream; the output head shares the token embedding's weights (tied). ``attention=`` replaces the
attention computation (the sequence- and context-parallel versions of notebook 14 plug in there),
and ``positions=`` gives the tokens' places in the whole sequence when a rank holds a part of it::

    from course_lib import transformer as tf
    text = tf.load_text()                          # the Python documentation, ~450 KB of English
    model = tf.GPT(tf.GPTConfig())                 # 2 layers, d = 64, 4 heads, context 64
    losses = tf.train(model, tf.encode(text), steps=200)
    print(tf.sample(model, "The list ", 80))

The text is ``pydoc_data.topics`` of the standard library: the reference manual's topics that
``help()`` shows, © Python Software Foundation, under the PSF licence (shipped with Python).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """The model's sizes. The defaults train in seconds on two cores.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    vocab_size: int = 256     # bytes
    context: int = 64         # the longest sequence the position embedding covers
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    hidden: int | None = None  # the MLP's hidden units (each expert's): 4 d_model by default
    recompute: str | None = None  # "full": each block again in backward; "attention": its core
    experts: ClassVar[int] = 0  # dense; notebook 15's moe.MoEConfig has a mixture of experts

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: one of {RECOMPUTE}")

    def feed_forward(self) -> nn.Module:
        """Each block's MLP (notebook 15's ``moe.MoEConfig`` makes it a mixture of experts)."""
        return mlp(self.d_model, self.hidden or 4 * self.d_model)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + mask) v`` over the last two dims, each query seeing only the
    keys at or before its own position (q, k, v: ``(..., T, d)``). Written out, to read; equal
    to ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    T = q.shape[-2]
    future = torch.ones(T, k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))  # query i may not look at key j > i
    return torch.softmax(scores, dim=-1) @ v


RECOMPUTE = (None, "full", "attention")


def recomputed(attention: Callable) -> Callable:
    """``attention`` that keeps only its inputs for backward and runs again there (selective
    activation recomputation, Korthikanti et al.: the T x T scores are cheap to recompute and
    expensive to keep). Introduced in notebooks/16_planning_a_run.ipynb."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return checkpoint(attention, q, k, v, use_reentrant=False)
    return run


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention: one projection makes Q, K and V for every head, ``attention``
    mixes the tokens within each head, one projection mixes the heads.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, attention: Callable = causal_attention) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, 3d) -> three (B, heads, T, d / heads): each head attends on its own slice
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2)  # -1: the heads it holds
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = attention(q, k, v).transpose(1, 2).reshape(B, T, -1)  # the heads side by side again
        return self.proj(y)


def mlp(d_model: int, hidden: int) -> nn.Sequential:
    """The block's MLP: up to ``hidden`` units, GELU, back down to ``d_model``.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    return nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))


class Block(nn.Module):
    """``x + attention(LN(x))``, then ``x + MLP(LN(x))``: the residual stream, pre-LayerNorm.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = cfg.feed_forward()

    def forward(self, x: torch.Tensor, attention: Callable = causal_attention) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attention)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, a final LayerNorm, and the output
    head tied to the token embedding. ``forward(idx, targets)`` returns the logits and, with
    targets, the loss SUM over the tokens (a rank holding part of a sequence adds its sum to the
    others'; divide by the token count for the mean). Seeded: every rank builds the same model.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.balance_loss: torch.Tensor | None = None  # experts: the last forward's, weighted
        with torch.random.fork_rng():  # the layers' own initialisation: the global RNG untouched
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.context, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
        # GPT-2's initialisation, drawn from this seed alone: the same weights on every rank,
        # processes or threads (a generator of its own: threads share the global one)
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02, generator=gen)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, attention: Callable = causal_attention,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[-1]
        last = T - 1 if positions is None else int(positions.max())  # (no data read: T alone)
        if last >= self.cfg.context:
            raise ValueError(f"position {last} is beyond the model's context {self.cfg.context}")
        if positions is None:
            positions = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        if self.cfg.recompute == "attention":  # keep q, k, v; compute the T x T scores again
            attention = recomputed(attention)
        for block in self.blocks:
            if self.cfg.recompute == "full":  # keep the block's input; run it again in backward
                x = checkpoint(block, x, attention, use_reentrant=False)
            else:
                x = block(x, attention)
        logits = self.ln_f(x) @ self.tok.weight.T  # tied head: the embedding, read backwards
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="sum")
        if self.cfg.experts:  # notebook 15: the load-balancing losses, a sum over the tokens too
            self.balance_loss = self.cfg.aux_weight * sum(b.mlp.aux_sum for b in self.blocks)
            loss = loss + self.balance_loss
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def activation_bytes_of(forward: Callable[[], object], module: nn.Module) -> int:
    """Bytes of the tensors autograd keeps for backward while ``forward()`` runs (each storage
    counted once, ``module``'s parameters left out): the activations.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values())


def activation_bytes(model: GPT, idx: torch.Tensor) -> int:
    """The activation bytes of one forward and loss of ``model`` on ``idx`` (its windows, each
    token's target the next). Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    return activation_bytes_of(lambda: model(idx[:, :-1], idx[:, 1:]), model)


# ---------------------------------------------------------------- text, batches, training
def load_text() -> str:
    """The reference manual's topics of this Python's standard library (``pydoc_data``), as one
    string. Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    from pydoc_data.topics import topics  # the standard library's own text: nothing to download
    return "\n\n".join(topics[name] for name in sorted(topics))


def encode(text: str) -> np.ndarray:
    """The UTF-8 bytes of ``text`` as token ids 0..255.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def decode(tokens: Iterable[int]) -> str:
    """Token ids back to text (a broken UTF-8 sequence shows as the replacement character).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def get_batch(data: np.ndarray, batch_size: int, length: int,
              rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``length`` tokens, and the same windows one token on:
    the target of each position is the next token.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    starts = rng.integers(0, len(data) - length - 1, batch_size)
    x = np.stack([data[s:s + length] for s in starts])
    y = np.stack([data[s + 1:s + length + 1] for s in starts])
    return torch.from_numpy(x), torch.from_numpy(y)


def train(model: GPT, data: np.ndarray, steps: int = 200, batch_size: int = 16,
          lr: float = 3e-3, seed: int = 0, length: int | None = None,
          after_step: Callable[[GPT], None] | None = None) -> list[float]:
    """AdamW on random windows of ``data``; returns the cross-entropy (nats per token) of each
    step (a mixture of experts trains on it plus its load-balancing loss). ``after_step(model)``
    runs after each step (to record the experts' load, say).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    length = length or model.cfg.context
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng, losses = np.random.default_rng(seed), []
    for _ in range(steps):
        x, y = get_batch(data, batch_size, length, rng)
        _, loss = model(x, y)
        loss = loss / y.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        balance = model.balance_loss.item() / y.numel() if model.cfg.experts else 0.0
        losses.append(loss.item() - balance)
        if after_step is not None:
            after_step(model)
    return losses


@torch.no_grad()
def sample(model: GPT, prompt: str, n_tokens: int, temperature: float = 0.8,
           seed: int = 0) -> str:
    """``prompt`` continued by ``n_tokens`` bytes drawn from the model, one at a time.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.from_numpy(encode(prompt))[None]
    for _ in range(n_tokens):
        logits, _ = model(idx[:, -model.cfg.context:])
        probs = torch.softmax(logits[0, -1] / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)[None]], dim=1)
    return decode(idx[0].tolist())
