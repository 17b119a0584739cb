"""The course as a static website: `make site` writes build/site/ (open build/site/index.html).

    sphinx-build -c site . build/site        # from the repository root

The README is the landing page; every notebook with its outputs (executed once, then reused
from the jupyter-cache in build/jupyter_cache, which `make slides` shares); the student labs as
students get them (not executed: their exercises raise until solved); the library's reference
from its docstrings; the figures of images/. Nothing is fetched at build or reading time:
MathJax is served from slides/vendor (`python slides/vendor.py`). SITE_NOTEBOOKS (globs,
space-separated; `make site NOTEBOOKS=...` sets it) builds a subset. site/_static/course.css
keeps every page within the window (long output lines scroll in their box).
"""
import os
import shutil
from pathlib import Path

from jupyter_client.manager import KernelManager
from sphinx.util.matching import Matcher

from course_lib.runtime.kernel_replies import poll_in_slices

ROOT = Path(__file__).resolve().parents[1]
MATHJAX = ROOT / "slides" / "vendor" / "mathjax"

project = "Distributed deep learning, built from scratch and run for real"
root_doc = "README"
extensions = ["myst_nb", "sphinx.ext.autodoc"]
include_patterns = ["README.md", "CONTRIBUTING.md", "site/*.md",
                    *os.environ.get("SITE_NOTEBOOKS", "notebooks/*.ipynb labs/*.ipynb").split()]
exclude_patterns = [".venv", "build", "labs/solutions", "slides", "course_lib", "tests"]
suppress_warnings = ["myst.xref_missing"]  # README links to files the site has no page for

myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
nb_execution_mode = "cache"
nb_execution_cache_path = str(ROOT / "build" / "jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_excludepatterns = ["labs/*"]
# kernels get CurveZMQ keys, as with `make lab` and `make slides` (myst-nb has no option for it)
KernelManager.class_traits()["transport_encryption"].default_value = "auto"
# each cell's reply read in short polls: one long poll can miss it and wait out the timeout
poll_in_slices()

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}
autodoc_inherit_docstrings = False  # torch's own docstrings (forward, ...) are not the course's

html_theme = "sphinx_book_theme"
html_title = "Distributed deep learning"
html_theme_options = {"use_download_button": True, "show_toc_level": 2}
html_context = {"default_mode": "light"}
html_favicon = "favicon.svg"
# the course's additions to the theme: no page wider than the window (long output lines
# scroll inside their box)
html_static_path = ["_static"]
html_css_files = ["course.css"]
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"  # MathJax 2, as in the decks
myst_update_mathjax = False  # its settings are MathJax 3's
mathjax2_config = {"tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]],
                               "processEscapes": True},
                   "messageStyle": "none"}

# The sidebar: README's course map first, then the notebooks and the labs that are built (a
# subset may have none of one kind: a toctree whose glob matches nothing is a warning), then the
# reference
TOC_SECTIONS = [("Notebooks", "notebooks"), ("Labs", "labs")]
REFERENCE = ["site/api", "site/figures", "CONTRIBUTING"]


def toc(patterns, srcdir=ROOT):
    """The landing page's hidden toctrees, for the folders of TOC_SECTIONS that `patterns`
    (include_patterns' syntax) take a notebook from."""
    included = Matcher(patterns)
    blocks = [f"```{{toctree}}\n:hidden:\n:caption: {caption}\n:glob:\n{folder}/*\n```\n"
              for caption, folder in TOC_SECTIONS
              if any(included(p.relative_to(srcdir).as_posix())
                     for p in (Path(srcdir) / folder).glob("*.ipynb"))]
    reference = "\n".join(REFERENCE)
    blocks.append(f"```{{toctree}}\n:hidden:\n:caption: Reference\n{reference}\n```\n")
    return "\n\n" + "\n".join(blocks)


def api_modules() -> list[str]:
    """The modules of the API page: the lessons (the top level), then the packages a notebook
    calls like them (comm, runtime, k8s), each module by its dotted name below course_lib."""
    package = ROOT / "course_lib"
    names = [p.stem for p in sorted(package.glob("*.py")) if p.stem[0] != "_"]
    for sub in ("comm", "runtime", "k8s"):
        names += ["k8s"] if sub == "k8s" else []  # its __init__ holds the manifests' model
        names += [f"{sub}.{p.stem}" for p in sorted((package / sub).glob("*.py"))
                  if p.stem[0] != "_"]
    return names


def _generated(app, docname, source):
    """The sidebar's tables of contents on the landing page; the API reference and the figures
    page listed from the files, so that they never go stale."""
    if docname == root_doc:
        source[0] += toc(app.config.include_patterns, Path(app.srcdir))
    elif docname == "site/api":
        source[0] += "".join(f"\n## `course_lib.{m}`\n\n```{{eval-rst}}\n.. automodule:: "
                             f"course_lib.{m}\n```\n" for m in api_modules())  # docstrings are RST
    elif docname == "site/figures":
        source[0] += "".join(f"\n```{{figure}} ../images/{p.name}\n:alt: {p.stem}\n\n"
                             f"`images/{p.name}`\n```\n"
                             for p in sorted((ROOT / "images").glob("*.png")))


def _literal_blocks(app, what, name, obj, options, lines):
    """The docstrings are plain text for help(): an indented block after a paragraph (a table,
    an example) is shown as written, as if the paragraph ended with ``::``."""
    for i in range(len(lines) - 1, 1, -1):
        block = lines[i].startswith("    ") and not lines[i - 1].strip()
        before = next((line for line in reversed(lines[:i - 1]) if line.strip()), "")
        if block and before and not before.startswith((" ", "-", "*")) \
                and not before.rstrip().endswith("::"):
            lines[i - 1:i - 1] = ["", "::"]


def _finish(app, exception):
    """MathJax into _static, and index.html opening the landing page."""
    if exception is None and app.builder.format == "html":
        out = Path(app.outdir)
        shutil.copytree(MATHJAX, out / "_static" / "mathjax", dirs_exist_ok=True)
        (out / "index.html").write_text('<!DOCTYPE html><meta http-equiv="refresh" '
                                        'content="0; url=README.html">'
                                        '<link rel="icon" href="_static/favicon.svg">\n')


def setup(app):
    if not (MATHJAX / "MathJax.js").exists():
        raise RuntimeError(f"no MathJax in {MATHJAX}: run `python slides/vendor.py` first")
    app.connect("source-read", _generated)
    app.connect("autodoc-process-docstring", _literal_blocks)
    app.connect("build-finished", _finish)
