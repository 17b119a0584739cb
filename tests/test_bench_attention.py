"""bench attention: one small real run through the command line, and its errors."""

import subprocess
import sys


def _bench(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "course_lib", "bench", "attention", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_small_run_prints_every_column(tmp_path):
    out = _bench("--world-sizes", "2", "--lengths", "64", "--repeats", "1", "--links",
                 "1Gbit/s,50us;100Mbit/s,100us",
                 "--csv", str(tmp_path / "a.csv"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "slowest/mean contiguous" in out.stdout and "Ulysses ms" in out.stdout
    assert "TP ms" in out.stdout and "100 Mbit/s, 100 us" in out.stdout
    assert "# ceiling: memcpy" in out.stdout
    assert (tmp_path / "a.csv").read_text().startswith("world_size,length,")


def test_a_length_that_does_not_split_is_refused():
    out = _bench("--world-sizes", "2", "--lengths", "30", "--repeats", "1")
    assert out.returncode == 1 and "not divisible by 2N = 4" in out.stderr
    assert _bench("--lengths", "x").returncode == 2
