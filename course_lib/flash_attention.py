"""FlashAttention: exact attention one tile at a time, the T x T matrix never stored.

Introduced in notebooks/14_transformers_and_long_sequences.ipynb. Written-out attention makes
the scores ``S = Q K^T / sqrt(d)`` and the probabilities ``P = softmax(S)`` for the whole
sequence and keeps ``P`` for backward: T^2 numbers per head. FlashAttention (Dao et al. 2022;
the forward's loops, queries outside, are FlashAttention-2's, Dao 2023) takes a block of queries
at a time and walks over the blocks of keys, keeping per query only a running maximum ``m``, a
running sum ``denom`` of exponentials and an unnormalised output ``acc``::

    m_new = max(m, rowmax(S_ij))
    denom = exp(m - m_new) * denom + rowsum(exp(S_ij - m_new))   # the old sum, rescaled
    acc   = exp(m - m_new) * acc + exp(S_ij - m_new) @ V_j
    out_i = acc / denom,  lse_i = m + log(denom)                 # after the last block

It saves Q, K, V, the output and ``lse`` (the log of each query's softmax denominator): O(T)
numbers. Backward recomputes each tile's probabilities from ``lse``, ``P_ij = exp(S_ij -
lse_i)``, with ``D_i = rowsum(dO_i * O_i)``::

    dV_j += P_ij^T dO_i        dS_ij = P_ij * (dO_i V_j^T - D_i)
    dQ_i += dS_ij K_j / sqrt(d)     dK_j += dS_ij^T Q_i / sqrt(d)

On a GPU each tile lives in the chip's fast on-chip memory; here the tiles are torch calls in a
Python loop, so a small tile costs interpreter time rather than saving memory traffic. The same
forward as a Triton kernel, :func:`triton_flash_forward`, is what runs on a GPU.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

BLOCK = 64  # queries and keys per tile


def _masked_scores(q: torch.Tensor, k: torch.Tensor, i: int, j: int, causal: bool,
                   scale: float) -> torch.Tensor:
    """The tile's scores, those of keys after their query set to -inf (query position
    ``i + a`` sees keys up to ``i + a``, as ``is_causal=True`` of torch's attention)."""
    s = q @ k.transpose(-2, -1) * scale
    if causal and j + k.shape[-2] - 1 > i:  # the tile reaches past its first query
        q_pos = torch.arange(i, i + q.shape[-2], device=q.device)
        k_pos = torch.arange(j, j + k.shape[-2], device=q.device)
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return s


def _key_blocks(i: int, rows: int, keys: int, causal: bool, block: int) -> range:
    """The starts of the key blocks a block of ``rows`` queries from ``i`` attends to: causal
    attention skips the blocks wholly after its last query."""
    return range(0, min(keys, i + rows) if causal else keys, block)


class FlashAttention(torch.autograd.Function):
    """``(out, lse)`` of attention over q, k, v ``(..., T, d)``, tile by tile (see the module's
    docstring); ``lse`` has no gradient. Introduced in
    notebooks/14_transformers_and_long_sequences.ipynb."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                block: int) -> tuple[torch.Tensor, torch.Tensor]:
        T, S, scale = q.shape[-2], k.shape[-2], 1 / math.sqrt(q.shape[-1])
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1])
        for i in range(0, T, block):
            qi = q[..., i:i + block, :]
            m = q.new_full(qi.shape[:-1], float("-inf"))  # running max of each query's scores
            denom = q.new_zeros(qi.shape[:-1])            # running sum of exp(score - m)
            acc = q.new_zeros(*qi.shape[:-1], v.shape[-1])  # running sum of exp(score - m) v
            for j in _key_blocks(i, qi.shape[-2], S, causal, block):
                s = _masked_scores(qi, k[..., j:j + block, :], i, j, causal, scale)
                m_new = torch.maximum(m, s.amax(-1))
                p = torch.exp(s - m_new.unsqueeze(-1))
                rescale = torch.exp(m - m_new)  # what the old max's terms are worth now
                denom = rescale * denom + p.sum(-1)
                acc = rescale.unsqueeze(-1) * acc + p @ v[..., j:j + block, :]
                m = m_new
            out[..., i:i + block, :] = acc / denom.unsqueeze(-1)
            lse[..., i:i + block] = m + torch.log(denom)
        ctx.save_for_backward(q, k, v, out, lse)  # O(T): no T x T tensor
        ctx.causal, ctx.block = causal, block
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        causal, block = ctx.causal, ctx.block
        T, S, scale = q.shape[-2], k.shape[-2], 1 / math.sqrt(q.shape[-1])
        delta = (dout * out).sum(-1)  # D_i = rowsum(dO_i * O_i) = rowsum(P_ij * dP_ij) over j
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i in range(0, T, block):
            qi, doi = q[..., i:i + block, :], dout[..., i:i + block, :]
            for j in _key_blocks(i, qi.shape[-2], S, causal, block):
                kj, vj = k[..., j:j + block, :], v[..., j:j + block, :]
                s = _masked_scores(qi, kj, i, j, causal, scale)
                p = torch.exp(s - lse[..., i:i + block].unsqueeze(-1))  # the tile's P again
                dv[..., j:j + block, :] += p.transpose(-2, -1) @ doi
                ds = p * (doi @ vj.transpose(-2, -1) - delta[..., i:i + block].unsqueeze(-1))
                dq[..., i:i + block, :] += ds @ kj * scale
                dk[..., j:j + block, :] += ds.transpose(-2, -1) @ qi * scale
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: attention of q to k, v ``(..., T, d)`` computed in tiles of ``block``
    queries by ``block`` keys; equal to ``F.scaled_dot_product_attention(q, k, v,
    is_causal=causal)``, with the log of each query's softmax denominator.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k "
                         "need the same head size, k and v the same length")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    return FlashAttention.apply(q, k, v, causal, block)


def causal_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal FlashAttention's output alone: a drop-in for ``transformer.causal_attention``
    (the model's ``attention=``). Introduced in
    notebooks/14_transformers_and_long_sequences.ipynb."""
    return flash_attention(q, k, v, causal=True)[0]


# ---------------------------------------------------------------- the same forward as a kernel
@functools.cache
def _triton_kernel() -> Any:
    """The causal forward as a Triton kernel: one program per block of queries of one head,
    its loop over the key blocks the forward above runs in Python. Built on first use (Triton
    is optional: ``pip install -e '.[triton]'``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def forward(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, T, scale,
                D: tl.constexpr, BLOCK: tl.constexpr):
        start, head = tl.program_id(0) * BLOCK, tl.program_id(1)
        rows, cols = start + tl.arange(0, BLOCK), tl.arange(0, D)
        base = head * T * D  # this head's (T, D) block of the (heads, T, D) tensors
        q = tl.load(q_ptr + base + rows[:, None] * D + cols[None, :], mask=rows[:, None] < T,
                    other=0.0)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, D], tl.float32)
        for j in range(0, tl.minimum(T, start + BLOCK), BLOCK):  # causal: up to the last query
            keys = j + tl.arange(0, BLOCK)
            k = tl.load(k_ptr + base + keys[:, None] * D + cols[None, :],
                        mask=keys[:, None] < T, other=0.0)
            v = tl.load(v_ptr + base + keys[:, None] * D + cols[None, :],
                        mask=keys[:, None] < T, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # fp32, not tf32
            s = tl.where((keys[None, :] <= rows[:, None]) & (keys[None, :] < T), s,
                         float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            rescale = tl.exp(m - m_new)
            denom = rescale * denom + tl.sum(p, 1)
            acc = rescale[:, None] * acc + tl.dot(p, v, input_precision="ieee")
            m = m_new
        tl.store(out_ptr + base + rows[:, None] * D + cols[None, :], acc / denom[:, None],
                 mask=rows[:, None] < T)
        tl.store(lse_ptr + head * T + rows, m + tl.log(denom), mask=rows < T)

    return forward


def triton_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal FlashAttention's forward ``(out, lse)`` as a Triton kernel (q, k, v: ``(..., T,
    d)`` float32, d a power of two >= 16, ``block`` one too): on a GPU, a kernel; on CPU
    tensors, Triton's interpreter (``TRITON_INTERPRET=1``), slowly. Forward only. Introduced in
    notebooks/14_transformers_and_long_sequences.ipynb."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("CPU tensors run in Triton's interpreter, which Triton sets up as it "
                         "is imported: start Python with TRITON_INTERPRET=1")
    if q.dtype != torch.float32 or not (q.shape == k.shape == v.shape):
        raise ValueError(f"float32 q, k, v of one shape, got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, d = q.shape[-2:]
    if d < 16 or d & (d - 1) or block < 16 or block & (block - 1):
        raise ValueError(f"head size {d} and block {block}: powers of two, at least 16")
    kernel = _triton_kernel()
    heads = q.numel() // (T * d)
    flat = [t.reshape(heads, T, d).contiguous() for t in (q, k, v)]
    out = torch.empty_like(flat[0])
    lse = q.new_empty(heads, T)
    kernel[(-(-T // block), heads)](*flat, out, lse, T, 1 / math.sqrt(d), D=d, BLOCK=block)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])
