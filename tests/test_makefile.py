"""The Makefile: `make lab` serves the whole repository (notebooks and labs), also as root,
without start-up warnings; kernels of `make lab` and `make slides` encrypt their messages;
`make setup` asks PyTorch's CPU index for torch when it answers, and PyPI alone otherwise;
`make slides` and `make site` build the notebooks NOTEBOOKS names; nbval interrupts a late cell
before pytest-timeout fires."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "course-test"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port, path):
    url = f"http://127.0.0.1:{port}/api/contents/{path}?content=1&token={TOKEN}"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.load(reply)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make (apt-get install make)")
def test_make_lab_serves_the_repository_root(tmp_path):
    port = _free_port()
    extra = (f"--no-browser --ServerApp.port={port} --ServerApp.port_retries=0 "
             f"--IdentityProvider.token={TOKEN}")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path))
    proc = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_ARGS={extra}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                labs = _get(port, "labs")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    pytest.fail("make lab did not serve within 90 s:\n" + proc.communicate()[0])
                time.sleep(0.3)
        assert "05_allreduce.ipynb" in {c["name"] for c in labs["content"]}
        root = {c["name"] for c in _get(port, "")["content"]}
        assert {"notebooks", "labs", "README.md"} <= root
        assert _get(port, "notebooks/00_welcome_and_cluster.ipynb")["type"] == "notebook"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
    log = proc.communicate(timeout=600)[0]
    # ipyparallel's server extension (old entry point, a warning at every start) is off; what
    # the server printed starts at its command (make may first run setup, which names it)
    server_log = log[log.index("jupyter lab "):]
    assert "ipyparallel" not in server_log, log


def _setup_command(index):
    out = subprocess.run(["make", "--no-print-directory", "-n", "-B", "setup",
                          f"TORCH_INDEX={index}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    # the install line, whatever the extras (CI runs make with EXTRAS=mpi,dev,ft)
    return next(line for line in out.stdout.splitlines()
                if "pip install" in line and "-e '.[" in line)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make (apt-get install make)")
def test_setup_uses_the_cpu_index_only_when_it_answers(tmp_path):
    import http.server
    import threading
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}/"
        assert f"--extra-index-url {index}" in _setup_command(index)
    finally:
        server.shutdown()
    assert "--extra-index-url" not in _setup_command(f"http://127.0.0.1:{_free_port()}/")
    assert "--extra-index-url" not in _setup_command("")   # TORCH_INDEX= : PyPI's torch


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make (apt-get install make)")
def test_slides_and_lab_kernels_do_not_warn_about_plain_tcp(tmp_path):
    """ipykernel warns "Kernel is running over TCP without encryption" unless its manager gives
    it CurveZMQ keys: `make slides` and `make lab` pass the option that does. Checked by running
    nbconvert on a one-cell notebook with the options `make slides` uses."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    commands = {}
    for target in ("slides", "lab"):
        out = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        commands[target] = out.stdout
    options = re.findall(r"--KernelManager\.\S+", commands["slides"])
    assert "--KernelManager.transport_encryption=auto" in options
    assert "--KernelManager.transport_encryption=auto" in commands["lab"]

    nb = new_notebook(cells=[new_code_cell("print(6 * 7)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    out = subprocess.run([sys.executable, "-m", "nbconvert", "--to",
                          "notebook", "--execute", *options, "--output-dir", str(tmp_path),
                          "--output", "run", str(tmp_path / "tiny.ipynb")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert "without encryption" not in out.stderr, out.stderr
    assert nbformat.read(tmp_path / "run.ipynb", 4).cells[0].outputs[0].text == "42\n"


def _dry_run(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("NOTEBOOKS", "SITE_NOTEBOOKS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make (apt-get install make)")
def test_slides_and_site_build_the_notebooks_named():
    """NOTEBOOKS (globs) picks the notebooks of `make slides` and `make site`; the decks take
    the notebooks/ ones; SITE_NOTEBOOKS, the site's own, still works and wins."""
    def decks(*args):
        code, out = _dry_run("slides", *args)
        assert code == 0, out
        # the nbconvert command, its continuation line joined
        line = next(line for line in out.replace("\\\n", " ").splitlines() if "nbconvert" in line)
        return [arg for arg in line.split() if arg.endswith(".ipynb")]

    def site(*args):
        code, out = _dry_run("site", *args)
        assert code == 0, out
        line = next(line for line in out.splitlines() if "sphinx-build" in line)
        found = re.search(r'SITE_NOTEBOOKS="([^"]*)"\s', line)
        return found and found.group(1)

    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert decks() == every and len(every) > 10
    assert decks("NOTEBOOKS=notebooks/01_*.ipynb") == ["notebooks/01_gradient_descent.ipynb"]
    assert decks("NOTEBOOKS=notebooks/0[12]_*.ipynb labs/01_*.ipynb") == every[1:3]
    code, out = _dry_run("slides", "NOTEBOOKS=labs/01_*.ipynb")
    assert code != 0 and "names no notebook" in out, out

    assert site() is None  # the whole course: conf.py's default
    assert site("NOTEBOOKS=notebooks/09_*.ipynb labs/09_*.ipynb") == \
        "notebooks/09_*.ipynb labs/09_*.ipynb"
    assert site("SITE_NOTEBOOKS=notebooks/01_*.ipynb") == "notebooks/01_*.ipynb"
    assert site("SITE_NOTEBOOKS=notebooks/01_*.ipynb", "NOTEBOOKS=notebooks/02_*.ipynb") == \
        "notebooks/01_*.ipynb"


def test_nbval_interrupts_a_late_cell_before_pytest_timeout_fires():
    """A cell past nbval's timeout is interrupted, and the next cells run in a free kernel. When
    pytest-timeout (pyproject.toml) fired first, nbval never interrupted the kernel: it went on
    with the late cell, and every later cell of the notebook queued behind it and timed out."""
    nbval = re.search(r"--nbval-cell-timeout=(\d+)", (ROOT / "Makefile").read_text())
    pytest_timeout = re.search(r"^timeout = (\d+)$", (ROOT / "pyproject.toml").read_text(),
                               re.MULTILINE)
    assert int(nbval.group(1)) < int(pytest_timeout.group(1))

