"""Launching and cleaning up processes: SLURM job scripts, mpiexec / torchrun launches,
supervised worker processes, the reaping of stray processes, and the command line run from a
notebook (``bench_rows``: a benchmark's rows, with a deadline).

Introduced in notebooks/00_welcome_and_cluster.ipynb (and notebooks/12_scaling_out.ipynb).
``python -m course_lib cluster clean`` calls :func:`clean_clusters` to stop clusters whose
notebook kernel was killed before it could stop them.

One file of plumbing rather than a lesson, in four parts a reader finds by its section lines
(SLURM and clean-up, launchers, worker processes, the command line); the parts share the
process-tree killing that makes "never a process left behind" hold. Its top-level imports are
the standard library's only: the spawned workers of :mod:`course_lib.race` and
:mod:`course_lib.hogwild` and the cluster's watchdog import it, and each would pay for more
(ipyparallel takes a second); the functions that need psutil, ipyparallel or IPython import it.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the annotations only: ipyparallel stays off the module's import
    import threading

    import ipyparallel as ipp

PROFILE = "course_lib"  # a profile of our own, so `cluster clean` never touches other clusters


# batch scripts and logs, one folder per user (see private_dir)
SLURM_FILES = os.path.join(tempfile.gettempdir(), f"course_lib-slurm-{os.getuid()}")


def warm_fallback_dir(create: bool = True) -> Path:
    """Where warm-start templates listen when the profile's path is too long for a Unix
    socket (``course_lib.runtime.warm_start``): ``course_lib-warm-<uid>`` in the temporary
    directory, made this user's alone unless ``create`` is False.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    path = Path(tempfile.gettempdir()) / f"course_lib-warm-{os.getuid()}"
    return private_dir(path) if create else path


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a folder only this user may enter: created with mode 0700, or refused when
    it exists and another user owns it or may enter it (on a shared machine, somebody else
    could have created it first, to read or replace what this user puts there).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not path.is_dir() or path.is_symlink() or info.st_uid != os.getuid() \
            or info.st_mode & 0o077:
        raise PermissionError(
            f"{path} belongs to user {info.st_uid} with mode {oct(info.st_mode & 0o777)}: a "
            f"folder of user {os.getuid()}'s must be theirs alone (mode 0700). Remove it, or "
            "set TMPDIR to a folder of your own")
    return path


# ---------------------------------------------------------------- SLURM, and cleaning up clusters
def slurm_batch_script(n: int, partition: str = "", time_limit: str = "00:30:00",
                       account: str = "", gpus_per_task: int = 0, cpus_per_task: int = 1,
                       extra: Sequence[str] = ()) -> str:
    """The sbatch script that starts ``n`` engines as one job (``srun`` fills in the engine).

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    lines = ["#!/bin/sh", "#SBATCH --job-name=course-engines-{cluster_id}",
             f"#SBATCH --ntasks={n}", f"#SBATCH --cpus-per-task={cpus_per_task}",
             f"#SBATCH --time={time_limit}",
             f"#SBATCH --output={SLURM_FILES}/engines-{{cluster_id}}.log"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    if gpus_per_task:
        lines.append(f"#SBATCH --gpus-per-task={gpus_per_task}")
    lines += [f"#SBATCH {x}" for x in extra]
    # {cluster_id} and {program_and_args} are left for ipyparallel's launcher to fill in
    lines += [f"export OMP_NUM_THREADS={cpus_per_task}", "srun {program_and_args}", ""]
    return "\n".join(lines)


def slurm_config(n: int, partition: str = "", time_limit: str = "00:30:00", account: str = "",
                 gpus_per_task: int = 0, cpus_per_task: int = 1, extra: Sequence[str] = (),
                 controller_ip: str = "*") -> dict:
    """ipyparallel settings for engines="slurm": controller here, engines in one sbatch job.

    The controller listens on ``controller_ip`` ("*" = every interface) because compute nodes
    must reach it; run this on a login node of a cluster you trust.
    Introduced in notebooks/00_welcome_and_cluster.ipynb.
    """
    from traitlets.config import Config  # standard library only at the top (as above)
    config = Config()
    config.SlurmEngineSetLauncher.batch_template = slurm_batch_script(
        n, partition, time_limit, account, gpus_per_task, cpus_per_task, extra)
    private_dir(SLURM_FILES)  # the job's script and log: not in the notebook's folder
    config.SlurmEngineSetLauncher.batch_file_name = os.path.join(
        SLURM_FILES, f"engines-{os.getpid()}-{time.monotonic_ns()}.sbatch")
    return dict(engines="slurm", controller_ip=controller_ip,
                controller_location=socket.gethostname(), config=config)


def _owner(cluster_id):
    return cluster_id.split("-", 1)[0]  # ids are "{owner pid}-{hex}" (see cluster.start_cluster)


def _owner_alive(cluster_id):
    owner = _owner(cluster_id)
    return owner.isdigit() and alive(int(owner))


def process_status(pid: int) -> str | None:
    """psutil's status of ``pid`` on this machine ("running", "sleeping", "stopped",
    "zombie", ...), or None once it is gone.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import psutil  # standard library only at the top (see the module docstring)
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` runs here (a zombie has ended: it only waits for its parent).
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    return process_status(pid) not in (None, "zombie")


def clean_clusters(all: bool = False, shared_by: int | str | None = None) -> list[str]:
    """Stop clusters left behind by a killed notebook kernel (all of ours with ``all=True``,
    the shared ones a test session kept running with ``shared_by=`` its pid; see
    ``cluster.SHARED_ENV``), and remove the rendezvous folders of owners that are gone
    (:func:`clean_stores`).

    Returns the ids of the clusters stopped. ``python -m course_lib cluster clean`` calls this.
    Introduced in notebooks/00_welcome_and_cluster.ipynb.
    """
    import ipyparallel as ipp  # standard library only at the top (see the module docstring)

    def doomed(cluster_id):
        return (all or not _owner_alive(cluster_id)
                or cluster_id.startswith(f"{shared_by}-shared-"))

    # Chosen by file name, and only those loaded: ipyparallel's loaded copy of a cluster
    # watches each of its processes from a thread of this process, logs here what they print
    # when they end ("Engine 2 not running" for one already gone) and rewrites the cluster's
    # file. Another kernel's live cluster is left alone.
    security = security_dir()
    stopped = []
    for file in sorted(security.glob("cluster-*.json")) if security else ():
        cluster_id = file.stem[len("cluster-"):]
        if not doomed(cluster_id):
            continue
        try:
            c = ipp.Cluster.from_file(str(file), log_level=logging.CRITICAL)
        except Exception:  # noqa: BLE001 - unreadable, or removed meanwhile
            file.unlink(missing_ok=True)
        else:
            try:
                stop_and_reap(c)
            except Exception:  # noqa: BLE001 - already half gone: remove what is left
                pass
            c.remove_cluster_file()
        stopped.append(cluster_id)
    # clusters whose file is gone (removed while they ran) are found by their processes
    leftovers = [found for found in _kill_leftovers(doomed) if found not in stopped]
    clean_stores()  # their rendezvous folders, and any other whose owner is gone
    return stopped + leftovers


STORE_PREFIX = "course_lib-pg-"  # a cluster's rendezvous folder: {prefix}{owner pid}-{random}


def clean_stores(tmp: str | os.PathLike | None = None) -> list[str]:
    """Remove the rendezvous folders of clusters (``course_lib-pg-{owner pid}-*`` in ``tmp``,
    default the temporary directory) whose owner is gone: no process of that pid runs as the
    folder's owner. A killed kernel leaves its folder behind; an id recycled since, of a process
    or of a user, inherits nothing. Only this user's folders, or every user's for root (the
    class server cleans them before each user's server starts). A folder without a pid in its
    name (an older course_lib's) goes once its owner runs no process at all.
    Returns the paths removed. Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import psutil  # standard library only at the top (see the module docstring)
    running: dict[int, int] = {}  # pid: real uid
    for proc in psutil.process_iter(["uids"]):
        with contextlib.suppress(TypeError):  # gone meanwhile: no uids
            running[proc.pid] = proc.info["uids"].real
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(STORE_PREFIX + "*"):
        try:
            info = folder.lstat()
        except OSError:
            continue
        if os.getuid() not in (0, info.st_uid):
            continue  # another user's: theirs to clean (and root's)
        pid = folder.name[len(STORE_PREFIX):].split("-", 1)[0]
        if "-" in folder.name[len(STORE_PREFIX):] and pid.isdigit():
            owner_alive = running.get(int(pid)) == info.st_uid
        else:
            owner_alive = info.st_uid in running.values()
        if not owner_alive:
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder, ignore_errors=True)
            else:
                folder.unlink(missing_ok=True)
            removed.append(str(folder))
    return removed


def cluster_processes(select: Callable[[str], bool] = lambda cluster_id: True,
                      ) -> dict[str, list[int]]:
    """{cluster id: pids} of this user's processes of the course's clusters whose id
    ``select`` accepts, found by the ``IPP_CLUSTER_ID`` and ``IPP_PROFILE_DIR`` that
    ipyparallel puts in the environment of every controller and engine it starts (and that
    their children inherit). Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import psutil  # standard library only at the top (see the module docstring)
    found = {}
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():  # code on an engine may clean up too: never itself
            continue
        try:
            if proc.uids().real != os.getuid():  # another user's clusters, even for root
                continue
            env = proc.environ()
        except (psutil.Error, OSError):  # another user's, or gone meanwhile
            continue
        cluster_id = env.get("IPP_CLUSTER_ID", "")
        profile = os.path.basename(env.get("IPP_PROFILE_DIR", "").rstrip("/"))
        if cluster_id and profile == f"profile_{PROFILE}" and select(cluster_id):
            found.setdefault(cluster_id, []).append(proc.pid)
    return found


def _kill_leftovers(select):
    """Kill what is still running of the clusters whose id ``select`` accepts (found by
    :func:`cluster_processes`) and remove the files that their processes, killed, could not
    remove; returns the ids of the clusters found running."""
    found = cluster_processes(select)
    for pids in found.values():
        kill_tree(pids)
    security = security_dir()
    # ipcontroller-{cluster id}-{client|engine}.json, and warm-{cluster id}-{random}.sock where
    # a killed template listened (course_lib.runtime.warm_start; its fallback folder when the
    # profile's path is too long for a socket)
    fallback = warm_fallback_dir(create=False)
    files = [*security.glob("ipcontroller-*.json"), *security.glob("warm-*.sock")] \
        if security else []
    files += list(fallback.glob("warm-*.sock")) if fallback.is_dir() else []
    for file in files:
        if select(file.stem.split("-", 1)[1].rsplit("-", 1)[0]):
            file.unlink(missing_ok=True)
    return list(found)


def start_watchdog(owner: int, cluster_file: str, poll: float = 0.5) -> subprocess.Popen:
    """Start a small process that stops the cluster of ``cluster_file`` once ``owner`` (the
    pid that started it: a notebook kernel, a test session) is gone without stopping it:
    killed, or timed out by nbval. It ends by itself when the cluster stops normally.
    Returns its Popen. Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    code = ("from course_lib.runtime.launch import watch_owner; "
            f"watch_owner({int(owner)}, {str(cluster_file)!r}, {float(poll)})")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # Kernel > Interrupt does not reach it


def watch_owner(owner: int, cluster_file: str, poll: float = 0.5) -> None:
    """The watchdog's loop (see :func:`start_watchdog`). Once the owner is gone it kills the
    processes of the owner's clusters first (found by their cluster ids, which start with the
    owner's pid: its spare warm template too), with psutil alone, imported while waiting; then
    it cleans what else is left (with ipyparallel: seconds of imports on a busy machine).
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import psutil  # noqa: F401 - now, not once the owner is gone
    while os.path.exists(cluster_file):  # removed when the cluster stops normally
        if not alive(owner):
            _kill_leftovers(lambda found: _owner(found) == str(owner))
            clean_clusters()  # the clusters of every owner that is gone, this one among them
            return
        time.sleep(poll)


def _launcher_pids(ipp_cluster):
    """Pids of the controller and engine launchers recorded by ipyparallel."""
    launchers = [ipp_cluster.controller] if ipp_cluster.controller else []
    for engine_set in (ipp_cluster.engines or {}).values():
        launchers.append(engine_set)
        launchers += list(getattr(engine_set, "launchers", {}).values())
    return [p for p in (getattr(x, "pid", None) for x in launchers) if p and p > 0]


def process_tree(pids: Iterable[int]) -> list:
    """psutil processes of ``pids`` and every descendant of each (those already gone left out).
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import psutil  # standard library only at the top (see the module docstring)
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            pass
    return procs


def kill_tree(pids: Iterable[int], timeout: float = 5) -> None:
    """SIGKILL processes and every descendant, then wait for them. The tree is read before the
    first kill: mpiexec's hydra proxy and torchrun's ranks live in sessions of their own, so
    neither a process group nor the parent's death reaches them.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    import psutil  # standard library only at the top (see the module docstring)
    procs = process_tree(pids)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(map(_ended, procs)):
        time.sleep(0.05)
    for proc in procs:  # reap those that are this process's children
        with contextlib.suppress(psutil.Error):
            proc.wait(timeout=0)


def _ended(proc):
    """Gone, or a zombie: dead, waiting for a parent to reap it (an orphan's parent may be an
    init that seldom does)."""
    import psutil
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def stop_and_reap(ipp_cluster: ipp.Cluster, extra_pids: Iterable[int] = ()) -> None:
    """Kill every process of a cluster's tree (engines hold nothing worth a graceful wait),
    then let ipyparallel remove the cluster's files.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    kill_tree({*_launcher_pids(ipp_cluster), *extra_pids}, timeout=10)
    _kill_leftovers(lambda found: found == ipp_cluster.cluster_id)  # what the trees missed
    ipp_cluster.stop_cluster_sync()


def security_dir() -> Path | None:
    """The course profile's security folder (cluster and connection files), or None before
    any cluster started. Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    from IPython.paths import locate_profile  # standard library only at the top (as above)
    try:
        return Path(locate_profile(PROFILE), "security")
    except OSError:  # no profile yet
        return None


# ---------------------------------------------------------------- launchers: mpiexec, torchrun
def launched_rank() -> tuple[int, int] | None:
    """(rank, local rank) of a process started by torchrun or mpiexec, else None.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    env = os.environ
    if "RANK" in env and "MASTER_PORT" in env:  # torchrun
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0))
    for rank, local in [("PMI_RANK", "MPI_LOCALRANKID"),
                        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")]:
        if rank in env:
            return int(env[rank]), int(env.get(local, env[rank]))
    return None


# MPI ranks on one machine talk over shared memory and loopback: without these, MPICH's UCX and
# libfabric transports listen on every network interface
MPI_LOOPBACK = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo"}

MPIEXEC_MISSING = "mpiexec not found: pip install -c constraints.txt -e '.[mpi]'"


def mpiexec_path(required: bool = False, error: type[Exception] = RuntimeError) -> str | None:
    """The ``mpiexec`` of this Python's environment (the mpich wheel's), else PATH's; None when
    there is none, or ``error`` saying how to get one when ``required``.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    for candidate in (Path(sys.executable).parent / "mpiexec", Path(sys.prefix, "bin", "mpiexec")):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("mpiexec")
    if found is None and required:
        raise error(MPIEXEC_MISSING)
    return found


def finish_within(proc: subprocess.Popen, deadline: float) -> tuple[Any, Any, bool]:
    """Wait for ``proc`` (a Popen with pipes) at most ``deadline`` seconds: ``(stdout, stderr,
    timed_out)``. Past the deadline, or on Ctrl-C, its whole process tree is killed (an
    interrupt is then raised again). Introduced in notebooks/02_parallel_computing.ipynb."""
    try:
        return (*proc.communicate(timeout=deadline), False)
    except subprocess.TimeoutExpired:
        kill_tree([proc.pid])
        return (*proc.communicate(), True)
    except BaseException:  # Ctrl-C in the notebook: take the ranks down too
        kill_tree([proc.pid])
        proc.wait()
        raise


def run_ranks(launcher: str, world_size: int, args: Sequence[str], env: dict | None = None,
              timeout: float = 600.0) -> str:
    """Run ``python *args`` as ``world_size`` ranks under "mpiexec" or "torchrun" (loopback
    rendezvous), with a deadline: past it the launcher and every rank are killed. Returns the
    combined output; raises RuntimeError naming the launcher when it fails or runs late.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    if launcher == "mpiexec":
        cmd = [mpiexec_path(required=True), "-n", str(world_size), sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world_size), *args]
    env = dict(os.environ if env is None else env)
    env.setdefault("MPIEXEC_TIMEOUT", str(int(timeout)))  # mpiexec's own deadline as well
    for name, value in MPI_LOOPBACK.items():
        env.setdefault(name, value)
    # torchrun shares its rendezvous store with the ranks; after a restart (--max-restarts) a
    # rank can then read its peer's address of the failed attempt and never connect
    # (pytorch/pytorch#135712): one store per attempt
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    except OSError as e:
        raise RuntimeError(f"cannot start {launcher}: {e}") from None
    # past MPIEXEC_TIMEOUT, so that mpiexec stops its own ranks first; this deadline catches
    # torchrun (which has no such variable) and a launcher that hangs
    output, _, late = finish_within(proc, timeout * 1.1 + 5)
    if late:
        raise RuntimeError(f"{launcher} did not finish within {timeout:g}s; its ranks were "
                           "stopped")
    if proc.returncode:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise RuntimeError(f"{launcher} exited with status {proc.returncode}:\n{tail}")
    return output


# ---------------------------------------------------------------- local worker processes
WORKER_PRELOAD = ["numpy", "torch", "course_lib.hogwild", "course_lib.race"]


def worker_context() -> multiprocessing.context.BaseContext:
    """Where the course's own worker processes come from: multiprocessing's forkserver, a
    process that imports :data:`WORKER_PRELOAD` once and forks each worker from there (no fork
    of this process, which may run threads: Jupyter, PyTorch), so a worker starts without a
    second's imports (the first call waits for the server's); "spawn" (a fresh Python each)
    with ``COURSE_LIB_WARM=0``. Arguments travel pickled either way.
    Introduced in notebooks/02_parallel_computing.ipynb."""
    if os.environ.get("COURSE_LIB_WARM", "1") == "0":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts, once
    # the server imports before its first fork: fork one now, so that no worker's deadline
    # pays for those imports (a second or more, once per process)
    probe = context.Process(target=os.getpid, daemon=True)
    probe.start()
    probe.join(timeout=120)
    return context


def supervise(procs: Sequence[multiprocessing.Process], timeout: float, what: str,
              error: type[Exception] = RuntimeError,
              barrier: threading.Barrier | None = None) -> None:
    """Start worker processes and sleep until all finish, one dies, or ``timeout`` s pass.

    A dead worker or a late one raises ``error`` naming it (worker index, pid, exit code); the
    ``barrier`` the others may wait at is aborted; every process is killed and joined, so none
    is left behind. Used by every module that spawns workers: :mod:`course_lib.race`, which
    introduces it in notebooks/02_parallel_computing.ipynb, and :mod:`course_lib.hogwild`
    (notebook 03)."""
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = [p.sentinel for p in procs if p.is_alive()]
            if not alive or any(p.exitcode not in (None, 0) for p in procs):
                break  # all done, or one died: the others would wait for it in vain
            # sleeps until a worker exits (its sentinel becomes ready), 0.1 s at most, so that
            # the deadline is checked at least ten times a second
            wait(alive, timeout=max(min(0.1, deadline - time.monotonic()), 0.0))
        dead = [f"worker {w} (pid {p.pid}) exited with code {p.exitcode}"
                for w, p in enumerate(procs) if p.exitcode not in (None, 0)]
        late = [w for w, p in enumerate(procs) if p.is_alive()]
        if dead or late:
            if barrier is not None:
                barrier.abort()
            raise error(f"{what}: " + "; ".join(dead + (
                [f"worker(s) {late} of {len(procs)} still running after {timeout:g}s were "
                 "killed"] if late and not dead else [])))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(5)


# ---------------------------------------------------------------- the command line, from a notebook
def run_cli(*args: Any, deadline: float = 600.0, echo: bool = True) -> str:
    """Run ``python -m course_lib *args`` in a subprocess with a deadline; returns its stdout.

    ``echo`` prints the command first (so it can be typed in a terminal) and its run time after.
    A non-zero exit, or a run past ``deadline`` seconds (its whole process tree is then killed:
    mpiexec's and torchrun's ranks too), raises RuntimeError naming the command, with the tail
    of its stderr. Introduced in notebooks/05_allreduce.ipynb."""
    cmd = [sys.executable, "-m", "course_lib", *map(str, args)]
    text = "python -m course_lib " + " ".join(map(str, args))
    if echo:
        print(f"$ {text}")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err, late = finish_within(proc, deadline)
    if late:
        raise RuntimeError(f"`{text}` did not finish within {deadline:g} s and was stopped; "
                           f"the end of its stderr:\n{_tail(err)}")
    if proc.returncode:
        raise RuntimeError(f"`{text}` exited with status {proc.returncode}; the end of its "
                           f"stderr:\n{_tail(err or out)}")
    if echo:
        print(f"finished in {time.perf_counter() - t:.1f} s")
    return out


def bench_args(benchmark: str, **options: Any) -> list[str]:
    """The arguments of ``python -m course_lib bench <benchmark>`` for ``options``.

    Each option becomes a flag: ``world_size=[2, 4]`` -> ``--world-size 2,4``,
    ``no_check=True`` -> ``--no-check``, ``timeout=5`` -> ``--timeout 5``; None and False are
    left out. Introduced in notebooks/05_allreduce.ipynb."""
    args = ["bench", benchmark]
    for name, value in options.items():
        if value is None or value is False:
            continue
        args.append("--" + name.replace("_", "-"))
        if value is not True:
            args.append(",".join(map(str, value)) if isinstance(value, (list, tuple))
                        else str(value))
    return args


def bench_rows(benchmark: str, deadline: float = 600.0, echo: bool = True,
               **options: Any) -> list[dict]:
    """Run ``python -m course_lib bench <benchmark>`` with ``options`` (as :func:`bench_args`
    writes them) and return its rows: through ``--csv`` (a temporary file), as dicts, numbers
    as int or float, empty cells as None. ``deadline`` (seconds, for the whole run), ``echo``
    and errors as :func:`run_cli`. Introduced in notebooks/05_allreduce.ipynb."""
    args = bench_args(benchmark, **options)
    with tempfile.TemporaryDirectory(prefix="course_lib-bench-") as tmp:
        path = os.path.join(tmp, "rows.csv")
        if echo:
            print("$ python -m course_lib " + " ".join(args))
        t = time.perf_counter()
        run_cli(*args, "--csv", path, deadline=deadline, echo=False)
        if echo:
            print(f"finished in {time.perf_counter() - t:.1f} s")
        with open(path, newline="") as f:
            return [{k: _cell(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _cell(text):
    """A CSV cell as int, float, None (empty) or the text itself."""
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _tail(text, lines=15):
    return "\n".join((text or "").strip().splitlines()[-lines:]) or "(empty)"
