"""Hyper-parameter search: the other way to use many machines.

Introduced in notebooks/13_hyperparameter_search.ipynb. Notebooks 02-12 train *one* model on
many workers; a search trains *many* models, one per configuration of the hyper-parameters, each
on one engine. The trials are independent (embarrassingly parallel) until the search decides
which of them to continue: that decision is where the algorithms differ, and where engines can
sit idle::

    result = hpsearch.asha(cluster, num_configs=27, min_epochs=1, max_epochs=9, eta=3)
    result.best, result.busy_fraction(), result.epochs_spent

Every algorithm is a *policy* driven by one loop (``hpsearch_loop.run``): whenever an engine is
free, the loop asks the policy for a job (a configuration and the epoch to train it to), submits
it to the cluster's load-balanced view, and reports each result to the policy as it arrives, in
any order. A promoted configuration resumes from its checkpoint instead of training again from
scratch. The trials, the jobs and the loop are in :mod:`course_lib.hpsearch_loop`; the
policies and the searches built on them are here.

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
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from course_lib.hpsearch_loop import Job, SearchResult, run
from course_lib.runtime.arguments import check_count

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster

SPACE = {"lr": ("log", 0.003, 3.0), "batch_size": ("choice", (16, 32, 64, 128)),
         "width": ("choice", (8, 16, 32, 64)), "warmup": ("choice", (0, 1, 2))}


# ---------------------------------------------------------------- configurations
def sample(space: dict, rng: np.random.Generator) -> dict:
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


def grid(space: dict, num: int = 3) -> list[dict]:
    """Every combination: ``num`` points per numeric range (log-spaced for "log"), every value
    of a choice. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    axes = []
    for name, (kind, *args) in space.items():
        values = (np.geomspace(*args, num) if kind == "log" else
                  np.linspace(*args, num) if kind == "uniform" else args[0])
        axes.append([(name, v.item() if hasattr(v, "item") else v) for v in values])
    return [dict(combination) for combination in itertools.product(*axes)]


# ---------------------------------------------------------------- the policies
class RandomSearch:
    """Every configuration trained to ``max_epochs``, in any order.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""

    def __init__(self, configs: Iterable[dict], max_epochs: int) -> None:
        self.queue = list(enumerate(configs))[::-1]  # reversed: pop() hands them out in order
        self.max_epochs = max_epochs

    def next(self) -> Job | None:
        if self.queue:
            config_id, config = self.queue.pop()
            return Job(config_id, config, 0, self.max_epochs)
        return None

    def report(self, job: Job) -> None:
        pass


class SuccessiveHalving:
    """Synchronous successive halving: every configuration for ``min_epochs``, then the best
    1/``eta`` of a *complete* rung ``eta`` times longer, up to ``max_epochs``.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""

    def __init__(self, configs: Iterable[dict], min_epochs: int, max_epochs: int, eta: int = 3,
                 first_id: int = 0) -> None:
        self.eta, self.max_epochs = eta, max_epochs
        self.rung, self.epochs = 0, min(min_epochs, max_epochs)
        self.todo = list(enumerate(configs, first_id))[::-1]
        self.expected, self.results, self.finished = len(self.todo), [], not self.todo

    def next(self) -> Job | None:
        if self.todo:
            config_id, config = self.todo.pop()
            return Job(config_id, config, self.rung, self.epochs)
        return None  # the rung is not complete yet: an engine may have to wait

    def report(self, job: Job) -> None:
        self.results.append(job)
        if len(self.results) < self.expected:
            return
        keep = max(1, len(self.results) // self.eta)  # the top 1/eta go on, at least one
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

    def __init__(self, configs: Iterable[dict], min_epochs: int, max_epochs: int, eta: int = 3,
                 budget: int | None = None) -> None:
        self.eta, self.budget, self.spent = eta, budget, 0
        self.new, self.configs = enumerate(configs), {}
        self.epochs = [min(min_epochs, max_epochs)]  # rung -> epochs: r, r eta, r eta^2 ..., R
        while self.epochs[-1] < max_epochs:
            self.epochs.append(min(self.epochs[-1] * eta, max_epochs))
        self.results = [{} for _ in self.epochs]      # rung -> {config_id: accuracy}
        self.promoted = [set() for _ in self.epochs]  # rung -> config ids sent up already

    def next(self) -> Job | None:
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
        for rung in range(len(self.epochs) - 2, -1, -1):  # highest first; the top has no rung above
            if not self._affordable(rung + 1):
                continue
            ranked = sorted(self.results[rung], key=lambda c: -self.results[rung][c])
            # the top 1/eta of what this rung has reported so far: with fewer than eta results
            # nobody qualifies yet, and a new configuration starts instead
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

    def report(self, job: Job) -> None:
        self.results[job.rung][job.config_id] = job.acc


class Hyperband:
    """Brackets of synchronous successive halving, one after another: bracket s starts
    ceil((s_max + 1) / (s + 1) * eta**s) configurations at ``max_epochs / eta**s`` epochs.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""

    def __init__(self, space: dict, min_epochs: int, max_epochs: int, eta: int = 3,
                 seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        # Li et al. 2018, Algorithm 1: s_max = floor(log_eta(R / r)) (+ 1e-9: log(243, 3) is
        # 4.999999999999999 in floating point), bracket s starts n configurations at r epochs
        s_max = int(math.floor(math.log(max_epochs / min_epochs, eta) + 1e-9))
        self.brackets, first_id = [], 0
        for s in range(s_max, -1, -1):
            n = math.ceil((s_max + 1) / (s + 1) * eta ** s)
            r = max(min_epochs, round(max_epochs / eta ** s))
            configs = [sample(space, rng) for _ in range(n)]
            self.brackets.append(SuccessiveHalving(configs, r, max_epochs, eta, first_id))
            first_id += n
        self.current = 0

    def next(self) -> Job | None:
        while self.brackets[self.current].finished and self.current + 1 < len(self.brackets):
            self.current += 1
        return self.brackets[self.current].next()

    def report(self, job: Job) -> None:  # brackets run in turn: a result is the current one's
        self.brackets[self.current].report(job)


# ---------------------------------------------------------------- the searches
def configurations(space: dict = SPACE, num_configs: int = 27, seed: int = 0) -> list[dict]:
    """``num_configs`` random configurations of ``space``, the same for a seed.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    check_count("num_configs", num_configs)
    rng = np.random.default_rng(seed)
    return [sample(space, rng) for _ in range(num_configs)]


def random_search(cluster: Cluster, num_configs: int = 9, max_epochs: int = 9, space: dict = SPACE,
                  seed: int = 0, **run_kwargs: Any) -> SearchResult:
    """``num_configs`` random configurations, each trained to ``max_epochs`` (:func:`run`'s
    arguments pass through). Introduced in notebooks/13_hyperparameter_search.ipynb."""
    policy = RandomSearch(configurations(space, num_configs, seed), max_epochs)
    return run(cluster, policy, name="random search", **run_kwargs)


def grid_search(cluster: Cluster, num: int = 2, max_epochs: int = 9, space: dict = SPACE,
                **run_kwargs: Any) -> SearchResult:
    """Every combination of :func:`grid` trained to ``max_epochs``.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    return run(cluster, RandomSearch(grid(space, num), max_epochs), name="grid search",
               **run_kwargs)


def successive_halving(cluster: Cluster, num_configs: int = 27, min_epochs: int = 1,
                       max_epochs: int = 9, eta: int = 3, space: dict = SPACE, seed: int = 0,
                       **run_kwargs: Any) -> SearchResult:
    """Synchronous successive halving of ``num_configs`` random configurations.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    policy = SuccessiveHalving(configurations(space, num_configs, seed), min_epochs, max_epochs,
                               eta)
    return run(cluster, policy, name="successive halving", **run_kwargs)


def asha(cluster: Cluster, num_configs: int = 27, min_epochs: int = 1, max_epochs: int = 9,
         eta: int = 3, space: dict = SPACE, seed: int = 0, budget: int | None = None,
         **run_kwargs: Any) -> SearchResult:
    """ASHA over ``num_configs`` random configurations; or, with ``budget`` (epochs), over as
    many as that budget allows (each engine busy until it is spent).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    rng = np.random.default_rng(seed)
    # with a budget, an endless stream: ASHA stops starting new ones when the budget is spent
    configs = (sample(space, rng) for _ in itertools.count()) if budget is not None else \
        configurations(space, num_configs, seed)
    policy = ASHA(configs, min_epochs, max_epochs, eta, budget)
    return run(cluster, policy, name="ASHA", **run_kwargs)


def halving_budget(num_configs: int = 27, min_epochs: int = 1, max_epochs: int = 9,
                   eta: int = 3) -> int:
    """Epochs synchronous successive halving spends on ``num_configs`` (promotions resume, so
    a promoted configuration costs only its extra epochs).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    total, n, epochs, done = 0, num_configs, min(min_epochs, max_epochs), 0
    while True:
        total += n * (epochs - done)
        if epochs >= max_epochs or n == 1:
            return total
        n, done, epochs = max(1, n // eta), epochs, min(epochs * eta, max_epochs)


def hyperband(cluster: Cluster, min_epochs: int = 1, max_epochs: int = 9, eta: int = 3,
              space: dict = SPACE, seed: int = 0, **run_kwargs: Any) -> SearchResult:
    """Hyperband: brackets of successive halving, one after another.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    policy = Hyperband(space, min_epochs, max_epochs, eta, seed)
    return run(cluster, policy, name="Hyperband", **run_kwargs)
