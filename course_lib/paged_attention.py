"""A paged KV cache and continuous batching: serving many requests of unknown lengths at once.

Introduced in notebooks/18_serving_across_devices.ipynb. A contiguous cache reserves, for each
request, room for the longest sequence it might reach: most of that room is never used, and
fewer requests fit. **PagedAttention** (Kwon et al. 2023, vLLM) stores keys and values in
fixed-size blocks from one pool, as an operating system pages memory: a request's *block table*
lists its blocks in order, position ``p`` lives in block ``table[p // block_size]`` at offset
``p % block_size``, a block is taken from the free list only when the previous one is full, and
all of them go back when the request finishes.

**Continuous batching** (Yu et al. 2022, Orca's iteration-level scheduling) decides the batch at
every step, not once per batch: a finished request leaves at once and a waiting one joins, its
prompt prefilled in the same step as the others' next tokens. The linear layers run on every
token of the step together; attention runs per request, over its own blocks::

    cache = PagedKVCache(model.cfg, num_blocks=32, block_size=16)
    served, log = serve(model, requests, cache)                   # continuous
    served, log = serve(model, requests, contiguous(model.cfg, 2), policy="static")

With ``block_size`` equal to the model's context, a paged cache is a contiguous one: one block a
request (:func:`contiguous`). Both policies compute every token the same way, so they return the
same tokens; they differ in when a request runs and how much cache it holds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from course_lib.transformer import GPTConfig


def blocks_needed(length: int, block_size: int) -> int:
    """Blocks that hold ``length`` positions: ``ceil(length / block_size)``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    return -(-length // block_size)


def slot_of(table: list[int], position: int, block_size: int) -> tuple[int, int]:
    """Where position ``position`` of a request lives: (block, offset in the block).
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    return table[position // block_size], position % block_size


def grow(table: list[int], free: list[int], length: int, n_new: int, block_size: int) -> None:
    """Take blocks from the end of ``free`` onto ``table`` until it holds ``length + n_new``
    positions (a request of ``length`` positions about to store ``n_new`` more). Takes nothing
    if they do not all fit (``MemoryError``).
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    more = blocks_needed(length + n_new, block_size) - len(table)
    if more > len(free):
        raise MemoryError(f"{more} more blocks needed, {len(free)} free")
    for _ in range(more):
        table.append(free.pop())


def release(table: list[int], free: list[int]) -> None:
    """A finished request's blocks back onto the free list; its table emptied.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    free.extend(reversed(table))
    table.clear()


class PagedKVCache:
    """One pool of ``num_blocks`` blocks of ``block_size`` positions per layer (keys and values
    ``(num_blocks, kv_heads, block_size, head_dim)``), the free list, and each request's block
    table and length. :meth:`attend` is the model's ``attention=`` for one step of a batch.
    Introduced in notebooks/18_serving_across_devices.ipynb."""

    def __init__(self, cfg: GPTConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32) -> None:
        head_dim = cfg.d_model // cfg.n_heads
        shape = (cfg.n_layers, num_blocks, cfg.n_heads, block_size, head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.n_layers, self.block_size, self.num_blocks = cfg.n_layers, block_size, num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def fits(self, request: int, n_new: int) -> bool:
        """Whether ``n_new`` more positions of ``request`` (new or not) find their blocks."""
        table = self.tables.get(request, [])
        need = blocks_needed(self.lengths.get(request, 0) + n_new, self.block_size) - len(table)
        return need <= len(self.free)

    def reserve(self, request: int, n_new: int) -> None:
        """Blocks for ``n_new`` more positions of ``request`` (a new request gets a table)."""
        table = self.tables.setdefault(request, [])
        self.lengths.setdefault(request, 0)
        grow(table, self.free, self.lengths[request], n_new, self.block_size)

    def release(self, request: int) -> None:
        """The request's blocks back to the free list; the request forgotten."""
        release(self.tables.pop(request), self.free)
        del self.lengths[request]

    def attend(self, requests: list[int], counts: list[int]):
        """The ``attention=`` of one step whose tokens are ``counts[i]`` new tokens of each
        ``requests[i]``, side by side in one sequence: the new keys and values are written to
        their blocks, and each request's queries attend over its own positions alone, all
        requests in one batched product (padded to the longest, the padding masked)."""
        starts = torch.tensor([self.lengths[r] for r in requests])
        t = torch.tensor(counts)
        ends = starts + t
        # every new token: its request's block table row, its position
        rows = torch.repeat_interleave(torch.arange(len(requests)), t)
        new_positions = torch.cat([torch.arange(s, e) for s, e in
                                   zip(starts.tolist(), ends.tolist(), strict=True)])
        longest = max(len(self.tables[r]) for r in requests)
        tables = torch.tensor([self.tables[r] + [0] * (longest - len(self.tables[r]))
                               for r in requests])  # (requests, blocks), padded with block 0
        write_block = tables[rows, new_positions // self.block_size]
        write_offset = new_positions % self.block_size
        # each request's positions 0 .. end - 1, padded to the longest: (requests, L)
        positions = torch.arange(int(ends.max()))
        read_block = tables[:, positions // self.block_size]
        read_offset = (positions % self.block_size).expand(len(requests), -1)
        # its new tokens' queries, padded to the most new tokens: (requests, T), index into the step
        slot = torch.arange(int(t.max()))
        first = torch.cumsum(t, 0) - t
        query = first[:, None] + torch.minimum(slot, t[:, None] - 1)  # padding repeats the last
        # query i of request r sits at position start + i and sees keys 0 .. start + i
        visible = positions[None, None, :] <= (starts[:, None] + torch.minimum(
            slot, t[:, None] - 1))[:, :, None]
        real = slot[None, :] < t[:, None]  # which padded queries are new tokens
        layer = 0

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            nonlocal layer
            # (1, heads, N, d) -> (N, heads, d): each new token into its block and offset
            self.k[layer, write_block, :, write_offset] = k[0].transpose(0, 1)
            self.v[layer, write_block, :, write_offset] = v[0].transpose(0, 1)
            # (requests, L, heads, d) -> (requests, heads, L, d)
            keys = self.k[layer, read_block, :, read_offset].transpose(1, 2)
            values = self.v[layer, read_block, :, read_offset].transpose(1, 2)
            queries = q[0][:, query].transpose(0, 1)  # (requests, heads, T, d)
            scores = queries @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
            out = torch.softmax(scores, dim=-1) @ values  # (requests, heads, T, d)
            layer += 1
            if layer == self.n_layers:  # every layer has stored them: the positions are in
                for request, n in zip(requests, counts, strict=True):
                    self.lengths[request] += n
            return out.transpose(0, 1)[:, real][None]  # back to (1, heads, N, d), in order
        return attention

    def slots(self) -> tuple[int, int]:
        """(positions held by a block, positions used): what is allocated and what is stored."""
        return (self.block_size * sum(len(t) for t in self.tables.values()),
                sum(self.lengths.values()))


def contiguous(cfg: GPTConfig, max_requests: int, dtype: torch.dtype = torch.float32
               ) -> PagedKVCache:
    """A contiguous cache for ``max_requests`` requests: one block of the model's whole context
    each, reserved at admission, whatever length the request will reach.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    return PagedKVCache(cfg, max_requests, block_size=cfg.context, dtype=dtype)


@dataclass
class Request:
    """A prompt (token ids), how many tokens to generate, and when it arrives (seconds after
    the server starts). Introduced in notebooks/18_serving_across_devices.ipynb."""

    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    tokens: list[int] = field(default_factory=list)  # generated so far
    admitted: float | None = None
    finished: float | None = None

    @property
    def latency(self) -> float:
        """Seconds from arrival to the last token."""
        return self.finished - self.arrival


POLICIES = ("continuous", "static")


@torch.no_grad()
def serve(model: nn.Module, requests: list[Request], cache: PagedKVCache,
          policy: str = "continuous", max_batch: int = 64) -> tuple[list[Request], list[dict]]:
    """Serve ``requests`` (greedy decoding) with ``cache``, batching ``"continuous"`` (every
    step admits what arrived and fits, and drops what finished) or ``"static"`` (a batch is
    admitted together when the previous one has finished). A running request that finds no
    free block is preempted, the newest first: its blocks freed, it waits again and recomputes
    its tokens when readmitted (vLLM's recompute). Returns copies of the requests, their tokens
    and times filled in, and a log of each step: its time, requests, tokens, requests preempted,
    allocated and used cache positions. Introduced in notebooks/18_serving_across_devices.ipynb."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {POLICIES}")
    for r in requests:
        if len(r.prompt) + r.max_new_tokens > model.cfg.context:
            raise ValueError(f"a request of {len(r.prompt)} + {r.max_new_tokens} tokens exceeds "
                             f"the model's context {model.cfg.context}")
    todo = sorted((Request(list(r.prompt), r.max_new_tokens, r.arrival) for r in requests),
                  key=lambda r: r.arrival)
    waiting, running, log, start = list(todo), [], [], time.perf_counter()
    while waiting or running:
        now = time.perf_counter() - start
        if policy == "continuous" or not running:
            while (waiting and waiting[0].arrival <= now and len(running) < max_batch
                   and cache.fits(id(waiting[0]), len(waiting[0].prompt + waiting[0].tokens) + 1)):
                r = waiting.pop(0)
                cache.reserve(id(r), len(r.prompt + r.tokens))  # its prompt's blocks, now
                r.admitted = now if r.admitted is None else r.admitted
                running.append(r)
        if not running:
            if waiting[0].arrival <= now:  # it arrived, and an empty cache cannot hold it
                raise MemoryError(f"a request of {len(waiting[0].prompt)} prompt tokens does "
                                  f"not fit in the whole cache ({cache.num_blocks} blocks of "
                                  f"{cache.block_size})")
            time.sleep(waiting[0].arrival - now)
            continue
        # each request's new tokens: its prompt (and what it generated before a preemption)
        # the first time, then its last token
        feed = {id(r): (r.tokens[-1:] if cache.lengths[id(r)] else r.prompt + r.tokens)
                for r in running if r.finished is None}
        preempted = 0
        for r in list(running):
            if id(r) not in feed:  # finished (static batching), or preempted just now
                continue
            while not cache.fits(id(r), len(feed[id(r)])):  # preempt the newest running
                victim = next(v for v in reversed(running) if id(v) in feed)
                if id(victim) in cache.tables:
                    cache.release(id(victim))
                running.remove(victim)
                waiting.insert(0, victim)
                preempted += 1
                feed.pop(id(victim))
                if victim is r:
                    break
            else:
                cache.reserve(id(r), len(feed[id(r)]))
        if not feed:  # every request preempted: admit again
            continue
        ids, counts = list(feed), [len(t) for t in feed.values()]
        flat = torch.tensor([t for tokens in feed.values() for t in tokens])[None]
        positions = torch.cat([torch.arange(cache.lengths[i], cache.lengths[i] + n)
                               for i, n in zip(ids, counts, strict=True)])
        logits, _ = model(flat, positions=positions, attention=cache.attend(ids, counts))
        ends = torch.tensor(counts).cumsum(0) - 1  # each request's last token in the step
        chosen = logits[0, ends].argmax(-1).tolist()
        allocated, used = cache.slots()
        now = time.perf_counter() - start
        for r, token in zip([r for r in running if id(r) in feed], chosen, strict=True):
            r.tokens.append(token)
            if len(r.tokens) == r.max_new_tokens:
                r.finished = now
                if policy == "continuous":
                    cache.release(id(r))
        log.append({"time": now, "requests": len(ids), "tokens": sum(counts),
                    "preempted": preempted, "allocated": allocated, "used": used})
        if policy == "continuous":
            running = [r for r in running if r.finished is None]
        elif all(r.finished is not None for r in running):  # the whole batch is done
            for r in running:
                cache.release(id(r))
            running = []
    return todo, log


def summary(served: list[Request], log: list[dict]) -> dict:
    """Throughput (generated tokens per second), mean and 90th-percentile latency, and the
    share of allocated cache positions holding no token, averaged over the steps.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    latencies = sorted(r.latency for r in served)
    tokens = sum(len(r.tokens) for r in served)
    makespan = max(r.finished for r in served) - min(r.arrival for r in served)
    waste = [1 - s["used"] / s["allocated"] for s in log if s["allocated"]]
    return {"tokens_per_s": tokens / makespan, "mean_latency": sum(latencies) / len(latencies),
            "p90_latency": latencies[int(0.9 * (len(latencies) - 1))],
            "wasted_cache": sum(waste) / len(waste), "steps": len(log)}
