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
