"""course_lib.runtime.launch's command line from a notebook: run_cli and bench_rows run
``python -m course_lib ...`` in a subprocess, return its output or rows, and fail with the
command and its stderr's tail, or within their deadline, never hanging; the clean-up removes the
rendezvous folders of clusters whose owner is gone."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from course_lib.runtime import launch
from course_lib.testing.timing import assert_no_hang


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_bench_rows_over_mpiexec_returns_typed_rows(capsys):
    rows = launch.bench_rows("allreduce", deadline=120, transport="mpi", launcher="mpiexec",
                             world_size=2, sizes="4K", algorithms=["native", "ring"], iters=1,
                             warmup=0, time_limit=60)
    assert [(r["algorithm"], r["world_size"], r["size"]) for r in rows] == \
        [("native", 2, 4096), ("ring", 2, 4096)]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["link"] is None for r in rows)
    assert isinstance(rows[0]["time_us"], float) and rows[0]["transport"] == "mpi"
    out = capsys.readouterr().out
    assert out.startswith("$ python -m course_lib bench allreduce --transport mpi --launcher "
                          "mpiexec --world-size 2 --sizes 4K --algorithms native,ring")
    assert "--csv" not in out and "finished in" in out


def test_options_become_flags_and_a_failure_names_the_command(capsys):
    with pytest.raises(RuntimeError, match=r"(?s)`python -m course_lib bench allreduce "
                       r"--sizes 4Q --no-check .*` exited with status 2.*bad size '4Q'"):
        launch.bench_rows("allreduce", deadline=60, sizes="4Q", check=None, no_check=True,
                          link=False)
    assert capsys.readouterr().out.startswith("$ python -m course_lib bench allreduce "
                                              "--sizes 4Q --no-check\n")


def test_a_run_past_its_deadline_is_stopped(tmp_path, monkeypatch):
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nsleep 60\n")
    slow.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow))
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"`python -m course_lib doctor` did not finish "
                                           r"within 0.5 s and was stopped"):
        launch.run_cli("doctor", deadline=0.5, echo=False)
    assert_no_hang(time.monotonic() - t, 0.5, timed_out=True, instead=60)


def test_clean_removes_the_rendezvous_folders_whose_owner_is_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()  # its pid is free now: a killed kernel's
    dead = tmp_path / f"{launch.STORE_PREFIX}{gone.pid}-k1ll3d"
    live = tmp_path / f"{launch.STORE_PREFIX}{os.getpid()}-al1ve"
    other = tmp_path / "course_lib-slurm-0"  # not a rendezvous folder: never touched
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "store-x").write_text("")
    assert launch.clean_stores(tmp_path) == [str(dead)]
    assert not dead.exists() and (live / "store-x").exists() and other.exists()
