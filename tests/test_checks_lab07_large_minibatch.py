"""Lab 07's checks (course_lib/checks/lab07_large_minibatch.py): the reference passes, typical
mistakes fail with their hint."""

import math

import numpy as np
import pytest

from course_lib import data, gd, large_batch, scaling_rule
from course_lib.checks import CheckFailed
from course_lib.checks import lab07_large_minibatch as checks_large_batch


def test_check_warmup_schedule_passes_reference_and_catches_mistakes():
    assert checks_large_batch.check_warmup_schedule(scaling_rule.linear_scaling_warmup) is True

    def per_epoch(base_lr, batch, base_batch, warmup_epochs, per_epoch_):
        target = base_lr * batch / base_batch
        ref = scaling_rule.linear_scaling_warmup(base_lr, batch, base_batch, warmup_epochs,
                                                 per_epoch_)
        return lambda u: ref((u // per_epoch_) * per_epoch_) if warmup_epochs else target

    def from_zero(base_lr, batch, base_batch, warmup_epochs, per_epoch_):
        target, w = base_lr * batch / base_batch, warmup_epochs * per_epoch_
        return lambda u: target * min(u / w, 1.0) if w else target

    def unscaled(base_lr, batch, base_batch, warmup_epochs, per_epoch_):
        return lambda u: base_lr

    for wrong, hint in [(per_epoch, "per UPDATE"), (from_zero, "not at 0"),
                        (unscaled, "unscaled")]:
        with pytest.raises(CheckFailed, match=hint):
            checks_large_batch.check_warmup_schedule(wrong)

    def not_written(*args):
        raise NotImplementedError
    assert checks_large_batch.check_warmup_schedule(not_written) is False


def test_check_largest_batch_recomputes_with_the_reference():
    n = len(data.load_digits()[0])

    def search(make_schedule, batch_sizes, base_lr, warmup_epochs, seeds, tolerance):
        acc = {}
        for b in batch_sizes:
            sched = make_schedule(base_lr, b, 32, warmup_epochs,
                                  gd.updates_per_epoch(n, b, drop_last=True))
            acc[b] = np.mean([large_batch.train_and_test(b, sched, seed=s)["accuracy"]
                              for s in seeds])
        return max(b for b in batch_sizes if acc[b] >= acc[batch_sizes[0]] - tolerance), acc

    assert checks_large_batch.check_largest_batch(search) is True
    answer, acc = checks_large_batch.reference_largest_batch()
    with pytest.raises(CheckFailed, match=f"is {answer}, you returned"):
        checks_large_batch.check_largest_batch(lambda *a: (2 * answer, search(*a)[1]))
    with pytest.raises(CheckFailed, match="mean accuracy at batch"):
        checks_large_batch.check_largest_batch(lambda *a: (answer, {b: 0.5 for b in acc}))


def warmup_with(ratio="linear", warmup="epochs x updates", ramp="linear", clamp=True):
    """The schedule of exercise 1 with knobs for the usual mistakes."""
    def make(base_lr, batch_size, base_batch_size, warmup_epochs, updates_per_epoch):
        k = batch_size / base_batch_size
        target = base_lr * {"linear": k, "square root": math.sqrt(k), "inverted": 1 / k,
                            "whole": batch_size // base_batch_size}[ratio]
        w = {"epochs x updates": warmup_epochs * updates_per_epoch,
             "rounded": int(warmup_epochs * updates_per_epoch), "epochs": warmup_epochs}[warmup]

        def schedule(u):
            if not w:
                return target
            if u >= w and clamp:
                return target
            step = {"linear": u / w, "ahead": (u + 1) / w, "W - 1": u / max(w - 1, 1)}
            if ramp == "geometric":
                return base_lr * (target / base_lr) ** (u / w)
            if ramp == "not below base_lr":
                return max(base_lr, base_lr + (target - base_lr) * u / w)
            return base_lr + (target - base_lr) * step[ramp]
        return schedule
    return make


@pytest.mark.parametrize("wrong, hint", [
    (warmup_with(ratio="square root"), r"that is the square-root rule"),
    (warmup_with(ratio="inverted"), r"the ratio is upside down"),
    (warmup_with(ratio="whole"), r"case 5/7 [\s\S]*rounded down to a whole number \(//\)"),
    (warmup_with(warmup="rounded"), r"case 4/7 [\s\S]*number of warmup updates was rounded"),
    (warmup_with(warmup="epochs"), r"your ramp lasts warmup_epochs UPDATES"),
    (warmup_with(clamp=False), r"your ramp goes on rising past the warmup"),
    (warmup_with(ramp="ahead"), r"your ramp is one update ahead"),
    (warmup_with(ramp="W - 1"), r"reaches the target one update early \(it divides by W - 1\)"),
    (warmup_with(ramp="geometric"), r"your ramp is geometric"),
    (warmup_with(ramp="not below base_lr"), r"case 5/7 [\s\S]*never goes below base_lr"),
], ids=["square root", "inverted", "whole ratio", "W rounded", "W in epochs", "no clamp",
        "one update ahead", "W - 1", "geometric", "never below base_lr"])
def test_more_schedule_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks_large_batch.check_warmup_schedule(wrong)
    assert "(target - base_lr) * u / W" not in str(failed.value)


def search_with(seeds_used="all", average="mean", baseline="first", choose="largest",
                drop_last=True, scale=1.0, relative=False, percent_tolerance=False,
                stop_at_first_failure=False):
    """The search of exercise 2 with knobs for the usual mistakes (the check makes each run
    once, and gives it again to every search that asks for it)."""
    n = len(data.load_digits()[0])

    def search(make_schedule, batch_sizes, base_lr, warmup_epochs, seeds, tolerance):
        acc = {}
        for b in batch_sizes:
            per_epoch = gd.updates_per_epoch(n, b, drop_last=drop_last)
            sched = make_schedule(base_lr, b, 32, warmup_epochs, per_epoch)
            used = {"all": seeds, "first": seeds[:1]}[seeds_used]
            runs = [large_batch.train_and_test(b, sched, seed=s)["accuracy"] for s in used]
            acc[b] = scale * {"mean": np.mean, "median": np.median, "sum": np.sum}[average](runs)
        base = {"first": acc[batch_sizes[0]], "best": max(acc.values())}[baseline]
        tol = tolerance * (base if relative else 1.0) * (100 if percent_tolerance else 1)
        ok = [b for b in batch_sizes if acc[b] >= base - tol]
        if stop_at_first_failure:
            ok = ok[:next((i for i, b in enumerate(batch_sizes) if b not in ok), len(ok))]
        if choose == "best":
            return max(batch_sizes, key=acc.get), acc
        if choose == "smallest":
            return min(b for b in ok if b != batch_sizes[0]), acc
        return max(ok), acc
    return search


@pytest.mark.parametrize("wrong, hint", [
    (search_with(seeds_used="first"), r"mean accuracy at batch 32[\s\S]*Hint: your accuracies are "
                                      r"those of the first seed alone"),
    (search_with(average="median"), r"Hint: your accuracies are the median over the seeds"),
    (search_with(average="sum"), r"Hint: your accuracies are the SUM over the seeds"),
    (search_with(scale=100.0), r"Hint: your accuracies are percentages"),
    (search_with(drop_last=False), r"Hint: batch 32's accuracy is right, the larger batches' are "
                                   r"not"),
    (search_with(choose="best"), r"asked again with tolerance=[\s\S]*Hint: you returned the "
                                 r"batch with the best accuracy"),
    (search_with(baseline="best"), r"asked again with tolerance=[\s\S]*Hint: your baseline is the "
                                   r"best accuracy over all the batches"),
    (search_with(choose="smallest"), r"you returned 64\.[\s\S]*Hint: you returned the SMALLEST "
                                     r"batch within the tolerance"),
    (search_with(relative=True), r"asked again with tolerance=[\s\S]*Hint: your tolerance is "
                                 r"relative"),
    (search_with(percent_tolerance=True), r"Hint: your tolerance is 100 times too large"),
    (search_with(stop_at_first_failure=True),
     r"asked again with the runs of batches 256 and 1024 exchanged, the largest batch within 1 "
     r"point\(s\) of the baseline is 1024, you returned 128\.[\s\S]*Hint: you stopped at the "
     r"first batch that falls out of the tolerance"),
], ids=["first seed only", "median", "sum over seeds", "percentages",
        "updates per epoch without drop_last", "the best batch", "baseline the best",
        "the smallest batch", "relative tolerance", "tolerance in percent",
        "stops at the first failure"])
def test_more_search_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks_large_batch.check_largest_batch(wrong)
    assert "train_and_test(batch, schedule" not in str(failed.value)


def test_a_search_that_returns_the_pair_the_other_way_round():
    answer, acc = checks_large_batch.reference_largest_batch()
    with pytest.raises(CheckFailed, match=r"Hint: the pair is the other way round"):
        checks_large_batch.check_largest_batch(lambda *a: (acc, answer))
