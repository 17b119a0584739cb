"""The README's promise: every public function's docstring names the notebook that introduces it.

Checked on the lessons, the top-level modules ``course_lib/*.py`` (not ``__init__``/``__main__``),
and on the packages a notebook calls like them: ``comm``, ``runtime`` and ``k8s`` (not the
scaffolding: checks, testing, bench, figures):
each public module-level function and class must name a notebook as
``notebooks/NN_name.ipynb``, and that notebook must exist. Pure ``ast``: nothing is imported.
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = re.compile(r"notebooks/\d\d_\w+\.ipynb")


def _public_definitions():
    top = [p for p in sorted((ROOT / "course_lib").glob("*.py"))
           if p.name not in ("__init__.py", "__main__.py")]
    packages = [p for sub in ("comm", "runtime", "k8s")
                for p in sorted((ROOT / "course_lib" / sub).glob("*.py"))]
    for path in top + packages:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and not node.name.startswith("_"):
                name = path.relative_to(ROOT / "course_lib")
                yield f"{name}:{node.name}", ast.get_docstring(node) or ""


def test_every_public_definition_names_an_existing_notebook():
    missing, unknown = [], []
    for name, doc in _public_definitions():
        named = NOTEBOOK.findall(doc)
        if not named:
            missing.append(name)
        unknown += [f"{name} -> {nb}" for nb in named if not (ROOT / nb).is_file()]
    assert not missing, (f"{len(missing)} public functions/classes name no notebook "
                         f"(notebooks/NN_name.ipynb) in their docstring: {', '.join(missing)}")
    assert not unknown, f"docstrings name notebooks that do not exist: {', '.join(unknown)}"
