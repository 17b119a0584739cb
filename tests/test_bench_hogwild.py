"""bench hogwild (course_lib/bench_hogwild.py): the table and the CSV, never the timings."""

import csv

import pytest

from course_lib.__main__ import main
from course_lib.bench import hogwild as bench_hogwild


def test_measure_table_and_csv(tmp_path):
    rows, serial = bench_hogwild.measure(workers=(1, 2), repeats=1, n_samples=2000,
                                         n_features=2000, nnz=8, num_epochs=2)
    assert [(r["workers"], r["mode"]) for r in rows] == [
        (1, "lock-free"), (1, "locked"), (2, "lock-free"), (2, "locked")]
    assert rows[0]["speedup_vs_1"] == 1.0 and all(r["samples_per_s"] > 0 for r in rows)
    assert rows[0]["loss_vs_serial"] == pytest.approx(1.0, abs=1e-12)  # 1 worker == serial
    assert all(r["conflict_rate"] == 0 for r in rows if r["workers"] == 1 or r["mode"] == "locked")
    text = bench_hogwild.format_table(rows, serial, nnz=8, n_features=2000)
    assert "lock-free" in text and "vs 2 locked" in text and "target >= 1.6x" in text
    path = tmp_path / "h.csv"
    bench_hogwild.write_csv(rows, path)
    read = list(csv.DictReader(path.open()))
    assert len(read) == 4 and set(read[0]) == set(bench_hogwild.COLUMNS)


def test_cli(tmp_path, capsys):
    path = tmp_path / "cli.csv"
    assert main(["bench", "hogwild", "--workers", "1", "--repeats", "1", "--samples", "500",
                 "--features", "500", "--nnz", "4", "--epochs", "1", "--csv", str(path)]) == 0
    assert "samples/s" in capsys.readouterr().out and path.exists()
    with pytest.raises(SystemExit):
        main(["bench", "hogwild", "--workers", "0"])
