"""Lab 04 (parameter server) checks: a synchronous shard server and a staleness-aware async one.

Used in labs/04_parameter_server.ipynb, on the framework of :mod:`course_lib.checks`. The
student writes a server as a class of event handlers (``on_push``, ``ready``, ``step``,
``on_pull`` for sync; ``on_push`` for async) and a server loop here drives it as
:class:`course_lib.ps_server.ShardServer` drives a policy: one message at a time, and after each
one the pulls the server allows are answered and a ready step is taken. The reference is the
course's own policies, :class:`course_lib.ps.Synchronous` and :class:`course_lib.ps.Asynchronous`,
behind the same handlers::

    from course_lib.checks import lab04_parameter_server as checks
    checks.check_sync_shard(SyncShard)      # seeded schedules, adversarial orders, then threads
    checks.check_async_shard(AsyncShard)

Each check runs hand-made schedules first (a fast worker's pull of the next version before a
slow worker's push; pushes in every order; a duplicate; a stale and an early push), then real
worker threads that talk to a server thread through queues, every wait with a deadline. Every
run is recorded as a trace (decisions, steps, answers) and the same messages, in the order the
server received them, are replayed on the reference: the first event that differs is named,
with what the student's server did and a hint. A handler that blocks, or a pull never answered,
ends in a hint within seconds, never a hang.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from course_lib.checks.framework import CheckFailed, not_implemented
from course_lib.ps import Asynchronous, Synchronous
from course_lib.ps_server import Shard
from course_lib.sharding import shard_bounds

TIMEOUT = 2.0  # seconds a worker waits for an answer, and a handler may take, in the checks


# ---------------------------------------------------------------- the course's servers
class ReferenceSyncShard:
    """The course's synchronous server behind the lab's handlers: :class:`ps.Synchronous` holds
    the pushes and takes the step; a push of another version, or a worker's second push of this
    one (a resend, which :class:`ps_server.ShardServer` answers without applying), is rejected."""

    def __init__(self, theta: np.ndarray, num_workers: int, lr: float) -> None:
        self.shard = Shard(np.array(theta, dtype=np.float64))
        self.policy, self.num_workers = Synchronous(lr, num_workers), num_workers

    theta = property(lambda self: self.shard.theta)
    version = property(lambda self: self.shard.version)

    def on_push(self, worker: int, version: int, grad_sum: np.ndarray, count: int) -> str:
        if version != self.shard.version or worker in self.policy.held:
            return "rejected"
        return self.policy.push(self.shard, worker, grad_sum, count, version)

    def ready(self) -> bool:
        return self.policy.ready(set(range(self.num_workers)))

    def step(self) -> None:
        self.policy.step(self.shard)

    def on_pull(self, worker: int, version: int) -> bool:
        return self.shard.version >= version


class ReferenceAsyncShard:
    """The course's asynchronous server (:class:`ps.Asynchronous`) behind the lab's handler."""

    def __init__(self, theta: np.ndarray, lr: float, staleness_aware: bool = False,
                 max_staleness: int | None = None) -> None:
        self.shard = Shard(np.array(theta, dtype=np.float64))
        self.policy = Asynchronous(lr, max_staleness, staleness_aware)

    theta = property(lambda self: self.shard.theta)
    version = property(lambda self: self.shard.version)
    staleness = property(lambda self: self.policy.staleness)

    def on_push(self, worker: int, version: int, grad_sum: np.ndarray, count: int) -> str:
        return self.policy.push(self.shard, worker, grad_sum, count, version)


# ---------------------------------------------------------------- the server loop
class ServerLoop:
    """Drive a server as ``ShardServer`` drives a policy, one message at a time, and record a
    trace: ``("push", worker, version, decision, version_after, theta, staleness)``,
    ``("step", version, theta)`` and ``("answer", worker, asked, version, theta)``. In sync mode,
    after every message the waiting pulls that ``on_pull`` allows are answered, then a ready step
    is taken and the pulls are asked again; in async mode a pull is answered at once.
    ``reply(worker, theta, version)`` sends an answer (threads: a queue); ``held`` counts the
    pushes held at each answer (what the hints report)."""

    def __init__(self, server: Any, sync: bool,
                 reply: Callable[[int, np.ndarray, int], None] | None = None) -> None:
        self.server, self.sync, self.reply = server, sync, reply
        self.waiting: list[tuple[int, int]] = []
        self.trace: list[tuple] = []
        self.pushes_of: dict[int, set] = {}  # version -> workers whose push of it was accepted

    def handle(self, message: tuple) -> None:
        if message[0] == "push":
            _, worker, version, grad_sum, count = message
            decision = self.server.on_push(worker, version, np.array(grad_sum), count)
            if decision in ("held", "applied"):
                self.pushes_of.setdefault(version, set()).add(worker)
            staleness = [] if self.sync else list(getattr(self.server, "staleness", []))
            self.trace.append(("push", worker, version, decision, int(self.server.version),
                               np.array(self.server.theta, dtype=float),
                               staleness[-1] if staleness else None))
        else:
            _, worker, version = message
            if not self.sync:
                self.answer(worker, version)
                return
            self.waiting.append((worker, version))
        if self.sync:
            self.answer_waiting()
            if self.server.ready():
                self.server.step()
                self.trace.append(("step", int(self.server.version),
                                   np.array(self.server.theta, dtype=float)))
                self.answer_waiting()

    def answer_waiting(self) -> None:
        for worker, version in list(self.waiting):
            if self.server.on_pull(worker, version):
                self.waiting.remove((worker, version))
                self.answer(worker, version)

    def answer(self, worker: int, asked: int) -> None:
        theta, version = np.array(self.server.theta, dtype=float), int(self.server.version)
        self.trace.append(("answer", worker, asked, version, theta,
                           len(self.pushes_of.get(asked - 1, ()))))
        if self.reply is not None:
            self.reply(worker, theta.copy(), version)


def _in_thread(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` in a daemon thread, joined with a deadline: a handler that blocks (a wait inside
    ``on_pull``) fails the check instead of freezing the notebook."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = err
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(2 * TIMEOUT)
    if thread.is_alive():
        raise CheckFailed(f"{what}\n  your server did not return from a handler within "
                          f"{2 * TIMEOUT:g}s\nHint: a server never waits inside a handler (it "
                          "would stop every other worker's message): return False from on_pull "
                          "and the loop asks again after the next message.")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _run_student(run: Callable[[], Any], where: str, hint: str) -> Any:
    """``run()`` (the student's server replaying a schedule) by :func:`_in_thread`; an error of
    the student's code becomes a CheckFailed with ``hint`` (NotImplementedError passes: the
    stub's notice)."""
    try:
        return _in_thread(run, where)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as err:
        raise CheckFailed(f"{where}\n  your server raised {type(err).__name__}: {err}\n"
                          f"Hint: {hint}") from err


def _replay(messages: list[tuple], server: Any, sync: bool) -> ServerLoop:
    loop = ServerLoop(server, sync)
    for message in messages:
        loop.handle(message)
    return loop


# ---------------------------------------------------------------- schedules
def _grad(worker: int, version: int, n: int, seed: int, copy: int = 0) -> tuple:
    """A seeded gradient sum and its sample count (counts differ between workers, so a mean of
    the workers' means differs from the mean over the samples)."""
    rng = np.random.default_rng([seed, worker, version, copy])
    count = 2 + 3 * worker + int(rng.integers(0, 3))
    return rng.normal(size=n) * count, count


def _push(worker: int, version: int, n: int, seed: int) -> tuple:
    return ("push", worker, version, *_grad(worker, version, n, seed))


def _sync_round(order: list[int], version: int, n: int, seed: int) -> list[tuple]:
    """Every worker pushes ``version`` in ``order``, each then asks for ``version + 1``."""
    out = []
    for w in order:
        out += [_push(w, version, n, seed), ("pull", w, version + 1)]
    return out


def sync_schedules(seed: int = 0, n: int = 5) -> list[tuple[str, int, list[tuple]]]:
    """The sync check's schedules: ``(label, num_workers, messages)``."""
    start = [("pull", w, 0) for w in range(3)]
    out = [("3 workers push in order 0, 1, 2 for 3 versions", 3,
            start + _sync_round([0, 1, 2], 0, n, seed) + _sync_round([0, 1, 2], 1, n, seed)
            + _sync_round([0, 1, 2], 2, n, seed))]
    for k, order in enumerate(itertools.permutations(range(3))):
        if k in (1, 4):  # two more orders, the same gradients: the same parameters
            out.append((f"the same pushes in the order {order}", 3,
                        start + _sync_round(list(order), 0, n, seed)
                        + _sync_round(list(order[::-1]), 1, n, seed)))
    duplicate = _sync_round([0], 0, n, seed)
    out.append(("worker 0 pushes version 0 twice (a resend) before the others", 3,
                start + duplicate + [duplicate[0]] + _sync_round([1, 2], 0, n, seed)
                + _sync_round([2, 0, 1], 1, n, seed)))
    out.append(("a late copy of worker 2's version-0 push arrives at version 1", 3,
                start + _sync_round([0, 1, 2], 0, n, seed) + [_push(2, 0, n, seed)]
                + _sync_round([1, 2, 0], 1, n, seed)))
    out.append(("worker 0 pushes version 1 before the slow worker 1 pushed version 0", 4,
                [("pull", w, 0) for w in range(4)] + _sync_round([0, 2, 3], 0, n, seed)
                + [_push(0, 1, n, seed)] + _sync_round([1], 0, n, seed)
                + _sync_round([3, 0, 2, 1], 1, n, seed)))
    out.append(("one worker, 3 versions", 1,
                [("pull", 0, 0)] + sum((_sync_round([0], v, n, seed) for v in range(3)), [])))
    out.append(("worker 1's push of version 1 arrives before any push of version 0", 2,
                [("pull", w, 0) for w in range(2)] + [_push(1, 1, n, seed)]
                + _sync_round([0, 1], 0, n, seed) + _sync_round([1, 0], 1, n, seed)))
    return out


def async_schedules(seed: int = 0, n: int = 4) -> list[tuple[str, dict, list[tuple]]]:
    """The async check's schedules: ``(label, server options, pushes)``. A push carries the
    version its worker pulled, chosen so that its staleness (server version - that version)
    runs through 0 (fresh), 1, the bound and beyond, up to 7."""
    rng = np.random.default_rng(seed)
    staleness = [0, 1, 2, 0, 3, 1, 0, 5, 2, 0, 7, 3, 1]
    out = []
    for aware, bound in [(False, None), (True, None), (True, 2), (False, 3), (True, 0)]:
        opts = dict(lr=float(np.round(rng.uniform(0.05, 0.3), 3)), staleness_aware=aware,
                    max_staleness=bound)
        server, pushes = ReferenceAsyncShard(np.zeros(n), **opts), []
        for k, tau in enumerate(staleness):
            pushes.append(("push", k % 3, max(server.version - tau, 0),
                           *_grad(k % 3, server.version, n, seed, k)))
            server.on_push(*pushes[-1][1:])
        out.append((", ".join(f"{key}={value}" for key, value in opts.items()), opts, pushes))
    return out


# ---------------------------------------------------------------- reading a difference
def _differ(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape != b.shape or not np.allclose(a, b, rtol=1e-9, atol=1e-12)


def _first_difference(got: list[tuple], expected: list[tuple]) -> int | None:
    for i, (g, e) in enumerate(itertools.zip_longest(got, expected)):
        if g is None or e is None or g[0] != e[0]:
            return i
        if g[0] == "push" and (g[1:5] != e[1:5] or _differ(g[5], e[5]) or g[6] != e[6]):
            return i
        if g[0] == "step" and (g[1] != e[1] or _differ(g[2], e[2])):
            return i
        if g[0] == "answer" and (g[1:4] != e[1:4] or _differ(g[4], e[4])):
            return i
    return None


def _show(event: tuple | None) -> str:
    if event is None:
        return "nothing more"
    if event[0] == "push":
        return f"push of worker {event[1]} (version {event[2]}): {event[3]!r}"
    if event[0] == "step":
        head = np.array2string(event[2][:3], precision=4, separator=", ")
        return f"a step, to version {event[1]}, theta[:3] = {head}"
    return f"worker {event[1]}'s pull of version {event[2]} answered with version {event[3]}"


def _step_hint(before: np.ndarray, got: np.ndarray, held: list[tuple], lr: float,
               num_workers: int) -> str:
    """What a wrong step computed, decoded from the pushes it used."""
    sums, counts = [np.asarray(g) for _, _, g, _ in held], [c for _, _, _, c in held]
    total = sum(counts)
    candidates = {
        "left out the learning rate: it moved theta by the whole mean gradient":
            before - sum(sums) / total,
        "divided the sum of the gradient sums by the LAST held push's count alone, not by the "
        "counts of all the held pushes": before - lr * sum(sums) / counts[-1],
        "divided the sum of the gradient sums by the FIRST held push's count alone, not by the "
        "counts of all the held pushes": before - lr * sum(sums) / counts[0],
        "summed the gradient sums without dividing by the samples: divide the sum of the "
        "gradient sums by the sum of the counts (the global batch size)": before - lr * sum(sums),
        "divided by the number of workers, not by the number of samples: the workers' counts "
        "differ, so divide by the sum of the counts": before - lr * sum(sums) / num_workers,
        "averaged the workers' mean gradients: with counts that differ that weighs a small "
        "slice like a large one; divide the sum of the sums by the sum of the counts":
            before - lr * np.mean([g / c for g, c in zip(sums, counts, strict=True)], axis=0),
        "went UP the gradient: the loss grows": before + lr * sum(sums) / total,
    }
    for hint, value in candidates.items():
        if not _differ(got, value):
            return f"your step {hint}."
    return ("your step is not one step of mini-batch SGD on the global batch made of the held "
            "pushes of this version, and none of the usual mistakes either: compare it with "
            "the formula above the exercise, term by term.")


def _state_before(i: int, expected: list[tuple], messages: list[tuple],
                  theta0: np.ndarray) -> tuple[int, np.ndarray, list[tuple]]:
    """The course's server just before event ``i``: (version, theta, the pushes it holds as
    (worker, version, grad_sum, count))."""
    pushes = iter(m for m in messages if m[0] == "push")
    version, theta, held = 0, theta0, []
    for event in expected[:i]:
        if event[0] == "push":
            message = next(pushes)
            if event[3] == "held":
                held.append(message[1:])
        elif event[0] == "step":
            version, theta, held = event[1], event[2], []
    return version, theta, held


def _diagnose_sync(i: int, got: list[tuple], expected: list[tuple], messages: list[tuple],
                   num_workers: int, lr: float, theta0: np.ndarray) -> str:
    g = got[i] if i < len(got) else None
    e = expected[i] if i < len(expected) else None
    version, before, held = _state_before(i, expected, messages, theta0)
    if e is not None and e[0] == "push" and g is not None and g[0] == "push":
        worker, pushed, want = e[1], e[2], e[3]
        if g[3] not in ("held", "rejected"):
            return f"on_push returned {g[3]!r}: return 'held' or 'rejected'."
        if want == "rejected" and g[3] == "held":
            if pushed == version:
                return (f"you held worker {worker}'s push of version {pushed} a second time (a "
                        f"resend): count each worker's push of a version once; reject the copy.")
            return (f"you held worker {worker}'s push of version {pushed} while the server is at "
                    f"version {version}: a push of another version (a late copy, or one from a "
                    f"worker ahead) is rejected, or it would be averaged into the wrong step.")
        if want == "held" and g[3] == "rejected":
            return (f"you rejected worker {worker}'s first push of version {pushed}, the "
                    f"server's current version: hold it until every worker has pushed (and "
                    f"let step() empty what the server holds).")
        if g[4] != e[4]:
            after = expected[i + 1] if i + 1 < len(expected) else None
            if (g[4] == e[4] + 1 and after is not None and after[0] == "step"
                    and not _differ(g[5], after[2])):
                return ("your on_push took the step itself when the last push of the version "
                        "came in: the loop takes it, when ready() says so, by calling step() "
                        "(and answers the pulls around it).")
            return (f"after this push your server is at version {g[4]}, not {e[4]}: only a step "
                    "(every worker's push of the version in) adds one to the version.")
        return ("you changed theta when a push arrived: on_push only holds it; the step, once "
                "every worker has pushed, averages them all.")
    if g is not None and g[0] == "step" and (e is None or e[0] != "step"):
        if not held:
            return ("your server took a second step with no push since the last one: step() "
                    "must empty what the server holds, so that ready() is False until every "
                    "worker has pushed the next version.")
        if len(held) <= 1 and num_workers > 1:
            return ("you applied a push as soon as it arrived: ready() must be True only once "
                    f"every one of the {num_workers} workers has pushed this version, then the "
                    "step averages them all.")
        return (f"you took the step with {len(held)} of the {num_workers} workers' pushes of "
                f"version {version}: ready() waits for one push from EVERY worker.")
    if g is not None and g[0] == "answer" and (e is None or e[0] != "answer"):
        asked, at = g[2], g[3]
        if at < asked:
            if g[5] >= num_workers:
                return (f"you answered worker {g[1]}'s pull of version {asked} when every push "
                        f"of version {asked - 1} was in but before the step was applied (the "
                        f"answer carried version {at}): release a pull only once the step it "
                        "waits for is applied, self.version >= version.")
            return (f"you answered worker {g[1]}'s pull of version {asked} with the parameters "
                    f"of version {at}, with {g[5]} of {num_workers} pushes of version "
                    f"{asked - 1} in: on_pull let a pull through before the version it asks "
                    f"for exists (off by one, or no test of the version at all).")
        return (f"you answered worker {g[1]}'s pull of version {asked} at version {at}, after "
                "the course's server had: a pull can be answered as soon as the version it asks "
                "for exists.")
    if e is not None and e[0] == "step" and (g is None or g[0] != "step"):
        return (f"every worker pushed version {version} but your server took no step: ready() "
                "must be True once the server holds one push from each of the num_workers "
                "workers (and step() empties what it holds).")
    if g is not None and e is not None and g[0] == e[0] == "step":
        if g[1] != e[1]:
            return (f"your step went to version {g[1]} instead of {e[1]}: every step adds one "
                    "to the version.")
        return _step_hint(before, g[2], held, lr, num_workers)
    if e is not None and e[0] == "answer" and (g is None or g[0] != "answer"):
        return (f"worker {e[1]}'s pull of version {e[2]} was never answered although the server "
                f"was at version {e[3]}: on_pull said no to a version that exists (a worker "
                "that waits one step too many; in a real run every worker then waits for the "
                "others until the deadline).")
    if g is not None and e is not None and g[0] == e[0] == "answer":
        return (f"worker {g[1]}'s pull of version {g[2]} got version {g[3]} with other "
                f"parameters than the course's version {e[3]}: keep self.theta and "
                "self.version as the step leaves them.")
    return "follow the exercise's rules for on_push, ready, step and on_pull."


def _sync_failure(where: str, messages: list[tuple], student: ServerLoop, reference: ServerLoop,
                  num_workers: int, lr: float, theta0: np.ndarray) -> CheckFailed | None:
    i = _first_difference(student.trace, reference.trace)
    if i is None:
        return None
    hint = _diagnose_sync(i, student.trace, reference.trace, messages, num_workers, lr, theta0)
    return CheckFailed(f"{where}\n  event {i + 1} of the server's trace: expected "
                       f"{_show(reference.trace[i] if i < len(reference.trace) else None)}, "
                       f"your server gave "
                       f"{_show(student.trace[i] if i < len(student.trace) else None)}"
                       f"\nHint: {hint}")


# ---------------------------------------------------------------- threads
def run_threads(server: Any, num_workers: int, num_steps: int,
                compute: Callable[[int, int, np.ndarray], tuple[np.ndarray, int]],
                sync: bool = True, timeout: float = TIMEOUT) -> dict:
    """Real concurrency: ``num_workers`` worker threads and one server thread, messages through
    queues. Worker w repeats ``num_steps`` times: pull (sync: the version after its last push;
    async: the newest), ``grad_sum, count = compute(w, version, theta)``, push. Every wait has a
    deadline of ``timeout`` s. Returns ``messages`` (in the order the server handled them),
    ``loop`` (its :class:`ServerLoop`), ``late`` (the waits that ran out: (worker, what)) and
    ``error`` (a handler's exception, if any). Used by the checks and by the lab's "use it"
    cells."""
    inbox: queue.Queue = queue.Queue()
    replies = [queue.Queue() for _ in range(num_workers)]
    loop = ServerLoop(server, sync, reply=lambda w, theta, v: replies[w].put((theta, v)))
    out: dict = dict(messages=[], loop=loop, late=[], error=None)

    def serve():
        done, deadline = 0, time.monotonic() + timeout * (num_steps + 2)
        while done < num_workers and time.monotonic() < deadline:
            try:
                message = inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if message[0] == "done":
                done += 1
                continue
            out["messages"].append(message)
            try:
                loop.handle(message)
            except Exception as err:  # noqa: BLE001 - reported by the check
                out["error"] = err
                return

    def work(w):
        version = 0
        try:
            for _ in range(num_steps):
                inbox.put(("pull", w, version))
                try:
                    theta, got = replies[w].get(timeout=timeout)
                except queue.Empty:
                    out["late"].append((w, f"pull of version {version}"))
                    break
                grad_sum, count = compute(w, got, theta)
                inbox.put(("push", w, got, np.asarray(grad_sum, dtype=float), count))
                version = got + 1
        except Exception as err:  # noqa: BLE001 - reported by the caller
            out["error"] = err
        finally:
            inbox.put(("done", w))  # the server stops waiting for this worker

    threads = [threading.Thread(target=serve, daemon=True)]
    threads += [threading.Thread(target=work, args=(w,), daemon=True) for w in range(num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads[1:]:
        thread.join(timeout * (num_steps + 2))
    threads[0].join(timeout)
    if threads[0].is_alive():
        out["late"].append((None, "the server thread did not finish (a handler that blocks?)"))
    return out


def train_sync(shard_class: Callable, problem: Any, X: np.ndarray, y: np.ndarray,
               theta0: np.ndarray, lr: float, num_workers: int, num_epochs: int,
               batch_size: int, seed: int = 0) -> np.ndarray:
    """Train with ``shard_class(theta0, num_workers, lr)`` as the server and worker threads that
    take their slice (``shard_bounds``) of each global batch, shuffled as ``gd.minibatch_sgd``
    shuffles with the same seed (the protocol of ``ps.train``'s sync mode). Returns theta."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(num_epochs):
        order = rng.permutation(len(X))
        batches += [order[s:s + batch_size] for s in range(0, len(X), batch_size)]

    def compute(w, version, theta):
        batch = batches[version]
        a, b = shard_bounds(len(batch), w, num_workers)
        return problem.grad_sum(theta, X[batch[a:b]], y[batch[a:b]]), b - a

    server = shard_class(np.array(theta0, dtype=float), num_workers, lr)
    run = run_threads(server, num_workers, len(batches), compute, sync=True, timeout=10.0)
    if run["late"] or run["error"]:
        raise RuntimeError(f"the run did not finish: {run['late'] or run['error']!r}")
    return np.array(server.theta)


# ---------------------------------------------------------------- the checks
def check_sync_shard(shard_class: Callable, seed: int = 0) -> bool:
    """Lab 04, exercise 1: ``shard_class(theta, num_workers, lr)`` with ``on_push(worker,
    version, grad_sum, count) -> 'held' | 'rejected'``, ``ready()``, ``step()`` and
    ``on_pull(worker, version) -> bool``, event by event against :class:`ReferenceSyncShard` on
    seeded and adversarial schedules, then with 3 worker threads."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_sync_shard"
    n = 5
    schedules = sync_schedules(seed, n)
    lr = 0.25
    theta0 = np.random.default_rng([seed, 99]).normal(size=n)
    for number, (label, num_workers, messages) in enumerate(schedules, start=1):
        where = f"{name}: schedule {number}/{len(schedules)} ({label})"
        reference = _replay(messages, ReferenceSyncShard(theta0, num_workers, lr), True)
        try:
            student = _run_student(lambda nw=num_workers, m=messages: _replay(
                m, shard_class(theta0.copy(), nw, lr), True), where,
                "hold a push with on_push, step when ready(), answer a pull when on_pull says so.")
        except NotImplementedError:
            return not_implemented(name)
        failure = _sync_failure(where, messages, student, reference, num_workers, lr, theta0)
        if failure is not None:
            raise failure
    # real threads: 3 workers, 6 versions, gradients of a least-squares problem on the
    # parameters each pulled; the server's order of arrival is replayed on the reference
    target = np.random.default_rng([seed, 7]).normal(size=n)

    def compute(w, version, theta):
        count = 2 + w
        return count * (theta - target) * (1 + 0.1 * w), count
    where = f"{name}: 3 worker threads and a server thread, 6 versions"
    run = run_threads(shard_class(theta0.copy(), 3, lr), 3, 6, compute, sync=True)
    reference = _replay(run["messages"], ReferenceSyncShard(theta0, 3, lr), True)
    failure = _sync_failure(where, run["messages"], run["loop"], reference, 3, lr, theta0)
    if run["error"] is not None:
        raise CheckFailed(f"{where}\n  your server raised {type(run['error']).__name__}: "
                          f"{run['error']}\nHint: see the schedules above.")
    if failure is not None:
        raise failure
    if run["late"]:
        w, what = run["late"][0]
        raise CheckFailed(f"{where}\n  worker {w}'s {what} got no answer within {TIMEOUT:g}s "
                          f"(server at version {run['loop'].server.version})\nHint: every pull "
                          "of version v must be answered once the step to v is applied.")
    print(f"✓ {name}: {len(schedules)} schedules and a run of 3 worker threads match the course's "
          "server")
    return True


def _diagnose_async(g: tuple, e: tuple, before: np.ndarray, message: tuple, opts: dict,
                    version: int) -> str:
    _, worker, pulled, grad_sum, count = message
    tau, bound = version - pulled, opts["max_staleness"]
    if g[3] not in ("applied", "rejected"):
        return f"on_push returned {g[3]!r}: return 'applied' or 'rejected'."
    if e[3] == "rejected" and g[3] == "applied":
        if bound == 0:
            return (f"a push stale by {tau} is beyond max_staleness=0, and your server applied "
                    f"it: 0 is a bound too (a test like `if self.max_staleness:` skips it, 0 "
                    f"being falsy; only None means no bound).")
        return (f"a push stale by {tau} (server version {version}, pulled {pulled}) is beyond "
                f"max_staleness={bound}: reject it, without changing theta or the version.")
    if e[3] == "applied" and g[3] == "rejected":
        if tau == bound:
            return (f"you rejected a push stale by exactly max_staleness={bound}: reject only "
                    "when staleness > max_staleness.")
        return (f"you rejected a push stale by {tau} (server version {version}, pulled "
                f"{pulled}) with max_staleness={bound}: staleness = self.version - version.")
    if e[3] == "rejected":
        if g[4] == e[4] and not _differ(g[5], e[5]) and g[6] != e[6]:
            return ("your server recorded a staleness for a rejected push: self.staleness "
                    "lists the applied pushes only.")
        return ("a rejected push is not an update: leave theta and the version as they were "
                f"(version {e[4]}, yours {g[4]}).")
    if g[4] != e[4]:
        if g[4] == pulled + 1 and pulled + 1 != e[4]:
            return (f"after the push your version is {g[4]}, the pushed version + 1: the "
                    f"server's version counts ITS updates ({e[4]} now), whatever version the "
                    f"worker had pulled.")
        return f"every applied push adds one to the version: {e[4]}, yours {g[4]}."
    if g[6] != e[6]:
        if g[6] is None:
            return ("your server recorded no staleness for this applied push: self.staleness "
                    "gets one entry per applied push.")
        if g[6] == -tau and tau:
            return (f"you recorded staleness {g[6]} for a push of version {pulled} at server "
                    f"version {version}: staleness = self.version - version, not the reverse.")
        if g[6] == tau + 1:
            return (f"you recorded staleness {g[6]} instead of {tau}: measure it BEFORE adding "
                    "one to the version.")
        if g[6] == tau - 1:
            return (f"you recorded staleness {g[6]} instead of {tau}, one less than the number "
                    f"of updates applied since the worker pulled version {pulled}.")
        return (f"you recorded staleness {g[6]}; the push of version {pulled} arrived at "
                f"server version {version}.")
    grad, lr = np.asarray(grad_sum) / count, opts["lr"]
    rate = lr / max(tau, 1) if opts["staleness_aware"] else lr
    candidates = {
        f"divided the rate by the staleness twice (lr / {max(tau, 1) ** 2}): divide once, "
        "lr / max(staleness, 1)": before - lr / max(tau, 1) ** 2 * grad,
        "divided by 1 + staleness: the course's step (Zhang et al.) is lr / max(staleness, 1), "
        "so a fresh gradient gets the full rate": before - lr / (1 + tau) * grad,
        "did not divide the rate by the staleness although staleness_aware is True: "
        "lr / max(staleness, 1)": before - lr * grad,
        "divided the rate by the staleness although staleness_aware is False: the plain "
        "step is lr": before - lr / max(tau, 1) * grad,
        "pushed the gradient SUM into the step: divide grad_sum by count (the mean gradient)":
            before - rate * np.asarray(grad_sum),
        "added the step (gradient ascent)": before + rate * grad,
        f"multiplied the rate by the staleness ({max(tau, 1)}): a staler gradient must get a "
        "SMALLER step": before - lr * max(tau, 1) * grad,
        "divided the rate by the square root of the staleness: the course's step (Zhang et "
        "al.) divides by the staleness itself": before - lr / np.sqrt(max(tau, 1)) * grad,
        "divided by count twice: grad_sum / count is the mean gradient already":
            before - rate * grad / count,
        "left out the learning rate": before - (1 / max(tau, 1) if opts["staleness_aware"]
                                                else 1.0) * grad,
    }
    for hint, value in candidates.items():
        if not _differ(g[5], value):
            return f"you {hint}."
    return ("your step is none of the usual mistakes: compare it with the formula above the "
            "exercise, term by term (the mean gradient, the rate, and when it is divided).")


def _async_failure(where: str, messages: list[tuple], student: ServerLoop,
                   reference: ServerLoop, opts: dict, theta0: np.ndarray) -> CheckFailed | None:
    i = _first_difference(student.trace, reference.trace)
    if i is None:
        return None
    pushes = [m for m in messages if m[0] == "push"]
    before, version, k = theta0, 0, 0
    for event in reference.trace[:i]:
        if event[0] == "push":
            before, version, k = event[5], event[4], k + 1
    g = student.trace[i] if i < len(student.trace) else None
    e = reference.trace[i] if i < len(reference.trace) else None
    if g is None or e is None or g[0] != "push" or e[0] != "push":
        hint = "answer every pull at once with self.theta and self.version."
    else:
        hint = _diagnose_async(g, e, before, pushes[k], opts, version)

    def show(event):
        if event is None or event[0] != "push":
            return _show(event)
        return _show(event) + (f" (version {event[4]} after it, staleness {event[6]})"
                               if event[3] == "applied" else f" (version {event[4]} after it)")
    return CheckFailed(f"{where}\n  event {i + 1}: expected {show(e)}, your server gave "
                       f"{show(g)}\nHint: {hint}")


def check_async_shard(shard_class: Callable, seed: int = 0) -> bool:
    """Lab 04, exercise 2: ``shard_class(theta, lr, staleness_aware, max_staleness)`` with
    ``on_push(worker, version, grad_sum, count) -> 'applied' | 'rejected'`` and a
    ``staleness`` list, push by push against :class:`ReferenceAsyncShard` (the course's
    ``ps.Asynchronous``) on 5 seeded schedules, then with 4 worker threads."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_async_shard"
    n = 4
    theta0 = np.random.default_rng([seed, 98]).normal(size=n)
    schedules = async_schedules(seed, n)
    for number, (label, opts, messages) in enumerate(schedules, start=1):
        where = f"{name}: schedule {number}/{len(schedules)} ({label})"
        reference = _replay(messages, ReferenceAsyncShard(theta0, **opts), False)
        try:
            student = _run_student(lambda o=opts, m=messages: _replay(
                m, shard_class(theta0.copy(), o["lr"], o["staleness_aware"],
                               o["max_staleness"]), False), where,
                "a push's staleness counts the updates the server applied since its worker "
                "pulled; a fresh push has staleness 0.")
        except NotImplementedError:
            return not_implemented(name)
        failure = _async_failure(where, messages, student, reference, opts, theta0)
        if failure is not None:
            raise failure
    target = np.random.default_rng([seed, 8]).normal(size=n)

    def compute(w, version, theta):
        time.sleep(0.001 * ((w * 7 + version) % 3))  # uneven workers: staleness varies
        return (w + 1) * (theta - target), w + 1
    opts = dict(lr=0.2, staleness_aware=True, max_staleness=2)
    where = f"{name}: 4 worker threads and a server thread, 8 pushes each, {opts}"
    run = run_threads(shard_class(theta0.copy(), *opts.values()), 4, 8, compute, sync=False)
    if run["error"] is not None:
        raise CheckFailed(f"{where}\n  your server raised {type(run['error']).__name__}: "
                          f"{run['error']}\nHint: see the schedules above.")
    reference = _replay(run["messages"], ReferenceAsyncShard(theta0, **opts), False)
    failure = _async_failure(where, run["messages"], run["loop"], reference, opts, theta0)
    if failure is not None:
        raise failure
    if run["late"]:
        raise CheckFailed(f"{where}\n  {run['late'][0]} got no answer within {TIMEOUT:g}s"
                          "\nHint: an async server answers every message at once.")
    print(f"✓ {name}: {len(schedules)} schedules and a run of 4 worker threads match the "
          "course's server")
    return True
