"""Generating text with a trained transformer: the KV cache, grouped-query attention, and why
decoding is memory-bound.

Introduced in notebooks/18_serving_across_devices.ipynb. A model generates one token at a time,
each from every token before it. Run naively, step t runs the whole prefix again: t tokens of
work for one new token. But a token's keys and values never change once computed (attention is
causal), so a **KV cache** keeps them: each step runs the new token alone, its query attending
over the cached keys. The cache holds ``2 x layers x kv_heads x head_dim`` numbers per token
(:func:`kv_bytes_per_token`), and grouped-query attention (Ainslie et al. 2023) shrinks it by
letting groups of query heads share one key and value head (:func:`grouped`)::

    decoder = Decoder(model)                    # the model and its cache
    logits = decoder.feed(prompt)               # prefill: the prompt's tokens at once
    logits = decoder.feed(next_token)           # decode: one token, over the cached keys
    tokens = generate(model, prompt, 50)        # greedy, cached; cache=False reruns the prefix

The cache plugs into the model as its ``attention=``: the model's own blocks compute Q, K and V,
:meth:`KVCache.attend` stores K and V and attends over everything stored. The same hook serves a
tensor-parallel model (each rank caches its heads, :mod:`course_lib.serving`) and a paged cache
(:mod:`course_lib.paged_attention`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import gpu
from course_lib.transformer import GPT, GPTConfig


def kv_bytes_per_token(n_layers: int, kv_heads: int, head_dim: int, itemsize: int = 2) -> int:
    """Bytes the cache holds per token: a key and a value (2) of ``head_dim`` numbers for each
    of ``kv_heads`` heads in each of ``n_layers`` layers. OPT-13B (40 layers, 40 heads of 128,
    fp16): 2 x 40 x 40 x 128 x 2 = 800 KiB a token, as Kwon et al. count it.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    return 2 * n_layers * kv_heads * head_dim * itemsize


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     start: int) -> torch.Tensor:
    """Causal attention of ``t`` new queries at positions ``start .. start + t - 1`` over the
    keys of positions ``0 .. start + t - 1`` (q: ``(B, heads, t, d)``; keys, values:
    ``(B, kv_heads, start + t, d)``, each of the ``kv_heads`` serving ``heads / kv_heads``
    query heads side by side). With ``start = 0`` it is the transformer's ``causal_attention``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    group = q.shape[1] // keys.shape[1]
    if group > 1:  # grouped-query attention: each key head serves `group` query heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    t, total = q.shape[-2], keys.shape[-2]
    # query i sits at position start + i: it may not see key j > start + i
    future = torch.ones(t, total, dtype=torch.bool, device=q.device).triu(start + 1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ values


def sdpa_cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          start: int) -> torch.Tensor:
    """:func:`cached_attention` by torch's fused ``scaled_dot_product_attention`` (the causal
    mask shifted by ``start``, grouped-query heads by ``enable_gqa``): the native kernel the
    benchmark compares with. Introduced in notebooks/18_serving_across_devices.ipynb."""
    t, total = q.shape[-2], keys.shape[-2]
    visible = torch.ones(t, total, dtype=torch.bool, device=q.device).tril(start)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible,
                                          enable_gqa=keys.shape[1] != q.shape[1])


class KVCache:
    """Keys and values of every position so far, per layer: ``(B, kv_heads, capacity, d)``
    each, allocated once for ``capacity`` positions (a contiguous cache: every sequence of the
    batch reserves the whole of it). ``attend`` is the model's ``attention=`` for a forward over
    the next tokens: it stores their K and V, layer after layer, and attends over all stored.
    Introduced in notebooks/18_serving_across_devices.ipynb."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kernel: Callable = cached_attention) -> None:
        shape = (n_layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_layers, self.kv_heads, self.capacity = n_layers, kv_heads, capacity
        self.kernel = kernel  # cached_attention's arguments and result: another may replace it
        self.length = 0   # positions stored in every layer
        self.layer = 0    # the layer the next attend() call belongs to

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' K and V (``(B, heads, t, d)``; one head of each group kept)
        for this layer, and return the new queries' attention over everything stored."""
        t, start, layer = q.shape[-2], self.length, self.layer
        if start + t > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions: {start} stored, "
                             f"{t} more do not fit")
        group = k.shape[1] // self.kv_heads  # a grouped model's heads of one group are equal
        self.k[layer, :, :, start:start + t] = k[:, ::group]
        self.v[layer, :, :, start:start + t] = v[:, ::group]
        self.layer = (layer + 1) % self.n_layers
        if self.layer == 0:  # the last layer has stored them: the positions are in
            self.length += t
        end = start + t
        return self.kernel(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], start)

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on (speculative decoding's rejected tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length}: the cache holds {self.length} positions")
        self.length, self.layer = length, 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated (the whole capacity, used or not)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes holding a stored position."""
        return self.nbytes * self.length // self.capacity


class Decoder:
    """A model and its KV cache: ``feed(idx)`` runs the next tokens ``(B, t)`` at the positions
    after those fed before and returns their logits ``(B, t, vocab)``. ``kv_heads`` caches one
    key and value head per group (a :func:`grouped` model's). ``model`` is any module whose
    forward takes ``(idx, positions=, attention=)`` and whose blocks hold ``n_heads`` heads:
    a :class:`transformer.GPT`, or one whose blocks are split by tensor parallelism (each rank
    then caches its own heads). Introduced in notebooks/18_serving_across_devices.ipynb."""

    def __init__(self, model: nn.Module, batch: int = 1, capacity: int | None = None,
                 kv_heads: int | None = None, dtype: torch.dtype | None = None,
                 kernel: Callable = cached_attention) -> None:
        cfg = model.cfg
        head_dim = cfg.d_model // cfg.n_heads
        heads = getattr(model.blocks[0], "heads", cfg.n_heads)  # a TP block: this rank's heads
        kv_heads = heads if kv_heads is None else kv_heads
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not split into {kv_heads} groups")
        self.model = model
        dtype = dtype or next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.cache = KVCache(cfg.n_layers, batch, kv_heads, head_dim, capacity or cfg.context,
                             dtype, device, kernel)

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.no_grad()
    def feed(self, idx: torch.Tensor) -> torch.Tensor:
        start = self.cache.length
        positions = torch.arange(start, start + idx.shape[-1], device=idx.device)
        logits, _ = self.model(idx, positions=positions, attention=self.cache.attend)
        return logits

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)


def pick(logits: torch.Tensor, temperature: float = 0.0,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` ``(B, vocab)``: the most likely one
    (``temperature`` 0, greedy), else one drawn from ``softmax(logits / temperature)``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, n_tokens: int, cache: bool = True,
             temperature: float = 0.0, seed: int = 0, kv_heads: int | None = None
             ) -> torch.Tensor:
    """``prompt`` ``(B, T0)`` followed by ``n_tokens`` generated tokens: with the KV cache
    (prefill, then one token a step), or without (``cache=False``: every step runs the whole
    prefix again, as notebook 14's ``sample`` does). Greedy by default.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    if prompt.shape[-1] + n_tokens > model.cfg.context:
        raise ValueError(f"{prompt.shape[-1]} prompt + {n_tokens} new tokens exceed the "
                         f"model's context {model.cfg.context}")
    gen = torch.Generator().manual_seed(seed)
    idx, new = prompt, prompt
    decoder = Decoder(model, prompt.shape[0], kv_heads=kv_heads) if cache else None
    for _ in range(n_tokens):
        logits = decoder.feed(new) if cache else model(idx)[0]
        new = pick(logits[:, -1], temperature, gen)[:, None]
        idx = torch.cat([idx, new], dim=1)
    return idx


@torch.no_grad()
def grouped(model: GPT, kv_heads: int) -> GPT:
    """A copy of ``model`` whose query heads share ``kv_heads`` key and value heads: each
    group's K and V projections replaced by their mean, as Ainslie et al. convert a multi-head
    checkpoint before training it a little more. (Its projection still computes every head's K
    and V, equal within a group; :class:`Decoder` with ``kv_heads`` caches one per group.)
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    heads, d = model.cfg.n_heads, model.cfg.d_model
    if heads % kv_heads:
        raise ValueError(f"{heads} heads do not split into {kv_heads} groups")
    shared = copy.deepcopy(model)
    group, head_dim = heads // kv_heads, d // heads
    for block in shared.blocks:
        for p in (block.attn.qkv.weight, block.attn.qkv.bias):
            for part in (1, 2):  # K, then V: rows d .. 2d and 2d .. 3d of [Q; K; V]
                rows = p[part * d:(part + 1) * d].view(kv_heads, group, head_dim, *p.shape[1:])
                rows.copy_(rows.mean(1, keepdim=True).expand_as(rows))
    return shared


# ---------------------------------------------------------------- prefill and decode, timed
def decode_intensity(params: int, batch: int, itemsize: int = 4, cache_bytes: int = 0) -> float:
    """FLOPs per byte read of one decode step of ``batch`` sequences: 2 FLOPs per parameter per
    token, against every parameter read once (``itemsize`` bytes each) and the ``cache_bytes``
    of keys and values the step reads (each sequence reads its own: that share never shrinks
    with the batch). Weights alone: ``2 batch / itemsize``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    return 2 * params * batch / (params * itemsize + cache_bytes)


@torch.no_grad()
def time_decode(model: GPT, batches: Sequence[int], context: int = 16, repeats: int = 5,
                device: str = "cpu", kernel: Callable = cached_attention) -> list[float]:
    """Seconds of one decode step (one new token for each of ``batch`` sequences, each with
    ``context`` cached positions) for each batch size: the median of ``repeats``. ``kernel``:
    the attention over the cache (:func:`cached_attention`, or :func:`sdpa_cached_attention`).
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    out = []
    for batch in batches:
        decoder = Decoder(model, batch, capacity=context + 1, kernel=kernel)
        decoder.feed(torch.zeros(batch, context, dtype=torch.long, device=device))
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)

        def step(decoder=decoder, token=token):
            decoder.truncate(context)
            decoder.feed(token)
        out.append(gpu.timed(step, repeats, device))
    return out


@torch.no_grad()
def time_prefill(model: GPT, lengths: Sequence[int], repeats: int = 3,
                 device: str = "cpu") -> list[float]:
    """Seconds to prefill one prompt of each length (all its tokens in one forward): the
    median of ``repeats``. Introduced in notebooks/18_serving_across_devices.ipynb."""
    out = []
    for length in lengths:
        prompt = torch.zeros(1, length, dtype=torch.long, device=device)
        out.append(gpu.timed(lambda p=prompt: Decoder(model, 1, capacity=p.shape[1]).feed(p),
                             repeats, device))
    return out


# 6.4 B parameters, 12.9 GB of bf16 weights: longer to read than its kernels take to launch
GPU_DECODE_CONFIG = GPTConfig(vocab_size=256, context=256, d_model=8192, n_heads=64, n_layers=8)


def decode_report(device: str = "cuda", small: bool = False,
                  batches: Sequence[int] = (1, 4, 16, 64, 256)) -> dict:
    """Decode tokens/s of a bf16 model on ``device`` for each batch, beside the roof that
    the memory bandwidth sets (every weight read once a step; the card's datasheet figure
    where it is listed, else the measured copy rate). ``small``: sizes for a CPU.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    cfg = GPTConfig(context=64, d_model=64, n_heads=4, n_layers=2) if small else GPU_DECODE_CONFIG
    with torch.device("meta"):  # allocated on the device and drawn there: seconds, not minutes
        model = GPT(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    params = model.num_parameters()
    seconds = time_decode(model, batches, context=16, repeats=5, device=device)
    spec = gpu.card() if torch.device(device).type == "cuda" else None
    bandwidth = spec.memory_bandwidth if spec else gpu.copy_rate(2**24 if small else 2**30,
                                                                 device=device)
    roof = bandwidth / (2 * params)  # steps per second when reading the weights is all
    return {"config": {"d_model": cfg.d_model, "n_layers": cfg.n_layers},
            "parameters": params, "batches": list(batches), "seconds": seconds,
            "tokens_per_s": [b / s for b, s in zip(batches, seconds, strict=True)],
            "roof_tokens_per_s": [b * roof for b in batches], "bandwidth": bandwidth}
