"""What runs a hyper-parameter search: the trials on the engines, the jobs, and the loop that
keeps every engine busy with a policy's jobs (the policies are in :mod:`course_lib.hpsearch`).

Introduced in notebooks/13_hyperparameter_search.ipynb. A *trial* trains one configuration on one
engine up to a given epoch, resuming from its checkpoint (:func:`train_trial`; :func:`sleep_trial`
is a stand-in that sleeps, so 8 engines fit on 2 cores). :func:`run` submits each job a policy
hands out to whichever engine is free and reports each result as it arrives, in any order; a job
whose engine dies runs again elsewhere. :func:`simulate` makes the same decisions on a simulated
clock, at any scale. It stays one file: the trials, the records and the two drivers (real and
simulated) meet in :class:`Job`, and the policies, the part a student changes, are elsewhere.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ipyparallel as ipp
import numpy as np

from course_lib import data, models
from course_lib.runtime import fault_points
from course_lib.runtime.engine import ENGINE

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster

ENGINE_FILE = ".engine"  # a trial's directory: the pid of the engine running it

class SearchError(RuntimeError):
    """A search that cannot go on: a trial raised, or the deadline passed.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""


# ---------------------------------------------------------------- trials (run on an engine)
_DIGITS = {}  # the data set, loaded once per engine and kept for its later trials


def train_trial(config: dict, epochs: int, directory: str | Path, seed: int = 0) -> dict:
    """On an engine: train the digits MLP of ``config`` (lr, batch_size, width, warmup epochs of
    linear learning-rate warm-up) with SGD and momentum up to epoch ``epochs``, resuming from the
    checkpoint in ``directory`` if there is one, and checkpoint it there. Returns the validation
    accuracy after every epoch so far and when it ran.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    # torch (seconds to import) only where a trial trains: an engine imports this module to
    # unpickle any trial, and the loop, the policies and simulate() run without it
    import torch
    import torch.nn.functional as F

    from course_lib import checkpoint  # imports torch too
    start, directory = time.time(), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ENGINE_FILE).write_text(str(os.getpid()))
    if not _DIGITS:
        X, y, Xv, yv = data.load_digits()
        _DIGITS.update(X=torch.from_numpy(X).float(), y=torch.from_numpy(y),
                       Xv=torch.from_numpy(Xv).float(), yv=torch.from_numpy(yv))
    X, y = _DIGITS["X"], _DIGITS["y"]
    model = models.mlp(X.shape[1], config["width"], 10, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    state, _ = checkpoint.load_latest(directory, report=lambda line: None)
    first, accs = 0, []
    if state is not None:  # a promotion: go on from where the last rung stopped
        first, accs = checkpoint.restore(state, model, optimizer)[1], list(state["extra"]["accs"])
    batch_size = config["batch_size"]
    per_epoch = math.ceil(len(X) / batch_size)
    warmup_steps = config.get("warmup", 0) * per_epoch
    for epoch in range(first, epochs):
        fault_points.point("trial-epoch")
        order = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(per_epoch):
            step = epoch * per_epoch + i
            # linear warm-up (Goyal et al. 2017): lr / warmup_steps at the first step, full lr
            # from the last warm-up step on
            scale = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
            for group in optimizer.param_groups:
                group["lr"] = config["lr"] * scale
            rows = order[i * batch_size:(i + 1) * batch_size]
            loss = F.cross_entropy(model(X[rows]), y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            accs.append((model(_DIGITS["Xv"]).argmax(1) == _DIGITS["yv"]).double().mean().item())
    checkpoint.save(checkpoint.training_state(model, optimizer, step=0, epoch=epochs, accs=accs),
                    directory, epochs, keep=1)
    return dict(accs=accs, first_epoch=first, start=start, end=time.time(), pid=os.getpid())


def surrogate(config: dict, epoch: int, epoch_s: float = 0.05) -> tuple[float, float]:
    """(validation accuracy after ``epoch`` epochs, seconds per epoch) of a stand-in trial: a
    smooth function of ``config``, best near lr = 0.1, better when wider, slower to rise with
    warm-up; an epoch takes ``epoch_s`` at batch size 32, longer for smaller batches (more
    steps). Introduced in notebooks/13_hyperparameter_search.ipynb."""
    quality = math.exp(-math.log10(config["lr"] / 0.1) ** 2) * (
        0.7 + 0.05 * math.log2(config.get("width", 64)))
    rate = 1.0 / (1 + config.get("warmup", 0))
    accuracy = 0.1 + 0.85 * quality * (1 - math.exp(-rate * epoch))
    return accuracy, epoch_s * (0.5 + 16 / config.get("batch_size", 32))


def sleep_trial(config: dict, epochs: int, directory: str | Path, seed: int = 0,
                epoch_s: float = 0.05) -> dict:
    """A stand-in for :func:`train_trial` that sleeps for its training time (so 8 engines fit
    on 2 cores) and reports the accuracy of :func:`surrogate`. Resumes like a real trial.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    from course_lib.checkpoint import atomic_write  # imports torch: see train_trial
    start, directory = time.time(), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ENGINE_FILE).write_text(str(os.getpid()))
    path = directory / "accs.json"
    accs = json.loads(path.read_text()) if path.exists() else []
    first = len(accs)
    for epoch in range(first, epochs):
        fault_points.point("trial-epoch")
        accuracy, seconds = surrogate(config, epoch + 1, epoch_s)
        time.sleep(seconds)
        accs.append(accuracy)
    atomic_write(path, json.dumps(accs).encode())
    return dict(accs=accs, first_epoch=first, start=start, end=time.time(), pid=os.getpid())


# ---------------------------------------------------------------- what a search records
@dataclass
class Job:
    """One submission: configuration ``config_id`` trained to ``epochs`` (rung ``rung``), and,
    once back, on which rank, when, and its accuracy after each epoch.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    config_id: int
    config: dict
    rung: int
    epochs: int
    rank: int | None = None
    start: float | None = None
    end: float | None = None
    accs: list = field(default_factory=list)
    first_epoch: int = 0
    retried: int = 0

    @property
    def acc(self) -> float:
        """The validation accuracy after its last epoch."""
        return self.accs[-1]

    @property
    def epochs_trained(self) -> int:
        """Epochs this job trained itself (a promotion resumes at ``first_epoch``)."""
        return self.epochs - self.first_epoch


class Policy(Protocol):
    """What :func:`run` and :func:`simulate` drive: ``next()`` hands out a job (None: nothing to
    start now) and ``report(job)`` hears each result, in any order. The policies are in
    :mod:`course_lib.hpsearch`. Introduced in notebooks/13_hyperparameter_search.ipynb."""

    def next(self) -> Job | None: ...

    def report(self, job: Job) -> None: ...


@dataclass
class SearchResult:
    """Every finished job of a search, in the order they finished.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    name: str
    jobs: list[Job]
    ranks: list[int]
    started: float
    elapsed: float
    lost_ranks: list[int] = field(default_factory=list)

    @property
    def best(self) -> tuple[float, dict]:
        """(accuracy, configuration) of the best finished job."""
        job = max(self.jobs, key=lambda j: j.acc)
        return job.acc, job.config

    @property
    def epochs_spent(self) -> int:
        """Epochs trained by all the jobs together: what the search cost."""
        return sum(j.epochs_trained for j in self.jobs)

    @property
    def retried(self) -> list[Job]:
        """Jobs started again because their engine died."""
        return [j for j in self.jobs if j.retried]

    def busy_fraction(self) -> float:
        """Time the engines spent in trials over the time they were there for."""
        return sum(j.end - j.start for j in self.jobs) / (len(self.ranks) * self.elapsed)

    def best_so_far(self) -> np.ndarray:
        """(seconds since the start, epochs spent, best accuracy) after each finished job."""
        out, best, spent = [], 0.0, 0
        for j in sorted(self.jobs, key=lambda j: j.end):
            best, spent = max(best, j.acc), spent + j.epochs_trained
            out.append((j.end - self.started, spent, best))
        return np.array(out)


# ---------------------------------------------------------------- the loop
def _arm(specs, directory):  # on each engine: ENGINE holds its rank (filled in place)
    fault_points.arm_once(specs, directory, ENGINE["rank"])


def run(cluster: Cluster, policy: Policy, trial: Callable[..., dict] = train_trial,
        directory: str | Path | None = None, ranks: list[int] | None = None,
        name: str | None = None, timeout: float = 300.0,
        on_result: Callable[[list[Job]], object] | None = None, faults: Sequence[str] = (),
        **trial_kwargs: Any) -> SearchResult:
    """Drive ``policy`` on ``cluster``: keep every engine of ``ranks`` busy with the policy's
    jobs (``trial(config, epochs, directory, **trial_kwargs)`` on whichever engine is free) and
    report each result as it arrives (then call ``on_result(jobs so far)``). A job whose engine
    dies is started again on another (from its checkpoint). Every wait has the deadline
    ``timeout`` s. ``faults``: fault points armed on the engines for this search, e.g.
    ``["trial-epoch:kill@5:rank=2"]`` (rank 2 dies in the 5th epoch it trains).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    directory = Path(directory or tempfile.mkdtemp(prefix="course-hpsearch-"))
    ranks = list(range(cluster.n) if ranks is None else ranks)
    if faults:
        cluster.run(_arm, list(faults), str(directory))
    try:
        return _drive(cluster, policy, trial, directory, ranks, name, timeout, on_result,
                      trial_kwargs)
    finally:
        if faults:  # on the engines still alive: nothing stays armed for the next search
            live = [cluster.engine_ids[r] for r in ranks if r not in cluster.dead_ranks()]
            cluster.client[live].apply_async(_disarm).get(timeout=30)


def _disarm():
    fault_points.disarm()


def _drive(cluster, policy, trial, directory, ranks, name, timeout, on_result, trial_kwargs):
    view, lost, jobs, running = cluster.balanced_view(ranks), [], [], {}
    started, deadline = time.time(), time.monotonic() + timeout

    def submit(job):
        path = directory / f"config-{job.config_id:04d}"
        # an earlier run of this config left its engine's pid: gone until this run writes its
        # own, so that a death of that engine is not taken for this run's
        (path / ENGINE_FILE).unlink(missing_ok=True)
        for _ in range(len(ranks) + 1):  # each failure drops an engine: at most len(ranks) of them
            try:
                running[view.apply_async(trial, job.config, job.epochs, str(path),
                                         **trial_kwargs)] = job
                return
            except KeyError:  # an engine of the view was unregistered just now: it died
                notice_dead()
        raise SearchError(f"config {job.config_id}: no live engine left to run it on")

    def notice_dead():
        """Drop the engines that died; their running jobs go to the engines left."""
        nonlocal view
        dead = [r for r in cluster.dead_ranks() if r in ranks and r not in lost]
        if not dead:
            return
        lost.extend(dead)
        view = cluster.balanced_view([r for r in ranks if r not in lost])
        pids = {cluster.pids[r] for r in dead}
        for ar, job in list(running.items()):
            if _engine_of(directory, job) in pids:
                del running[ar]
                job.retried += 1
                submit(job)

    while True:
        notice_dead()
        while len(running) < len(ranks) - len(lost) and (job := policy.next()) is not None:
            submit(job)
        if not running:
            break  # nothing to start, nothing running: the search is over
        finished = [ar for ar in running if ar.ready()]
        if not finished:
            if time.monotonic() > deadline:
                raise SearchError(f"{name or type(policy).__name__}: no end within {timeout:g}s;"
                                  f" {len(running)} job(s) still running: "
                                  + ", ".join(f"config {j.config_id} to epoch {j.epochs}"
                                              for j in running.values()))
            time.sleep(0.005)  # a short poll: a free engine gets its next job within ms
            continue
        for ar in finished:
            job = running.pop(ar)
            try:
                out = ar.get()
            except ipp.error.EngineError:  # its engine died before we noticed: run it again
                job.retried += 1
                submit(job)
                continue
            except ipp.error.RemoteError as e:
                raise SearchError(f"config {job.config_id} {job.config} (to epoch {job.epochs})"
                                  f" raised on its engine: {e.ename}: {e.evalue}") from None
            job.accs, job.first_epoch = out["accs"], out["first_epoch"]
            job.start, job.end = out["start"], out["end"]
            job.rank = cluster.pids.index(out["pid"]) if out["pid"] in cluster.pids else None
            jobs.append(job)
            policy.report(job)
            if on_result is not None:
                on_result(jobs)
    return SearchResult(name or type(policy).__name__, jobs, ranks, started,
                        time.time() - started, lost)


def _engine_of(directory, job):
    path = directory / f"config-{job.config_id:04d}" / ENGINE_FILE
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def simulate(policy: Policy, num_engines: int, epoch_s: float = 1.0, overhead_s: float = 0.0,
             name: str | None = None) -> SearchResult:
    """Run ``policy`` on ``num_engines`` imaginary engines with :func:`surrogate` trials, on a
    simulated clock (no cluster, no waiting): the same decisions :func:`run` makes, at any
    scale. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    free, events, jobs, now = list(range(num_engines))[::-1], [], [], 0.0
    while True:
        while free and (job := policy.next()) is not None:
            rank = free.pop()
            job.rank, job.start, job.first_epoch = rank, now, _resumed_from(jobs, job)
            job.accs, seconds = [], overhead_s
            for epoch in range(1, job.epochs + 1):
                accuracy, epoch_seconds = surrogate(job.config, epoch, epoch_s)
                job.accs.append(accuracy)
                seconds += epoch_seconds if epoch > job.first_epoch else 0.0
            job.end = now + seconds
            # a unique second key: equal end times never fall through to comparing two Jobs
            heapq.heappush(events, (job.end, len(jobs) + len(events), job))
        if not events:
            break
        now, _, job = heapq.heappop(events)
        free.append(job.rank)
        jobs.append(job)
        policy.report(job)
    return SearchResult(name or type(policy).__name__, jobs, list(range(num_engines)), 0.0, now)


def _resumed_from(jobs, job):
    done = [j.epochs for j in jobs if j.config_id == job.config_id]
    return max(done, default=0)
