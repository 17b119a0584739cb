"""The course's promises, tried one fault at a time: ``python -m course_lib faults``.

Every distributed wait has a deadline; an error names the rank (and the operation and sizes);
no process is left behind; nothing saved is lost; the cluster works for the next call; nothing
listens beyond loopback. Each scenario of :mod:`course_lib.testing.fault_scenarios` makes one
thing go wrong, and this runner checks those promises from outside:

* the time from the fault to the error: past :func:`timing.hang_bound` of the scenario's
  deadline it is a hang, a broken promise; past the deadline + ``GRACE`` seconds it is *late*,
  a figure the table reports beside the machine's load (a busy machine delays an error, it never
  loses one);
* processes left behind: every process started during the scenario carries a mark in its
  environment (``MARK``), so those still alive afterwards are found wherever they were
  re-parented (the cluster's own engines excepted), reported and killed;
* exposure: while the scenario runs, a thread samples the sockets that marked processes (and
  this one) listen on; any address other than loopback fails it.

Scenarios needing a cluster share one of ``CLUSTER_SIZE`` engines (the fresh context of each is
its own temporary folder and mark), and each ends by checking that the cluster still answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.runtime import warm_start
from course_lib.testing.fault_scenarios import SCENARIOS, Broken, Scenario  # noqa: F401
from course_lib.testing.timing import hang_bound

MARK = "COURSE_LIB_FAULT_SCENARIO"
MPICH_LAUNCHERS = ("mpiexec", "mpiexec.hydra", "hydra_pmi_proxy")
GRACE = 3.0  # seconds after its deadline an error counts as late (reported, not failed)
CLUSTER_SIZE = 3  # a server and two workers for the parameter server's scenarios


class Context:
    """What scenarios share: the cluster (started on first use, with short deadlines), and a
    fresh temporary folder per scenario (``tmp``)."""

    def __init__(self):
        self._cluster, self.tmp, self.used_cluster, self.watch = None, None, False, None

    @property
    def cluster(self):
        from course_lib.runtime.cluster import start_cluster
        self.used_cluster = True
        if self._cluster is None or self._cluster.stopped:
            self._cluster = start_cluster(n=CLUSTER_SIZE, timeout=20, pg_timeout=10)
        return self._cluster

    def cluster_pids(self):
        """The cluster's own processes: controller, engines, their warm template and their
        children."""
        import psutil
        if self._cluster is None or self._cluster.stopped:
            return set()
        template = warm_start.TEMPLATES.get(self._cluster._ipp.cluster_id)  # engines' parent
        roots = [*self._cluster.pids, self._cluster._ipp.controller.pid,
                 *([self._cluster.watchdog] if self._cluster.watchdog else []),
                 *([template.pid] if template else []),
                 *(spare.pid for _, spare in warm_start.SPARE)]  # kept for the next start
        pids = set()
        for pid in roots:
            try:
                p = psutil.Process(pid)
                pids |= {p.pid, *(c.pid for c in p.children(recursive=True))}
            except psutil.Error:
                pass
        return pids

    def stop(self):
        if self._cluster is not None:
            self._cluster.stop()


@dataclass
class Row:
    """One scenario's outcome, as the table prints it."""
    name: str
    promise: str
    deadline: float
    seconds: float | None = None
    error: str = ""
    left: list = field(default_factory=list)
    exposed: list = field(default_factory=list)
    known: list = field(default_factory=list)
    usable: bool | None = None
    broken: str = ""

    @property
    def passed(self):
        return not (self.broken or self.left or self.exposed or self.usable is False)

    @property
    def late(self):
        """The error came past the deadline + GRACE: slow (the load), not broken."""
        return self.seconds is not None and self.seconds > self.deadline + GRACE


def _marked(token, environs=None):
    """The live processes marked with ``token``; their environments go into ``environs``."""
    import psutil
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            if env.get(MARK) == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
                if environs is not None:
                    environs[p.pid] = env
        except psutil.Error:
            pass
    return found


class _Watch(threading.Thread):
    """Samples, every 0.1 s, the listening sockets of this process and of marked ones. MPICH
    (5.0) listens on 0.0.0.0 in every rank but 0, and its launcher for a moment at start (the
    port its proxies call back on), whatever its transports are told (``launch.MPI_LOOPBACK``
    moves everything else to loopback): reported apart, not failed."""

    def __init__(self, token):
        super().__init__(daemon=True)
        self.token, self.listeners = token, set()  # (pid, ip, port)
        self.seen = {}  # pid -> (name, environment) at its latest sample
        self.done = threading.Event()
        self.samples = 0  # taken so far: a scenario can wait until one saw what it does

    def wait_samples(self, count=2, timeout=60.0):
        """Wait until ``count`` more samples are taken (a sample can take a second on a busy
        machine: a listener open for less would be missed)."""
        target, deadline = self.samples + count, time.monotonic() + timeout
        while self.samples < target and time.monotonic() < deadline and self.is_alive():
            time.sleep(0.02)

    def run(self):
        import psutil
        self.seen[os.getpid()] = (psutil.Process().name(), dict(os.environ))
        while not self.done.wait(0.1):
            environs = {}
            marked = _marked(self.token, environs)
            for p in marked:  # latest wins: a process sampled between fork and exec is updated
                with contextlib.suppress(psutil.Error):
                    self.seen[p.pid] = (p.name(), environs[p.pid])
            pids = {os.getpid(), *(p.pid for p in marked)}
            try:
                conns = psutil.net_connections("inet")
            except psutil.Error:
                continue
            self.listeners |= {(c.pid, c.laddr.ip, c.laddr.port) for c in conns
                               if c.pid in pids and c.status == psutil.CONN_LISTEN
                               and c.laddr.ip not in ("127.0.0.1", "::1")}
            self.samples += 1

    def judged(self):
        """(exposed, known): each listener named, judged by what its process last showed."""
        exposed, known = [], []
        for pid, ip, port in sorted(self.listeners):
            name, env = self.seen.get(pid, ("gone", {}))
            mpich = ip == "0.0.0.0" and (env.get("PMI_RANK") not in (None, "0")
                                         or name in MPICH_LAUNCHERS)
            (known if mpich else exposed).append(f"pid {pid} ({name}) on {ip}:{port}")
        return exposed, known


def run_one(sc, ctx):
    """Run scenario ``sc`` in ``ctx`` and check the promises around it; returns a :class:`Row`."""
    row = Row(sc.name, sc.promise, sc.deadline)
    token = f"{sc.name}-{uuid.uuid4().hex[:8]}"
    os.environ[MARK] = token
    ctx.tmp, ctx.used_cluster = Path(tempfile.mkdtemp(prefix=f"course-fault-{sc.name}-")), False
    watch = ctx.watch = _Watch(token)
    watch.start()
    try:
        row.seconds, seen = sc.run(ctx)
        row.error = str(seen).strip().splitlines()[0] if str(seen).strip() else ""
        if row.seconds is not None and row.seconds > hang_bound(sc.deadline):
            row.broken = f"the error came after {row.seconds:.1f} s, past " \
                         f"{hang_bound(sc.deadline):g} s for a {sc.deadline:g} s deadline: a hang"
    except Broken as e:
        row.broken = str(e)
    except Exception as e:  # noqa: BLE001 - a scenario that crashes is a broken promise
        row.broken = f"unexpected {type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        if ctx.used_cluster:  # the next call works
            row.usable = _usable(ctx)
        watch.done.set()
        watch.join()
        os.environ.pop(MARK, None)
    row.exposed, row.known = watch.judged()
    row.left = _left_behind(token, ctx, GRACE + hang_bound(sc.settle) if sc.settle else GRACE)
    shutil.rmtree(ctx.tmp, ignore_errors=True)
    return row


def _usable(ctx):
    from course_lib.runtime.engine import allreduce_ranks
    try:
        expected = float(sum(range(CLUSTER_SIZE)))
        return ctx.cluster.run(allreduce_ranks, timeout=30) == [expected] * CLUSTER_SIZE
    except Exception:  # noqa: BLE001 - reported as "not usable"
        traceback.print_exc()
        return False


SERVERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")  # serve till exit


def _still_running(p):
    """Whether a marked process is a leftover: still running (one that ends, or turns zombie,
    between the scan and here is not), and not multiprocessing's resource tracker or fork
    server, which serve this process until it exits."""
    import psutil
    try:
        command = " ".join(p.cmdline())
        return all(server not in command for server in SERVERS)
    except psutil.Error:
        return False


def _left_behind(token, ctx, settle=GRACE):
    """Marked processes still alive ``settle`` s after the scenario (not the cluster's own):
    described, then killed. Returns as soon as none is left."""
    import psutil
    deadline = time.monotonic() + settle
    while True:
        keep = ctx.cluster_pids()
        left = [p for p in _marked(token) if p.pid not in keep and _still_running(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    said = []
    for p in left:
        try:
            said.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            p.kill()
        except psutil.Error:
            pass
    return said


def available(sc):
    """None when scenario ``sc`` can run here, else why not."""
    if sc.needs == "mpi":
        from course_lib.runtime.launch import MPIEXEC_MISSING, mpiexec_path
        return None if mpiexec_path() else MPIEXEC_MISSING
    if sc.needs == "root" and os.geteuid() != 0:
        return "needs root"
    return None


def run_all(names=None, repeat=1, report=print):
    """Run the scenarios ``names`` (all by default) ``repeat`` times each; returns the rows
    (skipped ones have ``broken`` empty and ``error`` starting with "skipped")."""
    unknown = sorted(set(names or ()) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; the scenarios are: "
                         f"{', '.join(SCENARIOS)}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    ctx, rows = Context(), []
    try:
        for sc in [SCENARIOS[n] for n in (names or SCENARIOS)]:
            reason = available(sc)
            for _ in range(repeat):
                row = Row(sc.name, sc.promise, sc.deadline, error=f"skipped: {reason}") \
                    if reason else run_one(sc, ctx)
                rows.append(row)
                report(format_row(row))
    finally:
        ctx.stop()
    return rows


COLUMNS = f"{'scenario':30} {'deadline':>8} {'error in':>8}  {'left':>4} {'exposed':>7}  " \
          f"{'result':6}  error (first line) / promise broken"


def format_row(row):
    """One line of the table."""
    took = "-" if row.seconds is None else f"{row.seconds:.1f}s" + ("*" if row.late else "")
    result = "skip" if row.error.startswith("skipped") else ("pass" if row.passed else "FAIL")
    said = row.broken or row.error
    if row.left:
        said = f"left behind: {row.left[0]} ... " + said
    if row.exposed:
        said = f"listening: {row.exposed[0]} ... " + said
    if row.usable is False:
        said = "the cluster did not answer the next call; " + said
    if row.known and row.passed:
        said += f" (MPICH's own listener on 0.0.0.0 in ranks >= 1: {len(row.known)})"
    return f"{row.name:30} {row.deadline:>7g}s {took:>8}  {len(row.left):>4} " \
           f"{len(row.exposed):>7}  {result:6}  {said[:110]}"


def arguments(parser):
    parser.add_argument("--repeat", type=int, default=1, help="run each scenario K times")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--list", action="store_true", help="list the scenarios and promises")


def main(args):
    if args.list:
        for sc in SCENARIOS.values():
            print(f"{sc.name:30} {sc.deadline:>5g}s  {sc.promise}")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or None
    print(f"load average {_load()} on {os.cpu_count()} cores")
    print(COLUMNS)
    rows = run_all(names, args.repeat)
    failed = [r for r in rows if not r.passed]
    ran = [r for r in rows if not r.error.startswith("skipped")]
    late = [r for r in ran if r.late]
    print(f"\n{len(ran) - len(failed)} of {len(ran)} runs kept every promise"
          + (f"; broken: {', '.join(sorted({r.name for r in failed}))}" if failed else ""))
    print(f"{len(late)} error(s) came past the deadline + {GRACE:g} s (*): "
          f"{', '.join(sorted({r.name for r in late})) or 'none'}; load average {_load()}")
    return 1 if failed else 0


def _load():
    """The load average over 1, 5 and 15 minutes, as uptime prints it."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
