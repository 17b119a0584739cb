"""Planning a run: what each rank of a mesh holds, predicted before anything runs.

Introduced in notebooks/16_planning_a_run.ipynb. Given the transformer's sizes, a batch and a
layout (how many ranks along dp, tp, cp and ep, and the ZeRO stage), :func:`memory_per_rank`
counts the bytes one rank keeps, by kind:

* **parameters**: the embeddings, LayerNorms and row-parallel biases whole; the attention and
  MLP matrices divided by tp (Megatron); each expert on one of the ep ranks;
* **gradients**: one per parameter; **optimizer**: K numbers per parameter (Adam: 2, and a
  step counter per tensor);
  ZeRO divides the optimizer state (stage 1), the gradients too (2) and the parameters too (3)
  over the dp ranks (the ZeRO paper's accounting, :func:`zero.zero_memory`);
* **activations**: per block :func:`sequence_parallel.block_activation_bytes` (a rank holds
  B/(dp ep) sequences and T/cp positions of each), then the head: the final LayerNorm's input,
  output and statistics, the log-probabilities over the vocabulary, the tokens and targets.

Each count is checked against the bytes a real run holds (``tests/test_planner.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.sequence_parallel import block_activation_bytes
from course_lib.sharding import shard_bounds
from course_lib.transformer import GPTConfig


@dataclass(frozen=True)
class Layout:
    """How a run splits: ranks along each dimension, the ZeRO stage over dp.
    Introduced in notebooks/16_planning_a_run.ipynb."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.ep

    @classmethod
    def from_shape(cls, shape: dict[str, int], zero: int = 0) -> Layout:
        """The layout of a mesh shape such as ``{"dp": 2, "tp": 2}``."""
        return cls(**shape, zero=zero)


def parameters_per_rank(cfg: GPTConfig, layout: Layout) -> int:
    """The parameters one rank holds (before ZeRO-3): see the module docstring and
    :func:`tensor_sizes`. Introduced in notebooks/16_planning_a_run.ipynb."""
    return sum(tensor_sizes(cfg, layout))


def tensors_per_rank(cfg: GPTConfig, layout: Layout) -> int:
    """The parameter tensors one rank holds (Adam keeps a step counter for each).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return len(tensor_sizes(cfg, layout))


def activation_bytes_per_rank(cfg: GPTConfig, layout: Layout, batch: int, length: int,
                              itemsize: int = 8) -> int:
    """The bytes one forward keeps for backward on one rank (dense blocks): see the module
    docstring. Introduced in notebooks/16_planning_a_run.ipynb."""
    if cfg.experts:
        raise ValueError("the activations of expert blocks are not in this count yet")
    b, T = batch // (layout.dp * layout.ep), length // layout.cp
    blocks = cfg.n_layers * block_activation_bytes(b, length, cfg.d_model, cfg.n_heads,
                                                   layout.tp, layout.cp, itemsize=itemsize,
                                                   recompute=cfg.recompute, hidden=cfg.hidden)
    # the head: final LayerNorm's input, output (the head's input) and two statistics per
    # token, the log-probabilities over the vocabulary, tokens and targets (int64); the
    # positions (int64) and the loss's scalar
    head = b * T * ((2 * cfg.d_model + 2 + cfg.vocab_size) * itemsize + 16) + 8 * T + itemsize
    return blocks + head


def memory_per_rank(cfg: GPTConfig, layout: Layout, batch: int, length: int,
                    itemsize: int = 8, optimizer_numbers: int = 2) -> dict[str, float]:
    """Bytes one rank holds, by kind: parameters, gradients, optimizer, activations, total.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    n = parameters_per_rank(cfg, layout) * itemsize
    shard = 1 / layout.dp
    out = {"parameters": n * (shard if layout.zero >= 3 else 1),
           "gradients": n * (shard if layout.zero >= 2 else 1),
           "optimizer": optimizer_numbers * n * (shard if layout.zero >= 1 else 1)
           + 4 * tensors_per_rank(cfg, layout),  # and a float32 step counter per tensor
           "activations": float(activation_bytes_per_rank(cfg, layout, batch, length,
                                                          itemsize))}
    out["total"] = math.fsum(out.values())
    return out


# ---------------------------------------------------------------- what a step sends
def tensor_sizes(cfg: GPTConfig, layout: Layout) -> list[int]:
    """The elements of each parameter tensor one rank holds (dense or expert blocks): the
    embeddings and LayerNorms whole, the attention and MLP matrices and their column-parallel
    biases divided by tp, the row-parallel biases whole, each expert on one ep rank.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    d, t, hidden = cfg.d_model, layout.tp, cfg.hidden or 4 * cfg.d_model
    sizes = [cfg.vocab_size * d, cfg.context * d, d, d]  # embeddings, final LayerNorm
    for _ in range(cfg.n_layers):
        sizes += [d, d, d, d, 3 * d * d // t, 3 * d // t, d * d // t, d]  # LayerNorms, attention
        if cfg.experts:
            sizes += [d * cfg.experts] + cfg.experts // layout.ep * [hidden * d, hidden,
                                                                     d * hidden, d]
        else:
            sizes += [hidden * d // t, hidden // t, d * hidden // t, d]
    return sizes


def ring_allreduce_elements(n: int, world_size: int, rank: int) -> int:
    """The elements rank ``rank`` sends in the course's ring allreduce of ``n`` elements: every
    chunk but its own in the reduce-scatter, every chunk but its right neighbour's in the
    all-gather (chunks of :func:`sharding.shard_bounds`).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if world_size == 1 or n == 0:
        return 0
    size = [b - a for a, b in (shard_bounds(n, c, world_size) for c in range(world_size))]
    return 2 * n - size[rank] - size[(rank + 1) % world_size]


def bytes_per_step(cfg: GPTConfig, layout: Layout, batch: int, length: int,
                   coords: dict[str, int], itemsize: int = 8) -> dict[str, int]:
    """The bytes the rank at ``coords`` sends in one step, along each dimension of dense
    blocks: tp, four allreduces per block of its B/dp sequences' T/cp positions (two in
    forward, two in backward); cp, ring attention's key/value blocks (N - 1 forward, N - 1
    backward with their gradients, and the last hop home) and the allreduce of every gradient;
    dp, the allreduce of every gradient (the course's ring). Recomputation adds the
    forward's messages it runs again. Introduced in notebooks/16_planning_a_run.ipynb."""
    if cfg.experts:
        raise ValueError("an expert block's all-to-alls depend on the routing: not counted")
    b, T = batch // (layout.dp * layout.ep), length // layout.cp
    out = {}
    for dim in ("dp", "cp"):
        n = getattr(layout, dim)
        out[dim] = itemsize * sum(ring_allreduce_elements(k, n, coords.get(dim, 0))
                                  for k in tensor_sizes(cfg, layout))
    # recomputation runs forwards again in backward: a whole block's stops once backward has
    # what it needs (torch's checkpoint), before the MLP's allreduce; attention's core, its ring
    again = {None: (0, 0), "attention": (0, 1), "full": (1, 1)}[cfg.recompute]
    out["tp"] = itemsize * (4 + again[0]) * cfg.n_layers * ring_allreduce_elements(
        b * T * cfg.d_model, layout.tp, coords.get("tp", 0))
    if layout.cp > 1:  # a block of keys and values: this rank's heads of its positions
        kv = b * (cfg.n_heads // layout.tp) * T * (cfg.d_model // cfg.n_heads) * itemsize
        forward = (layout.cp - 1) * 2 * kv
        out["cp"] += cfg.n_layers * ((1 + again[1]) * forward + (layout.cp - 1) * 4 * kv
                                     + 2 * kv)
    return {dim: int(v) for dim, v in out.items() if getattr(layout, dim) > 1}
