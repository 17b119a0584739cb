"""The course's labs as nbgrader assignments: a course directory, autograded tests, a report.

Each lab's single source, ``labs/solutions/NN_topic.ipynb``, becomes an nbgrader *source*
notebook (``assignment_source``): a code cell with ``### BEGIN SOLUTION`` markers (nbgrader's
own markers) is an autograded answer; a cell that calls a check, ``ok_x = checks.check_x(fn)``,
is an autograder test that asserts the check passed (the stub's notice scores 0, a
``CheckFailed`` scores 0 with its hint in the feedback) and runs hidden cases the released
notebook does not show: the same check with another seed, or the student's function against
the course's reference on cases of its own. The assert runs where nbgrader runs the notebook
(Validate, autograde): in the student's own Run All each check prints its verdict and the
notebook carries on to the next exercise, as in the course's labs. Written answers are
manually graded; every other cell is read-only. What a CPU autograder cannot judge (NCCL on
GPUs, two hosts) is listed per lab in ``NOT_GRADABLE_HERE`` and reported as such, never
failed::

    python -m course_lib class assignments --root course --exchange /srv/nbgrader/exchange
    cd course && nbgrader generate_assignment lab01 && nbgrader release_assignment lab01
    ... students fetch and submit; nbgrader collect / autograde / generate_feedback lab01
    python -m course_lib class report --root course    # course/grading_report.json

nbgrader itself is needed only to run the cycle and by ``grading_report`` (the gradebook).
"""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat

from course_lib.runtime.labs import BEGIN, PATTERN, RAISES_TAG, default_root

COURSE_ID = "distributed-deep-learning"
EXCHANGE_ENV = "COURSE_LIB_NBGRADER_EXCHANGE"  # where release/fetch/submit meet, unless given
DEFAULT_EXCHANGE = "/srv/nbgrader/exchange"    # nbgrader's own default
HIDDEN_SEED = 2718  # the seed of the hidden re-run of every check that takes one
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
CHECKS_IMPORT = re.compile(r"from course_lib\.checks import (\w+) as checks")
DEFINITION = re.compile(r"^(?:async\s+def|def|class)\s+(\w+)", re.MULTILINE)

# Checks without a seed: hidden cases computed against the course's reference in the cell
# itself, {check: (the line that names the reference _reference, [arguments, ...])}
# (Python source, run in the notebook after the lab's own cells).
HIDDEN_CASES = {
    "check_collision_probability": (
        "from course_lib.sparse_problem import collision_probability as _reference",
        ["3, 50", "50, 100_000", "7, 7"]),
    "check_zigzag": ("from course_lib.context_parallel import zigzag_positions as _reference",
                     ["32, 2", "48, 6", "12, 1"]),
    "check_zero_memory_per_rank": ("_reference = checks.zero_memory_reference",
                                   ["3e9, 8, 2, 12, 2", "1.3e9, 16, 3, 12, 2", "5e8, 2, 1, 8, 4"]),
    "check_dispatch": ("_reference = checks.reference_dispatch",
                       ["checks.dispatch_logits(48, 6, 77), 2, 1.25",
                        "checks.dispatch_logits(40, 4, 78), 1, None"]),
}

# Tier 2: what the lab's functions should also do where a CPU autograder cannot look.
NOT_GRADABLE_HERE = {
    "lab02": [("ring_pass across two hosts", "two hosts",
               "the ring pass between engines on two hosts, over TCP")],
    "lab05": [("ring_allreduce with NCCL", "CUDA GPUs and NCCL",
               "ring_allreduce on CUDA tensors over NCCL equals dist.all_reduce on every rank"),
              ("two-way ring on a real link", "two hosts",
               "the two-way ring beats the one-way ring on a full-duplex link between hosts")],
    "lab06": [("overlap on GPUs", "CUDA GPUs and NCCL",
               "OverlappedAverager hides the bucket allreduce behind backward on CUDA streams")],
    "lab09": [("f and g with NCCL", "CUDA GPUs and NCCL",
               "parallel_mlp's f and g on CUDA tensors over NCCL equal one GPU")],
    "lab10": [("ZeRO-1 memory on GPUs", "CUDA GPUs and NCCL",
               "zero1_step's measured CUDA memory per rank matches zero_memory_per_rank")],
    "lab12": [("rendezvous under real launchers", "two hosts (SLURM, torchrun)",
               "the rank and rendezvous function inside a 2-node SLURM job and torchrun"),
              ("the PyTorchJob on a cluster", "Kubernetes with GPU nodes",
               "the manifest is accepted, its pods start and meet at the master")],
    "lab15": [("all_to_all with NCCL", "CUDA GPUs and NCCL",
               "my_all_to_all on CUDA tensors equals dist.all_to_all_single over NCCL")],
    "lab16": [("mesh groups on two nodes", "two hosts with GPUs",
               "my_groups keeps tp inside a node when the ranks span two nodes")],
}


def _nbgrader(cell, grade_id: str, *, solution=False, grade=False, locked=False, points=None):
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
            "solution": solution}
    if points is not None:
        meta["points"] = points
    cell.metadata["nbgrader"] = meta


def _check_call(source: str) -> tuple[str | None, ast.Call] | None:
    """``(assigned name or None, call)`` when the cell is one statement calling
    ``checks.check_*``; None otherwise (demonstrations in try/except are not tests)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], (ast.Assign, ast.Expr)):
        return None
    call = body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "checks"
            and call.func.attr.startswith("check_")):
        return None
    if isinstance(body[0], ast.Expr):
        return None, call
    target = body[0].targets[0]
    first = target.elts[0] if isinstance(target, ast.Tuple) else target  # (ok, timelines) = ...
    return (first.id, call) if isinstance(first, ast.Name) else None


def check_parameters(module: str) -> dict[str, list[str]]:
    """The parameters of every ``check_*`` of ``course_lib/checks/<module>.py``, read from its
    source (nothing imported)."""
    path = Path(__file__).resolve().parent.parent / "checks" / f"{module}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name: [a.arg for a in node.args.args + node.args.kwonlyargs]
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")}


def _test_source(source: str, name: str | None, call: ast.Call,
                 parameters: list[str]) -> str:
    """The test cell: the lab's own line (its names stay defined for the cells below), an
    assert on the check's result where nbgrader runs the notebook (Validate, autograde; in a
    student's Run All the check prints its verdict and the notebook carries on, as in the
    course's labs), then the hidden cases, which assert it again."""
    check = call.func.attr
    target = name or "_ok"  # a bare call gets a name, to assert on
    failed = f"assert {target}, \"{check} did not pass: see its message above\""
    lines = [source.strip() if name else f"{target} = {source.strip()}",
             "import os  # nbgrader's Validate and autograder set NBGRADER_EXECUTION",
             "if os.environ.get(\"NBGRADER_EXECUTION\"):",
             f"    {failed}"]
    hidden = [failed]  # whatever the notebook did to os.environ
    if "seed" in parameters:
        again = copy.deepcopy(call)
        again.keywords = [k for k in again.keywords if k.arg != "seed"]
        again.keywords.append(ast.keyword("seed", ast.Constant(HIDDEN_SEED)))
        hidden.append(f"assert {ast.unparse(again)}, \"{check}: a hidden case failed\"")
    elif check in HIDDEN_CASES and call.args:
        reference, cases = HIDDEN_CASES[check]
        student = ast.unparse(call.args[0])
        hidden += ["from course_lib.checks import compare", reference,
                   f"for _args in [{', '.join(f'({c})' for c in cases)}]:",
                   f"    _problem = compare(_reference(*_args), {student}(*_args))",
                   f"    assert _problem is None, f\"{check}: a hidden case failed: {{_problem}}\""]
    return "\n".join([*lines, BEGIN_HIDDEN, *hidden, END_HIDDEN])


def assignment_source(solution_path: str | Path, points: float = 1,
                      written_points: float = 0) -> nbformat.NotebookNode:
    """The nbgrader source notebook of ``labs/solutions/NN_topic.ipynb``: solution cells
    autograded answers, check cells autograder tests of ``points`` (asserting the check passed,
    hidden cases added), written answers manually graded (``written_points``), the rest
    read-only."""
    solution_path = Path(solution_path)
    nb = nbformat.read(solution_path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    module = CHECKS_IMPORT.search(text)
    parameters = check_parameters(module.group(1)) if module else {}
    used: set[str] = set()

    def unique(grade_id: str) -> str:
        k, out = 1, grade_id
        while out in used:
            k += 1
            out = f"{grade_id}-{k}"
        used.add(out)
        return out

    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        has_solution = BEGIN in cell.source
        test = _check_call(cell.source) if cell.cell_type == "code" else None
        if has_solution and test:
            raise ValueError(f"{solution_path.name}, cell {index}: a solution and a check in "
                             f"one cell; put the check in the cell below")
        if has_solution and cell.cell_type == "code":
            definition = DEFINITION.search(cell.source)
            _nbgrader(cell, unique(definition.group(1) if definition else f"answer-{index}"),
                      solution=True)
            tags = cell.metadata.setdefault("tags", [])
            if RAISES_TAG not in tags:  # the stub raises: Run All goes on, as in the labs
                tags.append(RAISES_TAG)
        elif has_solution:
            _nbgrader(cell, unique(f"written-{index}"), solution=True, grade=True,
                      points=written_points)
        elif test:
            name, call = test
            cell.source = _test_source(cell.source, name, call,
                                       parameters.get(call.func.attr, []))
            _nbgrader(cell, unique(f"test-{call.func.attr}"), grade=True, locked=True,
                      points=points)
        else:
            _nbgrader(cell, unique(f"cell-{cell.get('id', index)}"), locked=True)
    nb.metadata["course_lib"] = {"generated_from": f"labs/solutions/{solution_path.name}"}
    return nb


def assignment_name(solution_path: str | Path) -> str:
    """``labNN`` for ``labs/solutions/NN_topic.ipynb``.
   """
    return f"lab{Path(solution_path).name[:2]}"


def exchange_root(exchange: str | Path | None = None) -> str:
    """The exchange directory: ``exchange``, else $COURSE_LIB_NBGRADER_EXCHANGE, else
    nbgrader's default."""
    return str(exchange or os.environ.get(EXCHANGE_ENV) or DEFAULT_EXCHANGE)


def write_course(root: str | Path, labs: list[str] | None = None,
                 exchange: str | Path | None = None, course_id: str = COURSE_ID,
                 repo: str | Path | None = None) -> list[Path]:
    """Write an nbgrader course directory at ``root``: ``nbgrader_config.py`` (course id,
    exchange, an execution timeout) and ``source/labNN/NN_topic.ipynb`` for each lab
    (``labs``: numbers like ``"01"``; None: all). Returns the notebooks written.
   """
    root = Path(root)
    solutions = sorted((default_root(repo) / "labs" / "solutions").glob(PATTERN))
    if labs is not None:
        wanted = {f"{int(n):02d}" for n in labs}
        unknown = wanted - {p.name[:2] for p in solutions}
        if unknown:
            raise ValueError(f"no lab numbered {', '.join(sorted(unknown))}")
        solutions = [p for p in solutions if p.name[:2] in wanted]
    (root / "source").mkdir(parents=True, exist_ok=True)
    (root / "nbgrader_config.py").write_text(
        "# written by python -m course_lib class assignments\n"
        "c = get_config()  # noqa: F821 - nbgrader provides it\n"
        f"c.CourseDirectory.course_id = {course_id!r}\n"
        f"c.Exchange.root = {exchange_root(exchange)!r}\n"
        "c.Execute.timeout = 300  # seconds per cell, as CI runs the labs\n"
        "c.ClearSolutions.text_stub = '*Your answer here.*'\n"
        "# each cell's reply read in short polls (a long one can wait out the whole timeout)\n"
        "from course_lib.runtime.kernel_replies import poll_in_slices  # noqa: E402\n"
        "poll_in_slices()\n", encoding="utf-8")
    written = []
    for solution in solutions:
        out = root / "source" / assignment_name(solution) / solution.name
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(assignment_source(solution), out)
        written.append(out)
    return written


def run_nbgrader(args: list[str], cwd: str | Path, timeout: float = 120,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``nbgrader <args>`` in ``cwd`` within ``timeout`` seconds; raise RuntimeError naming
    the step when it fails or does not finish."""
    command = [sys.executable, "-m", "nbgrader", *args]
    env = dict(os.environ if env is None else env)
    # nbgrader runs the `alembic` command when it creates a gradebook: this Python's scripts
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent),
                                                env.get("PATH")]))
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"nbgrader {args[0]} did not finish within {timeout} s "
                           f"(in {cwd})\n{err.output or ''}{err.stderr or ''}") from None
    if done.returncode != 0:
        raise RuntimeError(f"nbgrader {args[0]} failed (exit {done.returncode}, in {cwd})\n"
                           f"{done.stdout}{done.stderr}")
    return done


def grading_report(path: str | Path, out: str | Path | None = None,
                   not_gradable: dict | None = None) -> dict:
    """Both tiers per student from a course directory or its ``gradebook.db``: tier 1 the
    autograded score of each test cell and the total (written answers waiting for a grader
    listed apart), tier 2 each criterion "not gradable here: <reason>". Writes the JSON to
    ``out`` (default ``grading_report.json`` beside the gradebook) and returns it.
    ``not_gradable``: the tier-2 criteria per assignment (default ``NOT_GRADABLE_HERE``).
   """
    from nbgrader.api import Gradebook  # optional: only the grading machine needs nbgrader

    criteria = NOT_GRADABLE_HERE if not_gradable is None else not_gradable

    path = Path(path)
    db = path / "gradebook.db" if path.is_dir() else path
    if not db.is_file():
        raise FileNotFoundError(f"no gradebook at {db}: run nbgrader autograde first")
    report: dict = {"gradebook": str(db), "students": {}}
    with Gradebook(f"sqlite:///{db}") as gradebook:
        assignments = [a.name for a in gradebook.assignments]
        for student in gradebook.students:
            labs = report["students"].setdefault(student.id, {})
            for assignment in assignments:
                try:
                    submission = gradebook.find_submission(assignment, student.id)
                except Exception:  # noqa: BLE001 - nbgrader's MissingEntry: not submitted
                    labs[assignment] = {"submitted": False}
                    continue
                tests, written = {}, {}
                for notebook in submission.notebooks:
                    for grade in notebook.grades:
                        if grade.cell_type == "markdown":
                            written[grade.name] = ("needs manual grade" if grade.needs_manual_grade
                                                   else grade.score)
                        else:
                            tests[grade.name] = {"score": grade.score,
                                                 "max_score": grade.max_score}
                labs[assignment] = {
                    "submitted": True,
                    "tier1": {"tests": tests,
                              "score": sum(t["score"] for t in tests.values()),
                              "max_score": sum(t["max_score"] for t in tests.values()),
                              "written": written},
                    "tier2": [{"criterion": name, "what": what,
                               "status": f"not gradable here: needs {needs}"}
                              for name, needs, what in criteria.get(assignment, [])],
                }
    out = Path(out) if out else db.parent / "grading_report.json"
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    report["path"] = str(out)
    return report
