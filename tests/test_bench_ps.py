"""bench ps: the options, the table, and one real (tiny) run through the command line."""

import csv
import subprocess
import sys

import numpy as np
import pytest

from course_lib.bench import ps as bench_ps
from course_lib.models import Quadratic
from course_lib.testing import command_line


def test_quadratic_gradient_is_the_sum_over_samples():
    q, theta = Quadratic(), np.array([0.0, 3.0])
    assert np.allclose(q.grad_sum(theta, np.zeros((4, 1)), None), [-4.0, 8.0])
    assert q.loss(theta, np.zeros((2, 1)), None) == pytest.approx(2.5)


def test_options_are_checked():
    assert bench_ps.ints("1,2,3") == [1, 2, 3]
    for bad in ["", "0", "1,-2"]:
        with pytest.raises(ValueError):
            bench_ps.ints(bad)
    out = command_line.run("bench", "ps", "--modes", "fast")
    assert out.returncode == 1 and "--modes" in out.stderr


def test_a_tiny_run_prints_every_row(tmp_path):
    path = tmp_path / "ps.csv"
    out = subprocess.run([sys.executable, "-m", "course_lib", "bench", "ps", "--servers", "1,2",
                          "--workers", "1", "--params", "4K", "--steps", "3", "--csv", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(open(path)))
    assert [(r["mode"], r["servers"], r["workers"]) for r in rows] == [
        ("sync", "1", "1"), ("sync", "2", "1"), ("async", "1", "1"), ("async", "2", "1")]
    assert all(float(r["pushes_per_s"]) > 0 and r["params"] == "4096" for r in rows)
    assert "pushes/s" in out.stdout and "MB/s/server" in out.stdout


def test_servers_count_bytes_both_ways():
    """Each step a server takes in W shards and sends out W (plus the start: init and pulls)."""
    n, steps = 4096, 3
    rows = [r for r in _run_rows("--servers", "1,2", "--workers", "1", "--params", "4K",
                                 "--steps", str(steps), "--modes", "sync")]
    for r in rows:
        shard = 8 * n / int(r["servers"])
        per_step = float(r["server_mb_per_step"]) * 1e6
        assert 2 * shard <= per_step <= 2 * shard * (1 + 2 / steps)


def test_the_model_of_a_sync_step_on_an_emulated_link():
    from course_lib.runtime import netem
    link = netem.make_link("1Gbit/s,50us")
    t = link.seconds(8 * 250_000)  # one 2 MB message
    assert bench_ps.predicted_sync_steps(250_000, 1, 1, link) == pytest.approx(1 / (2 * t))
    # one server, W workers: its replies go out one after another, the last push comes back
    # one message later: W + 1 message times per step
    for w in (2, 3):
        assert bench_ps.predicted_sync_steps(250_000, 1, w, link) == pytest.approx(
            1 / ((w + 1) * t))
    assert bench_ps.predicted_sync_steps(250_000, 2, 2, link) > \
        bench_ps.predicted_sync_steps(250_000, 1, 2, link)


def _run_rows(*args):
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ps.csv"
        out = subprocess.run([sys.executable, "-m", "course_lib", "bench", "ps", *args, "--csv",
                              path], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return list(csv.DictReader(open(path)))
