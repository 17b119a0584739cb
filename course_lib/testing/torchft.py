"""Live recovery with torchft: the production counterpart of notebook 11's checkpoint-and-restart.

Introduced in notebooks/11_fault_tolerance.ipynb. :func:`course_lib.chief.supervise` restarts
*every* rank when one dies, and all resume from the last disk checkpoint. torchft
(``pip install -c constraints.txt torchft``, or ``pip install -e '.[ft]'``) keeps the survivors
going instead: a *Lighthouse* forms a quorum of the replica groups still alive, the survivors
continue at once with the smaller quorum, and a replica that (re)joins fetches the current
weights (and momentum) over HTTP from a live peer, not from disk::

    from course_lib.testing import torchft as ft
    run = ft.live_recovery(steps=60, kill_at=10)   # replica 1 SIGKILLed at its 10th step
    print(run.summary())

:func:`live_recovery` runs real processes on this machine: a Lighthouse and ``replicas``
replica groups of one rank each (``python -m course_lib.testing.torchft --replica ...``), each
training :func:`course_lib.chief.make_model` on :func:`course_lib.chief.batch` with a torchft
``Manager``, its ``DistributedDataParallel`` (gradient allreduce over a reconfigurable Gloo
process group) and its optimizer wrapper. Replica ``r`` takes the rows ``batch(step, r,
replicas)``: with every replica present the global batch of a step is the chief's; during the
outage the survivors average over their own rows only (torchft divides by the quorum's size).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

INSTALL = ("torchft is not installed; it is an optional extra: "
           "pip install -c constraints.txt torchft  (or: pip install -e '.[ft]')")
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds course_lib/
_PHASE = ["starting"]  # what this replica process is doing now, for error messages


class TorchftMissing(ImportError):
    """torchft is not installed. Introduced in notebooks/11_fault_tolerance.ipynb."""


def available():
    """Whether torchft can be imported here. Introduced in notebooks/11_fault_tolerance.ipynb."""
    return importlib.util.find_spec("torchft") is not None


def _require():
    if not available():
        raise TorchftMissing(INSTALL)


@dataclass
class LiveRecovery:
    """What :func:`live_recovery` measured. Steps are 0-based indices (the ``step`` of
    :func:`course_lib.chief.batch`); ``*_s`` are seconds (``resume_s``, ``restart_s`` and
    ``recover_s`` counted from the kill). Introduced in notebooks/11_fault_tolerance.ipynb."""
    replicas: int
    victim: int
    steps: dict            # replica -> the steps it committed (both lives of the victim)
    quorum: list           # quorum size of each step, as the first survivor saw it
    kill_step: int         # the victim died before this step
    kill_s: float          # ... this many seconds after the first step
    outage_steps: int      # steps the survivors committed with a smaller quorum
    rejoin_step: int       # the first step the restarted victim committed
    weights_equal: bool    # recovered weights == the sender's, bit for bit
    max_difference: float  # largest |difference| between them (0.0 when equal)
    final_equal: bool      # every replica ends with the same parameters, bit for bit
    loss_start: float      # MSE on the whole data pool, before / after training
    loss_final: float
    resume_s: float        # kill -> the survivors' first step with the smaller quorum
    restart_s: float       # kill -> the new process has its Manager (process start + imports)
    fetch_s: float         # the HTTP transfer of the weights from the live peer
    recover_s: float       # kill -> the restarted replica's first committed step
    wall_s: float          # the whole run: start, training, stop
    losses: list = field(default_factory=list)  # the first survivor's loss per step (its rows)

    def summary(self):
        """A few lines for the notebook. Introduced in notebooks/11_fault_tolerance.ipynb."""
        equal = ("bit for bit" if self.weights_equal
                 else f"NOT equal (max difference {self.max_difference:.3g})")
        return "\n".join([
            f"replica {self.victim} killed before step {self.kill_step} ({self.kill_s:.1f} s into "
            f"training); the survivors went on "
            f"{self.resume_s:.2f} s later with quorum {min(self.quorum)} for "
            f"{self.outage_steps} steps",
            f"restarted: process up after {self.restart_s:.2f} s, weights fetched from a live "
            f"peer in {self.fetch_s * 1000:.1f} ms, first step together (step "
            f"{self.rejoin_step}) {self.recover_s:.2f} s after the kill",
            f"recovered weights equal the sender's: {equal}; final parameters equal: "
            f"{self.final_equal}",
            f"loss on the data pool: {self.loss_start:.4f} -> {self.loss_final:.4f} "
            f"({self.wall_s:.1f} s in all)"])


def live_recovery(steps=60, kill_at=10, replicas=2, victim=1, step_time=0.15, timeout=10.0,
                  heartbeat_timeout=1.0, deadline=None, seed=0, lr=0.02, directory=None):
    """Train with torchft on ``replicas`` processes (one rank each), SIGKILL replica
    ``victim`` at its ``kill_at``-th step (the fault point ``train-step``, as ``chief``'s
    ``train-step:kill@K``), restart it at once, and measure how the survivors carry on and how
    it rejoins. The run lasts ``steps`` steps, longer if the restarted replica is not back by
    then (the survivors train on until it is, or until ``deadline`` seconds). ``step_time``:
    the least seconds per step, the compute of a real model; ``timeout``: the deadline of every
    torchft and Gloo operation; ``heartbeat_timeout``: how soon the Lighthouse declares a
    silent replica dead. Keeps the processes' logs in ``directory`` if given. Raises
    RuntimeError naming the replica and what it was doing.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    if not 2 <= replicas <= 4 or not 0 <= victim < replicas:
        raise ValueError(f"need 2 <= replicas <= 4 and 0 <= victim < replicas, not "
                         f"{replicas=}, {victim=}")
    if not 2 <= kill_at < steps:
        raise ValueError(f"need 2 <= kill_at < steps, not {kill_at=}, {steps=}")
    _require()
    if deadline is None:  # a hang guard: beside other work, a replica took 10 s to import torch
        deadline = 180.0 + 4 * steps * step_time
    import tempfile
    with tempfile.TemporaryDirectory(prefix="course_lib-torchft-") as tmp:
        folder = Path(directory or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for pattern in ("lighthouse.*", "ready-*", "replica-*"):  # a reused folder: our files
            for path in folder.glob(pattern):
                path.unlink()
        run = _Run(folder, steps, kill_at, replicas, victim, step_time, timeout,
                   heartbeat_timeout, deadline, seed, lr)
        began = time.time()
        events, kill_time = run.go()
        return _result(events, kill_time, run, seed, time.time() - began)


class _Run:
    """The launcher: the Lighthouse process, the replica processes, the restart."""

    def __init__(self, folder, steps, kill_at, replicas, victim, step_time, timeout,
                 heartbeat_timeout, deadline, seed, lr):
        self.folder, self.steps, self.kill_at = folder, steps, kill_at
        self.replicas, self.victim, self.step_time = replicas, victim, step_time
        self.timeout, self.heartbeat_timeout, self.deadline = timeout, heartbeat_timeout, deadline
        self.seed, self.lr = seed, lr
        self.procs = {}   # (replica, life) -> Popen
        self.env = {k: v for k, v in os.environ.items()  # our deadlines, not the environment's
                    if not k.startswith("TORCHFT_") and k != "COURSE_LIB_FAULTS"}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get(
            "PYTHONPATH")]))
        self.env.setdefault("OMP_NUM_THREADS", "1")
        # Gloo's sockets on the loopback interface (as the course's engines): 127.0.0.1 only
        self.env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")

    def _spawn(self, name, args):
        log = open(self.folder / f"{name}.log", "w")
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "course_lib.testing.torchft", *map(str, args)],
                env=self.env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()  # the child holds its own copy

    def _tail(self, name, lines=12):
        path = self.folder / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.strip().splitlines()[-lines:]) or "(no output)"

    def _replica(self, r, life):
        left = self.deadline - (time.monotonic() - self.start) - 2  # its watchdog fires first
        args = ["--replica", r, "--replicas", self.replicas, "--deadline", f"{max(left, 1):.1f}",
                "--steps", self.steps, "--step-time", self.step_time, "--timeout", self.timeout,
                "--seed", self.seed, "--lr", self.lr,
                "--dir", self.folder, "--life", life]
        if r == self.victim and life == 0:
            args += ["--kill-at", self.kill_at]
        self.procs[(r, life)] = self._spawn(f"replica-{r}-{life}", args)

    def go(self):
        from course_lib.runtime.launch import kill_tree
        start = self.start = time.monotonic()
        lighthouse = None
        kill_time = None
        try:
            lighthouse = self._spawn("lighthouse", [
                "--lighthouse-server", "--dir", self.folder, "--deadline", self.deadline + 5,
                "--heartbeat-timeout", self.heartbeat_timeout])
            for r in range(self.replicas):  # they read the Lighthouse's port when it is up
                self._replica(r, 0)
            while True:
                running = False
                if lighthouse.poll() is not None:
                    raise RuntimeError(f"live_recovery: the torchft Lighthouse exited with status "
                                       f"{lighthouse.poll()}:\n{self._tail('lighthouse')}")
                for (r, life), proc in list(self.procs.items()):
                    rc = proc.poll()
                    if rc is None:
                        running = True
                    elif rc == -9 and r == self.victim and life == 0:
                        if kill_time is None:  # the fault point fired: restart it at once
                            kill_time = time.time()
                            self._replica(r, 1)
                            running = True
                    elif rc != 0:
                        name = f"replica {r} ({'restarted' if life else 'first life'})"
                        raise RuntimeError(
                            f"live_recovery: {name}, pid {proc.pid}, exited with status {rc}; "
                            f"the end of its log:\n{self._tail(f'replica-{r}-{life}')}")
                if not running:
                    break
                if time.monotonic() - start > self.deadline:
                    late = [f"replica {r} (life {life})" for (r, life), p in self.procs.items()
                            if p.poll() is None]
                    raise RuntimeError(
                        f"live_recovery: {', '.join(late)} still running after "
                        f"{self.deadline:g} s; stopped. The end of the first one's log:\n"
                        + self._tail("replica-{}-{}".format(*next(
                            k for k, p in self.procs.items() if p.poll() is None))))
                time.sleep(0.02)
            if kill_time is None:
                raise RuntimeError(f"live_recovery: replica {self.victim} was never killed "
                                   f"(kill_at={self.kill_at}, steps={self.steps})")
            return _read_events(self.folder), kill_time
        finally:
            pids = [p.pid for p in self.procs.values()] + ([lighthouse.pid] if lighthouse else [])
            kill_tree(pids)
            for p in [*self.procs.values(), *([lighthouse] if lighthouse else [])]:
                if p.stdin:
                    p.stdin.close()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:  # SIGKILLed already: nothing more to do
                    pass


def _read_events(folder):
    """(replica, life) -> its JSONL records."""
    out = {}
    for path in sorted(folder.glob("replica-*-*.jsonl")):
        _, r, life = path.stem.split("-")
        out[(int(r), int(life))] = [json.loads(line) for line in path.read_text().splitlines()
                                    if line.strip()]
    return out


def _pool_loss(params, seed):
    """MSE of the model with these flat parameters on the whole data pool."""
    import torch

    from course_lib import chief
    model = chief.make_model(seed)
    torch.nn.utils.vector_to_parameters(torch.as_tensor(params, dtype=torch.float64),
                                        model.parameters())
    X, y = chief.batch(0, 0, 1, seed, size=512)  # every row of the pool (512 by default)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(X), y).item()


def _result(events, kill_time, run, seed, wall_s):
    """Reduce the replicas' records to a :class:`LiveRecovery`."""
    import torch

    from course_lib import chief
    R, victim = run.replicas, run.victim

    def records(r, life, event):
        return [e for e in events.get((r, life), []) if e["event"] == event]

    def need(found, what):
        if not found:
            raise RuntimeError(f"live_recovery: no record of {what} (logs: {run.folder})")
        return found

    committed = {r: [e for life in (0, 1) for e in records(r, life, "step") if e["committed"]]
                 for r in range(R)}
    survivor = min(r for r in range(R) if r != victim)
    mine = committed[survivor]
    quorum = [e["quorum"] for e in mine]
    outage = [e for e in mine if e["quorum"] < R]
    back = need([e for e in records(victim, 1, "step") if e["committed"]],
                f"a committed step of the restarted replica {victim}")
    recovered = need(records(victim, 1, "recovered"),
                     f"replica {victim} recovering its weights from a peer")[0]
    sent = need([e for r in range(R) for life in (0, 1) for e in records(r, life, "sent")
                 if e["step"] == recovered["step"]],
                f"a survivor sending its weights at step {recovered['step']}")[0]
    got, gave = (torch.tensor(x["params"], dtype=torch.float64) for x in (recovered, sent))
    finals = [torch.tensor(need(records(r, 1 if r == victim else 0, "done"),
                                f"replica {r} finishing")[0]["params"], dtype=torch.float64)
              for r in range(R)]
    start = torch.nn.utils.parameters_to_vector(chief.make_model(seed).parameters())
    return LiveRecovery(
        replicas=R, victim=victim, steps={r: [e["step"] for e in committed[r]] for r in range(R)},
        quorum=quorum, kill_step=run.kill_at - 1, kill_s=kill_time - mine[0]["time"],
        outage_steps=len(outage),
        rejoin_step=back[0]["step"], weights_equal=torch.equal(got, gave),
        max_difference=(got - gave).abs().max().item(),
        final_equal=all(torch.equal(f, finals[0]) for f in finals),
        loss_start=_pool_loss(start.detach(), seed), loss_final=_pool_loss(finals[0], seed),
        resume_s=(outage[0]["time"] if outage else float("nan")) - kill_time,
        restart_s=need(records(victim, 1, "ready"), "the restarted Manager")[0]["time"]
        - kill_time,
        fetch_s=need(records(victim, 1, "fetched"), "the weights' transfer")[0]["seconds"],
        recover_s=back[0]["time"] - kill_time,
        wall_s=wall_s,
        losses=[e["loss"] for e in mine])


# ---------------------------------------------------------------- inside the child processes
def _watchdog(seconds, who):
    """Exit this process (status 3) if it runs longer than ``seconds``: no wait is unbounded."""
    def expire():
        print(f"{who}: still {_PHASE[0]} after {seconds:g} s: giving up", file=sys.stderr,
              flush=True)
        os._exit(3)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def _rust_extension():
    """torchft's Rust extension (Lighthouse, Manager server) loaded alone: ``import torchft``
    would import PyTorch first, 3 s of CPU that a Lighthouse does not need."""
    spec = importlib.util.find_spec("torchft")
    for path in Path(spec.submodule_search_locations[0]).glob("_torchft*.so"):
        ext = importlib.util.spec_from_file_location("torchft._torchft", path)
        module = importlib.util.module_from_spec(ext)
        ext.loader.exec_module(module)
        return module
    import torchft._torchft  # not a .so file on this platform: the ordinary way
    return torchft._torchft


def _lighthouse_main(args):
    """The Lighthouse: quorums of the replica groups alive, until stdin closes."""
    LighthouseServer = _rust_extension().LighthouseServer
    _watchdog(args.deadline, "torchft Lighthouse")
    ms = int(args.heartbeat_timeout * 1000)
    # min_replicas=1: a lone survivor may go on. join_timeout: how long a quorum waits for a
    # replica that heartbeats but has not asked to join (only a membership change waits)
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=ms,
                              quorum_tick_ms=20, heartbeat_timeout_ms=ms)
    port = server.address().rsplit(":", 1)[1]  # address() names the host, not 127.0.0.1
    tmp = Path(args.dir) / "lighthouse.port.tmp"
    tmp.write_text(port)
    tmp.rename(Path(args.dir) / "lighthouse.port")
    try:
        sys.stdin.read()  # the launcher closes stdin, or dies: EOF
    finally:
        server.shutdown()


class _Log:
    """Append-only JSONL records of one replica process, flushed at once (it may be killed)."""

    def __init__(self, path):
        self.file = open(path, "a")  # lives as long as the process
        self.lock = threading.Lock()  # the Manager calls back from its quorum thread

    def __call__(self, event, **fields):
        with self.lock:
            self.file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
            self.file.flush()


def _lighthouse_address(folder, timeout):
    """The Lighthouse's address, once its process has written its port into ``folder``."""
    path, limit = Path(folder) / "lighthouse.port", time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > limit:
            raise TimeoutError(f"no {path} after {timeout:g} s")
        time.sleep(0.02)
    return f"http://127.0.0.1:{path.read_text().strip()}"


def _flat(model):
    return [x for p in model.parameters() for x in p.detach().reshape(-1).tolist()]


def _replica_main(args):
    """One replica group of one rank: chief's model and data under a torchft Manager."""
    who = f"torchft replica {args.replica}" + (" (restarted)" if args.life else "")
    _watchdog(args.deadline, who)
    _PHASE[0] = "waiting for the Lighthouse to start"  # it starts in 0.1 s: before torch
    lighthouse = args.lighthouse or _lighthouse_address(args.dir, args.timeout)
    _PHASE[0] = "importing torch and torchft"
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing import HTTPTransport

    from course_lib import chief
    from course_lib.runtime import fault_points

    torch.set_num_threads(1)
    log = _Log(Path(args.dir) / f"replica-{args.replica}-{args.life}.jsonl")
    log("start", pid=os.getpid())
    timeout = timedelta(seconds=args.timeout)

    class LoopbackHTTPTransport(HTTPTransport):
        """Serve and fetch the weights at 127.0.0.1 (the default advertises the host name),
        and time the fetch."""

        def address(self):
            return f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/"

        def recv_checkpoint(self, *a, **kw):
            t = time.perf_counter()
            state = super().recv_checkpoint(*a, **kw)
            log("fetched", seconds=time.perf_counter() - t)
            return state

    model = chief.make_model(args.seed)  # the same initial weights everywhere: no init sync
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def state_dict():  # called when a peer must be healed from us
        log("sent", step=manager.current_step(), params=_flat(model))
        return {"model": model.state_dict(), "optim": sgd.state_dict()}

    def load_state_dict(state):  # called when we heal from a peer (momentum included)
        model.load_state_dict(state["model"])
        sgd.load_state_dict(state["optim"])
        log("recovered", step=manager.current_step(), params=_flat(model))

    _PHASE[0] = "starting its TCPStore"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timeout)
    _PHASE[0] = f"creating its Manager (connecting to the Lighthouse at {lighthouse})"
    # use_async_quorum=False: the quorum (and healing) completes before the forward pass, so a
    # restarted replica trains its first step on the recovered weights; the default overlaps
    # the quorum with the forward pass and a healing replica contributes zeros for a step
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, use_async_quorum=False, timeout=timeout,
        quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=f"replica_{args.replica}", hostname="127.0.0.1", init_sync=False,
        checkpoint_transport=LoopbackHTTPTransport(timeout=timeout, num_chunks=0),
        max_retries=3)  # a 4th failed step in a row raises instead of retrying forever
    log("ready")
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, sgd)
    if args.life == 0:  # the first quorum: everyone, not whoever imported torch first
        _PHASE[0] = "waiting for the other replicas' Managers"
        (Path(args.dir) / f"ready-{args.replica}").touch()
        limit = time.monotonic() + 3 * args.timeout  # the others may still import torch
        while len(list(Path(args.dir).glob("ready-*"))) < args.replicas:
            if time.monotonic() > limit:
                ready = sorted(p.name for p in Path(args.dir).glob("ready-*"))
                raise TimeoutError(f"only {ready} after {3 * args.timeout:g} s")
            time.sleep(0.02)
    if args.kill_at:
        fault_points.arm("train-step", "kill", at=args.kill_at)
    while True:
        fault_points.point("train-step")
        began = time.perf_counter()
        _PHASE[0] = f"at step {manager.current_step()} waiting for a quorum (and healing)"
        optimizer.zero_grad()  # start_quorum: a new quorum reconfigures the PG, may heal us
        step = manager.current_step()
        if args.life and step == 0:
            raise RuntimeError("no live peer to recover the weights from: the quorum it joined "
                               "was at step 0")
        quorum = manager.num_participants()
        _PHASE[0] = f"at step {step} in the gradient allreduce"
        X, y = chief.batch(step, args.replica, args.replicas, args.seed)
        loss = torch.nn.functional.mse_loss(ddp(X), y)
        loss.backward()  # DDP's hook: manager.allreduce of the gradients (mean over the quorum)
        _PHASE[0] = f"at step {step} in should_commit"
        optimizer.step()  # steps SGD only if every rank of the group says should_commit
        committed = manager.current_step() == step + 1
        log("step", step=step, quorum=quorum, committed=committed, loss=loss.item())
        if committed and step + 1 >= args.steps:
            # stop together, with everyone back: every member of a quorum sees the same size.
            # Short of that, train on (to the deadline): a real run is long enough for the
            # restart to fit, this one may not be on a busy machine
            if quorum == args.replicas:
                break
            _PHASE[0] = (f"at step {step + 1} (of {args.steps}) training on with a quorum of "
                         f"{quorum}, waiting for the restarted replica to rejoin")
        time.sleep(max(0.0, args.step_time - (time.perf_counter() - began)))
    log("done", step=manager.current_step(), params=_flat(model))
    _PHASE[0] = "shutting down its Manager"
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # everything is written: skip the interpreter's slow teardown of torch


def main(argv=None):
    """``python -m course_lib.testing.torchft --replica R ...`` (or ``--lighthouse-server``):
    the processes :func:`live_recovery` starts. Introduced in notebooks/11_fault_tolerance.ipynb."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.testing.torchft")
    parser.add_argument("--lighthouse-server", action="store_true")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    parser.add_argument("--replica", type=int)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--life", type=int, default=0, help="0, or 1 once restarted")
    parser.add_argument("--lighthouse", help="the Lighthouse's address")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--deadline", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    if not args.lighthouse_server and args.replica is None:
        parser.error("give --replica R or --lighthouse-server")
    _require()
    who = "torchft Lighthouse" if args.lighthouse_server else (
        f"torchft replica {args.replica}" + (" (restarted)" if args.life else ""))
    try:
        (_lighthouse_main if args.lighthouse_server else _replica_main)(args)
    except BaseException as e:
        import traceback
        traceback.print_exc()
        print(f"{who}: failed while {_PHASE[0]}: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()


# ---------------------------------------------------------------- DiLoCo, beside notebook 08's
def torchft_diloco(replicas=2, sync_every=10, steps=60, batch_size=32,
                   hidden=(64,), inner_lr=3e-3, outer_lr=0.7, outer_momentum=0.9, seed=0,
                   timeout=30.0):
    """torchft's own DiLoCo (``torchft.local_sgd.DiLoCo``, a real Lighthouse and one
    ``Manager`` per replica group over Gloo, the replica groups as threads of this process, as
    torchft's integration tests run them) training what
    :func:`course_lib.local_sgd.diloco_on_rank` trains: the same MLP, shards, batches, inner
    AdamW and outer Nesterov SGD. Returns ``{"theta": replica 0's final parameters (flat, numpy),
    "loss": their training loss, "bytes": bytes each replica handed to the Manager's
    allreduce}``. Raises RuntimeError naming a replica that failed or did not finish within
    ``timeout`` seconds per operation (4 timeouts in all). Introduced in
    notebooks/08_local_sgd_and_compression.ipynb."""
    _require()
    import logging
    from datetime import timedelta

    # torchft's Rust side logs every quorum at INFO, read from RUST_LOG when it loads; its
    # Manager warns at every quorum that Gloo has no NCCL flight recorder to reset
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from course_lib.local_sgd import Replica
    wait = timedelta(seconds=timeout)
    lighthouse = _rust_extension().LighthouseServer(bind="127.0.0.1:0", min_replicas=replicas)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    # made one after another: the model's seed is global state, the threads would race on it
    shards = [Replica(r, replicas, batch_size, hidden, seed, "float32") for r in range(replicas)]
    results, failures = [None] * replicas, {}

    def replica(r):
        rep, model = shards[r], shards[r].model
        inner = torch.optim.AdamW(model.parameters(), lr=inner_lr)
        outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum,
                                nesterov=True)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=wait)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=wait), load_state_dict=None, state_dict=None,
            min_replica_size=replicas, use_async_quorum=False, replica_id=f"replica_{r}",
            store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
            lighthouse_addr=address, hostname="127.0.0.1", init_sync=False, timeout=wait,
            quorum_timeout=wait, connect_timeout=wait)
        handed = [0]
        allreduce = manager.allreduce

        def counted(tensor, *args, **kwargs):  # what DiLoCo hands the Manager to average
            handed[0] += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)
        manager.allreduce = counted
        try:
            with DiLoCo(manager, [model], inner, outer, sync_every=sync_every):
                for _ in range(steps):
                    idx = rep.next_batch()
                    inner.zero_grad()
                    F.cross_entropy(model(rep.X[idx]), rep.y[idx]).backward()
                    inner.step()  # DiLoCo's hook: every sync_every steps, the outer step
        finally:
            manager.shutdown(wait=False)
        theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        results[r] = {"theta": theta.double().numpy().copy(), "bytes": handed[0],
                      "loss": rep.evaluate(theta)[0]}

    def guarded(r):
        try:
            replica(r)
        except BaseException as e:  # noqa: BLE001  (reported below, by replica)
            failures[r] = f"{type(e).__name__}: {e}"
    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * timeout)
    lighthouse.shutdown()
    for r, t in enumerate(threads):
        if t.is_alive():
            failures[r] = f"not done after {4 * timeout:g} s"
    if failures:
        raise RuntimeError("torchft DiLoCo: " + "; ".join(f"replica {r}: {what}"
                                                          for r, what in failures.items()))
    return {**results[0], "replicas": results}

