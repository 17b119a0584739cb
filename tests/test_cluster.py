"""The cluster: ranks by position, a working process group, bounded failures, no leftovers."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ipyparallel as ipp
import psutil
import pytest

from course_lib.parallel_gd import check_full_gradient
from course_lib.runtime import cluster as C
from course_lib.runtime.launch import alive, process_tree, slurm_batch_script, slurm_config
from course_lib.testing.timing import assert_no_hang

CLUSTER_SIZE = 3  # the shared cluster of tests/conftest.py
CLUSTER_TIMEOUT = 30


def _cluster_pids(c):
    return [p.pid for p in process_tree(c.pids + [c._ipp.controller.pid])]


def test_ranks_environment_and_threads(cluster):
    infos = cluster.run(C.engine_info)
    assert [i["rank"] for i in infos] == [0, 1, 2]
    assert all(i["world_size"] == 3 and i["threads"] == 1 for i in infos)
    assert [i["env"] for i in infos] == [
        {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r)} for r in range(3)]
    assert len({i["pid"] for i in infos}) == 3


def test_engine_info_returns_after_a_subgroup_was_made_on_its_engines(cluster):
    # subgroups made by a lesson or a check are cached in ENGINE (process groups do not pickle):
    # engine_info, run after them on the same engines, must still return plain data
    from course_lib.testing.comm import make_subgroup
    assert cluster.run(make_subgroup, 2) == [True, True, False]
    infos = cluster.run(C.engine_info)
    assert [i["rank"] for i in infos] == [0, 1, 2]
    assert all("subgroups" not in i for i in infos)


def test_backend_auto_is_gloo_without_gpus(cluster):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    assert cluster.backend == "gloo" and "GPU" in cluster.backend_reason


def test_native_allreduce_and_full_gradient(cluster):
    assert cluster.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]
    error, results = check_full_gradient(cluster, n_samples=1000, n_features=5)
    assert [r["n_local"] for r in results] == [334, 333, 333]
    assert error < 1e-12


def test_remote_error_names_the_rank_and_cluster_recovers(cluster):
    with pytest.raises(C.RemoteError, match=r"rank\(s\) \[1\] of 3") as info:
        cluster.run(C.sleep_on, [1], -1)
    assert list(info.value.errors) == [1] and "ValueError" in info.value.errors[1]
    assert cluster.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]


def test_timeout_interrupts_and_names_the_late_rank(cluster):
    t = time.monotonic()
    with pytest.raises(C.ClusterTimeout, match=r"within 1s on rank\(s\) \[2\] of 3"):
        cluster.run(C.sleep_on, [2], 60, timeout=1)
    assert_no_hang(time.monotonic() - t, 1, timed_out=True, instead=60)
    assert cluster.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]


def test_rank_missing_from_a_collective_times_out_then_cluster_is_usable(cluster):
    t = time.monotonic()
    with pytest.raises(C.ClusterTimeout, match=r"rank\(s\) \[0, 1\] of 3"):
        cluster.run(C.skip_collective, 2, timeout=2)
    assert_no_hang(time.monotonic() - t, 2, timed_out=True)
    assert cluster.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]
    assert [i["rank"] for i in cluster.run(C.engine_info)] == [0, 1, 2]


def test_allow_dead_lets_the_other_ranks_finish(cluster):
    pid = cluster.pids[2]
    results = cluster.run(C.exit_on, 2, 1.0, allow_dead=True)
    assert results[:2] == [0, 1]
    assert isinstance(results[2], C.EngineDied) and f"pid {pid}" in str(results[2])
    assert cluster.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]  # restarted, ranks kept


def test_an_engine_the_controller_dropped_is_dead_not_a_key_error(cluster, monkeypatch):
    """The race of a killed engine: the controller unregisters it before the cluster's own
    look at the process sees it dead. Forced every time here: the look waits until the engine's
    id is gone from the controller. Signalling the peers must skip the dropped id (ipyparallel
    raises KeyError for it), end in EngineDied, and leave the cluster repaired by the next call."""
    dropped = cluster.engine_ids[2]
    looks = cluster._dead_ranks

    def look_after_the_controller_dropped_it():
        dead = looks()
        if dead:
            deadline = time.monotonic() + 30
            while dropped in cluster.client.ids and time.monotonic() < deadline:
                time.sleep(0.05)
            assert dropped not in cluster.client.ids, "the controller never dropped the engine"
        return dead

    monkeypatch.setattr(cluster, "_dead_ranks", look_after_the_controller_dropped_it)
    pid = cluster.pids[2]
    t = time.monotonic()
    with pytest.raises(C.EngineDied, match=rf"rank 2 \(pid {pid}\) died while running exit_on"):
        cluster.run(C.exit_on, 2, 120.0)
    # ranks 0 and 1 were interrupted (a grace of 3 s), not waited for
    assert_no_hang(time.monotonic() - t, 3, instead=120)
    monkeypatch.undo()
    assert cluster.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]  # restarted, ranks kept
    assert cluster.engine_ids[2] != dropped


def test_an_engine_dead_between_calls_is_restarted_by_the_next(cluster):
    """An engine killed while the cluster is idle (and dropped by the controller): the next
    call restarts it instead of naming an id the controller no longer knows."""
    dropped, pid = cluster.engine_ids[1], cluster.pids[1]
    os.kill(pid, 9)
    deadline = time.monotonic() + 30
    while dropped in cluster.client.ids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]
    assert pid not in cluster.pids


def test_every_listener_is_on_loopback(cluster):
    pids = set(_cluster_pids(cluster))
    listening = [c for c in psutil.net_connections("inet")
                 if c.pid in pids and c.status == psutil.CONN_LISTEN]
    assert listening, "expected the controller to listen somewhere"
    assert {c.laddr.ip for c in listening} <= {"127.0.0.1", "::1"}, listening


def test_stop_leaves_no_process_behind(capfd):
    c = C.start_cluster(n=2)
    procs = process_tree(c.pids + [c._ipp.controller.pid])
    assert len(procs) >= 3
    c.stop()
    assert [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    c.stop()  # stopping twice is harmless
    with pytest.raises(C.ClusterError, match="was stopped .*run the set-up cell again"):
        c.run(C.hello)  # one clear line, not a traceback from a closed socket
    out, err = capfd.readouterr()
    assert "Failed to remove" not in out + err and "%|" not in out + err  # no log noise, no bar


def test_cleaning_up_reads_no_live_cluster_of_another_kernel():
    """Every start_cluster (and every watchdog) cleans up the clusters of killed kernels. It
    must not load the live ones through ipyparallel: a loaded copy logged "Engine 2 not
    running" in a kernel that was not the cluster's, rewrote the cluster's file, watched its
    processes from a thread each, and dumped their logs when they ended."""
    c = C.start_cluster(n=2, share=False)
    try:
        os.kill(c.pids[1], 9)  # a live kernel's cluster that lost an engine
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(c.pids[1]).wait(timeout=60)  # a hang guard
        file = Path(c._ipp.cluster_file)
        before = file.read_text()
        script = ("import logging, threading\n"
                  "logging.basicConfig(level=logging.DEBUG)\n"
                  "from course_lib.runtime.launch import clean_clusters\n"
                  "print(clean_clusters(), threading.active_count())\n")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=300)  # a hang guard
        assert out.stdout.split() == ["[]", "1"], out.stdout + out.stderr
        assert "not running" not in out.stderr, out.stderr
        assert file.read_text() == before
    finally:
        c.stop()


@contextlib.contextmanager
def _notebook_session():
    """An nbval session's stand-in, a process of its own (not this pytest worker) whose kernels
    share their clusters (SHARED_ENV): yields its pid and a function that runs a kernel's
    script to its end."""
    owner = subprocess.Popen(["sleep", "300"])
    env = dict(os.environ, **{C.SHARED_ENV: str(owner.pid)})

    def kernel(script):
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=600)
    try:
        yield owner.pid, kernel
    finally:
        owner.kill()
        owner.wait()


def test_a_notebook_session_keeps_its_cluster_for_the_next_kernel(cluster):
    """With SHARED_ENV (set by an nbval session) a second kernel's start_cluster gets the same
    engines, with a fresh process group; the session's clean stops them, nothing is left (even
    once their cluster file is gone), and the session's other clusters ("{pid}-{hex}") live on."""
    script = ("import json\n"
              "from course_lib.runtime.cluster import start_cluster, engine_info, allreduce_ranks\n"
              "c = start_cluster(n=2)\n"
              "print(json.dumps([c.shared, c.run(allreduce_ranks),"
              " [i['pid'] for i in c.run(engine_info)]]))\n"
              "c.stop()\n")
    with _notebook_session() as (owner, kernel):
        runs = [kernel(script) for _ in range(2)]
        from course_lib.runtime.launch import clean_clusters, cluster_processes
        kept = next(found for found in cluster_processes()
                    if found.startswith(f"{owner}-shared-local-2-1-"))
        # a kept cluster whose file went away while it ran is still found, by its processes
        assert len(cluster_processes(lambda found: found == kept).get(kept, [])) >= 3
        os.remove(ipp.Cluster(profile=C.PROFILE, cluster_id=kept).cluster_file)
        stopped = clean_clusters(shared_by=owner)
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first == second and first[:2] == [True, [1.0, 1.0]], (first, second)
    assert stopped == [kept]
    from course_lib.runtime.launch import alive
    assert [p for p in first[2] if alive(p)] == [] and cluster_processes(
        lambda found: found == kept) == {}
    from IPython.paths import locate_profile  # the killed controller's connection files too
    assert not list(Path(locate_profile(C.PROFILE), "security").glob(f"ipcontroller-{kept}-*"))
    assert cluster.run(C.allreduce_ranks) == [3.0, 3.0, 3.0]


def test_a_kept_cluster_busy_with_a_dead_kernels_work_is_not_reused():
    """A kernel that ends with trials still queued on its load-balanced view (notebook 13's
    search, cut short) must not hand them to the next notebook: there they ran between its
    calls, and a collective found rank 0 busy with a trial, "idle (not in a cluster call)",
    until the deadline. The next start_cluster gets idle engines, and its first call does not
    wait for the old work."""
    leave = ("import time\n"
             "from course_lib.runtime.cluster import start_cluster, engine_info\n"
             "c = start_cluster(n=2)\n"
             "print([i['pid'] for i in c.run(engine_info)])\n"
             "trials = [c.balanced_view().apply_async(time.sleep, 120) for _ in range(4)]\n"
             "time.sleep(0.5)\n")  # ends without stop(), as a kernel that was shut down
    # the set-up must not have waited for the old work (it used to: up to SETUP_TIMEOUT for
    # the engines to answer, then a fresh start); its failures are recorded, its wait shortened
    use = ("import course_lib.runtime.cluster as C\n"
           "C.SETUP_TIMEOUT, failed, setup = 5, [], C.Cluster._setup\n"
           "def spy(self):\n"
           "    try:\n"
           "        setup(self)\n"
           "    except BaseException as e:\n"
           "        failed.append(repr(e))\n"
           "        raise\n"
           "C.Cluster._setup = spy\n"
           "c = C.start_cluster(n=2)\n"
           "print([c.run(C.allreduce_ranks, timeout=20), [i['pid'] for i in c.run(C.engine_info)],"
           " failed])\n"
           "c.stop()\n")
    with _notebook_session() as (owner, kernel):
        left, used = kernel(leave), kernel(use)
        from course_lib.runtime.launch import clean_clusters
        clean_clusters(shared_by=owner)
    assert used.returncode == 0, used.stderr[-2000:]
    old_pids = eval(left.stdout.strip().splitlines()[-1])
    sums, pids, failed = eval(used.stdout.strip().splitlines()[-1])
    assert failed == [] and sums == [1.0, 1.0] and not set(pids) & set(old_pids)


@pytest.mark.skipif(shutil.which("mpiexec") is None and
                    not os.path.exists(os.path.join(sys.prefix, "bin", "mpiexec")),
                    reason="no mpiexec (pip install mpi4py mpich)")
def test_mpi_engines_rank_is_mpi_rank():
    with C.start_cluster(n=2, engines="mpi") as c:
        mpi = c.run(C.mpi_hello)
        assert [m["mpi_rank"] for m in mpi] == [0, 1]
        assert [m["sum_of_ranks"] for m in mpi] == [1, 1]
        assert c.run(C.allreduce_ranks) == [1.0, 1.0]


def test_slurm_script_and_config():
    script = slurm_batch_script(8, partition="gpu", time_limit="01:00:00", account="proj",
                                gpus_per_task=1, cpus_per_task=4, extra=["--mem=16G"])
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh"
    for line in ["#SBATCH --ntasks=8", "#SBATCH --partition=gpu", "#SBATCH --account=proj",
                 "#SBATCH --time=01:00:00", "#SBATCH --gpus-per-task=1",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --mem=16G",
                 "export OMP_NUM_THREADS=4", "srun {program_and_args}"]:
        assert line in lines
    assert "partition" not in slurm_batch_script(2)
    cfg = slurm_config(4, partition="cpu")
    assert cfg["engines"] == "slurm" and cfg["controller_ip"] == "*"
    assert "#SBATCH --ntasks=4" in cfg["config"].SlurmEngineSetLauncher.batch_template
    from course_lib.runtime.launch import (
        SLURM_FILES,  # the job's files stay out of the notebook folder
    )
    assert cfg["config"].SlurmEngineSetLauncher.batch_file_name.startswith(SLURM_FILES)
    assert f"--output={SLURM_FILES}/" in cfg["config"].SlurmEngineSetLauncher.batch_template


def test_choose_backend():
    gpu = {"host": "a", "gpus": 2, "nccl": True}
    assert C.choose_backend([gpu, gpu])[0] == "nccl"
    assert C.choose_backend([gpu, gpu, gpu])[0] == "gloo"  # 3 ranks, 2 GPUs on host a
    assert C.choose_backend([gpu, {**gpu, "host": "b", "gpus": 1}])[0] == "nccl"
    assert C.choose_backend([gpu, gpu], "gloo")[0] == "gloo"
    cpu = {"host": "a", "gpus": 0, "nccl": False}
    assert C.choose_backend([cpu, cpu]) == ("gloo", "Gloo: no GPU visible, CPU tensors")
    with pytest.raises(ValueError, match="one GPU per rank"):
        C.choose_backend([cpu], "nccl")
    with pytest.raises(ValueError, match="backend must be"):
        C.choose_backend([cpu], "mpi")


def test_bad_arguments():
    with pytest.raises(ValueError, match="n must be >= 1"):
        C.start_cluster(n=0)
    with pytest.raises(ValueError, match="engines must be"):
        C.start_cluster(n=1, engines="kubernetes")


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_nccl_on_gpus():
    import torch
    n = torch.cuda.device_count()
    with C.start_cluster(n=n) as c:
        assert c.backend == "nccl"
        assert c.run(C.allreduce_ranks) == [float(n * (n - 1) // 2)] * n
        assert [i["device"] for i in c.run(C.engine_info)] == [f"cuda:{r}" for r in range(n)]


def test_the_course_computes_with_one_thread_unless_told_otherwise():
    """Importing course_lib sets one intra-op thread, as on the engines (before or after torch
    is imported); OMP_NUM_THREADS set by the user wins."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    script = "import {}, {}, torch; print(torch.get_num_threads())"
    for order, extra, threads in [(("course_lib", "torch"), {}, "1"),
                                  (("torch", "course_lib"), {}, "1"),
                                  (("course_lib", "torch"), {"OMP_NUM_THREADS": "2"}, "2")]:
        out = subprocess.run([sys.executable, "-c", script.format(*order)],
                             cwd=Path(__file__).resolve().parents[1], env={**env, **extra},
                             capture_output=True, text=True, timeout=600)
        assert out.stdout.strip() == threads, (order, extra, out.stderr[-500:])


def test_engines_that_do_not_come_up_are_named_with_what_they_printed(tmp_path):
    from types import SimpleNamespace
    log = tmp_path / "engine-0.log"
    log.write_text("starting\nConnectionRefusedError: [Errno 111] the template's socket\n")

    def launcher(pid, output_file, running):
        return SimpleNamespace(pid=pid, output_file=str(output_file), running=running)
    ipp_cluster = SimpleNamespace(
        controller=launcher(10, tmp_path / "missing.log", True),
        engines={"set": SimpleNamespace(launchers={"0": launcher(11, log, False)})})
    said = C.start_logs(ipp_cluster)
    assert "controller (pid 10, running): printed nothing" in said
    assert "engine 0 (pid 11, stopped):" in said and "the template's socket" in said


def test_a_kernel_that_ends_without_stop_leaves_no_process_of_its_cluster():
    """A kernel restarted or shut down runs its exit handlers: the cluster (and the spare warm
    template) are gone once the kernel is. (ipyparallel's own exit handler asked them to end,
    and the engines lingered until they missed the controller's heartbeats: 30 s.)"""
    script = ("import json, psutil\n"
              "from course_lib.runtime.cluster import start_cluster\n"
              "c = start_cluster(n=2, share=False)\n"
              "print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)"
              " if p.pid != c.watchdog]), flush=True)\n")  # then ends, as a kernel does
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        pids = json.loads(kernel.stdout.readline())
        kernel.wait(timeout=300)  # a hang guard
    finally:
        kernel.kill()
        kernel.stdout.close()
    assert len(pids) >= 4  # the controller, the template, two engines (and their nannies)
    assert not [p for p in pids if alive(p)]


def flaky_wait(monkeypatch):
    """Client.wait_for_engines failing once, as when the controller misses an engine's
    heartbeat (the engine runs, registered on its side, never counted); the calls made."""
    real, calls = ipp.Client.wait_for_engines, []

    def wait(self, n, *args, **kwargs):
        calls.append(n)
        if len(calls) == 1:
            raise TimeoutError("one engine's heartbeat missed")
        return real(self, n, *args, **kwargs)
    monkeypatch.setattr(ipp.Client, "wait_for_engines", wait)
    return calls


def test_a_start_left_short_by_a_running_engine_starts_again(monkeypatch, capsys):
    calls = flaky_wait(monkeypatch)
    with C.start_cluster(n=2, share=False) as cluster:
        assert len(cluster.engine_ids) == 2 and calls == [2, 2]
    said = capsys.readouterr().out
    assert "2 engines were not ready within" in said and "starting the cluster again" in said


def test_a_start_left_short_by_a_dead_engine_fails_at_once(monkeypatch):
    calls = flaky_wait(monkeypatch)
    monkeypatch.setattr(C, "all_engines_running", lambda ipp_cluster: False)
    with pytest.raises(C.EnginesNotReady, match="2 engines were not ready within"):
        C.start_cluster(n=2, share=False)
    assert calls == [2]
