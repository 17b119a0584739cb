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
and says which usual mistake answers as the student's rule does in every hand-made state
(scanning from the lowest rung, the top ``eta`` instead of the top ``1/eta``, rounding up, the
whole rung, promoting twice, a break or a return too early, the worst first, the top rung
promoting, ...): a mistake that agrees in one state only, by chance, is not named.
``busy_fraction(jobs, num_engines, elapsed)`` is compared with
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
    ("the best of rung 1 went up already: the second of its top 1/eta goes",
     [_rung(.9, .8, .7, .6, .5, .4), {0: .95, 1: .85, 2: .75, 3: .65, 4: .55, 5: .45}, {}],
     [{0}, {0}, set()], 3),
    ("rung 1's top 1/eta went up already: rung 0 promotes",
     [_rung(.9, .8, .7, .6, .5, .4), {0: .95, 1: .85, 2: .75}, {}], [{0}, {0}, set()], 3),
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


def _rule(order="down", keep=lambda n, eta: n // eta, skip=True, top=False, worst=False,
          stop_at_promoted=False, one_rung=False, ranked_by_accuracy=True, cut_of_unpromoted=False,
          destination=False) -> Callable:
    """ASHA's rule with one of the usual slips (the defaults: the rule itself)."""
    def choose(results, promoted, eta):
        rungs = range(len(results) - (1 if top else 2), -1, -1)
        for rung in (rungs if order == "down" else reversed(rungs)):
            ranked = list(results[rung])
            if ranked_by_accuracy:
                ranked.sort(key=lambda c: results[rung][c] * (1 if worst else -1))
            if cut_of_unpromoted:
                ranked = [c for c in ranked if c not in promoted[rung]]
            for config_id in ranked[:keep(len(ranked), eta)]:
                if not skip or config_id not in promoted[rung]:
                    return (rung + 1 if destination else rung), config_id
                if stop_at_promoted:
                    break
            if one_rung:
                return None
        return None
    return choose


MISTAKES = {  # what a rule does wrong: the rule that does it
    "scans the rungs from the lowest up": _rule(order="up"),
    "keeps the top eta of a rung instead of its top 1/eta": _rule(keep=lambda n, eta: eta),
    "rounds 1/eta of the rung up (so a rung of fewer than eta results promotes)":
        _rule(keep=lambda n, eta: math.ceil(n / eta)),
    "lets a rung of fewer than eta results promote one (at least one, not len // eta)":
        _rule(keep=lambda n, eta: max(1, n // eta)),
    "looks at the whole rung, not at its top 1/eta": _rule(keep=lambda n, eta: n),
    "takes the top 1/eta of the configurations not promoted yet, not of all the rung has "
    "reported": _rule(cut_of_unpromoted=True),
    "promotes a configuration that was promoted already": _rule(skip=False),
    "stops looking at a rung at its first configuration promoted already (break, where the "
    "next one should be tried)": _rule(stop_at_promoted=True),
    "gives up after the highest rung (a return None inside the loop over the rungs)":
        _rule(one_rung=True),
    "ranks the worst first": _rule(worst=True),
    "ranks a rung in the order its results came, not by accuracy": _rule(
        ranked_by_accuracy=False),
    "lets the top rung promote (it has no rung above)": _rule(top=True),
    "returns the rung the configuration goes to, not the rung it leaves": _rule(
        destination=True),
}


def _answers(choose, states=None):
    """What ``choose`` answers in each of the hand-made states (an exception: its type)."""
    out = []
    for _, results, promoted, eta in STATES if states is None else states:
        try:
            got = choose(copy.deepcopy(results), copy.deepcopy(promoted), eta)
            out.append(tuple(got) if isinstance(got, (list, tuple)) else got)
        except Exception as e:  # noqa: BLE001 - an answer like another
            out.append(type(e).__name__)
    return out


def _mistakes_of(choose):
    """The usual mistakes that answer as ``choose`` does in every hand-made state: a mistake
    that agrees in one state only, by chance, is not named."""
    mine = _answers(choose)
    return [m for m, rule in MISTAKES.items() if _answers(rule) == mine]


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


RULE = ("compare your rule with the exercise's, step by step: which rungs it looks at and in "
        "what order, how it ranks a rung, how many of the top it takes, and what it skips.")


def _hint(choose):
    """The usual mistakes that ``choose`` makes (it answers as they do in every hand-made
    state), or a pointer to the rule's steps."""
    mistakes = _mistakes_of(choose)
    return f"your rule {' or '.join(mistakes)}." if mistakes else RULE


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
        if got is not None and not (isinstance(got, (list, tuple)) and len(got) == 2):
            raise CheckFailed(f"{name}: {what} (eta {eta}): expected {expected}, got {got!r}\n"
                              f"Hint: return a pair (rung, config_id): the rung the "
                              f"configuration leaves and its id, or None.")
        if got is not None:
            got = tuple(got)
        if got != expected:
            raise CheckFailed(f"{name}: {what} (eta {eta}): expected {expected}, got {got}\n"
                              f"  the rungs:\n{_standings(results, promoted)}\n"
                              f"Hint: {_hint(choose)}")
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
            hint = _hint(choose)
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
        if not isinstance(got, (int, float)) or abs(got - expected) > 1e-9:
            trained = sum(j.end - j.start for j in search.jobs)
            hints = {trained / search.elapsed: "divide by every engine's time: num_engines x "
                                               "elapsed",
                     sum(j.epochs_trained for j in search.jobs) / (engines * search.elapsed):
                         "count the time the jobs took (end - start), not their epochs",
                     1 - expected: "that is the idle fraction: the busy time over the "
                                   "engines' time",
                     100 * expected: "that is a percentage: return the fraction, between 0 "
                                     "and 1",
                     -expected: "each job's time is end - start, not start - end",
                     trained / engines: "that is busy time per engine, in seconds: divide by "
                                        "the elapsed time too",
                     trained / (len(search.jobs) * search.elapsed):
                         f"you divided by the number of jobs ({len(search.jobs)}), not of "
                         f"engines ({engines})",
                     float(trained // (engines * search.elapsed)):
                         "// is integer division: the fraction is below 1, and // rounds it "
                         "down to 0; divide with /"}
            hint = next((h for v, h in hints.items() if isinstance(got, (int, float))
                         and abs(got - v) < 1e-9), "add up the time of every job, and divide "
                                                   "by the time the engines were there for")
            raise CheckFailed(f"{name}: {policy} on {engines} engines: expected {expected:.4f}, "
                              f"got {got}\nHint: {hint}")
    print(f"✓ {name}: {len(cases)} simulated searches")
    return True
