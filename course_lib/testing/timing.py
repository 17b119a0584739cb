"""What a test may assert about time: only what the code guarantees whatever else the machine runs.

A student's laptop, a shared CI runner: none is idle, and a process can wait seconds for a core.
So a test never bounds how fast something is. It asserts the promise instead: the error came from
its deadline (not before it), and it came at all, within a bound so generous that only a wait
that ignores its deadline exceeds it::

    t = time.monotonic()
    with pytest.raises(CommTimeout, match="within 1s"):   # the deadline named in the message
        ...
    timing.assert_no_hang(time.monotonic() - t, deadline=1, timed_out=True)

The tight figure (a deadline plus a few seconds of grace) is a measurement: ``python -m course_lib
faults`` reports it with the machine's load beside it. ``tests/test_structure.py`` finds an
``assert`` that compares a measured time with a fixed number; a bound that holds under any load
(an emulated link sleeps until a message's modelled end, so it is never early) carries the comment
``# holds under load: <why>``.
"""

from __future__ import annotations

HANG_FACTOR = 3      # an error this many deadlines late ...
HANG_SLACK = 20.0    # ... plus these seconds came from a hang (or another, longer wait), not load


def hang_bound(deadline: float) -> float:
    """The seconds after which an error due at ``deadline`` s counts as a hang."""
    return HANG_FACTOR * deadline + HANG_SLACK


def assert_no_hang(seconds: float, deadline: float, *, timed_out: bool = False,
                   instead: float | None = None) -> None:
    """Assert that an error due at ``deadline`` s came after ``seconds`` s from its own wait:
    within :func:`hang_bound` (and no earlier than the deadline when ``timed_out``: the error is
    that deadline passing). ``instead``: the longer wait a bug would make (a default deadline, a
    sleep that should have been interrupted); the bound must be below it to tell them apart."""
    bound = hang_bound(deadline)
    if instead is not None and instead <= bound:
        raise ValueError(f"a {deadline:g} s deadline cannot be told from a {instead:g} s wait "
                         f"under load (the bound is {bound:g} s): make the wrong wait longer")
    assert seconds <= bound, (
        f"the error came {seconds:.1f} s after the start, past {HANG_FACTOR} x its {deadline:g} s "
        f"deadline + {HANG_SLACK:g} s: a wait that ignores its deadline" +
        (f" (as the {instead:g} s one)" if instead else ""))
    if timed_out:
        assert seconds >= deadline, f"a {deadline:g} s deadline fired after {seconds:.2f} s"
