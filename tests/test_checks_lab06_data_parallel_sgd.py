"""Lab 06's checks (course_lib/checks/lab06_data_parallel_sgd.py): a right answer passes, typical
mistakes fail with their hint."""


import pytest
import torch
import torch.distributed as dist

from course_lib import ddp
from course_lib.checks import CheckFailed
from course_lib.checks import lab06_data_parallel_sgd as checks_ddp

CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py
CLUSTER_BACKEND = "gloo"


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
