"""The check framework (course_lib/checks/framework.py): comparing results, running cases, and
the hints of a failed case."""

import re
import sys

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


def _shown_in_ipython(capsys, *cells):
    """What IPython prints for these cells, colours removed."""
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    capsys.readouterr()
    for cell in cells:
        shell.run_cell(cell)
    return shell, re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)


def test_a_failed_check_in_a_notebook_shows_the_hint_then_only_the_students_lines(capsys):
    """The message and its hint come first; then the student's cell line, no library frame."""
    shell, shown = _shown_in_ipython(
        capsys, "from course_lib.checks import lab01_gradient_descent as checks\n"
                "checks.check_step_decay(lambda lr, drop, k: (lambda epoch: lr))")
    lines = shown.splitlines()
    assert lines[0].startswith("CheckFailed: check_step_decay: case 1/6"), shown
    assert lines[2].startswith("Hint: epoch 10 "), shown
    assert lines[3:5] == ["", "Your code (most recent call last):"], shown
    assert re.fullmatch(r"  Cell In\[\d+\], line 2", lines[5]), shown
    assert lines[6:] == ["    checks.check_step_decay(lambda lr, drop, k: (lambda epoch: lr))"]
    assert isinstance(sys.last_value, CheckFailed)  # %debug works as after any error


def test_a_crash_in_the_students_function_shows_where_in_their_code(capsys):
    _, shown = _shown_in_ipython(
        capsys, "from course_lib.checks import lab01_gradient_descent as checks",
        "def minibatch_epoch(problem, X, y, theta, lr, batch_size, rng):\n"
        "    losses = [problem.loss(theta, X, y)]\n"
        "    return theta, losses[1]",
        "ok = checks.check_minibatch_epoch(minibatch_epoch)")
    lines = shown.splitlines()
    assert lines[0].startswith("CheckFailed: check_minibatch_epoch: case 1/5"), shown
    assert lines[1] == "  your function raised IndexError: list index out of range", shown
    assert lines[2].startswith("Hint: "), shown
    assert lines[5:] == [lines[5], "    ok = checks.check_minibatch_epoch(minibatch_epoch)",
                         lines[7], "    return theta, losses[1]"], shown
    assert lines[7].endswith(", line 3, in minibatch_epoch"), shown
    assert "framework.py" not in shown and "Traceback" not in shown


def test_a_crash_on_the_ranks_shows_the_line_of_the_students_cell(capsys):
    """A check that ran the student's function on a cluster raises from the RemoteError, whose
    per-rank tracebacks name the cell's file: the line is shown from this kernel's cell."""
    _, shown = _shown_in_ipython(
        capsys, "def ring(buf, comm):\n    return buf[99]",
        "from course_lib.checks import CheckFailed\n"
        "class RemoteError(Exception):\n"
        "    errors = {1: f'IndexError: 99\\nFile {ring.__code__.co_filename}:2, in ring(buf)'}\n"
        "raise CheckFailed('check_ring: case 1/1\\nHint: h') from RemoteError()")
    lines = shown.splitlines()
    assert lines[:2] == ["CheckFailed: check_ring: case 1/1", "Hint: h"], shown
    assert re.fullmatch(r"  rank 1: Cell In\[\d+\], line 2, in ring", lines[-2]), shown
    assert lines[-1] == "    return buf[99]", shown


def test_someone_elses_ipython_exception_handler_is_kept(capsys):
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    handler = lambda self, etype, value, tb, tb_offset=None: print("their handler")  # noqa: E731
    shell.set_custom_exc((ValueError,), handler)
    try:
        _, shown = _shown_in_ipython(capsys, "from course_lib.checks import CheckFailed\n"
                                             "raise CheckFailed('x')", "raise ValueError")
        assert shell.custom_exceptions == (ValueError,)
        assert "Traceback" in shown and shown.strip().endswith("their handler")
    finally:
        shell.set_custom_exc((), None)
