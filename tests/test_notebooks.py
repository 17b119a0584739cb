"""Notebook and lab wiring: outputs stripped, numbering paired, every notebook on the course map.

nbval itself executes every notebook and lab (``make test-notebooks``); these tests keep the files
in the shape that CI and the slides expect.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "labs" / "solutions").glob("*.ipynb"))
ALL = NOTEBOOKS + LABS + SOLUTIONS
NAME = re.compile(r"^\d\d_[a-z0-9_]+\.ipynb$")


def _keeps_output(cell):
    return "keep_output" in cell.get("metadata", {}).get("tags", []) or \
        cell.get("metadata", {}).get("keep_output", False)


def test_there_is_something_to_check():
    assert NOTEBOOKS and LABS and SOLUTIONS


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(ROOT)))
def test_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count")) and not _keeps_output(c)]
    assert dirty == [], (f"{path.name}: cells {dirty} store outputs; run `nbstripout {path}` "
                         "or tag the cell keep_output")


def test_stored_as_the_nbstripout_filter_writes_them():
    """`make setup` installs nbstripout as a git filter: a notebook not stored in the form the
    filter writes (cell ids, sources) would show as modified in `git status` on a fresh clone."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "nbstripout", "--dry-run", *map(str, ALL)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "", (
        f"{out.stdout}{out.stderr}\nrun: python -m nbstripout notebooks/*.ipynb labs/*.ipynb "
        "labs/solutions/*.ipynb")


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_numbered_and_opened_with_a_title(path):
    assert NAME.match(path.name), f"{path.name} should be NN_topic.ipynb"
    nb = json.loads(path.read_text())
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown" and "".join(first["source"]).startswith("# ")
    assert nb["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_control_character_in_a_cell(path):
    """A tab or carriage return in a cell is almost always LaTeX written into JSON without its
    backslash doubled: "\\text" stored as "\\t" + "ext" renders as a tab and "ext"."""
    nb = json.loads(path.read_text())
    bad = [(i, repr(ch)) for i, c in enumerate(nb["cells"]) for ch in "".join(c["source"])
           if ord(ch) < 32 and ch != "\n"]
    assert bad == [], f"{path.name}: control characters in cells (index, char): {bad[:5]}"


def test_labs_pair_with_notebooks_and_solutions():
    topics = {p.name[:2] for p in NOTEBOOKS}
    for lab in LABS:
        assert lab.name[:2] in topics, f"{lab.name} has no notebook with the same number"
    assert [p.name for p in LABS] == [p.name for p in SOLUTIONS]


def test_readme_maps_every_notebook_and_lab():
    readme = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS + LABS:
        assert str(path.relative_to(ROOT)) in readme, f"README's course map misses {path.name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_have_slides_and_a_summary(path):
    nb = json.loads(path.read_text())
    kinds = {c.get("metadata", {}).get("slideshow", {}).get("slide_type") for c in nb["cells"]}
    assert "slide" in kinds, f"{path.name}: no cell starts a slide (make slides)"
    last = "".join(nb["cells"][-1]["source"])
    assert "Summary" in last or "summary" in last, f"{path.name} should end with a summary"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_slides_convert(path):
    import nbformat
    from nbconvert import SlidesExporter
    html, _ = SlidesExporter().from_notebook_node(nbformat.read(path, as_version=4))
    assert "reveal" in html and html.count('<section') >= 5
