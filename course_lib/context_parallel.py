"""Context parallelism: ring attention (Liu et al. 2023) with the online softmax, and the
zig-zag assignment that balances a causal mask's work.

Introduced in notebooks/14_transformers_and_long_sequences.ipynb. Each of N ranks holds some of
the sequence's positions (its queries, keys and values). Attention needs every key for every
query, so the key/value blocks travel around the ring (notebook 05's ring): at step s rank r
holds the block of rank ``r - s``, attends its queries to it, and merges the partial result
into its running one. The merge is exact (the *online softmax*): a partial result keeps, per
query, the log of its softmax denominator (``lse``), and two partials over disjoint keys combine
as::

    lse = log(exp(lse_a) + exp(lse_b));   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

The backward pass goes around the ring again: each block travels with the gradients of its keys
and values, which every rank adds to, and one last hop brings them home. With a causal mask, a
query ignores the keys after it: split contiguously, rank 0 attends to one block and rank N-1 to
N, and everyone waits for the last. The zig-zag assignment (rank r holds chunks r and 2N-1-r of
2N) gives every rank the same work: counted in pairs of chunks, 2N+1 each, against 4(r+1) for
contiguous rank r (a diagonal block is computed whole, its masked half too). The work is cut in
*tiles*, each rank's runs of consecutive positions no longer than the shortest run of any rank
(a zig-zag chunk; a contiguous rank's whole block), so the last zig-zag rank, whose two chunks
N-1 and N are adjacent, still skips the pair of its chunk N-1's queries and chunk N's keys.

Ulysses (:func:`ulysses_attention`) splits the other way: an all-to-all switches every rank from
T/N tokens of every head to every token of H/N heads. PyTorch's own context parallelism
(``torch.distributed.tensor.experimental.context_parallel``, head-tail balanced: the zig-zag)
dispatches the GPU attention kernels only; on CPU in torch 2.13 it raises NotImplementedError
(no sharding strategy for ``aten._scaled_dot_product_flash_attention_for_cpu``), so this module
is checked against one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from course_lib.collectives import all_to_all
from course_lib.comm import Comm, during, wait_all
from course_lib.runtime.timeline import cpu_seconds
from course_lib.sharding import shard_bounds
from course_lib.transformer import causal_attention
from course_lib.zero import DoesNotFit

TAG_KV, TAG_GRAD = 7100, 7101  # message tags of the forward blocks and the backward ones


# ---------------------------------------------------------------- which positions each rank holds
def contiguous_positions(length: int, world_size: int) -> list[torch.Tensor]:
    """Rank r holds the r-th contiguous slice of the sequence (sizes differ by at most one).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    return [torch.arange(*shard_bounds(length, r, world_size)) for r in range(world_size)]


def zigzag_positions(length: int, world_size: int) -> list[torch.Tensor]:
    """The sequence cut in 2N equal chunks; rank r holds chunks r and 2N-1-r: an early chunk
    (little causal work) with a late one (much), the same total on every rank.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    if length % (2 * world_size):
        raise ValueError(f"zig-zag needs a sequence length divisible by 2N = {2 * world_size}, "
                         f"got {length}")
    c = length // (2 * world_size)
    return [torch.cat([torch.arange(r * c, (r + 1) * c),
                       torch.arange((2 * world_size - 1 - r) * c, (2 * world_size - r) * c)])
            for r in range(world_size)]


def causal_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """How many (query, key) pairs a causal mask keeps: the work of one block.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    return int((k_pos[None, :] <= q_pos[:, None]).sum())


# ---------------------------------------------------------------- one block, and the merge
def runs(pos: torch.Tensor, tile: int | None = None) -> list[slice]:
    """The runs of consecutive positions in ``pos`` (one for a contiguous chunk, two for a
    zig-zag rank's), as slices of it, each cut into pieces of at most ``tile`` positions.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    cuts = [0, *(torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist(), len(pos)]
    tile = tile or max(len(pos), 1)
    return [slice(i, min(i + tile, b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)
            for i in range(a, b, tile)]


def tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, tile: int | None = None
          ) -> list[tuple[slice, slice]]:
    """The (queries, keys) pairs of :func:`runs` that causal attention computes: every pair
    but those whose keys all come after their queries.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    return [(qs, ks) for qs in runs(q_pos, tile) for ks in runs(k_pos, tile)
            if k_pos[ks.start] <= q_pos[qs.stop - 1]]


def shortest_run(positions: list[torch.Tensor]) -> int:
    """The tile of ring attention: the shortest run of consecutive positions any rank holds.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    return min(s.stop - s.start for p in positions for s in runs(p))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries at ``q_pos`` to the keys at ``k_pos`` alone, every pair
    computed: ``(out, lse)``, ``out`` normalised over these keys, ``lse`` the log of the softmax
    denominator per query (``-inf`` for a query that may see none of them, whose ``out`` is 0).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(score - lse): a row with no key left has lse = -inf and would give nan; it gets 0
    p = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(scores.dtype).min))
    return p @ v, lse


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, tile: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dense_attention`, run by :func:`tiles`, skipping each pair whose keys all come
    after its queries: a zig-zag rank's early chunk is not computed against a late block.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = q.new_full(q.shape[:-1], float("-inf"))
    for qs, ks in tiles(q_pos, k_pos, tile):
        o, s = dense_attention(q[..., qs, :], k[..., ks, :], v[..., ks, :], q_pos[qs], k_pos[ks])
        out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, s)
    return out, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over two disjoint sets of keys from each one's ``(out, lse)``: weight each
    part by its share of the total denominator. Exact: the same as one softmax over both.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.clamp_min(torch.finfo(lse.dtype).min)  # both parts empty: lse = -inf, weights 0
    wa, wb = torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


# ---------------------------------------------------------------- around the ring
def count_work(stats: dict, pairs: list, prefix: str = "") -> None:
    """Count a block's work into ``stats``: ``blocks`` (one, if any tile is computed) and
    ``scores`` (query-key scores of the tiles ``pairs``), each under ``prefix`` (``backward_``).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    stats[prefix + "blocks"] = stats.get(prefix + "blocks", 0) + bool(pairs)
    stats[prefix + "scores"] = stats.get(prefix + "scores", 0) + sum(
        (q.stop - q.start) * (k.stop - k.start) for q, k in pairs)


def pass_right(comm: Comm, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
    """Post the receive from the left and the send to the right (receive first, as ``sendrecv``
    does: a ring of them cannot deadlock); wait on both with ``wait_all``.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    left, right = (comm.rank - 1) % comm.world_size, (comm.rank + 1) % comm.world_size
    return [comm.irecv(recv, left, tag=tag), comm.isend(send, right, tag=tag)]


class RingAttention(torch.autograd.Function):
    """Causal attention over the whole sequence, each rank holding the queries, keys and values
    of its positions (``positions[r]`` for rank r, every rank knowing all of them). Forward: the
    key/value blocks go around the ring, each next block's transfer overlapping the attention to
    the current one. Backward: around again with the blocks' key/value gradients.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm,
                positions: list[torch.Tensor], stats: dict, merge_blocks: Callable,
                overlap: bool) -> torch.Tensor:
        N, r, tile = comm.world_size, comm.rank, shortest_run(positions)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        block = torch.stack([k, v])  # one message per step: this block's keys and values
        for step in range(N):
            owner = (r - step) % N  # whose block this rank holds at this step
            pending = []
            if step < N - 1 and overlap:  # the next block travels while this one is computed
                incoming = torch.empty_like(block)
                with during(f"ring attention, forward step {step}"):
                    pending = pass_right(comm, block, incoming, TAG_KV)
            pairs = tiles(positions[r], positions[owner], tile)
            with cpu_seconds(stats, "busy_s"):
                if pairs:  # a block wholly in the future: skip
                    o, s = block_attention(q, block[0], block[1], positions[r], positions[owner],
                                           tile)
                    out, lse = merge_blocks(out, lse, o, s)
            count_work(stats, pairs)
            with during(f"ring attention, forward step {step}"):
                if step < N - 1 and not overlap:  # the naive ring: compute, then pass it on
                    incoming = torch.empty_like(block)
                    pending = pass_right(comm, block, incoming, TAG_KV)
                wait_all(pending)
            if pending:
                block = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.positions, ctx.stats = comm, positions, stats
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        comm, positions = ctx.comm, ctx.positions
        N, r, scale = comm.world_size, comm.rank, 1 / math.sqrt(q.shape[-1])
        tile = shortest_run(positions)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)  # D_i = sum_j P_ij dP_ij, from the output
        dq = torch.zeros_like(q)
        # the block and the gradients of its keys and values, which travel with it
        block = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        safe_lse = lse.clamp_min(torch.finfo(lse.dtype).min).unsqueeze(-1)
        for step in range(N):
            owner = (r - step) % N
            q_pos, k_pos = positions[r], positions[owner]
            pairs = tiles(q_pos, k_pos, tile)
            count_work(ctx.stats, pairs, "backward_")
            for qs, ks in pairs:  # the forward's tiles, recomputed
                qb, do = q[..., qs, :], dout[..., qs, :]
                kb, vb = block[0][..., ks, :], block[1][..., ks, :]
                future = k_pos[ks][None, :] > q_pos[qs][:, None]
                scores = (qb @ kb.transpose(-2, -1) * scale).masked_fill(future, float("-inf"))
                p = torch.exp(scores - safe_lse[..., qs, :])        # the final P
                block[3][..., ks, :] += p.transpose(-2, -1) @ do    # dV += P^T dO
                ds = p * (do @ vb.transpose(-2, -1) - delta[..., qs, :])  # dS = P (dP - D)
                dq[..., qs, :] += ds @ kb * scale                   # dQ += dS K / sqrt(d)
                block[2][..., ks, :] += ds.transpose(-2, -1) @ qb * scale  # dK += dS^T Q
            if step < N - 1:  # pass the block on (after its gradients were added here)
                incoming = torch.empty_like(block)
                with during(f"ring attention, backward step {step}"):
                    wait_all(pass_right(comm, block, incoming, TAG_GRAD))
                block = incoming
        # now rank r holds the block of rank r + 1: one more hop takes every gradient home
        # (none when N = 1: the block never left)
        home = block[2:]
        if N > 1:
            home = torch.empty_like(block[2:])
            with during(f"ring attention, backward step {N}"):
                wait_all(pass_right(comm, block[2:].contiguous(), home, TAG_GRAD))
        return dq, home[0], home[1], None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm,
                   positions: list[torch.Tensor], stats: dict | None = None,
                   merge_blocks: Callable = merge, overlap: bool = True) -> torch.Tensor:
    """This rank's causal attention output for its queries, over every rank's keys (see
    :class:`RingAttention`); q, k, v: ``(..., T_r, d)`` with ``T_r = len(positions[rank])``.
    ``merge_blocks`` merges each block's partial result into the running one (lab 14 passes
    its own); ``overlap=False`` sends each block on only after computing with it (the naive
    ring, to measure what the overlap saves). ``stats`` (a dict) collects this rank's ``busy_s``
    (CPU seconds of the forward's block computations: torch computes on the calling thread
    here), ``blocks`` (blocks attended) and ``scores`` (query-key scores computed, masked ones
    inside a tile included; ``backward_blocks``, ``backward_scores`` for the backward).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    if len(positions) != comm.world_size:
        raise ValueError(f"positions names {len(positions)} ranks; the comm has "
                         f"{comm.world_size}")
    mine = len(positions[comm.rank])
    if not (q.shape[-2] == k.shape[-2] == v.shape[-2] == mine):
        raise ValueError(f"rank {comm.rank}: q, k, v hold {q.shape[-2]}, {k.shape[-2]}, "
                         f"{v.shape[-2]} positions; positions[{comm.rank}] has {mine}")
    if len({len(p) for p in positions}) != 1:
        raise ValueError(f"every rank must hold as many positions (the blocks travel in one "
                         f"buffer), got {[len(p) for p in positions]}")
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), comm, positions,
                               {} if stats is None else stats, merge_blocks, overlap)


# ---------------------------------------------------------------- Ulysses: switch to heads
def sequence_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``(B, H, T/N, d)``, this rank's tokens of every head, to ``(B, H/N, T, d)``, every token of
    this rank's heads: one all-to-all (block q of what rank r sends: its tokens of q's heads).
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    B, H, t, d = x.shape
    n = comm.world_size
    send = x.reshape(B, n, H // n, t, d).movedim(1, 0).contiguous()  # block q: q's heads
    recv = torch.empty_like(send)                                    # block q: q's tokens
    all_to_all(send.view(n, -1), recv.view(n, -1), comm)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * t, d)  # tokens in rank order


def heads_to_sequence(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`: ``(B, H/N, T, d)`` back to ``(B, H, T/N, d)``.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    B, h, T, d = y.shape
    n = comm.world_size
    send = y.reshape(B, h, n, T // n, d).permute(2, 0, 1, 3, 4).contiguous()  # block q: q's tokens
    recv = torch.empty_like(send)                                             # block q: q's heads
    all_to_all(send.view(n, -1), recv.view(n, -1), comm)
    return recv.movedim(0, 1).reshape(B, n * h, T // n, d)


class Switch(torch.autograd.Function):
    """A change of layout across the ranks, ``there(x, comm)``, whose gradient goes back through
    the inverse change, ``back(grad, comm)``: Ulysses' two all-to-alls.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, there: Callable, back: Callable
                ) -> torch.Tensor:
        ctx.comm, ctx.back = comm, back
        return there(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.back(grad.contiguous(), ctx.comm), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm,
                      attention: Callable = causal_attention) -> torch.Tensor:
    """DeepSpeed-Ulysses (Jacobs et al. 2023): q, k, v hold this rank's contiguous T/N tokens of
    every head; one all-to-all gives each rank every token of H/N heads, attention runs there
    whole (no merging: a head's softmax is all on one rank), and a second all-to-all returns
    the output to the tokens' ranks. The same bytes whatever N, (N-1)/N of the tensors; needs
    the heads divisible by N. ``attention`` computes the whole heads (``causal_flash``: no
    T x T tensor kept). Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    n = comm.world_size
    if q.shape[1] % n:
        raise ValueError(f"Ulysses splits the heads: {q.shape[1]} heads over {n} ranks")
    qkv = torch.cat([q, k, v])  # one all-to-all for the three: (3B, H, T/N, d)
    qh, kh, vh = Switch.apply(qkv.contiguous(), comm, sequence_to_heads,
                              heads_to_sequence).chunk(3)
    return Switch.apply(attention(qh, kh, vh).contiguous(), comm, heads_to_sequence,
                        sequence_to_heads)


def check_budget(kept_bytes: int, budget: int, who: str) -> None:
    """Raise :class:`zero.DoesNotFit` when ``who`` keeps more activation bytes for backward than
    its ``budget``: checked on the first forward, before any step.
    Introduced in notebooks/14_transformers_and_long_sequences.ipynb."""
    if kept_bytes > budget:
        raise DoesNotFit(f"{who} keeps {kept_bytes / 2**20:.1f} MiB of activations for "
                         f"backward, over the budget of {budget / 2**20:.1f} MiB")
