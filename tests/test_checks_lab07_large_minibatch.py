"""Lab 07's checks (course_lib/checks/lab07_large_minibatch.py): the reference passes, typical
mistakes fail with their hint."""

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
                        (unscaled, "SCALED")]:
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
