"""The shape of the code a student reads: lessons at the bottom of the import graph, the
scaffolding (bench/, figures/, checks/, testing/, classroom/) above them, no circle, and no
private name (``_name``) used outside the module that defines it."""

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "course_lib"
SCAFFOLDING = ("course_lib.bench", "course_lib.figures", "course_lib.checks", "course_lib.testing",
               "course_lib.classroom")
# above everything, as a command line is: the CLI and the headless tour run scaffolding on purpose
ENTRY_POINTS = {"course_lib.__main__", "course_lib.demo"}


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
              "import course_lib.cluster as cl\nrace._run(); cl._dead_ranks(); race.run()\n")
    imported, private = uses(source, None)
    assert imported == {"course_lib.race", "course_lib.bench.ps", "course_lib.cluster"}
    assert sorted(private) == ["course_lib.bench.ps._ints", "course_lib.cluster._dead_ranks",
                               "course_lib.race._run"]
