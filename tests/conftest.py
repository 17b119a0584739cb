"""One shared cluster per size for the whole test session.

Starting a cluster costs seconds (each engine imports PyTorch), so test modules do not start their
own: a module says ``CLUSTER_SIZE = 3`` (default 2; ``CLUSTER_BACKEND``, ``CLUSTER_TIMEOUT`` too)
and its tests take the ``cluster`` fixture. The cluster is kept for later modules of the same size
and rebuilt only when a test has stopped it; a broken process group or a killed engine is
repaired by the cluster itself on its next ``run``.
"""

import os
from pathlib import Path

import pytest

from course_lib.runtime.cluster import start_cluster

_CLUSTERS = {}


def _backend(backend):
    if backend == "auto":
        import torch
        return "auto" if torch.cuda.is_available() else "gloo"  # the same cluster on a CPU
    return backend


def shared_cluster(n, backend="auto", timeout=60):
    """The session's cluster of ``n`` ranks, started on first use (or again if stopped)."""
    key = (n, _backend(backend))
    cluster = _CLUSTERS.get(key)
    if cluster is None or cluster.stopped:
        cluster = _CLUSTERS[key] = start_cluster(n=n, backend=backend, timeout=60)
    cluster.timeout = timeout  # each module's default deadline for cluster.run
    return cluster


@pytest.fixture(scope="module")
def cluster(request):
    module = request.module
    return shared_cluster(getattr(module, "CLUSTER_SIZE", 2),
                          getattr(module, "CLUSTER_BACKEND", "auto"),
                          getattr(module, "CLUSTER_TIMEOUT", 60))


@pytest.fixture(scope="session", autouse=True)
def _stop_clusters():
    yield
    for cluster in _CLUSTERS.values():
        cluster.stop()



@pytest.fixture(scope="module")
def artifacts(request, tmp_path_factory):
    """Where a browser test module saves its screenshots: $BROWSER_ARTIFACTS, else a temporary
    folder; its path is printed even when pytest captures output. A module says what it saves
    with ``ARTIFACTS = (folder name, what)``."""
    name, what = getattr(request.module, "ARTIFACTS", ("browser", "screenshots"))
    path = Path(os.environ.get("BROWSER_ARTIFACTS") or tmp_path_factory.mktemp(name))
    path.mkdir(parents=True, exist_ok=True)
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n{what} in {path}")
    return path


@pytest.fixture(scope="module")
def chromium():
    """Debian's Chromium driven by Playwright, for the module (browser test modules skip first
    where either is missing)."""
    import shutil
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=shutil.which("chromium") or shutil.which("chromium-browser"))
        try:
            yield browser
        finally:
            browser.close()


# Every figure a test draws is one a notebook shows, and a deck shows it on a 1280 x 720 slide:
# its smallest text must be readable there (course_lib.runtime.slide_text). The
# notebooks' own figures are measured the same way under nbval (COURSE_LIB_SLIDE_TEXT).
_DRAWN = []


def _track_figures():
    import matplotlib.figure

    init = matplotlib.figure.Figure.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _DRAWN.append(self)

    matplotlib.figure.Figure.__init__ = tracked


_track_figures()


@pytest.fixture(autouse=True)
def _figures_readable_on_a_slide():
    _DRAWN.clear()
    yield
    from course_lib.runtime.slide_text import too_small_for_slides
    problems = [p for p in map(too_small_for_slides, _DRAWN) if p]
    _DRAWN.clear()
    assert not problems, "\n".join(problems)
