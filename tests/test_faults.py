"""The fault suite, every scenario once: each fault ends in an error within its deadline that
names what it must, leaves no process behind, exposes nothing beyond loopback, and leaves the
cluster usable. (`python -m course_lib faults --repeat 20` is the flake hunt.)"""

import pytest

from course_lib.testing import fault_scenarios  # noqa: F401 - registers the scenarios
from course_lib.testing.fault_suite import (
    SCENARIOS,
    Context,
    available,
    format_row,
    run_all,
    run_one,
)


@pytest.fixture(scope="module")
def context():
    ctx = Context()
    yield ctx
    ctx.stop()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_keeps_every_promise(context, name):
    sc = SCENARIOS[name]
    reason = available(sc)
    if reason:
        pytest.skip(f"{name}: {reason}")
    row = run_one(sc, context)
    assert row.passed, format_row(row) + (f"\nleft: {row.left}" if row.left else "") + \
        (f"\nexposed: {row.exposed}" if row.exposed else "")
    assert row.error and not row.error.startswith("skipped")


def test_unknown_names_and_bad_repeats_are_refused():
    with pytest.raises(ValueError, match="unknown scenario.*'nope'.*collective-mismatch"):
        run_all(["nope"])
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        run_all(["bad-arguments"], repeat=0)


def test_a_broken_promise_fails_its_row(context):
    from course_lib.testing.fault_suite import Broken, Scenario

    def silent(ctx):
        raise Broken("raised nothing")

    def slow(ctx):
        return 24.0, "hung"

    def late(ctx):
        return 5.0, "late"

    def leaves_and_listens(ctx):
        import socket
        import subprocess
        ctx.stray = subprocess.Popen(["sleep", "60"])
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            s.listen()
            ctx.watch.wait_samples()  # seen listening, however busy the machine
        return 0.1, "done"

    assert run_one(Scenario("x", "p", 1.0, silent), context).broken == "raised nothing"
    hung = run_one(Scenario("y", "p", 1.0, slow), context)
    assert not hung.passed and "past 23 s for a 1 s deadline: a hang" in hung.broken
    slow_but_kept = run_one(Scenario("w", "p", 1.0, late), context)  # a busy machine's delay
    assert slow_but_kept.passed and slow_but_kept.late and "5.0s*" in format_row(slow_but_kept)
    messy = run_one(Scenario("z", "p", 1.0, leaves_and_listens), context)
    assert not messy.passed and "sleep 60" in messy.left[0] and "0.0.0.0" in messy.exposed[0]
    assert context.stray.wait(timeout=5) != 0  # the runner killed what was left
