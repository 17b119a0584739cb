"""The scenarios of ``python -m course_lib faults`` (:mod:`course_lib.testing.fault_suite`):
one fault each, in the order of the course, registered with ``@scenario`` (the registry and its
small checks are at the top). Each returns ``(seconds from the fault to the error, or None, what
was seen)`` and raises :class:`Broken` when a promise does not hold; the runner adds the checks
every scenario shares (deadline, processes left, exposure, the next call).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from course_lib.runtime import launch
from course_lib.testing.timing import hang_bound

SHORT = 2.0  # the deadline of the scenarios' distributed waits, in seconds


# ---------------------------------------------------------------- the registry
class Broken(AssertionError):
    """A promise a scenario found broken; the message says which."""


@dataclass
class Scenario:
    """One fault: its ``name``, the ``promise`` it tries, the ``deadline`` (s) the error must
    arrive within, the function that makes it happen (``run(context)`` returns ``(seconds to
    the error or None, what was seen)`` and raises :class:`Broken`), what it ``needs``
    ("mpi", "root") to run at all, and ``settle``: the seconds a process of its own (a
    watchdog) may take, after it returns, to clean up (a busy machine may take
    :func:`timing.hang_bound` of them; an idle one rarely needs any)."""
    name: str
    promise: str
    deadline: float
    run: object
    needs: str = ""
    settle: float = 0.0


SCENARIOS: dict[str, Scenario] = {}


def scenario(name, promise, deadline, needs="", settle=0.0):
    """Register the decorated function as the scenario ``name``."""
    def register(fn):
        SCENARIOS[name] = Scenario(name, promise, deadline, fn, needs, settle)
        return fn
    return register


def expect_error(fn, *args, error=Exception, names=(), **kwargs):
    """Call ``fn``; it must raise ``error`` whose text contains every string of ``names``.
    Returns ``(seconds until it raised, its text)``; raises :class:`Broken` otherwise."""
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except error as e:
        seconds, text = time.monotonic() - start, f"{type(e).__name__}: {e}"
    else:
        raise Broken(f"{getattr(fn, '__name__', fn)} raised nothing")
    missing = [n for n in names if n not in text]
    if missing:
        raise Broken(f"the error does not name {missing}: {text[:300]}")
    return seconds, text


def check(condition, message):
    """Raise :class:`Broken` with ``message`` unless ``condition``."""
    if not condition:
        raise Broken(message)


# ---------------------------------------------------------------- on the ranks
def mixed_collectives(timeout=SHORT):
    """Rank 0 calls allreduce, the others all-gather: each must fail within ``timeout``."""
    from course_lib import collectives
    from course_lib.comm import get_comm
    comm = get_comm("torch", timeout=timeout)
    buf = np.ones(999, np.float32)
    if comm.rank == 0:
        collectives.allreduce(buf, comm, algorithm="ring")
    else:
        collectives.ring_allgather(buf, comm)


def send_cycle(n_bytes, timeout=SHORT):
    """Every rank sends ``n_bytes`` to the next with a blocking send, then receives: the
    cycle of MPI's eager-limit lesson, over Gloo."""
    from course_lib.comm import get_comm
    comm = get_comm("torch", timeout=timeout)
    buf = np.ones(n_bytes // 4, np.float32)
    comm.send(buf, (comm.rank + 1) % comm.world_size)
    comm.recv(buf, (comm.rank - 1) % comm.world_size)


def stop_self_on(rank, seconds=30.0):
    """Rank ``rank`` stops itself (SIGSTOP: alive, silent); the others sleep ``seconds``."""
    import torch.distributed as dist
    if dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(seconds)


# ---------------------------------------------------------------- 1-2: collectives
@scenario("collective-mismatch", "a length, dtype or op that differs across ranks is named on "
          "every rank, nobody dies", SHORT)
def collective_mismatch(ctx):
    from course_lib.runtime.cluster import RemoteError
    from course_lib.testing.collectives import mismatched_allreduce
    cluster, worst, said = ctx.cluster, 0.0, ""
    pids = list(cluster.pids)
    for algorithm, odd, words in [("ring", {"odd_n": 999}, "rank 1: (999,) float32"),
                                  ("tree", {"odd_dtype": "float64"}, "rank 1: (1000,) float64"),
                                  ("naive", {"odd_op": "max"}, "op='max'")]:
        seconds, said = expect_error(cluster.run, mismatched_allreduce, algorithm, **odd,
                                     timeout=30, error=RemoteError, names=[words])
        check(len(said.split("ValueError")) > cluster.n, f"not every rank raised: {said[:200]}")
        worst = max(worst, seconds)
    check(cluster.pids == pids, "a rank died")
    return worst, said.split("\n")[0]


@scenario("ddp-different-model", "DDP refuses ranks whose models differ before any gradient "
          "moves, listing both layouts", SHORT)
def ddp_different_model(ctx):
    from course_lib.runtime.cluster import RemoteError
    from course_lib.testing.ddp import mismatched_models
    return expect_error(ctx.cluster.run, mismatched_models, "wrapper", timeout=30,
                        error=RemoteError, names=["disagree on the tensors to broadcast",
                                                  "rank 0: ", "rank 1: "])


@scenario("rank-never-calls", "a rank that never joins a collective is named by the others "
          "within the deadline", SHORT)
def rank_never_calls(ctx):
    from course_lib.runtime.cluster import RemoteError
    from course_lib.testing.collectives import allreduce_without
    return expect_error(ctx.cluster.run, allreduce_without, 1, "ring", timeout=30,
                        error=RemoteError, names=["CommTimeout", "from rank 1",
                                                  "did not complete within"])


@scenario("rank-calls-another", "ranks calling different collectives fail within the "
          "deadline, naming the operation", SHORT)
def rank_calls_another(ctx):
    from course_lib.runtime.cluster import RemoteError
    return expect_error(ctx.cluster.run, mixed_collectives, timeout=30, error=RemoteError,
                        names=["rank 0", "rank 1"])


# ---------------------------------------------------------------- 3-4: point to point
def _mismatch_seen(report):
    """Rank 1's report: the 5-float message into 4 is an error naming both ranks and sizes, and
    the 4-float one after it still arrives (nothing was left in the pipe)."""
    said = next((r for r in report if isinstance(r, str)), "")
    check(all(w in said for w in ("rank 1: recv from rank 0", "rank 0 sent 20 bytes",
                                  "holds 16 bytes")), f"no size error naming both: {report}")
    check([3.0] * 4 in report, f"the matching message after it did not arrive: {report}")
    return said


@scenario("p2p-size-mismatch-gloo", "a message that does not fit its buffer is an error on "
          "the receiver naming both ranks and sizes; nobody dies", SHORT)
def p2p_size_mismatch_gloo(ctx):
    from course_lib.testing.comm import p2p_size_mismatch
    cluster = ctx.cluster
    start = time.monotonic()
    reports = cluster.run(p2p_size_mismatch, "torch", timeout=SHORT)
    return time.monotonic() - start, _mismatch_seen(reports[1])


@scenario("p2p-size-mismatch-mpi", "the same under mpiexec, over MPI", SHORT, needs="mpi")
def p2p_size_mismatch_mpi(ctx):
    script = ("import json; from course_lib.testing.comm import p2p_size_mismatch\n"
              "r = p2p_size_mismatch('mpi', timeout=2.0)\n"
              "print('REPORT', json.dumps(r)) if isinstance(r, list) else None\n")
    start = time.monotonic()
    out = launch.run_ranks("mpiexec", 2, ["-c", script], timeout=60)
    line = next(x for x in out.splitlines() if x.startswith("REPORT"))
    return time.monotonic() - start, _mismatch_seen(json.loads(line[7:]))


@scenario("send-cycle-mpi", "blocking sends in a cycle above MPI's eager limit deadlock; the "
          "deadline names the send, its peer and size, and kills every rank", 1.0, needs="mpi")
def send_cycle_mpi(ctx):
    from course_lib.send_cycle import run_cycle
    start = time.monotonic()
    results = run_cycle([1024, 1 << 20], "send", world_size=2, deadline=1.0)
    check([r.status for r in results] == ["completed", "deadlocked"],
          f"expected 1 KiB to complete and 1 MiB to deadlock: {[r.status for r in results]}")
    check("send to rank" in results[1].detail and "1048576 bytes" in results[1].detail,
          f"the report does not name the send and size: {results[1].detail}")
    return results[1].seconds, results[1].detail or f"{time.monotonic() - start:.1f}s"


@scenario("send-cycle-gloo", "the same cycle over Gloo ends at the deadline, naming rank, "
          "operation, peer and size", SHORT)
def send_cycle_gloo(ctx):
    from course_lib.runtime.cluster import RemoteError
    return expect_error(ctx.cluster.run, send_cycle, 4 << 20, timeout=30, error=RemoteError,
                        names=["CommTimeout", "send", "rank 0"])


# ---------------------------------------------------------------- 5-7: engines, kernels
@scenario("engine-killed", "an engine SIGKILLed mid-call is named with its pid within "
          "seconds; the next call restarts it", 5.0)
def engine_killed(ctx):
    from course_lib.runtime.cluster import EngineDied
    from course_lib.runtime.engine import exit_on
    pid = ctx.cluster.pids[1]
    return expect_error(ctx.cluster.run, exit_on, 1, error=EngineDied,
                        names=[f"rank 1 (pid {pid}) died"])


@scenario("engine-stopped", "an engine SIGSTOPped mid-call (alive, silent) is named at the "
          "call's deadline; the next call replaces it", 3.0)
def engine_stopped(ctx):
    from course_lib.runtime.cluster import ClusterTimeout
    return expect_error(ctx.cluster.run, stop_self_on, 1, timeout=3, error=ClusterTimeout,
                        names=["rank(s) [", "1"])


def _interrupt(ctx, fn, *args):
    """Kernel > Interrupt: SIGINT to this process 1 s into ``cluster.run(fn, *args)``."""
    from course_lib.runtime.engine import allreduce_ranks
    cluster = ctx.cluster
    cluster.run(allreduce_ranks)  # started and healthy before the clock starts
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    start, said = time.monotonic(), io.StringIO()
    try:
        timer.start()
        with contextlib.redirect_stderr(said):
            cluster.run(fn, *args, timeout=60)
        raise Broken("the call finished: the interrupt did not stop it")
    except KeyboardInterrupt:
        stopped = time.monotonic() - start - 1.0
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)
    lines = said.getvalue().strip().splitlines()
    check(len(lines) == 1 and lines[0].startswith(f"Interrupted: {fn.__name__} was stopped on "
                                                  "rank(s)"), f"the notebook was told {lines}")
    start = time.monotonic()
    cluster.run(allreduce_ranks, timeout=30)
    again = time.monotonic() - start
    check(again < 20, f"the next call took {again:.0f} s")
    return stopped, f"KeyboardInterrupt after {stopped:.1f} s; the next call took {again:.1f} s"


@scenario("interrupt-python-call", "Kernel > Interrupt during a Python call stops the engines "
          "too; the next call works within seconds", 5.0)
def interrupt_python_call(ctx):
    from course_lib.runtime.engine import sleep_on
    return _interrupt(ctx, sleep_on, list(range(ctx.cluster.n)), 40)


@scenario("interrupt-native-collective", "Kernel > Interrupt while ranks wait inside Gloo's "
          "allreduce; the next call works within seconds", 5.0)
def interrupt_native_collective(ctx):
    from course_lib.runtime.engine import skip_collective
    return _interrupt(ctx, skip_collective, ctx.cluster.n - 1)


def _killed_kernel(kill_watchdog):
    """A process that starts a cluster and is SIGKILLed (with its watchdog, if asked), as a
    notebook kernel killed by the OS or by nbval; returns its cluster's pids."""
    script = ("import os, signal, json, psutil\n"
              "from course_lib.runtime.cluster import start_cluster\n"
              "c = start_cluster(n=2)\n"
              "print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)"
              " if p.pid != c.watchdog]), flush=True)\n"
              f"os.kill(c.watchdog, signal.SIGKILL) if {kill_watchdog} else None\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    # its line is read, then the process itself waited for: not the end of its output, which
    # the cluster's processes hold open (what they inherited) until the watchdog stops them
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        line = _line_within(kernel.stdout, 120)
        kernel.wait(timeout=120)
    finally:
        kernel.kill()
        kernel.stdout.close()
    return json.loads(line)


def _line_within(stream, seconds):
    """The next line of ``stream``, or Broken after ``seconds``."""
    if not select.select([stream], [], [], seconds)[0]:
        raise Broken(f"no line within {seconds:g} s")
    return stream.readline()


def _alive(pids):
    return [p for p in pids if launch.alive(p)]


@scenario("kernel-killed", "a notebook kernel killed with a cluster running: its watchdog "
          "stops the cluster within seconds", 5.0)
def kernel_killed(ctx):
    pids = _killed_kernel(kill_watchdog=False)
    start, bound = time.monotonic(), hang_bound(5.0)
    while _alive(pids) and time.monotonic() - start < bound:
        time.sleep(0.1)
    seconds = time.monotonic() - start
    check(not _alive(pids), f"{_alive(pids)} still running {bound:g} s after the kernel died")
    return seconds, f"the watchdog stopped {len(pids)} processes {seconds:.1f} s after the kill"


@scenario("kernel-and-watchdog-killed", "if the watchdog died too, `python -m course_lib "
          "cluster clean` (and the next start_cluster) stops the orphans", 30.0)
def kernel_and_watchdog_killed(ctx):
    pids = _killed_kernel(kill_watchdog=True)
    check(_alive(pids), "the killed kernel left no engines to clean")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "course_lib", "cluster", "clean"],
                          capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    # (another cleaner running at the same time may have stopped it first)
    check(done.stdout.startswith("stopped") and not _alive(pids),
          f"{_alive(pids)} still running after: {done.stdout}{done.stderr}")
    return seconds, done.stdout.strip()


NOTEBOOK = {"cells": [
    {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source":
     "from course_lib import start_cluster\nfrom course_lib.runtime.engine import sleep_on\n"
     "cluster = start_cluster(n=2)"},
    {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
     "source": "cluster.run(sleep_on, [0, 1], 120, timeout=300)"}],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}


# the dead kernel's watchdog polls every 0.5 s, then imports ipyparallel and stops the cluster
# (up to 10 s for its processes to end): seconds on a busy machine after pytest has returned
@scenario("nbval-cell-timeout", "nbval's cell timeout firing while a cluster runs leaves no "
          "process behind", 15.0, settle=12.0)
def nbval_cell_timeout(ctx):
    path = ctx.tmp / "hangs.ipynb"
    path.write_text(json.dumps(NOTEBOOK))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=15",
                           str(path)], capture_output=True, text=True, timeout=180,
                          cwd=ctx.tmp)
    seconds = time.monotonic() - start
    check(done.returncode != 0 and "Timeout" in done.stdout, done.stdout[-800:])
    line = next((x for x in done.stdout.splitlines() if "1 failed" in x), "")
    return None, f"nbval stopped the cell ({line.strip()}, {seconds:.0f} s in all)"


# ---------------------------------------------------------------- 8-9: PS, Hogwild, pipeline
def _linear():
    from course_lib import data
    from course_lib.models import LinearRegression
    X, y, _ = data.make_linear(n_samples=300, n_features=5, noise=0.3, seed=0)
    return LinearRegression(), X, y, np.zeros(X.shape[1])


def _ps_train(ctx, **kwargs):
    from course_lib import ps
    problem, X, y, theta0 = _linear()
    spec = ps.make_spec(1, 2, world_size=3)
    return ps.train(ctx.cluster, spec, problem, X, y, theta0, lr=0.05, batch_size=30,
                    **{"num_epochs": 2, **kwargs})


@scenario("ps-sync-worker-killed", "a worker killed under the synchronous parameter server is "
          "named within the deadline", SHORT)
def ps_sync_worker_killed(ctx):
    from course_lib.runtime.cluster import EngineDied, RemoteError
    return expect_error(_ps_train, ctx, mode="sync", faults=["ps-worker-step:kill@4:rank=2"],
                        timeout=SHORT, error=(RemoteError, EngineDied), names=["rank"])


@scenario("ps-async-worker-killed", "under the asynchronous parameter server the others "
          "finish and the lost worker is reported", SHORT)
def ps_async_worker_killed(ctx):
    start = time.monotonic()
    result = _ps_train(ctx, mode="async", faults=["ps-worker-step:kill@4:rank=2"],
                       timeout=SHORT, num_epochs=3)
    check(result.lost_workers == [2], f"lost workers {result.lost_workers}, expected [2]")
    return None, f"lost workers {result.lost_workers}, finished in " \
                 f"{time.monotonic() - start:.1f} s"


@scenario("ps-server-killed", "a killed server is named by the workers within their reply "
          "deadline (2 x timeout + 5 s: longer than the server's own step deadline, so that in "
          "sync mode the server names a missing worker first)", 2 * 1 + 5)
def ps_server_killed(ctx):
    from course_lib.checkpoint import Store
    from course_lib.runtime.cluster import RemoteError
    _, said = expect_error(_ps_train, ctx, mode="async", checkpoints=Store(ctx.tmp),
                           faults=["ps-server-update:kill@10"], timeout=1, error=RemoteError,
                           names=["[0] died", "to server 0"])
    fired = (ctx.tmp / ".fault-0").stat().st_mtime  # the fault's once-file: when it fired
    return time.time() - fired, said


@scenario("hogwild-worker-crash", "a Hogwild worker that crashes is named within seconds and "
          "reaped", 5.0)
def hogwild_worker_crash(ctx):
    from course_lib import hogwild, sparse_problem
    data = sparse_problem.make_sparse_classification(n_samples=4000, n_features=4000, nnz=16,
                                                     seed=1)
    return expect_error(hogwild.run_sparse, data, num_workers=2, num_epochs=50, fail_worker=1,
                        error=hogwild.HogwildError, names=["worker 1", "exited with code 3"])


@scenario("pipeline-stage-dies", "a pipeline stage whose process dies is named by the other "
          "stages within their deadline", SHORT * 3)
def pipeline_stage_dies(ctx):
    from course_lib.testing.pipeline import silent_stage
    start = time.monotonic()
    reports = ctx.cluster.run(silent_stage, 1, SHORT, True, allow_dead=True, timeout=30)
    seconds = time.monotonic() - start
    check("died" in str(reports[1]), f"stage 1 did not die: {reports[1]}")
    others = [reports[r][0] for r in range(ctx.cluster.n) if r != 1]
    check(all(m.startswith(f"stage {r}") for r, m in zip([0, 2], others, strict=False)),
          f"the other stages did not name themselves: {others}")
    check(any("stage 1" in m for m in others), f"nobody named stage 1: {others}")
    return seconds, others[0]


# ---------------------------------------------------------------- 10: checkpoints
@scenario("chief-killed-mid-checkpoint", "the chief killed while writing a checkpoint resumes "
          "from the one before; nothing saved is lost", 10.0)
def chief_killed_mid_checkpoint(ctx):
    from course_lib import chief
    run = chief.supervise(ctx.cluster, ctx.tmp / "ckpt", 12, 5, report=lambda *_: None,
                          faults=["checkpoint-mid-write:kill@2:rank=0"])
    starts = [r for r in run.log if r["event"] == "start"]
    check(run.restarts == 1 and starts[1]["checkpoint"] == "step-00000005.pt",
          f"restarts {run.restarts}, resumed from {starts[-1].get('checkpoint')}")
    return None, f"killed, resumed from {starts[1]['checkpoint']}: {run.failures[0][:80]}"


@scenario("chief-killed-twice", "the chief killed in two attempts in a row (its engine dropped "
          "by the controller as the cluster looks) restarts twice and finishes", 10.0)
def chief_killed_twice(ctx):
    from course_lib import chief
    run = chief.supervise(ctx.cluster, ctx.tmp / "ckpt", 12, 5, report=lambda *_: None,
                          faults=["train-step:kill@8:rank=0", "train-step:kill@3:rank=0"])
    check(run.restarts == 2 and all("rank 0" in f and "died" in f for f in run.failures),
          f"restarts {run.restarts}: {run.failures}")
    return None, f"killed twice, finished: {run.failures[1][:80]}"


@scenario("checkpoint-damaged", "a truncated or bit-flipped checkpoint is named and the one "
          "before it is used", 1.0)
def checkpoint_damaged(ctx):
    import torch

    from course_lib import checkpoint
    said = []
    for damage in ("truncate", "flip"):
        folder = ctx.tmp / damage
        for step in (1, 2):
            checkpoint.save({"w": torch.full((1000,), float(step)), "step": step}, folder, step)
        newest = folder / "step-00000002.pt"
        data = newest.read_bytes()
        newest.write_bytes(data[:len(data) // 2] if damage == "truncate" else
                           data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
        state, path = checkpoint.load_latest(folder, report=said.append)
        check(state is not None and state["step"] == 1, f"{damage}: loaded {path}")
    check(len(said) == 2 and all("checksum mismatch" in s for s in said), f"said {said}")
    return None, said[-1]


def _save_with_a_full_disk(folder, limit):
    """In a child whose files may not grow past ``limit`` bytes (RLIMIT_FSIZE, as a full disk),
    save a checkpoint too big for it. Returns the child's exit status and error line."""
    script = ("import resource, signal, sys, torch\n"
              "from course_lib import checkpoint\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"  # a write then fails with EFBIG
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
              "try:\n"
              f"    checkpoint.save({{'w': torch.ones(1 << 20), 'step': 2}}, {str(folder)!r}, 2)\n"
              "except OSError as e:\n"
              "    print(f'{type(e).__name__}: {e}'); sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, (done.stdout + done.stderr).strip()


@scenario("disk-full-during-save", "a save that meets a full disk fails with an error and the "
          "previous checkpoint survives", 5.0)
def disk_full_during_save(ctx):
    import torch

    from course_lib import checkpoint
    folder = ctx.tmp / "ckpt"
    checkpoint.save({"w": torch.zeros(1000), "step": 1}, folder, 1)
    start = time.monotonic()
    status, said = _save_with_a_full_disk(folder, 64 * 1024)
    seconds = time.monotonic() - start
    check(status == 3 and "File too large" in said, f"status {status}: {said[-300:]}")
    state, path = checkpoint.load_latest(folder, report=lambda *_: None)
    check(state is not None and state["step"] == 1, f"the previous checkpoint is gone: {path}")
    check(not list(folder.glob(".*.tmp-*")) or checkpoint.remove_orphans(folder),
          "a partial file was left")
    return seconds, said.splitlines()[-1]


ASYNC_SAVE_KILLED = """\
import sys, time, torch
from course_lib import checkpoint
from course_lib.runtime import fault_points
folder = sys.argv[1]
checkpoint.dcp_save({"w": torch.full((1000,), 1.0), "step": torch.tensor(1)}, folder, 1)
fault_points.arm("dcp-before-metadata", "kill")
checkpoint.dcp_save({"w": torch.full((1000,), 2.0), "step": torch.tensor(2)}, folder, 2,
                    asynchronous=True)
print("async_save returned", flush=True)
time.sleep(60)  # training would go on here; the writer's thread is killed with its process
"""


@scenario("killed-during-async-save", "a process killed while DCP's async_save writes in the "
          "background (data files written, .metadata not) loses nothing: the step before loads, "
          "bit for bit", 5.0)
def killed_during_async_save(ctx):
    import torch
    import torch.distributed.checkpoint as dcp

    from course_lib import checkpoint
    folder = ctx.tmp / "dcp"
    done = subprocess.run([sys.executable, "-c", ASYNC_SAVE_KILLED, str(folder)],
                          capture_output=True, text=True, timeout=120)
    check(done.returncode == -signal.SIGKILL and "async_save returned" in done.stdout,
          f"exit {done.returncode}: {(done.stdout + done.stderr)[-300:]}")
    said = []
    latest = checkpoint.dcp_latest(folder, report=said.append)
    check(latest is not None and latest.name == "step-00000001", f"newest committed: {latest}")
    check(len(said) == 1 and "step-00000002" in said[0], f"said {said}")
    state = {"w": torch.zeros(1000), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=latest, no_dist=True)
    check(torch.equal(state["w"], torch.ones(1000)) and int(state["step"]) == 1,
          f"step {int(state['step'])} loaded with values {state['w'].unique().tolist()}")
    return None, said[0]


# ---------------------------------------------------------------- 11-12: input, exposure
def _bad_calls():
    """(what a student calls, the argument the error must name), none of them valid."""
    import tempfile

    import torch

    from course_lib import (
        checkpoint,
        chief,
        collectives,
        compression,
        data,
        ddp,
        gd,
        hogwild,
        hpsearch,
        large_batch,
        local_sgd,
        pipeline,
        ps,
        zero,
    )
    from course_lib.runtime import netem
    from course_lib.runtime.cluster import start_cluster
    return [
        (lambda: start_cluster(n=0), "n"),
        (lambda: start_cluster(n=2, engines="gpu"), "engines"),
        (lambda: start_cluster(n=2, link="fast"), "bandwidth"),
        (lambda: netem.make_link("-1Gbit/s"), "bandwidth"),
        (lambda: collectives.allreduce(np.ones(4), None, algorithm="magic"), "algorithm"),
        (lambda: ps.make_spec(0, 2), "servers"),
        (lambda: ps.make_spec(1, 0), "workers"),
        (lambda: hogwild.run_sparse(None, num_workers=0), "num_workers"),
        (lambda: gd.batch_gd(*_linear(), lr=-0.1, num_epochs=1), "lr"),
        (lambda: data.make_linear(n_samples=0), "n_samples"),
        (lambda: pipeline.schedule_order("zigzag", 0, 2, 4), "schedule"),
        (lambda: pipeline.bubble_fraction(0, 4), "num_stages"),
        (lambda: zero.zero_memory(1000, 4, stage=5), "stage"),
        (lambda: hpsearch.random_search(None, num_configs=0), "num_configs"),
        (lambda: compression.make_compressor("zip"), "name"),
        (lambda: compression.make_compressor("topk", ratio=0), "ratio"),
        (lambda: large_batch.train_and_test(0, "constant"), "batch_size"),
        (lambda: checkpoint.save({}, tempfile.mkdtemp(), 1, keep=0), "keep"),
        (lambda: chief.supervise(None, tempfile.mkdtemp(), steps=0), "steps"),
        (lambda: local_sgd.run_local_sgd(None, sync_every=0), "sync_every"),
        (lambda: ddp.DistributedDataParallel(torch.nn.Linear(2, 2), "fastest"), "strategy"),
        (lambda: gd.minibatch_sgd(*_linear(), lr=0.1, num_epochs=1, batch_size=0),
         "batch_size"),
    ]


@scenario("bad-arguments", "a wrong argument to an entry point is a ValueError naming it and "
          "what is allowed, before any process starts", 1.0)
def bad_arguments(ctx):
    worst, problems = 0.0, []
    for call, name in _bad_calls():
        start = time.monotonic()
        try:
            call()
            problems.append(f"{name}: no error")
        except ValueError as e:
            if name not in str(e):
                problems.append(f"{name}: the error does not name it: {e}")
        except Exception as e:  # noqa: BLE001 - any other error is a broken promise
            problems.append(f"{name}: {type(e).__name__} instead of ValueError: {e}")
        worst = max(worst, time.monotonic() - start)
    check(not problems, "; ".join(problems))
    return worst, f"{len(_bad_calls())} bad calls, each a ValueError naming its argument"


@scenario("exposure", "while the cluster, the parameter server and a benchmark run, nothing "
          "listens beyond loopback", 30.0)
def exposure(ctx):
    from course_lib.bench.allreduce import allreduce_rank_bench
    start = time.monotonic()
    _ps_train(ctx, mode="async", num_epochs=3, timeout=5)
    ctx.cluster.run(allreduce_rank_bench, "torch", ["ring", "native"], [1 << 16], iters=2)
    return None, f"a parameter server and a benchmark ran for {time.monotonic() - start:.1f} s"
