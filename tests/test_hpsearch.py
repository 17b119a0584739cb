"""Hyper-parameter search: the policies decide as the papers say, a promotion resumes exactly,
synchronous halving waits for its rungs and ASHA does not, a killed engine's trial runs again."""

import os

import numpy as np
import pytest

from course_lib import hpsearch, hpsearch_loop
from course_lib.hpsearch import ASHA, Hyperband, SuccessiveHalving

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py


def _finish(job, acc):
    job.accs = [acc] * job.epochs
    return job


def test_sample_and_grid():
    rng = np.random.default_rng(0)
    configs = [hpsearch.sample(hpsearch.SPACE, rng) for _ in range(200)]
    lrs = np.array([c["lr"] for c in configs])
    assert lrs.min() >= 0.003 and lrs.max() <= 3.0 and np.median(lrs) < 0.3  # log-uniform
    assert {c["batch_size"] for c in configs} == {16, 32, 64, 128}
    assert all(type(c["width"]) is int for c in configs)
    assert len(hpsearch.grid(hpsearch.SPACE, num=2)) == 2 * 4 * 4 * 3
    with pytest.raises(ValueError, match="unknown kind"):
        hpsearch.sample({"x": ("normal", 0, 1)}, rng)


def test_successive_halving_keeps_the_best_third_of_each_complete_rung():
    sh = SuccessiveHalving([{"k": i} for i in range(27)], 1, 9, eta=3)
    rungs = []
    while not sh.finished:
        jobs = [job for job in iter(sh.next, None)]   # a whole rung, then nothing: wait
        rungs.append((len(jobs), jobs[0].epochs))
        for job in jobs:
            sh.report(_finish(job, acc=job.config["k"] / 27))
    assert rungs == [(27, 1), (9, 3), (3, 9)]
    assert hpsearch.halving_budget(27, 1, 9, 3) == 27 * 1 + 9 * 2 + 3 * 6 == 63


def test_asha_promotes_from_partial_rungs_and_stops_at_its_budget():
    asha = ASHA(({"k": i} for i in range(1000)), 1, 9, eta=3, budget=20)
    first = [asha.next() for _ in range(3)]
    assert [j.rung for j in first] == [0, 0, 0]
    for job, acc in zip(first, (0.2, 0.9, 0.5), strict=True):
        asha.report(_finish(job, acc))
    promoted = asha.next()            # 3 results: the top third (one) goes up at once
    assert (promoted.rung, promoted.epochs, promoted.config_id) == (1, 3, 1)
    assert asha.next().rung == 0      # nothing else promotable: a new configuration
    jobs = list(iter(asha.next, None))
    assert asha.spent == 20 and len(jobs) == 20 - 3 - 2 - 1  # new ones of 1 epoch fill it


def test_simulated_asha_outpaces_synchronous_halving_on_many_engines():
    rng = np.random.default_rng(0)
    configs = [hpsearch.sample(hpsearch.SPACE, rng) for _ in range(81)]
    budget = hpsearch.halving_budget(81, 1, 27, 3)
    sh = hpsearch_loop.simulate(SuccessiveHalving(configs, 1, 27, 3), 64)
    asha = hpsearch_loop.simulate(ASHA(iter(configs * 4), 1, 27, 3, budget), 64)
    assert sh.epochs_spent == asha.epochs_spent == budget
    assert [sum(j.rung == k for j in sh.jobs) for k in range(4)] == [81, 27, 9, 3]
    # holds under load: a simulated clock
    assert asha.elapsed < sh.elapsed / 2 and asha.busy_fraction() > 2 * sh.busy_fraction()


def test_hyperband_brackets():
    hb = Hyperband(hpsearch.SPACE, 1, 9, eta=3)
    assert [(b.expected, b.epochs) for b in hb.brackets] == [(9, 1), (5, 3), (3, 9)]
    ids = [cid for b in hb.brackets for cid, _ in b.todo]
    assert sorted(ids) == list(range(17))  # every configuration has its own checkpoint


def test_a_promoted_trial_resumes_exactly(tmp_path):
    config = {"lr": 0.1, "batch_size": 64, "width": 16, "warmup": 1}
    straight = hpsearch_loop.train_trial(config, 3, tmp_path / "straight")
    hpsearch_loop.train_trial(config, 1, tmp_path / "resumed")
    resumed = hpsearch_loop.train_trial(config, 3, tmp_path / "resumed")
    assert resumed["first_epoch"] == 1 and resumed["accs"] == straight["accs"]
    assert straight["accs"][-1] > 0.9


def test_searches_on_the_cluster(cluster, tmp_path):
    sh = hpsearch.successive_halving(cluster, trial=hpsearch_loop.sleep_trial, epoch_s=0.02)
    asha = hpsearch.asha(cluster, trial=hpsearch_loop.sleep_trial, epoch_s=0.02,
                         budget=hpsearch.halving_budget())
    assert [len([j for j in sh.jobs if j.rung == k]) for k in range(3)] == [27, 9, 3]
    assert sh.epochs_spent == asha.epochs_spent == 63  # the same budget
    for k in (1, 2):  # synchronous: a rung starts once the rung below has ended
        assert min(j.start for j in sh.jobs if j.rung == k) >= \
            max(j.end for j in sh.jobs if j.rung == k - 1)
    rung0_end = max(j.end for j in asha.jobs if j.rung == 0)
    assert min(j.start for j in asha.jobs if j.rung == 1) < rung0_end  # asynchronous
    promoted = [j for j in sh.jobs if j.rung > 0]
    assert all(j.first_epoch == {1: 1, 2: 3}[j.rung] for j in promoted)  # resumed
    assert {j.rank for j in sh.jobs} == set(range(cluster.n))
    best = hpsearch.random_search(cluster, num_configs=4, max_epochs=2, directory=tmp_path)
    assert best.best[0] > 0.5 and len(list(tmp_path.glob("config-*/step-*.pt"))) == 4


def test_a_killed_engine_s_trial_runs_again_elsewhere(cluster, tmp_path):
    victim = cluster.pids[2]
    result = hpsearch.successive_halving(cluster, trial=hpsearch_loop.sleep_trial, epoch_s=0.05,
                                         faults=["trial-epoch:kill@4:rank=2"],
                                         directory=tmp_path)
    # the trial rank 2 was running, and at most one more the scheduler had just given it
    # (one task per engine at a time: TaskScheduler.hwm = 1)
    assert result.lost_ranks == [2] and 1 <= len(result.retried) <= 2, result.retried
    assert all(j.retried == 1 for j in result.retried)  # each started again once, not twice
    assert 2 not in {j.rank for j in result.jobs if j.end > result.retried[0].start}
    assert [len([j for j in result.jobs if j.rung == k]) for k in range(3)] == [27, 9, 3]
    assert cluster.run(os.getpid)[2] != victim  # the next call restarted the engine
