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


def test_compare_points_at_the_first_differing_item_of_lists_of_tuples():
    expected = [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert checks.compare(expected, [("F", 0), ("F", 1), ("B", 0), ("B", 1)]) is None
    assert checks.compare(expected, [("F", 0), ("B", 0), ("F", 1), ("B", 1)]) == \
        "output[1][0]: expected 'F', got 'B'"
    assert checks.compare(expected, expected[:3]) == \
        "output: expected length 4, got length 3: output[3] = ('B', 1) is missing"
    assert checks.compare([None, "x"], [None, "x"]) is None


def test_sequence_difference_names_the_first_difference_before_both_lists():
    """Two lists of 16 tuples wrap over several lines: the index and the two items that differ
    come first, then the lists."""
    expected = [("F", m) for m in range(4)] + [(op, m) for m in range(4, 8) for op in "BF"] \
        + [("B", m) for m in range(4, 8)]
    got = [("F", m) for m in range(8)] + [("B", m) for m in range(8)]
    assert len(expected) == len(got) == 16
    lines = checks.sequence_difference(expected, got).splitlines()
    assert lines == ["  first difference at index 4: expected ('B', 4), got ('F', 4)",
                     f"  expected {expected}", f"  got      {got}"]
    assert checks.sequence_difference(expected, got[:3]).splitlines()[0] == \
        "  yours stops after 3 items: index 3 is missing, expected ('F', 3)"
    assert checks.sequence_difference(got[:3], got).splitlines()[0] == \
        "  yours has 13 item(s) too many: index 3, ('F', 3), is not expected"
    assert checks.sequence_difference([1], None, indent="").splitlines() == \
        ["expected [1]", "got      None"]


def test_a_wrong_pipeline_order_is_shown_from_its_first_difference():
    """Lab 09's check of the 1F1B order (16 steps on stage 0 of 4 with 8 micro-batches)."""
    from course_lib import pipeline
    from course_lib.checks import lab09_model_parallelism as lab09

    def gpipe(stage, num_stages, num_microbatches):
        return pipeline.schedule_order("gpipe", stage, num_stages, num_microbatches)

    with pytest.raises(CheckFailed) as failed:
        lab09.check_1f1b_order(gpipe)
    lines = str(failed.value).splitlines()
    assert lines[1] == "  first difference at index 4: expected ('B', 0), got ('F', 4)", lines
    assert lines[2].startswith("  expected [('F', 0), ") and lines[3].startswith("  got      [")
    assert lines[4].startswith("Hint: that is GPipe's order")


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
    assert lines[2].startswith("Hint: your rate never drops"), shown
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
