"""The shape of the code a student reads: lessons at the top level, each importing only earlier
lessons (and comm, runtime, k8s, models); the scaffolding (bench/, figures/, checks/, testing/,
classroom/) above them; no circle, and no private name (``_name``) used outside the module that
defines it."""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "course_lib"
SCAFFOLDING = ("course_lib.bench", "course_lib.figures", "course_lib.checks", "course_lib.testing",
               "course_lib.classroom")
# above everything, as a command line is: the CLI and the headless tour run scaffolding on purpose
ENTRY_POINTS = {"course_lib.__main__", "course_lib.runtime.demo"}


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def is_lesson(name):
    return name not in ENTRY_POINTS and not name.startswith(SCAFFOLDING)


def notebook_code(path):
    """The code cells of a notebook, IPython magics and shell lines left out."""
    cells = json.loads(path.read_text())["cells"]
    lines = [line for c in cells if c["cell_type"] == "code" for line in
             "".join(c["source"]).splitlines() if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


def uses(source, here):
    """(imported modules, private names used from other modules) of one file's source."""
    imported, private, aliases = set(), [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith("course_lib")):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:  # from course_lib import ps
                    imported.add(full)
                    aliases[alias.asname or alias.name] = full
                else:
                    imported.add(node.module)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(full)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("course_lib"):
                    imported.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__") and aliases[node.value.id] != here):
            private.append(f"{aliases[node.value.id]}.{node.attr}")
    return imported, private


GRAPH = {name: uses(path.read_text(), name)[0] & set(MODULES) for name, path in MODULES.items()}


def test_no_lesson_imports_the_scaffolding():
    up = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() if is_lesson(a)
                for b in targets if b.startswith(SCAFFOLDING))
    assert not up, "lesson modules importing bench/figures/checks/testing:\n" + "\n".join(up)


def test_the_import_graph_has_no_circle():
    # Tarjan's strongly connected components: a component of two or more modules is a circle
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v] - {v}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other: {circles}"


# ---------------------------------------------------------------- lessons in course order
FOUNDATIONS = {"course_lib.models", "course_lib.data"}  # every notebook's models and data sets
LESSONS = {name: path for name, path in MODULES.items()
           if name.count(".") == 1 and path.name != "__init__.py" and is_lesson(name)
           and name != "course_lib.__main__" and name not in FOUNDATIONS}


def notebook_of(path):
    """The number of the notebook a module's docstring says introduces it (None: it names none)."""
    found = re.search(r"notebooks/(\d\d)_", ast.get_docstring(ast.parse(path.read_text())) or "")
    return int(found.group(1)) if found else None


NOTEBOOK_OF = {name: notebook_of(path) for name, path in LESSONS.items()}  # read once


def test_the_top_level_holds_lessons_each_naming_its_notebook():
    unnamed = sorted(name for name, number in NOTEBOOK_OF.items() if number is None)
    assert not unnamed, ("top-level modules whose docstring names no notebook "
                         f"(a lesson says 'Introduced in notebooks/NN_name.ipynb'): {unnamed}")


def test_a_lesson_imports_only_earlier_lessons():
    later = sorted(f"{a} (notebook {NOTEBOOK_OF[a]}) -> {b} (notebook {NOTEBOOK_OF[b]})"
                   for a in LESSONS for b in GRAPH[a] - {a}
                   if b in LESSONS and (NOTEBOOK_OF[b] or 0) > (NOTEBOOK_OF[a] or 0))
    assert not later, "lessons importing a later lesson:\n" + "\n".join(later)


def test_the_lessons_leave_the_plumbing_to_comm_and_the_runtime():
    """A lesson's lines are the idea: errors get their context from ``comm.during``, timelines
    record through ``timeline.DISABLED`` by default, options travel by name (a wrapped module's
    ``forward`` aside, which passes its inputs on as torch's DDP does)."""
    found = []
    for name, path in LESSONS.items():
        source = path.read_text()
        if "timeline is not None" in source:
            found.append(f"{name}: branches on 'timeline is not None'")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ExceptHandler) and node.type is not None and any(
                    isinstance(n, ast.Name) and n.id in ("CommError", "CommTimeout")
                    for n in ast.walk(node.type)):
                found.append(f"{name}:{node.lineno}: catches {ast.unparse(node.type)} (use "
                             f"comm.during to add context)")
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not node.name.startswith("_") and node.name != "forward"
                    and node.args.vararg and node.args.kwarg):
                found.append(f"{name}:{node.lineno}: {node.name}(*{node.args.vararg.arg}, "
                             f"**{node.args.kwarg.arg}) passes options on unnamed")
    assert not found, "\n".join(found)
    lines = len((PACKAGE / "ddp.py").read_text().splitlines())
    assert lines <= 400, f"ddp.py has {lines} lines: a lesson read in one sitting keeps to 400"


FILES = sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"),
                *(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "labs").rglob("*.ipynb")])


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_crosses_a_module(path):
    if ".ipynb_checkpoints" in path.parts:
        pytest.skip("a Jupyter autosave")
    source = notebook_code(path) if path.suffix == ".ipynb" else path.read_text()
    here = module_name(path) if path.is_relative_to(PACKAGE) else None
    _, private = uses(source, here)
    assert not private, f"{path.relative_to(ROOT)} uses private names of other modules: {private}"


def test_the_checker_sees_what_it_must():
    source = ("from course_lib import race\nfrom course_lib.bench.ps import _ints\n"
              "import course_lib.runtime.cluster as cl\n"
              "race._run(); cl._dead_ranks(); race.run()\n")
    imported, private = uses(source, None)
    assert imported == {"course_lib.race", "course_lib.bench.ps", "course_lib.runtime.cluster"}
    assert sorted(private) == ["course_lib.bench.ps._ints", "course_lib.race._run",
                               "course_lib.runtime.cluster._dead_ranks"]


# ---------------------------------------------------------------- time in tests
CLOCKS = {"monotonic", "perf_counter", "time", "process_time", "monotonic_ns", "perf_counter_ns"}
TIMED = __import__("re").compile(r"(^|_)(seconds|secs|elapsed|took|duration|wall|speedup)$"
                                 r"|_(s|ms|us)$|per_s$")
LOAD_PROOF = "holds under load:"  # the comment that vouches for a bound (course_lib.testing.timing)


def _is_clock(node):
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in CLOCKS and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "time")


def _measured(node, clocked):
    """Whether an expression holds a measured time: a clock read, a name set from one, or a
    name, attribute or key named as a duration or a rate (``seconds``, ``step_s``, ``per_s``)."""
    for n in ast.walk(node):
        if (_is_clock(n) or isinstance(n, ast.Name) and (n.id in clocked or TIMED.search(n.id))
                or isinstance(n, ast.Attribute) and TIMED.search(n.attr)
                or isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
                and isinstance(n.slice.value, str) and TIMED.search(n.slice.value)):
            return True
    return False


def fixed_timing_asserts(source):
    """Line numbers of ``assert`` statements that order a measured time against anything but 0
    (``elapsed < 10``, ``a["step_s"] > b["step_s"] + 0.1``) without a ``# holds under load:``
    comment: bounds a busy machine breaks. ``timing.assert_no_hang`` is the way to bound one."""
    tree, lines, found = ast.parse(source), source.splitlines(), set()
    for scope in ast.walk(tree):
        if not isinstance(scope, ast.FunctionDef | ast.Module):
            continue
        clocked = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign)
                   and any(_is_clock(c) for c in ast.walk(n.value))
                   for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(scope):
            if not isinstance(node, ast.Assert) or any(
                    LOAD_PROOF in line for line in lines[node.lineno - 2:node.end_lineno]):
                continue
            for compare in (c for c in ast.walk(node.test) if isinstance(c, ast.Compare)):
                sides = [compare.left, *compare.comparators]
                for a, op, b in zip(sides, compare.ops, sides[1:], strict=False):
                    zero = any(isinstance(x, ast.Constant) and x.value == 0 for x in (a, b))
                    if (isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) and not zero
                            and (_measured(a, clocked) or _measured(b, clocked))):
                        found.add(node.lineno)
    return sorted(found)


SUBPROCESS_GUARD = 300  # seconds: a Python that imports PyTorch took over 30 beside other work
RUNS = {"run", "check_output", "check_call", "call", "communicate"}


def _constants(tree):
    """The module's ``NAME = number`` assignments (``STEP_TIMEOUT = 120``)."""
    return {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant) and isinstance(n.value.value, int | float)
            for t in n.targets if isinstance(t, ast.Name)}


def _number(node, constants):
    """A literal number, or a module constant's, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    return constants.get(node.id) if isinstance(node, ast.Name) else None


def _const_timeout(call, constants=None):
    return next((n for k in call.keywords if k.arg == "timeout"
                 and (n := _number(k.value, constants or {})) is not None), None)


def short_subprocess_guards(source):
    """Line numbers of a subprocess a test waits for with a literal ``timeout=`` below
    ``SUBPROCESS_GUARD``: ``subprocess.run(..., timeout=30)``, ``proc.communicate(timeout=30)``,
    or a call of this file's own function that passes its ``timeout`` to one (its default
    too). Such a timeout is a hang guard: its process waits for a core like any other."""
    tree, found = ast.parse(source), set()
    constants, wrappers = _constants(tree), set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
            if isinstance(call.func, ast.Attribute) and call.func.attr in RUNS and any(
                    k.arg == "timeout" and isinstance(k.value, ast.Name) for k in call.keywords):
                wrappers.add(fn.name)
                defaults = dict(zip([a.arg for a in fn.args.args][::-1],
                                    fn.args.defaults[::-1], strict=False))
                defaults.update({a.arg: d for a, d in zip(fn.args.kwonlyargs,
                                                          fn.args.kw_defaults, strict=True)})
                d = defaults.get("timeout")
                d = _number(d, constants) if d is not None else None
                if d is not None and d < SUBPROCESS_GUARD:
                    found.add(fn.lineno)
    for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(
            call.func, "id", "")
        subprocess_call = isinstance(call.func, ast.Attribute) and (
            call.func.attr == "communicate" or isinstance(call.func.value, ast.Name)
            and call.func.value.id == "subprocess" and call.func.attr in RUNS)
        timeout = _const_timeout(call, constants)
        if (subprocess_call or name in wrappers) and timeout is not None \
                and timeout < SUBPROCESS_GUARD:
            found.add(call.lineno)
    lines = source.splitlines()
    return sorted(n for n in found if LOAD_PROOF not in " ".join(lines[n - 2:n]))


@pytest.mark.parametrize("path", sorted((ROOT / "tests").glob("test_*.py")), ids=lambda p: p.name)
def test_no_test_bounds_a_time_that_load_can_break(path):
    lines = path.read_text().splitlines()
    bad = [f"{path.name}:{n}: {lines[n - 1].strip()}"
           for n in fixed_timing_asserts("\n".join(lines))]
    bad += [f"{path.name}:{n}: {lines[n - 1].strip()} (a subprocess's hang guard: at least "
            f"{SUBPROCESS_GUARD} s)" for n in short_subprocess_guards("\n".join(lines))]
    assert not bad, ("a busy machine breaks these bounds: assert the promise with "
                     "course_lib.testing.timing.assert_no_hang, report the figure in a benchmark, "
                     "or say why it holds under any load (# holds under load: ...):\n"
                     + "\n".join(bad))


def test_the_timing_checker_sees_what_it_must():
    source = ("import time\n"
              "def test_x(r, run):\n"
              "    t = time.monotonic()\n"
              "    assert time.monotonic() - t < 10\n"              # 4: a clock read
              "    elapsed = time.monotonic() - t\n"
              "    assert elapsed < 5\n"                             # 6: set from a clock
              "    assert r['step_s'] > r['base_s'] + 0.1\n"         # 7: named as a duration
              "    assert 0 < run.fetch_s\n"                         # positive: fine
              "    assert r['steps_per_s'] <= 2 * r['model']  # holds under load: never early\n"
              "    assert r['loss'] < 0.5 and len(r) > 3\n")         # not a time
    assert fixed_timing_asserts(source) == [4, 6, 7]
    source = ("import subprocess\n"
              "def _cli(*args, timeout=30):\n"                       # 2: its default
              "    return subprocess.run(args, timeout=timeout)\n"
              "def test_y(proc, cluster):\n"
              "    subprocess.run(['x'], timeout=60)\n"              # 5
              "    _cli('--help', timeout=20)\n"                      # 6: through the wrapper
              "    proc.communicate(timeout=10)\n"                    # 7
              "    subprocess.run(['x'], timeout=600)\n"             # a hang guard: fine
              "    cluster.run(f, timeout=2)\n"                      # a deadline under test
              "STEP = 120\n"
              "def _step(args, timeout=STEP):\n"                    # 11: a constant's default
              "    return subprocess.run(args, timeout=timeout)\n"
              "def test_z():\n"
              "    subprocess.run(['x'], timeout=STEP)\n")           # 14: a constant
    assert short_subprocess_guards(source) == [2, 5, 6, 7, 11, 14]
