"""Planning a run: what each rank of a mesh holds, predicted before anything runs.

Introduced in notebooks/16_planning_a_run.ipynb. Given the transformer's sizes, a batch and a
layout (how many ranks along dp, tp, cp and ep, and the ZeRO stage), :func:`memory_per_rank`
counts the bytes one rank keeps, by kind:

* **parameters**: the embeddings, LayerNorms and row-parallel biases whole; the attention and
  MLP matrices divided by tp (Megatron); each expert on one of the ep ranks;
* **gradients**: one per parameter; **optimizer**: K numbers per parameter (Adam: 2, and a
  step counter per tensor);
  ZeRO divides the optimizer state (stage 1), the gradients too (2) and the parameters too (3)
  over the dp ranks (the ZeRO paper's accounting, :func:`zero.zero_memory`; given a rank's
  ``coords``, the shares the course's ZeRO-1 and ZeRO-3 really cut);
* **activations**: per block :func:`sequence_parallel.block_activation_bytes` (a rank holds
  B/(dp ep) sequences and T/cp positions of each), then the head: the final LayerNorm's input,
  output and statistics, the log-probabilities over the vocabulary, the tokens and targets.

A pipeline (``pp`` stages) gives each stage its share of the blocks, the embeddings to the
first, the head (with its own copy of the tied embedding) to the last, and activations for the
micro-batches its 1F1B schedule keeps at once. Each count is checked against the bytes a real
run holds (``tests/test_mesh.py``, ``tests/test_mesh_8.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.pipeline import schedule_order
from course_lib.sequence_parallel import block_activation_bytes
from course_lib.sharding import shard_bounds
from course_lib.transformer import GPTConfig


@dataclass(frozen=True)
class Layout:
    """How a run splits: ranks along each dimension, the ZeRO stage over dp, the pipeline's
    stages (``pp``, each its share of the blocks by :func:`sharding.shard_bounds`) and the
    micro-batches of its 1F1B step. Introduced in notebooks/16_planning_a_run.ipynb."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    pp: int = 1
    microbatches: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp * self.cp * self.ep

    @classmethod
    def from_shape(cls, shape: dict[str, int], zero: int = 0, microbatches: int = 1) -> Layout:
        """The layout of a mesh shape such as ``{"dp": 2, "tp": 2}``."""
        return cls(**shape, zero=zero, microbatches=microbatches)


def parameters_per_rank(cfg: GPTConfig, layout: Layout, stage: int = 0) -> int:
    """The parameters one rank (of pipeline stage ``stage``) holds (before ZeRO-3): see the
    module docstring and :func:`tensor_sizes`. Introduced in notebooks/16_planning_a_run.ipynb."""
    return sum(tensor_sizes(cfg, layout, stage))


def tensors_per_rank(cfg: GPTConfig, layout: Layout, stage: int = 0) -> int:
    """The parameter tensors one rank (of pipeline stage ``stage``) holds (Adam keeps a step
    counter for each). Introduced in notebooks/16_planning_a_run.ipynb."""
    return len(tensor_sizes(cfg, layout, stage))


def activation_bytes_per_rank(cfg: GPTConfig, layout: Layout, batch: int, length: int,
                              itemsize: int = 8, stage: int = 0) -> int:
    """The bytes one forward keeps for backward on one rank (dense blocks): see the module
    docstring. With pipeline stages (``layout.pp``), the most that stage ``stage`` keeps at
    once in a 1F1B step of ``layout.microbatches`` micro-batches: each forward run and not yet
    run backward keeps its blocks' and ends' bytes for its micro-batch, at most
    min(pp - stage, M) of them (:func:`pipeline.schedule_order`); the tokens and targets
    count once, whole (a micro-batch's are a view of its rank's batch).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if cfg.experts:
        raise ValueError("the activations of expert blocks are not in this count yet")
    b, T = batch // (layout.dp * layout.ep), length // layout.cp
    first, last = stage == 0, stage == layout.pp - 1
    start, stop = shard_bounds(cfg.n_layers, stage, layout.pp)

    def forward(rows: int) -> int:  # what a forward of ``rows`` sequences keeps on this stage
        kept = (stop - start) * block_activation_bytes(
            rows, length, cfg.d_model, cfg.n_heads, layout.tp, layout.cp, itemsize=itemsize,
            recompute=cfg.recompute, hidden=cfg.hidden)
        if first:  # the positions (int64)
            kept += 8 * T
        if last:  # final LayerNorm's input, output (the head's input) and two statistics per
            # token, the log-probabilities over the vocabulary; the loss's scalar
            kept += rows * T * (2 * cfg.d_model + 2 + cfg.vocab_size) * itemsize + itemsize
        return kept
    whole = 8 * b * T * (first + last)  # the tokens (first stage) and targets (last), int64
    if layout.pp == 1:
        return forward(b) + whole
    M, live, peak = layout.microbatches, 0, 0
    for op, m in schedule_order("1f1b", stage, layout.pp, M):
        a, z = shard_bounds(b, m, M)  # micro-batch m's sequences, as pipeline_step cuts them
        live += forward(z - a) if op == "F" else -forward(z - a)
        peak = max(peak, live)
    return peak + whole


def memory_per_rank(cfg: GPTConfig, layout: Layout, batch: int, length: int,
                    itemsize: int = 8, optimizer_numbers: int = 2,
                    coords: dict[str, int] | None = None) -> dict[str, float]:
    """Bytes one rank holds, by kind: parameters, gradients, optimizer, activations, total.
    ``coords``, the rank's place on the mesh, gives its pipeline stage and ZeRO's shares as
    the course cuts them: ZeRO-1 (:class:`zero_optimizer.ShardedOptimizer`) the state of whole
    tensors, each owned by one dp rank (:func:`owned_tensors`); ZeRO-3
    (:class:`zero.ZeroDataParallel`) this rank's :func:`sharding.shard_bounds` of each unit's
    flat vector (:func:`tensor_units`), parameters, gradients and state alike. Without
    ``coords``: stage 0, and ZeRO's even split over dp (the ZeRO paper's accounting).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    stage = (coords or {}).get("pp", 0)
    n = parameters_per_rank(cfg, layout, stage) * itemsize
    shard = 1 / layout.dp
    out = {"parameters": n * (shard if layout.zero >= 3 else 1),
           "gradients": n * (shard if layout.zero >= 2 else 1),
           "optimizer": optimizer_numbers * n * (shard if layout.zero >= 1 else 1)
           + 4 * tensors_per_rank(cfg, layout, stage),  # and a float32 step counter per tensor
           "activations": float(activation_bytes_per_rank(cfg, layout, batch, length,
                                                          itemsize, stage))}
    if coords is not None and layout.zero == 1:
        owned = owned_tensors(tensor_sizes(cfg, layout, stage), layout.dp)[coords.get("dp", 0)]
        out["optimizer"] = optimizer_numbers * itemsize * sum(owned) + 4 * len(owned)
    elif coords is not None and layout.zero == 3:
        units = tensor_units(cfg, layout, stage)
        held = itemsize * sum(b - a for a, b in (shard_bounds(sum(u), coords.get("dp", 0),
                                                              layout.dp) for u in units))
        out.update(parameters=held, gradients=held,  # one optimizer tensor per unit
                   optimizer=optimizer_numbers * held + 4 * len(units))
    elif coords is not None and layout.zero:
        raise ValueError(f"ZeRO-{layout.zero}: the mesh runs ZeRO-1 and ZeRO-3")
    out["total"] = math.fsum(out.values())
    return out


def owned_tensors(sizes: list[int], world_size: int) -> list[list[int]]:
    """The sizes of the tensors each rank owns under ZeRO-1's
    :class:`zero_optimizer.ShardedOptimizer`: the largest first, each to the rank holding the
    fewest elements so far, ties to the lowest (:func:`zero_optimizer.partition`, torch's rule).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    held, owned = [0] * world_size, [[] for _ in range(world_size)]
    for n in sorted(sizes, reverse=True):  # equal sizes in any order: the same counts
        rank = held.index(min(held))
        owned[rank].append(n)
        held[rank] += n
    return owned


# ---------------------------------------------------------------- what a step sends
def tensor_sizes(cfg: GPTConfig, layout: Layout, stage: int = 0) -> list[int]:
    """The elements of each parameter tensor one rank holds (dense or expert blocks): the
    embeddings and LayerNorms whole, the attention and MLP matrices and their column-parallel
    biases divided by tp, the row-parallel biases whole, each expert on one ep rank. With
    pipeline stages, stage ``stage``'s: its blocks, the embeddings on the first stage, the
    final LayerNorm and a copy of the tied token embedding (the head) on the last.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return [n for unit in tensor_units(cfg, layout, stage) for n in unit]


def tensor_units(cfg: GPTConfig, layout: Layout, stage: int = 0) -> list[list[int]]:
    """:func:`tensor_sizes` by the module that holds them (:class:`mesh.PipelineStage`'s
    children, the units ZeRO-3 gathers one at a time): the ends (embeddings, final LayerNorm,
    head), if the stage has any, then each block. Introduced in
    notebooks/16_planning_a_run.ipynb."""
    d, t, hidden = cfg.d_model, layout.tp, cfg.hidden or 4 * cfg.d_model
    first, last = stage == 0, stage == layout.pp - 1
    ends = ([cfg.vocab_size * d] if first or last else []) + ([cfg.context * d] if first else [])
    ends += [d, d] if last else []  # token (the head's too) and position embeddings, LayerNorm
    block = [d, d, d, d, 3 * d * d // t, 3 * d // t, d * d // t, d]  # LayerNorms, attention
    if cfg.experts:
        block += [d * cfg.experts] + cfg.experts // layout.ep * [hidden * d, hidden,
                                                                 d * hidden, d]
    else:
        block += [hidden * d // t, hidden // t, d * hidden // t, d]
    start, stop = shard_bounds(cfg.n_layers, stage, layout.pp)
    return ([ends] if ends else []) + [list(block) for _ in range(start, stop)]


def ring_allreduce_elements(n: int, world_size: int, rank: int) -> int:
    """The elements rank ``rank`` sends in the course's ring allreduce of ``n`` elements: every
    chunk but its own in the reduce-scatter, every chunk but its right neighbour's in the
    all-gather (chunks of :func:`sharding.shard_bounds`).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if world_size == 1 or n == 0:
        return 0
    size = [b - a for a, b in (shard_bounds(n, c, world_size) for c in range(world_size))]
    return 2 * n - size[rank] - size[(rank + 1) % world_size]


def ring_allgather_elements(n: int, world_size: int, rank: int) -> int:
    """The elements rank ``rank`` sends in the course's ring all-gather of ``n`` elements:
    every chunk but its right neighbour's (the reduce-scatter sends the rest of
    :func:`ring_allreduce_elements`: every chunk but its own).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if world_size == 1:
        return 0
    a, b = shard_bounds(n, (rank + 1) % world_size, world_size)
    return n - (b - a)


def bytes_per_step(cfg: GPTConfig, layout: Layout, batch: int, length: int,
                   coords: dict[str, int], itemsize: int = 8) -> dict[str, int]:
    """The bytes the rank at ``coords`` sends in one step, along each dimension of dense
    blocks: tp, four allreduces per block of its B/dp sequences' T/cp positions (two in
    forward, two in backward); cp, ring attention's key/value blocks (N - 1 forward, N - 1
    backward with their gradients, and the last hop home) and the allreduce of every gradient;
    dp, the allreduce of all gradients in one bucket (the course's ring). Recomputation adds the
    forward's messages it runs again. A pipeline stage (``coords["pp"]``) runs its blocks'
    allreduces once per micro-batch, sends each micro-batch's activations on (after a header
    of 8 int64) and their gradients back, and the first and last stages swap the tied
    embedding's gradient. ZeRO-1 adds the all-gather of the updated parameters (each rank's
    share padded to the largest, :func:`owned_tensors`); ZeRO-3 sends no allreduce but
    all-gathers each unit (:func:`tensor_units`) before its forward and its backward (the
    ends twice each: embeddings and head) and reduce-scatters its gradients once.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if cfg.experts:
        raise ValueError("an expert block's all-to-alls depend on the routing: not counted")
    b, T = batch // (layout.dp * layout.ep), length // layout.cp
    stage = coords.get("pp", 0)
    first, last = stage == 0, stage == layout.pp - 1
    start, stop = shard_bounds(cfg.n_layers, stage, layout.pp)
    M = layout.microbatches if layout.pp > 1 else 1
    rows = [z - a for a, z in (shard_bounds(b, m, M) for m in range(M))]  # per micro-batch
    out = {}
    for dim in ("dp", "cp"):
        n = getattr(layout, dim)
        out[dim] = itemsize * ring_allreduce_elements(sum(tensor_sizes(cfg, layout, stage)), n,
                                                      coords.get(dim, 0))  # one bucket
    # recomputation runs forwards again in backward: a whole block's stops once backward has
    # what it needs (torch's checkpoint), before the MLP's allreduce; attention's core, its ring
    again = {None: (0, 0), "attention": (0, 1), "full": (1, 1)}[cfg.recompute]
    out["tp"] = itemsize * (4 + again[0]) * (stop - start) * sum(ring_allreduce_elements(
        r * T * cfg.d_model, layout.tp, coords.get("tp", 0)) for r in rows)
    if layout.cp > 1:  # a block of keys and values: this rank's heads of its positions
        kv = b * (cfg.n_heads // layout.tp) * T * (cfg.d_model // cfg.n_heads) * itemsize
        forward = (layout.cp - 1) * 2 * kv
        out["cp"] += cfg.n_layers * ((1 + again[1]) * forward + (layout.cp - 1) * 4 * kv
                                     + 2 * kv)
    if layout.pp > 1:  # activations on (with a header each), gradients back, the tied weight
        activations = sum(rows) * T * cfg.d_model * itemsize
        out["pp"] = ((0 if last else activations + 64 * M) + (0 if first else activations)
                     + (cfg.vocab_size * cfg.d_model * itemsize if first or last else 0))
    if layout.zero == 1:
        longest = max(map(sum, owned_tensors(tensor_sizes(cfg, layout, stage), layout.dp)))
        out["dp"] += itemsize * (layout.dp - 1) * longest
    elif layout.zero == 3:
        r, out["dp"] = coords.get("dp", 0), 0
        for i, unit in enumerate(tensor_units(cfg, layout, stage)):
            n = sum(unit)
            gathers = 4 if i == 0 and first and last else 2  # the ends: called twice
            gather = ring_allgather_elements(n, layout.dp, r)
            out["dp"] += itemsize * (gathers * gather
                                     + ring_allreduce_elements(n, layout.dp, r) - gather)
    return {dim: int(v) for dim, v in out.items() if getattr(layout, dim) > 1}
