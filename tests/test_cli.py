"""The command line: demo, doctor, labs, images and cluster clean all run and say something."""

import subprocess
import sys

from course_lib.testing import command_line


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "course_lib", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_demo_runs_every_part_and_every_check_passes(tmp_path):
    out = _cli("demo", "-n", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    for row in ["cluster", "batch GD", "SGD", "mini-batch SGD", "sum of 2 shard gradients",
                "1F1B pipeline, 2 stages", "ZeRO-3, 2 ranks", "rank 1 killed, 2 ranks",
                "ring attention, 2 ranks", "tensor-parallel decoding, 2 ranks",
                "continuous (paged) vs static (contiguous) batching"]:
        assert row in out.stdout
    assert "✗" not in out.stdout
    assert (tmp_path / "demo_gd_loss_curves.png").stat().st_size > 10_000


def test_doctor_ends_with_a_verdict():
    out = _cli("doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("doctor: ready")
    assert "allreduce" in out.stdout


def test_labs_are_up_to_date():
    out = command_line.run("labs", "check")
    assert out.returncode == 0, out.stdout


def test_images_are_regenerated(tmp_path):
    out = _cli("images", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert len(list(tmp_path.glob("*.png"))) >= 4


def test_cluster_clean_runs_when_there_is_nothing_to_clean():
    out = command_line.run("cluster", "clean")
    assert out.returncode == 0 and out.stdout.startswith("stopped")


def test_unknown_command_is_an_error():
    out = command_line.run("fly")
    assert out.returncode == 2 and "invalid choice: 'fly'" in out.stderr
