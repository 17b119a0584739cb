"""A student's first hour, in a real browser: `make lab`, then Run All in notebook 00 and lab 05,
then a long cluster call stopped with Kernel > Interrupt.

Headless Chromium from Debian (`apt-get install -y chromium`) driven by Playwright; skipped
where either is missing. One JupyterLab for the module, stopped at the end with every kernel and
cluster it started. Autosave is off: the notebooks on disk stay as they are. Screenshots and
the JupyterLab log go to $BROWSER_ARTIFACTS (a temporary directory otherwise; its path is printed).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TOKEN = "course-browser-test"
WELCOME = "notebooks/00_welcome_and_cluster.ipynb"
LAB05 = "labs/05_allreduce.ipynb"

# where the artifacts fixture (tests/conftest.py) saves, and what
ARTIFACTS = ("browser", "browser tests: screenshots and JupyterLab log")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium"),
    pytest.mark.skipif(shutil.which("make") is None, reason="needs make: apt-get install -y make"),
]
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="needs Playwright: pip install -c constraints.txt -e '.[dev]'")

# JupyterLab settings for the test: no autosave (outputs must not reach the repository), every
# cell in the page (no windowing), no news or update checks.
SETTINGS = {
    "docmanager-extension/plugin": '{"autosave": false}',
    "notebook-extension/tracker": '{"windowingMode": "none"}',
    "apputils-extension/notification": '{"checkForUpdates": false, "fetchNews": "false"}',
}

# The notebook's model, read through the app object (errors and stderr look alike in the page)
STATE_JS = """(path) => {
  for (const w of window.jupyterapp.shell.widgets('main')) {
    if (!w.context || w.context.path !== path) continue;
    const list = w.content.model.cells, cells = [];
    for (let i = 0; i < list.length; i++) cells.push(list.get(i).toJSON());
    const prompts = [...w.node.querySelectorAll('.jp-InputArea-prompt')].map(p => p.textContent);
    return {status: w.sessionContext.kernelDisplayStatus, cells, prompts};
  }
  return null;
}"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc, timeout=30):
    """SIGTERM `make lab` (JupyterLab shuts its kernels down), then kill whatever is left of its
    process tree, then the clusters of kernels that died without stopping theirs."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    _, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=10)
    from course_lib.runtime.launch import clean_clusters
    clean_clusters()  # only clusters whose kernel is gone


@pytest.fixture(scope="module")
def lab(artifacts, tmp_path_factory):
    """`make lab` as the README starts it, on a free port with a known token and no browser."""
    home = tmp_path_factory.mktemp("jupyterlab")
    for name, text in SETTINGS.items():
        plugin = home / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        plugin.parent.mkdir(parents=True, exist_ok=True)
        plugin.write_text(text)
    port = _free_port()
    lab_args = (f"--no-browser --ServerApp.port={port} --ServerApp.port_retries=0 "
                f"--IdentityProvider.token={TOKEN} --LabApp.expose_app_in_browser=True")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"))
    log_path = artifacts / "jupyterlab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_ARGS={lab_args}"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}",
                                       timeout=5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("make lab did not serve within 120 s:\n" + log_path.read_text())
                time.sleep(0.3)
        yield {"port": port, "log": log_path}
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def browser(lab, chromium):  # once lab is up
    return chromium


@pytest.fixture(scope="module")
def pages(lab, browser):
    """One browser page per notebook, opened on first use and kept for the module."""
    opened = {}

    def page_for(path):
        if path not in opened:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            workspace = re.sub(r"\W", "-", Path(path).stem)
            page.goto(f"http://127.0.0.1:{lab['port']}/lab/workspaces/{workspace}/tree/{path}"
                      f"?token={TOKEN}&reset")
            _wait_idle(page, path, deadline_s=90)
            opened[path] = page
        return opened[path]

    yield page_for
    for page in opened.values():
        page.close()


def _state(page, path):
    return page.evaluate(STATE_JS, path)


def _wait_idle(page, path, deadline_s, done=lambda state: True):
    """Wait until the kernel is idle, no cell is queued or running and ``done(state)`` holds,
    twice in a row half a second apart; returns the notebook's state."""
    deadline = time.monotonic() + deadline_s
    settled = 0
    while True:
        state = page.evaluate("() => window.jupyterapp !== undefined") and _state(page, path)
        quiet = (state and state["status"] == "idle"
                 and not any("*" in p for p in state["prompts"]) and done(state))
        settled = settled + 1 if quiet else 0
        if settled >= 2:
            return state
        if time.monotonic() > deadline:
            status = state and state["status"]
            pytest.fail(f"{path}: not idle within {deadline_s} s (kernel {status})")
        time.sleep(0.5)


def _menu(page, menu, item):
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{item}$")).click()


def _code_cells(state):
    return [c for c in state["cells"] if c["cell_type"] == "code"]


def _text(cell, kinds=("stream", "execute_result", "display_data")):
    parts = []
    for out in cell["outputs"]:
        if out["output_type"] in kinds:
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            parts.append("".join(text) if isinstance(text, list) else text)
    return "".join(parts)


def _errors(state):
    return [(i, f"{o['ename']}: {o['evalue']}") for i, c in enumerate(state["cells"])
            for o in c.get("outputs", []) if o["output_type"] == "error"]


def _run_all(page, path, deadline_s):
    """Run > Run All Cells, and wait until every code cell has run (or an error stopped it)."""
    _menu(page, "Run", "Run All Cells")
    return _wait_idle(page, path, deadline_s, done=lambda s: _errors(s) or all(
        c["execution_count"] for c in _code_cells(s)))


def _assert_all_ran_without_errors(state, path):
    assert not _errors(state), f"{path}: error outputs in cells {_errors(state)}"
    missing = [i for i, c in enumerate(state["cells"])
               if c["cell_type"] == "code" and not c["execution_count"]]
    assert not missing, f"{path}: cells {missing} did not run"


def _add_cell_and_run(page, code):
    """Select the last cell, insert a code cell below it (B), type, run it (Ctrl+Enter)."""
    page.keyboard.press("Escape")
    page.locator(".jp-NotebookPanel .jp-Cell").last.locator(".jp-InputPrompt").click()
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.insert_text(code)
    page.keyboard.press("Control+Enter")


def test_untouched_lab_05_runs_all_cells_without_errors(pages, artifacts):
    """A student's Run All before solving anything: the figure, a notice per check, no error."""
    page = pages(LAB05)
    state = _run_all(page, LAB05, deadline_s=180)
    page.screenshot(path=artifacts / "lab05_run_all.png")
    _assert_all_ran_without_errors(state, LAB05)
    checks = [c for c in _code_cells(state) if "checks.check_" in c["source"]]
    silent = [c["source"] for c in checks if "not implemented yet" not in _text(c)]
    assert checks and not silent, f"checks that did not say 'not implemented yet': {silent}"
    figure = page.locator(".jp-NotebookPanel .jp-OutputArea-output img").first
    figure.scroll_into_view_if_needed()
    assert figure.evaluate("img => img.complete && img.naturalWidth > 0"), "figure not rendered"
    page.screenshot(path=artifacts / "lab05_figure.png")


def test_welcome_notebook_runs_all_cells_without_errors(pages, artifacts):
    page = pages(WELCOME)
    state = _run_all(page, WELCOME, deadline_s=240)
    page.screenshot(path=artifacts / "welcome_run_all.png")
    _assert_all_ran_without_errors(state, WELCOME)
    assert "doctor: ready" in "".join(_text(c) for c in _code_cells(state))


def test_kernel_interrupt_stops_a_cluster_call_and_the_next_call_works(pages, artifacts):
    """Kernel > Interrupt during a 40 s cluster call: the engines stop too (Cluster.run), and
    the next call repairs the process group and answers within its 10 s deadline."""
    page = pages(WELCOME)
    _add_cell_and_run(page, "import time\n"
                            "from course_lib import start_cluster\n"
                            "from course_lib.runtime.cluster import allreduce_ranks\n"
                            "from course_lib.runtime.engine import sleep_on\n"
                            "cluster = start_cluster(n=2, timeout=60)")
    _wait_idle(page, WELCOME, deadline_s=90)
    _add_cell_and_run(page, "cluster.run(sleep_on, [0, 1], 40)")
    page.locator(".jp-NotebookPanel .jp-InputArea-prompt").last.filter(
        has_text="*").wait_for(timeout=10_000)
    time.sleep(2)  # both engines are asleep inside the call
    _menu(page, "Kernel", "Interrupt Kernel")
    cell = _wait_idle(page, WELCOME, deadline_s=15)["cells"][-1]  # not the 40 s of the call
    assert [o["ename"] for o in cell["outputs"] if o["output_type"] == "error"] == \
        ["KeyboardInterrupt"], cell["outputs"]
    assert "sleep_on was stopped on rank(s) [0, 1]" in _text(cell, ("stream",))

    _add_cell_and_run(page, "t = time.perf_counter()\n"
                            "sums = cluster.run(allreduce_ranks, timeout=10)\n"
                            "print(sums, f'in {time.perf_counter() - t:.1f} s')")
    try:
        cell = _wait_idle(page, WELCOME, deadline_s=30)["cells"][-1]
        page.locator(".jp-NotebookPanel .jp-Cell").last.scroll_into_view_if_needed()
        page.screenshot(path=artifacts / "welcome_interrupt.png")
    finally:
        _add_cell_and_run(page, "cluster.stop()")
        _wait_idle(page, WELCOME, deadline_s=30)
    assert not _errors({"cells": [cell]}), cell["outputs"]
    shown = _text(cell)
    assert shown.startswith("[1.0, 1.0] in "), shown


def test_jupyterlab_log_has_no_setup_warnings_and_no_save(lab):
    """No warning about ipyparallel's server extension or plain-TCP kernels (fixed in the
    Makefile), and nothing saved: the notebooks in the repository keep no outputs."""
    log = lab["log"].read_text()
    assert "Saving file" not in log
    assert "_jupyter_server_extension_points" not in log
    assert "without encryption" not in log
