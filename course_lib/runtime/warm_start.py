"""Engines forked from a warm template: a cluster that starts in a second.

Introduced in notebooks/00_welcome_and_cluster.ipynb. Every engine imports PyTorch, NumPy and
ipyparallel before it can run a line: about a second of CPU each, four on two cores, every
time a notebook starts its cluster. A **template** process imports them once, then forks an
engine per request, as ``multiprocessing``'s forkserver (with preloaded modules) and Android's
zygote start processes: a forked child shares the parent's imported modules and starts in
milliseconds. ``start_cluster(n, warm=True)`` (the default for local engines) starts the
template beside the controller, and a spare one for the process's next cluster, which then
finds its imports done; ``warm=False``, or ``COURSE_LIB_WARM=0`` in the environment, starts
engines the plain way.

What a fork must not break. The template runs no thread (one BLAS thread: ``OMP_NUM_THREADS``
and its kin are 1 before NumPy loads), opens no socket but its own (closed in the child), runs
no PyTorch operation (its thread pools start lazily, in the child) and never touches a GPU;
a child draws NumPy's global seed afresh, as a new process would.
A child starts a session of its own (signals for the cluster do not reach the template), takes
its environment, directory and output file from the request, and runs ipyparallel's engine: a
normal engine, with its id, heartbeat and signals. The template carries the cluster's
``IPP_CLUSTER_ID`` in its environment, so its children are found, cleaned and killed with the
cluster (``launch.cluster_processes``); it ends when its cluster's owner does, and the
cluster's stop kills it. Children are reaped by the kernel (``SIGCHLD`` ignored): the
launcher watches an engine by its pid, as for any engine.
"""

from __future__ import annotations

import base64
import functools
import importlib
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
from ipyparallel.cluster.launcher import (
    LocalControllerLauncher,
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    LocalProcessLauncher,
)
from traitlets import Float

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
PRELOAD = ("numpy", "torch", "zmq", "ipyparallel.engine.app", "ipyparallel.engine.nanny",
           "ipyparallel.controller.app", "course_lib.runtime.engine", "course_lib.comm",
           "course_lib.collectives", "sklearn.datasets", "sklearn.model_selection")
# (scikit-learn: the digits most notebooks train on; an engine restarted after a hang loads
# them in milliseconds, not seconds)
MODULES = ("ipyparallel.engine", "ipyparallel.controller")  # what a template may start
WARM_ENV = "COURSE_LIB_WARM"  # "0": engines start the plain way
SOCKET_ENV = "COURSE_LIB_WARM_SOCKET"  # where a forked engine asks for its nanny
READY = "ready"


def enabled() -> bool:
    """Whether engines start from a warm template (unless ``COURSE_LIB_WARM=0``).
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    return os.environ.get(WARM_ENV, "1") != "0"


MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path on Linux (sun_path, less its NUL)


def fallback_dir(create: bool = True) -> Path:
    """Where templates listen when the profile's path is too long for a socket: a folder of
    this user's alone in the temporary directory (made, mode 0700, unless ``create`` is
    False). Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    from course_lib.runtime.launch import warm_fallback_dir
    return warm_fallback_dir(create)


def socket_path(profile_dir: str, cluster_id: str) -> Path:
    """Where a new template of cluster ``cluster_id`` listens: the profile's private security
    directory, under a name of its own: a template that ends removes its own socket, never a
    newer one's. Under a home directory so deep that the path would not fit a Unix socket,
    :func:`fallback_dir` instead. Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    name = f"warm-{cluster_id}-{uuid.uuid4().hex[:6]}.sock"
    path = Path(profile_dir) / "security" / name
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        path = fallback_dir() / name
    return path


# ---------------------------------------------------------------- the template process
def serve(path: str) -> None:
    """The template's loop: import what engines need, say ready, then fork one engine per
    request on the socket at ``path``; end when the process that started it is gone.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    for name in PRELOAD:
        __import__(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    owner = os.getppid()
    Path(path).unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)  # only this user may ask for a process
    listener.listen(16)
    try:
        print(READY, flush=True)
    except BrokenPipeError:  # the process that started it has ended meanwhile (a spare)
        return
    while os.getppid() == owner:  # orphaned: the owner is gone
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                _become_engine(request, conn) if "args" in request else _become_nanny(request,
                                                                                      conn)
            if "args" in request:  # a nanny answers its engine itself, on this connection
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    Path(path).unlink(missing_ok=True)


def _on_its_own(request: dict) -> None:
    """In a forked child: a session (signals to the template's group pass it by), the
    request's environment and directory, its output file on stdout and stderr."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0), os.dup2(out, 1), os.dup2(out, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])


def _become_engine(request: dict, conn: socket.socket) -> None:
    """In the forked child: ipyparallel's engine (its nanny forked from the template too) or
    controller, with the request's arguments. Never returns."""
    code = 1
    try:
        conn.close()
        _on_its_own(request)
        import numpy as np
        np.random.seed()  # as a fresh process: its own seed (Python's random reseeds at fork)
        if request["module"] not in MODULES:
            raise ValueError(f"a template starts {MODULES}, not {request['module']!r}")
        sys.argv = [request["module"], *request["args"]]
        app = importlib.import_module(request["module"] + ".app")
        if request["module"] == "ipyparallel.engine":
            app.start_nanny = functools.partial(_forked_nanny, request)
        app.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - report it in the engine's log, then exit
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def _forked_nanny(engine: dict, **kwargs) -> tuple[str, socket.socket]:
    """ipyparallel's ``start_nanny`` for a forked engine: the nanny (which relays signals and
    reports the engine's death at once) forked from the template too, not a fresh Python.
    Returns its address and the connection it watches: closed, the engine is gone."""
    kwargs["pid"] = os.getpid()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[SOCKET_ENV])
    nanny = base64.b64encode(pickle.dumps(kwargs)).decode()
    conn.sendall(json.dumps(dict(nanny=nanny, env=engine["env"], cwd=engine["cwd"],
                                 output=engine["output"])).encode() + b"\n")
    return conn.makefile().readline().strip(), conn


def _become_nanny(request: dict, conn: socket.socket) -> None:
    """In the forked child: ipyparallel's kernel nanny, writing its address on ``conn`` and
    watching it. Never returns."""
    code = 1
    try:
        _on_its_own(request)
        kwargs = pickle.loads(base64.b64decode(request["nanny"]))
        kwargs["pipe"] = os.fdopen(conn.detach(), "w", buffering=1)
        from ipyparallel.engine.nanny import KernelNanny
        KernelNanny.main(**kwargs)
        code = 0
    except BaseException:  # noqa: BLE001 - report it in the engine's log, then exit
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------- the side that asks
def start_template(profile_dir: str, cluster_id: str, timeout: float = 60.0
                   ) -> subprocess.Popen:
    """Start the template of cluster ``cluster_id`` (it imports in the background: call
    :func:`wait_ready` before forking). Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    path = socket_path(profile_dir, cluster_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **dict.fromkeys(THREAD_VARS, "1"), "IPP_CLUSTER_ID": cluster_id,
           "IPP_PROFILE_DIR": str(profile_dir)}
    proc = subprocess.Popen([sys.executable, "-m", "course_lib.runtime.warm_start", str(path)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env,
                            start_new_session=True, text=True)
    proc.path, proc.deadline = path, time.monotonic() + timeout
    return proc


def wait_ready(proc: subprocess.Popen, wait: bool = True) -> bool:
    """Wait until the template has imported and listens (``wait=False``: only look); True
    once it does. RuntimeError if it died or missed its deadline.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    if getattr(proc, "ready", False):
        return True
    while True:  # a spare started long ago is ready: its line waits in the pipe
        left = max(0.0, proc.deadline - time.monotonic())
        if select.select([proc.stdout], [], [], min(0.5, left) if wait else 0)[0]:
            line = proc.stdout.readline()
            if line.strip() == READY:
                proc.ready = True
                return True
            if not line:
                break
        elif not wait:
            return False
        if not left:
            break
    raise RuntimeError(f"the warm template (pid {proc.pid}) did not start: exit code "
                       f"{proc.poll()}; start the cluster with warm=False")


def fork_engine(path: Path, module: str, args: list[str], env: dict, cwd: str, output: str,
                timeout: float = 10.0) -> int:
    """Ask the template listening at ``path`` for an engine (or the controller: ``module``
    is ipyparallel's); returns its pid. Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps(dict(module=module, args=args, env=env, cwd=cwd, output=output)
                             ).encode() + b"\n")
        return json.loads(s.makefile().readline())["pid"]


TEMPLATES: dict[str, subprocess.Popen] = {}  # cluster id -> its template, in this process
SPARE: list[tuple[str, subprocess.Popen]] = []  # one started ahead, for this process's next


def template_for_next(profile_dir: str) -> tuple[str, subprocess.Popen]:
    """A cluster id and its template: the spare that the previous start left importing (so
    the next cluster need not wait for it) if it is alive, else one started now.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    found = None
    while SPARE and found is None:
        cluster_id, template = SPARE.pop()
        if template.poll() is None and str(template.path.parent.parent) == str(profile_dir):
            found = cluster_id, template
        else:
            _reap(template)
    return found or _started(profile_dir)


def keep_spare(profile_dir: str) -> None:
    """Start the spare template for this process's next cluster (after this one is up: its
    imports would slow this start). Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    if not SPARE:
        SPARE.append(_started(profile_dir))


def stop_spares() -> None:
    """Stop this process's spare template (at exit: it would import on, then end by itself).
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    while SPARE:
        _reap(SPARE.pop()[1])


def _started(profile_dir):
    cluster_id = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"  # as cluster.start_cluster names one
    return cluster_id, start_template(profile_dir, cluster_id)


def _reap(template):
    template.kill()
    template.wait(timeout=10)
    template.stdout.close()


def forget(cluster_id: str) -> None:
    """Stop the template of a stopped cluster and reap it.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    template = TEMPLATES.pop(cluster_id, None)
    if template is not None:
        _reap(template)


def forked_start(launcher: LocalProcessLauncher) -> bool:
    """Start ``launcher``'s process (``python -m ipyparallel.engine`` or ``.controller``) as
    a fork of its cluster's template, started here if ``start_cluster`` has not; False for
    another command, or a controller while the template still imports (start it plainly).
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    args = list(launcher.args)
    if args[1:2] != ["-m"] or args[2] not in MODULES:
        return False
    template = TEMPLATES.get(launcher.cluster_id)
    if template is None or template.poll() is not None:
        template = TEMPLATES[launcher.cluster_id] = start_template(launcher.profile_dir,
                                                                    launcher.cluster_id)
    if args[2] == "ipyparallel.controller" and not wait_ready(template, wait=False):
        return False  # still importing: a fresh controller starts meanwhile, side by side
    wait_ready(template)
    env = {**os.environ, **launcher.get_env(), SOCKET_ENV: str(template.path)}
    launcher.pid = fork_engine(template.path, args[2], args[3:], env, launcher.work_dir,
                               launcher.output_file)
    launcher.process = psutil.Process(launcher.pid)
    launcher.notify_start(launcher.pid)
    launcher._start_waiting()
    return True


class WarmEngineLauncher(LocalEngineLauncher):
    """ipyparallel's local engine, forked from its cluster's template.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""

    def start(self) -> None:
        if not forked_start(self):
            super().start()


class WarmControllerLauncher(LocalControllerLauncher):
    """ipyparallel's controller, forked from its cluster's template.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""

    entrypoint_name = "course_lib.runtime.warm_start.WarmControllerLauncher"

    def start(self) -> None:
        if not forked_start(self):
            super().start()


class WarmEngineSetLauncher(LocalEngineSetLauncher):
    """A set of :class:`WarmEngineLauncher` engines, with no delay between them.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""

    launcher_class = WarmEngineLauncher
    # how the cluster's file names it: a dotted path the file's next reader can import
    entrypoint_name = "course_lib.runtime.warm_start.WarmEngineSetLauncher"
    delay = Float(0.0, config=True, help="seconds between engines: none, a fork is cheap")


if __name__ == "__main__":
    serve(sys.argv[1])
