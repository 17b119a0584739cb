"""The check framework (course_lib/checks/framework.py): comparing results, running cases, and
the hints of a failed case."""

import re

import numpy as np
import pytest

from course_lib.checks import framework as checks
from course_lib.checks.framework import Case, CheckFailed


def test_compare_handles_arrays_tensors_and_sequences():
    torch = pytest.importorskip("torch")
    assert checks.compare([1.0, np.ones(3)], (1.0, torch.ones(3))) is None
    assert "shape" in checks.compare(np.ones(3), np.ones(4))
    assert "largest difference at index (1,)" in checks.compare(np.zeros(3), np.array([0, 1, 0]))
    assert "expected length 2" in checks.compare([1, 2], [1])
    assert checks.compare(1.0, 1.0 + 1e-9) is None
    assert checks.compare(1.0, 1.001) is not None


def test_run_check_generic():
    cases = [Case(f"n={n}", lambda n=n: (np.arange(n, dtype=float),)) for n in (0, 1, 5)]
    assert checks.run_check("check_double", lambda x: x * 2, lambda x: 2 * x, cases, hint="h")
    with pytest.raises(CheckFailed, match=r"case 2/3 \(n=1\)[\s\S]*Hint: multiply by two"):
        checks.run_check("check_double", lambda x: x + 1, lambda x: 2 * x, cases,
                         hint="multiply by two")

    def in_place(x):
        x *= 2
        return x

    with pytest.raises(CheckFailed, match="modified its input 'x' in place"):
        checks.run_check("check_double", in_place, lambda x: 2 * x, cases, hint="h",
                         inputs_unchanged=True, arg_names=("x",))
    assert checks.run_check("check_double", in_place, lambda x: 2 * x, cases, hint="h")


def test_a_failed_check_in_a_notebook_shows_the_hint_not_the_library(capsys):
    """In IPython the check's own frames are hidden (``__tracebackhide__``): the student sees
    their cell, one line saying frames were skipped, the raise, and the hint."""
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    capsys.readouterr()
    shell.run_cell("from course_lib.checks import lab01_gradient_descent as checks\n"
                   "checks.check_step_decay(lambda lr, drop, k: (lambda epoch: lr))")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # no colours
    assert "CheckFailed: check_step_decay: case 1/6" in shown and "\nHint: epoch 10 " in shown
    assert "skipping hidden" in shown
    assert "_schedule_values" not in shown and "compare(" not in shown
    assert len(shown.splitlines()) < 40, shown
