"""TensorBoard for the chief's run: its event files read back as numbers, and TensorBoard itself
served on this machine.

Introduced in notebooks/11_fault_tolerance.ipynb. The chief (:func:`course_lib.chief.train`)
writes its loss with ``torch.utils.tensorboard.SummaryWriter`` into ``<directory>/tensorboard``;
a restarted chief opens the writer with ``purge_step`` at the step it resumes from, so the
steps it computes twice are shown once, from the attempt that finished::

    read_scalars("ckpt/tensorboard")           # {"loss": [(1, 0.52), (2, 0.49), ...]}
    with serve("ckpt/tensorboard") as board:   # tensorboard --logdir ... on 127.0.0.1
        board.url                              # open it in a browser: the Scalars tab
"""

from __future__ import annotations

import ctypes
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

SUBDIR = "tensorboard"  # where the chief writes, inside its checkpoint directory


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files under ``logdir``, as ``{tag: [(step, value), ...]}``
    in step order, with what a restart purged left out (as TensorBoard shows it).
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    # optional dependency (tensorboard), imported only when logs are read
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    if not Path(logdir).is_dir():
        raise FileNotFoundError(f"no TensorBoard logs in {logdir}: did the chief run with "
                                "tensorboard=True?")
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep them all
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


class TensorBoard:
    """A TensorBoard server started by :func:`serve`: ``url``, ``scalars(tag)`` through its own
    HTTP API, ``stop()``. Introduced in notebooks/11_fault_tolerance.ipynb."""

    def __init__(self, process: subprocess.Popen, url: str) -> None:
        self.process, self.url = process, url

    def scalars(self, tag: str, run: str = ".") -> list[tuple[int, float]]:
        """``[(step, value), ...]`` of ``tag`` as the server shows it (its ``/data`` API)."""
        query = f"data/plugin/scalars/scalars?tag={tag}&run={run}"
        with urllib.request.urlopen(self.url + query, timeout=10) as reply:  # [[time, step, value]]
            return [(step, value) for _, step, value in json.load(reply)]

    def stop(self) -> None:
        """Terminate the server (killed if it has not exited 10 s later)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self) -> TensorBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _repr_html_(self):  # in a notebook: the link, and TensorBoard itself below it
        return (f'<a href="{self.url}" target="_blank">{self.url}</a><br>'
                f'<iframe src="{self.url}#scalars" width="100%" height="520" '
                'style="border: 1px solid #ccc"></iframe>')


def _die_with_parent():
    """In the child, before it runs TensorBoard (Linux): SIGTERM when the process that started
    it dies, so a notebook's kernel shut down or killed takes its TensorBoard with it."""
    if sys.platform.startswith("linux"):
        # (ctypes is imported at the top, not here: between fork and exec, do as little as can be)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve(logdir: str | Path, timeout: float = 60) -> TensorBoard:
    """Start ``tensorboard --logdir logdir`` on 127.0.0.1 and a free port; returns a
    :class:`TensorBoard` once it answers (a deadline of ``timeout`` s, naming what it printed).
    It runs until ``stop()``, or until the process that started it (a notebook's kernel) ends.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    logdir = Path(logdir)
    if not logdir.is_dir():
        raise FileNotFoundError(f"no TensorBoard logs in {logdir}")
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", "0", "--reload_interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)
    lines = queue.Queue()  # a thread reads its output all its life: a full pipe never blocks it
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout],
                     daemon=True).start()
    said, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            said.append(lines.get(timeout=0.2))
        except queue.Empty:
            continue
        found = re.search(r"(http://127\.0\.0\.1:\d+/)", said[-1])  # printed once it listens
        if found:
            return TensorBoard(process, found.group(1))
    process.kill()
    raise RuntimeError(f"TensorBoard did not start within {timeout}s on {logdir} (exit code "
                       f"{process.wait(10)}): " + "".join(said)[-1000:])
