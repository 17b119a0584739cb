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
    """The parameters one rank holds (before ZeRO-3): see the module docstring.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    d, t = cfg.d_model, layout.tp
    hidden = cfg.hidden or 4 * d
    whole = cfg.vocab_size * d + cfg.context * d + 2 * d  # embeddings, final LayerNorm
    block = 4 * d                                          # two LayerNorms
    block += (3 * d * d + 3 * d) // t + d * d // t + d     # QKV (column), projection (row) + bias
    mlp = 2 * d * hidden + hidden + d                      # one MLP: fc, its bias, out, its bias
    if cfg.experts:
        block += d * cfg.experts + cfg.experts // layout.ep * mlp  # the router, its experts
    else:
        block += (2 * d * hidden + hidden) // t + d        # column, row, the row's bias whole
    return whole + cfg.n_layers * block


def tensors_per_rank(cfg: GPTConfig, layout: Layout) -> int:
    """The parameter tensors one rank holds (Adam keeps a step counter for each).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    block = 4 + 4 + (1 + 4 * (cfg.experts // layout.ep) if cfg.experts else 4)
    return 4 + cfg.n_layers * block  # embeddings and final LayerNorm; LayerNorms, attention


def activation_bytes_per_rank(cfg: GPTConfig, layout: Layout, batch: int, length: int,
                              itemsize: int = 8) -> int:
    """The bytes one forward keeps for backward on one rank (dense blocks): see the module
    docstring. Introduced in notebooks/16_planning_a_run.ipynb."""
    if cfg.experts:
        raise ValueError("the activations of expert blocks are not in this count yet")
    b, T = batch // (layout.dp * layout.ep), length // layout.cp
    blocks = cfg.n_layers * block_activation_bytes(b, length, cfg.d_model, cfg.n_heads,
                                                   layout.tp, layout.cp, itemsize=itemsize,
                                                   recompute=cfg.recompute)
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
