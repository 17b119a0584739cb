"""Serving across devices: tensor-parallel decoding, and planning a deployment on paper.

Introduced in notebooks/18_serving_across_devices.ipynb. A model too large for one device is
served split by **tensor parallelism** (notebook 14's Megatron block): each rank holds its heads
of attention and its columns of the MLP, and caches the keys and values of its own heads only;
every token then costs two allreduces per block (after attention, after the MLP) of
``batch x d_model`` numbers. In decode those messages are small and latency sets their price; with
large batches and in prefill their bytes do, and NVLink carries ten times what a server's network
does: that is why serving keeps TP inside a node::

    split = tensor_parallel_model(model, TensorParallel(comm))   # on every rank
    tokens = decoding.generate(split, prompt, 50)               # the same tokens as one process

**Planning a deployment** asks what training's planner asked (notebook 16), for serving: the
weights, divided over the devices, plus the KV cache of ``batch`` requests of ``length`` tokens
(:func:`serving_memory`); a decode step reads both once, so its time is their bytes over the
devices' memory bandwidth until the batch reaches the critical size where compute takes over
(:func:`decode_step_time`, :func:`critical_batch`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import costmodel, gpu, planner
from course_lib.comm import get_comm
from course_lib.decoding import Decoder, kv_bytes_per_token, pick
from course_lib.sequence_parallel import ParallelBlock
from course_lib.tensor_parallel import TensorParallel
from course_lib.transformer import GPT, GPTConfig


class TimedTensorParallel(TensorParallel):
    """A :class:`tensor_parallel.TensorParallel` that also adds up the seconds its allreduces
    took (``seconds``). Introduced in notebooks/18_serving_across_devices.ipynb."""

    def __init__(self, comm, algorithm: str = "ring") -> None:
        super().__init__(comm, algorithm)
        self.seconds = 0.0

    def allreduce(self, tensor: torch.Tensor, phase: str) -> torch.Tensor:
        start = time.perf_counter()
        out = super().allreduce(tensor, phase)
        self.seconds += time.perf_counter() - start
        return out


def tensor_parallel_model(model: GPT, tp: TensorParallel) -> GPT:
    """A copy of ``model`` whose blocks are this rank's :class:`sequence_parallel.ParallelBlock`
    (its heads, its MLP columns; embeddings, LayerNorms and head whole). A
    :class:`decoding.Decoder` on it caches this rank's heads.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    split = copy.deepcopy(model)
    split.blocks = nn.ModuleList(ParallelBlock(b, tp) for b in split.blocks)
    return split.eval()


@torch.no_grad()
def tensor_parallel_generate(model: GPT, prompt: torch.Tensor, n_tokens: int, comm) -> dict:
    """Greedy decoding of ``prompt`` ``(B, T0)`` with ``model`` split over ``comm``'s ranks by
    tensor parallelism (every rank calls it with the same model and prompt). Returns the
    tokens, each step's seconds and the seconds its allreduces took, their count per step, the
    time of one ring step's message measured first (:func:`hop_seconds`), and the bytes this
    rank held: its weights and its KV cache.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    tp = TimedTensorParallel(comm)
    split = tensor_parallel_model(model, tp)
    decoder = Decoder(split, prompt.shape[0])
    idx, new, steps, waits = prompt, prompt, [], []
    hop = hop_seconds(comm, prompt.shape[0] * model.cfg.d_model * 4)  # one allreduce message
    comm.barrier()
    for _ in range(n_tokens):
        tp.seconds, start = 0.0, time.perf_counter()
        new = pick(decoder.feed(new)[:, -1])[:, None]
        steps.append(time.perf_counter() - start)
        waits.append(tp.seconds)
        idx = torch.cat([idx, new], dim=1)
    return {"tokens": idx, "step_seconds": steps, "allreduce_seconds": waits, "hop_seconds": hop,
            "allreduces_per_step": tp.counts["forward"] // max(1, n_tokens),
            "weight_bytes": sum(p.nbytes for p in split.parameters()),
            "cache_bytes": decoder.cache.used_bytes}


def generate_on_rank(state: dict, config: dict, prompt: torch.Tensor, n_tokens: int,
                     timeout: float = 20.0) -> dict:
    """:func:`tensor_parallel_generate` on this cluster's ranks, for the model
    ``GPTConfig(**config)`` with weights ``state``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    model = GPT(GPTConfig(**config))
    model.load_state_dict(state)
    comm = get_comm("torch", timeout=timeout, check_sizes=False)
    return tensor_parallel_generate(model, prompt, n_tokens, comm)


def hop_seconds(comm, n_bytes: int, repeats: int = 20) -> float:
    """This machine's α for ``n_bytes`` messages: the median time of one step of a ring (send
    to the next rank, receive from the previous), all ranks stepping together.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    message = torch.zeros(max(1, n_bytes // 4))
    return gpu.timed(lambda: comm.sendrecv(message, right, torch.empty_like(message), left),
                     repeats, device="cpu")


def allreduce_seconds_per_token(cfg: GPTConfig, batch: int, world_size: int,
                                link: costmodel.Link, itemsize: int = 4) -> float:
    """What the α-β model predicts a decode step's allreduces take on ``link``: two ring
    allreduces per block of ``batch x d_model`` numbers, 2 (p - 1) steps each.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    one = costmodel.allreduce_time("ring", batch * cfg.d_model * itemsize, world_size, link)
    return 2 * cfg.n_layers * float(one)


def course_memory_per_rank(cfg: GPTConfig, tp: int, batch: int, length: int,
                           itemsize: int = 4) -> dict[str, int]:
    """The bytes one rank of a tensor-parallel course model holds while serving: its
    parameters (notebook 16's planner) and the cache of its ``n_heads / tp`` heads for
    ``batch`` sequences of ``length`` positions.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    params = planner.parameters_per_rank(cfg, planner.Layout(tp=tp))
    per_token = kv_bytes_per_token(cfg.n_layers, cfg.n_heads // tp, cfg.d_model // cfg.n_heads,
                                   itemsize)
    return {"weights": params * itemsize, "kv_cache": batch * length * per_token}


# ---------------------------------------------------------------- a deployment on paper
@dataclass(frozen=True)
class ServedModel:
    """What serving needs to know of a model: its parameters and its attention's shape.
    Introduced in notebooks/18_serving_across_devices.ipynb."""

    name: str
    params: float
    n_layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Chip:
    """An accelerator's memory (bytes), memory bandwidth (bytes/s) and 16-bit FLOP/s.
    Introduced in notebooks/18_serving_across_devices.ipynb."""

    name: str
    memory: float
    bandwidth: float
    flops: float


# Llama 3 70B: 80 layers, 8 key/value heads of 128 (grouped-query attention, 64 query heads).
# OPT-13B: 40 layers, 40 heads of 128 (multi-head attention).
LLAMA3_70B = ServedModel("Llama 3 70B", 70e9, 80, 8, 128)
OPT_13B = ServedModel("OPT-13B", 13e9, 40, 40, 128)
# The scaling book's v5e figures (16 GB HBM at 8.1e11 B/s, 1.97e14 bf16 FLOP/s); an H100 SXM.
TPU_V5E = Chip("TPU v5e", 16e9, 8.1e11, 1.97e14)
H100 = Chip("H100 SXM", 80e9, 3.35e12, 989e12)


def serving_memory(model: ServedModel, batch: int, length: int, tp: int = 1, pp: int = 1,
                   itemsize: float = 2, kv_itemsize: float | None = None) -> dict[str, float]:
    """Bytes per chip when ``tp x pp`` chips serve ``batch`` requests of ``length`` tokens:
    tensor parallelism over ``tp`` chips splits every layer's weights and key/value heads (a
    head is whole on a chip: with fewer key/value heads than ``tp``, each is held by several
    chips), ``pp`` pipeline stages split the layers. ``kv_itemsize`` defaults to ``itemsize``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    kv_heads = max(model.kv_heads / tp, 1)  # per chip: at least one whole head
    per_token = kv_bytes_per_token(model.n_layers, 1, model.head_dim, 1) * kv_heads / pp
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    return {"weights": model.params * itemsize / (tp * pp),
            "kv_cache": batch * length * per_token * kv_itemsize}


def decode_step_time(model: ServedModel, batch: int, length: int, chip: Chip, tp: int = 1,
                     pp: int = 1, itemsize: float = 2) -> float:
    """Seconds for one token of every request to come out, on the roofline: each of the ``pp``
    stages reads its weights and cache once over its ``tp`` chips' bandwidth (or does its
    ``2 params batch / pp`` FLOPs, whichever takes longer), one stage after the other. Pipeline
    stages divide the memory but not this time; they keep every stage busy only with ``pp``
    batches in flight. Introduced in notebooks/18_serving_across_devices.ipynb."""
    held = sum(serving_memory(model, batch, length, tp, pp, itemsize).values())
    stage = max(held / chip.bandwidth, 2 * model.params * batch / (tp * pp * chip.flops))
    return pp * stage


def critical_batch(chip: Chip, itemsize: float = 2) -> float:
    """The batch where a decode step's weight reads and its FLOPs take equally long: each
    parameter read (``itemsize`` bytes) serves 2 FLOPs per sequence, so ``B = F itemsize /
    (2 W)``; in bf16, ``F / W`` (the cache's reads left out).
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    return chip.flops * itemsize / (2 * chip.bandwidth)
