"""bench attention: one small real run through the command line, and its errors."""

import csv
import subprocess
import sys

from course_lib import sequence_parallel as sp
from course_lib.testing import command_line


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "course_lib", "bench", "attention", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_small_run_prints_every_table(tmp_path):
    out = _bench("--world-sizes", "2", "--lengths", "64,128", "--repeats", "1", "--links",
                 "1Gbit/s,50us;100Mbit/s,100us",
                 "--csv", str(tmp_path / "a.csv"))
    assert out.returncode == 0, out.stdout + out.stderr
    for table in ("# balance", "# links", "# overlap", "# memory", "# ceiling: memcpy"):
        assert table in out.stdout
    assert "Ulysses" in out.stdout and "100 Mbit/s, 100 us" in out.stdout
    rows = list(csv.DictReader((tmp_path / "a.csv").open()))
    tables = [r["table"] for r in rows]
    assert tables == ["balance"] * 2 + ["links"] * 2 + ["overlap"] * 2 + ["memory"] * 2
    for r in rows[-2:]:  # the bytes each split keeps, measured, are its formula's
        for split in sp.SPLITS:
            assert int(r[f"{split}_bytes"]) == int(r[f"{split}_formula"]) > 0
        assert int(r["ring_bytes"]) < int(r["tp+sp_bytes"]) < int(r["one_process_bytes"])
    for r in rows[2:6]:  # every time measured and modelled
        assert all(float(v) > 0 for k, v in r.items() if k.endswith("_ms") and v)


def test_a_length_that_does_not_split_is_refused():
    out = command_line.run("bench", "attention", "--world-sizes", "2", "--lengths", "30",
                           "--repeats", "1")
    assert out.returncode == 1 and "not divisible by 2N = 4" in out.stderr
    assert "starting" not in out.stderr  # refused before any engine starts
    assert command_line.run("bench", "attention", "--lengths", "x").returncode == 2
