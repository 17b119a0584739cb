"""Ring attention, tensor and sequence parallelism on a cluster's ranks against one process: what
tests, the demo and notebook 14 run on every rank (real Gloo messages, float64)."""

from __future__ import annotations

import copy
import functools
import time

import numpy as np
import torch

from course_lib import collectives
from course_lib import context_parallel as cp
from course_lib import sequence_parallel as sp
from course_lib import transformer as tf
from course_lib.comm import get_comm
from course_lib.flash_attention import causal_flash
from course_lib.runtime import netem
from course_lib.tensor_parallel import TensorParallel


def ring_attention_error_on_rank(length: int = 16, seed: int = 0, layout: str = "zigzag",
                                 timeout: float = 20.0, batch: int = 2, heads: int = 3,
                                 dim: int = 8) -> dict:
    """Random q, k, v (the same on every rank, from ``seed``), this rank's positions of the
    ``layout``; ring attention forward and backward against :func:`transformer.causal_attention`
    on the whole sequence. Returns this rank's largest error and its busy seconds."""
    comm = get_comm("torch", timeout=timeout)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, dtype=torch.float64,
                           generator=gen).requires_grad_() for _ in range(3))
    pos = (cp.zigzag_positions if layout == "zigzag" else cp.contiguous_positions)(
        length, comm.world_size)
    p = pos[comm.rank]
    mine = [t.detach()[..., p, :].clone().requires_grad_() for t in (q, k, v)]
    stats: dict = {}
    out = cp.ring_attention(*mine, comm, pos, stats)
    out.sum().backward()
    ref = tf.causal_attention(q, k, v)
    ref.sum().backward()
    pairs = [(out, ref[..., p, :]), (mine[0].grad, q.grad[..., p, :]),
             (mine[1].grad, k.grad[..., p, :]), (mine[2].grad, v.grad[..., p, :])]
    return dict(error=max(float((a - b).abs().max()) for a, b in pairs), **stats)


def transformer_on_rank(length: int = 32, seed: int = 0, layout: str = "zigzag",
                        timeout: float = 20.0, **config) -> dict:
    """The transformer (float64, ``GPTConfig(**config)``) on this rank's positions of one batch
    of two windows, ring attention inside; returns this rank's loss sum and its parameters'
    gradients (flat): summed over the ranks they must equal :func:`transformer_reference`."""
    comm = get_comm("torch", timeout=timeout)
    model, x, y = _model_and_batch(length, seed, config)
    pos = (cp.zigzag_positions if layout == "zigzag" else cp.contiguous_positions)(
        length, comm.world_size)
    p = pos[comm.rank]
    attention = functools.partial(cp.ring_attention, comm=comm, positions=pos)
    _, loss_sum = model(x[:, p], y[:, p], positions=p, attention=attention)
    loss_sum.backward()
    return dict(loss_sum=loss_sum.item(), grads=_flat_grads(model))


def transformer_reference(length: int = 32, seed: int = 0, **config) -> dict:
    """The same model and batch as :func:`transformer_on_rank`, in one process."""
    model, x, y = _model_and_batch(length, seed, config)
    _, loss_sum = model(x, y)
    loss_sum.backward()
    return dict(loss_sum=loss_sum.item(), grads=_flat_grads(model))


def _model_and_batch(length, seed, config):
    model = tf.GPT(tf.GPTConfig(**{"context": length, **config})).double()
    data = tf.encode(tf.load_text()[:20_000])
    x, y = tf.get_batch(data, 2, length, np.random.default_rng(seed))
    return model, x, y


def _flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()


def block_split_on_rank(split: str, batch: int = 2, length: int = 64, d_model: int = 32,
                        heads: int = 4, seed: int = 0, timeout: float = 20.0,
                        dtype: torch.dtype = torch.float64, flash: bool = False) -> dict:
    """A transformer block split over this cluster's ranks (``split``: one of
    :data:`sequence_parallel.SPLITS`) against the same block in one process: this rank's
    largest error (output, input gradient, its part of every parameter gradient), the
    collectives of tensor parallelism it ran and the activation bytes it kept. Ring attention
    holds the zig-zag's positions, TP + SP and Ulysses contiguous ones, TP every token.
    ``flash``: TP, TP + SP and Ulysses compute their heads with FlashAttention."""
    comm = get_comm("torch", timeout=timeout)
    gen = torch.Generator().manual_seed(seed)
    block = tf.Block(tf.GPTConfig(d_model=d_model, n_heads=heads)).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, dtype=p.dtype, generator=gen))
    x = torch.randn(batch, length, d_model, dtype=dtype, generator=gen, requires_grad=True)
    dout = torch.randn(batch, length, d_model, dtype=dtype, generator=gen)
    out = block(x)
    out.backward(dout)
    N, r = comm.world_size, comm.rank
    positions = (cp.zigzag_positions if split == "ring" else cp.contiguous_positions)(length, N)
    tokens = torch.arange(length) if split == "tp" else positions[r]
    mine = x.detach()[:, tokens].clone().requires_grad_()
    tp = TensorParallel(comm)
    core = causal_flash if flash else tf.causal_attention  # on a rank's whole heads
    if split in ("tp", "tp+sp"):
        part = sp.ParallelBlock(block, tp, split == "tp+sp")
        run = functools.partial(part, attention=core)
    else:  # every rank holds the whole block; attention crosses the ranks
        part = copy.deepcopy(block)
        part.zero_grad()
        attention = (functools.partial(cp.ring_attention, comm=comm, positions=positions)
                     if split == "ring" else
                     functools.partial(cp.ulysses_attention, comm=comm, attention=core))
        run = functools.partial(part, attention=attention)
    outputs: list = []
    kept = tf.activation_bytes_of(lambda: outputs.append(run(mine)), part)
    outputs[0].backward(dout[:, tokens])
    errors = [(outputs[0] - out[:, tokens]).abs().max(),
              (mine.grad - x.grad[:, tokens]).abs().max()]
    if split in ("tp", "tp+sp"):
        sp.allreduce_replicated_grads([part])
        params = dict(part.named_parameters())
        errors += [(params[sp.SHARD_NAMES[n]].grad - sp.shard_of(part, n, p.grad)).abs().max()
                   for n, p in block.named_parameters()]
    else:  # each rank's gradients cover its tokens: summed, the whole sequence's
        for mine_p, p in zip(part.parameters(), block.parameters(), strict=True):
            collectives.allreduce(mine_p.grad, comm, check=False)
            errors.append((mine_p.grad - p.grad).abs().max())
    return dict(error=float(max(errors)), counts=dict(tp.counts), kept=kept,
                one_process=tf.activation_bytes_of(lambda: block(x), block))


def all_to_all_against_torch_on_rank(seed: int = 0, timeout: float = 20.0) -> dict:
    """The course's all-to-all against ``dist.all_to_all_single`` (equal and uneven blocks,
    float64, over Gloo), and Ulysses attention on this cluster against one process."""
    import torch.distributed as dist  # the engines have it loaded already
    comm = get_comm("torch", timeout=timeout)
    n, r = comm.world_size, comm.rank
    counts = [[(q + s) % 3 + 1 for q in range(n)] for s in range(n)]  # counts[s][q]: s -> q
    send = torch.arange(sum(counts[r]), dtype=torch.float64) + 100 * r
    recv_counts = [counts[s][r] for s in range(n)]
    mine = collectives.all_to_all(send.reshape(-1, 1), torch.empty(sum(recv_counts), 1,
                                  dtype=torch.float64), comm, counts[r], recv_counts)
    theirs = torch.empty(sum(recv_counts), dtype=torch.float64)
    dist.all_to_all_single(theirs, send, recv_counts, counts[r])
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2 * n, 8 * n, 4, dtype=torch.float64, generator=gen)
               for _ in range(3))
    t = slice(r * 8, (r + 1) * 8)
    out = cp.ulysses_attention(q[:, :, t], k[:, :, t], v[:, :, t], comm)
    error = float((out - tf.causal_attention(q, k, v)[:, :, t]).abs().max())
    return dict(equal=bool(torch.equal(mine.reshape(-1), theirs)), ulysses_error=error)


def long_sequence_training_on_rank(length: int = 1024, budget: int = 12 * 2**20, steps: int = 3,
                                   seed: int = 0, timeout: float = 60.0) -> dict:
    """The transformer (float32) trained on windows of ``length`` tokens split over this
    cluster's ranks (zig-zag, ring attention), each rank allowed ``budget`` bytes of
    activations: the forward's kept bytes are measured first and a rank over budget raises
    :class:`zero.DoesNotFit` (:func:`context_parallel.check_budget`) before any step. Returns
    this rank's kept bytes and the losses (nats per token, whole sequence) of the steps."""
    comm = get_comm("torch", timeout=timeout)
    N, r = comm.world_size, comm.rank
    model = tf.GPT(tf.GPTConfig(context=length), seed=seed)
    data = tf.encode(tf.load_text())
    pos = cp.zigzag_positions(length, N) if N > 1 else [torch.arange(length)]
    p = pos[r]
    attention = (functools.partial(cp.ring_attention, comm=comm, positions=pos) if N > 1
                 else tf.causal_attention)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng, losses, kept = np.random.default_rng(seed), [], None
    for _ in range(steps):
        x, y = tf.get_batch(data, 1, length, rng)
        outputs: list = []

        def forward(x=x, y=y, outputs=outputs):
            outputs.append(model(x[:, p], y[:, p], positions=p, attention=attention))

        measured = tf.activation_bytes_of(forward, model)
        if kept is None:
            kept = measured
            cp.check_budget(kept, budget, f"rank {r} of {N}, {length} tokens split")
        _, loss_sum = outputs[0]
        opt.zero_grad()
        (loss_sum / length).backward()  # this rank's share of the mean over the whole sequence
        total = loss_sum.detach().reshape(1).clone()
        if N > 1:
            for param in model.parameters():  # the gradients of the whole sequence: a sum
                collectives.allreduce(param.grad, comm, check=False)
            collectives.allreduce(total, comm, check=False)
        opt.step()
        losses.append(float(total) / length)
    return dict(kept=kept, losses=losses)


def time_attention_on_rank(method: str, length: int, layout: str = "zigzag", repeats: int = 3,
                           batch: int = 1, heads: int = 4, dim: int = 32, overlap: bool = True,
                           timeout: float = 60.0) -> dict:
    """Seconds of one forward of ``method`` on this rank's part of a ``length``-token sequence
    (float32, the process's emulated link if any), median of ``repeats`` started together; the
    CPU seconds of this process during it (``cpu_s``, every thread: computing and copying
    messages, not waiting) and its attention's alone (ring: ``busy_s``). "ring": its tokens,
    ring attention (``overlap=False``: the naive ring); "ulysses": its tokens, two
    all-to-alls; "tp": every token of its H/N heads, then the allreduce that tensor
    parallelism's output projection runs (of the attention's output)."""
    comm = get_comm("torch", timeout=timeout)
    n, r = comm.world_size, comm.rank
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=gen) for _ in range(3))
    if method == "ring":
        pos = (cp.zigzag_positions if layout == "zigzag" else cp.contiguous_positions)(length, n)
    else:
        pos = cp.contiguous_positions(length, n)
    if method == "tp":  # this rank's heads, every token
        h = heads // n
        mine = [t[:, r * h:(r + 1) * h].contiguous() for t in (q, k, v)]
    else:
        mine = [t[..., pos[r], :].contiguous() for t in (q, k, v)]
    times, cpu, busy = [], [], []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first one warms up
            stats: dict = {}
            start = netem.start_clock(comm)
            cpu_start = time.process_time()
            if method == "ring":
                cp.ring_attention(*mine, comm, pos, stats, overlap=overlap)
            elif method == "ulysses":
                cp.ulysses_attention(*mine, comm)
            else:  # g: the heads' partial outputs summed (as if projected: same bytes)
                out = tf.causal_attention(*mine).transpose(1, 2).reshape(batch, length, -1)
                collectives.allreduce(torch.cat([out] * n, dim=-1).contiguous(), comm,
                                      check=False)
            times.append(time.monotonic() - start)
            cpu.append(time.process_time() - cpu_start)
            busy.append(stats.get("busy_s", 0.0))
    return dict(seconds=float(np.median(times[1:])), cpu_s=float(np.median(cpu[1:])),
                busy_s=float(np.median(busy[1:])))


def time_ring_overlap_on_rank(length: int, link: dict, repeats: int = 3, heads: int = 4,
                              dim: int = 32, timeout: float = 60.0) -> dict:
    """Ring attention's forward on ``link`` overlapped and naive, and with no link (the
    computation alone), one after the other within each of ``repeats`` rounds, so that what
    else the machine runs slows the three alike; each one's median seconds and CPU seconds."""
    comms = {"overlap": get_comm("torch", timeout=timeout, link=link),
             "serial": get_comm("torch", timeout=timeout, link=link),
             "alone": get_comm("torch", timeout=timeout)}  # the process's link: none here
    n, r = comms["alone"].world_size, comms["alone"].rank
    gen = torch.Generator().manual_seed(0)
    pos = cp.zigzag_positions(length, n)
    mine = [t[..., pos[r], :].contiguous()
            for t in (torch.randn(1, heads, length, dim, generator=gen) for _ in range(3))]
    times, cpu = ({kind: [] for kind in comms} for _ in range(2))
    with torch.no_grad():
        for round_ in range(repeats + 1):  # the first round warms up
            for kind, comm in comms.items():
                start = netem.start_clock(comm)
                cpu_start = time.process_time()
                cp.ring_attention(*mine, comm, pos, {}, overlap=kind != "serial")
                if round_:
                    times[kind].append(time.monotonic() - start)
                    cpu[kind].append(time.process_time() - cpu_start)
    return {**{f"{k}_s": float(np.median(v)) for k, v in times.items()},
            **{f"{k}_cpu_s": float(np.median(v)) for k, v in cpu.items()}}
