"""Optuna, the production counterpart of :mod:`course_lib.hpsearch`: every engine a worker of
one shared study. Introduced in notebooks/13_hyperparameter_search.ipynb.

Our searches have one driver that decides and engines that only train. Optuna has no driver:
each engine runs ``study.optimize(objective)`` itself, and the engines coordinate *only*
through the study's storage. Here that is a journal file (``JournalStorage`` over a
``JournalFileBackend``: an append-only log of operations, written under a file lock), which
every engine of one machine, or of a shared file system, can open. SQLite is the wrong storage
for this: Optuna documents it as unsafe for parallel workers (one writer at a time, and
``database is locked`` errors under concurrent writes).

Inside a trial the objective trains one epoch at a time with the course's own trial function
(:func:`course_lib.hpsearch_loop.train_trial` resumes from its checkpoint, so epoch e + 1 costs one
epoch), reports the validation accuracy with ``trial.report(acc, epoch)`` and asks the pruner
``trial.should_prune()``. ``SuccessiveHalvingPruner`` *is* ASHA, decided by each trial for
itself when it reaches a rung; ``HyperbandPruner`` runs brackets of it side by side::

    result = optuna_search(cluster, budget_epochs=63, pruner="asha")
    result.best, result.epochs_spent, result.busy_fraction(), result.pruned

The result is a :class:`course_lib.hpsearch_loop.SearchResult` (one job per trial), so the same
tables and figures show it beside ours.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course_lib import hpsearch_loop
from course_lib.hpsearch import SPACE
from course_lib.hpsearch_loop import Job, SearchError, SearchResult

STUDY = "course-hpsearch"     # the study's name: Hyperband's brackets are a hash of it
JOURNAL = "optuna-journal.log"  # the shared storage, in the search's directory
SPENT = "epochs-claimed"       # the shared epoch counter, in the same directory
PRUNERS = ("asha", "hyperband")
SAMPLERS = ("random", "tpe")


def journal_storage(path):
    """An Optuna storage that several processes share through the file ``path``: a
    ``JournalStorage`` over a ``JournalFileBackend`` (Optuna >= 4; lock by symlink).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    return JournalStorage(JournalFileBackend(str(path)))


def make_pruner(pruner="asha", min_epochs=1, max_epochs=9, eta=3):
    """Optuna's ASHA (``SuccessiveHalvingPruner``: rungs at min_epochs * eta**k epochs) or
    Hyperband (``HyperbandPruner``: brackets of it, up to ``max_epochs``).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import optuna
    if pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_epochs,
                                                      reduction_factor=eta)
    if pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=min_epochs, max_resource=max_epochs,
                                              reduction_factor=eta)
    raise ValueError(f"pruner must be one of {PRUNERS}, not {pruner!r}")


def make_sampler(sampler="random", seed=0):
    """``RandomSampler`` (default: draws like our searches do, so a comparison shows only the
    scheduling) or ``TPESampler`` (Optuna's default, a model of the good configurations after
    10 random ones; ``constant_liar`` so parallel workers do not propose the same point).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import optuna
    if sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    raise ValueError(f"sampler must be one of {SAMPLERS}, not {sampler!r}")


def suggest(trial, space=SPACE):
    """A configuration of ``space`` (the format of :data:`course_lib.hpsearch.SPACE`) drawn by
    the Optuna ``trial``. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    config = {}
    for name, (kind, *args) in space.items():
        if kind in ("log", "uniform"):
            config[name] = trial.suggest_float(name, args[0], args[1], log=kind == "log")
        elif kind == "choice":
            config[name] = trial.suggest_categorical(name, list(args[0]))
        else:
            raise ValueError(f"{name}: unknown kind {kind!r} (log, uniform or choice)")
    return config


def claim_epoch(path, budget, deadline):
    """Take one epoch of the shared ``budget`` counted in the file ``path`` (under an exclusive
    lock, so engines never both take the last one); False once it is spent. Waits for the lock
    until ``deadline`` (time.monotonic()).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    with open(path, "a+") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SearchError(f"{path}: no lock before the deadline") from None
                time.sleep(0.001)
        try:
            f.seek(0)
            spent = int(f.read() or 0)
            if spent >= budget:
                return False
            f.seek(0)
            f.truncate()
            f.write(str(spent + 1))
            f.flush()
            return True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def optimize_on_engine(directory, budget_epochs, max_epochs, settings, trial_fn, trial_kwargs,
                       timeout, ranks=None, faults=()):
    """On every engine: join the shared study in ``directory`` and run ``study.optimize`` until
    the study's ``budget_epochs`` are spent (or ``timeout`` s); each trial trains with
    ``trial_fn`` one epoch further at a time and stops when the pruner says so. ``settings``:
    the study's name, pruner, sampler (seeded per rank), space and rungs. Ranks not in
    ``ranks`` return at once. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import optuna

    from course_lib.runtime import fault_points
    from course_lib.runtime.engine import ENGINE
    rank = ENGINE.get("rank", 0)
    if ranks is not None and rank not in ranks:
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    directory = Path(directory)
    deadline = time.monotonic() + timeout
    s = settings
    study = optuna.load_study(
        study_name=s["study"], storage=journal_storage(directory / JOURNAL),
        sampler=make_sampler(s["sampler"], s["seed"] * 1000 + rank),
        pruner=make_pruner(s["pruner"], s["min_epochs"], max_epochs, s["eta"]))
    trials = []

    def objective(trial):
        config = suggest(trial, s["space"])
        trial.set_user_attr("rank", rank)
        trial.set_user_attr("pid", os.getpid())
        trials.append(trial.number)
        path, acc = directory / f"trial-{trial.number:04d}", None
        for epoch in range(1, max_epochs + 1):
            late = time.monotonic() > deadline
            if late or not claim_epoch(directory / SPENT, budget_epochs, deadline):
                study.stop()  # this engine's loop ends after this trial
                trial.set_user_attr("cut", "deadline" if late else "budget")
                raise optuna.TrialPruned("past the deadline" if late else "budget spent")
            out = trial_fn(config, epoch, str(path), **trial_kwargs)
            acc = out["accs"][-1]
            if epoch == 1:
                trial.set_user_attr("start", out["start"])
            trial.set_user_attr("end", out["end"])
            trial.report(acc, epoch)
            if epoch < max_epochs and trial.should_prune():
                raise optuna.TrialPruned()
        return acc

    if faults:
        fault_points.arm_once(list(faults), str(directory), rank)
    try:
        study.optimize(objective, timeout=timeout)
    finally:
        fault_points.disarm()
    return {"rank": rank, "pid": os.getpid(), "trials": trials}


def _import_optuna():
    import optuna  # noqa: F401  (so the search's clock does not time the import)


@dataclass
class OptunaResult(SearchResult):
    """A :class:`course_lib.hpsearch_loop.SearchResult` of an Optuna study (one job per trial, its
    ``rung`` the highest rung its epochs reached), plus the study's trials by state.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    journal: str = ""
    study_name: str = STUDY
    states: dict = field(default_factory=dict)  # trial number -> "COMPLETE", "PRUNED", ...
    budget_cut: list = field(default_factory=list)  # trials stopped because the budget ran out

    @property
    def pruned(self):
        """Trial numbers the pruner stopped (not counting those the budget stopped)."""
        return [n for n, s in self.states.items() if s == "PRUNED" and n not in self.budget_cut]

    @property
    def complete(self):
        """Trial numbers trained to ``max_epochs``."""
        return [n for n, s in self.states.items() if s == "COMPLETE"]

    def study(self):
        """The study itself, loaded from its journal file."""
        import optuna
        return optuna.load_study(study_name=self.study_name, storage=journal_storage(self.journal))


def _rung(epochs, min_epochs, eta):
    rung = 0
    while min_epochs * eta ** (rung + 1) <= epochs:
        rung += 1
    return rung


def optuna_search(cluster, budget_epochs=63, min_epochs=1, max_epochs=9, eta=3, pruner="asha",
                  seed=0, trial=hpsearch_loop.train_trial, directory=None, timeout=300.0,
                  sampler="random", space=SPACE, ranks=None, faults=(), name=None,
                  **trial_kwargs):
    """Optuna on ``cluster``: one study in a journal file in ``directory``, created here, and
    every engine of ``ranks`` (default all) running ``study.optimize`` on it at once, with
    ``pruner`` "asha" (``SuccessiveHalvingPruner(min_epochs, eta)``) or "hyperband"
    (``HyperbandPruner(min_epochs, max_epochs, eta)``) and ``sampler`` "random" or "tpe",
    seeded ``seed * 1000 + rank`` so the engines draw different configurations. The engines
    stop once the study has trained ``budget_epochs`` epochs (a shared counter: exactly that
    many, unless an engine dies); ``trial(config, epochs, directory, **trial_kwargs)`` trains
    each trial one epoch further at a time. Every wait has the deadline ``timeout`` s; an
    engine that dies ends its own part (its running trial is marked FAIL), not the search.
    A ``directory`` that holds a study already goes on with it: ``budget_epochs`` counts the
    epochs of every call, and the result holds this call's trials.
    A SQLite storage would be unsafe here: Optuna documents it as unfit for parallel workers.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import optuna

    from course_lib.runtime.cluster import EngineDied
    make_pruner(pruner)  # bad names fail here, before any engine starts
    make_sampler(sampler)
    directory = Path(directory or tempfile.mkdtemp(prefix="course-optuna-"))
    directory.mkdir(parents=True, exist_ok=True)
    journal = directory / JOURNAL
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=journal_storage(journal), study_name=STUDY,
                                direction="maximize", load_if_exists=True)
    before = {t.number for t in study.get_trials(deepcopy=False)}  # a study resumed: not ours
    ranks = list(range(cluster.n) if ranks is None else ranks)
    cluster.run(_import_optuna)
    settings = dict(study=STUDY, pruner=pruner, sampler=sampler, seed=seed, space=space,
                    min_epochs=min_epochs, eta=eta)
    started = time.time()
    outs = cluster.run(optimize_on_engine, str(directory), budget_epochs, max_epochs, settings,
                       trial, trial_kwargs, timeout, ranks, tuple(faults), timeout=timeout + 30,
                       allow_dead=True)
    elapsed = time.time() - started
    lost = [r for r, out in enumerate(outs) if isinstance(out, EngineDied)]
    study = optuna.load_study(study_name=STUDY, storage=journal_storage(journal))
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if t.number not in before:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)  # its engine died in it
    jobs, states, cut, late = [], {}, [], []
    for t in study.get_trials(deepcopy=False):
        if t.number in before:
            continue
        states[t.number] = t.state.name
        if t.user_attrs.get("cut") == "budget":
            cut.append(t.number)
        elif t.user_attrs.get("cut") == "deadline":
            late.append(t.number)
        accs = [t.intermediate_values[e] for e in sorted(t.intermediate_values)]
        if not accs:
            continue  # stopped by the budget before its first epoch
        pid = t.user_attrs.get("pid")
        job = Job(t.number, dict(t.params), _rung(len(accs), min_epochs, eta), len(accs),
                  rank=t.user_attrs.get("rank"), start=t.user_attrs["start"],
                  end=t.user_attrs["end"], accs=accs)
        if job.rank is None and pid in cluster.pids:
            job.rank = cluster.pids.index(pid)
        jobs.append(job)
    if late:
        raise SearchError(f"Optuna ({pruner}): no end within {timeout:g}s (trials {late} cut "
                          f"short; {sum(j.epochs for j in jobs)} of {budget_epochs} epochs "
                          f"spent); the study is in {journal}")
    jobs.sort(key=lambda j: j.end)
    label = {"asha": "ASHA", "hyperband": "Hyperband"}[pruner]
    return OptunaResult(name or f"Optuna ({label})", jobs, ranks, started, elapsed, lost,
                        journal=str(journal), states=states, budget_cut=cut)
