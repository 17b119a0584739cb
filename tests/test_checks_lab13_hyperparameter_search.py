"""Lab 13's checks: the right rule and the right busy fraction pass; every usual mistake of
ASHA's decision (from the lowest rung, the top eta, rounding up, promoting twice, the worst
first, the top rung promoting) and of the busy fraction is caught with a hint that says what
the code did; a template is a notice, not a failure."""

import math

import pytest

from course_lib.checks import lab13_hyperparameter_search as checks
from course_lib.checks.framework import CheckFailed


def rule(order="down", keep=lambda n, eta: n // eta, skip=True, top=False, worst=False):
    def choose(results, promoted, eta):
        rungs = list(range(len(results) - (1 if top else 2), -1, -1))
        for rung in rungs[::-1] if order == "up" else rungs:
            ranked = sorted(results[rung], key=lambda c: results[rung][c] * (1 if worst else -1))
            for config_id in ranked[:keep(len(ranked), eta)]:
                if not skip or config_id not in promoted[rung]:
                    return rung, config_id
        return None
    return choose


def test_the_right_rule_passes(capsys):
    assert checks.check_choose(rule())
    assert "every decision as the course's ASHA's" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, said", [
    (rule(order="up"), "scans the rungs from the lowest up"),
    (rule(keep=lambda n, eta: eta), "keeps the top eta of a rung instead of its top 1/eta"),
    (rule(keep=lambda n, eta: math.ceil(n / eta)), "rounds 1/eta of the rung up"),
    (rule(skip=False), "promotes a configuration that was promoted already"),
    (rule(worst=True), "ranks the worst first"),
    (rule(top=True), "lets the top rung promote"),
])
def test_every_usual_mistake_is_named(mistake, said):
    with pytest.raises(CheckFailed) as failed:
        checks.check_choose(mistake)
    assert said in str(failed.value) and "the rungs" in str(failed.value), str(failed.value)


def stops_at_a_promoted_one(results, promoted, eta):
    for rung in range(len(results) - 2, -1, -1):
        ranked = sorted(results[rung], key=lambda c: -results[rung][c])
        for config_id in ranked[:len(ranked) // eta]:
            if config_id in promoted[rung]:
                break                        # should be: continue
            return rung, config_id
    return None


def returns_inside_the_loop(results, promoted, eta):
    for rung in range(len(results) - 2, -1, -1):
        ranked = sorted(results[rung], key=lambda c: -results[rung][c])
        for config_id in ranked[:len(ranked) // eta]:
            if config_id not in promoted[rung]:
                return rung, config_id
        return None                          # one indent too deep
    return None


def whole_rung(results, promoted, eta):
    for rung in range(len(results) - 2, -1, -1):
        for config_id in sorted(results[rung], key=lambda c: -results[rung][c]):
            if config_id not in promoted[rung]:
                return rung, config_id
    return None


def arrival_order(results, promoted, eta):
    for rung in range(len(results) - 2, -1, -1):
        ids = list(results[rung])
        for config_id in ids[:len(ids) // eta]:
            if config_id not in promoted[rung]:
                return rung, config_id
    return None


def top_of_the_rest(results, promoted, eta):
    for rung in range(len(results) - 2, -1, -1):
        rest = [c for c in sorted(results[rung], key=lambda c: -results[rung][c])
                if c not in promoted[rung]]
        if rest[:len(rest) // eta]:
            return rung, rest[0]
    return None


def at_least_one(results, promoted, eta):
    return rule(keep=lambda n, eta: max(1, n // eta))(results, promoted, eta)


def the_rung_it_goes_to(results, promoted, eta):
    answer = rule()(results, promoted, eta)
    return None if answer is None else (answer[0] + 1, answer[1])


@pytest.mark.parametrize("mistake, said", [
    (stops_at_a_promoted_one, "stops looking at a rung at its first configuration promoted "
                              "already (break"),
    (returns_inside_the_loop, "gives up after the highest rung"),
    (whole_rung, "looks at the whole rung, not at its top 1/eta"),
    (arrival_order, "ranks a rung in the order its results came, not by accuracy"),
    (top_of_the_rest, "takes the top 1/eta of the configurations not promoted yet"),
    (at_least_one, "lets a rung of fewer than eta results promote one"),
    (the_rung_it_goes_to, "returns the rung the configuration goes to"),
])
def test_more_mistakes_are_named_and_only_them(mistake, said):
    with pytest.raises(CheckFailed) as failed:
        checks.check_choose(mistake)
    hint = str(failed.value).split("Hint: ")[1]
    assert hint == f"your rule {[m for m in checks.MISTAKES if said in m][0]}.", hint


def test_an_answer_that_is_not_a_pair_is_told_so():
    with pytest.raises(CheckFailed, match=r"return a pair \(rung, config_id\)"):
        checks.check_choose(lambda results, promoted, eta: (rule()(results, promoted, eta)
                                                            or (None, None))[1])


def test_a_rule_no_usual_mistake_explains_gets_the_steps():
    def odd(results, promoted, eta):
        answer = rule()(results, promoted, eta)
        return None if answer == (0, 3) else answer
    with pytest.raises(CheckFailed, match="compare your rule with the exercise's, step by step"):
        checks.check_choose(odd)


def test_a_mistake_seen_only_in_a_search_is_named_at_its_decision(monkeypatch):
    """Without the hand-made states, promoting twice shows in the simulated search itself."""
    monkeypatch.setattr(checks, "STATES", ())
    with pytest.raises(CheckFailed, match=r"was promoted from rung \d already"):
        checks.check_choose(rule(skip=False))


def test_a_rule_that_modifies_or_returns_odd_things():
    def nonsense(results, promoted, eta):
        return 0, 999
    with pytest.raises(CheckFailed, match="expected"):
        checks.check_choose(nonsense)


def busy(jobs, num_engines, elapsed):
    return sum(j.end - j.start for j in jobs) / (num_engines * elapsed)


@pytest.mark.parametrize("mistake, said", [
    (lambda jobs, n, elapsed: sum(j.end - j.start for j in jobs) / elapsed,
     "divide by every engine's time"),
    (lambda jobs, n, elapsed: sum(j.epochs_trained for j in jobs) / (n * elapsed),
     "not their epochs"),
    (lambda jobs, n, elapsed: 1 - busy(jobs, n, elapsed), "that is the idle fraction"),
    (lambda jobs, n, elapsed: sum(j.end for j in jobs) / (n * elapsed),
     "add up the time of every job"),
    (lambda jobs, n, elapsed: 100 * busy(jobs, n, elapsed), "that is a percentage"),
    (lambda jobs, n, elapsed: sum(j.start - j.end for j in jobs) / (n * elapsed),
     "end - start, not start - end"),
    (lambda jobs, n, elapsed: sum(j.end - j.start for j in jobs) / n,
     "busy time per engine, in seconds"),
    (lambda jobs, n, elapsed: sum(j.end - j.start for j in jobs) / (len(jobs) * elapsed),
     "you divided by the number of jobs"),
    (lambda jobs, n, elapsed: sum(j.end - j.start for j in jobs) // (n * elapsed),
     "// is integer division"),
    (lambda jobs, n, elapsed: None, "add up the time of every job"),
])
def test_busy_fraction_mistakes(mistake, said):
    assert checks.check_busy_fraction(busy)
    with pytest.raises(CheckFailed) as failed:
        checks.check_busy_fraction(mistake)
    assert said in str(failed.value)


def test_templates_are_a_notice():
    def template(*args):
        raise NotImplementedError("exercise 1: fill in choose")
    assert checks.check_choose(template) is False
    assert checks.check_busy_fraction(template) is False
