"""Lab 04 checks pass the right servers and fail realistic wrong ones with a useful hint."""

import math
import threading
import time

import numpy as np
import pytest

from course_lib import data, gd
from course_lib.checks import CheckFailed
from course_lib.checks import lab04_parameter_server as checks_ps
from course_lib.models import LinearRegression
from course_lib.testing.timing import assert_no_hang


# ---------------------------------------------------------------- the right answers
class SyncShard:
    def __init__(self, theta, num_workers, lr):
        self.theta = np.array(theta, dtype=float)
        self.version = 0
        self.num_workers, self.lr = num_workers, lr
        self.held = {}

    def on_push(self, worker, version, grad_sum, count):
        if version != self.version or worker in self.held:
            return "rejected"
        self.held[worker] = (grad_sum, count)
        return "held"

    def ready(self):
        return len(self.held) == self.num_workers

    def step(self):
        total = sum(count for _, count in self.held.values())
        grad_sum = sum(g for g, _ in self.held.values())
        self.theta = self.theta - self.lr * grad_sum / total
        self.version += 1
        self.held = {}

    def on_pull(self, worker, version):
        return self.version >= version


class AsyncShard:
    def __init__(self, theta, lr, staleness_aware=False, max_staleness=None):
        self.theta = np.array(theta, dtype=float)
        self.version = 0
        self.lr, self.staleness_aware, self.max_staleness = lr, staleness_aware, max_staleness
        self.staleness = []

    def rate(self, staleness):
        return self.lr / max(staleness, 1) if self.staleness_aware else self.lr

    def on_push(self, worker, version, grad_sum, count):
        staleness = self.version - version
        if self.max_staleness is not None and staleness > self.max_staleness:
            return "rejected"
        self.theta = self.theta - self.rate(staleness) * grad_sum / count
        self.version += 1
        self.staleness.append(staleness)
        return "applied"


def test_reference_passes():
    assert checks_ps.check_sync_shard(SyncShard) is True
    assert checks_ps.check_async_shard(AsyncShard) is True
    assert checks_ps.check_sync_shard(checks_ps.ReferenceSyncShard) is True
    assert checks_ps.check_async_shard(checks_ps.ReferenceAsyncShard) is True


def test_not_implemented_returns_false(capsys):
    class Todo:
        def __init__(self, *args):
            pass

        def on_push(self, *args):
            raise NotImplementedError

        ready = step = on_pull = on_push

    assert checks_ps.check_sync_shard(Todo) is False
    assert checks_ps.check_async_shard(Todo) is False
    assert "not implemented yet" in capsys.readouterr().out


def test_threads_give_minibatch_sgd():
    """The sync server driven by worker threads is mini-batch SGD on the global batch."""
    X, y, _ = data.make_linear(n_samples=200, n_features=4, noise=0.5, seed=0)
    problem, theta0 = LinearRegression(), np.zeros(X.shape[1])
    theta = checks_ps.train_sync(SyncShard, problem, X, y, theta0, 0.05, 3, 2, 32)
    reference = gd.minibatch_sgd(problem, X, y, theta0, 0.05, 2, 32, seed=0)
    np.testing.assert_allclose(theta, reference.final_theta, rtol=1e-10, atol=1e-12)


def test_a_server_that_never_answers_ends_in_a_deadline():
    class Silent(SyncShard):
        def on_pull(self, worker, version):
            return False

    t0 = time.monotonic()
    run = checks_ps.run_threads(Silent(np.zeros(2), 2, 0.1), 2, 3,
                                lambda w, v, theta: (theta, 1), timeout=0.3)
    assert_no_hang(time.monotonic() - t0, 0.3)
    assert sorted(run["late"]) == [(0, "pull of version 0"), (1, "pull of version 0")]


# ---------------------------------------------------------------- sync mistakes
class EachPush(SyncShard):
    def ready(self):
        return len(self.held) >= 1


class Summed(SyncShard):
    def step(self):
        self.theta = self.theta - self.lr * sum(g for g, _ in self.held.values())
        self.version += 1
        self.held = {}


class ByWorkers(SyncShard):
    def step(self):
        self.theta = self.theta - self.lr * sum(g for g, _ in self.held.values()) / len(self.held)
        self.version += 1
        self.held = {}


class MeanOfMeans(SyncShard):
    def step(self):
        self.theta = self.theta - self.lr * np.mean([g / c for g, c in self.held.values()], axis=0)
        self.version += 1
        self.held = {}


class ReleaseBeforeStep(SyncShard):
    def on_pull(self, worker, version):
        return self.version >= version or self.ready()  # everyone pushed: "done"


class OffByOne(SyncShard):
    def on_pull(self, worker, version):
        return self.version >= version - 1


class NeverRelease(SyncShard):
    def on_pull(self, worker, version):
        return self.version > version


class CountsDuplicates(SyncShard):
    def on_push(self, worker, version, grad_sum, count):
        if version != self.version:
            return "rejected"
        self.held[worker] = (grad_sum, count)  # a resend replaces the first copy: "held" again
        return "held"


class TakesStale(SyncShard):
    def on_push(self, worker, version, grad_sum, count):
        if worker in self.held:
            return "rejected"
        self.held[worker] = (grad_sum, count)
        return "held"


class KeepsHeld(SyncShard):
    def step(self):
        total = sum(count for _, count in self.held.values())
        self.theta = self.theta - self.lr * sum(g for g, _ in self.held.values()) / total
        self.version += 1


RELEASED = threading.Event()  # set by the test, so the blocked handler's thread ends


class BlocksInPull(SyncShard):
    def on_pull(self, worker, version):
        RELEASED.wait(30)
        return self.version >= version


@pytest.mark.parametrize("wrong,hint", [
    (EachPush, "applied a push as soon as it arrived"),
    (Summed, "summed the gradient sums"),
    (ByWorkers, "divided by the number of workers"),
    (MeanOfMeans, "averaged the workers' mean gradients"),
    (ReleaseBeforeStep, "before the step was applied"),
    (OffByOne, "(off by one, or no test of the version at all)"),
    (NeverRelease, "was never answered"),
    (CountsDuplicates, "a second time (a resend)"),
    (TakesStale, "a push of another version"),
    (KeepsHeld, "step() must empty what the server holds"),
])
def test_sync_shard_catches_mistakes(wrong, hint):
    with pytest.raises(CheckFailed) as err:
        checks_ps.check_sync_shard(wrong)
    assert hint in str(err.value)


class RejectsOnlyLate(SyncShard):
    def on_push(self, worker, version, grad_sum, count):
        if version < self.version or worker in self.held:  # a push from ahead is held
            return "rejected"
        self.held[worker] = (grad_sum, count)
        return "held"


class ReadyOneShort(SyncShard):
    def ready(self):
        return len(self.held) >= self.num_workers - 1


class NoVersionStep(SyncShard):
    def step(self):
        version = self.version
        super().step()
        self.version = version


class LastCount(SyncShard):
    def step(self):
        total, count = 0, 0
        for g, c in self.held.values():
            total, count = total + g, c  # the last worker's count, not the sum
        self.theta = self.theta - self.lr * total / count
        self.version += 1
        self.held = {}


class HeldList(SyncShard):
    def __init__(self, theta, num_workers, lr):
        super().__init__(theta, num_workers, lr)
        self.held = []

    def on_push(self, worker, version, grad_sum, count):
        if version != self.version:
            return "rejected"
        self.held.append((grad_sum, count))
        return "held"

    def step(self):
        total = sum(count for _, count in self.held)
        self.theta = self.theta - self.lr * sum(g for g, _ in self.held) / total
        self.version += 1
        self.held = []


class Ascent(SyncShard):
    def step(self):
        total = sum(count for _, count in self.held.values())
        self.theta = self.theta + self.lr * sum(g for g, _ in self.held.values()) / total
        self.version += 1
        self.held = {}


class NoLr(SyncShard):
    def step(self):
        total = sum(count for _, count in self.held.values())
        self.theta = self.theta - sum(g for g, _ in self.held.values()) / total
        self.version += 1
        self.held = {}


class ReturnsTrue(SyncShard):
    def on_push(self, worker, version, grad_sum, count):
        return super().on_push(worker, version, grad_sum, count) == "held"


class SeenForever(SyncShard):
    def __init__(self, theta, num_workers, lr):
        super().__init__(theta, num_workers, lr)
        self.seen = set()  # never emptied

    def on_push(self, worker, version, grad_sum, count):
        if version != self.version or worker in self.seen:
            return "rejected"
        self.seen.add(worker)
        self.held[worker] = (grad_sum, count)
        return "held"


class AlwaysAnswers(SyncShard):
    def on_pull(self, worker, version):
        return True


class StepsInPush(SyncShard):
    def on_push(self, worker, version, grad_sum, count):
        decision = super().on_push(worker, version, grad_sum, count)
        if len(self.held) == self.num_workers:
            self.step()
        return decision

    def ready(self):
        return False


@pytest.mark.parametrize("wrong,hint", [
    (RejectsOnlyLate, r"schedule 8/8 [\s\S]*Hint: you held worker 1's push of version 1 while "
                      r"the server is at version 0"),
    (ReadyOneShort, r"Hint: you took the step with 2 of the 3 workers' pushes"),
    (NoVersionStep, r"Hint: your step went to version 0 instead of 1"),
    (LastCount, r"Hint: your step divided the sum of the gradient sums by the LAST held push's "
                r"count alone"),
    (HeldList, r"schedule 4/8 [\s\S]*Hint: you held worker 0's push of version 0 a second time"),
    (Ascent, r"Hint: your step went UP the gradient"),
    (NoLr, r"Hint: your step left out the learning rate"),
    (ReturnsTrue, r"Hint: on_push returned True: return 'held' or 'rejected'"),
    (SeenForever, r"Hint: you rejected worker 0's first push of version 1"),
    (AlwaysAnswers, r"Hint: you answered worker 0's pull of version 1 with the parameters of "
                    r"version 0, with 1 of 3 pushes of version 0 in: on_pull let a pull through"),
    (StepsInPush, r"Hint: your on_push took the step itself"),
], ids=["a push from ahead held", "ready one short", "no version step", "last count",
        "pushes held in a list", "ascent", "no lr", "True for held", "workers never forgotten",
        "every pull answered", "step inside on_push"])
def test_more_sync_shard_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks_ps.check_sync_shard(wrong)
    assert "self.version >=" not in str(failed.value)


def test_sync_shard_a_blocking_handler_is_a_hint_not_a_hang():
    RELEASED.clear()
    t0 = time.monotonic()
    try:
        with pytest.raises(CheckFailed, match="never waits inside a handler"):
            checks_ps.check_sync_shard(BlocksInPull)
    finally:
        RELEASED.set()
    assert_no_hang(time.monotonic() - t0, checks_ps.TIMEOUT)


# ---------------------------------------------------------------- async mistakes
class WrongSign(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        staleness = version - self.version
        if self.max_staleness is not None and staleness > self.max_staleness:
            return "rejected"
        self.theta = self.theta - self.rate(staleness) * grad_sum / count
        self.version += 1
        self.staleness.append(staleness)
        return "applied"


class AfterTheBump(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        if self.max_staleness is not None and self.version - version > self.max_staleness:
            return "rejected"
        self.version += 1
        staleness = self.version - version
        self.theta = self.theta - self.rate(staleness) * grad_sum / count
        self.staleness.append(staleness)
        return "applied"


class ScaledTwice(AsyncShard):
    def rate(self, staleness):
        return super().rate(staleness) / max(staleness, 1) if self.staleness_aware else self.lr


class OnePlus(AsyncShard):
    def rate(self, staleness):
        return self.lr / (1 + staleness) if self.staleness_aware else self.lr


class NeverDrops(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        bound, self.max_staleness = self.max_staleness, None
        try:
            return super().on_push(worker, version, grad_sum, count)
        finally:
            self.max_staleness = bound


class DropsAtTheBound(NeverDrops):
    def on_push(self, worker, version, grad_sum, count):
        if self.max_staleness is not None and self.version - version >= self.max_staleness:
            return "rejected"
        return super().on_push(worker, version, grad_sum, count)  # past the bound check


class SumNotMean(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        return super().on_push(worker, version, grad_sum * count, count)


class DividesByZero(AsyncShard):
    def rate(self, staleness):
        return self.lr / staleness if self.staleness_aware else self.lr


class CountsRejected(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        decision = super().on_push(worker, version, grad_sum, count)
        if decision == "rejected":
            self.version += 1
        return decision


class IgnoresAware(AsyncShard):
    def rate(self, staleness):
        return self.lr


@pytest.mark.parametrize("wrong,hint", [
    (WrongSign, "not the reverse"),
    (AfterTheBump, "BEFORE adding one to the version"),
    (ScaledTwice, "by the staleness twice"),
    (OnePlus, "divided by 1 + staleness"),
    (NeverDrops, "is beyond max_staleness"),
    (DropsAtTheBound, "stale by exactly max_staleness"),
    (SumNotMean, "divide grad_sum by count"),
    (DividesByZero, "ZeroDivisionError"),
    (CountsRejected, "a rejected push is not an update"),
    (IgnoresAware, "did not divide the rate by the staleness"),
])
def test_async_shard_catches_mistakes(wrong, hint):
    with np.errstate(divide="ignore", invalid="ignore"), pytest.raises(CheckFailed) as err:
        checks_ps.check_async_shard(wrong)
    assert hint in str(err.value)


class FalsyBound(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        staleness = self.version - version
        if self.max_staleness and staleness > self.max_staleness:  # 0 is no bound here
            return "rejected"
        self.theta = self.theta - self.rate(staleness) * grad_sum / count
        self.version += 1
        self.staleness.append(staleness)
        return "applied"


class TimesStaleness(AsyncShard):
    def rate(self, staleness):
        return self.lr * max(staleness, 1) if self.staleness_aware else self.lr


class SquareRoot(AsyncShard):
    def rate(self, staleness):
        return self.lr / math.sqrt(max(staleness, 1)) if self.staleness_aware else self.lr


class AwareAlways(AsyncShard):
    def rate(self, staleness):
        return self.lr / max(staleness, 1)


class CountTwice(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        return super().on_push(worker, version, grad_sum / count, count)


class OneLess(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        decision = super().on_push(worker, version, grad_sum, count)
        if decision == "applied":
            self.staleness[-1] -= 1
        return decision


class RecordsRejected(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        decision = super().on_push(worker, version, grad_sum, count)
        if decision == "rejected":
            self.staleness.append(self.version - version)
        return decision


class NoRecord(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        decision = super().on_push(worker, version, grad_sum, count)
        if decision == "applied":
            self.staleness.pop()
        return decision


class NoVersionStep(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        decision = super().on_push(worker, version, grad_sum, count)
        if decision == "applied":
            self.version -= 1
        return decision


class VersionFromPush(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        decision = super().on_push(worker, version, grad_sum, count)
        if decision == "applied":
            self.version = version + 1
        return decision


class SaysAccepted(AsyncShard):
    def on_push(self, worker, version, grad_sum, count):
        decision = super().on_push(worker, version, grad_sum, count)
        return "accepted" if decision == "applied" else decision


@pytest.mark.parametrize("wrong,hint", [
    (FalsyBound, r"schedule 5/5 [\s\S]*Hint: a push stale by 1 is beyond max_staleness=0, and "
                 r"your server applied it: 0 is a bound too"),
    (TimesStaleness, r"Hint: you multiplied the rate by the staleness"),
    (SquareRoot, r"Hint: you divided the rate by the square root of the staleness"),
    (AwareAlways, r"Hint: you divided the rate by the staleness although staleness_aware is "
                  r"False"),
    (CountTwice, r"Hint: you divided by count twice"),
    (OneLess, r"Hint: you recorded staleness -1 instead of 0, one less"),
    (RecordsRejected, r"Hint: your server recorded a staleness for a rejected push"),
    (NoRecord, r"Hint: your server recorded no staleness for this applied push"),
    (NoVersionStep, r"Hint: every applied push adds one to the version: 1, yours 0"),
    (VersionFromPush, r"Hint: after the push your version is 1, the pushed version \+ 1"),
    (SaysAccepted, r"Hint: on_push returned 'accepted': return 'applied' or 'rejected'"),
], ids=["max_staleness=0 falsy", "times the staleness", "square root", "aware when not asked",
        "count twice", "staleness one less", "rejected push recorded", "staleness not recorded",
        "no version step", "version from the push", "'accepted'"])
def test_more_async_shard_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks_ps.check_async_shard(wrong)
    assert "lr / max(staleness, 1)" not in str(failed.value)
