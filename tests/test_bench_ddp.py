"""bench ddp (course_lib/bench/ddp.py): options, the rows of a tiny real run on 2 ranks, the
table."""


import pytest

from course_lib import ddp
from course_lib.bench import ddp as bench_ddp
from course_lib.testing import command_line

CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py
CLUSTER_BACKEND = "gloo"


@pytest.fixture(scope="module")
def rows(cluster):
    configs = bench_ddp.make_configs(ddp.STRATEGIES, buckets=(0.01, 1), bucket_mb=1)
    return cluster.run(bench_ddp.ddp_rank_bench, configs, 32, (64, 64), 10, 8, 1, 2)[0]


def test_options_are_checked():
    assert bench_ddp.parse_hidden("2560,2048") == (2560, 2048)
    assert bench_ddp.parse_hidden("1024x3") == (1024, 1024, 1024)
    for bad in ["", "0", "x3", "64,-1", "axb"]:
        with pytest.raises(ValueError):
            bench_ddp.parse_hidden(bad)
    with pytest.raises(ValueError):
        bench_ddp.parse_buckets("1,0")
    out = command_line.run("bench", "ddp", "--hidden", "7y")
    assert out.returncode == 1 and "--hidden" in out.stderr


def test_configs_put_every_strategy_torch_the_sweep_and_one_process_in_order():
    configs = bench_ddp.make_configs(ddp.STRATEGIES, buckets=(1, 25), bucket_mb=25, world_size=3)
    assert [c[0] for c in configs[:5]] == [*ddp.STRATEGIES, bench_ddp.TORCH]
    assert ("overlap", 1, 1) in configs and (bench_ddp.TORCH, 1, 1) in configs
    assert configs[-2:] == [(bench_ddp.ONE_PROCESS, None, 1), (bench_ddp.ONE_PROCESS, None, 3)]


def test_a_tiny_run_has_every_row_and_sane_numbers(rows):
    names = [(r["strategy"], r["bucket_mb"]) for r in rows]
    assert names == [("per_parameter", None), ("flat", None), ("bucketed", 1), ("overlap", 1),
                     (bench_ddp.TORCH, 1), ("overlap", 0.01), (bench_ddp.TORCH, 0.01),
                     (bench_ddp.ONE_PROCESS, None), (bench_ddp.ONE_PROCESS, None)]
    params = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    assert all(r["params"] == params and r["step_ms"] > 0 and r["samples_per_s"] > 0
               for r in rows)
    by = {(r["strategy"], r["bucket_mb"]): r for r in rows}
    assert by[("per_parameter", None)]["buckets"] == 6 and by[("flat", None)]["buckets"] == 1
    assert by[("overlap", 0.01)]["buckets"] >= by[("overlap", 1)]["buckets"] >= 1
    assert by[(bench_ddp.TORCH, 1)]["vs_torch"] == pytest.approx(1.0)
    assert all(r["vs_torch"] > 0 for r in rows if r["strategy"] != bench_ddp.ONE_PROCESS)
    alone = [r for r in rows if r["strategy"] == bench_ddp.ONE_PROCESS]
    assert [(r["ranks"], r["batch"]) for r in alone] == [(1, 8), (1, 16)]
    assert all(r["ranks"] == 2 and r["batch"] == 8 for r in rows if r not in alone)


def test_the_table_shows_every_row_scaling_and_the_target(rows):
    table = bench_ddp.format_ddp_table(rows)
    for name in [*ddp.STRATEGIES, bench_ddp.TORCH, bench_ddp.ONE_PROCESS]:
        assert name in table
    assert "weak scaling efficiency" in table and "speed-up" in table
    assert "# target: bucketed+overlap >= 0.95x torch DDP at 1 MB" in table
    weak, speedup = bench_ddp.scaling(rows)
    assert weak > 0 and speedup > 0
    assert "# target" not in bench_ddp.format_ddp_table(rows, target=False)
