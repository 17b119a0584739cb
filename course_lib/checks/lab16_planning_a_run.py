"""Checks for labs/16_planning_a_run.ipynb: the memory calculator and a rank's mesh coordinates
and groups (notebook 16).

In the lab, right under each exercise::

    from course_lib.checks import lab16_planning_a_run as checks
    checks.check_memory(my_memory, cluster)            # against bytes measured, here and on 4 ranks
    checks.check_coordinates(my_coordinates, cluster)  # against init_device_mesh on 4 ranks
    checks.check_groups(my_groups, cluster)            # and course_lib.mesh on larger meshes
    checks.check_to_fp8_blocks(to_fp8_blocks)          # against course_lib.precision.to_fp8

The first compares ``my_memory(cfg, layout, batch, length)`` (bytes per rank by kind, float64,
AdamW) with what real runs held: one process in this kernel (the tensors held after a step,
``transformer.activation_bytes_of`` for the activations) and the transformer trained on meshes
of the cluster's 4 ranks (``testing.mesh.mesh_training_on_rank``, every rank's bytes), with and
without recomputation. A wrong count is matched against the usual mistakes, each recomputed
(:func:`memory_parts` with a ``mistake``), then against one part left out, then shown beside
the parts it is made of. The other two compare with torch's ``init_device_mesh`` on the cluster
and with ``mesh.coordinates`` / ``mesh.mesh_groups`` on meshes of up to 24 ranks, and name
column-major order, a group along the wrong dimension and a rank missing from its own group.
The last compares an FP8 cast with one scale per block against ``precision.to_fp8`` (the FP8
numbers bit for bit, the scales to float32's rounding) on six tensors (an outlier, all
negative, a block of zeros, numbers beyond 448, 3-D), and names an upside-down scale, one
scale for the tensor, max without abs, a NaN from a zero block.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from course_lib import mesh as M
from course_lib import transformer as tf
from course_lib.checks.framework import CheckFailed, not_implemented
from course_lib.planner import Layout
from course_lib.testing.mesh import (
    forward_kept,
    held_bytes,
    mesh_training_on_rank,
    model_config,
    optimizer_bytes,
)

KINDS = ("parameters", "gradients", "optimizer", "activations")
ITEMSIZE = 8       # float64: every number of the model, its gradients and Adam's state
COUNTER_BYTES = 4  # Adam's step counter: a float32 scalar tensor per parameter tensor

# ---------------------------------------------------------------- the count, right and wrong
# Each mistake recomputes the count as a student who made it would; its hint says what it did.
MISTAKES = {
    "elements": "you counted numbers, not bytes: float64 takes 8 bytes a number (int64 too; a "
                "boolean takes 1 byte, a step counter 4).",
    "float32": "the model is float64 here: 8 bytes a number, not 4.",
    "embeddings split": "you divided the embeddings (and the final LayerNorm) by tp. Tensor "
                        "parallelism splits only the matrices of attention and the MLP: the "
                        "token and position embeddings and every LayerNorm are whole on every "
                        "tp rank.",
    "layernorms split": "you divided the blocks' LayerNorms by tp: they act on whole tokens, "
                        "outside the split layers, so every tp rank holds them whole.",
    "row biases split": "you divided the row-parallel biases (attention's projection bias, the "
                        "MLP's second bias) by tp: a row-parallel layer adds its bias once, "
                        "after the allreduce, so every tp rank holds it whole. The "
                        "column-parallel biases (QKV's, the MLP's first) are split with their "
                        "columns.",
    "all split": "you divided every parameter by tp. Only the matrices of attention and the "
                 "MLP and the column-parallel biases are split; the embeddings, the LayerNorms "
                 "and the row-parallel biases are whole on every tp rank.",
    "hidden 4d": "the MLP's hidden units are cfg.hidden when it is set (4 d only when it is "
                 "None): H = cfg.hidden or 4 * d.",
    "positions by length": "the position embedding has a row for every position the model "
                           "takes, cfg.context, whatever the length of this batch's sequences.",
    "untied head": "the output head shares the token embedding's weights (tied: logits = "
                   "LN(x) @ tok.weight.T): it adds no parameters.",
    "gradients over dp": "you divided the gradients by dp: that is ZeRO-2. Without ZeRO every "
                         "data-parallel rank holds the whole gradient of its parameters.",
    "optimizer over dp": "you divided Adam's state by dp: that is ZeRO-1. Without ZeRO every "
                         "data-parallel rank keeps the state of all its parameters.",
    "one adam number": "Adam keeps two numbers per parameter: the running means of the gradient "
                       "(exp_avg) and of its square (exp_avg_sq).",
    "no adam numbers": "you counted the step counters but not Adam's two numbers per parameter "
                       "(exp_avg and exp_avg_sq, float64 like the parameters: 16 bytes a "
                       "parameter).",
    "three adam numbers": "three numbers per parameter is mixed precision's master copy and the "
                          "two moments; here the parameters are float64 themselves, and Adam "
                          "keeps two numbers per parameter.",
    "no counters": "Adam also keeps a step counter for each parameter tensor: a float32 scalar "
                   "tensor, 4 bytes (4 tensors outside the blocks, 12 in each block). This lab "
                   "counts them, as torch holds them.",
    "counters float64": "the step counters are float32 scalars, 4 bytes each, whatever the "
                        "parameters' dtype.",
    "counter per parameter": "one step counter per parameter tensor, not per number: "
                             "4 + 12 L tensors.",
    "ln regions split": "you divided the LayerNorm regions by tp. Without sequence parallelism "
                        "every tp rank holds each token whole outside attention and the MLP: "
                        "the LayerNorms' inputs, outputs and statistics (4 b T' d + 4 b T' "
                        "numbers a block). Only what lies between the column- and the "
                        "row-parallel layers (Q, K, V, attention's output and probabilities, "
                        "the MLP's hidden layer) is split, by heads and hidden units.",
    "no dp": "each data-parallel rank holds B / dp of the sequences: count the activations of "
             "b = batch // dp sequences.",
    "total over dp": "you divided the activations of the whole batch by dp. Each rank runs its "
                     "b = B / dp sequences, and what does not grow with the sequences (the "
                     "causal mask, the positions, the loss) is the same on every rank, not "
                     "divided. Count with b = batch // dp.",
    "no cp": "context parallelism gives each rank T' = T / cp positions of every sequence, and "
             "ring attention keeps no T x T probabilities or mask (its output a second time "
             "and the log-denominators instead).",
    "total over cp": "you divided the activations of whole sequences by cp. Each rank holds "
                     "T' = T / cp positions; ring attention keeps neither probabilities nor a "
                     "mask, and the positions are T' int64 on each rank.",
    "probs under ring": "ring attention (cp > 1) keeps no probabilities and no mask: in "
                        "backward it recomputes each block's probabilities from its "
                        "log-denominators (b h T' / tp numbers) and it keeps its output a second "
                        "time (b T' d / tp).",
    "no ring extras": "ring attention (cp > 1) keeps two things of its own in each block: its "
                      "output a second time (b T' d / tp) and the log-denominators of its "
                      "probabilities (b h T' / tp), from which backward recomputes them.",
    "core under selective": "selective recomputation (recompute='attention') keeps only "
                            "attention's inputs, Q, K and V: the probabilities and the mask "
                            "(with ring attention, its output copy and log-denominators) are "
                            "computed again in backward, not kept.",
    "recompute ignored": "cfg.recompute changes what is kept: 'full' keeps each block's input "
                         "only (b T' d, whole on every tp rank) and runs the block again in "
                         "backward; 'attention' drops attention's core.",
    "full input split": "with full recomputation a block keeps its input, b T' d, whole on "
                        "every tp rank: it is the residual stream, not split by heads.",
    "no head": "the head is part of every forward and is not recomputed: the final "
               "LayerNorm's input, output and statistics, the log-probabilities over the "
               "vocabulary (b T' V numbers, often the largest tensor), the tokens, targets and "
               "positions (int64) and the loss.",
    "no log-probabilities": "you left out the log-probabilities over the vocabulary, b T' V "
                            "numbers: cross-entropy keeps them for backward.",
    "log-probabilities split": "you divided the log-probabilities by tp: the head is not "
                               "split, every tp rank computes the log-probabilities over the "
                               "whole vocabulary (b T' V numbers), and the loss.",
    "logits too": "the logits themselves are not kept: the head's matmul keeps its input (the "
                  "final LayerNorm's output) and the weight, and cross-entropy keeps the "
                  "log-probabilities, b T' V numbers, once.",
    "int32": "the tokens, the targets and the positions are int64 (torch's integers by "
             "default): 8 bytes each, not 4.",
    "mask itemsize": "the causal mask is booleans: 1 byte each, T'^2 a block, not 8.",
    "mask per head": "the causal mask is one T' x T' boolean tensor a block, shared by every "
                     "sequence and head (and whole on every tp rank).",
    "mask split": "the causal mask is not split by tp: each rank builds the whole T' x T' "
                  "booleans for its heads.",
    "one block": "every block keeps its own activations: L = cfg.n_layers times one block's.",
}
# the same hint for another way to make the same mistake
SAME_AS = {"probs and ring under ring": "probs under ring",
           "probs under ring, whole keys": "probs under ring"}


def memory_parts(cfg: tf.GPTConfig, layout: Layout, batch: int, length: int,
                 mistake: str | None = None) -> dict[str, list[tuple[str, float]]]:
    """The bytes one rank holds, kind by kind, as labelled parts: the right count, or the
    count with ``mistake`` (a key of :data:`MISTAKES` or :data:`SAME_AS`) made.
    Dense blocks, float64, AdamW, no ZeRO; ``layout.ep`` must be 1."""
    m = mistake
    V, d, h, L = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers
    H = 4 * d if m == "hidden 4d" else (cfg.hidden or 4 * d)
    tp, dp, cp = layout.tp, layout.dp, layout.cp
    s = {"elements": 1, "float32": 4}.get(m, ITEMSIZE)  # bytes of a float
    i64 = {"elements": 1, "int32": 4}.get(m, 8)          # of an int64
    counter = 1 if m == "elements" else COUNTER_BYTES

    # ------------------------------------------------ parameters (numbers)
    whole = tp if m in ("embeddings split", "all split") else 1
    norms = tp if m in ("layernorms split", "all split") else 1
    biases = tp if m in ("row biases split", "all split") else 1
    rows = length if m == "positions by length" else cfg.context
    numbers = [("the token embedding, V d", V * d / whole),
               ("the position embedding, context d", rows * d / whole),
               ("the final LayerNorm, 2 d", 2 * d / whole),
               ("the blocks' LayerNorms, 4 d each", L * 4 * d / norms),
               ("attention's QKV weight and bias, 3 d^2 + 3 d each", L * (3 * d * d + 3 * d) / tp),
               ("attention's projection weight, d^2 each", L * d * d / tp),
               ("the MLP's first weight and bias, d H + H each", L * (d * H + H) / tp),
               ("the MLP's second weight, H d each", L * H * d / tp),
               ("the row-parallel biases, 2 d each", L * 2 * d / biases)]
    if m == "untied head":
        numbers.append(("an output head, V d", V * d))
    n = math.fsum(x for _, x in numbers)
    tensors = 4 + 12 * L  # embeddings, final LayerNorm; 12 in each block
    adam = {"one adam number": 1, "no adam numbers": 0, "three adam numbers": 3}.get(m, 2)
    counters = {"no counters": 0, "counters float64": 8 * tensors,
                "counter per parameter": COUNTER_BYTES * n}.get(m, counter * tensors)
    parts = {"parameters": [(label, x * s) for label, x in numbers],
             "gradients": [("one gradient per parameter", n * s / (dp if m == "gradients over dp"
                                                                   else 1))],
             "optimizer": [("Adam's two numbers per parameter",
                            adam * n * s / (dp if m == "optimizer over dp" else 1)),
                           ("a float32 step counter per parameter tensor", counters)]}

    # ------------------------------------------------ activations (bytes)
    b = batch if m in ("no dp", "total over dp") else batch // dp
    T = length if m in ("no cp", "total over cp") else length // cp
    ring = cp > 1 and m not in ("no cp", "total over cp", "probs under ring",
                                "probs under ring, whole keys")
    dense = not ring or m == "probs and ring under ring"
    recompute = None if m == "recompute ignored" else cfg.recompute
    if recompute == "full":
        block = [("the block's input, b T' d", b * T * d * s / (tp if m == "full input split"
                                                                 else 1))]
    else:
        ln = tp if m == "ln regions split" else 1
        block = [("the LayerNorms' inputs and outputs, 4 b T' d", 4 * b * T * d * s / ln),
                 ("the LayerNorms' statistics, 4 b T'", 4 * b * T * s / ln),
                 ("Q, K and V, 3 b T' d / tp", 3 * b * T * d * s / tp),
                 ("attention's output, b T' d / tp", b * T * d * s / tp),
                 ("the MLP's hidden layer before and after GELU, 2 b T' H / tp",
                  2 * b * T * H * s / tp)]
        if recompute != "attention" or m == "core under selective":
            if ring and m != "no ring extras":
                block += [("ring attention's output again, b T' d / tp", b * T * d * s / tp),
                          ("ring attention's log-denominators, b h T' / tp", b * h * T * s / tp)]
            if dense:
                keys = length if m == "probs under ring, whole keys" else T
                mask = {"mask itemsize": s, "mask per head": b * h / tp,
                        "mask split": 1 / tp}.get(m, 1)
                block += [("attention's probabilities, b h T'^2 / tp", b * h * T * keys * s / tp),
                          ("the causal mask, T'^2 booleans", T * keys * mask)]
    head = [] if m == "no head" else [
        ("the final LayerNorm's input and output, 2 b T' d", 2 * b * T * d * s),
        ("the final LayerNorm's statistics, 2 b T'", 2 * b * T * s),
        ("the log-probabilities over the vocabulary, b T' V",
         0 if m == "no log-probabilities" else
         b * T * V * s / (tp if m == "log-probabilities split" else 1)),
        ("the tokens and the targets, 2 b T' int64", 2 * b * T * i64),
        ("the positions, T' int64", T * i64),
        ("the loss, one number", s)]
    if m == "logits too":
        head.append(("the logits, b T' V", b * T * V * s))
    blocks = 1 if m == "one block" else L
    share = dp if m == "total over dp" else cp if m == "total over cp" else 1
    parts["activations"] = [(f"{label}, in each of {blocks} blocks", blocks * x / share)
                            for label, x in block] + [(f"{label} (the head)", x / share)
                                                      for label, x in head]
    return parts


def reference_memory(cfg: tf.GPTConfig, layout: Layout, batch: int, length: int,
                     mistake: str | None = None) -> dict[str, float]:
    """The bytes one rank holds by kind (:func:`memory_parts` summed), with ``mistake`` made."""
    return {kind: math.fsum(x for _, x in parts)
            for kind, parts in memory_parts(cfg, layout, batch, length, mistake).items()}


# ---------------------------------------------------------------- what real runs held
def measure_one_process(cfg: tf.GPTConfig, batch: int, length: int, seed: int = 0
                        ) -> dict[str, int]:
    """The bytes one process held in a step of AdamW on ``batch`` sequences of ``length``
    random tokens (float64): the parameters, their gradients and Adam's state as tensors, the
    activations as ``saved_tensors_hooks`` saw them."""
    model = tf.GPT(cfg, seed=seed).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, length), generator=gen) for _ in range(2))
    kept, loss = forward_kept(model, x, y, None, tf.causal_attention)
    loss.backward()
    opt.step()
    return dict(**held_bytes(model), optimizer=optimizer_bytes(opt), activations=kept)


def mesh_config(length: int, recompute: str | None) -> tf.GPTConfig:
    """The model :func:`testing.mesh.mesh_training_on_rank` trains (dense)."""
    return model_config(length, 0, recompute)


ONE_PROCESS_CASES = [  # (label, cfg, batch, length), measured in this kernel
    ("one process, the small model of notebook 16", tf.GPTConfig(context=16, d_model=16,
                                                                 n_heads=4), 8, 16),
    ("one process, other sizes: V = 100, d = 24, 3 heads, 3 layers, H = 40, T = 24 < context "
     "32", tf.GPTConfig(vocab_size=100, context=32, d_model=24, n_heads=3, n_layers=3,
                        hidden=40), 4, 24),
    ("one process, the same with recompute='attention'",
     tf.GPTConfig(vocab_size=100, context=32, d_model=24, n_heads=3, n_layers=3, hidden=40,
                  recompute="attention"), 4, 24),
    ("one process, the same with recompute='full'",
     tf.GPTConfig(vocab_size=100, context=32, d_model=24, n_heads=3, n_layers=3, hidden=40,
                  recompute="full"), 4, 24),
]
MESH_CASES = [  # (shape, recompute), trained on the cluster's 4 ranks (B = 8, T = 16)
    ({"dp": 2, "tp": 2}, None), ({"tp": 4}, None), ({"dp": 4}, None), ({"cp": 2, "tp": 2}, None),
    ({"dp": 2, "cp": 2}, None), ({"cp": 2, "tp": 2}, "attention"), ({"dp": 2, "tp": 2}, "full"),
    ({"dp": 2, "tp": 2}, "attention"),
]
MESH_BATCH, MESH_LENGTH = 8, 16
_MEASURED: dict[tuple, list[dict]] = {}  # measurements do not change: each is made once


def measured_cases(cluster: Any) -> list[tuple[str, tf.GPTConfig, Layout, int, int, list]]:
    """Every case with what each rank held: (label, cfg, layout, batch, length, [memory of
    each rank]). The first call measures (a second or two), later ones reuse it."""
    out = []
    for label, cfg, batch, length in ONE_PROCESS_CASES:
        key = ("one", cfg, batch, length)
        if key not in _MEASURED:
            _MEASURED[key] = [measure_one_process(cfg, batch, length)]
        out.append((label, cfg, Layout(), batch, length, _MEASURED[key]))
    for shape, recompute in MESH_CASES:
        key = ("mesh", tuple(shape.items()), recompute)
        if key not in _MEASURED:
            rows = cluster.run(mesh_training_on_rank, shape, 1, 0, MESH_BATCH, MESH_LENGTH,
                               recompute=recompute)
            _MEASURED[key] = [row["memory"] for row in rows]
        name = " x ".join(f"{k}{v}" for k, v in shape.items())
        out.append((f"mesh {name} on the cluster, recompute={recompute!r}, B = {MESH_BATCH}, "
                    f"T = {MESH_LENGTH}", mesh_config(MESH_LENGTH, recompute),
                    Layout.from_shape(shape), MESH_BATCH, MESH_LENGTH, _MEASURED[key]))
    return out


# ---------------------------------------------------------------- exercise 1: the check
def _number(x: Any) -> float | None:
    try:
        return float(x.item() if hasattr(x, "item") else x)
    except (TypeError, ValueError):
        return None


def _same(a: float, b: float) -> bool:
    return abs(a - b) < 0.5  # bytes: a float division may leave a fraction of one


def _describe(parts: list[tuple[str, float]]) -> str:
    return "\n".join(f"    {x:>12,.0f}  {label}" for label, x in parts if x)


def _probes(cfg: tf.GPTConfig, layout: Layout, batch: int, length: int) -> list[tuple]:
    """Other configurations near this one (another vocabulary, width, depth, batch, length):
    where the usual mistakes that coincide here part."""
    import dataclasses
    h = cfg.n_heads
    cfgs = [dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 13),
            dataclasses.replace(cfg, d_model=cfg.d_model + 2 * h,
                                hidden=None if cfg.hidden is None else cfg.hidden + 8),
            dataclasses.replace(cfg, n_layers=cfg.n_layers + 1)]
    out = [(c, layout, batch, length) for c in cfgs]
    out.append((cfg, layout, 2 * batch, length))
    if length > 2 * layout.cp:
        out.append((cfg, layout, batch, length - 2 * layout.cp))
    return out


def diagnose_memory(cfg: tf.GPTConfig, layout: Layout, batch: int, length: int, kind: str,
                    got: dict[str, float], student_fn: Callable | None = None) -> str:
    """The hint for a wrong ``kind`` of ``got`` (bytes by kind): the usual mistake that gives
    every kind of ``got`` (else the one that gives this kind), else the one part left out, else
    the parts the count is made of. With ``student_fn``, a mistake or a part left out must also
    give what the function returns on :func:`_probes`: a match by coincidence is no hint."""
    right = memory_parts(cfg, layout, batch, length)
    want = math.fsum(x for _, x in right[kind])
    mistakes = [*MISTAKES, *SAME_AS]
    wrong = {m: reference_memory(cfg, layout, batch, length, m) for m in mistakes}
    fits = [m for m in mistakes if not _same(wrong[m][kind], want)
            and _same(wrong[m][kind], got[kind])]
    whole = [m for m in fits if all(_same(wrong[m][k], got[k]) for k in KINDS)]
    left = [label for label, x in right[kind] if x and _same(got[kind], want - x)]
    probes = []
    for probe in _probes(cfg, layout, batch, length) if student_fn is not None else []:
        try:
            probes.append((probe, _number(student_fn(*probe)[kind])))
        except Exception:  # noqa: BLE001 - a configuration it cannot take tells nothing
            continue

    def holds(predict):
        return all(value is None or _same(predict(probe), value) for probe, value in probes)

    for mistake in dict.fromkeys(whole + fits):
        if holds(lambda p, m=mistake: reference_memory(*p, m)[kind]):
            return MISTAKES[SAME_AS.get(mistake, mistake)]
    def same_part(a, b):  # a part of another configuration: the number of blocks aside
        return re.sub(r", in each of \d+ blocks", "", a) == re.sub(r", in each of \d+ blocks",
                                                                   "", b)
    for label in left:
        x = dict(right[kind])[label]

        def without(p, label=label):
            parts = memory_parts(*p)[kind]
            return math.fsum(v for lab, v in parts if not same_part(lab, label))
        if holds(without):
            return f"you left out {label}: {x:,.0f} bytes here."
    return (f"one rank holds {want:,.0f} bytes of {kind} here, made of:\n{_describe(right[kind])}"
            f"\n  Find the part your count differs in (yours is {got[kind] - want:+,.0f} bytes "
            f"off).")


def check_memory(student_fn: Callable, cluster: Any) -> bool:
    """Lab 16, exercise 1: ``my_memory(cfg, layout, batch, length)`` returns the bytes one rank
    holds by kind (parameters, gradients, optimizer, activations; float64, AdamW), equal to what
    one process held here and what each of the cluster's 4 ranks held on meshes of dp, tp and
    cp, with and without recomputation. Prints a pass line and returns True, returns False
    while the function raises NotImplementedError, raises ``CheckFailed`` otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    if cluster.n != 4:
        raise ValueError(f"check_memory runs meshes of 4 ranks: it needs a cluster of 4 engines, "
                         f"this one has {cluster.n}")
    _, cfg, batch, length = ONE_PROCESS_CASES[0]
    try:  # before measuring: an exercise not written yet is told so at once
        student_fn(cfg, Layout(), batch, length)
    except NotImplementedError:
        return not_implemented("check_memory")
    except Exception:  # noqa: BLE001 - reported with its case below
        pass
    cases = measured_cases(cluster)
    for number, (label, cfg, layout, batch, length, held) in enumerate(cases, start=1):
        where = (f"check_memory: case {number}/{len(cases)} ({label})\n  my_memory({cfg}, "
                 f"{layout}, batch={batch}, length={length})")
        right = reference_memory(cfg, layout, batch, length)
        for rank, memory in enumerate(held):  # the count itself, against what was held
            if any(not _same(memory[k], right[k]) for k in KINDS):
                raise RuntimeError(f"{where}: rank {rank} held {memory}; the lab's count is "
                                   f"{right}: the check's count is wrong, not your function")
        try:
            got = student_fn(cfg, layout, batch, length)
        except NotImplementedError:
            return not_implemented("check_memory")
        except Exception as err:  # a crash in the student's code: a failed check
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}"
                              f"\nHint: read the line of your function that raised it; cfg and "
                              f"layout are read by attribute (cfg.d_model, layout.tp).") from err
        if not isinstance(got, dict) or any(k not in got for k in KINDS):
            raise CheckFailed(f"{where}\n  returned {type(got).__name__} "
                              f"{sorted(got) if isinstance(got, dict) else ''}"
                              f"\nHint: return a dict with the keys {list(KINDS)}, in bytes.")
        values = {k: _number(got[k]) for k in KINDS}
        if any(v is None for v in values.values()):
            bad = next(k for k, v in values.items() if v is None)
            raise CheckFailed(f"{where}\n  {bad} is {got[bad]!r}\nHint: every kind is a "
                              f"number of bytes.")
        for kind in KINDS:
            for rank, memory in enumerate(held):
                if not _same(values[kind], memory[kind]):
                    on = (f"rank {rank} of {len(held)} held" if len(held) > 1
                          else "one process held")
                    hint = diagnose_memory(cfg, layout, batch, length, kind, values,
                                           student_fn)
                    raise CheckFailed(f"{where}\n  {kind}: {on} {memory[kind]:,} bytes; yours "
                                      f"{values[kind]:,.0f}\nHint: {hint}")
        if "total" in got:
            total = _number(got["total"])
            if total is None or not _same(total, math.fsum(values.values())):
                raise CheckFailed(f"{where}\n  total {got['total']!r} is not the sum of the four "
                                  f"kinds, {math.fsum(values.values()):,.0f}\nHint: the total, "
                                  f"if you return one, adds up the four kinds.")
    ranks = sum(len(c[-1]) for c in cases)
    print(f"✓ check_memory: {len(cases)}/{len(cases)} configurations match the bytes held "
          f"({len(ONE_PROCESS_CASES)} in this kernel, {len(MESH_CASES)} meshes on the cluster's "
          f"4 ranks: {ranks} ranks in all), kind by kind")
    return True


# ---------------------------------------------------------------- exercise 2: the mesh
TORCH_SHAPES = [{"dp": 2, "tp": 2}, {"pp": 2, "dp": 1, "tp": 2}, {"dp": 4, "tp": 1}]
LIBRARY_SHAPES = [{"dp": 2, "cp": 2, "tp": 2}, {"pp": 2, "dp": 3, "tp": 2},
                  {"dp": 2, "pp": 3, "cp": 2, "tp": 2}, {"x": 3, "y": 1, "z": 4}, {"dp": 5}]


def torch_mesh_on_rank(shapes: list[dict[str, int]]) -> list[dict]:
    """On every rank: for each shape, this rank's coordinates and the world ranks of its group
    along each dimension, from torch's ``init_device_mesh``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    out = []
    for shape in shapes:
        mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
        out.append({"coords": dict(zip(shape, map(int, mesh.get_coordinate()), strict=True)),
                    "groups": {name: dist.get_process_group_ranks(mesh.get_group(name))
                               for name in shape}})
    return out


def library_mesh(rank: int, shape: dict[str, int]) -> dict:
    """Rank ``rank``'s {"coords", "groups"} from ``mesh.coordinates`` and ``mesh.mesh_groups``."""
    return {"coords": M.coordinates(rank, shape),
            "groups": {name: next(g for g in groups if rank in g)
                       for name, groups in M.mesh_groups(shape).items()}}


def mesh_cases(cluster: Any) -> list[tuple[str, dict[str, int], list[dict]]]:
    """(label, shape, each rank's {"coords", "groups"}): torch's on the cluster's ranks, then
    course_lib.mesh's on larger meshes. torch's is measured once."""
    if cluster.n != 4:
        raise ValueError(f"the mesh checks lay out 4 ranks: they need a cluster of 4 engines, "
                         f"this one has {cluster.n}")
    key = ("torch", tuple(tuple(s.items()) for s in TORCH_SHAPES))
    if key not in _MEASURED:
        rows = cluster.run(torch_mesh_on_rank, TORCH_SHAPES)
        _MEASURED[key] = [[rows[r][i] for r in range(len(rows))]
                          for i in range(len(TORCH_SHAPES))]
    cases = []
    for shape, ranks in zip(TORCH_SHAPES, _MEASURED[key], strict=True):
        for r, row in enumerate(ranks):  # the library itself, against torch
            if row != library_mesh(r, shape):
                raise RuntimeError(f"init_device_mesh{shape} on rank {r}: {row}; "
                                   f"course_lib.mesh disagrees")
        cases.append(("init_device_mesh on the cluster's 4 ranks", shape, ranks))
    for shape in LIBRARY_SHAPES:
        ranks = [library_mesh(r, shape) for r in range(math.prod(shape.values()))]
        cases.append((f"mesh.coordinates / mesh.mesh_groups, {len(ranks)} ranks", shape, ranks))
    return cases


def _as_coords(got: Any, shape: dict[str, int]) -> dict | None:
    """A dict {name: int}, or None when ``got`` is not one (a number that is not whole is not
    an int: a coordinate computed with / instead of //)."""
    if not isinstance(got, dict) or set(got) != set(shape):
        return None
    try:
        if any(float(got[name]) != int(got[name]) for name in shape):
            return None
        return {name: int(got[name]) for name in shape}
    except (TypeError, ValueError, OverflowError):
        return None


def _key_order(where: str, got: dict, shape: dict[str, int], what: str) -> None:
    """The dict's keys must come in the mesh's order: a mesh's dimensions are ordered."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    if list(got) != list(shape):
        raise CheckFailed(f"{where}\n  the right {what}, but keyed {list(got)}: the mesh's "
                          f"dimensions are {list(shape)}, in that order\nHint: a mesh's "
                          f"dimensions are ordered (the last varies fastest), and code that "
                          f"reads the dict's values in order, as a mesh's coordinates, would mix "
                          f"them up: build the dict in shape's order.")


def column_major_coordinates(rank: int, shape: dict[str, int]) -> dict[str, int]:
    """The first dimension fastest (Fortran order): the usual wrong layout."""
    return dict(zip(shape, map(int, np.unravel_index(rank, list(shape.values()), order="F")),
                    strict=True))


def _table(shape: dict[str, int], fn: Callable[[int], Any], ranks: int = 8) -> str:
    n = math.prod(shape.values())
    rows = [f"    rank {r}: {fn(r)}" for r in range(min(n, ranks))]
    return "\n".join(rows + ([f"    ... ({n} ranks)"] if n > ranks else []))


def _coordinate_rule(shape: dict[str, int]) -> str:
    sizes = list(shape.values())
    strides = ", ".join(f"{name}: {math.prod(sizes[i + 1:])}" for i, name in enumerate(shape))
    return ("rank r's coordinate along dimension i is (r // stride_i) % size_i, stride_i the "
            f"product of the sizes after i (here {strides})")


def _coordinate_mistakes(rank: int, shape: dict[str, int], coords: dict, want: dict
                         ) -> dict[str, str]:
    """Every usual mistake that gives ``coords`` for ``rank``, with its hint."""
    rule, names = _coordinate_rule(shape), list(shape)
    out = {}
    if coords == column_major_coordinates(rank, shape):
        out["column-major"] = (
            f"these are column-major coordinates: the first dimension varies fastest. The mesh "
            f"is row-major, as init_device_mesh lays it out (torch.arange(world_size)"
            f".reshape(sizes)): the LAST dimension varies fastest, so consecutive ranks differ "
            f"in {names[-1]!r}; {rule}.")
    if coords == dict(zip(names, reversed(list(want.values())), strict=True)):
        out["reversed"] = f"the right numbers, under the wrong names: reversed. {rule}."
    if coords == {k: v + 1 for k, v in want.items()}:
        out["one-based"] = f"coordinates count from 0, as ranks do. {rule}."
    if len(shape) > 1 and coords == {k: rank % size for k, size in shape.items()}:
        out["no division"] = (f"every coordinate is rank % size: the rank is not divided by "
                              f"the dimension's stride first, so the dimensions do not move "
                              f"one after the other. {rule}.")
    if len(shape) > 1 and coords == {k: rank // size % size for k, size in shape.items()}:
        out["by its size"] = (f"each coordinate is (rank // size) % size: divided by the "
                              f"dimension's own size, not by its stride. {rule}.")
    over = [k for k, v in coords.items() if not 0 <= v < shape[k]]
    if over:
        out["out of range"] = (f"coordinate {over[0]!r} = {coords[over[0]]} is outside 0 .. "
                               f"{shape[over[0]] - 1}: take it modulo the size. {rule}.")
    return out


def _explain(failures: list[dict[str, str]], fallback: str) -> str:
    """The hint of the first usual mistake that explains every failure of a case (a pattern
    over all the ranks tells apart mistakes that coincide on one rank), else the first
    failure's first, else ``fallback``."""
    for mistake in failures[0]:
        if all(mistake in f for f in failures):
            return failures[0][mistake]
    if len(failures) > 1 and any(not f for f in failures[1:]):  # no usual mistake explains all
        return fallback
    return next(iter(failures[0].values()), fallback)


def check_coordinates(student_fn: Callable, cluster: Any) -> bool:
    """Lab 16, exercise 2: ``my_coordinates(rank, shape)`` returns ``{name: coordinate}`` as
    torch's ``init_device_mesh`` gives each of the cluster's ranks, and as ``mesh.coordinates``
    for larger meshes. Prints a pass line and returns True, returns False while the function
    raises NotImplementedError, raises ``CheckFailed`` otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = mesh_cases(cluster)
    for number, (label, shape, ranks) in enumerate(cases, start=1):
        failures, first = [], None
        for rank, row in enumerate(ranks):
            where = (f"check_coordinates: case {number}/{len(cases)} ({label})\n  "
                     f"my_coordinates({rank}, {shape})")
            try:
                got = student_fn(rank, dict(shape))
            except NotImplementedError:
                return not_implemented("check_coordinates")
            except Exception as err:  # a crash in the student's code: a failed check
                raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: "
                                  f"{err}\nHint: shape is a dict {{name: size}}, in order; the "
                                  f"last dimension varies fastest.") from err
            coords = _as_coords(got, shape)
            if coords == row["coords"]:
                _key_order(where, got, shape, "coordinates")
                continue
            told = f"{where}\n  expected {row['coords']}, got {got!r}\nHint: "
            fractional = isinstance(got, dict) and set(got) == set(shape) and next(
                (k for k in shape if isinstance(got[k], float) and not got[k].is_integer()), None)
            if fractional:
                raise CheckFailed(f"{told}coordinate {fractional!r} is {got[fractional]}, not a "
                                  f"whole number: / divides into a float; a coordinate counts "
                                  f"whole steps (//).")
            if coords is None:
                names = ", ".join(repr(n) for n in shape)
                if isinstance(got, (list, tuple)) and len(got) == len(shape):
                    raise CheckFailed(f"{told}return a dict of the dimension names, {{{names}}},"
                                      f" to coordinates, not a {type(got).__name__}: "
                                      f"dict(zip(shape, coords)).")
                raise CheckFailed(f"{told}return a dict with one int per dimension, keys "
                                  f"{list(shape)}, e.g. {row['coords']}.")
            failures.append(_coordinate_mistakes(rank, shape, coords, row["coords"]))
            first = first or told
        if failures:
            table = _table(shape, lambda r, shape=shape: M.coordinates(r, shape))
            raise CheckFailed(first + _explain(failures, f"{_coordinate_rule(shape)}. Here "
                                                         f"every rank, row-major:\n{table}"))
    print(f"✓ check_coordinates: every rank of {len(cases)} meshes matches "
          f"({len(TORCH_SHAPES)} against init_device_mesh on the cluster, "
          f"{len(LIBRARY_SHAPES)} against mesh.coordinates, up to "
          f"{max(math.prod(s.values()) for s in LIBRARY_SHAPES)} ranks)")
    return True


def sharing_coordinate(rank: int, shape: dict[str, int], name: str) -> list[int]:
    """The ranks whose coordinate along ``name`` equals this rank's: the usual confusion with
    its group (the ranks that differ from it along ``name`` alone)."""
    mine = M.coordinates(rank, shape)[name]
    return [r for r in range(math.prod(shape.values())) if M.coordinates(r, shape)[name] == mine]


def column_major_group(rank: int, shape: dict[str, int], name: str) -> list[int]:
    """This rank's group along ``name`` when the ranks are laid out column-major."""
    grid = np.arange(math.prod(shape.values())).reshape(list(shape.values()), order="F")
    i = list(shape).index(name)
    rows = np.moveaxis(grid, i, -1).reshape(-1, shape[name]).tolist()
    return next(g for g in rows if rank in g)


def _group_rule(shape: dict[str, int], name: str) -> str:
    stride = math.prod(list(shape.values())[list(shape).index(name) + 1:])
    return (f"a rank's group along {name!r} is the {shape[name]} ranks that differ from it in "
            f"{name!r} alone: the coordinate along {name!r} changes every {stride} rank(s) "
            f"(the product of the sizes after it), so the group of rank r is r - c * {stride} "
            f"+ j * {stride}, j = 0 .. {shape[name] - 1}, c its coordinate along {name!r}")


def _group_mistakes(rank: int, shape: dict[str, int], name: str, got: list, want: list,
                    groups: dict[str, list[int]]) -> dict[str, str]:
    """Every usual mistake that gives ``got`` as ``rank``'s group along ``name``, with its
    hint, the more telling first."""
    rule, out = _group_rule(shape, name), {}
    others = [o for o in shape if o != name and got == groups[o]]
    if sorted(got) == sorted(w for w in want if w != rank):
        out["missing itself"] = (f"rank {rank} is missing from its own group: a group holds "
                                 f"every rank along the dimension, this one included ({want}).")
    if sorted(got) == sorted(want):
        out["order"] = (f"the right ranks in the wrong order: a group lists its ranks by their "
                        f"coordinate along {name!r}, ascending ({want}), so that a rank's place "
                        f"in it is its coordinate.")
    if got == list(range(shape[name])):
        out["positions"] = (f"those are the positions 0 .. {shape[name] - 1} within a group; "
                            f"the group is the world ranks at those positions: {rule}.")
    if got == [rank // shape[name] * shape[name] + j for j in range(shape[name])]:
        last = list(shape)[-1]
        out["consecutive"] = (f"consecutive ranks form the groups of the last dimension only "
                              f"({last!r}); {rule}.")
    if got == column_major_group(rank, shape, name):
        also = f" (it is also its group along {others[0]!r})" if others else ""
        out["column-major"] = (f"that is rank {rank}'s group along {name!r} when the ranks are "
                               f"laid out column-major, the first dimension fastest{also}. The "
                               f"mesh is row-major, the last dimension fastest, as "
                               f"init_device_mesh: {rule}.")
    if others:
        out["other dimension"] = (f"that is rank {rank}'s group along {others[0]!r}, not along "
                                  f"{name!r}: {rule}.")
    world = math.prod(shape.values())
    outside = [r for r in got if not 0 <= r < world]
    if outside:
        out["outside"] = (f"rank {outside[0]} is outside the mesh (ranks 0 .. {world - 1}): "
                          f"{rule}.")
    stride = math.prod(list(shape.values())[list(shape).index(name) + 1:])
    if rank and got == [rank + j * stride for j in range(shape[name])] and got != want:
        out["from the rank"] = (f"the group starts at rank {rank} itself: it starts at the rank "
                                f"whose coordinate along {name!r} is 0. {rule}.")
    if rank and got == library_mesh(0, shape)["groups"][name] and got != want:
        out["rank 0's"] = (f"that is rank 0's group along {name!r}, whatever the rank: the "
                           f"group depends on rank {rank}'s own coordinates. {rule}.")
    if got == sharing_coordinate(rank, shape, name):
        out["sharing"] = (f"those are the ranks that share rank {rank}'s coordinate along "
                          f"{name!r} (they differ from it in the other dimensions); {rule}.")
    return out


def check_groups(student_fn: Callable, cluster: Any) -> bool:
    """Lab 16, exercise 2: ``my_groups(rank, shape)`` returns ``{name: [world ranks of its
    group along name]}`` as torch's ``init_device_mesh`` gives each of the cluster's ranks, and
    as ``mesh.mesh_groups`` for larger meshes. Prints a pass line and returns True, returns
    False while the function raises NotImplementedError, raises ``CheckFailed`` otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = mesh_cases(cluster)
    for number, (label, shape, ranks) in enumerate(cases, start=1):
        failures, first = [], None
        for rank, row in enumerate(ranks):
            where = (f"check_groups: case {number}/{len(cases)} ({label})\n  "
                     f"my_groups({rank}, {shape})")
            try:
                got = student_fn(rank, dict(shape))
            except NotImplementedError:
                return not_implemented("check_groups")
            except Exception as err:  # a crash in the student's code: a failed check
                raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: "
                                  f"{err}\nHint: shape is a dict {{name: size}}, in order; the "
                                  f"last dimension varies fastest.") from err
            if not isinstance(got, dict) or set(got) != set(shape):
                raise CheckFailed(f"{where}\n  expected {row['groups']}, got {got!r}\nHint: "
                                  f"return a dict with one list of world ranks per dimension, "
                                  f"keys {list(shape)}.")
            for name in shape:
                want = row["groups"][name]
                try:
                    mine = [int(r) for r in got[name]]
                except (TypeError, ValueError):
                    every = isinstance(got[name], (list, tuple)) and any(
                        isinstance(g, (list, tuple)) and list(g) == want for g in got[name])
                    hint = (f"that is every group along {name!r}: return only the one that "
                            f"holds rank {rank}." if every else
                            "each group is a list of ints, the world ranks.")
                    raise CheckFailed(f"{where}\n  along {name!r}: expected {want}, got "
                                      f"{got[name]!r:.200}\nHint: {hint}") from None
                if mine != want:
                    failures.append(_group_mistakes(rank, shape, name, mine, want,
                                                    row["groups"]))
                    first = first or (f"{where}\n  along {name!r}: expected {want}, got "
                                      f"{got[name]!r}\nHint: ", name)
        if failures:
            told, name = first
            raise CheckFailed(told + _explain(failures, f"{_group_rule(shape, name)}."))
        for rank in range(len(ranks)):
            _key_order(f"check_groups: case {number}/{len(cases)} ({label})\n  my_groups("
                       f"{rank}, {shape})", student_fn(rank, dict(shape)), shape, "groups")
    print(f"✓ check_groups: every rank's groups along every dimension of {len(cases)} meshes "
          f"match ({len(TORCH_SHAPES)} against init_device_mesh on the cluster, "
          f"{len(LIBRARY_SHAPES)} against mesh.mesh_groups)")
    return True


# ---------------------------------------------------------------- exercise 3: FP8 per block
def _fp8_cases():
    """(label, x, block): each a mistake's trap."""
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(4, 16, generator=g)
    mixed[:, 3] *= 1e4  # an outlier in the first block of each row
    negative = -torch.rand(2, 8, generator=g) - 1  # every number negative
    zeros = torch.randn(2, 8, generator=g)
    zeros[1, 4:] = 0  # a block of zeros
    return [("2 rows of 8, blocks of 4", torch.randn(2, 8, generator=g), 4),
            ("an outlier in one block of each row", mixed, 8),
            ("every number negative", negative, 4),
            ("a block of zeros", zeros, 4),
            ("numbers far beyond 448", 1e4 * torch.randn(3, 8, generator=g), 8),
            ("3-D activations (batch, tokens, features)", torch.randn(2, 3, 8, generator=g), 4)]


def _fp8_hint(x, block, q, scales):
    """Which usual mistake a wrong (q, scales) is."""
    from course_lib import precision
    rows = x.float().unflatten(-1, (-1, block))
    amax = rows.abs().amax(-1)
    right = (amax / 448).clamp(min=torch.finfo(torch.float32).tiny)
    if torch.isnan(scales).any() or torch.isnan(q.float()).any():
        return ("a NaN: a block of zeros has amax 0, and 0/0 is NaN. Give such a block a "
                "positive scale (clamp amax / 448 from below by a tiny positive number).")
    if torch.allclose(scales, 448 / amax.clamp(min=1e-30), rtol=1e-5):
        return "the scale is upside down: scale = amax / 448, and q = x / scale."
    if torch.allclose(scales, torch.full_like(scales, float(x.abs().max()) / 448), rtol=1e-5):
        return ("every block has the tensor's scale: take the amax of each block of `block` "
                "numbers along the last dimension (x.unflatten(-1, (-1, block))).")
    if torch.allclose(scales, (rows.amax(-1) / 448), rtol=1e-5):
        return ("amax is the largest *magnitude*: x.abs() before the max (a block may be all "
                "negative).")
    if torch.allclose(scales, right, rtol=1e-5):
        back = precision.from_fp8(q, scales, block)
        if torch.allclose(back, x.float(), rtol=1 / 8):
            return "the scales are right; cast x / scale to torch.float8_e4m3fn (round to nearest)."
        return ("the scales are right but q is not x / scale in e4m3: divide each block by its "
                "own scale (scales.unsqueeze(-1) against the blocks) and cast.")
    return "scale = (amax of each block) / 448 along the last dimension, q = (x / scale) in e4m3."


def check_to_fp8_blocks(student_fn: Callable) -> bool:
    """Lab 16, exercise 3: ``to_fp8_blocks(x, block)`` returns ``(q, scales)``, x's numbers in
    e4m3 with one float32 scale per ``block`` consecutive numbers of a row, as
    ``course_lib.precision.to_fp8(x, "e4m3", block)``; compared bitwise, a wrong answer named."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib import precision
    name = "check_to_fp8_blocks"
    cases = _fp8_cases()
    for number, (label, x, block) in enumerate(cases, start=1):
        where = (f"{name}: case {number}/{len(cases)} ({label}, shape {tuple(x.shape)}, "
                 f"block {block})")
        try:
            got = student_fn(x.clone(), block)
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              "Hint: split the last dimension into blocks with "
                              "x.unflatten(-1, (-1, block)).") from err
        want_q, want_scales = precision.to_fp8(x, "e4m3", block)
        if not (isinstance(got, tuple) and len(got) == 2 and all(map(torch.is_tensor, got))):
            raise CheckFailed(f"{where}\n  your function returned {type(got).__name__}\nHint: "
                              "return (q, scales): two tensors.")
        q, scales = got
        if q.dtype != torch.float8_e4m3fn or q.shape != x.shape:
            raise CheckFailed(f"{where}\n  q is {q.dtype} of shape {tuple(q.shape)}, expected "
                              f"torch.float8_e4m3fn of shape {tuple(x.shape)}\nHint: q = "
                              "(blocks / scales).to(torch.float8_e4m3fn), back in x's shape.")
        if scales.shape != want_scales.shape:
            raise CheckFailed(f"{where}\n  scales has shape {tuple(scales.shape)}, expected "
                              f"{tuple(want_scales.shape)} (one per block of each row)")
        scales = scales.float()
        if torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and \
                torch.allclose(scales, want_scales, rtol=1e-6, atol=0):
            continue
        error = precision.relative_error(precision.from_fp8(q, scales, block), x)
        right = precision.relative_error(precision.from_fp8(want_q, want_scales, block), x)
        raise CheckFailed(f"{where}\n  your q * scales is {error:.3g} away from x (relative), "
                          f"the right cast's {right:.3g}\nHint: {_fp8_hint(x, block, q, scales)}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} tensors cast as course_lib.precision.to_fp8 "
          f"casts them (q bit for bit)")
    return True
