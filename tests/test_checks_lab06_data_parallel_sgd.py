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
    with pytest.raises(CheckFailed, match="follow the model's order"):
        checks_ddp.check_assign_buckets(forward)
    strict = lambda sizes, cap: good_buckets(sizes, cap + 1)   # > instead of >=
    with pytest.raises(CheckFailed, match="at least"):
        checks_ddp.check_assign_buckets(strict)

    def unfinished(sizes, cap):
        raise NotImplementedError
    assert checks_ddp.check_assign_buckets(unfinished) is False
    assert "not implemented" in capsys.readouterr().out


def buckets_with(walk="reversed", numbering="own", closes="at the cap", count=1, carry=False,
                 last="kept", order="as filled", reverse_in_place=False):
    """The bucket assignment with knobs for the usual mistakes."""
    def assign(sizes, cap_bytes):
        if reverse_in_place:
            sizes.reverse()
            positions = list(range(len(sizes)))
            numbers = [len(sizes) - 1 - k for k in positions]
        else:
            positions = list(reversed(range(len(sizes)))) if walk == "reversed" else \
                list(range(len(sizes)))
            numbers = ([len(sizes) - 1 - k for k in positions] if numbering == "from the end"
                       else positions)
        buckets, current, filled = [], [], 0
        for k, i in zip(positions, numbers, strict=True):
            if closes == "before the cap" and current and filled + sizes[k] > cap_bytes:
                buckets.append(current)
                current, filled = [], 0
            current.append(i)
            filled += count * sizes[k]
            if closes == "at the cap" and filled >= cap_bytes:
                buckets.append(current)
                current, filled = [], (filled - cap_bytes if carry else 0)
        if current and last == "kept":
            buckets.append(current)
        if order == "reversed":
            buckets = buckets[::-1]
        elif order == "each sorted":
            buckets = [sorted(b) for b in buckets]
        return buckets
    return assign


@pytest.mark.parametrize("wrong, hint", [
    (buckets_with(reverse_in_place=True), r"changed the caller's list of sizes\.\nHint: "
                                          r"sizes\.reverse\(\) \(or sort\) reorders"),
    (buckets_with(numbering="from the end"), r"count the parameters from the end"),
    (buckets_with(last="dropped"), r"Hint: parameters \[1, 0\] are in no bucket: the bucket "
                                   r"still open at the end"),
    (buckets_with(carry=True), r"did not start again from zero"),
    (buckets_with(count=4), r"case 4/7 [\s\S]*you counted every size 4 times"),
    (buckets_with(order="reversed"), r"your buckets are right but in reverse order"),
    (buckets_with(order="each sorted"), r"each bucket in increasing order"),
    (buckets_with(closes="before the cap"), r"you closed a bucket before a parameter could push "
                                            r"it over the cap"),
    (lambda sizes, cap: [i for b in good_buckets(sizes, cap) for i in b],
     r"Hint: return a list of buckets, each a list of parameter indices"),
], ids=["sizes.reverse()", "numbered from the end", "last bucket dropped", "bytes carried over",
        "4 x sizes", "buckets reversed", "each bucket sorted", "closed before the cap",
        "one flat list"])
def test_more_bucket_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks_ddp.check_assign_buckets(wrong)
    assert "reversed(range(len(sizes)))" not in str(failed.value)


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


class NoReset(Averager):
    def wait(self):
        for b, indices in enumerate(self.buckets):  # the works and counts are never reset
            self.works[b].wait()
            self.flat[b] /= dist.get_world_size()
            for i in indices:
                _, start, stop = self.slot[i]
                self.params[i].grad.copy_(self.flat[b][start:stop].view_as(self.params[i]))


class ForgetsWorksOnly(Averager):
    def wait(self):
        pending = list(self.pending)
        super().wait()
        self.pending = pending  # left at 0: no bucket goes at the next step


class DividedTwice(Averager):
    def wait(self):
        super().wait()
        for p in self.params:
            p.grad /= dist.get_world_size()


class NoCopyBack(Averager):
    def wait(self):
        for b, indices in enumerate(self.buckets):
            self.works[b].wait()
            self.flat[b] /= dist.get_world_size()
            self.pending[b], self.works[b] = len(indices), None


class SliceFromTheStart(Averager):
    def wait(self):
        for b, indices in enumerate(self.buckets):
            self.works[b].wait()
            self.flat[b] /= dist.get_world_size()
            for i in indices:
                n = self.params[i].numel()  # every parameter from the bucket's first element
                self.params[i].grad.copy_(self.flat[b][:n].view_as(self.params[i]))
            self.pending[b], self.works[b] = len(indices), None


class Done:
    def wait(self):
        return True


class Blocking(Averager):
    def grad_ready(self, i):
        b, start, stop = self.slot[i]
        self.flat[b][start:stop].copy_(self.params[i].grad.reshape(-1))
        self.pending[b] -= 1
        if self.pending[b] == 0:
            dist.all_reduce(self.flat[b])
            self.works[b] = Done()


class OneEarly(Averager):
    def grad_ready(self, i):
        b, start, stop = self.slot[i]
        self.pending[b] -= 1
        if self.pending[b] == 1 or len(self.buckets[b]) == 1:  # one gradient early
            self.works[b] = dist.all_reduce(self.flat[b], async_op=True)
        self.flat[b][start:stop].copy_(self.params[i].grad.reshape(-1))


class CopiesAfterTheLaunch(Averager):
    def grad_ready(self, i):
        b, start, stop = self.slot[i]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.works[b] = dist.all_reduce(self.flat[b], async_op=True)
        self.flat[b][start:stop].copy_(self.params[i].grad.reshape(-1))  # after the launch


class PerParameter(Averager):
    def grad_ready(self, i):
        b, start, stop = self.slot[i]
        self.flat[b][start:stop].copy_(self.params[i].grad.reshape(-1))
        self.pending[b] -= 1
        self.works.append(dist.all_reduce(self.flat[b][start:stop], async_op=True))

    def wait(self):
        for work in self.works[len(self.buckets):]:
            work.wait()
        del self.works[len(self.buckets):]
        for b in range(len(self.buckets)):
            self.works[b] = Done()
        super().wait()


@pytest.mark.parametrize("wrong, said", [
    (NoReset, r"step 1: no dist.all_reduce was called \(step 0 made 3\)\.\nHint: after the first "
              r"step the buckets were not ready"),
    (ForgetsWorksOnly, r"'NoneType' object has no attribute 'wait'[\s\S]*Hint: wait\(\) found a "
                       r"bucket whose allreduce was never launched in this step"),
    (DividedTwice, r"the gradients are 1/2 of torch DDP's: divided by the world size twice"),
    (NoCopyBack, r"the gradients after wait\(\) are this rank's own[\s\S]*Hint: the averaged "
                 r"buffers never reached the parameters' p.grad"),
    (SliceFromTheStart, r"step 0: parameters differ[\s\S]*Hint: the averages go wrong from the "
                        r"first step: each parameter's gradient must come back from its own "
                        r"slice"),
    (Blocking, r"called without async_op=True[\s\S]*Hint: launch it without waiting"),
    (OneEarly, r"step 0: bucket 0's allreduce \(\[7, 6, 5, 4\]\) was launched before the "
               r"gradient\(s\) of parameter\(s\) \[4\] had arrived"),
    (CopiesAfterTheLaunch, r"step 0: when bucket 0's allreduce was launched, its buffer did not "
                           r"hold the gradient\(s\) of parameter\(s\) \[4\] yet"),
    (PerParameter, r"8 allreduces per step, one per parameter; expected one per bucket \(3\)"),
], ids=["no reset", "works forgotten, counts not reset", "divided twice", "no copy back",
        "slice from the start", "blocking", "one gradient early", "copies after the launch",
        "one allreduce per parameter"])
def test_more_averager_mistakes(cluster, wrong, said):
    with pytest.raises(CheckFailed, match=said) as failed:
        checks_ddp.check_overlapped_averager(wrong, cluster, steps=2)
    assert "async_op=True)" not in str(failed.value).split("Hint:")[1]
