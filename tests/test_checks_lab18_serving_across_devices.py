"""Lab 18's checks: the lab's solution and the library pass; each usual mistake fails with the
hint that names it, never with the answer.

The wrong answers below are written as a student would write them (the check replays its own
versions of the usual mistakes to name the one a wrong answer made)."""

import math
import re

import pytest
import torch

from course_lib import paged_attention as pa
from course_lib import speculative as sp
from course_lib.checks import CheckFailed
from course_lib.checks import lab18_serving_across_devices as checks


# ---------------------------------------------------------------- the lab's solution
def grow(table, free, length, n_new, block_size):
    """As in labs/solutions/18_serving_across_devices.ipynb."""
    need = -(-(length + n_new) // block_size)
    more = need - len(table)
    if more > len(free):
        raise MemoryError(f"{more} more blocks needed, {len(free)} free")
    for _ in range(more):
        table.append(free.pop())


def slot_of(table, position, block_size):
    return table[position // block_size], position % block_size


def release(table, free):
    while table:
        free.append(table.pop())


def accept(p, q, token, u):
    return bool(u * q[token] < p[token])


def residual(p, q):
    r = torch.clamp(p - q, min=0)
    return r / r.sum()


@pytest.mark.parametrize("seed", [0, 2718])  # the lab's, and the hidden re-run's (nbgrader)
def test_the_solution_and_the_library_pass(seed, capsys):
    for mine, library in ((grow, pa.grow), (slot_of, pa.slot_of), (release, pa.release)):
        name = "check_" + mine.__name__
        assert getattr(checks, name)(mine, seed=seed) is True
        assert getattr(checks, name)(library, seed=seed) is True
    for mine, library in ((accept, sp.accept), (residual, sp.residual)):
        name = "check_" + mine.__name__
        assert getattr(checks, name)(mine, seed=seed) is True
        assert getattr(checks, name)(library, seed=seed) is True
    out = capsys.readouterr().out
    assert "✓ check_grow: 18/18 cases" in out and "✓ check_release: 10/10" in out


def test_the_sampling_check_passes_and_tells_the_acceptance_rate(capsys):
    assert checks.check_keeps_target(accept, residual) is True
    out = capsys.readouterr().out
    assert "100,000 steps give the target's p within 0.01" in out
    assert "50.0% of the proposals kept, the sum of min(p, q) being 50.0%" in out


def test_other_right_answers_pass():
    def grow_ceil(table, free, length, n_new, block_size):
        missing = math.ceil((length + n_new) / block_size) - len(table)
        if missing > len(free):
            raise MemoryError("out of blocks")
        table.extend(free.pop() for _ in range(missing))

    def release_reversed(table, free):
        free.extend(table[::-1])
        del table[:]

    assert checks.check_grow(grow_ceil)
    assert checks.check_release(release_reversed)
    assert checks.check_accept(lambda p, q, x, u: u < min(1, p[x] / q[x]))
    assert checks.check_accept(lambda p, q, x, u: u * q[x] < p[x])  # a tensor, not a bool
    assert checks.check_residual(lambda p, q: (p - q).clamp(min=0) / (1 - torch.minimum(p, q)
                                                                      .sum()))


def test_not_implemented_is_reported_not_raised(capsys):
    def todo(*args):
        raise NotImplementedError("exercise 1: fill in grow")
    for check in (checks.check_grow, checks.check_slot_of, checks.check_release,
                  checks.check_accept, checks.check_residual):
        assert check(todo) is False
    assert checks.check_keeps_target(todo, residual) is False
    assert checks.check_keeps_target(accept, todo) is False
    assert "not implemented yet" in capsys.readouterr().out


def hint_of(failed):
    """The hint of a failed check: what follows 'Hint:'."""
    return str(failed.value).split("\nHint: ", 1)[1]


NO_ANSWER = re.compile(r"//|ceil|pop\(|clamp|\.append|extend|reversed\(|min\(1")


# ---------------------------------------------------------------- exercise 1: grow
def rounded_down(table, free, length, n_new, block_size):
    need = (length + n_new) // block_size
    for _ in range(need - len(table)):
        table.append(free.pop())


def one_too_many(table, free, length, n_new, block_size):
    need = (length + n_new) // block_size + 1
    if need - len(table) > len(free):
        raise MemoryError
    for _ in range(need - len(table)):
        table.append(free.pop())


def checked(take):
    """A grow that checks for room first and takes the missing blocks with ``take``."""
    def grow(table, free, length, n_new, block_size):
        more = -(-(length + n_new) // block_size) - len(table)
        if more > len(free):
            raise MemoryError
        take(table, free, more)
    return grow


def from_the_front(table, free, more):
    for _ in range(more):
        table.append(free.pop(0))


def in_list_order(table, free, more):
    if more > 0:
        table.extend(free[len(free) - more:])
        del free[len(free) - more:]


def not_removed(table, free, more):
    table.extend(list(reversed(free))[:more])


def for_n_new_only(table, free, length, n_new, block_size):
    more = -(-n_new // block_size) - len(table)
    if more > len(free):
        raise MemoryError
    for _ in range(more):
        table.append(free.pop())


def fresh_for_the_new(table, free, length, n_new, block_size):
    more = -(-n_new // block_size)
    if more > len(free):
        raise MemoryError
    for _ in range(more):
        table.append(free.pop())


def whole_new_set(table, free, length, n_new, block_size):
    need = -(-(length + n_new) // block_size)
    if need > len(free):
        raise MemoryError
    for _ in range(need):
        table.append(free.pop())


def block_when_full(table, free, length, n_new, block_size):
    if length % block_size == 0:  # the last block is full: open a new one
        table.append(free.pop())
    grow(table, free, length + 0, n_new, block_size)


def never_raises(table, free, length, n_new, block_size):
    for _ in range(-(-(length + n_new) // block_size) - len(table)):
        if free:
            table.append(free.pop())


def pops_empty(table, free, length, n_new, block_size):
    for _ in range(-(-(length + n_new) // block_size) - len(table)):
        table.append(free.pop())


def partial(table, free, length, n_new, block_size):
    for _ in range(-(-(length + n_new) // block_size) - len(table)):
        if not free:
            raise MemoryError("out of blocks")
        table.append(free.pop())


def exactly_enough_raises(table, free, length, n_new, block_size):
    more = -(-(length + n_new) // block_size) - len(table)
    if more >= len(free):
        raise MemoryError
    for _ in range(more):
        table.append(free.pop())


def new_lists(table, free, length, n_new, block_size):
    table, free = list(table), list(free)
    grow(table, free, length, n_new, block_size)
    return table


GROW_MISTAKES = [
    (rounded_down, "case 1/18", "for length 0, n_new 5 and block size 4 your table holds 1 "
                                "block(s), room for 4 positions, not 5"),
    (one_too_many, "case 4/18", "for length 15, n_new 1 and block size 16 your table holds 2 "
                                "blocks, but 16 positions fill exactly 1"),
    (checked(from_the_front), "case 1/18", "your table got [7, 6] from the front of the free "
                                           "list"),
    (checked(in_list_order), "case 1/18", "the right blocks, in the wrong order: your table got "
                                          "[1, 0]"),
    (for_n_new_only, "case 2/18", "already holds 16 positions in 1 block and stores 1 more, "
                                  "your table holds 1: it must hold all 17 positions"),
    (fresh_for_the_new, "case 3/18", "your table went from 3 to 5 blocks: you took blocks for "
                                     "the 6 new positions as if the last block were full, but it "
                                     "has room for 3 more; 15 positions need 4 blocks"),
    (whole_new_set, "case 2/18", "for length 16, n_new 1 and block size 16 your table holds 3 "
                                 "blocks; 17 positions need fewer"),
    (checked(not_removed), "case 1/18", "block(s) [0, 1] are in your table and still on the "
                                        "free list"),
    (block_when_full, "case 5/18", "with n_new 0 there is nothing to store, but your function "
                                   "changed the table from [2, 6] to [2, 6, 0]"),
    (never_raises, "case 7/18", "3 more blocks are needed and 2 are free, but your function "
                                "returned without raising"),
    (pops_empty, "case 7/18", "your function raised IndexError (pop from empty list): 3 more "
                              "blocks are needed and 2 are free"),
    (partial, "case 7/18", "your function raised MemoryError, but only after moving block(s) "
                           "[5, 1] from the free list to the table: a request that does not "
                           "fit must take nothing"),
    (exactly_enough_raises, "case 6/18", "your function raised MemoryError with 4 free blocks "
                                         "for the 4 more needed: exactly enough is enough"),
    (new_lists, "case 1/18", "your function returned [0, 1] and left the caller's table and "
                             "free as they were"),
]


@pytest.mark.parametrize("mistake, case, hint", GROW_MISTAKES,
                         ids=["rounded down", "one too many", "from the front", "in list order",
                              "for n_new only", "fresh for the new", "whole new set",
                              "not removed", "block when full", "never raises", "pops empty",
                              "partial", "exactly enough raises", "new lists"])
def test_a_wrong_grow_is_told_its_mistake(mistake, case, hint):
    with pytest.raises(CheckFailed) as failed:
        checks.check_grow(mistake)
    text = str(failed.value)
    assert f"check_grow: {case} " in text, text
    assert hint in hint_of(failed), text
    assert not NO_ANSWER.search(hint_of(failed)), text


def test_a_grow_failure_shows_the_call_and_both_outcomes():
    with pytest.raises(CheckFailed) as failed:
        checks.check_grow(partial)
    text = str(failed.value)
    assert "grow(table=[3, 7], free=[1, 5], length=8, n_new=9, block_size=4)" in text
    assert "expected: MemoryError, table [3, 7] and free [1, 5] unchanged" in text
    assert "yours:    raised MemoryError: out of blocks; table [3, 7, 5, 1], free []" in text


# ---------------------------------------------------------------- exercise 2: slot_of
FREE = [50, 51, 52, 53, 54, 55, 56, 57]  # a free list in the notebook's globals


SLOT_MISTAKES = [
    (lambda t, p, b: (t[(p + 1) // b], p % b), "case 2/15",
     "position 3 with blocks of 4 is on page 0, but you returned the block of page 1: your page "
     "index is one too high"),
    (lambda t, p, b: (t[p // b - 1], p % b), "case 1/15",
     "position 0 with blocks of 4 is on page 0, but you returned the block of the last page "
     "(index -1 counts from the end): your page index is one too low"),
    (lambda t, p, b: (t[p // b], p // b), "case 2/15",
     "the block is right, but the offset 0 is the page's index"),
    (lambda t, p, b: (p % b, t[p // b]), "case 1/15", "block and offset are swapped"),
    (lambda t, p, b: (p // b, p % b), "case 1/15",
     "0 is the index of the page that holds position 0 with blocks of 4, not the block"),
    (lambda t, p, b: (FREE[p // b], p % b), "case 1/15",
     "block 50 is not one of this request's blocks [12, 30, 17, 25]"),
]


@pytest.mark.parametrize("mistake, case, hint", SLOT_MISTAKES,
                         ids=["page + 1", "page - 1", "offset the quotient", "swapped",
                              "page index", "the free list"])
def test_a_wrong_slot_is_told_its_mistake(mistake, case, hint):
    with pytest.raises(CheckFailed) as failed:
        checks.check_slot_of(mistake)
    assert f"check_slot_of: {case} " in str(failed.value), str(failed.value)
    assert hint in hint_of(failed), str(failed.value)
    assert not NO_ANSWER.search(hint_of(failed))


# ---------------------------------------------------------------- exercise 2: release
def not_freed(table, free):
    table.clear()


def not_cleared(table, free):
    free.extend(reversed(table))


def in_table_order(table, free):
    free.extend(table)
    table.clear()


def twice(table, free):
    for block in reversed(table):
        free.append(block)
    free.extend(reversed(table))
    table.clear()


def at_the_front(table, free):
    free[:0] = reversed(table)
    table.clear()


def only_the_last(table, free):
    free.append(table.pop())


def rebound(table, free):
    free = free + table[::-1]  # noqa: F841 - the mistake: a new list, lost
    table = []  # noqa: F841


RELEASE_MISTAKES = [
    (not_freed, "the request's blocks [4, 0, 6] did not go back to the free list (a page never "
                "freed)"),
    (not_cleared, "the blocks are back on the free list, but the table still lists them "
                  "([4, 0, 6])"),
    (in_table_order, "the right blocks, in the wrong order: after your release the free list is "
                     "[5, 2, 4, 0, 6], and the next grow, taking from its end, would hand a "
                     "request as long [6, 0, 4], not the blocks [4, 0, 6]"),
    (twice, "block(s) [0, 4, 6] are on the free list twice"),
    (at_the_front, "you put the blocks in front of the free list [5, 2]"),
    (only_the_last, "after your release the table still holds [4, 0] and block(s) [0, 4] did "
                    "not go back"),
    (rebound, "left the caller's table and free list as they were"),
]


@pytest.mark.parametrize("mistake, hint", RELEASE_MISTAKES, ids=lambda m: getattr(m, "__name__",
                                                                                   ""))
def test_a_wrong_release_is_told_its_mistake(mistake, hint):
    with pytest.raises(CheckFailed) as failed:
        checks.check_release(mistake)
    assert "check_release: case 1/10 (a request of 3 blocks, 2 blocks already free)" in \
        str(failed.value)
    assert hint in hint_of(failed), str(failed.value)
    assert not NO_ANSWER.search(hint_of(failed))


# ---------------------------------------------------------------- exercise 3: accept
ACCEPT_MISTAKES = [
    (lambda p, q, x, u: u * p[x] < q[x], "case 4/20",
     "token 1: p(x) = 0.6, q(x) = 0.3, u = 0.9: the target wants x 2 times as often as the "
     "draft proposes it, and you dropped x: p and q play each other's part"),
    (lambda p, q, x, u: bool(u > p[x] / q[x]), "case 1/20",
     "Your comparison runs the wrong way"),
    (lambda p, q, x, u: True, "case 5/20",
     "token 0: p(x) = 0.2, q(x) = 0.4, u = 0.7: you kept x although the draft proposes x 2 times "
     "as often as the target wants it. Keeping every proposal gives the draft's distribution"),
    (lambda p, q, x, u: bool(u < p[x]), "case 2/20",
     "as if the target's p(x) alone decided; how often the draft proposes x matters too"),
    (lambda p, q, x, u: bool(u < q[x]), "case 3/20",
     "as if the draft's q(x) alone decided; how often the target wants x matters too"),
    (lambda p, q, x, u: bool(u <= p[x] / q[x]), "case 7/20",
     "you kept a token to which the target gives probability 0 (u can be exactly 0)"),
]


@pytest.mark.parametrize("mistake, case, hint", ACCEPT_MISTAKES,
                         ids=["p/q swapped", "inverted", "always", "p alone", "q alone",
                              "not strict"])
def test_a_wrong_acceptance_rule_is_told_its_mistake(mistake, case, hint):
    with pytest.raises(CheckFailed) as failed:
        checks.check_accept(mistake)
    assert f"check_accept: {case} " in str(failed.value), str(failed.value)
    assert hint in hint_of(failed), str(failed.value)
    assert not NO_ANSWER.search(hint_of(failed))


# ---------------------------------------------------------------- exercise 3: residual
def in_place(p, q):
    p -= q
    p.clamp_(min=0)
    return p / p.sum()


RESIDUAL_MISTAKES = [
    (lambda p, q: torch.clamp(q - p, min=0) / torch.clamp(q - p, min=0).sum(),
     "your residual puts its mass where the draft proposes more than the target wants (token 0: "
     "q = 0.4, p = 0.2)"),
    (lambda p, q: torch.clamp(p - q, min=0), "your residual sums to 0.3, not 1"),
    (lambda p, q: p - q, "your residual gives token 0 (p = 0.2, q = 0.4) the probability -0.2: "
                         "a distribution to draw from has no negative entries"),
    (lambda p, q: (p - q) / (p - q).sum(), "the differences p - q sum to 0 over the vocabulary"),
    (lambda p, q: (p - q).abs() / (p - q).abs().sum(),
     "your residual gives mass to tokens the draft already over-proposes (token 0: q = 0.4, p = "
     "0.2)"),
    (lambda p, q: p, "your residual is p itself"),
    (in_place, "your function modified its input 'p' in place"),
]


@pytest.mark.parametrize("mistake, hint", RESIDUAL_MISTAKES,
                         ids=["q - p", "not normalised", "no clamp", "no clamp, normalised",
                              "abs", "p", "in place"])
def test_a_wrong_residual_is_told_its_mistake(mistake, hint):
    with pytest.raises(CheckFailed) as failed:
        checks.check_residual(mistake)
    assert "check_residual: case 1/8" in str(failed.value), str(failed.value)
    assert hint in str(failed.value).split("\n  ", 1)[1], str(failed.value)


# ---------------------------------------------------------------- exercise 3: the distribution
def test_a_wrong_rule_does_not_keep_the_target_distribution():
    with pytest.raises(CheckFailed) as failed:
        checks.check_keeps_target(lambda p, q, x, u: u < p[x], residual)
    text = str(failed.value)
    assert re.search(r"largest gap 0\.2\d\d \(allowed 0\.01\)", text), text
    assert "Hint: your accept disagrees with the rule on" in text
    assert "check_accept names the mistake" in text


def test_a_wrong_residual_does_not_keep_the_target_distribution():
    with pytest.raises(CheckFailed) as failed:
        checks.check_keeps_target(accept, lambda p, q: p)
    text = str(failed.value)
    assert "Hint: your accept keeps exactly the right proposals" in text
    assert "check_residual names the mistake" in text
    with pytest.raises(CheckFailed, match="drawing from your residual"):
        checks.check_keeps_target(accept, lambda p, q: p - q)
