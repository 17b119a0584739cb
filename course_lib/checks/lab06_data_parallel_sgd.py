"""Lab 06 checks: a student's bucket assignment and bucketed, overlapped gradient averaging.

Introduced in labs/06_data_parallel_sgd.ipynb, on the framework of :mod:`course_lib.checks`::

    checks.check_assign_buckets(assign_buckets)                   # in the notebook's process
    ok, timelines = checks.check_overlapped_averager(OverlappedAverager, cluster)

The second check sends the student's class to every rank of a small cluster (cloudpickle) and
trains the same MLP on the digits twice, once averaged by the student's class and once by
torch's ``DistributedDataParallel``; the parameters must agree to 1e-5 (float32) after every
step. Every ``dist.all_reduce`` the class makes is recorded (launch time, completion time,
blocking or not), so the check also sees whether the first bucket's allreduce was launched
while backward was still computing gradients, and returns the ranks' timelines to draw.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np

from course_lib.checks.framework import (
    Case,
    CheckFailed,
    not_implemented,
    pack_function,
    sequence_difference,
)

HIDDEN, CAP_BYTES, BATCH, STEPS, LR = (128, 128, 128), 40_000, 64, 4, 0.1
WAIT_DEADLINE = 10.0  # seconds a student's work.wait() may take before it is an error
TOLERANCE = 1e-5
BUCKET_HINT = ("go through the three rules above the exercise again: the order in which the "
               "parameters are walked, when a bucket closes, and what happens at the end.")


# ---------------------------------------------------------------- exercise 1 (local)
def _bucket_cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    mlp = [4 * n for n in (64 * 128, 128, 128 * 128, 128, 128 * 128, 128, 128 * 10, 10)]
    specs = [(mlp, 40_000, "an MLP's parameters, two weights larger than the cap"),
             (mlp, 10**9, "a cap larger than the whole model: one bucket"),
             (mlp, 1, "a cap of 1 byte: every parameter alone"),
             ([400] * 6, 800, "six equal parameters, two fill a bucket exactly"),
             ([100, 5000, 100, 100, 5000, 100], 1000, "large parameters between small ones"),
             (list(rng.integers(1, 200, 12) * 4), 600, "twelve random sizes"),
             ([], 100, "a model without parameters: no bucket")]
    return [Case(f"{len(s)} parameters, cap {cap} bytes: {text}",
                 lambda s=s, cap=cap: (list(s), cap)) for s, cap, text in specs]


def _as_lists(buckets):
    return [[int(i) for i in b] for b in buckets]


def _buckets_like(sizes, cap, mistake):
    """The buckets as written with ``mistake``: each a list of parameter indices."""
    n, order = len(sizes), list(reversed(range(len(sizes))))
    out, current, filled = [], [], 0
    for i in order:
        if mistake == "close before the cap" and current and filled + sizes[i] > cap:
            out.append(current)
            current, filled = [], 0
        current.append(n - 1 - i if mistake == "numbered from the end" else i)
        filled += 4 * sizes[i] if mistake == "4 x sizes" else sizes[i]
        if filled >= cap and mistake != "close before the cap":
            out.append(current)
            current, filled = [], (filled - cap if mistake == "carry over" else 0)
    if current:
        out.append(current)
    if mistake == "buckets reversed":
        out = out[::-1]
    elif mistake == "each bucket sorted":
        out = [sorted(b) for b in out]
    return out


# The usual mistakes of the buckets, replayed: (mistake, what the student's buckets did).
BUCKET_MISTAKES = [
    ("numbered from the end", "your buckets have the right sizes but count the parameters "
     "from the end: position k of the reversed sizes is parameter len(sizes) - 1 - k, and a "
     "bucket holds the parameters' own indices."),
    ("carry over", "after closing a bucket your count of bytes did not start again from zero: "
     "what went over the cap was carried into the next bucket, which then closes too early."),
    ("4 x sizes", "you counted every size 4 times: sizes are in bytes already (the caller "
     "multiplied by the element size)."),
    ("buckets reversed", "your buckets are right but in reverse order: the first bucket is the "
     "one backward fills first, which holds the LAST parameters."),
    ("each bucket sorted", "your buckets hold the right parameters, each bucket in increasing "
     "order: list them in the order they were added, the order backward produces them."),
    ("close before the cap", "you closed a bucket before a parameter could push it over the "
     "cap: here a bucket closes once it holds at least cap_bytes, so it may exceed the cap by "
     "its last parameter."),
]


def _diagnose_buckets(got, sizes, cap):
    try:
        got = _as_lists(got)
    except (TypeError, ValueError):
        return "return a list of buckets, each a list of parameter indices."
    for mistake, text in BUCKET_MISTAKES:
        if got == _buckets_like(sizes, cap, mistake):
            return text
    flat = [i for b in got for i in b]
    if sorted(flat) != list(range(len(sizes))):
        missing = sorted(set(range(len(sizes))) - set(flat))
        if missing and sorted(flat) == [i for i in range(len(sizes)) if i not in missing] \
                and missing == list(range(len(missing))):
            return (f"parameters {missing[::-1]} are in no bucket: the bucket still open at the "
                    f"end (holding less than cap_bytes) was dropped.")
        return "every parameter index must appear in exactly one bucket."
    if any(not b for b in got):
        return "never return an empty bucket."
    if flat == sorted(flat) and len(sizes) > 1:
        return ("your buckets follow the model's order; backward produces the LAST layer's "
                "gradient first, and the buckets are filled in that order.")
    for b in got[:-1]:
        if sum(sizes[i] for i in b) < cap:
            return (f"bucket {b} holds {sum(sizes[i] for i in b)} bytes, less than the cap of "
                    f"{cap}, yet you closed it: a bucket closes only once it holds at least "
                    "cap_bytes (a large parameter may join it and push it over the cap).")
    for b in got:
        if len(b) > 1 and sum(sizes[i] for i in b[:-1]) >= cap:
            return (f"bucket {b} already held {sum(sizes[i] for i in b[:-1])} >= {cap} bytes "
                    "before its last parameter: a bucket closes as soon as it holds at least "
                    "cap_bytes (>=, not >).")
    return BUCKET_HINT


def check_assign_buckets(student_fn, seed: int = 0) -> bool:
    """Lab 06, exercise 1: ``assign_buckets(sizes, cap_bytes)`` -> lists of parameter indices,
    as ``course_lib.ddp.assign_buckets``, on 6 cases; ``sizes`` must be left unchanged."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.ddp import assign_buckets
    name = "check_assign_buckets"
    cases = _bucket_cases(seed)
    for number, case in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({case.label})"
        sizes, cap = case.args()
        expected = _as_lists(assign_buckets(list(sizes), cap))
        given = list(sizes)
        try:
            got = student_fn(given, cap)
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}"
                              f"\nHint: {BUCKET_HINT}") from err
        if given != sizes:
            raise CheckFailed(f"{where}\n  your function changed the caller's list of sizes."
                              "\nHint: sizes.reverse() (or sort) reorders the caller's list in "
                              "place: the caller still needs it in the model's order.")
        try:
            shown = _as_lists(got)  # tuples or numpy ints compare as the lists they hold
        except (TypeError, ValueError):
            shown = None
        if shown != expected:
            difference = sequence_difference(expected, got if shown is None else shown)
            raise CheckFailed(f"{where}\n  sizes {sizes}\n{difference}"
                              f"\nHint: {_diagnose_buckets(got, sizes, cap)}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match the reference")
    return True


# ---------------------------------------------------------------- exercise 2 (on the ranks)
class _RecordedWork:
    """A ``dist.all_reduce(..., async_op=True)`` handle whose wait has a deadline."""

    def __init__(self, work, record):
        self._work, self._record = work, record
        work.get_future().add_done_callback(lambda _: record.__setitem__("end",
                                                                         time.perf_counter()))

    def wait(self, timeout=None):
        try:
            return self._work.wait(timeout or timedelta(seconds=WAIT_DEADLINE))
        except RuntimeError as e:
            raise TimeoutError(f"an allreduce of {self._record['bytes']} bytes did not complete "
                               f"within {WAIT_DEADLINE:g}s on this rank: {e}") from None

    def __getattr__(self, name):
        return getattr(self._work, name)


class _Recorder:
    """Replaces ``torch.distributed.all_reduce`` while the student's code runs."""

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.original, self.calls = dist, dist.all_reduce, []

    def __call__(self, tensor, *args, async_op=False, **kwargs):
        record = dict(start=time.perf_counter(), end=None, async_op=bool(async_op),
                      bytes=tensor.numel() * tensor.element_size(),
                      launched=tensor.detach().clone())  # what the allreduce is handed
        self.calls.append(record)
        work = self.original(tensor, *args, async_op=async_op, **kwargs)
        if not async_op:
            record["end"] = time.perf_counter()
            return work
        return _RecordedWork(work, record)

    def __enter__(self):
        self.dist.all_reduce = self
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self.original


def run_averager(payload, steps=STEPS, cap_bytes=CAP_BYTES, hidden=HIDDEN, batch=BATCH,
                 lr=LR, seed=0):
    """On every rank: train an MLP on the digits with the student's averager and with torch DDP.

    Returns per step the largest parameter difference between the two, the first step's
    gradient ratios (student / torch DDP, student / this rank's own), the recorded allreduces,
    the times at which the last gradient became ready and backward returned, and a Timeline.
    """
    import cloudpickle
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_lib import data, ddp, models, sharding
    from course_lib.runtime import timeline
    cls = cloudpickle.loads(payload)
    rank, world = dist.get_rank(), dist.get_world_size()
    X, y, _, _ = data.load_digits()
    X, y = torch.from_numpy(X).float(), torch.from_numpy(y).long()
    order = np.random.default_rng(seed).permutation(len(X))
    lo, hi = sharding.shard_bounds(batch, rank, world)
    mine, ref = (models.mlp(64, list(hidden), 10, seed=seed) for _ in range(2))
    ref_net = torch.nn.parallel.DistributedDataParallel(ref, bucket_cap_mb=cap_bytes / 2**20)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (mine, ref)]
    ready = {}  # parameter -> when its gradient was final (this hook runs before the student's)
    for i, p in enumerate(mine.parameters()):
        p.register_post_accumulate_grad_hook(
            lambda p, i=i: ready.__setitem__(i, time.perf_counter()))
    averager = cls(mine, cap_bytes)
    params = list(mine.parameters())
    buckets = ddp.assign_buckets([p.numel() * p.element_size() for p in params], cap_bytes)
    tl, out = timeline.Timeline(rank), dict(diffs=[], steps=[])
    for s in range(steps):
        idx = order[s * batch:(s + 1) * batch][lo:hi]
        ready.clear()
        with _Recorder() as rec:
            t0 = time.perf_counter()
            loss = F.cross_entropy(mine(X[idx]), y[idx])
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            local = [p.grad.clone() for p in mine.parameters()]
            averager.wait()
            t3 = time.perf_counter()
        F.cross_entropy(ref_net(X[idx]), y[idx]).backward()
        off = {}  # parameter -> what its gradient holds, for those that differ from DDP's
        for i, (a, b) in enumerate(zip(mine.parameters(), ref.parameters(), strict=True)):
            if not torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6):
                off[i] = ("zero" if not a.grad.any() else
                          "own share" if torch.allclose(a.grad, local[i] / world) else
                          "own" if torch.allclose(a.grad, local[i]) else "other")
        if s == 0:
            g_mine = torch.cat([p.grad.reshape(-1) for p in mine.parameters()])
            g_ref = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
            g_local = torch.cat([g.reshape(-1) for g in local])
            out["sum_ratio"] = float(g_mine.norm() / g_ref.norm().clamp_min(1e-30))
            out["is_local"] = bool(torch.allclose(g_mine, g_local, atol=1e-7)) and world > 1
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["diffs"].append(max(float((a - b).abs().max()) for a, b in
                                zip(mine.parameters(), ref.parameters(), strict=True)))
        unfilled = _unfilled(rec.calls, buckets, local)
        for c in rec.calls:
            del c["launched"]
        out["steps"].append(dict(calls=rec.calls, last_grad=max(ready.values(), default=t2),
                                 backward_end=t2, off=off, ready=dict(ready),
                                 unfilled=unfilled))
        tl.add("forward", "forward", t0, t1)
        tl.add("backward", "backward", t1, t2)
        tl.add("wait", "wait", t2, t3)
        for k, c in enumerate(rec.calls):
            tl.add(f"allreduce {k}", "allreduce", c["start"], c["end"] or t3, bytes=c["bytes"])
    out["timeline"] = tl
    return out


def _unfilled(calls, buckets, local):
    """(bucket, parameters) of the first launch whose buffer, as handed to the allreduce, did
    not hold some of its parameters' gradients of this step, laid out as the lab's constructor
    lays them (the bucket's parameters one after the other); None when every launch held them
    all, or when the launches are not the buckets' (another layout, another order)."""
    calls = sorted(calls, key=lambda c: c["start"])
    sizes = [sum(local[i].numel() for i in b) for b in buckets]
    if [c["launched"].numel() for c in calls] != sizes:
        return None
    for k, (call, bucket) in enumerate(zip(calls, buckets, strict=True)):
        offset, held = 0, []
        for i in bucket:
            n = local[i].numel()
            held.append(bool((call["launched"][offset:offset + n] == local[i].reshape(-1)).all()))
            offset += n
        if any(held) and not all(held):
            return k, [i for i, h in zip(bucket, held, strict=True) if not h]
    return None


def _expected_buckets(cap_bytes, hidden):
    from course_lib import ddp, models
    sizes = [p.numel() * 4 for p in models.mlp(64, list(hidden), 10).parameters()]
    return len(ddp.assign_buckets(sizes, cap_bytes))


def _judge(results, world):
    """Raise CheckFailed with a hint for the first thing wrong; None when all is right."""
    from course_lib import ddp, models
    sizes = [p.numel() * 4 for p in models.mlp(64, list(HIDDEN), 10).parameters()]
    buckets = ddp.assign_buckets(sizes, CAP_BYTES)
    n_buckets = len(buckets)
    r0 = results[0]
    for step, st in enumerate(r0["steps"]):
        calls = st["calls"]
        if not calls and step > 0:
            return (f"step {step}: no dist.all_reduce was called (step 0 made "
                    f"{len(r0['steps'][0]['calls'])}).", "after the first step the buckets "
                    "were not ready for the next backward pass: a bucket's count of missing "
                    "gradients stayed where the last step left it.")
        if not calls:
            return (f"step {step}: no dist.all_reduce was called.",
                    "a bucket's allreduce is launched from the hook, once the bucket's last "
                    "missing gradient has arrived.")
        if any(not c["async_op"] for c in calls):
            return (f"step {step}: dist.all_reduce was called without async_op=True, so the "
                    "backward pass stopped until each allreduce finished.",
                    "launch it without waiting (its work is what wait() waits for later).")
        if len(calls) == len(sizes) and n_buckets != len(sizes):
            return (f"step {step}: {len(calls)} allreduces per step, one per parameter; "
                    f"expected one per bucket ({n_buckets}).", "a bucket gathers several "
                    "gradients into one buffer, so that they travel as one larger message: its "
                    "allreduce goes once the whole bucket is in.")
        if len(calls) != n_buckets:
            return (f"step {step}: {len(calls)} allreduce(s) per step, expected one per bucket "
                    f"({n_buckets}).", "launch each bucket's allreduce once per step, when its "
                    "last missing gradient has arrived.")
    diffs = [max(r["diffs"][s] for r in results) for s in range(len(r0["diffs"]))]
    for step in range(len(r0["steps"])):
        early = _launched_early(results, step, buckets, sizes)
        if early:
            k, missing = early
            luck = ("" if diffs[step] > TOLERANCE else " The parameters came out right anyway: "
                    "the allreduce happened to read the buffer late, a race that any other run "
                    "may lose.")
            return (f"step {step}: bucket {k}'s allreduce ({buckets[k]}) was launched before "
                    f"the gradient(s) of parameter(s) {missing} had arrived.{luck}",
                    "a bucket's allreduce can only go once ALL its gradients are in its buffer: "
                    "your count of the missing ones reached its end one gradient early.")
    for step in range(len(r0["steps"])):
        for r in results:
            if r["steps"][step]["unfilled"]:
                k, missing = r["steps"][step]["unfilled"]
                luck = ("" if diffs[step] > TOLERANCE else " The parameters came out right "
                        "anyway: the allreduce happened to read the buffer late, a race that "
                        "any other run may lose.")
                return (f"step {step}: when bucket {k}'s allreduce was launched, its buffer did "
                        f"not hold the gradient(s) of parameter(s) {missing} yet.{luck}",
                        "the allreduce reads the buffer from the moment it is launched: every "
                        "gradient of the bucket must be in the buffer before (a copy that comes "
                        "after the launch is too late).")
    if r0["is_local"]:
        return ("the gradients after wait() are this rank's own: the averages never came back.",
                "the averaged buffers never reached the parameters' p.grad.")
    if abs(r0["sum_ratio"] - world) < 0.05 * world:
        return (f"the gradients are {world}x torch DDP's: a sum over the ranks, not a mean.",
                "the allreduce sums: the mean over the ranks still has to be taken.")
    if abs(r0["sum_ratio"] - 1 / world) < 0.05 / world:
        return (f"the gradients are 1/{world} of torch DDP's: divided by the world size twice.",
                "the allreduce's sum is divided by the world size once.")
    bad = [s for s, d in enumerate(diffs) if not d <= TOLERANCE]
    if bad:
        s = bad[0]
        off = sorted({i for r in results for i in r["steps"][s]["off"]})
        if off and set(off) <= {b[-1] for b in buckets}:
            return (f"step {s}: parameters differ from torch DDP's by {diffs[s]:.2e}; the "
                    f"gradients that differ, of parameters {off}, are each the LAST to arrive "
                    f"in its bucket.", "their bucket's allreduce was launched before their "
                    "gradient was copied into its buffer: the allreduce reads the buffer as it "
                    "is when it starts.")
        where = ("from the first step: each parameter's gradient must come back from its own "
                 "slice of its bucket" if s == 0 else "only from a later step: the buckets "
                 "were not made ready for the next backward pass")
        return (f"step {s}: parameters differ from torch DDP's by {diffs[s]:.2e} "
                f"(> {TOLERANCE:g}).", f"the averages go wrong {where}.")
    st = r0["steps"][-1]
    first = min(c["start"] for c in st["calls"])
    if first >= st["last_grad"]:
        return ("the parameters match, but the first allreduce started only after the last "
                "gradient was computed: no overlap with backward.",
                "a bucket's allreduce can start as soon as the bucket is complete, while "
                "backward computes the rest: wait() comes too late.")
    return None


def _launched_early(results, step, buckets, sizes):
    """(bucket, parameters) of the first bucket whose allreduce started, on some rank, before
    all of its gradients were final; None when every launch came after its bucket was in (or
    the launches are not the buckets', in their order)."""
    for r in results:
        st = r["steps"][step]
        calls = sorted(st["calls"], key=lambda c: c["start"])
        if [c["bytes"] for c in calls] != [sum(sizes[i] for i in b) for b in buckets]:
            return None
        for k, (call, bucket) in enumerate(zip(calls, buckets, strict=True)):
            missing = [i for i in bucket if st["ready"].get(i, float("inf")) > call["start"]]
            if missing:
                return k, missing
    return None


def check_overlapped_averager(student_cls, cluster, steps: int = STEPS):
    """Lab 06, exercise 2: ``student_cls(model, cap_bytes)`` averages the gradients bucket by
    bucket from hooks; ``.wait()`` after backward. Trains ``steps`` steps on every rank of
    ``cluster`` beside torch DDP. Returns ``(ok, timelines)``: ``(False, None)`` while not
    implemented; raises CheckFailed with a hint when something is wrong."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import ClusterTimeout, RemoteError
    name = "check_overlapped_averager"
    try:
        results = cluster.run(run_averager, pack_function(student_cls), steps, timeout=60)
    except RemoteError as e:
        if any(t.startswith("NotImplementedError") for t in e.errors.values()):
            return not_implemented(name), None
        first = "\n  ".join(f"rank {r}: {t.strip().splitlines()[-1]}"
                            for r, t in sorted(e.errors.items()))
        hint = ("read each rank's traceback above; every rank must launch the same allreduces "
                "in the same order, and wait() must wait for each of them.")
        if all("'NoneType' object has no attribute 'wait'" in t for t in e.errors.values()):
            hint = ("wait() found a bucket whose allreduce was never launched in this step (its "
                    "work is None): the bucket's count of missing gradients never came to its "
                    "end. Was it made ready again after the step before?")
        raise CheckFailed(f"{name}: your class raised on the ranks:\n  {first}\nHint: "
                          f"{hint}") from None
    except ClusterTimeout as e:
        raise CheckFailed(f"{name}: {e}\nHint: a rank waited for an allreduce another rank "
                          "never launched: are the buckets and their order the same on every "
                          "rank?") from None
    problem = _judge(results, cluster.n)
    if problem:
        raise CheckFailed(f"{name}: {problem[0]}\nHint: {problem[1]}")
    st = results[0]["steps"][-1]
    lead = (st["backward_end"] - min(c["start"] for c in st["calls"])) * 1e3
    print(f"✓ {name}: {steps} steps on {cluster.n} ranks equal torch DDP's to "
          f"{max(max(r['diffs']) for r in results):.1e}; {len(st['calls'])} bucket "
          f"allreduces per step, the first launched {lead:.1f} ms before backward ended")
    return True, [r["timeline"] for r in results]


# ---------------------------------------------------------------- use it: a bucket-cap sweep
class _RingWork:
    """What ``dist.all_reduce(..., async_op=True)`` returns during the sweep: the course's ring
    runs on a thread of its own, over the emulated link, and ``wait()`` waits for it."""

    def __init__(self, future):
        self.future = future

    def wait(self, timeout=None):
        self.future.result(timeout=WAIT_DEADLINE)
        return True


class _RingAllreduce:
    """Stands in for ``torch.distributed.all_reduce`` in the sweep: the sum by the course's ring
    on ``comm`` (so it crosses the emulated link), launched on one background thread in call
    order, as DDP's communication runs beside backward. Made once; each ``with`` block swaps it
    in for the student's code only (the timing's own collectives stay native)."""

    def __init__(self, comm):
        from concurrent.futures import ThreadPoolExecutor

        import torch.distributed as dist
        self.dist, self.original, self.comm = dist, dist.all_reduce, comm
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lab06-ring")

    def __call__(self, tensor, *args, async_op=False, **kwargs):
        from course_lib.collectives import allreduce
        future = self.pool.submit(allreduce, tensor, self.comm, "ring", check=False)
        work = _RingWork(future)
        return work if async_op else work.wait()

    def __enter__(self):
        self.dist.all_reduce = self
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self.original


def time_averager_on_rank(payload, caps, steps=3, hidden=(256,) * 6, batch=512, seed=0):
    """On every rank: median step time (ms) of the student's averager for each bucket cap in
    ``caps`` (bytes), its allreduces carried by the course's ring over the cluster's emulated
    link; and the same steps without any averaging (compute alone). Returns
    ``(step_ms per cap, compute_ms, buckets per cap)``, the slowest rank's.
    Introduced in labs/06_data_parallel_sgd.ipynb."""
    import cloudpickle
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_lib import models
    from course_lib.comm import get_comm
    from course_lib.runtime import netem
    cls, comm = cloudpickle.loads(payload), get_comm("torch", check_sizes=False)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x, y = torch.randn(batch, 64, generator=gen), torch.randint(0, 10, (batch,), generator=gen)

    ring = _RingAllreduce(comm)

    def time_steps(model, averager):
        times = []
        for _ in range(steps + 1):  # the first step warms up: not counted
            start = netem.start_clock(comm)
            with ring:  # only the student's calls go through the ring
                F.cross_entropy(model(x), y).backward()
                if averager is not None:
                    averager.wait()
            model.zero_grad()
            times.append(time.monotonic() - start)
        return float(np.median(times[1:])) * 1e3

    step_ms, buckets = [], []
    for cap in caps:
        model = models.mlp(64, list(hidden), 10, seed=seed)
        averager = cls(model, cap)
        buckets.append(len(averager.buckets))
        step_ms.append(time_steps(model, averager))
    compute_ms = time_steps(models.mlp(64, list(hidden), 10, seed=seed), None)
    ring.pool.shutdown(wait=True)
    slowest = torch.tensor(step_ms + [compute_ms], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest[:-1].tolist(), float(slowest[-1]), buckets


def sweep_bucket_caps(student_cls, cluster, caps_mb=(0.0625, 0.25, 1, 4), link="400Mbit/s,50us"):
    """Time the student's averager at several bucket caps on an emulated ``link`` (its
    allreduces go through the course's ring, so they cross the link) and plot step time against
    the cap, with compute alone and compute plus one allreduce of every gradient.
    Introduced in labs/06_data_parallel_sgd.ipynb."""
    from IPython.display import display

    from course_lib import models
    from course_lib.figures import data_parallel_sgd as figures
    from course_lib.runtime import netem
    spec = cluster.set_link(link)
    try:
        step_ms, compute_ms, buckets = cluster.run(
            time_averager_on_rank, pack_function(student_cls), [c * 2**20 for c in caps_mb],
            timeout=120)[0]
    finally:
        cluster.set_link(None)
    grad_bytes = 4 * sum(p.numel() for p in models.mlp(64, [256] * 6, 10).parameters())
    comm_ms = 1e3 * netem.predict_allreduce("ring", grad_bytes, cluster.n, spec, check=False)
    display(figures.bucket_sweep_figure(caps_mb, {"your averager": (step_ms, buckets)},
                                        compute_ms, comm_ms,
                                        f"{cluster.n} ranks on an emulated {spec}"))
    return dict(zip(caps_mb, step_ms, strict=True))
