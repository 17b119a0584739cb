"""nbconvert's configuration for `make slides`: a reveal.js deck per notebook that works offline.

The outputs come from the jupyter-cache that `make site` fills (build/jupyter_cache): a notebook
whose code is unchanged since it was executed is not executed again; one that is missing is
executed and cached, so the site then reuses it. reveal.js, require.js and MathJax are served
from slides/vendor/ (`python slides/vendor.py`); the look is in slides/template/.

    jupyter nbconvert --config slides/config.py --to slides --output-dir slides notebooks/*.ipynb
"""
import re
from pathlib import Path

from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from nbconvert.preprocessors import ExecutePreprocessor
from traitlets import Unicode

HERE = Path(__file__).resolve().parent


class CachedExecute(ExecutePreprocessor):
    """The notebook's outputs from the cache, or executed (in its folder) and cached."""

    record_timing = False  # as myst-nb executes: the cached notebook must hash like the source
    cache_path = Unicode(str(HERE.parent / "build" / "jupyter_cache")).tag(config=True)

    def preprocess(self, nb, resources=None, km=None):
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


c = get_config()  # noqa: F821  (traitlets defines it for configuration files)
c.SlidesExporter.preprocessors = [CachedExecute]
c.CachedExecute.timeout = 600
c.SlidesExporter.extra_template_basedirs = [str(HERE)]
c.SlidesExporter.template_name = "template"
c.SlidesExporter.reveal_url_prefix = "vendor/reveal.js"
c.SlidesExporter.require_js_url = "vendor/requirejs/require.js"
c.SlidesExporter.mathjax_url = "vendor/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"
c.SlidesExporter.reveal_theme = "white"
c.SlidesExporter.reveal_transition = "none"
c.SlidesExporter.reveal_number = "c/t"
