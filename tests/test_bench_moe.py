"""bench moe: one small real run through the command line, and its errors."""

import csv
import subprocess
import sys

from course_lib.testing import command_line


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "course_lib", "bench", "moe", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_small_run_prints_every_table(tmp_path):
    out = _bench("--world-sizes", "2", "--steps", "3", "--sizes", "1KiB,8KiB", "--repeats", "1",
                 "--capacity-factors", "none,1.0", "--links", "1Gbit/s,50us",
                 "--csv", str(tmp_path / "m.csv"))
    assert out.returncode == 0, out.stdout + out.stderr
    for table in ("# balance", "# capacity", "# all-to-all", "# experts split", "# ceiling"):
        assert table in out.stdout
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert [r["table"] for r in rows] == ["balance"] * 4 + ["capacity"] * 2 + \
        ["all_to_all"] * 2 + ["split"]
    capacity = rows[4:6]
    assert int(capacity[0]["dropped"]) == 0 < int(capacity[1]["dropped"])  # skewed: drops
    split = rows[-1]
    # experts split send less: N / k times less (top-1, N = 2), plus the counts
    assert 1.6 < int(split["tp_sent"]) / int(split["ep_sent"]) < 2.4
    for r in rows[6:8]:
        assert float(r["naive_ms"]) > 0 and float(r["pairwise_model_ms"]) > 0


def test_bad_options_are_refused():
    def bench(*args):
        return command_line.run("bench", "moe", *args)
    out = bench("--world-sizes", "3", "--steps", "1")
    assert out.returncode == 1 and "4 experts do not split over 3 ranks" in out.stderr
    assert bench("--repeats", "0").returncode == 1
    assert bench("--sizes", "x").returncode == 2
