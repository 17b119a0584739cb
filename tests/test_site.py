"""`make site` and `make slides`, checked in a real browser with no network.

The site is built from a subset (notebook 01, executed into a fresh jupyter-cache; lab 05; the
landing page, the API reference and the figures), then the deck of notebook 01 from the same
cache, which must not execute it again; every slide of the deck, figures included, is measured
as tests/test_slides.py measures the decks as stored. Every page and the deck are served on
127.0.0.1 and opened in headless Chromium (Debian's, driven by Playwright, as in
test_browser.py): any request to another host, console error or failed load fails the test.
Screenshots go to $BROWSER_ARTIFACTS (a temporary directory otherwise; its path is printed).
"""

import functools
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NOTEBOOK = "notebooks/01_gradient_descent.ipynb"
LAB = "labs/05_allreduce.ipynb"
PAGES = ["README.html", "notebooks/01_gradient_descent.html", "labs/05_allreduce.html",
         "site/api.html", "site/figures.html"]
DECK = "01_gradient_descent.slides.html"

# where the artifacts fixture (tests/conftest.py) saves, and what
ARTIFACTS = ("site", "site tests: screenshots")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium"),
]
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="needs Playwright: pip install -c constraints.txt -e '.[dev]'")
for _module in ("sphinx", "myst_nb", "sphinx_book_theme", "jupyter_cache"):
    pytest.importorskip(_module, reason="needs the site extra: "
                        "pip install -c constraints.txt -e '.[site]'")


def _run(args, timeout, **kwargs):
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         **kwargs)
    assert out.returncode == 0, f"{args}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def vendor():
    """reveal.js, require.js and MathJax in slides/vendor (fetched once, then offline)."""
    out = subprocess.run([sys.executable, "slides/vendor.py", "slides/vendor"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.skip("could not fetch reveal.js, require.js and MathJax from the npm registry "
                    f"(python slides/vendor.py): {out.stderr.strip()[-300:]}")
    return ROOT / "slides" / "vendor"


@pytest.fixture(scope="module")
def built(vendor, tmp_path_factory):
    """The site's subset and the deck, from one fresh cache."""
    tmp = tmp_path_factory.mktemp("build")
    cache, site, slides = tmp / "jupyter_cache", tmp / "site", tmp / "slides"
    env = dict(os.environ, SITE_NOTEBOOKS=f"{NOTEBOOK} {LAB}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    site_build = _run([sys.executable, "-m", "sphinx", "-q", "-c", "site", "-b", "html",
                       "-D", f"nb_execution_cache_path={cache}", ".", str(site)],
                      timeout=600, env=env)  # a hang guard: minutes on a busy machine
    deck = _run([sys.executable, "-m", "jupyter", "nbconvert", "--config", "slides/config.py",
                 "--to", "slides", f"--CachedExecute.cache_path={cache}", "--output-dir",
                 str(slides), NOTEBOOK], timeout=300, env=env)
    (slides / "vendor").symlink_to(vendor, target_is_directory=True)
    return {"site": site, "slides": slides, "site_log": site_build.stderr,
            "deck_log": deck.stderr}


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    """One HTTP server on 127.0.0.1 for the site (/site/...) and the decks (/slides/...)."""
    root = tmp_path_factory.mktemp("served")
    (root / "site").symlink_to(built["site"], target_is_directory=True)
    (root / "slides").symlink_to(built["slides"], target_is_directory=True)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser(server, chromium):  # once server is up
    return chromium


@pytest.fixture
def open_page(browser, server):
    """Open a URL under the server and record what goes wrong: console errors, uncaught
    exceptions, failed loads and every request to a host other than the server's."""
    opened = []

    def open_(path, viewport=(1400, 1000)):
        page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
        page.set_default_timeout(30_000)
        problems = []
        local = urlsplit(server).netloc
        page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"exception: {e}"))
        page.on("response", lambda r: r.status >= 400 and problems.append(f"{r.status} {r.url}"))
        # (a load aborted because the page moved on, as index.html's redirect does, is not a
        # missing file: that one answers 404, caught above)
        page.on("requestfailed", lambda r: r.failure != "net::ERR_ABORTED"
                and problems.append(f"failed: {r.url} ({r.failure})"))
        page.on("request", lambda r: urlsplit(r.url).scheme != "data"
                and urlsplit(r.url).netloc != local and problems.append(f"left: {r.url}"))
        page.goto(f"{server}/{path}", wait_until="load")
        page.problems = problems
        opened.append(page)
        return page

    yield open_
    for page in opened:
        page.close()


def _wait_math(page, deadline_s=30):
    """Wait until MathJax has typeset every formula of the page; returns how many there are."""
    page.wait_for_function("() => window.MathJax && MathJax.Hub && MathJax.isReady",
                           timeout=deadline_s * 1000)
    page.evaluate("() => new Promise(done => MathJax.Hub.Queue(done))")
    return page.evaluate("""() => [...document.querySelectorAll('span.math, div.math')]
        .filter(m => m.querySelector('.MathJax_CHTML')).length""")


def test_built_html_names_no_external_script_style_or_image(built):
    pattern = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=[\"'](?:https?:)?//", re.I)
    files = [*built["site"].rglob("*.html"), *built["slides"].glob("*.html")]
    assert len(files) > len(PAGES)
    offenders = [str(f.relative_to(f.parents[1])) for f in files if pattern.search(f.read_text())]
    assert not offenders, f"pages loading scripts, styles or images from another host: {offenders}"


def test_builds_do_not_warn(built):
    """Sphinx (-q) prints only warnings; nbconvert warns when an image has no alt text."""
    assert "WARNING" not in built["site_log"], built["site_log"][-3000:]
    assert "didn't match any documents" not in built["site_log"]  # a toctree of nothing built
    assert "Alternative text is missing" not in built["deck_log"], built["deck_log"][-3000:]


def _conf():
    spec = importlib.util.spec_from_file_location("site_conf", ROOT / "site" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


def test_sidebar_lists_only_the_kinds_of_notebook_built(built):
    toc = _conf().toc
    assert "notebooks/*" in toc(["notebooks/01_*.ipynb"])
    assert "labs/*" not in toc(["notebooks/01_*.ipynb"])
    assert "notebooks/*" not in toc(["labs/05_allreduce.ipynb"])
    assert "labs/*" in toc(["labs/05_allreduce.ipynb", "labs/solutions/*.ipynb"])
    assert "site/api" in toc([])
    landing = (built["site"] / "README.html").read_text()  # the small site has both kinds
    assert 'href="notebooks/01_gradient_descent.html"' in landing
    assert 'href="labs/05_allreduce.html"' in landing


def test_deck_images_say_what_they_show(built):
    html = (built["slides"] / DECK).read_text()
    alts = re.findall(r'<div class="jp-RenderedImage[^>]*>\s*<img [^>]*?alt="([^"]*)"', html)
    images = html.count('<div class="jp-RenderedImage')
    assert images >= 5 and len(alts) == images, (images, alts)
    assert all(alt.startswith("Figure") and "No description" not in alt for alt in alts), alts
    # a title the cell gives, else the call that made the figure
    assert "Figure: loss above the optimum, same epochs" in alts
    assert "Figure made by: figures.plot_contour_paths(problem, X, y, runs, " \
           "optimum_theta=theta_star)" in alts


# A page no wider than the window, with both sidebars (1400) and without (600, where notebook
# 01's printed lines are wider than their box): long lines scroll inside their box
@pytest.mark.parametrize("width", [1400, 600])
@pytest.mark.parametrize("path", PAGES)
def test_site_page_is_no_wider_than_the_window(open_page, artifacts, path, width):
    page = open_page(f"site/{path}", viewport=(width, 900))
    if page.locator("span.math, div.math").count():
        _wait_math(page)  # a typeset formula has its final width
    widths = page.evaluate("""() => [document.documentElement.scrollWidth,
                                     document.documentElement.clientWidth]""")
    if widths[0] > widths[1]:
        page.screenshot(path=artifacts / f"site_wide_{width}_{path.replace('/', '_')}.png",
                        full_page=True)
    assert widths[0] <= widths[1], f"{path} at {width} px: {widths[0]} px wide"
    overflowing = page.evaluate("""() => [...document.querySelectorAll('.cell_output pre')]
        .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => getComputedStyle(e).overflowX)""")
    assert all(o in ("auto", "scroll") for o in overflowing), overflowing
    if path == NOTEBOOK.replace(".ipynb", ".html") and width == 600:
        assert overflowing, "no printed line wider than its box: nothing was checked"


@pytest.mark.parametrize("path", ["index.html", *PAGES])
def test_site_page_loads_offline_without_errors(open_page, artifacts, path):
    page = open_page(f"site/{path}")
    page.wait_for_load_state("networkidle", timeout=30_000)
    page.screenshot(path=artifacts / f"site_{path.replace('/', '_')}.png")
    assert page.title(), path
    assert not page.problems, f"{path}: {page.problems}"


def test_landing_page_is_the_course_map_and_links_the_notebook(open_page):
    page = open_page("site/index.html")
    page.wait_for_url("**/README.html", timeout=10_000)
    assert page.locator("h2", has_text="Course map").count() == 1
    _wait_math(page)  # the course map's formulas: their fonts load before we leave the page
    page.wait_for_load_state("networkidle", timeout=30_000)
    link = page.locator("article a[href$='notebooks/01_gradient_descent.html']").first
    link.click()
    page.wait_for_url("**/notebooks/01_gradient_descent.html", timeout=10_000)
    page.wait_for_load_state("networkidle", timeout=30_000)
    assert not page.problems, page.problems


def test_notebook_page_has_its_outputs_math_and_figures(open_page, artifacts):
    page = open_page("site/notebooks/01_gradient_descent.html")
    formulas = page.locator("span.math, div.math").count()
    assert formulas > 10
    assert _wait_math(page) == formulas, "formulas left untypeset"
    images = page.evaluate("""() => [...document.querySelectorAll('.cell_output img')]
        .map(i => i.complete && i.naturalWidth)""")
    assert len(images) >= 5 and all(images), images  # the notebook's plots, each loaded
    assert page.locator(".cell_output").count() > 10  # executed: text outputs too
    figure = page.locator(".cell_output img").first
    figure.scroll_into_view_if_needed()
    page.screenshot(path=artifacts / "site_notebook01_figure.png")
    assert not page.problems, page.problems


def test_lab_page_is_the_student_version_unexecuted(open_page):
    page = open_page("site/labs/05_allreduce.html")
    assert page.locator(".cell_input").count() > 3
    assert page.locator(".cell_output").count() == 0
    assert "raise NotImplementedError" in page.locator("article").inner_text()


def test_api_page_documents_every_top_level_module(open_page):
    page = open_page("site/site/api.html")
    package = ROOT / "course_lib"  # the lessons, then comm, runtime and k8s (site/conf.py)
    modules = [p.stem for p in package.glob("*.py") if p.stem[0] != "_"] + [
        f"{sub}.{p.stem}" for sub in ("comm", "runtime", "k8s")
        for p in (package / sub).glob("*.py") if p.stem[0] != "_"]
    documented = page.evaluate("""() => [...document.querySelectorAll('dt[id^="course_lib."]')]
        .map(d => d.id)""")
    missing = [m for m in modules if not any(d.startswith(f"course_lib.{m}.") for d in documented)]
    assert not missing, f"modules with no documented function or class: {missing}"
    assert "course_lib.collectives.ring_allreduce" in documented


def test_figures_page_shows_every_image(open_page):
    page = open_page("site/site/figures.html")
    page.wait_for_load_state("networkidle", timeout=30_000)
    widths = page.evaluate("() => [...document.querySelectorAll('article img')]"
                           ".map(i => i.complete && i.naturalWidth)")
    assert len(widths) == len(list((ROOT / "images").glob("*.png"))) and all(widths), widths


# Every slide of a deck against a room's bar (tests/deck_check.js, as in tests/test_slides.py):
# at 1280 x 720, body text at least 24 px on the screen and code 18 px, every slide on the screen
# without being shrunk (what it clips scrolls in a box), every image loaded and at the slide's
# full size, every formula once.
CHECK_JS = (Path(__file__).parent / "deck_check.js").read_text()
BODY_PX, CODE_PX = 24, 18
ROOM = (1280, 720)


def _wait_deck(page, deadline_s=120):
    """Wait until the deck is fitted (its images decoded, MathJax done) and reveal.js started:
    a hang guard (seconds normally; a deck starts anyway after 60 s without MathJax done)."""
    page.wait_for_function("() => document.documentElement.dataset.deck === 'ready'",
                           timeout=deadline_s * 1000)


def test_deck_reuses_the_cache_and_every_slide_is_readable_from_the_back(built, open_page,
                                                                       artifacts):
    assert "executing" not in built["deck_log"], "the deck executed the notebook again"
    page = open_page(f"slides/{DECK}", viewport=ROOM)
    _wait_deck(page)
    bar = page.locator(".reveal .progress").bounding_box()
    assert bar and bar["height"] <= 10 and bar["width"] > 1000, f"progress bar: {bar}"
    seen = []
    for _ in range(10):  # the presenter's next: fragments, sub-slides, slides
        seen.append(tuple(page.evaluate("() => Object.values(Reveal.getIndices())")))
        page.evaluate("() => Reveal.next()")
    assert len(set(seen)) == 10, f"Reveal.next() did not move on every step: {seen}"
    report = page.evaluate(CHECK_JS, {"body": BODY_PX, "code": CODE_PX})
    for k, s in enumerate(report):
        page.evaluate(f"() => Reveal.slide({s['h']}, {s['v']}, 1000)")
        page.screenshot(path=artifacts / f"deck01_{k:02d}_{s['h']}_{s['v']}.png",
                        animations="disabled")
    failing = [f"slide {s['h']}/{s['v']} (deck01_{k:02d}_*.png): {s['problems']}"
               for k, s in enumerate(report) if s["problems"]]
    assert not failing, "\n".join(failing)
    figures = [image for s in report for image in s["images"]]
    assert len(figures) >= 5, f"the notebook's figures, each loaded at full size: {figures}"
    assert min(s["body"] for s in report if s["body"]) >= BODY_PX  # measured, not skipped
    assert page.locator(".reveal .slides section .MathJax_CHTML").count() > 0
    assert not page.problems, page.problems


def test_a_deck_opened_at_a_later_slide_shows_each_formula_once(built, open_page):
    """A presenter reloads the deck mid-lecture (its URL keeps the slide): the deck opens on
    that slide, and each of its formulas is typeset once."""
    page = open_page(f"slides/{DECK}#/2/0", viewport=ROOM)  # the gradient: ten formulas
    _wait_deck(page)
    time.sleep(1)  # anything queued after the slide change has run
    state = page.evaluate("""() => [Reveal.getIndices(), [...Reveal.getCurrentSlide()
        .querySelectorAll('.MathJax_CHTML')].map(m => m.querySelectorAll(':scope > .mjx-math')
        .length)]""")
    assert (state[0]["h"], state[0]["v"]) == (2, 0), state[0]
    assert len(state[1]) >= 5 and set(state[1]) == {1}, state[1]
    assert not page.problems, page.problems
