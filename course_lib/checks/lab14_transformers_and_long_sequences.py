"""Checks for labs/14_transformers_and_long_sequences.ipynb: the online-softmax merge and the
zig-zag assignment of ring attention (notebook 14).

In the lab, right under each exercise::

    from course_lib.checks import lab14_transformers_and_long_sequences as checks
    checks.check_merge(merge)            # random partial blocks, then a 2-rank ring attention
    checks.check_zigzag(zigzag_positions)
    checks.check_tiled_attention(tiled_attention)

The first compares a student's merge with ``context_parallel.merge`` on random partial results
(large scores, queries that see no key of a block), then runs ring attention on two ranks (threads
of this process) with the student's merge and compares the output with one process. The second
compares the assignment with ``context_parallel.zigzag_positions`` and measures its balance. The
third compares a tiled causal attention's forward with FlashAttention's (``flash_attention``, and
so torch's own attention) on tiles that do and do not divide the sequence and on scores large
enough to overflow, and names the usual mistakes by replaying them on the failing case.
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
from course_lib.flash_attention import flash_attention


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


_MERGE_CASES = [("random blocks", 0, 1.0, "none"),
                ("scores up to 1000: e^1000 overflows float64", 1, 300.0, "none"),
                ("queries that see none of the first block", 2, 1.0, "a"),
                ("queries that see none of either block", 3, 1.0, "both"),
                ("large scores and empty rows", 4, 300.0, "a")]


MERGE_HINT = ("the merged (out, lse) is what attention over both blocks' keys together gives: "
              "compare yours with the formula of the exercise, term by term.")


def _diagnose_merge(expected: tuple, got: Any, args: tuple) -> str | None:
    out_a, lse_a, out_b, lse_b = args
    try:
        out, lse = (torch.as_tensor(x) for x in got)
    except (TypeError, ValueError):
        return None
    want_out, want_lse = expected
    empty = torch.isinf(lse_a) & torch.isinf(lse_b)  # queries that see no key at all
    if out.shape == want_out.shape and not torch.isfinite(out).all():
        bad = ~torch.isfinite(out).all(dim=-1)
        if (bad <= empty).all():
            return ("your output is nan exactly for the queries that see no key of either "
                    "block (lse_a = lse_b = -inf, so lse = -inf too): -inf - (-inf) is nan. Such "
                    "a query's output must be 0.")
        return ("your output has inf or nan for queries that see keys: exp of a large lse "
                "overflows (e^710 is inf in float64). Compute each weight from a difference of "
                "logs, never from exp(lse) itself.")
    if lse.shape == want_lse.shape and torch.isposinf(lse).any():
        return ("your lse is +inf for large scores: exp(lse_a) overflows before the log brings "
                "it back. The log of a sum of exponentials has a stable form (torch.logaddexp).")
    if lse.shape == want_lse.shape and torch.allclose(lse, want_lse, rtol=1e-9, atol=1e-12):
        if out.shape != want_out.shape:
            return None
        if torch.allclose(out, out_a + out_b):
            return ("lse is right, but out is out_a + out_b: each part's output is normalised "
                    "over its own keys, so each must be weighted by its share of the total "
                    "denominator.")
        if torch.allclose(out, (out_a + out_b) / 2):
            return ("lse is right, but out gives both parts the same weight 1/2: a part's "
                    "weight is its share of the total denominator, not one half.")
        w_a = torch.exp(lse_a - want_lse.clamp_min(-1e300)).unsqueeze(-1)
        w_b = torch.exp(lse_b - want_lse.clamp_min(-1e300)).unsqueeze(-1)
        if torch.allclose(out, w_b * out_a + w_a * out_b):
            return ("lse is right, but the weights are swapped: out_a is weighted by block b's "
                    "share and out_b by block a's.")
        return "lse is right, but out is not: look at the weight of each part."
    if lse.shape == want_lse.shape:
        if torch.allclose(lse, torch.maximum(lse_a, lse_b)):
            return ("the merged lse is the log of the sum of both denominators, not the larger "
                    "of the two logs.")
        if torch.allclose(lse, lse_a + lse_b):
            return ("your lse is lse_a + lse_b: the log of the product of the two denominators. "
                    "The merged denominator is their sum.")
    return None


def _shapes_told(student_fn: Callable) -> Callable:
    """The student's merge, with a broadcasting error turned into what it means."""
    def merge(out_a, lse_a, out_b, lse_b):
        try:
            return student_fn(out_a, lse_a, out_b, lse_b)
        except RuntimeError as err:
            if "must match the size" not in str(err):
                raise
            raise CheckFailed(f"your merge raised RuntimeError: {err}\n  out_a and out_b have "
                              f"shape {tuple(out_a.shape)} (..., T, d), lse_a and lse_b "
                              f"{tuple(lse_a.shape)} (..., T): a weight per query does not "
                              f"broadcast against an output per query until it has a last "
                              f"dimension of its own (size 1)") from None
    return merge


def check_merge(student_fn: Callable) -> bool:
    """Lab 14, exercise 1: ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`` equals
    ``context_parallel.merge`` on 5 cases, then, inside ring attention on 2 ranks, one process."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [Case(label, lambda c=(seed, scale, empty): _partials(*c))
             for label, seed, scale, empty in _MERGE_CASES]
    ok = run_check("check_merge", _shapes_told(student_fn), cp.merge, cases,
                   output_names=("out", "lse"), rtol=1e-9, atol=1e-12, diagnose=_diagnose_merge,
                   hint=MERGE_HINT, inputs_unchanged=True,
                   arg_names=("out_a", "lse_a", "out_b", "lse_b"))
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
_UNEVEN_CASES = [(18, 4), (20, 3), (7, 1)]  # lengths that 2N equal chunks cannot cut


def _as_lists(assignment: Any) -> list[list[int]]:
    return [[int(p) for p in np.asarray(positions).ravel()] for positions in assignment]


def _chunks(ranks: list[list[int]], length: int, n: int) -> str:
    """Which of the 2N chunks each rank holds, when its positions are whole chunks."""
    c = length // (2 * n)
    said = []
    for r, positions in enumerate(ranks):
        held = sorted({p // c for p in positions})
        if sorted(positions) != [p for k in held for p in range(k * c, (k + 1) * c)]:
            return ""
        said.append(f"rank {r}: chunk{'s' if len(held) > 1 else ''} "
                    f"{', '.join(map(str, held))}")
    return f" (of the {2 * n} chunks of {c} positions, yours gives {'; '.join(said)})"


def _diagnose_zigzag(expected: Any, got: Any, args: tuple) -> str | None:
    length, n = args
    try:
        got = _as_lists(got)
    except (TypeError, ValueError):
        return "return one list (or tensor) of positions per rank."
    if len(got) != n:
        return (f"return one tensor of positions per rank, in rank order: {len(got)} items for "
                f"world_size = {n}.")
    flat = sorted(p for ranks in got for p in ranks)
    outside = sorted({p for p in flat if not 0 <= p < length})
    if outside:
        return (f"positions {outside[:5]} are outside the sequence (0 to {length - 1}): each "
                f"chunk is length / (2N) = {length // (2 * n)} positions long.")
    if flat != list(range(length)):
        twice = sorted({p for p in flat if flat.count(p) > 1})
        missing = sorted(set(range(length)) - set(flat))
        return (f"every position must be on exactly one rank: {twice[:5]} assigned twice, "
                f"{missing[:5]} missing{_chunks(got, length, n)}.")
    unsorted = [r for r, p in enumerate(got) if p != sorted(p)]
    if unsorted:
        return (f"rank {unsorted[0]}'s positions are not in increasing order "
                f"({got[unsorted[0]][:8]}{' ...' if len(got[unsorted[0]]) > 8 else ''}): a "
                f"rank's own positions must be in sequence order, as its tokens are.")
    want = _as_lists(expected)
    if sorted(map(tuple, got)) == sorted(map(tuple, want)):
        return ("every rank's set of positions is one the zig-zag gives, but not on the right "
                f"rank{_chunks(got, length, n)}: the list is in rank order.")
    work = [sum(cp.causal_pairs(torch.tensor(p), torch.tensor(q)) for q in got) for p in got]
    if len(set(work)) > 1:
        return (f"the causal work per rank is {work}, not balanced{_chunks(got, length, n)}: "
                f"the rank that holds the earliest positions must also hold the latest.")
    return None


def check_zigzag(student_fn: Callable) -> bool:
    """Lab 14, exercise 2: ``zigzag_positions(length, world_size)`` gives rank r chunks r and
    2N-1-r of 2N, each rank's positions in increasing order, on 5 cases (every rank's causal
    work equal, measured in query-key pairs); lengths that 2N chunks cannot cut raise
    ValueError."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_zigzag"
    cases = [Case(f"length={length}, world_size={n}", lambda c=(length, n): c)
             for length, n in _ZIGZAG_CASES]
    ok = run_check(name, lambda *a: _as_lists(student_fn(*a)),
                   lambda *a: _as_lists(cp.zigzag_positions(*a)), cases,
                   result_name="positions per rank", diagnose=_diagnose_zigzag,
                   hint="compare your ranks' positions with the expected ones above, rank by "
                        "rank.")
    if not ok:
        return False
    for length, n in _UNEVEN_CASES:
        where = f"{name}: length={length}, world_size={n} ({2 * n} chunks do not cut {length})"
        try:
            got = student_fn(length, n)
        except ValueError:
            continue
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              f"Hint: a length that does not divide is a wrong argument: "
                              f"raise ValueError, the exception Python uses for one (an "
                              f"assert disappears under python -O).") from err
        try:
            sizes = [len(_as_lists([p])[0]) for p in got]
        except (TypeError, ValueError):
            sizes = "?"
        raise CheckFailed(f"{where}\n  your function returned positions for {n} ranks "
                          f"(sizes {sizes}) instead of raising ValueError\nHint: {length} "
                          f"positions do not cut into {2 * n} equal chunks: some positions would "
                          f"be lost, or the chunks unequal and the balance gone. The exercise "
                          f"asks to refuse such a length.")
    print(f"✓ {name}: lengths that {', '.join(str(2 * n) for _, n in _UNEVEN_CASES)} chunks "
          f"cannot cut raise ValueError")
    return True


# ---------------------------------------------------------------- exercise 3: the tiled forward
def _qkv(seed: int, length: int, scale: float, late_keys_loud: bool) -> tuple:
    """q, k, v (1, 2, length, 4) float64; ``scale`` multiplies q (scores of hundreds overflow
    exp); ``late_keys_loud``: each key's size grows with its position, so the keys a causal mask
    hides score highest."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, length, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    if late_keys_loud:
        k = k.abs() * torch.arange(1, length + 1, dtype=torch.float64)[:, None]
        q = q.abs()
    return q * scale, k, v


_TILED_CASES = [("T = 16, tiles of 4", 0, 16, 4, 1.0, False),
                ("T = 19, tiles of 4: the last tile has 3", 1, 19, 4, 1.0, False),
                ("tiles of 1: one key at a time", 2, 9, 1, 1.0, False),
                ("a tile longer than the sequence: one tile", 3, 7, 32, 1.0, False),
                ("scores near a thousand: e^710 overflows float64", 4, 19, 4, 500.0, False),
                ("the keys a query may not see score highest", 5, 19, 4, 60.0, True)]


def _tiled_reference(q, k, v, block):
    with torch.no_grad():
        return flash_attention(q, k, v, causal=True, block=block)


def _mistaken(q, k, v, block, mistake):
    """The tiled forward with one of the usual mistakes, to name the one a student made."""
    T, scale = q.shape[-2], 1 / q.shape[-1] ** 0.5
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for i in range(0, T, block):
        qi = q[..., i:i + block, :]
        m = q.new_full(qi.shape[:-1], float("-inf"))
        denom, acc = q.new_zeros(qi.shape[:-1]), torch.zeros_like(qi)
        for j in range(0, T, block):
            s = qi @ k[..., j:j + block, :].transpose(-2, -1) * scale
            future = (torch.arange(j, j + s.shape[-1])[None, :]
                      > torch.arange(i, i + s.shape[-2])[:, None])
            if mistake == "diagonal hidden":
                future = future | (torch.arange(j, j + s.shape[-1])[None, :]
                                   == torch.arange(i, i + s.shape[-2])[:, None])
            if mistake not in ("no mask", "mask after exp"):
                s = s.masked_fill(future, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            if mistake == "no max":
                m_new = torch.zeros_like(m_new)
            p = torch.exp(s - m_new.unsqueeze(-1))
            if mistake == "mask after exp":
                p = p.masked_fill(future, 0.0)
            rescale = torch.exp(m_new - m if mistake == "rescale inverted" else m - m_new)
            denom = (denom if mistake == "sum not rescaled" else rescale * denom) + p.sum(-1)
            acc = (acc if mistake == "output not rescaled" else rescale.unsqueeze(-1) * acc) \
                + p @ v[..., j:j + block, :]
            if mistake == "normalised each tile":
                acc = acc / denom.unsqueeze(-1)
                denom = torch.ones_like(denom)
            m = m_new
        out[..., i:i + block, :] = acc / denom.unsqueeze(-1)
        lse[..., i:i + block] = (0 if mistake == "lse without max" else m) + torch.log(denom)
    return out, lse


_TILED_HINTS = {
    "sum not rescaled": "your running sum of exponentials is not rescaled when a tile raises the "
                        "maximum: the terms summed before were taken relative to the old maximum, "
                        "and are worth exp(m - m_new) of that now.",
    "output not rescaled": "your running output is not rescaled when a tile raises the maximum "
                           "(the sum is): both were accumulated relative to the old maximum.",
    "rescale inverted": "you rescale by exp(m_new - m), the inverse: a higher maximum makes the "
                        "old terms worth less, not more.",
    "no max": "your exponentials overflow: exp of a score above 709 is inf in float64. The "
              "running maximum is there to be taken out of every score before the exponent.",
    "mask after exp": "you hide the future keys after the exponent: their scores still set the "
                      "maximum, and when they are the largest every visible term underflows to "
                      "0. Hide them before the maximum is taken (a score of -inf).",
    "no mask": "every query sees every key: the attention is causal, a query at position t "
               "sees keys 0..t only.",
    "diagonal hidden": "a query does not see its own key: causal attention hides only the keys "
                       "AFTER a query's position.",
    "normalised each tile": "you normalise the output at every tile and restart the sum: the "
                            "next tiles then weigh as much as all the tiles before together. "
                            "Divide once, after the last tile.",
    "lse without max": "the output is right, but lse is the log of the sum alone: the sum was "
                       "taken relative to the running maximum, which lse must add back.",
}


def _diagnose_tiled(expected: tuple, got: Any, args: tuple) -> str | None:
    try:
        out, lse = (torch.as_tensor(x) for x in got)
    except (TypeError, ValueError):
        return None
    for mistake, hint in _TILED_HINTS.items():
        want_out, want_lse = _mistaken(*args, mistake)
        if out.shape == want_out.shape and lse.shape == want_lse.shape and torch.allclose(
                out, want_out, rtol=1e-9, atol=1e-12, equal_nan=True) and torch.allclose(
                lse, want_lse, rtol=1e-9, atol=1e-12, equal_nan=True):
            return hint
    if out.shape == expected[0].shape and not torch.isfinite(out).all():
        return ("your output has inf or nan: an exponent overflowed (a score not taken relative "
                "to the running maximum) or a sum was 0 (every term underflowed).")
    return None


def check_tiled_attention(student_fn: Callable) -> bool:
    """Lab 14, exercise 3: ``tiled_attention(q, k, v, block) -> (out, lse)``, causal attention
    computed one tile of ``block`` queries by ``block`` keys at a time, equals FlashAttention's
    forward (and torch's attention) on 6 cases; the usual mistakes are named."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [Case(label, lambda c=(seed, length, scale, loud, block): (
        *_qkv(*c[:4]), c[4])) for label, seed, length, block, scale, loud in _TILED_CASES]
    return run_check("check_tiled_attention", student_fn, _tiled_reference, cases,
                     output_names=("out", "lse"), rtol=1e-9, atol=1e-12,
                     diagnose=_diagnose_tiled, inputs_unchanged=True,
                     arg_names=("q", "k", "v", "block"),
                     hint="compare your update with the three lines of the exercise, one "
                          "term at a time, on a tile where the maximum rises.")
