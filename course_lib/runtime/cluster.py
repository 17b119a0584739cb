"""A local cluster of ipyparallel engines, each one a rank in a torch.distributed process group.

Introduced in notebooks/00_welcome_and_cluster.ipynb. Usage::

    from course_lib.runtime.cluster import start_cluster
    with start_cluster(n=4) as cluster:          # 4 engines, Gloo on CPU, NCCL on GPUs
        print(cluster.run(engine_info))          # one result per rank, in rank order

Every engine gets a rank 0..n-1 by position (engine ids change on restart, ranks do not),
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in its environment, one torch thread, and a process group
with a short timeout. Nothing waits forever: a call past its deadline interrupts the engines and
raises :class:`ClusterTimeout` naming the ranks that did not finish; an engine that dies raises
:class:`EngineDied` naming its rank; either way the next call repairs the cluster first.

One file, longer than a lesson: starting, running, repairing and stopping a cluster share the
state of one :class:`Cluster` (engine ids, pids, what is broken), and splitting it would scatter
that state; what runs on the engines is in :mod:`course_lib.runtime.engine`, the processes' launch
and reaping in :mod:`course_lib.runtime.launch`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp
from IPython.paths import get_ipython_dir
from traitlets.config import Config

from course_lib.runtime import netem, warm_start
from course_lib.runtime.engine import (  # noqa: F401 - re-exported: the rank demos sit beside the cluster
    allreduce_ranks,
    call_and_report,
    choose_backend,
    engine_info,
    exit_on,
    free_port_and_host,
    hello,
    mpi_hello,
    probe_engine,
    setup_engine,
    skip_collective,
    sleep_on,
)
from course_lib.runtime.launch import (
    MPI_LOOPBACK,
    PROFILE,
    clean_clusters,
    mpiexec_path,
    process_status,
    security_dir,
    slurm_config,
    start_watchdog,
    stop_and_reap,
)

SETUP_TIMEOUT = 60  # s: engines report and create their process group within this


class ClusterError(RuntimeError):
    """A cluster call failed; the message names the ranks concerned.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""


class EnginesNotReady(ClusterError):
    """Fewer engines registered than were started, within the deadline; ``all_running``: every
    engine process still runs (the controller missed one's heartbeat), so a new start can
    succeed. Introduced in notebooks/00_welcome_and_cluster.ipynb."""

    def __init__(self, message: str, all_running: bool) -> None:
        super().__init__(message)
        self.all_running = all_running


class ClusterTimeout(ClusterError, TimeoutError):
    """A call did not finish on some ranks before its deadline.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""


class EngineDied(ClusterError):
    """An engine process exited while the cluster was using it.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""


class RemoteError(ClusterError):
    """A function raised on one or more ranks; ``errors`` maps rank to the remote traceback.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


# ---------------------------------------------------------------- the client side
class Cluster:
    """A started cluster: ``run`` a course_lib function on every rank, ``stop`` when done.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""

    def __init__(self, ipp_cluster: ipp.Cluster, client: ipp.Client, n: int, backend: str,
                 timeout: float, pg_timeout: float, threads: int, link: netem.Link | None = None,
                 shared: bool = False) -> None:
        self._ipp, self.client, self.n = ipp_cluster, client, n
        self.shared = shared  # kept running for the next start_cluster (see SHARED_ENV)
        self.link = link  # the emulated network of every rank (course_lib.runtime.netem), or None
        self.requested_backend, self.timeout = backend, timeout
        self.pg_timeout, self.threads = pg_timeout, threads
        self._store_dir = tempfile.mkdtemp(prefix=f"course_lib-pg-{os.getpid()}-")
        self._broken = None  # None, "pg" (re-create the process group) or "engines" (restart)
        self._replaced: set[int] = set()  # ids of engines a restart replaced
        self.watchdog = None  # pid of the process that stops it if its owner dies
        self._setup()
        _STARTED.add(self)

    # -- set-up and repair
    def _setup(self):
        """Order engines into ranks, pick the backend, and create the process group."""
        ids = sorted(set(self.client.ids) - self._replaced)
        ar = self.client[ids].apply_async(probe_engine)
        try:
            probes = ar.get(timeout=SETUP_TIMEOUT)
        except ipp.error.TimeoutError:
            raise ClusterError(f"engines {ids} did not answer within {SETUP_TIMEOUT}s (is the "
                               "controller alive?): start a new cluster") from None
        # rank = MPI rank when engines run under mpiexec (so mpi4py and torch agree), else the
        # engine's position; engine ids are not ranks: a restarted engine gets a new id
        order = sorted(range(len(ids)), key=lambda i: (probes[i]["mpi_rank"] is None,
                                                       probes[i]["mpi_rank"], i))
        self.engine_ids = [ids[i] for i in order]
        self.probes = [probes[i] for i in order]
        self.pids = [p["pid"] for p in self.probes]
        self.backend, self.backend_reason = choose_backend(self.probes, self.requested_backend)
        hosts = [p["host"] for p in self.probes]
        local_ranks = [hosts[:r].count(h) for r, h in enumerate(hosts)]  # earlier ranks on h
        single_host = len(set(hosts)) == 1
        if self.link is not None and (not single_host or self.backend == "nccl"):
            raise ClusterError(f"an emulated link needs every rank on one machine, over gloo "
                               f"(hosts {sorted(set(hosts))}, backend {self.backend}); on a real "
                               "network or GPUs, measure the real thing: start_cluster(link=None)")
        if single_host:  # a file rendezvous: no listening socket at all
            # a fresh file per group: a new group on an old FileStore's file can read the old
            # group's keys (torch's docs warn against reusing one)
            init = f"file://{self._store_dir}/store-{uuid.uuid4().hex}"
        else:
            host, port = self.client[self.engine_ids[0]].apply_sync(free_port_and_host)
            init = f"tcp://{host}:{port}"
        self.view = self.client[self.engine_ids]
        self.view.block = True  # %%px cells wait for and show every rank's output
        calls = [self.client[e].apply_async(setup_engine, r, self.n, local_ranks[r],
                                            self.backend, init, self.pg_timeout, self.threads,
                                            single_host, self.link)
                 for r, e in enumerate(self.engine_ids)]
        for ar in calls:  # init_process_group waits up to pg_timeout for its peers; 10 s spare
            ar.get(timeout=self.pg_timeout + 10)
        if _in_ipython():
            self.view.activate()  # %px / %%px now target the ranks in order
        self._broken = None

    def _repair(self):
        if self._broken == "engines":
            # every engine restarts under a new id; the killed ones may stay registered until
            # the controller notices they are gone, and must not be taken for new ones
            self._replaced |= set(self.engine_ids)
            self._ipp.restart_engines_sync()
            self._wait_for_engines()
        self._setup()

    def _wait_for_engines(self, timeout=60):
        deadline = time.monotonic() + timeout
        while len(set(self.client.ids) - self._replaced) < self.n:
            if time.monotonic() > deadline:
                new = len(set(self.client.ids) - self._replaced)
                raise ClusterError(f"only {new} of {self.n} engines came up within {timeout}s")
            time.sleep(0.1)

    # -- running
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            allow_dead: bool = False, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``allow_dead=True``: an engine that dies does not stop the others; its result is the
        :class:`EngineDied` error (returned, not raised), as an asynchronous job that must
        survive a lost worker wants. Either way the next call restarts the dead engines.
        """
        __tracebackhide__ = True  # a notebook shows the error, not these frames
        if self.stopped:
            raise ClusterError(f"this cluster of {self.n} ranks was stopped (cluster.stop(), or "
                               "the end of its with block): run the set-up cell again to start "
                               "one, cluster = start_cluster(...)")
        if not self._broken:
            self.dead_ranks()  # an engine that died since the last call: restarted first
        if self._broken:
            self._repair()
        ar = self.view.apply_async(call_and_report, fn, args, kwargs)
        try:
            done = self._wait(ar, fn, timeout, allow_dead)
        except KeyboardInterrupt:  # Kernel > Interrupt: stop the engines too, not just the wait
            late = self._pending(ar)
            killed = self._interrupt(ar, late)
            then = (f"rank(s) {killed} did not stop and were killed; the next call restarts "
                    "them") if killed else "the next call re-creates the process group"
            print(f"Interrupted: {getattr(fn, '__qualname__', fn)} was stopped on rank(s) "
                  f"{late} too; {then}.", file=sys.stderr)
            raise KeyboardInterrupt from None
        results = []
        for r in done:
            if isinstance(r, EngineDied):
                results.append(r)
                continue
            result, broken = r
            if broken:  # a deadline passed on that rank, even if fn caught the error
                self._broken = self._broken or "pg"
            results.append(result)
        return results

    def balanced_view(self, ranks: list[int] | None = None) -> ipp.LoadBalancedView:
        """An ipyparallel ``LoadBalancedView`` over ``ranks`` (default: every rank whose engine
        is alive): each task goes to whichever of them is free, results come back in any order.
        Independent tasks (the trials of a search) need no process group.
        Introduced in notebooks/13_hyperparameter_search.ipynb."""
        dead, wanted = self.dead_ranks(), list(range(self.n) if ranks is None else ranks)
        live = [r for r in wanted if r not in dead]
        if not live:
            raise ClusterError(f"no live engine among ranks {wanted} (dead: {dead})")
        return self.client.load_balanced_view([self.engine_ids[r] for r in live])

    def stacks(self, timeout: float = 2.0) -> list[dict]:
        """Every rank's stack and what it waits for, now (:mod:`course_lib.runtime.stacks`; print
        ``stacks.summary(cluster.stacks())``), even while a call hangs. Engines on other hosts
        answer with an error (their sockets are there). Introduced in
        notebooks/17_debugging_clinic.ipynb."""
        from course_lib.runtime import stacks
        here, dead = socket.gethostname(), set(self._dead_ranks())
        local = [r for r in range(self.n) if self.probes[r]["host"] == here and r not in dead]
        snaps = dict(zip(local, stacks.gather([self.pids[r] for r in local], timeout),
                         strict=True))
        silent = [r for r in local if "error" in snaps[r]]
        deadline = time.monotonic() + 1.0  # a process killed a moment ago may still be ending
        while silent and time.monotonic() < deadline:
            gone = set(self._dead_ranks()) & set(silent)
            dead |= gone
            silent = [r for r in silent if r not in gone]
            time.sleep(0.05) if silent else None
        snaps = {r: s for r, s in snaps.items() if r not in dead}
        return [dict(snaps[r], rank=r) if r in snaps else
                {"rank": r, "pid": self.pids[r], "error": "its engine is gone (killed or died; "
                 "the next call starts it again)" if r in dead
                 else f"on another host ({self.probes[r]['host']})"} for r in range(self.n)]

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine process has died (or that the controller has already dropped);
        the next :meth:`run` restarts them.
        Introduced in notebooks/13_hyperparameter_search.ipynb."""
        registered = set(self.client.ids)
        dead = sorted(set(self._dead_ranks())
                      | {r for r, e in enumerate(self.engine_ids) if e not in registered})
        if dead:
            self._broken = "engines"
        return dead

    def _dead_ranks(self):
        return self._ranks_in_state(range(self.n), (None, "zombie"))

    def _ranks_in_state(self, ranks, states):
        """Those of ``ranks`` whose engine runs on this host with a process status in ``states``
        (psutil's names; None: gone). Engines on other hosts are watched by the controller."""
        here = socket.gethostname()
        return [r for r in ranks
                if self.probes[r]["host"] == here and process_status(self.pids[r]) in states]

    def _pending(self, ar):
        return [r for r, m in enumerate(ar.msg_ids) if m in self.client.outstanding]

    def _wait(self, ar, fn, timeout, allow_dead=False):
        __tracebackhide__ = True
        timeout = self.timeout if timeout is None else timeout
        name = getattr(fn, "__qualname__", repr(fn))
        deadline = time.monotonic() + timeout
        dead = []
        while not ar.ready():
            ar.wait(0.05)  # short waits: a dead engine or Ctrl-C is noticed within 50 ms
            dead = self.dead_ranks()  # marks the cluster broken ("engines") when one died
            if dead and allow_dead:
                if set(self._pending(ar)) <= set(dead):  # every live rank has answered
                    return self._results_without(ar, dead, name)
            elif dead:
                self._interrupt(ar, [r for r in self._pending(ar) if r not in dead],
                                engines_dead=True)
                raise self._died(dead, name)
            if time.monotonic() > deadline and not ar.ready():
                late = [r for r in self._pending(ar) if r not in dead]
                where = self._where(late)  # before the interrupt moves them
                killed = self._interrupt(ar, late)
                then = (f"rank(s) {killed} ignored the interrupt (blocked in a native wait, or "
                        "stopped) and were killed; the next call restarts the engines") \
                    if killed else \
                    "they were interrupted; the next call re-creates the process group"
                raise ClusterTimeout(f"{name} did not finish within {timeout:g}s on rank(s) "
                                     f"{late} of {self.n}; {then}.{where}")
        dead = self.dead_ranks()  # died as the call ended (its peers' collectives failed at once)
        if dead:
            if allow_dead:
                return self._results_without(ar, dead, name)
            raise self._died(dead, name)
        try:
            return ar.get()
        except ipp.error.CompositeError as e:
            errors = {self.engine_ids.index(info["engine_id"]): f"{ename}: {evalue}\n{tb or ''}"
                      for ename, evalue, tb, info in e.elist}
        except ipp.error.RemoteError as e:
            errors = {self.engine_ids.index(e.engine_info["engine_id"]): f"{e.ename}: {e.evalue}"
                      f"\n{e.traceback or ''}"}
        errors = {r: re.sub(r"\x1b\[[0-9;]*m", "", text) for r, text in errors.items()}
        self._broken = "pg"  # a collective may have been left half done
        first = min(errors)
        detail = "\n".join(f"--- rank {r}: {text}" for r, text in sorted(errors.items()))
        raise RemoteError(f"{name} raised on rank(s) {sorted(errors)} of {self.n} (first: rank "
                          f"{first}: {errors[first].splitlines()[0]})\n{detail}", errors)

    def _where(self, late):
        """Where the late ranks are, as a paragraph of the timeout's message ("" if the stacks
        could not be had)."""
        from course_lib.runtime import stacks
        try:
            snaps = [s for s in self.stacks(timeout=1.0) if s.get("rank") in late]
        except Exception:  # the message matters more than the stacks
            return ""
        where = "\nWhere they were (course_lib.runtime.stacks):\n"
        return where + stacks.summary(snaps) if snaps else ""

    def _died(self, dead, name):
        pids = ", ".join(f"rank {r} (pid {self.pids[r]})" for r in dead)
        return EngineDied(f"{pids} died while running {name}; the next call restarts the "
                          "engines (their state is lost)")

    def _results_without(self, ar, dead, name):
        """Results in rank order, with an EngineDied error in place of each dead rank's."""
        results, errors = [], {}
        for r, msg_id in enumerate(ar.msg_ids):
            if r in dead:
                results.append(EngineDied(f"rank {r} (pid {self.pids[r]}) died while running "
                                          f"{name}"))
                continue
            try:
                results.append(self.client.get_result(msg_id, block=False).get(timeout=10))
            except ipp.error.RemoteError as e:
                errors[r] = re.sub(r"\x1b\[[0-9;]*m", "", f"{e.ename}: {e.evalue}\n"
                                   f"{e.traceback or ''}")
                results.append(None)
        if errors:
            detail = "\n".join(f"--- rank {r}: {text}" for r, text in sorted(errors.items()))
            raise RemoteError(f"{name} raised on rank(s) {sorted(errors)} of {self.n} (and "
                              f"rank(s) {dead} died)\n{detail}", errors)
        return results

    def _interrupt(self, ar, ranks, engines_dead=False, grace=3.0):
        """SIGINT ``ranks``; kill those still running after ``grace`` s. Returns the killed."""
        # broken before anything that can raise: the next call repairs whatever happens here
        self._broken = "engines" if engines_dead else (self._broken or "pg")
        self._signal(ranks, signal.SIGINT)
        frozen = self._ranks_in_state(ranks, ("stopped", "tracing-stop"))  # alive, no handler runs
        deadline = time.monotonic() + grace
        while set(self._pending(ar)) - set(frozen) and time.monotonic() < deadline:
            ar.wait(0.05)
        stuck = self._pending(ar)
        self._signal(stuck, signal.SIGKILL)  # deaf to SIGINT (blocked in a native wait)
        if stuck:
            self._broken = "engines"  # restarted by the next call
        return stuck

    def _signal(self, ranks, sig):
        """Send ``sig`` to the engines of ``ranks``: straight to a process on this host, through
        the controller to one on another host. An engine the controller has already dropped is
        dead: it is skipped (ipyparallel raises KeyError for an id it no longer knows, and the
        controller may drop one between our look and the send)."""
        remote = [self.engine_ids[r] for r in ranks
                  if not _signal_pid(self.pids[r], sig, self.probes[r]["host"])]
        registered = set(self.client.ids)
        remote = [e for e in remote if e in registered]
        if remote:
            try:
                self.client.send_signal(sig, targets=remote, block=False)
            except (KeyError, ipp.error.NoEnginesRegistered):
                pass

    # -- the end
    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` has run."""
        return self._ipp is None

    def stop(self) -> None:
        """Stop the controller and every engine; returns once no process of it is left.
        (A shared cluster, see :data:`SHARED_ENV`, is left running for the next notebook
        unless a call is still running on it or an engine died; its process group is
        re-created at the next start.)"""
        if self._ipp is None:
            return
        if self.shared and self._broken != "engines" and not self.client.outstanding:
            self.client.close()
            self._ipp = None
            shutil.rmtree(self._store_dir, ignore_errors=True)
            return
        try:
            self.client.close()
        finally:
            stop_and_reap(self._ipp, extra_pids=self.pids)
            warm_start.forget(self._ipp.cluster_id)
            self._ipp = None
            shutil.rmtree(self._store_dir, ignore_errors=True)

    def set_link(self, link: str | netem.Link | None = None,
                 latency: str | float | None = None) -> netem.Link | None:
        """Switch every rank's emulated network (:mod:`course_lib.runtime.netem`) on, e.g.
        ``set_link("1Gbit/s,50us")``, or off with ``set_link(None)``; returns the link."""
        spec = netem.make_link(link, latency)
        if spec is not None and (len({p["host"] for p in self.probes}) > 1
                                 or self.backend == "nccl"):
            raise ClusterError("an emulated link needs every rank on one machine, over gloo")
        self.run(netem.set_link, spec)
        self.link = spec
        return spec

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else self.backend
        link = f", link {self.link}" if self.link and not self.stopped else ""
        return f"<Cluster n={self.n} {state}{link}>"


def _signal_pid(pid, sig, host):
    """Signal a process on this host; False when it lives on another host."""
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    return True


# ---------------------------------------------------------------- starting and cleaning up
# An engine counts as registered at the controller's next heartbeat: with the default 3 s beat
# that is most of a start. Beat every 0.1 s and allow 300 misses (30 s, as the default allows).
CONTROLLER_ARGS = ["--HeartMonitor.period=100", "--HeartMonitor.max_heartmonitor_misses=300",
                   "--IPController.use_threads=True"]


# A test session (CI runs every notebook) sets this to its own pid: clusters are then kept
# running between notebooks, one per (engines, n, threads), instead of each notebook paying the
# seconds of a start (every engine imports PyTorch). A kept cluster gets a fresh process group
# and link at each start_cluster; it is stopped when the session ends, or by the next
# start_cluster or `cluster clean` once that pid is gone. Students never set it.
SHARED_ENV = "COURSE_LIB_SHARED_CLUSTERS"
# The most engines one user may start at once: a class server (hub/) sets it for every student
MAX_ENGINES_ENV = "COURSE_LIB_MAX_ENGINES"


def _reuse(kind, n, *args):
    """A kept cluster of ``kind`` (its id's prefix) with ``n`` live engines as a new Cluster,
    else None; the kept ones of that kind that are not usable are stopped. Each kept cluster
    has an id of its own: one that is stopping (its processes killed, its files removed by
    id) never touches the next one's."""
    security = security_dir()
    files = sorted(security.glob(f"cluster-{kind}-*.json") if security else (),
                   key=os.path.getmtime, reverse=True)
    for file in files:
        cluster = _reuse_one(file.stem[len("cluster-"):], n, *args)
        if cluster is not None:
            return cluster
    return None


def _reuse_one(cluster_id, n, *args):
    try:
        ipp_cluster = ipp.Cluster.from_file(profile=PROFILE, cluster_id=cluster_id,
                                            log_level=logging.CRITICAL)
    except (OSError, ValueError):
        return None
    try:
        client = ipp_cluster.connect_client_sync()
        client.wait_for_engines(n, timeout=5, interactive=False)
        if len(client.ids) != n:
            raise ClusterError(f"{len(client.ids)} engines, not {n}")
        # work a dead kernel left (trials of a load-balanced view, a call it stopped waiting
        # for) would run between this kernel's calls: a collective would find one rank busy
        # with it, "idle (not in a cluster call)", until its deadline. Reuse idle engines only.
        busy = {e: s for e, s in client.queue_status().items()
                if e == "unassigned" and s or isinstance(s, dict) and (s["queue"] or s["tasks"])}
        if busy:
            raise ClusterError(f"engines busy with an earlier kernel's work: {busy}")
        return Cluster(ipp_cluster, client, n, *args, shared=True)
    except Exception:  # noqa: BLE001 - dead or half gone: start afresh
        stop_and_reap(ipp_cluster)
        ipp_cluster.remove_cluster_file()
        return None


def start_cluster(n: int = 4, backend: str = "auto", engines: str = "local", timeout: float = 60,
                  pg_timeout: float = 30, threads: int = 1, link: str | netem.Link | None = None,
                  latency: str | float | None = None, warm: bool | None = None,
                  share: bool = True, **slurm: Any) -> Cluster:
    """Start ``n`` engines and return a :class:`Cluster` whose ranks share a process group.

    engines: "local" (processes on this machine), "mpi" (under ``mpiexec``, so mpi4py works on
    them and rank == MPI rank) or "slurm" (an sbatch job; see :func:`slurm_config`).
    timeout: default deadline of ``Cluster.run`` in seconds; pg_timeout: the process group's.
    link, latency: an emulated network for every rank's messages (:mod:`course_lib.runtime.netem`),
    e.g. ``link="1Gbit/s", latency="50us"``, ``link="1Gbit/s,50us"`` or ``link="10GbE"``.
    warm: local engines forked from a template that has imported PyTorch
    (:mod:`course_lib.runtime.warm_start`; default: yes, unless ``COURSE_LIB_WARM=0``); False starts
    each engine as a fresh Python. share=False: engines of its own even where a test run
    shares clusters between notebooks (``SHARED_ENV``), for a notebook that kills engines on
    purpose. If an engine runs but never registers (its heartbeat missed by the controller,
    a rare race of ipyparallel's start), the cluster is started once more, saying so.
    Introduced in notebooks/00_welcome_and_cluster.ipynb.
    """
    args = (n, backend, engines, timeout, pg_timeout, threads, link, latency, warm, share)
    try:
        return _start_cluster(*args, **slurm)
    except EnginesNotReady as short:
        if not short.all_running:  # an engine died: starting again would fail the same way
            raise
        print(f"{str(short).split(';')[0]}, every engine running: starting the cluster again")
        return _start_cluster(*args, **slurm)


def _start_cluster(n, backend, engines, timeout, pg_timeout, threads, link, latency, warm,
                   share, **slurm):
    """:func:`start_cluster`, once."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    most = os.environ.get(MAX_ENGINES_ENV, "")
    if most.isdigit() and n > int(most):  # set by a class server for every student
        raise ValueError(f"{n} engines is more than each user of this machine may start "
                         f"({MAX_ENGINES_ENV}={most}): start_cluster(n={most}) or fewer")
    link = netem.make_link(link, latency)  # bad text fails here, before any engine starts
    if engines not in ("local", "mpi", "slurm"):
        raise ValueError(f"engines must be 'local', 'mpi' or 'slurm', not {engines!r}")
    clean_clusters()  # clusters whose notebook kernel was killed
    owner = os.environ.get(SHARED_ENV, "")
    shared = share and owner.isdigit() and engines in ("local", "mpi")
    kind = f"{owner}-shared-{engines}-{n}-{threads}"  # what a kept cluster's id starts with
    cluster_id = f"{kind if shared else os.getpid()}-{uuid.uuid4().hex[:6]}"
    if shared:
        cluster = _reuse(kind, n, backend, timeout, pg_timeout, threads, link)
        if cluster is not None:
            return cluster
    warm = warm_start.enabled() if warm is None else warm
    warm = warm and engines == "local" and threads == 1  # BLAS pools of 1 thread in the template
    if warm:  # its imports run while the controller starts (or ran since the last start)
        profile_dir = os.path.join(get_ipython_dir(), f"profile_{PROFILE}")
        if shared:
            template = warm_start.start_template(profile_dir, cluster_id)
        else:
            cluster_id, template = warm_start.template_for_next(profile_dir)
        warm_start.TEMPLATES[cluster_id] = template
    config = Config()
    kwargs = dict(n=n, profile=PROFILE, log_level=40, config=config, cluster_id=cluster_id,
                  controller_args=CONTROLLER_ARGS, shutdown_atexit=False)  # _stop_at_exit
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if engines == "local":
        kwargs.update(engines=warm_start.WarmEngineSetLauncher if warm else "local",
                      controller_ip="127.0.0.1")
        if warm:
            kwargs["controller"] = warm_start.WarmControllerLauncher
        config.LocalEngineSetLauncher.environment = env
    elif engines == "mpi":
        mpiexec = mpiexec_path(required=True, error=ClusterError)
        kwargs.update(engines="mpi", controller_ip="127.0.0.1")
        config.MPIEngineSetLauncher.mpi_cmd = [mpiexec]
        config.MPIEngineSetLauncher.environment = {**MPI_LOOPBACK, **env}
    elif engines == "slurm":
        kwargs.update(slurm_config(n, **slurm))
        kwargs["config"].SlurmEngineSetLauncher.environment = env
    ipp_cluster = ipp.Cluster(**kwargs)
    ipp_cluster.log.addFilter(_quiet)
    try:
        ipp_cluster.start_cluster_sync(n=n)
        client = ipp_cluster.connect_client_sync()  # no progress bar: the start takes seconds
        try:
            client.wait_for_engines(n, timeout=ipp_cluster.engine_timeout, interactive=False)
        except TimeoutError:
            raise EnginesNotReady(f"{n} engines were not ready within "
                                  f"{ipp_cluster.engine_timeout:g} s ({len(client.ids)} ready); "
                                  f"{start_logs(ipp_cluster)}",
                                  all_running=all_engines_running(ipp_cluster)) from None
        cluster = Cluster(ipp_cluster, client, n, backend, timeout, pg_timeout, threads, link,
                          shared=shared)
    except BaseException:
        stop_and_reap(ipp_cluster)
        warm_start.forget(cluster_id)
        raise
    # if this kernel dies without stopping the cluster, a watchdog stops it (a shared one is
    # watched on behalf of the test session that owns it, not of this notebook's kernel)
    cluster.watchdog = start_watchdog(int(owner) if shared else os.getpid(),
                                      ipp_cluster.cluster_file).pid
    if warm and not shared:  # the next start_cluster of this kernel finds its imports done
        warm_start.keep_spare(profile_dir)
    return cluster


def all_engines_running(ipp_cluster) -> bool:
    """Whether every engine process of ``ipp_cluster`` is still running.
    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    launchers = [launcher for engine_set in (ipp_cluster.engines or {}).values()
                 for launcher in getattr(engine_set, "launchers", {}).values()]
    return bool(launchers) and all(launcher.running for launcher in launchers)


def start_logs(ipp_cluster, lines=6):
    """The end of what each launched process of ``ipp_cluster`` printed (for a cluster whose
    engines did not come up). Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    said = []
    launchers = [("controller", ipp_cluster.controller)] + [
        (f"engine {i}", launcher) for engine_set in (ipp_cluster.engines or {}).values()
        for i, launcher in enumerate(getattr(engine_set, "launchers", {}).values())]
    for name, launcher in launchers:
        try:
            with open(launcher.output_file) as f:
                tail = [x for x in f.read().splitlines() if x.strip()][-lines:]
        except (AttributeError, OSError):
            tail = []
        state = "running" if launcher is not None and launcher.running else "stopped"
        said.append(f"{name} (pid {getattr(launcher, 'pid', '?')}, {state}): " +
                    ("\n    ".join(["", *tail]) if tail else "printed nothing"))
    return "what each process printed:\n" + "\n".join(said)


_STARTED: weakref.WeakSet[Cluster] = weakref.WeakSet()  # stopped when this process exits


@atexit.register
def _stop_at_exit():
    """A kernel that ends (a restart, a shutdown, the end of a notebook under nbval) stops its
    clusters as :meth:`Cluster.stop` does: every process killed, before the kernel is gone.
    (ipyparallel's own stop at exit asks them to end, and an engine that did not ended only
    when it missed its controller's heartbeats, 30 s later.) Its spare template goes too."""
    for cluster in list(_STARTED):
        with contextlib.suppress(Exception):  # at exit: stop what can be stopped
            cluster.stop()
    warm_start.stop_spares()


def _quiet(record):
    """Drop ipyparallel's log line about a log file already removed (two removers race on
    stop): harmless, and it reads as an error to a newcomer."""
    return not str(record.msg).startswith("Failed to remove")


def _in_ipython():
    try:  # guarded: this check must answer False, never fail, wherever IPython is missing
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None
