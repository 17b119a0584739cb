"""Tests for course_lib.labs: solution markers become stubs, student notebooks are reproducible,
and the committed student notebooks in labs/ are up to date."""

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_lib import labs

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
    assert source == 'def f(x):\n    """Double x."""\n    raise NotImplementedError\n'
    namespace = {}
    exec(source, namespace)
    with pytest.raises(NotImplementedError):
        namespace["f"](1)


def test_top_level_marker_and_code_after_it_are_kept():
    cell = labs.make_student(solution_notebook()).cells[2]
    assert cell.source == "import math\nraise NotImplementedError\nprint(answer)"
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
    assert labs._default_root(None) == labs.Path(labs.__file__).resolve().parents[1]
    assert (labs._default_root(None) / "labs" / "solutions").is_dir()


def test_committed_student_notebooks_are_up_to_date():
    stale = labs.stale()
    assert stale == [], (f"stale student notebooks {[str(p) for p in stale]}: "
                         "run `python -m course_lib labs build` and commit the result")
