"""Checks for labs/13_hyperparameter_search.ipynb: ASHA's decision rule and the busy fraction
(notebook 13).

In the lab, under each exercise::

    from course_lib.checks import lab13_hyperparameter_search as checks
    checks.check_choose(choose)            # decision by decision, against hpsearch.ASHA
    checks.check_busy_fraction(busy_fraction)

``choose(results, promoted, eta)`` is ASHA's rule as a pure function: ``results[k]`` maps each
configuration id that rung ``k`` has reported to its accuracy (in the order they arrived),
``promoted[k]`` is the set already sent up from rung ``k``; it returns ``(k, config_id)``, the
configuration to promote from rung ``k`` to ``k + 1``, or None (start a new configuration).
The check runs ASHA with it on the simulated clock of ``hpsearch_loop.simulate`` (surrogate
trials, several engines, seeded configurations) beside the course's ``hpsearch.ASHA``, and
stops at the first decision that differs: it names the decision, shows each rung's standings
and says which usual mistake gives the answer the student's gave (scanning from the lowest rung,
the top ``eta`` instead of the top ``1/eta``, rounding up, promoting twice, the worst first, the
top rung promoting). ``busy_fraction(jobs, num_engines, elapsed)`` is compared with
``SearchResult.busy_fraction`` on simulated searches.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

from course_lib import hpsearch
from course_lib.checks.framework import CheckFailed, not_implemented
from course_lib.hpsearch_loop import simulate

CASES = ((27, 1, 9, 3, 4), (27, 1, 9, 3, 9), (64, 1, 16, 4, 8), (40, 2, 18, 3, 6))
# (configurations, min epochs, max epochs, eta, engines)


def _rung(*accs, first=0):
    """A rung's results: configuration first, first + 1, ... with these accuracies."""
    return {first + i: a for i, a in enumerate(accs)}


# states where the usual mistakes answer otherwise: (what it shows, results, promoted, eta)
STATES = (
    ("two rungs could promote: the higher one goes first",
     [_rung(.50, .60, .70, .40, .30, .20), {2: .80, 1: .70, 0: .10}, {}],
     [{2}, set(), set()], 3),
    ("12 results, eta 3: the top 4 may go up",
     [_rung(.9, .8, .7, .6, .5, .4, .3, .2, .1, .05, .04, .03), {}, {}],
     [{0, 1, 2}, set(), set()], 3),
    ("10 results, eta 3: the top 3 only (10 // 3)",
     [_rung(.9, .8, .7, .6, .5, .4, .3, .2, .1, .05), {}, {}], [{0, 1, 2}, set(), set()], 3),
    ("the best is promoted already: the next best of the top 1/eta goes",
     [_rung(.2, .9, .3, .8, .1, .4), {}, {}], [{1}, set(), set()], 3),
    ("a rung of fewer than eta results promotes nobody yet",
     [_rung(.50, .60), {}, {}], [set(), set(), set()], 3),
    ("the top rung has results but no rung above it",
     [_rung(.5, .4, .3), {0: .6}, {0: .7, 5: .2, 6: .1}], [{0}, {0}, set()], 3),
)


def reference_choose(results: list[dict], promoted: list[set], eta: int) -> tuple | None:
    """ASHA's rule (as ``hpsearch.ASHA``): from the highest rung that can promote down, the best
    configuration in the top 1/eta of what that rung has reported so far, not promoted yet."""
    for rung in range(len(results) - 2, -1, -1):
        ranked = sorted(results[rung], key=lambda c: -results[rung][c])
        for config_id in ranked[:len(ranked) // eta]:
            if config_id not in promoted[rung]:
                return rung, config_id
    return None


def _mistakes(results, promoted, eta):
    """What the usual wrong rules answer in this state: {mistake: answer}."""
    def rule(order, keep, skip_promoted=True, top=True, worst=False):
        rungs = range(len(results) - (1 if top else 2), -1, -1)
        for rung in (rungs if order == "down" else reversed(rungs)):
            ranked = sorted(results[rung], key=lambda c: results[rung][c] * (1 if worst else -1))
            for config_id in ranked[:keep(len(ranked))]:
                if not skip_promoted or config_id not in promoted[rung]:
                    return rung, config_id
        return None
    floor = lambda n: n // eta  # noqa: E731  (the rule: the top 1/eta, rounded down)
    return {
        "scans the rungs from the lowest up": rule("up", floor, top=False),
        "keeps the top eta of a rung instead of its top 1/eta": rule("down", lambda n: eta,
                                                                     top=False),
        "rounds 1/eta of the rung up (so a rung of fewer than eta results promotes)":
            rule("down", lambda n: math.ceil(n / eta), top=False),
        "promotes a configuration that was promoted already": rule("down", floor, False,
                                                                   top=False),
        "ranks the worst first": rule("down", floor, top=False, worst=True),
        "lets the top rung promote (it has no rung above)": rule("down", floor, top=True),
    }


class StudentASHA(hpsearch.ASHA):
    """``hpsearch.ASHA`` whose promotion rule is ``choose``; records every decision with the
    state it was made in."""

    def __init__(self, choose: Callable, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choose, self.decisions = choose, []

    def _promotion(self):
        state = (copy.deepcopy(self.results), copy.deepcopy(self.promoted))
        answer = self.choose(copy.deepcopy(self.results), copy.deepcopy(self.promoted),
                             self.eta)
        self.decisions.append((state, answer))
        if answer is None:
            return None
        rung, config_id = answer
        if not 0 <= rung < len(self.epochs) - 1 or config_id not in self.results[rung]:
            raise CheckFailed(f"choose returned ({rung}, {config_id}): rung {rung} has no "
                              f"configuration {config_id}, or no rung above it (rungs 0 to "
                              f"{len(self.epochs) - 1})\nHint: the top rung never promotes; "
                              "scan from the second highest down")
        if config_id in self.promoted[rung]:
            raise CheckFailed(f"choose returned ({rung}, {config_id}) at decision "
                              f"{len(self.decisions)}, but configuration {config_id} was "
                              f"promoted from rung {rung} already\nHint: skip what "
                              "promoted[rung] holds")
        self.promoted[rung].add(config_id)
        return hpsearch.Job(config_id, self.configs[config_id], rung + 1,
                            self.epochs[rung + 1])


def _hint(results, promoted, eta, got, expected):
    """The usual mistakes that answer ``got`` in this state, or the rule in words."""
    mistakes = [m for m, answer in _mistakes(results, promoted, eta).items()
                if answer == got and answer != expected]
    if mistakes:
        return f"your rule {' or '.join(mistakes)}."
    return ("scan the rungs from the second highest down; in each, rank what it has reported "
            "so far, best first, and look at the top len // eta of them.")


def _standings(results, promoted):
    lines = []
    for rung, table in enumerate(results):
        ranked = sorted(table, key=lambda c: -table[c])
        shown = ", ".join(f"{c}: {table[c]:.3f}{'*' if c in promoted[rung] else ''}"
                          for c in ranked[:8]) + (" ..." if len(ranked) > 8 else "")
        lines.append(f"    rung {rung} ({len(table)} reported): {shown or '-'}")
    return "\n".join(lines) + "\n    (* promoted already)"


def check_choose(choose: Callable) -> bool:
    """ASHA with ``choose`` makes, decision by decision, the course's ASHA's decisions on the
    simulated clock. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    __tracebackhide__ = True
    name = "check_choose"
    for what, results, promoted, eta in STATES:
        expected = reference_choose(results, promoted, eta)
        try:
            got = choose(copy.deepcopy(results), copy.deepcopy(promoted), eta)
        except NotImplementedError:
            return not_implemented(name)
        except Exception as e:
            raise CheckFailed(f"{name}: {what}: your choose raised {type(e).__name__}: "
                              f"{e}") from e
        if got is not None:
            got = tuple(got)
        if got != expected:
            raise CheckFailed(f"{name}: {what} (eta {eta}): expected {expected}, got {got}\n"
                              f"  the rungs:\n{_standings(results, promoted)}\n"
                              f"Hint: {_hint(results, promoted, eta, got, expected)}")
    for number, (n, r, R, eta, engines) in enumerate(CASES, start=1):
        configs = hpsearch.configurations(hpsearch.SPACE, n, seed=number)
        reference = StudentASHA(reference_choose, configs, r, R, eta)
        student = StudentASHA(choose, configs, r, R, eta)
        try:
            simulate(student, engines)
        except NotImplementedError:
            return not_implemented(name)
        except CheckFailed as e:
            raise CheckFailed(f"{name}: case {number} ({n} configurations, epochs {r} to {R}, "
                              f"eta {eta}, {engines} engines): {e}") from None
        except Exception as e:
            raise CheckFailed(f"{name}: case {number}: your choose raised "
                              f"{type(e).__name__}: {e}") from e
        simulate(reference, engines)
        pairs = zip(student.decisions, reference.decisions, strict=False)  # lengths: below
        for k, ((state, got), (_, expected)) in enumerate(pairs):
            if got == expected:
                continue
            results, promoted = state
            hint = _hint(results, promoted, eta, got, expected)
            raise CheckFailed(
                f"{name}: case {number} ({n} configurations, epochs {r} to {R}, eta {eta}, "
                f"{engines} engines), decision {k + 1}: expected {expected}, got {got}\n"
                f"  the rungs then:\n{_standings(results, promoted)}\nHint: {hint}")
        if len(student.decisions) != len(reference.decisions):
            raise CheckFailed(f"{name}: case {number}: {len(student.decisions)} decisions, "
                              f"expected {len(reference.decisions)}")
    print(f"✓ {name}: {len(CASES)} searches, every decision as the course's ASHA's")
    return True


def check_busy_fraction(busy_fraction: Callable) -> bool:
    """``busy_fraction(jobs, num_engines, elapsed)`` against ``SearchResult.busy_fraction``
    on ASHA and synchronous successive halving, simulated.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    __tracebackhide__ = True
    name = "check_busy_fraction"
    cases = [(policy, engines) for policy in ("ASHA", "SuccessiveHalving") for engines in (4, 16)]
    for policy, engines in cases:
        configs = hpsearch.configurations(hpsearch.SPACE, 27, seed=0)
        search = simulate(getattr(hpsearch, policy)(configs, 1, 9, 3), engines)
        expected = search.busy_fraction()
        try:
            got = busy_fraction(search.jobs, engines, search.elapsed)
        except NotImplementedError:
            return not_implemented(name)
        if got is None or abs(got - expected) > 1e-9:
            trained = sum(j.end - j.start for j in search.jobs)
            hints = {trained / search.elapsed: "divide by every engine's time: num_engines x "
                                               "elapsed",
                     sum(j.epochs_trained for j in search.jobs) / (engines * search.elapsed):
                         "count the time the jobs took (end - start), not their epochs",
                     1 - expected: "that is the idle fraction: the busy time over the "
                                   "engines' time"}
            hint = next((h for v, h in hints.items() if got is not None
                         and abs(got - v) < 1e-9), "sum every job's end - start, divide by "
                                                   "num_engines x elapsed")
            raise CheckFailed(f"{name}: {policy} on {engines} engines: expected {expected:.4f}, "
                              f"got {got}\nHint: {hint}")
    print(f"✓ {name}: {len(cases)} simulated searches")
    return True
