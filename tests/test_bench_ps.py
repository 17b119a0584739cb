"""bench ps: the options, the table, and one real (tiny) run through the command line."""

import csv
import subprocess
import sys

import numpy as np
import pytest

from course_lib.bench import ps as bench_ps


def test_quadratic_gradient_is_the_sum_over_samples():
    q, theta = bench_ps.Quadratic(), np.array([0.0, 3.0])
    assert np.allclose(q.grad_sum(theta, np.zeros((4, 1)), None), [-4.0, 8.0])
    assert q.loss(theta, np.zeros((2, 1)), None) == pytest.approx(2.5)


def test_options_are_checked():
    assert bench_ps._ints("1,2,3") == [1, 2, 3]
    for bad in ["", "0", "1,-2"]:
        with pytest.raises(ValueError):
            bench_ps._ints(bad)
    out = subprocess.run([sys.executable, "-m", "course_lib", "bench", "ps", "--modes", "fast"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--modes" in out.stderr


def test_a_tiny_run_prints_every_row(tmp_path):
    path = tmp_path / "ps.csv"
    out = subprocess.run([sys.executable, "-m", "course_lib", "bench", "ps", "--servers", "1,2",
                          "--workers", "1", "--params", "4K", "--steps", "3", "--csv", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(open(path)))
    assert [(r["mode"], r["servers"], r["workers"]) for r in rows] == [
        ("sync", "1", "1"), ("sync", "2", "1"), ("async", "1", "1"), ("async", "2", "1")]
    assert all(float(r["pushes_per_s"]) > 0 and r["params"] == "4096" for r in rows)
    assert "pushes/s" in out.stdout and "MB/s/server" in out.stdout
