"""Tests for course_lib.classroom.grading: every lab as a valid nbgrader assignment (solutions,
tests and hidden tests where they belong, none of them released), then the whole nbgrader cycle
on lab 01 with its own command line: three students, one exchange, feedback and the two-tier
report."""

import ast
import json
import os
import time
from pathlib import Path

import nbformat
import pytest

from course_lib.__main__ import main
from course_lib.classroom import grading
from course_lib.runtime import labs

nbgrader = pytest.importorskip("nbgrader", reason="nbgrader is not installed")
from nbgrader.api import Gradebook  # noqa: E402 - only once nbgrader is known to be there
from nbgrader.nbgraderformat import MetadataValidator  # noqa: E402
from nbgrader.preprocessors import (  # noqa: E402
    CheckCellMetadata,
    ClearHiddenTests,
    ClearOutput,
    ClearSolutions,
    ComputeChecksums,
    LockCells,
)

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "labs" / "solutions").glob(labs.PATTERN))
STEP_TIMEOUT = 600  # a hang guard for one nbgrader command: a stuck step fails with its name


def nbgrader_meta(cell):
    return cell.metadata.get("nbgrader", {})


def release(source):
    """What nbgrader generate_assignment releases, minus what needs the gradebook."""
    nb, resources = nbformat.from_dict(source), {}
    for step in (CheckCellMetadata(), LockCells(), ClearSolutions(), ClearOutput(),
                 ClearHiddenTests(), ComputeChecksums(), CheckCellMetadata()):
        nb, resources = step.preprocess(nb, resources)
    return nb


def check_cells(solution):
    """Indices of the solution notebook's cells that are one call of checks.check_*."""
    nb = nbformat.read(solution, as_version=4)
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or cell.source.lstrip().startswith("%"):
            continue  # (a magic is no check)
        body = ast.parse(cell.source).body
        if len(body) == 1 and "checks.check_" in ast.unparse(getattr(body[0], "value", body[0])) \
                and isinstance(body[0], (ast.Assign, ast.Expr)):
            out.append(i)
    return nb, out


def solution_lines(nb):
    """Distinctive lines inside the solution blocks of a notebook (not elsewhere in it)."""
    inside, outside = set(), set()
    for cell in nb.cells:
        in_block = False
        for line in cell.source.splitlines():
            if labs.BEGIN in line:
                in_block = True
            elif labs.END in line:
                in_block = False
            else:
                (inside if in_block else outside).add(line.strip())
    return {line for line in inside - outside if len(line) > 25}


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_lab_is_a_valid_assignment(solution):
    source = grading.assignment_source(solution)
    MetadataValidator().validate_nb(source)
    nb, checks = check_cells(solution)
    assert checks, f"{solution.name} has no check cell"
    for i, cell in enumerate(source.cells):
        meta = nbgrader_meta(cell)
        assert meta, f"cell {i} has no nbgrader metadata"
        if i in checks:  # an autograder test that asserts the lab's own check
            assert meta["grade"] and meta["locked"] and meta["points"] > 0, (i, meta)
            assert cell.source.startswith(nb.cells[i].source.strip()), "the lab's line is kept"
            assert "\nassert " in cell.source
        elif labs.BEGIN in cell.source:
            assert meta["solution"], (i, meta)
            assert meta["grade"] == (cell.cell_type == "markdown")  # written: graded by hand
            if cell.cell_type == "code":  # its stub raises: Run All goes on, as in the labs
                assert labs.RAISES_TAG in cell.metadata.tags
        else:
            assert meta["locked"] and not meta["grade"] and not meta["solution"], (i, meta)

    released = release(source)
    text = nbformat.writes(released)
    for marker in (labs.BEGIN, labs.END, grading.BEGIN_HIDDEN, grading.END_HIDDEN):
        assert marker not in text
    student = labs.render(solution)  # the course's own student version: no solution in it
    leaked = [line for line in solution_lines(nb) if line in text and line not in student]
    assert not leaked, f"solution lines in the released notebook: {leaked[:3]}"
    assert [c.source for c in released.cells if c.cell_type == "code"
            and "raise NotImplementedError()" in c.source], "the stubs are nbgrader's"
    tests = [c for c in released.cells if nbgrader_meta(c).get("grade")
             and c.cell_type == "code"]
    assert len(tests) == len(checks)
    for test in tests:  # asserts only where nbgrader runs it (Validate): Run All carries on
        assert '\nif os.environ.get("NBGRADER_EXECUTION"):\n    assert ' in test.source
        assert "\nassert " not in test.source


def test_checks_with_a_seed_get_hidden_cases_with_another():
    source = grading.assignment_source(ROOT / "labs/solutions/01_gradient_descent.ipynb")
    tests = [c.source for c in source.cells if nbgrader_meta(c).get("grade")
             and c.cell_type == "code"]
    assert len(tests) == 2
    for test in tests:
        hidden = test.split(grading.BEGIN_HIDDEN)[1].split(grading.END_HIDDEN)[0]
        assert f"seed={grading.HIDDEN_SEED}" in hidden and "assert " in hidden
    for solution in SOLUTIONS:  # every check that takes a seed, and the table's, get cases
        source = grading.assignment_source(solution)
        module = grading.CHECKS_IMPORT.search(
            "\n".join(c.source for c in source.cells)).group(1)
        seeded = {name for name, args in grading.check_parameters(module).items()
                  if "seed" in args} | set(grading.HIDDEN_CASES)
        for cell in source.cells:
            if nbgrader_meta(cell).get("grade") and cell.cell_type == "code":
                check = cell.source.split("checks.", 1)[1].split("(")[0]
                hidden = cell.source.split(grading.BEGIN_HIDDEN)[1]
                assert hidden.startswith("\nassert ok")  # the autograder's own assert, always
                assert ("_reference" in hidden or f"seed={grading.HIDDEN_SEED}" in hidden) == (
                    check in seeded), check


def test_run_all_of_a_released_lab_goes_past_an_unsolved_exercise(tmp_path):
    """A student's Run All of the released lab 01, run as JupyterLab runs it (it stops at the
    first error but in cells tagged raises-exception): exercise 1 as released, exercise 2
    solved. Exercise 1's check says what is missing, and exercise 2's still runs and passes."""
    from nbclient import NotebookClient  # nbgrader's own dependency

    source = grading.assignment_source(ROOT / "labs/solutions/01_gradient_descent.ipynb")
    released = answer(release(source), source, only=["step_decay"])
    NotebookClient(released, timeout=STEP_TIMEOUT, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = {nbgrader_meta(c).get("grade_id"): "".join(o.get("text", "") for o in c.outputs)
               for c in released.cells if c.cell_type == "code"}
    assert "check_minibatch_epoch: not implemented yet" in printed["test-check_minibatch_epoch"]
    assert "✓ check_step_decay" in printed["test-check_step_decay"]


def test_write_course_makes_a_course_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(grading.EXCHANGE_ENV, str(tmp_path / "from-env"))
    written = grading.write_course(tmp_path / "course", labs=["1", "14"])
    assert [p.relative_to(tmp_path / "course").as_posix() for p in written] == [
        "source/lab01/01_gradient_descent.ipynb",
        "source/lab14/14_transformers_and_long_sequences.ipynb"]
    config = (tmp_path / "course" / "nbgrader_config.py").read_text()
    assert f"course_id = {grading.COURSE_ID!r}" in config
    assert repr(str(tmp_path / "from-env")) in config
    grading.write_course(tmp_path / "other", labs=["01"], exchange=tmp_path / "given")
    assert repr(str(tmp_path / "given")) in (tmp_path / "other" / "nbgrader_config.py").read_text()
    with pytest.raises(ValueError, match="no lab numbered 99"):
        grading.write_course(tmp_path / "none", labs=["99"])


def test_a_stuck_nbgrader_step_fails_with_its_name(tmp_path):
    with pytest.raises(RuntimeError, match="generate_assignment did not finish within"):
        grading.run_nbgrader(["generate_assignment", "lab01"], cwd=tmp_path, timeout=0.01)
    with pytest.raises(RuntimeError, match="nbgrader autograde failed"):
        grading.run_nbgrader(["autograde", "no-such-lab"], cwd=tmp_path)


# ------------------------------------------------------------------ the cycle, with nbgrader's CLI
def student_env(home):
    """A student of their own: HOME and Jupyter's directories (nbgrader's cache among them)."""
    env = dict(os.environ, HOME=str(home), JUPYTER_CONFIG_DIR=str(home / ".jupyter"),
               JUPYTER_DATA_DIR=str(home / ".local/share/jupyter"))
    home.mkdir(parents=True)
    return env


def answer(released, source, mistake=None, only=None):
    """The released notebook with every answer cell taken from the source (the solutions), or
    those whose grade id ``only`` lists; ``mistake``: (old, new) text replaced in them."""
    answers = {nbgrader_meta(c)["grade_id"]: c.source for c in source.cells
               if nbgrader_meta(c).get("solution")
               and (only is None or nbgrader_meta(c)["grade_id"] in only)}
    for cell in released.cells:
        grade_id = nbgrader_meta(cell).get("grade_id")
        if grade_id in answers:
            cell.source = answers[grade_id]
            if mistake:
                cell.source = cell.source.replace(*mistake)
    return released


def test_the_command_line_writes_and_generates_assignments(tmp_path, capsys):
    course = tmp_path / "course"
    assert main(["class", "assignments", "--root", str(course), "--labs", "01",
                 "--exchange", str(tmp_path / "exchange"), "--generate"]) == 0
    assert (course / "release" / "lab01" / "01_gradient_descent.ipynb").is_file()
    assert f"exchange: {tmp_path / 'exchange'}" in capsys.readouterr().out


def test_the_whole_nbgrader_cycle_on_lab_01(tmp_path, capsys):
    course, exchange = tmp_path / "course", tmp_path / "exchange"
    exchange.mkdir()
    grading.write_course(course, labs=["01"], exchange=exchange)
    notebook = "01_gradient_descent.ipynb"
    timings = {}

    def step(name, args, cwd=course, env=None):
        start = time.perf_counter()
        grading.run_nbgrader(args, cwd=cwd, env=env, timeout=STEP_TIMEOUT)
        timings[name] = timings.get(name, 0) + time.perf_counter() - start

    step("generate_assignment", ["generate_assignment", "lab01"])
    step("release_assignment", ["release_assignment", "lab01"])
    source = nbformat.read(course / "source" / "lab01" / notebook, as_version=4)
    students = {"alice": None,                                        # every answer right
                "bob": ["step_decay"],                     # exercise 1 left unsolved
                "carol": ("perm = rng.permutation(len(X))", "perm = np.arange(len(X))")}
    for student, work in students.items():
        home = tmp_path / student
        env = student_env(home)
        who = [f"--CourseDirectory.course_id={grading.COURSE_ID}",
               f"--Exchange.root={exchange}", f"--CourseDirectory.student_id={student}"]
        step("fetch_assignment", ["fetch_assignment", "lab01", *who], cwd=home, env=env)
        path = home / "lab01" / notebook
        released = nbformat.read(path, as_version=4)
        only, mistake = (work, None) if isinstance(work, list) else (None, work)
        nbformat.write(answer(released, source, mistake, only), path)
        step("submit", ["submit", "lab01", *who], cwd=home, env=env)
    step("collect", ["collect", "lab01"])
    step("autograde", ["autograde", "lab01"])
    step("generate_feedback", ["generate_feedback", "lab01"])
    with capsys.disabled():  # shown with pytest -s
        print("\nnbgrader cycle, seconds per step (3 students):",
              ", ".join(f"{k} {v:.1f}" for k, v in timings.items()),
              f"; total {sum(timings.values()):.1f}")

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        assert sorted(s.id for s in gradebook.students) == sorted(students)
        scores = {s: gradebook.find_submission("lab01", s) for s in students}
        assert scores["alice"].max_score == 2  # two tests; the written answer counts 0
        assert {s: (sub.code_score, sub.max_code_score) for s, sub in scores.items()} == {
            "alice": (2, 2), "bob": (1, 2), "carol": (1, 2)}

    feedback = {s: (course / "feedback" / s / "lab01" / notebook.replace(".ipynb", ".html"))
                .read_text(encoding="utf-8") for s in students}
    # what the student saw in the lab: the stub's notice, the check's hint
    assert "check_minibatch_epoch: not implemented yet" in feedback["bob"]
    assert "✓ check_step_decay" in feedback["bob"]  # checked past the unsolved exercise 1
    assert "your batches are the rows in their stored order" in feedback["carol"]
    assert "✓ check_step_decay" in feedback["carol"]
    assert "not implemented yet" not in feedback["alice"]
    # the cells after the checks still read ok_epoch and ok_schedule
    assert "least sq." in feedback["alice"]
    assert "Finish exercises 1 and 2" in feedback["bob"]

    report = grading.grading_report(course)
    assert json.loads(Path(report["path"]).read_text()) == {
        k: v for k, v in report.items() if k != "path"}
    tier1 = {s: report["students"][s]["lab01"]["tier1"] for s in students}
    assert {s: (t["score"], t["max_score"]) for s, t in tier1.items()} == {
        "alice": (2, 2), "bob": (1, 2), "carol": (1, 2)}
    assert tier1["bob"]["tests"] == {"test-check_minibatch_epoch": {"score": 0, "max_score": 1},
                                     "test-check_step_decay": {"score": 1, "max_score": 1}}
    assert tier1["carol"]["tests"] == {"test-check_minibatch_epoch": {"score": 0, "max_score": 1},
                                       "test-check_step_decay": {"score": 1, "max_score": 1}}
    assert tier1["alice"]["written"] == {"written-10": "needs manual grade"}
    assert report["students"]["alice"]["lab01"]["tier2"] == []  # lab 01 runs anywhere
    # a lab with criteria a CPU machine cannot judge: reported, never failed
    criteria = {"lab01": [("on NCCL", "CUDA GPUs and NCCL", "the same epoch on CUDA tensors")]}
    with_gpu = grading.grading_report(course, out=tmp_path / "r.json", not_gradable=criteria)
    lab = with_gpu["students"]["bob"]["lab01"]
    assert lab["tier2"] == [{"criterion": "on NCCL", "what": "the same epoch on CUDA tensors",
                             "status": "not gradable here: needs CUDA GPUs and NCCL"}]
    assert lab["tier1"]["score"] == 1 and with_gpu["students"]["alice"]["lab01"]["tier1"][
        "score"] == 2


    capsys.readouterr()
    assert main(["class", "report", "--root", str(course)]) == 0
    out = capsys.readouterr().out
    assert "bob lab01: 1/2 autograded" in out and "alice lab01: 2/2 autograded" in out


def test_tier_two_names_labs_that_exist():
    names = {grading.assignment_name(p) for p in SOLUTIONS}
    assert set(grading.NOT_GRADABLE_HERE) <= names
