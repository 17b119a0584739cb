"""The check framework: run a student's function and the reference side by side on seeded cases.

Every lab's checks (``checks/labNN_topic.py``) are built on it. In a lab notebook, right under
the exercise cell::

    from course_lib.checks import lab01_gradient_descent as checks
    ok_epoch = checks.check_minibatch_epoch(minibatch_epoch)

A check prints ``✓ check_name: 5/5 cases match the reference`` and returns True, or raises
``CheckFailed`` (an ``AssertionError``) whose message names the case, the input sizes, what was
expected and what came back, and a hint. A function that still raises ``NotImplementedError``
gets a friendly notice and the check returns False without raising, so the generated student
notebook runs from top to bottom. In a notebook a failed check shows its message, hint included,
then only the student's own lines that led to it (their cell, their function), no library frames.

Adding a check for a new lab: build a list of ``Case`` (a label and a function returning fresh
arguments) and call ``run_check``; pass ``diagnose`` to turn a mismatch into a targeted hint.
Checks that run the student's code on a cluster's ranks send it with ``pack_function``.
"""

from __future__ import annotations

import inspect
import linecache
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class CheckFailed(AssertionError):
    """A student's function disagrees with the reference; the message says where and why.

    In IPython (a notebook) it is shown as its message, hint included, then only the student's
    own lines that led to it: no frames of the check (see ``_show_check_failed``)."""

    def __init__(self, *args):
        super().__init__(*args)
        _show_briefly_in_ipython()


@dataclass
class Case:
    """One test case: ``args()`` returns fresh positional arguments (new arrays, new rng)."""

    label: str
    args: Callable[[], tuple]


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _as_array(x: Any) -> np.ndarray:
    if _is_tensor(x):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=float)


def _summary(a: np.ndarray) -> str:
    """A short human summary of an array: shape and (first) values."""
    flat = a.ravel()
    head = np.array2string(flat[:4], precision=5, separator=", ")
    more = " ..." if flat.size > 4 else ""
    return f"shape {a.shape}, values {head}{more}"


def compare(expected: Any, got: Any, name: str = "output", rtol: float = 1e-6,
            atol: float = 1e-9) -> str | None:
    """Describe the first difference between ``expected`` and ``got``, or return None.

    Tuples and lists are compared element by element (the first element that differs is named,
    then a length that differs: ``output[3] = ... is missing``); numbers, numpy arrays and
    torch tensors by shape and ``np.allclose(got, expected, rtol, atol)``; anything else
    (strings, None) with ``==``.
    """
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list, np.ndarray)) and not _is_tensor(got):
            return (f"{name}: expected a sequence of length {len(expected)}, "
                    f"got {type(got).__name__}")
        for i, (e, g) in enumerate(zip(expected, got, strict=False)):  # lengths: below
            problem = compare(e, g, f"{name}[{i}]", rtol, atol)
            if problem:
                if len(got) != len(expected):
                    problem += f" (and expected length {len(expected)}, got length {len(got)})"
                return problem
        if len(got) != len(expected):
            i = min(len(got), len(expected))
            extra = (f"{name}[{i}] = {_short(expected[i])} is missing" if i < len(expected)
                     else f"{name}[{i}] = {_short(got[i])} is one too many")
            return f"{name}: expected length {len(expected)}, got length {len(got)}: {extra}"
        return None
    e = _number_or_array(expected)
    if e is None:  # a string, None, ...: compared with ==
        return None if _equal(expected, got) else \
            f"{name}: expected {_short(expected)}, got {_short(got)}"
    try:
        g = _as_array(got)
    except (TypeError, ValueError):
        return f"{name}: expected a number or an array, got {type(got).__name__}"
    if e.shape != g.shape:
        return f"{name}: expected shape {e.shape}, got shape {g.shape}"
    if not np.allclose(g, e, rtol=rtol, atol=atol):
        if e.ndim == 0:
            return f"{name}: expected {e.item():.6g}, got {g.item():.6g}"
        worst = np.unravel_index(np.argmax(np.abs(g - e)), e.shape)
        return (f"{name}: values differ (largest difference at index {tuple(map(int, worst))}: "
                f"expected {e[worst]:.6g}, got {g[worst]:.6g})\n"
                f"  expected {_summary(e)}\n  got      {_summary(g)}")
    return None


def _number_or_array(x: Any) -> np.ndarray | None:
    """``x`` as a float array, or None when it is not numbers (None, a string, ...)."""
    if x is None or isinstance(x, (str, bytes)):  # (None would become nan)
        return None
    try:
        return _as_array(x)
    except (TypeError, ValueError):
        return None


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an array compared with a string, ...
        return False


def _short(x: Any, width: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= width else text[: width - 4] + " ..."


def sequence_difference(expected: Sequence, got: Any, indent: str = "  ") -> str:
    """Lines that show where two sequences compared with ``==`` part: the index and the two
    items of the first difference, then both sequences in full, e.g.::

          first difference at index 5: expected ('B', 0), got ('F', 5)
          expected [('F', 0), ...]
          got      [('F', 0), ...]

    Used by the check of labs/09_model_parallelism.ipynb (the 1F1B order of
    notebooks/09_model_parallelism.ipynb)."""
    try:
        items = list(got)
    except TypeError:
        return f"{indent}expected {expected}\n{indent}got      {got!r}"
    n = min(len(expected), len(items))
    i = next((k for k in range(n) if not _equal(expected[k], items[k])), n)
    if i < n:
        first = f"first difference at index {i}: expected {expected[i]!r}, got {items[i]!r}"
    elif len(items) < len(expected):
        first = (f"yours stops after {len(items)} items: index {i} is missing, "
                 f"expected {expected[i]!r}")
    elif len(items) > len(expected):
        first = (f"yours has {len(items) - len(expected)} item(s) too many: "
                 f"index {i}, {items[i]!r}, is not expected")
    else:
        first = "no difference"
    return f"{indent}{first}\n{indent}expected {expected}\n{indent}got      {got}"


def _changed_inputs(before: tuple, after: tuple) -> list[int]:
    """Positions of array/tensor arguments whose values differ between two argument tuples."""
    changed = []
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if (isinstance(b, np.ndarray) or _is_tensor(b)) and compare(b, a, rtol=0, atol=0):
            changed.append(i)
    return changed


def _same_rows(before: Any, after: Any) -> bool:
    """Whether ``after`` holds the rows of ``before`` in another order (a shuffle in place)."""
    try:
        b, a = _as_array(before), _as_array(after)
    except (TypeError, ValueError):
        return False
    if b.shape != a.shape or b.ndim == 0 or len(b) < 2:
        return False
    key = lambda x: x[np.lexsort(x.reshape(len(x), -1).T[::-1])]  # rows sorted
    return bool(np.array_equal(key(b), key(a)))


def not_implemented(name: str) -> bool:
    """Print the friendly 'not implemented yet' notice; return False."""
    print(f"… {name}: not implemented yet — fill in the cell above, then run this check again.")
    return False


def run_check(name: str, student_fn: Callable, reference_fn: Callable, cases: Sequence[Case],
              *, hint: str, output_names: Sequence[str] | None = None, rtol: float = 1e-6,
              atol: float = 1e-9, result_name: str = "result", arg_names: Sequence[str] = (),
              inputs_unchanged: bool = False,
              diagnose: Callable[..., str | None] | None = None) -> bool:
    """Compare ``student_fn(*case.args())`` with ``reference_fn(*case.args())`` on every case.

    Each side gets its own fresh arguments. ``output_names`` labels the parts of a tuple
    result (``result_name`` a single result); ``inputs_unchanged`` makes it an error to modify
    an array argument in place (``arg_names`` names them in the message);
    ``diagnose(expected, got)`` (or ``diagnose(expected, got, args)``, given fresh arguments of
    the failing case) may return a hint more specific than ``hint``. Prints the pass
    line and returns True; returns False if the student function raises NotImplementedError;
    raises CheckFailed otherwise.
    """
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    for number, case in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({case.label})"
        expected = reference_fn(*case.args())
        args = case.args()
        try:
            got = student_fn(*args)
        except NotImplementedError:
            return not_implemented(name)
        except CheckFailed as err:  # raised by a wrapper around the student's function
            raise CheckFailed(f"{where}\n  {err}\nHint: {hint}") from None
        except Exception as err:  # a crash in the student's code: report it as a failed check
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}"
                              f"\nHint: {hint}") from err
        if inputs_unchanged:
            before = case.args()
            for i in _changed_inputs(before, args):
                arg = arg_names[i] if i < len(arg_names) else f"argument {i}"
                if _same_rows(before[i], args[i]):
                    raise CheckFailed(f"{where}\n  your function reordered the rows of its input "
                                      f"'{arg}' in place (the same rows, in another order)."
                                      f"\nHint: the caller's {arg} must keep its order: reorder "
                                      f"a copy (indexing with an array of positions makes one), "
                                      f"not {arg} itself.")
                raise CheckFailed(f"{where}\n  your function modified its input '{arg}' in place."
                                  f"\nHint: make a new array ({arg} = {arg} - ...) instead of "
                                  f"changing the caller's ({arg} -= ...).")
        parts = list(output_names or [])
        if parts and isinstance(expected, tuple):
            if not isinstance(got, (tuple, list)) or len(got) != len(expected):
                raise CheckFailed(f"{where}\n  expected a tuple ({', '.join(parts)}), got "
                                  f"{type(got).__name__}\nHint: return {', '.join(parts)}")
            problem = "\n  ".join(filter(None, (compare(e, g, n, rtol, atol) for e, g, n
                                                 in zip(expected, got, parts, strict=True))))
        else:
            problem = compare(expected, got, result_name, rtol, atol)
        if problem:
            specific = None
            if diagnose is not None:
                with_args = len(inspect.signature(diagnose).parameters) >= 3
                specific = diagnose(expected, got, *([case.args()] if with_args else []))
            raise CheckFailed(f"{where}\n  {problem}\nHint: {specific or hint}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match the reference")
    return True


def pack_function(fn: Callable) -> bytes:
    """A student's function as bytes that engines can load (``cloudpickle.loads``): by value,
    with the globals it uses, unless it comes from course_lib or an installed package.
    (ipyparallel's own pickling drops a notebook function's globals such as ``np``.)"""
    import cloudpickle
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    file = getattr(module, "__file__", None) or ""
    by_value = (module is not None and module.__name__ != "__main__"
                and not module.__name__.startswith("course_lib")
                and not file.startswith((sys.prefix, sys.base_prefix)))
    if by_value:  # a module of the student's own: the engines may not be able to import it
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


# ---------------------------------------------------------------- how a notebook shows a failure
_LIBRARY = str(Path(__file__).resolve().parents[1])  # course_lib/
_NOT_OWN = ("course_lib", "IPython", "ipykernel", "traitlets")  # modules whose frames are hidden


def _show_briefly_in_ipython():
    """Register ``_show_check_failed`` as IPython's display of CheckFailed, once per shell;
    a custom exception handler that someone else set is left alone."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return
    theirs = [e for e in shell.custom_exceptions if getattr(e, "__name__", "") != "CheckFailed"]
    if not theirs and shell.custom_exceptions != (CheckFailed,):
        shell.set_custom_exc((CheckFailed,), _show_check_failed)


def _own_frames(tb, shell):
    """'where' lines for the frames of ``tb`` that run the student's code: notebook cells and
    files of their own, not the library, IPython or installed packages."""
    lines = []
    for frame, lineno in traceback.walk_tb(tb):
        file, name = frame.f_code.co_filename, frame.f_code.co_name
        cell = shell.compile.format_code_name(file) if hasattr(shell, "compile") else None
        if cell:
            where = f"{cell[0]} {cell[1]}, line {lineno}"
        elif (file.startswith(("<", _LIBRARY, sys.prefix, sys.base_prefix))
              or frame.f_globals.get("__name__", "").startswith(_NOT_OWN)):
            continue
        else:
            where = f"File {file}, line {lineno}"
        if name != "<module>":
            where += f", in {name}"
        lines += [f"  {where}", f"    {linecache.getline(file, lineno).strip()}"]
    return lines


_REMOTE_FRAME = re.compile(r"^File (\S+?):(\d+), in (\w+)", re.MULTILINE)


def _remote_own_frames(errors, shell):
    """'where' lines for the student's cells in the first failing rank's traceback (the
    ``errors`` of a ``cluster.RemoteError``: the ranks ran a function defined in a cell)."""
    if not isinstance(errors, dict) or not errors or not hasattr(shell, "compile"):
        return []
    rank = min(errors)
    lines = []
    for file, lineno, name in _REMOTE_FRAME.findall(str(errors[rank])):
        cell = shell.compile.format_code_name(file)
        if cell:
            lines += [f"  rank {rank}: {cell[0]} {cell[1]}, line {lineno}, in {name}",
                      f"    {linecache.getline(file, int(lineno)).strip()}"]
    return lines


def _show_check_failed(shell, etype, value, tb, tb_offset=None):
    """IPython's display of a CheckFailed: the message (what differs, then the hint), then the
    student's own lines that led to it, the check's frames left out."""
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # %debug still works
    sys.last_exc = value
    red, plain = ("", "") if shell.colors.lower() == "nocolor" else ("\x1b[31m", "\x1b[0m")
    lines = f"{red}{etype.__name__}{plain}: {value}".splitlines()
    where = _own_frames(tb, shell)
    cause = value.__cause__
    if cause is not None:  # the student's function raised: where, in their code
        where += _own_frames(cause.__traceback__, shell)
        where += _remote_own_frames(getattr(cause, "errors", None), shell)
    if where:
        lines += ["", "Your code (most recent call last):", *where]
    shell._showtraceback(etype, value, lines)
    return lines
