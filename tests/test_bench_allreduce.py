"""The allreduce benchmark: sizes, the table, and real runs that are correct (never timed)."""

import csv
import os
import shutil
import subprocess
import sys

import pytest

from course_lib.bench import allreduce as bench
from course_lib.testing import command_line

ALGORITHMS = ["native", "naive", "tree", "ring", "ring_pipelined"]


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "course_lib", "bench", "allreduce", *args],
                          capture_output=True, text=True, timeout=timeout)


def _table(stdout):
    """Data lines of the printed tables as dicts (header and comment lines start with '#')."""
    names = ["size", "count", "type", "algorithm", "time_us", "predicted_us", "algbw", "busbw",
             "frac", "wrong", "vs_native"]
    return [dict(zip(names, line.split(), strict=True)) for line in stdout.splitlines()
            if line.strip() and not line.startswith("#")]


def test_sizes_parse_like_nccl_tests():
    assert bench.parse_size("512") == 512
    assert bench.parse_size("4K") == 4096 and bench.parse_size("64m") == 64 * 2**20
    assert bench.parse_size("1G") == 2**30 and bench.parse_size("2KiB") == 2048
    assert bench.parse_sizes("1K-8K") == [1024, 2048, 4096, 8192]
    assert bench.parse_sizes("1K-3K") == [1024, 2048]
    assert bench.parse_sizes("1M,16M") == [2**20, 16 * 2**20]
    assert bench.parse_sizes("4K,1M-2M") == [4096, 2**20, 2**21]
    for bad in ["", "1Q", "K", "8K-1K", "0", "1.5K", "-4K"]:
        with pytest.raises(ValueError):
            bench.parse_sizes(bad)
    assert bench.format_size(4 * 2**20) == "4 MiB" and bench.format_size(1536) == "1536 B"
    assert bench.format_size(3 * 2**10) == "3 KiB"


def _row(algorithm, time_us, wrong=0, vs_native=1.0, world_size=4):
    return dict(world_size=world_size, transport="torch", backend="gloo", algorithm=algorithm,
                size=1048576, count=262144, type="float32", time_us=time_us,
                algbw=1048576 / time_us / 1e3, busbw=1048576 / time_us / 1e3 * 1.5,
                wrong=wrong, vs_native=vs_native, iters=10, warmup=2)


def test_table_has_every_column_and_a_block_per_world_size():
    rows = [_row("native", 1000.0), _row("ring", 500.0, vs_native=2.0),
            _row("naive", 2000.0, wrong=3, vs_native=0.5), _row("ring", 400.0, world_size=2)]
    text = bench.format_table(rows, memcpy=10.0)
    assert text.count("# allreduce over torch (gloo), world size") == 2
    assert "world size 4, float32: median of 10 rounds after 2 warm-up(s)" in text
    assert "single-core memcpy 10.00 GB/s" in text
    for word in ["size", "count", "type", "time", "algbw", "busbw", "#wrong", "native"]:
        assert word in text
    lines = {(r["algorithm"], r["time_us"]): r for r in _table(text)}
    ring = lines[("ring", "500.0")]
    assert ring["size"] == "1048576" and ring["count"] == "262144" and ring["type"] == "float32"
    assert ring["algbw"] == "2.097" and ring["busbw"] == "3.146" and ring["frac"] == "31.5%"
    assert ring["vs_native"] == "2.00x" and lines[("naive", "2000.0")]["wrong"] == "3"
    no_ceiling = bench.format_table([_row("ring", 500.0, vs_native=None)])
    assert _table(no_ceiling)[0]["frac"] == "-" and _table(no_ceiling)[0]["vs_native"] == "-"


def test_csv_has_one_row_per_result_with_every_column(tmp_path):
    path = tmp_path / "rows.csv"
    bench.write_csv([_row("native", 1000.0), _row("ring", 500.0)], path, memcpy=10.0)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["algorithm"] for r in rows] == ["native", "ring"]
    assert list(rows[0]) == bench.COLUMNS
    assert float(rows[1]["busbw_of_memcpy"]) == pytest.approx(float(rows[1]["busbw"]) / 10.0)


def _check_run(out, algorithms, sizes, world_size=2):
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _table(out.stdout)
    assert [(int(r["size"]), r["algorithm"]) for r in rows] == [
        (s, a) for s in sizes for a in algorithms]
    assert all(r["wrong"] == "0" for r in rows)
    assert f"world size {world_size}" in out.stdout and "memcpy" in out.stdout
    assert "checks of the from-scratch algorithms:" in out.stdout


def test_cli_through_the_cluster_launcher_writes_the_csv(tmp_path):
    path = tmp_path / "allreduce.csv"
    out = _cli("--world-size", "2", "--sizes", "1K,64K", "--iters", "2", "--csv", str(path))
    _check_run(out, ALGORITHMS, [1024, 65536])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["size"]), r["algorithm"]) for r in rows] == [
        (s, a) for s in [1024, 65536] for a in ALGORITHMS]
    for r in rows:
        assert r["world_size"] == "2" and r["wrong"] == "0" and r["type"] == "float32"
        assert int(r["count"]) == int(r["size"]) // 4 and r["transport"] == "torch"
        seconds = float(r["time_us"]) * 1e-6
        assert float(r["algbw"]) == pytest.approx(int(r["size"]) / seconds / 1e9)
        assert float(r["busbw"]) == pytest.approx(float(r["algbw"]) * 2 * (2 - 1) / 2)
        assert float(r["busbw_of_memcpy"]) == pytest.approx(float(r["busbw"]) / float(r["memcpy"]))
    assert all(float(r["vs_native"]) == 1.0 for r in rows if r["algorithm"] == "native")


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_cli_through_mpiexec_over_mpi():
    out = _cli("--transport", "mpi", "--world-size", "2", "--sizes", "4K", "--iters", "2",
               "--launcher", "mpiexec", "--check-messages")
    _check_run(out, ALGORITHMS, [4096])
    assert "allreduce over mpi" in out.stdout
    assert "checks of the from-scratch algorithms: size header per message" in out.stdout


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_three_ranks_uneven_chunks_and_float16_are_exact():
    out = _cli("--transport", "mpi", "--world-size", "3", "--sizes", "4106", "--iters", "1",
               "--dtype", "float16", "--launcher", "mpiexec")
    _check_run(out, ALGORITHMS, [4106], world_size=3)  # 2053 elements: chunks 685, 684, 684
    assert "float16" in out.stdout


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_cli_already_under_mpiexec_runs_as_a_rank():
    mpiexec = shutil.which("mpiexec")
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "course_lib", "bench",
                          "allreduce", "--transport", "mpi", "--sizes", "1K", "--iters", "1",
                          "--algorithms", "native,ring"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "MPIEXEC_TIMEOUT": "60"})
    _check_run(out, ["native", "ring"], [1024])


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_a_run_past_its_time_limit_is_stopped():
    out = _cli("--launcher", "mpiexec", "--sizes", "16M", "--iters", "1000", "--time-limit", "2")
    assert out.returncode == 1 and "mpiexec exited" in out.stderr and "TIMED OUT" in out.stderr


def test_cli_through_torchrun():
    out = _cli("--world-size", "2", "--sizes", "1K", "--iters", "1", "--launcher", "torchrun",
               "--algorithms", "native,naive,ring")
    _check_run(out, ["native", "naive", "ring"], [1024])


@pytest.mark.parametrize("args, code, message", [
    (["--sizes", "1Q"], 2, "bad size '1Q'"),
    (["--sizes", "8K-1K"], 2, "need 1 <= first <= last"),
    (["--algorithms", "ring,rign"], 2, "unknown algorithm(s) ['rign']"),
    (["--world-size", "1"], 2, "rank counts >= 2"),
    (["--launcher", "slurm"], 2, "invalid choice"),
    (["--iters", "0"], 1, "--iters must be >= 1"),
    (["--transport", "mpi", "--backend", "nccl"], 1, "--backend nccl goes with --transport torch"),
])
def test_bad_arguments_end_with_a_clear_message(args, code, message):
    out = command_line.run("bench", "allreduce", *args)
    assert out.returncode == code and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_nccl_without_gpus_says_so():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    out = command_line.run("bench", "allreduce", "--backend", "nccl")
    assert out.returncode == 1 and "needs one CUDA GPU per rank" in out.stderr
    assert "Traceback" not in out.stderr
