"""bench hpsearch: the rows, the tables and the command line at the smallest size, never the
timings."""

import csv

import pytest

from course_lib import hpsearch_loop
from course_lib.__main__ import main
from course_lib.bench import hpsearch as bench

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py
SMALL = dict(configs=9, max_epochs=3, eta=3)  # budget 9 x 1 + 3 x 2 = 15 epochs


def test_every_search_on_the_same_budget(cluster):
    names = list(bench.NAMES)
    rows = bench.compare(cluster, names, seeds=[0], engines=2, trial=hpsearch_loop.sleep_trial,
                         epoch_s=0.005, **SMALL)
    assert [r["search"] for r in rows] == names and all(r["engines"] == 2 for r in rows)
    epochs = {r["search"]: r["epochs"] for r in rows}
    assert epochs == {"random": 15, "sh": 15, "asha": 15, "hyperband": 3 + 2 + 6,
                      "optuna": 15, "optuna-hyperband": 15}
    assert all(0 < r["busy"] <= 1 and r["best"] > 0.1 and r["seconds"] > 0 for r in rows)
    text = bench.format_search_table(rows, 2, trial_name="sleep", **SMALL)
    for name in bench.NAMES.values():
        assert f"\n{name} " in text
    assert "best/ASHA" in text and "budget 15 epochs" in text
    asha = next(line for line in text.splitlines() if line.startswith("ASHA "))
    assert asha.split()[-2:] == ["1.000x", "1.00x"]  # ASHA over itself
    assert "Optuna/ASHA" in text  # the seed-by-seed table


def test_speedup_rows_and_table(cluster):
    rows = bench.speedup(cluster, [1, 2], seeds=[0], epoch_s=0.005, **SMALL)
    assert [(r["search"], r["engines"]) for r in rows] == [("sh", 1), ("asha", 1), ("sh", 2),
                                                           ("asha", 2)]
    assert all(r["epochs"] == 15 and r["simulated_s"] > 0 for r in rows)
    one, endless = (bench.simulated("sh", n, epoch_s=0.005, **SMALL).elapsed for n in (1, 99))
    assert rows[0]["simulated_s"] == pytest.approx(one) and endless < one
    concurrency = bench.sleep_concurrency(cluster, 2, seconds=0.05)
    assert 0.5 < concurrency <= 2.0
    text = bench.format_speedup_table(rows, 0.005, concurrency, (one, endless))
    lines = text.splitlines()
    assert lines[2].split()[-7:-4] == ["1.00x", "1x", "100%"]  # SH, 1 engine: the baseline
    assert "linear" in lines[1] and "ceiling" in lines[-1] and "CPU cores" in lines[-1]


def test_the_command_line(tmp_path, capsys):
    path = tmp_path / "hp.csv"
    assert main(["bench", "hpsearch", "--seeds", "1", "--searches", "asha,optuna",
                 "--search-engines", "2", "--engines", "1,2", "--trial", "sleep",
                 "--epoch-ms", "5", "--configs", "9", "--max-epochs", "3", "--csv",
                 str(path)]) == 0
    out = capsys.readouterr().out
    assert "Optuna (ASHA)" in out and "speed-up" in out and "ceiling" in out
    rows = list(csv.DictReader(path.open()))
    assert [(r["table"], r["search"]) for r in rows] == [
        ("search", "asha"), ("search", "optuna"), ("speedup", "sh"), ("speedup", "asha"),
        ("speedup", "sh"), ("speedup", "asha")]
    assert set(rows[0]) == set(bench.COLUMNS)
    assert main(["bench", "hpsearch", "--eta", "1"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "hpsearch", "--searches", "bayes"])
