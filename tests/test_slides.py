"""Every slide of every deck `make slides` makes, read from the back of a room: at 1280 x 720,
body text is at least 24 px on the screen and code at least 18 px, and every slide fits on the
screen without being shrunk (what does not fit scrolls inside a box, at full size).

The decks are built from the notebooks as stored (no outputs: executing them all takes far too
long here; tests/test_site.py checks notebook 01's deck with its outputs and figures), in one
nbconvert run, and opened one after the other in one headless Chromium (Debian's, driven by
Playwright, as in test_browser.py), with no network. tests/deck_check.js measures the slides.
Screenshots of a slide that fails, and a report of the sizes measured, go to $BROWSER_ARTIFACTS
(a temporary directory otherwise; its path is printed).
"""

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHECK_JS = (Path(__file__).parent / "deck_check.js").read_text()
BODY_PX, CODE_PX = 24, 18  # the least text size on a 1280 x 720 screen
VIEWPORT = {"width": 1280, "height": 720}

# where the artifacts fixture (tests/conftest.py) saves, and what
ARTIFACTS = ("slides", "slide tests: screenshots of failing slides, sizes.json")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium"),
]
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="needs Playwright: pip install -c constraints.txt -e '.[dev]'")


def open_deck(page, url, deadline_s=120):
    """Open a deck and wait until it is fitted and reveal.js has started (<html data-deck>): a
    hang guard (seconds normally; a deck starts anyway after 60 s without MathJax done)."""
    page.goto(url, wait_until="load")
    page.wait_for_function("() => document.documentElement.dataset.deck === 'ready'",
                           timeout=deadline_s * 1000)


def check_deck(page):
    """Every slide of the open deck (tests/deck_check.js): a list of {h, v, body, code,
    images, problems}."""
    return page.evaluate(CHECK_JS, {"body": BODY_PX, "code": CODE_PX})


@pytest.fixture(scope="module")
def decks(tmp_path_factory):
    """Every notebook's deck, as stored (nothing executed, no cache), in one folder with the
    scripts beside them (slides/vendor, fetched once)."""
    out = subprocess.run([sys.executable, "slides/vendor.py", "slides/vendor"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.skip("could not fetch reveal.js, require.js and MathJax from the npm registry "
                    f"(python slides/vendor.py): {out.stderr.strip()[-300:]}")
    folder = tmp_path_factory.mktemp("decks")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    build = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--config", "slides/config.py",
         "--to", "slides", "--CachedExecute.as_stored=True", "--output-dir", str(folder),
         *(str(p.relative_to(ROOT)) for p in NOTEBOOKS)],
        cwd=ROOT, capture_output=True, text=True, env=env,
        timeout=900)  # a hang guard: about 15 s on an idle machine
    assert build.returncode == 0, build.stderr[-3000:]
    assert "executing" not in build.stderr, "a deck as stored executed its notebook"
    assert len(list(folder.glob("*.slides.html"))) == len(NOTEBOOKS)
    (folder / "vendor").symlink_to(ROOT / "slides" / "vendor", target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def server(decks):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(Quiet, directory=str(decks)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def page(server, chromium):
    """One page for every deck; what goes wrong in it (console errors, failed loads, requests
    to another host) is collected in page.problems, emptied by each test."""
    page = chromium.new_page(viewport=VIEWPORT)
    page.set_default_timeout(30_000)
    page.problems = []
    local = urlsplit(server).netloc
    page.on("console", lambda m: m.type == "error" and page.problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: page.problems.append(f"exception: {e}"))
    page.on("response", lambda r: r.status >= 400 and page.problems.append(f"{r.status} {r.url}"))
    page.on("request", lambda r: urlsplit(r.url).scheme != "data"
            and urlsplit(r.url).netloc != local and page.problems.append(f"left: {r.url}"))
    yield page
    page.close()


@pytest.fixture(scope="module")
def sizes(artifacts):
    """The smallest sizes measured on each deck, written to sizes.json at the end."""
    found = {}
    yield found
    (artifacts / "sizes.json").write_text(json.dumps(found, indent=1))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_slide_is_readable_from_the_back_of_the_room(page, server, artifacts, sizes,
                                                           notebook):
    deck = notebook.stem + ".slides.html"
    page.problems.clear()
    open_deck(page, f"{server}/{deck}")
    report = check_deck(page)
    sizes[deck] = {"slides": len(report),
                   "body_px": min((s["body"] for s in report if s["body"]), default=None),
                   "code_px": min((s["code"] for s in report if s["code"]), default=None)}
    failing = [s for s in report if s["problems"]]
    for s in failing[:5]:
        page.evaluate(f"() => Reveal.slide({s['h']}, {s['v']}, 1000)")
        page.screenshot(path=artifacts / f"{notebook.stem[:2]}_{s['h']}_{s['v']}.png")
    assert not failing, f"{deck}: " + "\n".join(
        f"slide {s['h']}/{s['v']}: {s['problems']}" for s in failing)
    assert len(report) > 5 and any(s["body"] for s in report), f"{deck}: {report[:3]}"
    assert not page.problems, page.problems


def test_a_deck_reloaded_keeps_its_place(page, server):
    """The deck is fitted before reveal.js starts: a reload (the URL names the slide) shows the
    same slide, sub-slides made by the fitting included."""
    deck = "05_allreduce.slides.html"
    open_deck(page, f"{server}/{deck}")
    split = page.evaluate("() => Reveal.getSlides().filter(s => 'continued' in s.dataset)"
                          ".map(s => [Reveal.getIndices(s), s.textContent.trim().slice(0, 60)])")
    assert split, "no slide of deck 05 was split: nothing to check"
    where, text = split[len(split) // 2]
    page.goto("about:blank")
    open_deck(page, f"{server}/{deck}#/{where['h']}/{where['v']}")
    now = page.evaluate("() => [Reveal.getIndices(), "
                        "Reveal.getCurrentSlide().textContent.trim().slice(0, 60)]")
    assert (now[0]["h"], now[0]["v"], now[1]) == (where["h"], where["v"], text)


def test_a_deck_is_fitted_the_same_on_a_larger_screen(page, server):
    """The fitting is done at the deck's own size (formulas are broken at its width too): on a
    1920 x 1080 screen the same slides fit, everything half as large again."""
    deck = "05_allreduce.slides.html"  # long formulas, tables and code
    page.goto("about:blank")
    open_deck(page, f"{server}/{deck}")
    count = page.evaluate("() => Reveal.getTotalSlides()")
    page.set_viewport_size({"width": 1920, "height": 1080})
    try:
        page.goto("about:blank")
        open_deck(page, f"{server}/{deck}")
        report = page.evaluate(CHECK_JS, {"body": BODY_PX * 1.5, "code": CODE_PX * 1.5})
    finally:
        page.set_viewport_size(VIEWPORT)
    assert len(report) == count
    failing = [f"slide {s['h']}/{s['v']}: {s['problems']}" for s in report if s["problems"]]
    assert not failing, "\n".join(failing)
