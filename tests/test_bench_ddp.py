"""bench ddp: options, the rows of a tiny real run on 2 ranks, the table; the lab 06 checks and
figures on the same cluster (a right answer passes, typical mistakes fail with their hint)."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from course_lib import bench_ddp, checks_ddp, ddp, figures_ddp
from course_lib.checks import CheckFailed
from course_lib.cluster import start_cluster


@pytest.fixture(scope="module")
def cluster():
    with start_cluster(n=2, backend="gloo", timeout=60) as c:
        yield c


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
        bench_ddp._floats("1,0")
    out = subprocess.run([sys.executable, "-m", "course_lib", "bench", "ddp", "--hidden", "7y"],
                         capture_output=True, text=True, timeout=60)
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


# ---------------------------------------------------------------- lab 06 checks
def good_buckets(sizes, cap_bytes):
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        filled += sizes[i]
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])


def test_check_assign_buckets_passes_the_reference_and_explains_mistakes(capsys):
    assert checks_ddp.check_assign_buckets(ddp.assign_buckets)
    assert checks_ddp.check_assign_buckets(good_buckets)
    forward = lambda sizes, cap: [list(range(len(sizes)))] if sizes else []
    with pytest.raises(CheckFailed, match="reverse"):
        checks_ddp.check_assign_buckets(forward)
    strict = lambda sizes, cap: good_buckets(sizes, cap + 1)   # > instead of >=
    with pytest.raises(CheckFailed, match="at least"):
        checks_ddp.check_assign_buckets(strict)

    def unfinished(sizes, cap):
        raise NotImplementedError
    assert checks_ddp.check_assign_buckets(unfinished) is False
    assert "not implemented" in capsys.readouterr().out


class Averager:
    """The lab's solution; ``mean=False`` forgets to divide, ``early=False`` launches in wait."""

    mean, early = True, True

    def __init__(self, model, cap_bytes):
        self.params = list(model.parameters())
        self.buckets = good_buckets([p.numel() * 4 for p in self.params], cap_bytes)
        self.flat = [torch.zeros(sum(self.params[i].numel() for i in b)) for b in self.buckets]
        self.slot = {}
        for b, indices in enumerate(self.buckets):
            offset = 0
            for i in indices:
                self.slot[i] = (b, offset, offset + self.params[i].numel())
                offset += self.params[i].numel()
        self.pending, self.works = [len(b) for b in self.buckets], [None] * len(self.buckets)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self.grad_ready(i))

    def grad_ready(self, i):
        b, start, stop = self.slot[i]
        self.flat[b][start:stop].copy_(self.params[i].grad.reshape(-1))
        self.pending[b] -= 1
        if self.pending[b] == 0 and self.early:
            self.works[b] = dist.all_reduce(self.flat[b], async_op=True)

    def wait(self):
        for b, indices in enumerate(self.buckets):
            if not self.early:
                self.works[b] = dist.all_reduce(self.flat[b], async_op=True)
            self.works[b].wait()
            if self.mean:
                self.flat[b] /= dist.get_world_size()
            for i in indices:
                _, start, stop = self.slot[i]
                self.params[i].grad.copy_(self.flat[b][start:stop].view_as(self.params[i]))
            self.pending[b], self.works[b] = len(indices), None


class SumAverager(Averager):
    mean = False


class LateAverager(Averager):
    early = False


def test_check_overlapped_averager_on_the_ranks(cluster):
    ok, timelines = checks_ddp.check_overlapped_averager(Averager, cluster)
    assert ok and [tl.rank for tl in timelines] == [0, 1]
    assert {"forward", "backward", "allreduce", "wait"} <= {e.cat for e in timelines[0].events}
    with pytest.raises(CheckFailed, match="sum over the ranks"):
        checks_ddp.check_overlapped_averager(SumAverager, cluster)
    with pytest.raises(CheckFailed, match="no overlap"):
        checks_ddp.check_overlapped_averager(LateAverager, cluster)


def test_figures_draw_and_check_their_input():
    fig = figures_ddp.bucket_figure(["a", "b", "c"], [400, 4000, 40], 1000)
    assert "2 buckets" in fig.axes[0].get_title()
    with pytest.raises(ValueError):
        figures_ddp.bucket_figure(["a"], [1, 2], 10)
    assert len(figures_ddp.sync_step_figure(2).axes) == 1
