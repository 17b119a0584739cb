"""Build the student lab notebooks from their solution sources, and spot stale ones.

Each lab has one source, ``labs/solutions/NN_topic.ipynb``, in which the worked answers sit
between nbgrader-style markers::

    def minibatch_epoch(problem, X, y, theta, lr, batch_size, rng):
        \"\"\"Docstring stays for the student.\"\"\"
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

The student version ``labs/NN_topic.ipynb`` replaces every marked block of a code cell with
a ``raise NotImplementedError(...)`` that names the exercise and the function to fill in (at the
indentation of the BEGIN marker, so a block inside a function body becomes the body)::

    raise NotImplementedError("exercise 2: fill in ring_allgather")

and tags the cell ``raises-exception`` so that nbval still runs the student notebook. The
exercise is the last markdown heading ``## Exercise N · ...`` (or ``## Stretch · ...``) above
the cell; the function is the ``def`` (inside its ``class``, if any) around the marker.
In a markdown cell a marked block becomes ``*Your answer here.*``; there the markers may sit
in HTML comments (``<!-- ### BEGIN SOLUTION -->``) so they stay invisible. A marker is any
line that contains the marker text.
Student notebooks are written without outputs and byte-for-byte reproducibly, so they can be
committed and compared::

    python -m course_lib labs build   # build_all(): regenerate labs/NN_*.ipynb
    python -m course_lib labs check   # stale(): list student notebooks that need a rebuild

``make_student(nb)`` is the pure transformation, used by both and by the tests. One file, a
little over a lesson's length: the transformation and the two commands built on it.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
CODE_STUB = "raise NotImplementedError"
MARKDOWN_STUB = "*Your answer here.*"
RAISES_TAG = "raises-exception"
PATTERN = "[0-9][0-9]_*.ipynb"
SECTION = re.compile(r"^##?\s+(.*)$", re.MULTILINE)  # headings of level 1 and 2
EXERCISE = re.compile(r"(?:Exercise\s+(\d+)|Stretch)\b")
DEFINITION = re.compile(r"^(\s*)(?:async\s+def|def|class)\s+(\w+)")


def code_stub(exercise: str | None = None, function: str | None = None) -> str:
    """The line that replaces a solution block in a code cell: a ``raise NotImplementedError``
    whose message names the exercise and the function to fill in, e.g.
    ``raise NotImplementedError("exercise 2: fill in ring_allgather")``.
    Introduced in notebooks/00_welcome_and_cluster.ipynb.
    """
    message = f"fill in {function}" if function else "fill in this cell"
    if exercise:
        message = f"{exercise}: {message}"
    return f"{CODE_STUB}({json.dumps(message)})"


def exercise_name(markdown: str, current: str | None = None) -> str | None:
    """The exercise that the cells after this markdown cell belong to: ``"exercise N"`` or
    ``"the stretch exercise"`` after a heading ``## Exercise N · ...`` or ``## Stretch · ...``,
    None after any other heading of level 1 or 2, ``current`` when the cell has none.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    for heading in SECTION.finditer(markdown):
        match = EXERCISE.match(heading.group(1))
        if match is None:
            current = None
        else:
            current = f"exercise {match.group(1)}" if match.group(1) else "the stretch exercise"
    return current


def default_root(root: str | Path | None) -> Path:
    """The repository root: ``root`` if given, else the folder that holds ``course_lib``.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    return Path(root) if root is not None else Path(__file__).resolve().parents[2]


def strip_solutions(source: str, stub: str | Callable[[str | None], str],
                    where: str = "cell") -> tuple[str, int]:
    """Replace each BEGIN/END block in ``source`` by ``stub`` at the BEGIN marker's indentation.

    ``stub`` is the text, or a function of the name of the ``def`` around the block (dotted
    with its class: ``"Averager.wait"``; None at the top level) that returns it.
    Returns ``(new_source, number_of_blocks)``. Raises ``ValueError`` (naming ``where``) on a
    nested BEGIN, an END without BEGIN, or a BEGIN that is never closed.
    Introduced in notebooks/00_welcome_and_cluster.ipynb.
    """
    out: list[str] = []
    begin_line = None
    blocks = 0
    enclosing: list[tuple[int, str]] = []  # (indentation, name) of the defs and classes open
    for lineno, line in enumerate(source.splitlines(keepends=True), start=1):
        if BEGIN in line:
            if begin_line is not None:
                raise ValueError(f"{where}: nested '{BEGIN}' on line {lineno} "
                                 f"(the block opened on line {begin_line} is not closed)")
            begin_line = lineno
            indent = line[: len(line) - len(line.lstrip())]
            newline = "\n" if line.endswith("\n") else ""
            if callable(stub):
                names = [name for depth, name in enclosing if depth < len(indent)]
                text = stub(".".join(names) or None)
            else:
                text = stub
            out.append(f"{indent}{text}{newline}")
        elif END in line:
            if begin_line is None:
                raise ValueError(f"{where}: '{END}' on line {lineno} without a '{BEGIN}'")
            begin_line = None
            blocks += 1
            if not line.endswith("\n") and out:  # END was the last line: no trailing newline
                out[-1] = out[-1].rstrip("\n")
        elif begin_line is None:
            out.append(line)
            code = line.lstrip()
            if code and not code.startswith(("#", ")", "]", "}")):  # a statement: it closes
                depth = len(line) - len(code)                       # the defs it is not inside
                enclosing = [(d, n) for d, n in enclosing if d < depth]
                definition = DEFINITION.match(line)
                if definition:
                    enclosing.append((depth, definition.group(2)))
    if begin_line is not None:
        raise ValueError(f"{where}: '{BEGIN}' on line {begin_line} is never closed by '{END}'")
    return "".join(out), blocks


def make_student(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """Return the student version of solution notebook ``nb`` (``nb`` itself is not changed).

    Solution blocks are replaced (see module docstring; a code stub names the exercise of the
    last exercise heading above it and its function), code cells that had one get the
    ``raises-exception`` tag, every output and execution count is dropped, and cells without an
    id get a deterministic one. ``name`` only appears in error messages.
    Introduced in notebooks/00_welcome_and_cluster.ipynb.
    """
    nb = copy.deepcopy(nb)
    exercise = None
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        source = cell.get("source", "")
        if isinstance(source, list):  # tolerate the on-disk list-of-lines form
            source = "".join(source)
        if cell.cell_type == "code":
            cell.source, blocks = strip_solutions(
                source, lambda function, exercise=exercise: code_stub(exercise, function), where)
            cell.outputs = []
            cell.execution_count = None
            if blocks:
                tags = cell.setdefault("metadata", {}).setdefault("tags", [])
                if RAISES_TAG not in tags:
                    tags.append(RAISES_TAG)
        else:
            exercise = exercise_name(source, exercise)
            cell.source, _ = strip_solutions(source, MARKDOWN_STUB, where)
        cell.get("metadata", {}).pop("execution", None)  # timing metadata from some frontends
        if "id" not in cell:
            cell["id"] = f"cell-{index}"
    if (nb.nbformat, nb.nbformat_minor) < (4, 5):
        nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


def _pairs(root: Path) -> list[tuple[Path, Path]]:
    """(solution, student) paths for every ``labs/solutions/NN_*.ipynb``."""
    labs = root / "labs"
    return [(src, labs / src.name) for src in sorted((labs / "solutions").glob(PATTERN))]


def render(solution: Path) -> str:
    """The exact text the student notebook built from ``solution`` must have.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    nb = nbformat.read(solution, as_version=4)
    student = make_student(nb, name=solution.name)
    student.metadata["course_lib"] = {
        "generated_from": f"labs/solutions/{solution.name}",
        "note": "Generated by `python -m course_lib labs build`; edit the solution source.",
    }
    nbformat.validate(student)
    text = nbformat.writes(student)  # json with sorted keys, indent=1: deterministic
    return text if text.endswith("\n") else text + "\n"


def build_all(root: str | Path | None = None) -> list[Path]:
    """Regenerate every student notebook under ``root/labs``; return their paths.

    A file is rewritten only when its content changes, so a rebuild leaves clean files alone.
    Introduced in notebooks/00_welcome_and_cluster.ipynb.
    """
    built = []
    for solution, student in _pairs(default_root(root)):
        text = render(solution)
        if not student.exists() or student.read_text(encoding="utf-8") != text:
            student.write_text(text, encoding="utf-8")
        built.append(student)
    return built


def stale(root: str | Path | None = None) -> list[Path]:
    """Student notebooks that are missing, out of date, or left without a solution source.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    root = default_root(root)
    pairs = _pairs(root)
    out = [student for solution, student in pairs
           if not student.exists() or student.read_text(encoding="utf-8") != render(solution)]
    expected = {student.name for _, student in pairs}
    out += [p for p in sorted((root / "labs").glob(PATTERN)) if p.name not in expected]
    return out
