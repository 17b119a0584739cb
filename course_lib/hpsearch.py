"""Hyper-parameter search: the other way to use many machines.

Introduced in notebooks/13_hyperparameter_search.ipynb. Notebooks 02-11 train *one* model on
many workers; a search trains *many* models, one per configuration of the hyper-parameters, each
on one engine. The trials are independent (embarrassingly parallel) until the search decides
which of them to continue: that decision is where the algorithms differ, and where engines can
sit idle::

    result = hpsearch.asha(cluster, num_configs=27, min_epochs=1, max_epochs=9, eta=3)
    result.best, result.busy_fraction(), result.epochs_spent

Every algorithm is a *policy* driven by one loop (:func:`run`): whenever an engine is free, the
loop asks the policy for a job (a configuration and the epoch to train it to), submits it to the
cluster's load-balanced view, and reports each result to the policy as it arrives, in any order.
A promoted configuration resumes from its checkpoint instead of training again from scratch.

- random search: every configuration trained to ``max_epochs``;
- successive halving (synchronous): n configurations for r epochs, the best 1/eta of them eta
  times longer, and so on; a rung must be complete before the next one starts;
- ASHA (asynchronous successive halving, Li et al. 2020): when an engine is free, promote a
  configuration in the top 1/eta of what its rung has reported *so far*, else start a new one;
  no engine waits for a rung to fill;
- Hyperband (Li et al. 2018): brackets of successive halving, from many short trials to a few
  long ones, a hedge against stopping slow starters too early.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from course_lib import faults
from course_lib.gd import check_count

SPACE = {"lr": ("log", 0.003, 3.0), "batch_size": ("choice", (16, 32, 64, 128)),
         "width": ("choice", (8, 16, 32, 64)), "warmup": ("choice", (0, 1, 2))}
ENGINE_FILE = ".engine"  # a trial's directory: the pid of the engine running it


class SearchError(RuntimeError):
    """A search that cannot go on: a trial raised, or the deadline passed.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""


# ---------------------------------------------------------------- configurations
def sample(space, rng):
    """One configuration drawn from ``space`` ({name: ("log", lo, hi) | ("uniform", lo, hi) |
    ("choice", values)}). Introduced in notebooks/13_hyperparameter_search.ipynb."""
    config = {}
    for name, (kind, *args) in space.items():
        if kind == "log":
            config[name] = float(np.exp(rng.uniform(np.log(args[0]), np.log(args[1]))))
        elif kind == "uniform":
            config[name] = float(rng.uniform(*args))
        elif kind == "choice":
            config[name] = args[0][int(rng.integers(len(args[0])))]
        else:
            raise ValueError(f"{name}: unknown kind {kind!r} (log, uniform or choice)")
    return config


def grid(space, num=3):
    """Every combination: ``num`` points per numeric range (log-spaced for "log"), every value
    of a choice. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    axes = []
    for name, (kind, *args) in space.items():
        values = (np.geomspace(*args, num) if kind == "log" else
                  np.linspace(*args, num) if kind == "uniform" else args[0])
        axes.append([(name, v.item() if hasattr(v, "item") else v) for v in values])
    return [dict(combination) for combination in itertools.product(*axes)]


# ---------------------------------------------------------------- trials (run on an engine)
_DIGITS = {}


def train_trial(config, epochs, directory, seed=0):
    """On an engine: train the digits MLP of ``config`` (lr, batch_size, width, warmup epochs of
    linear learning-rate warm-up) with SGD and momentum up to epoch ``epochs``, resuming from the
    checkpoint in ``directory`` if there is one, and checkpoint it there. Returns the validation
    accuracy after every epoch so far and when it ran.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import torch
    import torch.nn.functional as F

    from course_lib import checkpoint, data, models
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
        faults.point("trial-epoch")
        order = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed + epoch))
        for i in range(per_epoch):
            step = epoch * per_epoch + i
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


def surrogate(config, epoch, epoch_s=0.05):
    """(validation accuracy after ``epoch`` epochs, seconds per epoch) of a stand-in trial: a
    smooth function of ``config``, best near lr = 0.1, better when wider, slower to rise with
    warm-up; an epoch takes ``epoch_s`` at batch size 32, longer for smaller batches (more
    steps). Introduced in notebooks/13_hyperparameter_search.ipynb."""
    quality = math.exp(-math.log10(config["lr"] / 0.1) ** 2) * (
        0.7 + 0.05 * math.log2(config.get("width", 64)))
    rate = 1.0 / (1 + config.get("warmup", 0))
    accuracy = 0.1 + 0.85 * quality * (1 - math.exp(-rate * epoch))
    return accuracy, epoch_s * (0.5 + 16 / config.get("batch_size", 32))


def sleep_trial(config, epochs, directory, seed=0, epoch_s=0.05):
    """A stand-in for :func:`train_trial` that sleeps for its training time (so 8 engines fit
    on 2 cores) and reports the accuracy of :func:`surrogate`. Resumes like a real trial.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    from course_lib.checkpoint import atomic_write
    start, directory = time.time(), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ENGINE_FILE).write_text(str(os.getpid()))
    path = directory / "accs.json"
    accs = json.loads(path.read_text()) if path.exists() else []
    first = len(accs)
    for epoch in range(first, epochs):
        faults.point("trial-epoch")
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
    def acc(self):
        return self.accs[-1]

    @property
    def epochs_trained(self):
        return self.epochs - self.first_epoch


@dataclass
class SearchResult:
    """Every finished job of a search, in the order they finished.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    name: str
    jobs: list
    ranks: list
    started: float
    elapsed: float
    lost_ranks: list = field(default_factory=list)

    @property
    def best(self):
        """(accuracy, configuration) of the best finished job."""
        job = max(self.jobs, key=lambda j: j.acc)
        return job.acc, job.config

    @property
    def epochs_spent(self):
        return sum(j.epochs_trained for j in self.jobs)

    @property
    def retried(self):
        """Jobs started again because their engine died."""
        return [j for j in self.jobs if j.retried]

    def busy_fraction(self):
        """Time the engines spent in trials over the time they were there for."""
        return sum(j.end - j.start for j in self.jobs) / (len(self.ranks) * self.elapsed)

    def best_so_far(self):
        """(seconds since the start, epochs spent, best accuracy) after each finished job."""
        out, best, spent = [], 0.0, 0
        for j in sorted(self.jobs, key=lambda j: j.end):
            best, spent = max(best, j.acc), spent + j.epochs_trained
            out.append((j.end - self.started, spent, best))
        return np.array(out)


# ---------------------------------------------------------------- the policies
class RandomSearch:
    """Every configuration trained to ``max_epochs``, in any order.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""

    def __init__(self, configs, max_epochs):
        self.queue = list(enumerate(configs))[::-1]
        self.max_epochs = max_epochs

    def next(self):
        if self.queue:
            config_id, config = self.queue.pop()
            return Job(config_id, config, 0, self.max_epochs)
        return None

    def report(self, job):
        pass


class SuccessiveHalving:
    """Synchronous successive halving: every configuration for ``min_epochs``, then the best
    1/``eta`` of a *complete* rung ``eta`` times longer, up to ``max_epochs``.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""

    def __init__(self, configs, min_epochs, max_epochs, eta=3, first_id=0):
        self.eta, self.max_epochs = eta, max_epochs
        self.rung, self.epochs = 0, min(min_epochs, max_epochs)
        self.todo = list(enumerate(configs, first_id))[::-1]
        self.expected, self.results, self.finished = len(self.todo), [], not self.todo

    def next(self):
        if self.todo:
            config_id, config = self.todo.pop()
            return Job(config_id, config, self.rung, self.epochs)
        return None  # the rung is not complete yet: an engine may have to wait

    def report(self, job):
        self.results.append(job)
        if len(self.results) < self.expected:
            return
        keep = max(1, len(self.results) // self.eta)
        if self.epochs >= self.max_epochs or len(self.results) == 1:
            self.finished = True
            return
        best = sorted(self.results, key=lambda j: -j.acc)[:keep]
        self.rung, self.epochs = self.rung + 1, min(self.epochs * self.eta, self.max_epochs)
        self.todo = [(j.config_id, j.config) for j in best][::-1]
        self.expected, self.results = keep, []


class ASHA:
    """Asynchronous successive halving: when asked, promote the best configuration of the
    highest rung that is in the top 1/``eta`` of that rung's results so far and not yet
    promoted; else start a new configuration (from ``configs``, which may be endless); never
    wait. ``budget``: start no job that would take the epochs spent or running past it.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""

    def __init__(self, configs, min_epochs, max_epochs, eta=3, budget=None):
        self.eta, self.budget, self.spent = eta, budget, 0
        self.new, self.configs = enumerate(configs), {}
        self.epochs = [min(min_epochs, max_epochs)]
        while self.epochs[-1] < max_epochs:
            self.epochs.append(min(self.epochs[-1] * eta, max_epochs))
        self.results = [{} for _ in self.epochs]      # rung -> {config_id: accuracy}
        self.promoted = [set() for _ in self.epochs]  # rung -> config ids sent up already

    def next(self):
        job = self._promotion() or self._new()
        if job is not None:
            self.spent += self._cost(job.rung)
        return job

    def _cost(self, rung):
        """Epochs a job of ``rung`` adds (a promotion resumes from the rung below)."""
        return self.epochs[rung] - (self.epochs[rung - 1] if rung else 0)

    def _affordable(self, rung):
        return self.budget is None or self.spent + self._cost(rung) <= self.budget

    def _promotion(self):
        for rung in range(len(self.epochs) - 2, -1, -1):
            if not self._affordable(rung + 1):
                continue
            ranked = sorted(self.results[rung], key=lambda c: -self.results[rung][c])
            for config_id in ranked[:len(ranked) // self.eta]:
                if config_id not in self.promoted[rung]:
                    self.promoted[rung].add(config_id)
                    return Job(config_id, self.configs[config_id], rung + 1,
                               self.epochs[rung + 1])
        return None

    def _new(self):
        if not self._affordable(0):
            return None
        config_id, config = next(self.new, (None, None))
        if config_id is None:
            return None
        self.configs[config_id] = config
        return Job(config_id, config, 0, self.epochs[0])

    def report(self, job):
        self.results[job.rung][job.config_id] = job.acc


class Hyperband:
    """Brackets of synchronous successive halving, one after another: bracket s starts
    ceil((s_max + 1) / (s + 1) * eta**s) configurations at ``max_epochs / eta**s`` epochs.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""

    def __init__(self, space, min_epochs, max_epochs, eta=3, seed=0):
        rng = np.random.default_rng(seed)
        s_max = int(math.floor(math.log(max_epochs / min_epochs, eta) + 1e-9))
        self.brackets, first_id = [], 0
        for s in range(s_max, -1, -1):
            n = math.ceil((s_max + 1) / (s + 1) * eta ** s)
            r = max(min_epochs, round(max_epochs / eta ** s))
            configs = [sample(space, rng) for _ in range(n)]
            self.brackets.append(SuccessiveHalving(configs, r, max_epochs, eta, first_id))
            first_id += n
        self.current = 0

    def next(self):
        while self.brackets[self.current].finished and self.current + 1 < len(self.brackets):
            self.current += 1
        return self.brackets[self.current].next()

    def report(self, job):  # brackets run one after another: a result is the current one's
        self.brackets[self.current].report(job)


# ---------------------------------------------------------------- the loop
def _arm(specs, directory):
    from course_lib.engine import ENGINE
    faults.arm_once(specs, directory, ENGINE["rank"])


def run(cluster, policy, trial=train_trial, directory=None, ranks=None, name=None,
        timeout=300.0, on_result=None, faults=(), **trial_kwargs):
    """Drive ``policy`` on ``cluster``: keep every engine of ``ranks`` busy with the policy's
    jobs (``trial(config, epochs, directory, **trial_kwargs)`` on whichever engine is free) and
    report each result as it arrives (then call ``on_result(jobs so far)``). A job whose engine
    dies is started again on another (from its checkpoint). Every wait has the deadline
    ``timeout`` s. ``faults``: fault points armed on the engines for this search, e.g.
    ``["trial-epoch:kill@5:rank=2"]`` (rank 2 dies in the 5th epoch it trains).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import ipyparallel as ipp
    directory = Path(directory or tempfile.mkdtemp(prefix="course-hpsearch-"))
    ranks = list(range(cluster.n) if ranks is None else ranks)
    if faults:
        cluster.run(_arm, list(faults), str(directory))
    try:
        return _drive(cluster, policy, trial, directory, ranks, name, timeout, on_result,
                      trial_kwargs, ipp)
    finally:
        if faults:  # on the engines still alive: nothing stays armed for the next search
            live = [cluster.engine_ids[r] for r in ranks if r not in cluster.dead_ranks()]
            cluster.client[live].apply_sync(_disarm)


def _disarm():
    faults.disarm()


def _drive(cluster, policy, trial, directory, ranks, name, timeout, on_result, trial_kwargs,
           ipp):
    view, lost, jobs, running = cluster.balanced_view(ranks), [], [], {}
    started, deadline = time.time(), time.monotonic() + timeout

    def submit(job):
        path = directory / f"config-{job.config_id:04d}"
        for _ in range(len(ranks) + 1):
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
            time.sleep(0.005)
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


def simulate(policy, num_engines, epoch_s=1.0, overhead_s=0.0, name=None):
    """Run ``policy`` on ``num_engines`` imaginary engines with :func:`surrogate` trials, on a
    simulated clock (no cluster, no waiting): the same decisions :func:`run` makes, at any
    scale. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import heapq
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


# ---------------------------------------------------------------- the searches
def _configs(space, num_configs, seed):
    check_count("num_configs", num_configs)
    rng = np.random.default_rng(seed)
    return [sample(space, rng) for _ in range(num_configs)]


def random_search(cluster, num_configs=9, max_epochs=9, space=SPACE, seed=0, **run_kwargs):
    """``num_configs`` random configurations, each trained to ``max_epochs`` (:func:`run`'s
    arguments pass through). Introduced in notebooks/13_hyperparameter_search.ipynb."""
    policy = RandomSearch(_configs(space, num_configs, seed), max_epochs)
    return run(cluster, policy, name="random search", **run_kwargs)


def grid_search(cluster, num=2, max_epochs=9, space=SPACE, **run_kwargs):
    """Every combination of :func:`grid` trained to ``max_epochs``.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    return run(cluster, RandomSearch(grid(space, num), max_epochs), name="grid search",
               **run_kwargs)


def successive_halving(cluster, num_configs=27, min_epochs=1, max_epochs=9, eta=3, space=SPACE,
                       seed=0, **run_kwargs):
    """Synchronous successive halving of ``num_configs`` random configurations.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    policy = SuccessiveHalving(_configs(space, num_configs, seed), min_epochs, max_epochs, eta)
    return run(cluster, policy, name="successive halving", **run_kwargs)


def asha(cluster, num_configs=27, min_epochs=1, max_epochs=9, eta=3, space=SPACE, seed=0,
         budget=None, **run_kwargs):
    """ASHA over ``num_configs`` random configurations; or, with ``budget`` (epochs), over as
    many as that budget allows (each engine busy until it is spent).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    rng = np.random.default_rng(seed)
    configs = (sample(space, rng) for _ in itertools.count()) if budget is not None else \
        _configs(space, num_configs, seed)
    policy = ASHA(configs, min_epochs, max_epochs, eta, budget)
    return run(cluster, policy, name="ASHA", **run_kwargs)


def halving_budget(num_configs=27, min_epochs=1, max_epochs=9, eta=3):
    """Epochs synchronous successive halving spends on ``num_configs`` (promotions resume, so
    a promoted configuration costs only its extra epochs).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    total, n, epochs, done = 0, num_configs, min(min_epochs, max_epochs), 0
    while True:
        total += n * (epochs - done)
        if epochs >= max_epochs or n == 1:
            return total
        n, done, epochs = max(1, n // eta), epochs, min(epochs * eta, max_epochs)


def hyperband(cluster, min_epochs=1, max_epochs=9, eta=3, space=SPACE, seed=0, **run_kwargs):
    """Hyperband: brackets of successive halving, one after another.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    policy = Hyperband(space, min_epochs, max_epochs, eta, seed)
    return run(cluster, policy, name="Hyperband", **run_kwargs)
