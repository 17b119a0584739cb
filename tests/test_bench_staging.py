"""bench staging: the options, the model table, and one real (tiny) run through the command
line, whose rows are checked, never its timings."""

import csv
import subprocess
import sys

from course_lib.testing import command_line


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "course_lib", "bench", "staging", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_the_model_alone_lists_every_gpu_path():
    from course_lib import costmodel
    out = command_line.run("bench", "staging", "--model-only")
    assert out.returncode == 0, out.stderr
    for name in costmodel.gpu_paths():
        assert name in out.stdout
    assert "pipelined, 4 MiB chunks" in out.stdout and "1 GiB" in out.stdout


def test_bad_options_are_refused():
    assert command_line.run("bench", "staging", "--sizes", "12Q").returncode == 2
    out = command_line.run("bench", "staging", "--repeats", "0")
    assert out.returncode == 1 and "--repeats" in out.stderr


def test_a_tiny_run_prints_every_row(tmp_path):
    path = tmp_path / "staging.csv"
    out = _bench("--sizes", "256K,1M", "--link", "1Gbit/s,50us", "--chunk", "128K",
                 "--repeats", "1", "--csv", str(path))
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(open(path)))
    assert [(r["bytes"], r["link"].split(" (")[0]) for r in rows] == [
        ("262144", "loopback"), ("1048576", "loopback"),
        ("262144", "1 Gbit/s, 50 us"), ("1048576", "1 Gbit/s, 50 us")]
    assert all(r["intact"] == "True" for r in rows)
    assert "ceiling: memcpy" in out.stdout and "GPUDirect RDMA" in out.stdout
