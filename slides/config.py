"""nbconvert's configuration for `make slides`: a reveal.js deck per notebook that works offline.

The outputs come from the jupyter-cache that `make site` fills (build/jupyter_cache): a notebook
whose code is unchanged since it was executed is not executed again; one that is missing is
executed and cached, so the site then reuses it. reveal.js, require.js and MathJax are served
from slides/vendor/ (`python slides/vendor.py`); the look is in slides/template/.

    jupyter nbconvert --config slides/config.py --to slides --output-dir slides notebooks/*.ipynb

With `--CachedExecute.as_stored=True` a deck is made from the notebook as stored (no outputs),
with no cache and nothing executed: seconds for every notebook (tests/test_slides.py).
"""
import ast
import re
from pathlib import Path

from IPython.core.inputtransformer2 import TransformerManager
from nbconvert.preprocessors import ExecutePreprocessor
from traitlets import Bool, Unicode

HERE = Path(__file__).resolve().parent

# nbclient waits for each cell's reply in short polls: one long poll can miss the reply and wait
# out the cell's whole timeout (notebook 16's widget cell: 10 minutes)
from course_lib.runtime.kernel_replies import poll_in_slices  # noqa: E402

poll_in_slices()


class CachedExecute(ExecutePreprocessor):
    """The notebook's outputs from the cache, or executed (in its folder) and cached; with
    `--CachedExecute.as_stored=True`, the notebook as it is stored (a quick deck, for tests)."""

    record_timing = False  # as myst-nb executes: the cached notebook must hash like the source
    cache_path = Unicode(str(HERE.parent / "build" / "jupyter_cache")).tag(config=True)
    as_stored = Bool(False, help="Neither execute nor read the cache").tag(config=True)

    def preprocess(self, nb, resources=None, km=None):
        if self.as_stored:
            return _deck_links(nb), resources
        from jupyter_cache import get_cache  # the site extra (a deck as stored needs none)
        from jupyter_cache.base import CacheBundleIn
        cache = get_cache(self.cache_path)
        try:
            return _deck_links(cache.merge_match_into_notebook(nb)[1]), resources
        except KeyError:
            pass
        folder = Path((resources or {}).get("metadata", {}).get("path") or ".").resolve()
        name = (resources or {}).get("metadata", {}).get("name", "notebook")
        self.log.info("executing %s (not in the cache %s)", name, self.cache_path)
        nb, resources = super().preprocess(nb, resources, km)
        record = cache.add_nb_to_project(str(folder / f"{name}.ipynb"))
        cache.cache_notebook_bundle(CacheBundleIn(nb, record.uri), check_validity=False,
                                    overwrite=True)
        return _deck_links(nb), resources


def _deck_links(nb):
    """A link to another notebook of notebooks/ opens its deck."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = re.sub(r"\]\((\d\d_\w+)\.ipynb([#)])", r"](\1.slides.html\2", cell.source)
    return nb


def _strings(source, keyword):
    """The strings given as `keyword=` or to set_`keyword`( / sup`keyword`( in `source`; an
    f-string's fields become an ellipsis."""
    pattern = rf"""(?:\b{keyword}\s*=|set_{keyword}\(|sup{keyword}\()\s*[fF]?(["'])([^"'\n]+)\1"""
    found = (re.sub(r"\{[^}]*\}", "…", text).strip() for _, text in re.findall(pattern, source))
    return list(dict.fromkeys(text for text in found if text.strip("… ")))


def figure_alt(output, cell, longest=160):
    """The alt text of an image output: an `alt` in the output's metadata (its image's or its
    own) or in the cell's; else the titles the cell gives, or its axes' labels; else the
    statement that made the figure (the cell's last one that calls a plotting function)."""
    meta = output.get("metadata") or {}
    for place in (*(v for v in meta.values() if isinstance(v, dict)), meta,
                  cell.get("metadata") or {}):
        if isinstance(place.get("alt"), str) and place["alt"].strip():
            return place["alt"].strip()
    source = cell.get("source", "")
    if titles := _strings(source, "title"):
        return "Figure: " + "; ".join(titles)
    ylabels, xlabels = _strings(source, "ylabel"), _strings(source, "xlabel")
    if ylabels:
        return "Figure: " + "; ".join(ylabels) + (" against " + xlabels[0] if xlabels else "")
    code = TransformerManager().transform_cell(source)  # %magics to plain Python
    try:
        tree = ast.parse(code)
        statements = [" ".join(ast.get_source_segment(code, s).split()) for s in tree.body]
    except (SyntaxError, TypeError):
        statements = [line.strip() for line in code.splitlines()]
    statements = [s.rstrip(";") for s in statements if s and not s.startswith("#")]
    plots = [s for s in statements if re.search(r"\b(figures\.\w+|\w*(plot|figure)\w*)\(", s)]
    made_by = (plots or statements or [""])[-1]
    if len(made_by) > longest:
        made_by = made_by[:longest - 1] + "…"
    return f"Figure made by: {made_by}" if made_by else "Figure"


c = get_config()  # noqa: F821  (traitlets defines it for configuration files)
c.SlidesExporter.preprocessors = [CachedExecute]
c.CachedExecute.timeout = 600
c.SlidesExporter.extra_template_basedirs = [str(HERE)]
c.SlidesExporter.template_name = "template"
c.SlidesExporter.filters = {"figure_alt": figure_alt}
c.SlidesExporter.reveal_url_prefix = "vendor/reveal.js"
c.SlidesExporter.require_js_url = "vendor/requirejs/require.js"
c.SlidesExporter.mathjax_url = "vendor/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"
c.SlidesExporter.reveal_theme = "white"
c.SlidesExporter.reveal_transition = "none"
c.SlidesExporter.reveal_number = "c/t"
# The deck's own size: 1 deck-pixel is 1 pixel on a 1280 x 720 screen (reveal.js scales the deck
# to any other); the template starts reveal.js with no margin around it
c.SlidesExporter.reveal_width = "1280"
c.SlidesExporter.reveal_height = "720"
