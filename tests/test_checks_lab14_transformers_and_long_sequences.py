"""Lab 14's checks: the reference passes; the usual mistakes get the hint that names them."""

import pytest
import torch

from course_lib import context_parallel as cp
from course_lib.checks import CheckFailed
from course_lib.checks import lab14_transformers_and_long_sequences as checks


def test_the_references_pass():
    assert checks.check_merge(cp.merge) is True
    assert checks.check_zigzag(cp.zigzag_positions) is True


def test_not_implemented_is_reported_not_raised():
    def todo(*args):
        raise NotImplementedError("exercise 1: fill in merge")
    assert checks.check_merge(todo) is False
    assert checks.check_zigzag(todo) is False


def test_a_merge_without_the_largest_taken_out_overflows_and_is_told_so():
    def naive(out_a, lse_a, out_b, lse_b):
        total = torch.exp(lse_a) + torch.exp(lse_b)   # overflows for scores around 300
        lse = torch.log(total)
        return (torch.exp(lse_a)[..., None] * out_a + torch.exp(lse_b)[..., None] * out_b) \
            / total[..., None], lse
    with pytest.raises(CheckFailed, match="inf or nan"):
        checks.check_merge(naive)


def test_a_merge_that_forgets_the_weights_is_told_so():
    def unweighted(out_a, lse_a, out_b, lse_b):
        return out_a + out_b, torch.logaddexp(lse_a, lse_b)
    with pytest.raises(CheckFailed, match="share of the total denominator"):
        checks.check_merge(unweighted)


def test_a_zigzag_with_the_wrong_mirror_or_none_is_told_so():
    def off_by_one(length, n):
        c = length // (2 * n)
        return [torch.cat([torch.arange(r * c, (r + 1) * c),
                           torch.arange((2 * n - r) * c, (2 * n - r + 1) * c)])
                for r in range(n)]
    with pytest.raises(CheckFailed, match="assigned twice"):
        checks.check_zigzag(off_by_one)
    with pytest.raises(CheckFailed, match="not balanced"):
        checks.check_zigzag(lambda length, n: [p for p in cp.contiguous_positions(length, n)])
