"""Lab 14's checks: the reference passes; the usual mistakes get the hint that names them."""

import pytest
import torch

from course_lib import context_parallel as cp
from course_lib.checks import CheckFailed
from course_lib.checks import lab14_transformers_and_long_sequences as checks


def test_the_references_pass(capsys):
    assert checks.check_merge(cp.merge) is True
    assert checks.check_zigzag(cp.zigzag_positions) is True
    assert "cannot cut raise ValueError" in capsys.readouterr().out


def test_not_implemented_is_reported_not_raised():
    def todo(*args):
        raise NotImplementedError("exercise 1: fill in merge")
    assert checks.check_merge(todo) is False
    assert checks.check_zigzag(todo) is False


# ---------------------------------------------------------------- exercise 1: the merge
def naive(out_a, lse_a, out_b, lse_b):
    total = torch.exp(lse_a) + torch.exp(lse_b)   # overflows for scores around 1000
    lse = torch.log(total)
    return (torch.exp(lse_a)[..., None] * out_a + torch.exp(lse_b)[..., None] * out_b) \
        / total[..., None], lse


def stable_weights(lse_a, lse_b, lse):
    return torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)


def empty_rows_nan(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    wa, wb = stable_weights(lse_a, lse_b, lse)        # -inf - -inf = nan where both are empty
    return wa * out_a + wb * out_b, lse


def lse_overflows(out_a, lse_a, out_b, lse_b):
    out, _ = cp.merge(out_a, lse_a, out_b, lse_b)
    return out, torch.log(torch.exp(lse_a) + torch.exp(lse_b))


def unweighted(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)


def averaged(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def swapped(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    wa, wb = stable_weights(lse_a, lse_b, lse.clamp_min(-1e300))
    return wb * out_a + wa * out_b, lse


def lse_the_larger(out_a, lse_a, out_b, lse_b):
    out, _ = cp.merge(out_a, lse_a, out_b, lse_b)
    return out, torch.maximum(lse_a, lse_b)


def lse_the_sum(out_a, lse_a, out_b, lse_b):
    out, _ = cp.merge(out_a, lse_a, out_b, lse_b)
    return out, lse_a + lse_b


def no_unsqueeze(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b, lse


def out_only(out_a, lse_a, out_b, lse_b):
    return cp.merge(out_a, lse_a, out_b, lse_b)[0]


def in_place(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    wa, wb = stable_weights(lse_a, lse_b, lse.clamp_min(-1e300))
    return out_a.mul_(wa).add_(wb * out_b), lse


@pytest.mark.parametrize("merge,hint", [
    (naive, r"case 2/5 \(scores up to 1000: e\^1000 overflows float64\)[\s\S]*Hint: your "
            r"output has inf or nan for queries that see keys: exp of a large lse overflows"),
    (empty_rows_nan, r"case 3/5[\s\S]*Hint: your output is nan exactly for the queries that see "
                     r"no key of either block"),
    (lse_overflows, r"case 2/5[\s\S]*Hint: your lse is \+inf for large scores"),
    (unweighted, r"Hint: lse is right, but out is out_a \+ out_b"),
    (averaged, r"Hint: lse is right, but out gives both parts the same weight 1/2"),
    (swapped, r"Hint: lse is right, but the weights are swapped"),
    (lse_the_larger, r"Hint: the merged lse is the log of the sum of both denominators, not the "
                     r"larger"),
    (lse_the_sum, r"Hint: your lse is lse_a \+ lse_b: the log of the product"),
    (no_unsqueeze, r"your merge raised RuntimeError: .*\n  out_a and out_b have shape "
                   r"\(2, 3, 10, 4\) \(\.\.\., T, d\), lse_a and lse_b \(2, 3, 10\) "
                   r"\(\.\.\., T\): a weight per query does not broadcast"),
    (out_only, r"expected a tuple \(out, lse\), got Tensor"),
    (in_place, r"your function modified its input 'out_a' in place"),
], ids=lambda x: getattr(x, "__name__", ""))
def test_a_wrong_merge_is_told_what_it_did(merge, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_merge(merge)
    assert "logaddexp(lse_a, lse_b); out = exp" not in str(failed.value)  # never the answer


# ---------------------------------------------------------------- exercise 2: the zig-zag
def zigzag(length, n, *, mirror=lambda r, n: 2 * n - 1 - r, chunks=None, late_first=False,
           check=True):
    """The zig-zag, with knobs that turn it into the usual mistakes."""
    k = chunks or 2 * n
    if check and length % (2 * n):
        raise ValueError(f"{length} is not divisible by {2 * n}")
    c = length // k
    ranks = []
    for r in range(n):
        early, late = torch.arange(r * c, (r + 1) * c), \
            torch.arange(mirror(r, n) * c, (mirror(r, n) + 1) * c)
        ranks.append(torch.cat([late, early] if late_first else [early, late]))
    return ranks


def with_knobs(**knobs):
    return lambda length, n: zigzag(length, n, **knobs)


def asserts(length, n):
    assert length % (2 * n) == 0, "length must divide"
    return zigzag(length, n)


@pytest.mark.parametrize("fn,hint", [
    (with_knobs(mirror=lambda r, n: 2 * n - r), r"positions \[16, 17, 18, 19\] are outside the "
                                                r"sequence \(0 to 15\)"),
    (with_knobs(mirror=lambda r, n: 2 * n - 2 - r), r"every position must be on exactly one "
                                                    r"rank: \[4, 5, 6, 7\] assigned twice, "
                                                    r"\[12, 13, 14, 15\] missing"),
    (lambda length, n: list(cp.contiguous_positions(length, n)),
     r"the causal work per rank is \[\d+, \d+\], not balanced \(of the 4 chunks of 4 positions, "
     r"yours gives rank 0: chunks 0, 1; rank 1: chunks 2, 3\): the rank that holds the earliest"),
    (with_knobs(late_first=True), r"rank 0's positions are not in increasing order \(\[12, 13, "
                                  r"14, 15, 0, 1, 2, 3\]\)"),
    (with_knobs(check=False), r"length=18, world_size=4 \(8 chunks do not cut 18\)\n  your "
                              r"function returned positions for 4 ranks \(sizes \[4, 4, 4, 4\]\) "
                              r"instead of raising ValueError"),
    (asserts, r"your function raised AssertionError: length must divide[\s\S]*\nHint: a "
              r"length that does not divide is a wrong argument: raise ValueError"),
    (lambda length, n: zigzag(length, n)[::-1],
     r"every rank's set of positions is one the zig-zag gives, but not on the right rank"),
    (with_knobs(chunks=2, mirror=lambda r, n: n + r),  # chunk size length / N
     r"positions \[16, 17, 18, 19, 20\] are outside the sequence \(0 to 15\)"),
    (with_knobs(mirror=lambda r, n: n + r), r"not balanced \(of the 4 chunks of 4 positions, yours "
                                            r"gives rank 0: chunks 0, 2; rank 1: chunks 1, 3\)"),
    (lambda length, n: torch.cat(zigzag(length, n)), r"16 items for world_size = 2"),
], ids=["mirror off by one", "mirror off by two", "contiguous", "late chunk first",
        "no ValueError", "assert", "ranks reversed", "chunks of length / N", "striped halves",
        "one flat tensor"])
def test_a_wrong_zigzag_is_told_what_it_did(fn, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_zigzag(fn)
    assert "rank r gets chunk r" not in str(failed.value)  # never the answer


# ---------------------------------------------------------------- exercise 3: the tiled forward
def tiled_with(rescale_sum=True, rescale_output=True, inverted=False, subtract_max=True,
               mask="before the max", divide="at the end", lse_adds_max=True):
    """A student's tiled forward with knobs for the usual mistakes."""
    def tiled_attention(q, k, v, block):
        T, scale = q.shape[-2], q.shape[-1] ** -0.5
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
        for i in range(0, T, block):
            qi = q[..., i:i + block, :]
            m = torch.full(qi.shape[:-1], -torch.inf, dtype=q.dtype)
            total, acc = torch.zeros(qi.shape[:-1], dtype=q.dtype), torch.zeros_like(qi)
            for j in range(0, T, block):
                s = qi @ k[..., j:j + block, :].transpose(-2, -1) * scale
                later = (torch.arange(j, j + s.shape[-1])[None, :]
                         > torch.arange(i, i + s.shape[-2])[:, None])
                if mask == "own key too":
                    later = later | (torch.arange(j, j + s.shape[-1])[None, :]
                                     == torch.arange(i, i + s.shape[-2])[:, None])
                if mask in ("before the max", "own key too"):
                    s = torch.where(later, -torch.inf, s)
                m_new = torch.maximum(m, s.max(-1).values) if subtract_max else torch.zeros_like(m)
                p = torch.exp(s - m_new[..., None])
                if mask == "after the exponent":
                    p = torch.where(later, 0.0, p)
                factor = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
                total = (factor * total if rescale_sum else total) + p.sum(-1)
                acc = (factor[..., None] * acc if rescale_output else acc) \
                    + p @ v[..., j:j + block, :]
                if divide == "every tile":
                    acc, total = acc / total[..., None], torch.ones_like(total)
                m = m_new
            out[..., i:i + block, :] = acc / total[..., None]
            lse[..., i:i + block] = (m if lse_adds_max else 0) + torch.log(total)
        return out, lse
    return tiled_attention


def test_the_tiled_reference_and_the_lessons_flash_attention_pass(capsys):
    from course_lib.flash_attention import flash_attention
    assert checks.check_tiled_attention(tiled_with()) is True
    assert checks.check_tiled_attention(
        lambda q, k, v, block: flash_attention(q, k, v, block=block)) is True
    assert "✓ check_tiled_attention: 6/6 cases" in capsys.readouterr().out
    def todo(*args):
        raise NotImplementedError("exercise 3: fill in tiled_attention")
    assert checks.check_tiled_attention(todo) is False


@pytest.mark.parametrize("fn, hint", [
    (tiled_with(rescale_sum=False), r"case 1/6 [\s\S]*Hint: your running sum of exponentials is "
                                    r"not rescaled when a tile raises the maximum"),
    (tiled_with(rescale_output=False), r"Hint: your running output is not rescaled"),
    (tiled_with(inverted=True), r"Hint: you rescale by exp\(m_new - m\), the inverse"),
    (tiled_with(subtract_max=False), r"case 5/6 \(scores near a thousand[\s\S]*Hint: your "
                                     r"exponentials overflow"),
    (tiled_with(mask="after the exponent"), r"Hint: you hide the future keys after the "
                                            r"exponent"),
    (tiled_with(mask="none"), r"Hint: every query sees every key: the attention is causal"),
    (tiled_with(mask="own key too"), r"Hint: a query does not see its own key"),
    (tiled_with(divide="every tile"), r"Hint: you normalise the output at every tile"),
    (tiled_with(lse_adds_max=False), r"Hint: the output is right, but lse is the log of the sum "
                                     r"alone"),
], ids=["sum not rescaled", "output not rescaled", "rescale inverted", "no max",
        "mask after exp", "no mask", "own key hidden", "normalised every tile", "lse without m"])
def test_a_wrong_tiled_forward_is_told_what_it_did(fn, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_tiled_attention(fn)
    assert "masked_fill" not in str(failed.value) and "m + torch.log" not in str(failed.value)
