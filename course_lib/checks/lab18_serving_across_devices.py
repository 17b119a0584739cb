"""Checks for labs/18_serving_across_devices.ipynb: a paged KV cache's block tables and the
acceptance rule of speculative decoding (notebook 18).

In the lab, right under each exercise::

    from course_lib.checks import lab18_serving_across_devices as checks
    checks.check_grow(grow)                        # against paged_attention.grow
    checks.check_slot_of(slot_of)                  # against paged_attention.slot_of
    checks.check_release(release)                  # against paged_attention.release
    checks.check_accept(accept)                    # against speculative.accept
    checks.check_residual(residual)                # against speculative.residual
    checks.check_keeps_target(accept, residual)    # 100,000 steps are distributed as p

Each compares the student's function with the library's on fresh arguments: hand-made cases
that set a trap each (a block boundary crossed or filled exactly, ``n_new = 0``, a new request,
a request that does not fit; a position at the end of a page; a token the target never draws),
then seeded random ones (``seed=``). ``grow`` and ``release`` change the lists they are given:
their check compares the table and the free list after the call, and for a request that does
not fit, the ``MemoryError`` and the lists left as they were. A wrong answer is matched against
the usual mistakes, each replayed on the cases seen so far, and gets the hint of the one it
made, with the numbers of the failing case; otherwise a hint that says what its result shows.
The last check runs 100,000 steps of speculative sampling with the student's two functions
(draft proposals from q, kept or replaced as :func:`course_lib.speculative.one_step` does) and
compares the tokens' frequencies with the target's p.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from course_lib import paged_attention as pa
from course_lib import speculative as sp
from course_lib.checks.framework import Case, CheckFailed, not_implemented, run_check


# ---------------------------------------------------------------- exercise 1: grow
@dataclass(frozen=True)
class GrowCase:
    """One call of ``grow``: a request's table, the free list, its length, what it stores."""

    label: str
    table: tuple[int, ...]
    free: tuple[int, ...]
    length: int
    n_new: int
    block_size: int

    def call(self) -> str:
        """The call, as the student would write it."""
        return (f"grow(table={list(self.table)}, free={list(self.free)}, length={self.length}, "
                f"n_new={self.n_new}, block_size={self.block_size})")

    @property
    def need(self) -> int:
        """Blocks that hold ``length + n_new`` positions."""
        return pa.blocks_needed(self.length + self.n_new, self.block_size)

    @property
    def more(self) -> int:
        """Blocks to take from the free list."""
        return max(0, self.need - len(self.table))


@dataclass(frozen=True)
class Outcome:
    """What a call of ``grow`` or ``release`` did: the exception it raised (its type's name, or
    None), the two lists after it, and what it returned."""

    raised: str | None
    message: str
    table: tuple[int, ...]
    free: tuple[int, ...]
    returned: Any = None

    def same(self, other: Outcome) -> bool:
        """The same exception type and the same lists (the return value aside)."""
        return (self.raised, self.table, self.free) == (other.raised, other.table, other.free)

    def describe(self) -> str:
        """'table [...], free [...]', after what it raised."""
        lists = f"table {list(self.table)}, free {list(self.free)}"
        if self.raised is None:
            return lists
        return f"raised {self.raised}{': ' + self.message if self.message else ''}; {lists}"


def _n(k: int, word: str) -> str:
    """'1 block', '2 blocks'."""
    return f"{k} {word}{'' if k == 1 else 's'}"


def _call_grow(fn: Callable, case: GrowCase) -> Outcome:
    """``fn`` on fresh copies of the case's lists (NotImplementedError goes through)."""
    table, free = list(case.table), list(case.free)
    try:
        back = fn(table, free, case.length, case.n_new, case.block_size)
    except NotImplementedError:
        raise
    except Exception as err:  # MemoryError is the contract's; others are mistakes to name
        return Outcome(type(err).__name__, str(err)[:120], tuple(table), tuple(free))
    return Outcome(None, "", tuple(table), tuple(free), back)


def _grow_cases(seed: int) -> list[GrowCase]:
    """The hand-made traps, then 10 random cases drawn with ``seed``."""
    cases = [
        GrowCase("a new request: an empty table, 5 positions in blocks of 4",
                 (), (7, 6, 5, 4, 3, 2, 1, 0), 0, 5, 4),
        GrowCase("a full block of 16 and one position more", (3,), (9, 6, 5, 2), 16, 1, 16),
        GrowCase("9 positions held in 3 blocks of 4, 6 more", (5, 0, 7), (6, 3, 2, 1, 4), 9, 6, 4),
        GrowCase("15 positions and one more fill a block of 16 exactly", (4,), (8, 1, 0), 15, 1,
                 16),
        GrowCase("n_new = 0: nothing to store", (2, 6), (5, 4, 3, 1, 0), 8, 0, 4),
        GrowCase("blocks of 1, and exactly as many free blocks as needed", (3, 1), (9, 8, 0, 2),
                 2, 4, 1),
        GrowCase("3 more blocks needed, 2 free: it does not fit", (3, 7), (1, 5), 8, 9, 4),
        GrowCase("no free block at all", (0, 1, 2), (), 12, 1, 4),
    ]
    rng = np.random.default_rng(seed)
    for i in range(10):
        block_size = int(rng.choice([1, 2, 3, 4, 8, 16]))
        pool = int(rng.integers(4, 25))
        ids = [int(b) for b in rng.permutation(pool)]
        held = int(rng.integers(0, pool + 1))
        if held == 0:
            length = 0
        elif i % 3 == 0:  # the table's last block full
            length = held * block_size
        else:
            length = int(rng.integers((held - 1) * block_size + 1, held * block_size + 1))
        n_new = 0 if i % 4 == 1 else int(rng.integers(1, 3 * block_size + 2))
        if i % 4 == 2:  # up to the end of a block exactly
            n_new = block_size - length % block_size + block_size * int(rng.integers(0, 3))
        more = _n(n_new, "position")
        fits = "" if pa.blocks_needed(length + n_new, block_size) - held <= pool - held else \
            ", too many for the free blocks"
        cases.append(GrowCase(f"random: a pool of {pool} blocks of {block_size}, {held} held, "
                              f"{more} more{fits}", tuple(ids[:held]),
                              tuple(ids[held:]), length, n_new, block_size))
    return cases


# The usual mistakes, each as a student would write it, to replay on the cases seen so far.
def _taking(more_of: Callable[[GrowCase, list], int], *, check: str = "before",
            take: str = "end") -> Callable:
    """A grow that takes ``more_of(case, table)`` blocks, checking for room ``check`` (before,
    "equal" too, "during" the loop, "skip" when empty, "never"), taking them from ``take``."""
    def grow(table, free, length, n_new, block_size):
        case = GrowCase("", tuple(table), tuple(free), length, n_new, block_size)
        more = more_of(case, table)
        if (check == "before" and more > len(free)) or (check == "equal" and more >= len(free)
                                                         and more > 0):
            raise MemoryError(f"{more} more blocks needed, {len(free)} free")
        if take == "slice" and more > 0:
            table.extend(free[-more:])
            del free[-more:]
            return None
        for i in range(more):
            if not free and check == "during":
                raise MemoryError("no free block")
            if not free and check == "skip":
                break
            if take == "front":
                table.append(free.pop(0))
            elif take == "copy":
                table.append(free[-1 - i])
            else:
                table.append(free.pop())
        return None
    return grow


def _right(case: GrowCase, table: list) -> int:
    return case.need - len(table)


def _last_full_first(table, free, length, n_new, block_size):
    if length % block_size == 0 and free:  # "the last block is full: take a new one"
        table.append(free.pop())
    return _taking(_right)(table, free, length, n_new, block_size)


def _new_lists(table, free, length, n_new, block_size):
    table, free = list(table), list(free)
    _taking(_right)(table, free, length, n_new, block_size)
    return table


def _hint_floor(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"for length {c.length}, n_new {c.n_new} and block size {c.block_size} your table "
            f"holds {len(got.table)} block(s), room for {len(got.table) * c.block_size} "
            f"positions, not {c.length + c.n_new}: a block that the positions only partly fill "
            f"is taken all the same (you rounded the number of blocks down).")


def _hint_extra(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"for length {c.length}, n_new {c.n_new} and block size {c.block_size} your table "
            f"holds {len(got.table)} blocks, but {c.length + c.n_new} positions fill exactly "
            f"{c.need}: you take one block too many when the positions end at the end of a "
            f"block.")


def _new_blocks(c: GrowCase, out: Outcome) -> list[int]:
    return list(out.table[len(c.table):])


def _hint_front(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"your table got {_new_blocks(c, got)} from the front of the free list "
            f"{list(c.free)}: blocks are taken from its end, the last one first "
            f"({_new_blocks(c, want)} here).")


def _hint_order(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"the right blocks, in the wrong order: your table got {_new_blocks(c, got)}, but "
            f"the block at the very end of the free list is handed out first, then the one "
            f"before it ({_new_blocks(c, want)}).")


def _hint_n_new_only(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"for a request that already holds {c.length} positions in "
            f"{_n(len(c.table), 'block')} and stores {c.n_new} more, your table holds "
            f"{len(got.table)}: it must hold all {c.length + c.n_new} positions, those stored "
            f"before too, not room for the {c.n_new} new ones alone.")


def _hint_fresh(c: GrowCase, got: Outcome, want: Outcome) -> str:
    room = len(c.table) * c.block_size - c.length
    return (f"your table went from {len(c.table)} to {len(got.table)} blocks: you took blocks "
            f"for the {_n(c.n_new, 'new position')} as if the last block were full, but it has "
            f"room for {room} more; {c.length + c.n_new} positions need "
            f"{_n(c.need, 'block')}.")


def _hint_whole_set(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"for length {c.length}, n_new {c.n_new} and block size {c.block_size} your table "
            f"holds {len(got.table)} blocks; {c.length + c.n_new} positions need fewer: the "
            f"{len(c.table)} block(s) the table already holds count, take only the missing "
            f"ones.")


def _hint_copied(c: GrowCase, got: Outcome, want: Outcome) -> str:
    twice = sorted(set(got.table) & set(got.free))
    return (f"block(s) {twice} are in your table and still on the free list: the next request "
            f"would be handed the same block and overwrite this request's keys and values. A "
            f"block taken leaves the free list.")


def _hint_zero(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"with n_new 0 there is nothing to store, but your function changed the table from "
            f"{list(c.table)} to {list(got.table)}: the table already holds its {c.length} "
            f"positions, so the call must leave table and free as they are.")


def _hint_skip(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"{c.more} more blocks are needed and {len(c.free)} are free, but your function "
            f"returned without raising, the table holding {len(got.table)} blocks, too few "
            f"for {c.length + c.n_new} positions: a request that cannot get all its blocks must "
            f"raise MemoryError, and the server then waits or preempts.")


def _hint_index(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"your function raised {got.raised} ({got.message}): {c.more} more blocks are "
            f"needed and {len(c.free)} are free. When the free list cannot supply them all, "
            f"raise MemoryError before taking any.")


def _hint_partial(c: GrowCase, got: Outcome, want: Outcome) -> str:
    moved = [b for b in got.table if b not in c.table]
    return (f"your function raised MemoryError, but only after moving block(s) {moved} from the "
            f"free list to the table: a request that does not fit must take nothing, and leave "
            f"table and free as they were (the blocks taken would be lost: no request owns "
            f"them).")


def _hint_equal(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"your function raised MemoryError with {len(c.free)} free blocks for the "
            f"{c.more} more needed: exactly enough is enough.")


def _hint_new_list(c: GrowCase, got: Outcome, want: Outcome) -> str:
    return (f"your function returned {got.returned!r:.80} and left the caller's table and free "
            f"as they were: grow changes the two lists it is given, in place (the cache keeps "
            f"them), and returns nothing.")


GROW_MISTAKES: list[tuple[str, Callable, Callable]] = [
    ("rounded down", _taking(lambda c, t: (c.length + c.n_new) // c.block_size - len(t)),
     _hint_floor),
    ("one too many when exact",
     _taking(lambda c, t: (c.length + c.n_new) // c.block_size + 1 - len(t)), _hint_extra),
    ("from the front", _taking(_right, take="front"), _hint_front),
    ("from the end, in list order", _taking(_right, take="slice"), _hint_order),
    ("for n_new only", _taking(lambda c, t: pa.blocks_needed(c.n_new, c.block_size) - len(t)),
     _hint_n_new_only),
    ("fresh blocks for the new positions",
     _taking(lambda c, t: pa.blocks_needed(c.n_new, c.block_size)), _hint_fresh),
    ("a whole new set", _taking(lambda c, t: c.need), _hint_whole_set),
    ("left on the free list", _taking(_right, check="never", take="copy"), _hint_copied),
    ("a block when the last is full", _last_full_first, _hint_zero),
    ("no MemoryError", _taking(_right, check="skip"), _hint_skip),
    ("pops an empty list", _taking(_right, check="never"), _hint_index),
    ("partial, then MemoryError", _taking(_right, check="during"), _hint_partial),
    ("MemoryError when exactly enough", _taking(_right, check="equal"), _hint_equal),
    ("new lists", _new_lists, _hint_new_list),
]
"""(name, a grow with the mistake, its hint(case, yours, expected)): replayed, in this order,
on the cases a wrong grow has seen; the first that did what it did on all of them names it."""


def _grow_symptom(c: GrowCase, got: Outcome, want: Outcome) -> str:
    """A hint from what the failing call did, when no usual mistake explains it."""
    positions = c.length + c.n_new
    if want.raised and got.raised not in (None, "MemoryError"):
        return _hint_index(c, got, want)
    if want.raised and got.raised is None:
        return _hint_skip(c, got, want)
    if want.raised:
        return (f"your function raised MemoryError, as it must, but changed the lists first "
                f"(table {list(c.table)} -> {list(got.table)}, free {list(c.free)} -> "
                f"{list(got.free)}): a request that does not fit must leave them as they were.")
    if got.raised == "MemoryError":
        return _hint_equal(c, got, want) if c.more <= len(c.free) else _hint_skip(c, got, want)
    if got.raised:
        return (f"your function raised {got.raised}: {got.message}. Here {positions} positions "
                f"need {c.need} blocks of {c.block_size}, and the table holds {len(c.table)}.")
    if got.table[:len(c.table)] != c.table:
        return (f"your function changed the blocks the table already held ({list(c.table)} -> "
                f"{list(got.table)}): the request's keys and values are in those blocks; new "
                f"blocks go after them.")
    if len(got.table) != len(want.table):
        how = "fewer" if len(got.table) < len(want.table) else "more"
        return (f"your table holds {len(got.table)} blocks; {positions} positions in blocks of "
                f"{c.block_size} need {c.need}, {how} than yours.")
    if got.table != want.table:
        return _hint_front(c, got, want) if set(got.table) != set(want.table) else \
            _hint_order(c, got, want)
    return (f"your table is right, but the free list is {list(got.free)}, not what is left, "
            f"{list(want.free)}: the blocks taken leave it, the others stay in their order.")


def _failure(name: str, number: int, total: int, label: str, call: str, want: str, got: str,
             hint: str) -> CheckFailed:
    return CheckFailed(f"{name}: case {number}/{total} ({label})\n  {call}\n"
                       f"  expected: {want}\n  yours:    {got}\nHint: {hint}")


def check_grow(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 18, exercise 1: ``grow(table, free, length, n_new, block_size)`` changes the two
    lists as ``paged_attention.grow`` does on 8 hand-made and 10 random cases (``seed``): the
    missing blocks taken from the end of ``free`` onto ``table``, or ``MemoryError`` with both
    lists unchanged. Prints a pass line and returns True, returns False while the function
    raises NotImplementedError, raises ``CheckFailed`` with the mistake named otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_grow"
    cases = _grow_cases(seed)
    seen: list[tuple[GrowCase, Outcome]] = []
    for number, case in enumerate(cases, start=1):
        want = _call_grow(pa.grow, case)
        try:
            got = _call_grow(student_fn, case)
        except NotImplementedError:
            return not_implemented(name)
        seen.append((case, got))
        if got.same(want):
            continue
        hint = None
        for _, mistaken, hint_of in GROW_MISTAKES:
            if all(_call_grow(mistaken, c).same(o) for c, o in seen):
                hint = hint_of(case, got, want)
                break
        if want.raised:
            expected = (f"MemoryError, table {list(case.table)} and free {list(case.free)} "
                        f"unchanged")
        else:
            expected = want.describe()
        raise _failure(name, number, len(cases), case.label, case.call(), expected,
                       got.describe(), hint or _grow_symptom(case, got, want))
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match paged_attention.grow (the tables, "
          f"the free lists, and MemoryError where a request does not fit)")
    return True


# ---------------------------------------------------------------- exercise 2: slot_of, release
def _slot_cases(seed: int) -> list[Case]:
    """Positions at the edges of pages, then random ones (``seed``); block ids from 10 on, so
    that no block is mistaken for a page's index."""
    table = [12, 30, 17, 25]
    fixed = [("position 0", table, 0, 4),
             ("the last position of page 0", table, 3, 4),
             ("the first position of page 1", table, 4, 4),
             ("the middle of page 2, blocks of 4", table, 9, 4),
             ("the last position of the last page", table, 15, 4),
             ("blocks of 16, page 1", [41, 11, 23], 20, 16),
             ("blocks of 1", [19, 13, 44, 10], 2, 1)]
    rng = np.random.default_rng(seed)
    for _ in range(8):
        block_size = int(rng.choice([2, 3, 4, 8, 16]))
        pages = int(rng.integers(1, 9))
        blocks = [int(b) for b in rng.choice(np.arange(10, 60), size=pages, replace=False)]
        position = int(rng.integers(0, pages * block_size))
        fixed.append((f"random: {pages} page(s) of {block_size}", blocks, position, block_size))
    return [Case(f"{label}: slot_of({t}, {p}, {b})", lambda t=t, p=p, b=b: (list(t), p, b))
            for label, t, p, b in fixed]


def _diagnose_slot(expected: tuple, got: Any, args: tuple) -> str | None:
    table, position, block_size = args
    try:
        block, offset = (int(x) for x in got)
    except (TypeError, ValueError):
        return None
    want_block, want_offset = expected
    page = position // block_size
    where = f"position {position} with blocks of {block_size}"
    if (block, offset) == (want_offset, want_block) and block != want_block:
        return "block and offset are swapped: return the block first, then the offset."
    if block != want_block:
        if block == page:
            return (f"{block} is the index of the page that holds {where}, not the block that "
                    f"page is stored in: the table names the block of each page.")
        if page + 1 < len(table) and block == table[page + 1]:
            return (f"{where} is on page {page}, but you returned the block of page "
                    f"{page + 1}: your page index is one too high (here at the last position of "
                    f"a page).")
        if block == table[page - 1]:
            page_of = "the last page (index -1 counts from the end)" if page == 0 else \
                f"page {page - 1}"
            return (f"{where} is on page {page}, but you returned the block of {page_of}: your "
                    f"page index is one too low.")
        if block not in table:
            return (f"block {block} is not one of this request's blocks {table}: a position's "
                    f"block is an entry of the request's own table (not of the free list).")
        return (f"block {block} is the block of page {table.index(block)}, but {where} is on "
                f"page {page}.")
    if offset == page and offset != want_offset:
        return (f"the block is right, but the offset {offset} is the page's index: the offset "
                f"is where in its block the position lies, 0 .. {block_size - 1}.")
    return (f"the block is right, but {where} lies at offset {want_offset} of it, not "
            f"{offset}.")


def check_slot_of(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 18, exercise 2: ``slot_of(table, position, block_size) -> (block, offset)`` equals
    ``paged_attention.slot_of`` on 7 hand-made positions (the first and last of a page) and 8
    random ones (``seed``). Prints a pass line and returns True, returns False while the
    function raises NotImplementedError, raises ``CheckFailed`` otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    return run_check("check_slot_of", student_fn, pa.slot_of, _slot_cases(seed),
                     output_names=("block", "offset"), diagnose=_diagnose_slot,
                     hint="the table lists the request's blocks page by page: find the page of "
                          "the position, then where in that page it lies.")


@dataclass(frozen=True)
class ReleaseCase:
    """A finished request's table and the free list before ``release``."""

    label: str
    table: tuple[int, ...]
    free: tuple[int, ...]


def _release_cases(seed: int) -> list[ReleaseCase]:
    cases = [ReleaseCase("a request of 3 blocks, 2 blocks already free", (4, 0, 6), (5, 2)),
             ReleaseCase("a request of one block, nothing free", (3,), ()),
             ReleaseCase("a request that holds no block", (), (1, 0)),
             ReleaseCase("a request of 5 blocks, 1 free", (7, 2, 9, 4, 1), (8,))]
    rng = np.random.default_rng(seed)
    for _ in range(6):
        pool = int(rng.integers(2, 20))
        ids = [int(b) for b in rng.permutation(pool)]
        held = int(rng.integers(1, pool + 1))
        cases.append(ReleaseCase(f"random: {held} of {pool} blocks held", tuple(ids[:held]),
                                 tuple(ids[held:])))
    return cases


def _call_release(fn: Callable, case: ReleaseCase) -> Outcome:
    table, free = list(case.table), list(case.free)
    try:
        back = fn(table, free)
    except NotImplementedError:
        raise
    except Exception as err:  # a crash in the student's code: reported with the lists
        return Outcome(type(err).__name__, str(err)[:120], tuple(table), tuple(free))
    return Outcome(None, "", tuple(table), tuple(free), back)


def _handed_out(free: Sequence[int], n: int) -> list[int]:
    """The blocks the next grow would take, ``n`` of them: from the end of ``free``."""
    return list(reversed(free))[:n]


def _release_hint(c: ReleaseCase, got: Outcome, want: Outcome) -> str:
    table, free = list(c.table), list(c.free)
    if got.raised:
        return (f"your function raised {got.raised}: {got.message}. It gets the request's "
                f"table {table} and the free list {free}.")
    if got.table == c.table and got.free == c.free:
        back = f"returned {got.returned!r:.60} and " if got.returned is not None else ""
        return (f"your function {back}left the caller's table and free list as they were: the "
                f"cache keeps those two lists, so release must change them, in place (new "
                f"lists bound to the same names inside the function are lost).")
    doubled = [b for b, k in Counter(got.free).items() if k > 1]
    if doubled:
        return (f"block(s) {sorted(doubled)} are on the free list twice after your release: two "
                f"requests would be handed the same block and write over each other's keys and "
                f"values.")
    strangers = sorted(set(got.free) - set(c.free) - set(c.table))
    if strangers:
        return (f"block(s) {strangers} were neither free nor the request's, and are on your "
                f"free list now.")
    if got.table:
        if Counter(got.free) == Counter(want.free):
            return (f"the blocks are back on the free list, but the table still lists them "
                    f"({list(got.table)}): the finished request would still own blocks that "
                    f"the next request is handed. Its table must end empty.")
        lost = sorted(set(c.table) - set(got.free))
        return (f"after your release the table still holds {list(got.table)} and block(s) "
                f"{lost} did not go back to the free list: every block of the request goes "
                f"back, and the table ends empty.")
    lost = sorted(set(c.table) - set(got.free))
    if lost == sorted(c.table):
        return (f"the request's blocks {table} did not go back to the free list (a page never "
                f"freed): they are lost to every later request, and the pool shrinks with each "
                f"request that finishes.")
    if lost:
        return (f"block(s) {lost} of the request did not go back to the free list: they are "
                f"lost to every later request.")
    if got.free[:len(free)] != c.free:
        return (f"you put the blocks in front of the free list {free} (or reordered it): the "
                f"next grow takes from the end, so it would hand out {_handed_out(got.free, 3)} "
                f"first. The blocks that were free stay as they were, and the request's go "
                f"after them.")
    return (f"the right blocks, in the wrong order: after your release the free list is "
            f"{list(got.free)}, and the next grow, taking from its end, would hand a request as "
            f"long {_handed_out(got.free, len(table))}, not the blocks {table} in their table's "
            f"order.")


def check_release(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 18, exercise 2: ``release(table, free)`` changes the two lists as
    ``paged_attention.release`` does on 4 hand-made and 6 random cases (``seed``): every block
    back on the free list once, in the order that makes the next ``grow`` hand them out as the
    table listed them, and the table emptied. Prints a pass line and returns True, returns
    False while the function raises NotImplementedError, raises ``CheckFailed`` otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_release"
    cases = _release_cases(seed)
    for number, case in enumerate(cases, start=1):
        want = _call_release(pa.release, case)
        try:
            got = _call_release(student_fn, case)
        except NotImplementedError:
            return not_implemented(name)
        if got.same(want):
            continue
        raise _failure(name, number, len(cases), case.label,
                       f"release(table={list(case.table)}, free={list(case.free)})",
                       want.describe(), got.describe(), _release_hint(case, got, want))
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match paged_attention.release (the next "
          f"grow hands out the same blocks in the same order)")
    return True


# ---------------------------------------------------------------- exercise 3: accept, residual
@dataclass(frozen=True)
class AcceptCase:
    """One draft proposal: the target's ``p``, the draft's ``q``, the token, the uniform ``u``."""

    label: str
    p: tuple[float, ...]
    q: tuple[float, ...]
    token: int
    u: float

    def args(self) -> tuple:
        """Fresh arguments: two float64 tensors, an int and a float."""
        return (torch.tensor(self.p, dtype=torch.float64),
                torch.tensor(self.q, dtype=torch.float64), self.token, self.u)

    def told(self) -> str:
        """p(x), q(x) and u, for a hint."""
        x = self.token
        return f"token {x}: p(x) = {self.p[x]:.3g}, q(x) = {self.q[x]:.3g}, u = {self.u:.3g}"


_P = (0.2, 0.6, 0.2, 0.0)
_Q = (0.4, 0.3, 0.2, 0.1)


def _accept_cases(seed: int) -> list[AcceptCase]:
    cases = [AcceptCase("the draft proposes x twice as often as the target, u = 0.1", _P, _Q, 0,
                        0.1),
             AcceptCase("the draft proposes x twice as often as the target, u = 0.3", _P, _Q, 0,
                        0.3),
             AcceptCase("the target wants x twice as often as the draft, u = 0.4", _P, _Q, 1,
                        0.4),
             AcceptCase("the target wants x twice as often as the draft, u = 0.9", _P, _Q, 1,
                        0.9),
             AcceptCase("the draft proposes x twice as often as the target, u = 0.7", _P, _Q, 0,
                        0.7),
             AcceptCase("p(x) = q(x), u = 0.99", _P, _Q, 2, 0.99),
             AcceptCase("a token the target never draws, u = 0", _P, _Q, 3, 0.0),
             AcceptCase("a token the target never draws, u = 0.5", _P, _Q, 3, 0.5)]
    gen = torch.Generator().manual_seed(seed)
    while len(cases) < 20:
        vocab = int(torch.randint(3, 12, (), generator=gen))
        p = torch.softmax(2 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
        q = torch.softmax(2 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
        x = int(torch.multinomial(q, 1, generator=gen))
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if abs(u * q[x] - p[x]) < 1e-6:  # too close to call in another order of operations
            continue
        cases.append(AcceptCase(f"random: a vocabulary of {vocab}", tuple(p.tolist()),
                                tuple(q.tolist()), x, u))
    return cases


def _ratio(c: AcceptCase) -> str:
    """How p(x) and q(x) compare, in words."""
    p, q = c.p[c.token], c.q[c.token]
    if p == 0:
        return "the target never draws x"
    if p == q:
        return "the draft proposes x exactly as often as the target wants it"
    if p > q:
        return f"the target wants x {p / q:.3g} times as often as the draft proposes it"
    return f"the draft proposes x {q / p:.3g} times as often as the target wants it"


_KEPT = {True: "kept", False: "dropped"}

ACCEPT_MISTAKES: list[tuple[str, Callable, Callable[[AcceptCase, bool], str]]] = [
    ("inverted", lambda p, q, x, u: bool(u * q[x] > p[x]),
     lambda c, got: f"{c.told()}: you {_KEPT[got]} x. Your comparison runs the wrong way: the "
                    f"smaller u, the more readily x must be kept."),
    ("p alone", lambda p, q, x, u: bool(u < p[x]),
     lambda c, got: f"{c.told()}: you {_KEPT[got]} x, as if the target's p(x) alone decided; "
                    f"how often the draft proposes x matters too ({_ratio(c)})."),
    ("q alone", lambda p, q, x, u: bool(u < q[x]),
     lambda c, got: f"{c.told()}: you {_KEPT[got]} x, as if the draft's q(x) alone decided; "
                    f"how often the target wants x matters too ({_ratio(c)})."),
    ("p and q swapped", lambda p, q, x, u: bool(u * p[x] < q[x]),
     lambda c, got: f"{c.told()}: {_ratio(c)}, and you {_KEPT[got]} x: p and q play each "
                    f"other's part in your rule."),
    ("always", lambda p, q, x, u: True,
     lambda c, got: f"{c.told()}: you kept x although {_ratio(c)}. Keeping every proposal "
                    f"gives the draft's distribution, not the target's."),
    ("not strict", lambda p, q, x, u: bool(u * q[x] <= p[x]),
     lambda c, got: f"{c.told()}: you kept a token to which the target gives probability 0 "
                    f"(u can be exactly 0): a token the target never draws must never be kept."),
]
"""(name, an accept with the mistake, its hint on the failing case and what the student's
accept did): the first that agrees with a wrong accept on every case so far names it."""


def _as_bool(x: Any) -> bool:
    return bool(x.item()) if torch.is_tensor(x) or isinstance(x, np.ndarray) else bool(x)


def check_accept(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 18, exercise 3: ``accept(p, q, token, u)`` keeps or drops a draft token as
    ``speculative.accept`` does (kept iff ``u < p(x) / q(x)``) on 8 hand-made proposals and 12
    random ones (``seed``). Prints a pass line and returns True, returns False while the
    function raises NotImplementedError, raises ``CheckFailed`` with the mistake named
    otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_accept"
    cases = _accept_cases(seed)
    seen: list[tuple[AcceptCase, bool]] = []
    for number, case in enumerate(cases, start=1):
        want = bool(sp.accept(*case.args()))
        where = (f"{name}: case {number}/{len(cases)} ({case.label})\n  accept(p={list(case.p)}"
                 f", q={list(case.q)}, token={case.token}, u={case.u:.6g})")
        try:
            got = _as_bool(student_fn(*case.args()))
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              f"Hint: p and q are 1-D tensors, token an int and u a float; "
                              f"return True (keep x) or False (drop it).") from err
        seen.append((case, got))
        if got == want:
            continue
        hint = next((hint_of(case, got) for _, mistaken, hint_of in ACCEPT_MISTAKES
                     if all(mistaken(*c.args()) == g for c, g in seen)), None)
        raise CheckFailed(f"{where}\n  expected: {_KEPT[want]}\n  yours:    {_KEPT[got]}\n"
                          "Hint: " + (hint or f"{case.told()}: {_ratio(case)}, and for this u "
                                               f"yours {_KEPT[got]} x."))
    print(f"✓ {name}: {len(cases)}/{len(cases)} proposals kept or dropped as "
          f"speculative.accept does")
    return True


def _residual_cases(seed: int) -> list[Case]:
    def tensors(p, q):
        return lambda: (torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64))
    cases = [Case("p = [0.2, 0.6, 0.2, 0], q = [0.4, 0.3, 0.2, 0.1]", tensors(_P, _Q)),
             Case("p = [0.5, 0.3, 0.15, 0.05], q = [0.1, 0.2, 0.3, 0.4]",
                  tensors((0.5, 0.3, 0.15, 0.05), (0.1, 0.2, 0.3, 0.4))),
             Case("greedy: p one-hot at token 3, q one-hot at token 5",
                  tensors(tuple(float(i == 3) for i in range(6)),
                          tuple(float(i == 5) for i in range(6))))]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(5):
        vocab = int(torch.randint(4, 40, (), generator=gen))
        logits = 2 * torch.randn(vocab, generator=gen, dtype=torch.float64)
        p = torch.softmax(logits, -1)
        q = torch.softmax(logits + torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
        cases.append(Case(f"random: a vocabulary of {vocab}, the draft near the target",
                          tensors(tuple(p.tolist()), tuple(q.tolist()))))
    return cases


def _diagnose_residual(expected: Any, got: Any, args: tuple) -> str | None:
    p, q = args
    try:
        r = torch.as_tensor(got, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    if r.shape != p.shape:
        return None

    def close(a):
        return bool(torch.allclose(r, a, rtol=1e-5, atol=1e-8))
    over = int(torch.argmax(q - p))  # the token the draft over-proposes most
    said = f"token {over}: q = {float(q[over]):.3g}, p = {float(p[over]):.3g}"
    if not torch.isfinite(r).all() or float(r.abs().max()) > 1e3:
        worst = "inf or nan" if not torch.isfinite(r).all() else \
            f"entries of {float(r[torch.argmax(r.abs())]):.3g}"
        return (f"your residual has {worst}: the differences p - q sum to 0 over the "
                f"vocabulary (p and q both sum to 1), so dividing them by their sum divides by "
                f"about 0, and some of them are negative: probabilities they are not.")
    if close(sp.residual(q, p)):
        return (f"your residual puts its mass where the draft proposes more than the target "
                f"wants ({said}): after a rejection the missing mass is where the target "
                f"wants more than the draft gives. p and q are the wrong way round.")
    if (r < -1e-12).any():
        k = int(torch.argmin(r))
        return (f"your residual gives token {k} (p = {float(p[k]):.3g}, q = "
                f"{float(q[k]):.3g}) the probability {float(r[k]):.3g}: a distribution to draw "
                f"from has no negative entries.")
    total = float(r.sum())
    if close((p - q).clamp(min=0)):
        return (f"your residual sums to {total:.3g}, not 1: a distribution sums to 1 "
                f"(torch.multinomial would hide it, as it rescales its weights, but a "
                f"probability read from yours is wrong).")
    if close(p):
        return ("your residual is p itself: after a rejection, drawing from p gives again the "
                "share of each token that the accepted proposals already supplied; the tokens "
                "the draft over-proposes then come out too often.")
    if close(q):
        return "your residual is q: after a rejection the draft's distribution is not asked again."
    if close((p - q).abs() / (p - q).abs().sum()):
        return (f"your residual gives mass to tokens the draft already over-proposes ({said}): "
                f"only the tokens where the target wants more than the draft gives get any.")
    if abs(total - 1) > 1e-6:
        return f"your residual sums to {total:.3g}: a distribution sums to 1."
    return None


def check_residual(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 18, exercise 3: ``residual(p, q)`` equals ``speculative.residual`` (``max(0, p - q)``
    normalised) on 3 hand-made pairs of distributions and 5 random ones (``seed``), leaving
    ``p`` and ``q`` unchanged. Prints a pass line and returns True, returns False while the
    function raises NotImplementedError, raises ``CheckFailed`` otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    return run_check("check_residual", student_fn, sp.residual, _residual_cases(seed),
                     result_name="residual", arg_names=("p", "q"), inputs_unchanged=True,
                     rtol=1e-5, atol=1e-8, diagnose=_diagnose_residual,
                     hint="after a rejection, a token comes from the mass the target gives "
                          "beyond the draft's: look at each token's p and q.")


STEPS = 100_000
TARGET = (0.5, 0.3, 0.15, 0.05)
DRAFT = (0.1, 0.2, 0.3, 0.4)
TOLERANCE = 0.01  # about 6 standard deviations of a frequency over 100,000 steps


def speculative_steps(accept: Callable, residual: Callable, p: torch.Tensor, q: torch.Tensor,
                      n: int = STEPS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor]:
    """``n`` tokens, each from one proposal of the draft ``q`` kept or replaced by ``accept``
    and ``residual`` (1-D, one proposal at a time), drawn as ``speculative.one_step`` draws
    them: (tokens, proposals, u, kept)."""
    gen = torch.Generator().manual_seed(seed)
    proposed = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=gen)[:, 0]
    u = torch.rand(n, generator=gen, dtype=p.dtype)
    kept = torch.tensor([_as_bool(accept(p, q, x, v))
                         for x, v in zip(proposed.tolist(), u.tolist(), strict=True)])
    fallback = torch.multinomial(torch.as_tensor(residual(p, q), dtype=p.dtype), n,
                                 replacement=True, generator=gen)
    return torch.where(kept, proposed, fallback), proposed, u, kept


class _Raised(Exception):
    """The student's ``accept`` or ``residual`` raised: which one, and what."""


def _telling(fn: Callable, label: str) -> Callable:
    def call(*args):
        try:
            return fn(*args)
        except NotImplementedError:
            raise
        except Exception as err:
            raise _Raised(f"your {label} raised {type(err).__name__}: {err}") from err
    return call


def check_keeps_target(accept: Callable, residual: Callable, seed: int = 0) -> bool:
    """Lab 18, exercise 3: 100,000 steps of speculative sampling with the student's ``accept``
    and ``residual`` (proposals from the draft q, each kept or replaced) give each token with
    the target's probability p, within 0.01. Prints the frequencies and the acceptance rate and
    returns True, returns False while either function raises NotImplementedError, raises
    ``CheckFailed`` with the part that is wrong named otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_keeps_target"
    p = torch.tensor(TARGET, dtype=torch.float64)
    q = torch.tensor(DRAFT, dtype=torch.float64)
    where = f"{name}: {STEPS:,} steps, target p = {list(TARGET)}, draft q = {list(DRAFT)}"
    try:
        tokens, proposed, u, kept = speculative_steps(
            _telling(accept, "accept"), _telling(residual, "residual"), p, q, seed=seed)
    except NotImplementedError:
        return not_implemented(name)
    except _Raised as err:
        raise CheckFailed(f"{where}\n  {err}\nHint: check_accept and check_residual show "
                          f"the arguments each gets.") from err
    except Exception as err:  # torch could not draw from the residual
        raise CheckFailed(f"{where}\n  drawing from your residual(p, q) raised "
                          f"{type(err).__name__}: {err}\nHint: after a rejection the token is "
                          f"drawn from residual(p, q), so it must be a distribution (no "
                          f"negative entry, no nan); check_residual tells more.") from err
    freq = torch.bincount(tokens, minlength=len(p)).double() / STEPS
    gap = (freq - p).abs()
    rate, alpha = float(kept.double().mean()), float(torch.minimum(p, q).sum())
    if float(gap.max()) <= TOLERANCE:
        print(f"✓ {name}: {STEPS:,} steps give the target's p within {TOLERANCE} (largest gap "
              f"{float(gap.max()):.4f}); {rate:.1%} of the proposals kept, the sum of "
              f"min(p, q) being {alpha:.1%}")
        return True
    table = "\n".join(f"  {x:>5}  {float(p[x]):>10.3f}  {float(freq[x]):>6.3f}  "
                      f"{float(q[x]):>9.3f}" for x in range(len(p)))
    right = sp.accept(p.expand(STEPS, -1), q.expand(STEPS, -1), proposed, u)
    wrong = int((right != kept).sum())
    if wrong:
        i = int(torch.nonzero(right != kept)[0])
        x = int(proposed[i])
        hint = (f"your accept disagrees with the rule on {wrong:,} of the {STEPS:,} proposals "
                f"(token {x}, p(x) = {float(p[x]):.3g}, q(x) = {float(q[x]):.3g}, u = "
                f"{float(u[i]):.3g}: you {'kept' if bool(kept[i]) else 'dropped'} it); you kept "
                f"{rate:.1%} of the proposals, where the rule keeps {alpha:.1%}. check_accept "
                f"names the mistake.")
    else:
        hint = ("your accept keeps exactly the right proposals, so the tokens drawn after a "
                "rejection are wrong: residual(p, q) is not what is missing from p once the "
                "accepted proposals are counted; check_residual names the mistake.")
    raise CheckFailed(f"{where}\n  token  p (target)  yours  q (draft)\n{table}\n  largest gap "
                      f"{float(gap.max()):.3f} (allowed {TOLERANCE})\nHint: {hint}")
