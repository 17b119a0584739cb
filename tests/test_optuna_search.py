"""Optuna beside our searches: one shared study in a journal file, every engine a worker, the
budget in epochs kept exactly, pruned trials stopped at a rung, a real search that finds a good
setting, and an engine killed mid-search that does not stop the others."""

import optuna
import pytest

from course_lib import hpsearch, hpsearch_loop
from course_lib.testing import hpsearch as optuna_hpsearch

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py


def _in_space(config):
    lo, hi = hpsearch.SPACE["lr"][1:]
    return lo <= config["lr"] <= hi and all(
        config[k] in hpsearch.SPACE[k][1] for k in ("batch_size", "width", "warmup"))


@pytest.mark.parametrize("pruner", ["asha", "hyperband"])
def test_one_study_shared_by_every_engine(cluster, tmp_path, pruner):
    result = optuna_hpsearch.optuna_search(cluster, budget_epochs=63, pruner=pruner,
                                           trial=hpsearch_loop.sleep_trial, epoch_s=0.01,
                                           directory=tmp_path)
    assert (tmp_path / optuna_hpsearch.JOURNAL).stat().st_size > 0
    study = optuna.load_study(study_name=optuna_hpsearch.STUDY,
                              storage=optuna_hpsearch.journal_storage(
                                  tmp_path / optuna_hpsearch.JOURNAL))
    ranks = {t.user_attrs["rank"] for t in study.trials if "rank" in t.user_attrs}
    pids = {t.user_attrs["pid"] for t in study.trials if "pid" in t.user_attrs}
    assert len(ranks) > 1 and len(pids) == len(ranks) and pids <= set(cluster.pids)
    assert result.epochs_spent == 63  # the shared counter: exactly the budget
    assert int((tmp_path / optuna_hpsearch.SPENT).read_text()) == 63
    assert result.pruned and all(j.epochs in (1, 3) for j in result.jobs  # stopped at a rung
                                 if j.config_id in result.pruned)
    assert all(j.epochs == 9 for j in result.jobs if j.config_id in result.complete)
    assert {j.rank for j in result.jobs} <= ranks and all(_in_space(j.config)
                                                          for j in result.jobs)
    configs = {tuple(sorted(j.config.items())) for j in result.jobs}
    assert len(configs) == len(result.jobs)  # seeded per engine: no two draw the same
    rows = result.best_so_far()
    assert rows[-1, 1] == 63 and rows[-1, 2] == result.best[0] > 0.5
    assert 0 < result.busy_fraction() <= 1 and not result.lost_ranks
    more = optuna_hpsearch.optuna_search(cluster, budget_epochs=63 + 9, pruner=pruner,
                                         trial=hpsearch_loop.sleep_trial, epoch_s=0.01,
                                         directory=tmp_path)  # the same study goes on
    assert more.epochs_spent == 9 and min(more.states) == max(result.states) + 1


def test_a_real_search_finds_a_good_setting(cluster, tmp_path):
    result = optuna_hpsearch.optuna_search(cluster, budget_epochs=36, directory=tmp_path,
                                           seed=1)
    assert result.epochs_spent == 36 and result.best[0] > 0.9
    assert len(list(tmp_path.glob("trial-*/step-*.pt"))) == len(result.jobs)  # checkpoints


def test_bad_names_fail_before_any_engine_starts(cluster):
    with pytest.raises(ValueError, match="pruner"):
        optuna_hpsearch.optuna_search(cluster, pruner="median")
    with pytest.raises(ValueError, match="sampler"):
        optuna_hpsearch.optuna_search(cluster, sampler="grid")


def test_a_killed_engine_ends_only_its_own_part(cluster, tmp_path):
    result = optuna_hpsearch.optuna_search(cluster, budget_epochs=63, directory=tmp_path,
                                           trial=hpsearch_loop.sleep_trial, epoch_s=0.01,
                                           faults=["trial-epoch:kill@3:rank=1"])
    assert result.lost_ranks == [1]
    assert result.epochs_spent == 62  # the epoch it died in was claimed, never trained
    assert {j.rank for j in result.jobs} - {1} == {0, 2, 3}  # the others went on
    failed = [t for t in result.study().trials if t.state == optuna.trial.TrialState.FAIL]
    assert [t.user_attrs["rank"] for t in failed] == [1]  # the trial it died in, marked FAIL
    assert "RUNNING" not in result.states.values()
    # (the cluster's next run restarts the engine: tests/test_hpsearch.py checks that)
