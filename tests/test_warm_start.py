"""Engines forked from a warm template: normal engines (process group, signals, a death
noticed and repaired, their own NumPy seeds), found and stopped with their cluster; the plain
start stays one argument or one environment variable away."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from course_lib.runtime import cluster as C
from course_lib.runtime import warm_start
from course_lib.runtime.launch import alive, cluster_processes
from course_lib.testing.warm_start import parent_and_draw


def test_a_warm_cluster_has_normal_engines_and_leaves_nothing_behind():
    c = C.start_cluster(n=3, warm=True)
    try:
        template = warm_start.TEMPLATES[c._ipp.cluster_id]
        parents, draws = zip(*c.run(parent_and_draw), strict=True)
        assert set(parents) == {template.pid}  # forked, not started afresh
        assert len(set(draws)) == 3  # each its own seed, as a fresh process
        assert c.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]  # a working process group
        found = cluster_processes(lambda cluster_id: cluster_id == c._ipp.cluster_id)
        assert set(c.pids) | {template.pid} <= set(found[c._ipp.cluster_id])  # clean finds them
        killed = c.pids[1]
        os.kill(killed, signal.SIGKILL)  # noticed, and the next call restarts it (forked again)
        deadline = time.monotonic() + 30
        while killed in c.pids and time.monotonic() < deadline:
            try:
                assert c.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]
            except C.EngineDied:
                continue
        assert killed not in c.pids
        assert {parent for parent, _ in c.run(parent_and_draw)} == {template.pid}
        procs = [psutil.Process(p) for p in [*c.pids, template.pid]]
    finally:
        c.stop()
    assert not [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert template.returncode is not None  # reaped, no zombie left in this process
    assert not template.path.exists()  # the socket it listened on, removed with its cluster


def test_the_next_cluster_takes_the_spare_template_and_forks_its_controller_too():
    with C.start_cluster(n=1, warm=True):
        spare_id, spare = warm_start.SPARE[0]  # started for the next cluster
    warm_start.wait_ready(spare)
    with C.start_cluster(n=1, warm=True) as c:
        assert c._ipp.cluster_id == spare_id and warm_start.TEMPLATES[spare_id] is spare
        assert psutil.Process(c._ipp.controller.pid).ppid() == spare.pid
        assert {parent for parent, _ in c.run(parent_and_draw)} == {spare.pid}


def test_the_plain_start_is_one_variable_away(monkeypatch):
    monkeypatch.setenv(warm_start.WARM_ENV, "0")
    assert not warm_start.enabled()
    with C.start_cluster(n=2) as c:
        assert c._ipp.cluster_id not in warm_start.TEMPLATES
        parents = [psutil.Process(p) for p, _ in c.run(parent_and_draw)]
        assert all("course_lib.runtime.warm_start" not in " ".join(p.cmdline()) for p in parents)
        assert c.run(C.allreduce_ranks) == [1.0, 1.0]


def test_the_course_workers_fork_from_a_preloaded_server(monkeypatch):
    from course_lib.runtime.launch import worker_context
    from course_lib.testing.warm_start import torch_was_loaded
    ctx = worker_context()
    assert ctx.get_start_method() == "forkserver"
    results = ctx.Queue()
    worker = ctx.Process(target=torch_was_loaded, args=(results,))
    worker.start()
    assert results.get(timeout=60) is True  # imported once, in the server
    worker.join(timeout=30)
    monkeypatch.setenv(warm_start.WARM_ENV, "0")
    assert worker_context().get_start_method() == "spawn"


def test_an_older_template_of_a_kept_cluster_leaves_the_new_ones_socket():
    """A kept cluster has the same id at every start: the template of the kernel that started
    it may still be ending when the next kernel's template starts (engines there found no
    socket to fork from: "0 engines ready in 60 s")."""
    tmp_path = Path(tempfile.mkdtemp(prefix="warm"))  # short: a socket's path has 107 bytes
    profile = tmp_path / "profile_kept"
    code = ("import sys; from course_lib.runtime import warm_start as w; "
            "t = w.start_template(sys.argv[1], 'kept'); w.wait_ready(t); print(t.pid, flush=True);"
            " sys.stdin.readline()")  # then this process ends: its template is orphaned, and ends
    kernel = subprocess.Popen([sys.executable, "-c", code, str(profile)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    old = int(kernel.stdout.readline())
    new = warm_start.start_template(str(profile), "kept")
    try:
        warm_start.wait_ready(new)
        kernel.communicate("\n", timeout=600)
        deadline = time.monotonic() + 120  # a hang guard: it ends within a second when idle
        while alive(old) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(old), "the orphaned template did not end"
        assert new.path.exists(), "the older template removed the new template's socket"
        pid = warm_start.fork_engine(new.path, "nothing.to.start", [], dict(os.environ),
                                     str(tmp_path), str(tmp_path / "child.log"))
        assert pid > 0  # (the child refuses the module and exits)
    finally:
        new.kill()
        new.wait()
        new.stdout.close()
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_template_under_a_deep_home_listens_where_a_socket_fits():
    """A profile whose path leaves no room for a Unix socket's name (107 bytes): the template
    listens in a private folder of the temporary directory instead, forks engines from there,
    and removes its socket when it ends."""
    tmp_path = Path(tempfile.mkdtemp(prefix="warm"))
    profile = tmp_path / ("a-very-deep-home-directory-" * 4) / "profile_deep"
    assert len(os.fsencode(profile)) > warm_start.MAX_SOCKET_PATH - 40
    template = warm_start.start_template(str(profile), "deep")
    try:
        warm_start.wait_ready(template)
        assert template.path.parent == warm_start.fallback_dir()
        assert len(os.fsencode(template.path)) <= warm_start.MAX_SOCKET_PATH
        assert template.path.parent.stat().st_mode & 0o777 == 0o700
        pid = warm_start.fork_engine(template.path, "nothing.to.start", [], dict(os.environ),
                                     str(tmp_path), str(tmp_path / "child.log"))
        assert pid > 0
    finally:
        template.kill()
        template.wait()
        shutil.rmtree(tmp_path, ignore_errors=True)
    short = warm_start.socket_path(str(tmp_path / "p"), "c")
    assert short.parent == tmp_path / "p" / "security"  # where it fits, the profile as before
