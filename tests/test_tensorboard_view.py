"""The chief's TensorBoard logs, read back and shown by TensorBoard itself in a real browser: its
Scalars page draws the run's loss (headless Chromium from Debian, driven by Playwright; skipped
where either is missing)."""

import json
import re
import shutil
import time

import pytest

from course_lib import chief
from course_lib.runtime import tensorboard_view

CLUSTER_SIZE = 2
STEPS = 12
ARTIFACTS = ("tensorboard", "TensorBoard's Scalars page")


@pytest.fixture(scope="module")
def run_dir(cluster, tmp_path_factory):
    directory = tmp_path_factory.mktemp("chief")
    run = chief.supervise(cluster, directory, STEPS, 5)
    assert run.restarts == 0
    return directory


def test_the_event_files_hold_every_step_the_chief_logged(run_dir):
    logged = [(r["step"], r["loss"]) for r in chief.read_log(run_dir) if r["event"] == "step"]
    read = tensorboard_view.read_scalars(run_dir / tensorboard_view.SUBDIR)
    assert list(read) == ["loss"] and [s for s, _ in read["loss"]] == list(range(1, STEPS + 1))
    assert all(abs(v - w) <= 1e-6 * w for (_, v), (_, w) in zip(read["loss"], logged, strict=True))


def test_no_logs_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TensorBoard logs"):
        tensorboard_view.read_scalars(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no TensorBoard logs"):
        tensorboard_view.serve(tmp_path / "nothing")


def test_tensorboard_dies_with_the_process_that_started_it(run_dir):
    """A notebook's kernel shut down or killed takes its TensorBoard with it."""
    import subprocess
    import sys

    import psutil
    code = ("import sys; from course_lib.runtime import tensorboard_view\n"
            f"board = tensorboard_view.serve({str(run_dir / tensorboard_view.SUBDIR)!r})\n"
            "print(board.process.pid, flush=True)\n"
            "import os; os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    pid = int(out.stdout.split()[0])

    def gone():
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    deadline = time.monotonic() + 20
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), "TensorBoard outlived the process that started it"


@pytest.mark.browser
@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="needs Chromium: apt-get install -y chromium")
def test_tensorboard_shows_the_runs_loss_in_a_browser(run_dir, chromium, artifacts):
    read = tensorboard_view.read_scalars(run_dir / tensorboard_view.SUBDIR)["loss"]
    with tensorboard_view.serve(run_dir / tensorboard_view.SUBDIR) as board:
        page = chromium.new_page(viewport={"width": 1280, "height": 800})
        drawn = []  # the loss series the page fetched to draw its chart

        def keep(response):  # the Scalars page posts for every run of a tag at once
            if "/data/plugin/scalars/scalars_multirun" in response.url and response.ok:
                series = json.loads(response.body())
                asked = response.request.post_data or ""  # a form: tag, then the runs
                if "." in series and re.search(r'name="tag"\s+loss\s', asked):
                    drawn.append(series["."])
        page.on("response", keep)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not drawn:
                page.goto(board.url + "#scalars")  # again, until TensorBoard has read the files
                try:
                    page.get_by_text("tag: loss").wait_for(timeout=10_000)
                except Exception:
                    continue
                page.wait_for_timeout(1000)
            page.screenshot(path=str(artifacts / "tensorboard_scalars.png"))
        finally:
            page.close()
    assert drawn, "the Scalars page never showed the loss card"
    assert [(step, value) for _, step, value in drawn[-1]] == read
