"""Checks for labs/14_transformers_and_long_sequences.ipynb: the online-softmax merge and the
zig-zag assignment of ring attention (notebook 14).

In the lab, right under each exercise::

    from course_lib.checks import lab14_transformers_and_long_sequences as checks
    checks.check_merge(merge)            # random partial blocks, then a 2-rank ring attention
    checks.check_zigzag(zigzag_positions)

The first compares a student's merge with ``context_parallel.merge`` on random partial results
(large scores, queries that see no key of a block), then runs ring attention on two ranks (threads
of this process) with the student's merge and compares the output with one process. The second
compares the assignment with ``context_parallel.zigzag_positions`` and measures its balance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from course_lib import context_parallel as cp
from course_lib import transformer as tf
from course_lib.checks.framework import Case, CheckFailed, not_implemented, run_check
from course_lib.comm import run_ranks


def _partials(seed: int, scale: float, empty: str) -> tuple:
    """Two partial attention results (out, lse) over disjoint keys, from real blocks.
    ``empty``: "none", "a" (the first part sees no key for some queries) or "both"."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 10, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    q = q * scale  # large scores: exp overflows unless the largest is taken out first
    pos = torch.arange(10)
    split = {"none": 0, "a": 4, "both": 4}[empty]
    key_pos_a = pos[:5] + split  # with split = 4 the first 4 queries see none of part a's keys
    a = cp.dense_attention(q, k[..., :5, :], v[..., :5, :], pos, key_pos_a)
    key_pos_b = pos[5:] + (20 if empty == "both" else 0)  # "both": no query sees part b
    b = cp.dense_attention(q, k[..., 5:, :], v[..., 5:, :], pos, key_pos_b)
    return (*a, *b)


_MERGE_CASES = [("random blocks", 0, 1.0, "none"), ("scores around 300", 1, 60.0, "none"),
                ("queries that see none of the first block", 2, 1.0, "a"),
                ("queries that see none of either block", 3, 1.0, "both"),
                ("large scores and empty rows", 4, 60.0, "a")]


def _diagnose_merge(expected: tuple, got: Any, args: tuple) -> str | None:
    out_a, lse_a, out_b, lse_b = args
    try:
        out, lse = (torch.as_tensor(x) for x in got)
    except (TypeError, ValueError):
        return None
    if not torch.isfinite(out).all():
        return ("your output has inf or nan. exp(lse) overflows for large scores, and a query "
                "that sees no key has lse = -inf: take the larger lse out first "
                "(torch.logaddexp does), and give an empty part the weight 0.")
    if torch.allclose(out, out_a + out_b):
        return ("each part's output is normalised over its own keys: weight it by its share "
                "of the total denominator, exp(lse_a - lse) and exp(lse_b - lse).")
    if torch.allclose(lse, torch.maximum(lse_a, lse_b)):
        return "the merged lse is log(exp(lse_a) + exp(lse_b)), not the larger of the two."
    return None


def check_merge(student_fn: Callable) -> bool:
    """Lab 14, exercise 1: ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`` equals
    ``context_parallel.merge`` on 5 cases, then, inside ring attention on 2 ranks, one process."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [Case(label, lambda c=(seed, scale, empty): _partials(*c))
             for label, seed, scale, empty in _MERGE_CASES]
    ok = run_check("check_merge", student_fn, cp.merge, cases, output_names=("out", "lse"),
                   rtol=1e-9, atol=1e-12, diagnose=_diagnose_merge,
                   hint="lse = logaddexp(lse_a, lse_b); out = exp(lse_a - lse) * out_a + "
                        "exp(lse_b - lse) * out_b (the weights broadcast over the last dim).")
    if not ok:
        return False
    return _check_in_ring(student_fn)


def _check_in_ring(student_fn: Callable) -> bool:
    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    pos = cp.contiguous_positions(12, 2)

    def rank(_, comm):
        mine = [t[..., pos[comm.rank], :] for t in (q, k, v)]
        with torch.no_grad():
            return cp.ring_attention(*mine, comm, pos, merge_blocks=student_fn)

    try:
        outs, _ = run_ranks(rank, [None, None], check_sizes=False, timeout=10)
    except NotImplementedError:
        return not_implemented("check_merge")
    got = torch.cat(outs, dim=-2)
    err = float((got - tf.causal_attention(q, k, v)).abs().max())
    if not err < 1e-10:
        raise CheckFailed(f"check_merge: ring attention on 2 ranks with your merge differs from "
                          f"one process by {err:.2e}\nHint: the running result starts as out = 0, "
                          f"lse = -inf (no key yet): merging into it must give the block itself.")
    print(f"✓ check_merge: ring attention on 2 ranks with your merge equals one process "
          f"(largest difference {err:.1e})")
    return True


_ZIGZAG_CASES = [(16, 2), (16, 4), (24, 3), (64, 8), (8, 4)]


def _as_lists(assignment: Any) -> list[list[int]]:
    return [sorted(int(p) for p in np.asarray(positions).ravel()) for positions in assignment]


def _diagnose_zigzag(expected: Any, got: Any, args: tuple) -> str | None:
    length, n = args
    try:
        got = _as_lists(got)
    except (TypeError, ValueError):
        return "return one list (or tensor) of positions per rank."
    flat = sorted(p for ranks in got for p in ranks)
    if flat != list(range(length)):
        twice = sorted({p for p in flat if flat.count(p) > 1})
        missing = sorted(set(range(length)) - set(flat))
        return (f"every position must be on exactly one rank: {twice[:5]} assigned twice, "
                f"{missing[:5]} missing. Rank r holds chunks r and 2N-1-r of 2N chunks.")
    work = [sum(cp.causal_pairs(torch.tensor(p), torch.tensor(q)) for q in got) for p in got]
    if len(set(work)) > 1:
        return (f"the causal work per rank is {work}, not balanced: the late chunk of rank r is "
                f"chunk 2N-1-r (the mirror of chunk r), for N = {n}.")
    return None


def check_zigzag(student_fn: Callable) -> bool:
    """Lab 14, exercise 2: ``zigzag_positions(length, world_size)`` gives rank r chunks r and
    2N-1-r of 2N, on 5 cases, every rank's causal work equal (measured in query-key pairs)."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [Case(f"length={length}, world_size={n}", lambda c=(length, n): c)
             for length, n in _ZIGZAG_CASES]
    return run_check("check_zigzag", lambda *a: _as_lists(student_fn(*a)),
                     lambda *a: _as_lists(cp.zigzag_positions(*a)), cases,
                     result_name="positions per rank", diagnose=_diagnose_zigzag,
                     hint="cut the sequence in 2N chunks of length / 2N; rank r gets chunk r "
                          "and chunk 2N-1-r.")
