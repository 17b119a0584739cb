"""Tests for course_lib.runtime.labs: solution markers become stubs, student notebooks are
reproducible, and the committed student notebooks in labs/ are up to date."""

import ast
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_lib.runtime import labs

FUNCTION = '''\
def f(x):
    """Double x."""
    ### BEGIN SOLUTION
    y = 2 * x
    return y
    ### END SOLUTION
'''

TOP_LEVEL = '''\
import math
### BEGIN SOLUTION
answer = math.pi
### END SOLUTION
print(answer)'''

MARKDOWN = '''\
**Question.** Why shuffle?

### BEGIN SOLUTION
Because ordered data biases every batch.
### END SOLUTION
'''


def solution_notebook():
    nb = new_notebook(cells=[
        new_markdown_cell("# A lab"),
        new_code_cell(FUNCTION, execution_count=3,
                      outputs=[new_output("stream", name="stdout", text="hi\n")]),
        new_code_cell(TOP_LEVEL, metadata={"tags": ["keep"]}),
        new_markdown_cell(MARKDOWN),
        new_code_cell("f(2)", execution_count=4,
                      outputs=[new_output("execute_result", {"text/plain": "4"},
                                          execution_count=4)]),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    return nb


def test_marker_inside_function_becomes_the_body():
    student = labs.make_student(solution_notebook())
    source = student.cells[1].source
    assert source == ('def f(x):\n    """Double x."""\n'
                      '    raise NotImplementedError("fill in f")\n')
    namespace = {}
    exec(source, namespace)
    with pytest.raises(NotImplementedError, match="^fill in f$"):
        namespace["f"](1)


def test_top_level_marker_and_code_after_it_are_kept():
    cell = labs.make_student(solution_notebook()).cells[2]
    assert cell.source == ('import math\nraise NotImplementedError("fill in this cell")\n'
                           'print(answer)')
    assert cell.metadata["tags"] == ["keep", "raises-exception"]


def test_markdown_answer_is_hidden_and_not_tagged():
    cell = labs.make_student(solution_notebook()).cells[3]
    assert "Because" not in cell.source and "SOLUTION" not in cell.source
    assert "*Your answer here.*" in cell.source and "**Question.**" in cell.source
    assert "tags" not in cell.metadata


def test_tags_outputs_and_purity():
    nb = solution_notebook()
    before = nbformat.writes(nb)
    student = labs.make_student(nb)
    assert nbformat.writes(nb) == before, "make_student must not modify its input"
    tagged = [i for i, c in enumerate(student.cells) if "raises-exception" in
              c.metadata.get("tags", [])]
    assert tagged == [1, 2]
    for cell in student.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
        assert "SOLUTION" not in cell.source
    assert student.cells[4].source == "f(2)"
    nbformat.validate(student)
    assert labs.make_student(student).cells[1].metadata["tags"] == ["raises-exception"]


METHODS = '''\
class Averager:
    def __init__(self):
        self.n = 0

    def add(self, x):
        ### BEGIN SOLUTION
        self.n += 1
        ### END SOLUTION

def helper():
    ### BEGIN SOLUTION
    return 1
    ### END SOLUTION
'''


def test_a_stub_names_the_exercise_and_the_function_to_fill_in():
    """Calling an unfinished function says which exercise and which function to fill in."""
    nb = new_notebook(cells=[
        new_markdown_cell("# Lab 99 · demo\n\n## The tools\n\ntext"),
        new_code_cell(FUNCTION),                                       # before any exercise
        new_markdown_cell("## Exercise 2 · averaging\n\n### Details\n\nmore"),
        new_code_cell(METHODS),
        new_markdown_cell("## Use it · training"),
        new_code_cell(TOP_LEVEL),
        new_markdown_cell("## Stretch · both ways"),
        new_code_cell(FUNCTION),
    ])
    cells = labs.make_student(nb).cells
    assert 'raise NotImplementedError("fill in f")' in cells[1].source
    namespace = {}
    exec(cells[3].source, namespace)
    with pytest.raises(NotImplementedError, match=r"^exercise 2: fill in Averager\.add$"):
        namespace["Averager"]().add(1)
    with pytest.raises(NotImplementedError, match=r"^exercise 2: fill in helper$"):
        namespace["helper"]()
    assert 'raise NotImplementedError("fill in this cell")' in cells[5].source
    assert ('raise NotImplementedError("the stretch exercise: fill in f")'
            in cells[7].source)


def test_every_committed_stub_names_its_exercise_and_function():
    stubs = []
    for path in sorted((labs.default_root(None) / "labs").glob(labs.PATTERN)):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                stubs += [(path.name, line.strip()) for line in cell.source.splitlines()
                          if labs.CODE_STUB in line]
    assert stubs
    vague = [s for s in stubs if not re.fullmatch(
        r'raise NotImplementedError\("(exercise \d+|the stretch exercise): fill in '
        r'[A-Za-z_][\w.]*"\)', s[1])]
    assert vague == [], vague


def _clusters_started_and_stopped(source):
    """The names this cell binds to ``start_cluster(...)``, and ``(line, name)`` of every
    ``name.stop()`` it calls (IPython magics are skipped)."""
    code = "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())
    started, stops = set(), []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if getattr(func, "id", getattr(func, "attr", None)) == "start_cluster":
                started |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "stop" and isinstance(node.func.value, ast.Name)):
            stops.append((node.lineno, node.func.value.id))
    return started, stops


def test_the_stop_finder_finds_a_stop():
    assert _clusters_started_and_stopped(
        "%matplotlib inline\ncluster = start_cluster(n=2)\nprint(cluster)\ncluster.stop()\n"
    ) == ({"cluster"}, [(4, "cluster")])


@pytest.mark.parametrize("path", sorted(Path(labs.__file__).resolve().parents[1]
                                        .joinpath("labs", "solutions").glob(labs.PATTERN)),
                         ids=lambda p: p.name)
def test_no_cell_of_a_lab_stops_its_cluster(path):
    """After Run All a student goes back to an exercise and runs its check: the cluster the
    check needs must still be running, so no code cell (all of which Run All reaches) may stop
    it. The notebook says how to stop it; shutting the kernel down or restarting it does too."""
    started, stops = set(), []
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code":
            names, calls = _clusters_started_and_stopped(cell.source)
            started |= names
            stops += [(index, line, name) for line, name in calls]
    stopped = [(index, line) for index, line, name in stops if name in started]
    assert stopped == [], f"{path.name}: (cell, line) stopping the cluster: {stopped}"


@pytest.mark.parametrize("source, problem", [
    ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("x = 1\n### END SOLUTION\n", "without a"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n### END SOLUTION\n", "nested"),
])
def test_unbalanced_markers_name_notebook_and_cell(source, problem):
    nb = solution_notebook()
    nb.cells.append(new_markdown_cell(source) if "x" not in source else new_code_cell(source))
    with pytest.raises(ValueError, match=rf"07_demo\.ipynb, cell 5: .*{problem}"):
        labs.make_student(nb, name="07_demo.ipynb")


def make_repo(tmp_path):
    (tmp_path / "labs" / "solutions").mkdir(parents=True)
    nbformat.write(solution_notebook(), tmp_path / "labs" / "solutions" / "07_demo.ipynb")
    return tmp_path


def test_build_is_idempotent_and_stale_tracks_changes(tmp_path):
    root = make_repo(tmp_path)
    student = root / "labs" / "07_demo.ipynb"
    assert labs.stale(root) == [student]  # missing
    assert labs.build_all(root) == [student]
    first = student.read_bytes()
    assert labs.stale(root) == []
    assert labs.build_all(root) == [student]
    assert student.read_bytes() == first, "rebuilding must be byte-identical"
    built = nbformat.reads(first.decode(), as_version=4)
    assert built.metadata["course_lib"]["generated_from"] == "labs/solutions/07_demo.ipynb"
    assert all(c.get("outputs", []) == [] for c in built.cells)

    student.write_text(first.decode().replace("Double x.", "Triple x."), encoding="utf-8")
    assert labs.stale(root) == [student]  # edited by hand
    labs.build_all(root)
    assert labs.stale(root) == []

    orphan = root / "labs" / "08_gone.ipynb"
    orphan.write_bytes(first)
    assert labs.stale(root) == [orphan]  # its solution source was removed


def test_default_root_is_the_repository():
    assert labs.default_root(None) == Path(__file__).resolve().parents[1]  # this checkout
    assert (labs.default_root(None) / "labs" / "solutions").is_dir()


def test_committed_student_notebooks_are_up_to_date():
    stale = labs.stale()
    assert stale == [], (f"stale student notebooks {[str(p) for p in stale]}: "
                         "run `python -m course_lib labs build` and commit the result")
