"""Lab 02 checks: run a student's function on every rank of a real cluster, compare the results.

Used in labs/02_parallel_computing.ipynb, right under each exercise::

    from course_lib.checks import lab02_parallel_computing as checks
    ok_ring = checks.check_ring_pass(ring_pass, cluster)
    ok_grad = checks.check_global_gradient(global_gradient, cluster)

The student's function is serialised with cloudpickle (by value, with the globals it uses, so
a function defined in the notebook runs on the engines) and called on the first ``world_size``
ranks of the cluster as ``fn(comm, ...)``, with ``comm`` a ``course_lib.comm`` communicator over
those ranks (a torch.distributed group, Gloo on CPU) whose waits time out after ``timeout``
seconds. Each case uses fresh seeded inputs; world sizes run from 2 to the cluster's size. A
blocking send cycle ends in a ``CommTimeout`` on the ranks, which the check turns into a hint
instead of a hang. The conventions are those of ``course_lib.checks``: a pass line and True,
``CheckFailed`` with a hint, or False (with a notice) while the function is not written yet.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from course_lib.checks.framework import CheckFailed, compare, not_implemented, pack_function

DEADLOCK_HINT = (
    "the ranks waited for each other until the deadline: a blocking-send cycle. When every rank "
    "first sends to its right neighbour and only then receives, each send waits for a receive "
    "that is never posted (Gloo's send always waits for the matching receive; MPI's does once "
    "the message is larger than its eager limit). Use comm.sendrecv(sendbuf, right, recvbuf, "
    "left), or let even ranks send first and odd ranks receive first.")


@dataclass
class _Case:
    label: str
    world_size: int
    kind: str      # "ring" or "gradient"
    params: tuple


# ---------------------------------------------------------------- on the engines
def _rank_inputs(kind, params, rank, world_size):
    """This rank's arguments for a case (after ``comm``), rebuilt from the seed on each side."""
    if kind == "ring":
        shape, dtype, seed = params
        rng = np.random.default_rng([seed, rank])
        if np.issubdtype(np.dtype(dtype), np.integer):
            return (rng.integers(-1000, 1000, size=shape).astype(dtype),)
        return (rng.normal(size=shape).astype(dtype),)
    from course_lib import data
    n_total, n_features, seed = params
    X, y, _ = data.make_linear(n_total, n_features, noise=0.5, seed=seed)
    theta = np.random.default_rng(seed + 1).normal(size=X.shape[1])
    X_r, y_r = data.shard(X, y, rank, world_size)
    return X_r.copy(), y_r.copy(), theta, n_total


def _plain(x):
    """Tensors to numpy arrays (lists and tuples element-wise), so any answer pickles back."""
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "detach") and hasattr(x, "numpy"):
        return x.detach().cpu().numpy()
    return x


def _call_student(fn_bytes, world_size, kind, params, timeout):
    """On every cluster rank: call the student's function on the first ``world_size`` ranks."""
    import cloudpickle

    from course_lib.comm.subgroups import subgroup_comm
    # one group per size, made once by every rank and kept until the process group is made
    # again (setup_engine empties the cache): making and destroying one per case churns Gloo's
    # connections, and under load a new group's connection can then fail
    comm = subgroup_comm(world_size, timeout=timeout)
    if comm is None:
        return None
    rank = comm.rank
    fn = cloudpickle.loads(fn_bytes)
    args = _rank_inputs(kind, params, rank, world_size)
    counted = _Counted(comm)
    got = fn(counted if kind == "ring" else comm, *args)
    buffers = _buffers(got, args[0], _rank_inputs(kind, params, rank, world_size)[0])
    return _plain(got), dict(buffers, sent=counted.sent)


class _Counted:
    """The comm a student's ring gets: the same calls, with the messages it sends counted."""

    def __init__(self, comm):
        self._comm, self.sent = comm, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def send(self, *args, **kwargs):
        self.sent += 1
        return self._comm.send(*args, **kwargs)

    def isend(self, *args, **kwargs):
        self.sent += 1
        return self._comm.isend(*args, **kwargs)

    def sendrecv(self, *args, **kwargs):
        self.sent += 1
        return self._comm.sendrecv(*args, **kwargs)


def _buffers(got, value, fresh):
    """What the buffers of a rank's answer share: the pairs of entries that are one array, the
    entries that are the caller's ``value``, and whether ``value`` was changed in place."""
    arrays = [g.detach().numpy() if hasattr(g, "detach") else g
              for g in (got if isinstance(got, (list, tuple)) else [])]
    arrays = [a if isinstance(a, np.ndarray) else None for a in arrays]
    pairs = [(i, j) for i in range(len(arrays)) for j in range(i + 1, len(arrays))
             if arrays[i] is not None and arrays[j] is not None
             and np.shares_memory(arrays[i], arrays[j])]
    inputs = [i for i, a in enumerate(arrays) if a is not None and np.shares_memory(a, value)]
    return {"pairs": pairs, "inputs": inputs,
            "input_changed": not np.array_equal(value, fresh, equal_nan=True)}


def _train_on_rank(fn_bytes, n_samples, n_features, lr, num_epochs, seed, timeout):
    """On every cluster rank: batch GD on this rank's shard with the student's gradient."""
    import cloudpickle

    from course_lib.comm import get_comm
    comm = get_comm("torch", timeout=timeout)
    fn = cloudpickle.loads(fn_bytes)
    X_r, y_r, _, n_total = _rank_inputs("gradient", (n_samples, n_features, seed), comm.rank,
                                        comm.world_size)
    theta = np.zeros(X_r.shape[1])
    thetas = [theta]
    for _ in range(num_epochs):
        theta = theta - lr * np.asarray(_plain(fn(comm, X_r, y_r, theta, n_total)))
        thetas.append(theta)
    return np.array(thetas)


# ---------------------------------------------------------------- on the client
def _run_case(name, where, fn_bytes, cluster, case, timeout, hint):
    """One case on the cluster; returns the per-rank results, or None if not implemented."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import ClusterError, ClusterTimeout, RemoteError
    try:
        results = cluster.run(_call_student, fn_bytes, case.world_size, case.kind, case.params,
                              timeout, timeout=timeout + 30)
    except RemoteError as err:
        texts = dict(err.errors)
        if any(t.startswith("NotImplementedError") for t in texts.values()):
            return None
        waits = ("CommTimeout", "CommError")  # ranks left waiting for a partner
        crashed = {r: t for r, t in texts.items() if not t.startswith(waits)}
        if crashed:  # a real error on some rank: the others then wait for it in vain
            rank = min(crashed)
            first = crashed[rank].splitlines()[0]
            raise CheckFailed(f"{where}\n  your function raised on rank(s) {sorted(crashed)}; "
                              f"rank {rank}: {first}\nHint: {_crash_hint(first) or hint}"
                              ) from None
        timed_out = sorted(r for r, t in texts.items() if t.startswith("CommTimeout"))
        first = texts[(timed_out or sorted(texts))[0]].splitlines()[0]
        raise CheckFailed(f"{where}\n  {first}\nHint: {_wait_hint(texts, case)}") from None
    except ClusterTimeout as err:
        raise CheckFailed(f"{where}\n  {err}\nHint: {DEADLOCK_HINT}") from None
    except ClusterError as err:
        raise CheckFailed(f"{where}\n  {err}\nHint: {hint}") from None
    return results[:case.world_size]


_WAITED = re.compile(r"^CommTimeout: rank (\d+): (\w+) (?:from|to) rank (\d+)")
_MISFIT = re.compile(r"rank (\d+): \w+ from rank (\d+) of (.*?) over .*?: rank \d+ sent (\d+) "
                     r"bytes \((.*?)\) but the receive buffer holds (\d+) bytes")


def _wait_hint(texts, case):
    """Why the ranks of a case were left waiting: a message that did not fit its buffer, a
    blocking-send cycle, or receives from ranks that were sending elsewhere."""
    for text in texts.values():
        misfit = _MISFIT.search(text)
        if misfit:
            rank, src, buf, sent, elements, holds = misfit.groups()
            return (f"a message did not fit its receive buffer: rank {src} sent {sent} bytes "
                    f"({elements}) and rank {rank}'s buffer, {buf}, holds {holds} bytes. The "
                    f"receive buffer must be the size of what arrives: the value's shape AND "
                    f"its dtype.")
    waits = {}
    for text in texts.values():
        m = _WAITED.match(text)
        if m:
            waits[int(m.group(1))] = (m.group(2), int(m.group(3)))
    ops = {op for op, _ in waits.values()}
    if waits and ops <= {"sendrecv", "recv"} and "send" not in ops:
        who = ", ".join(f"rank {r} for rank {src}" for r, (_, src) in sorted(waits.items()))
        return (f"the ranks waited in vain for messages to arrive ({who}): with sendrecv no "
                f"send blocks another, so each of these receives named a rank that, in that "
                f"step, sent to someone else. Whoever rank r receives from must be the one "
                f"that sends to rank r.")
    return DEADLOCK_HINT


def _crash_hint(first_line):
    """A hint for a crash whose message gives the mistake away; None for the others."""
    if "'NoneType'" in first_line:
        return ("your function handed comm a None: an entry of your list that nothing has "
                "filled yet (what a rank forwards in a step must be what it has already).")
    return None


def _run_check(name, student_fn, cluster, cases, expected_fn, diagnose, hint, timeout,
               also=lambda case, rank, buffers: None):
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    if cluster.n < 2:
        raise ValueError(f"{name} needs a cluster of at least 2 engines, this one has {cluster.n}")
    fn_bytes = pack_function(student_fn)
    for number, case in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({case.label})"
        results = _run_case(name, where, fn_bytes, cluster, case, timeout, hint)
        if results is None:
            return not_implemented(name)
        expected = expected_fn(case)
        for rank, (got, buffers) in enumerate(results):
            problem = compare(expected, got, f"rank {rank}'s result")
            if problem:
                specific = diagnose(case, expected, got, rank, buffers)
                raise CheckFailed(f"{where}\n  {problem}\nHint: {specific or hint}")
            wrong = also(case, rank, buffers)  # a right result made the wrong way
            if wrong:
                raise CheckFailed(f"{where}\n  {wrong}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match the reference on every rank")
    return True


def _world_sizes(cluster):
    return list(range(2, cluster.n + 1))


# ---------------------------------------------------------------- exercise 1: ring_pass
def _ring_expected(case):
    return [_rank_inputs("ring", case.params, r, case.world_size)[0]
            for r in range(case.world_size)]


def _ring_messages(case, rank, buffers):
    """More messages than a ring pass needs (world_size - 1 per rank), as a failure's text."""
    n = case.world_size
    if buffers["sent"] > n - 1:
        return (f"rank {rank}'s list is right, but it sent {buffers['sent']} messages; a ring "
                f"pass needs world_size - 1 = {n - 1}\nHint: your last step only passed each "
                f"value back to the rank it started on: it costs a message and teaches nothing "
                f"new." if buffers["sent"] == n else
                f"rank {rank}'s list is right, but it sent {buffers['sent']} messages; a ring "
                f"pass needs world_size - 1 = {n - 1}\nHint: every value reaches every rank "
                f"after world_size - 1 steps of one message each.")
    return None


def _diagnose_ring(case, expected, got, rank, buffers):
    """Tell a list of the wrong length, a buffer of the wrong dtype or shape, entries never
    filled, one buffer for every step, the caller's value received into, no forwarding and a
    wrong index apart."""
    n = len(expected)
    if not isinstance(got, (list, tuple)):
        return (f"return a list of world_size = {n} arrays, entry r holding rank r's value; "
                f"yours is {type(got).__name__}.")
    if len(got) != n:
        own = any(_same_array(g, expected[rank]) for g in got)
        if len(got) == n - 1 and not own:
            return (f"rank {rank}'s list has world_size - 1 = {n - 1} entries, the values it "
                    f"received: its own value is missing (it belongs at index {rank}).")
        if len(got) < n:
            return (f"rank {rank} returned {len(got)} of the {n} values: every rank (not "
                    f"only one) must end with the list of all of them, in rank order.")
        return f"rank {rank} returned {len(got)} entries, for world_size = {n} ranks."
    if buffers["inputs"] or buffers["input_changed"]:
        return (f"rank {rank} received into value, the caller's array (its entries "
                f"{buffers['inputs']} are that array, and it changed): the caller's value is "
                f"overwritten, and each entry stored from it ends as the last value received.")
    if buffers["pairs"]:
        i, j = buffers["pairs"][0]
        return (f"entries {i} and {j} of rank {rank}'s list are one array: you kept receiving "
                f"into one buffer, so every entry stored from it shows the last value "
                f"received there.")
    none = [i for i, g in enumerate(got) if g is None]
    if none:
        if rank in none or not np.array_equal(np.asarray(got[rank]), expected[rank]):
            return (f"rank {rank}'s own entry ({rank}) was overwritten and entry {none[0]} was "
                    f"never filled: the index you store each arrival at is off by one.")
        return (f"entry {none[0]} of rank {rank}'s list was never filled (None): "
                f"{'your loop ran one step too few' if len(none) == 1 else 'steps are missing'}"
                f", where world_size - 1 = {n - 1} values have to arrive.")
    try:
        got = [np.asarray(g) for g in got]
        dtype, shape = expected[rank].dtype, expected[rank].shape
        for i, g in enumerate(got):
            if i == rank:
                continue
            if g.dtype != dtype:
                same_bytes = g.nbytes == expected[i].nbytes and np.array_equal(
                    np.ascontiguousarray(g).view(dtype).reshape(shape), expected[i])
                return (f"entry {i} is {g.dtype}, the values are {dtype}" + (
                    ": the bytes arrived, read as another type" if same_bytes else "")
                    + ". The receive buffer must have the value's dtype (and shape).")
            if g.shape != shape:
                return (f"entry {i} has shape {g.shape}, the values have shape {shape}: the "
                        f"receive buffer must have the value's shape (and dtype).")
        left = (rank - 1) % n
        received = [got[i] for i in range(n) if i != rank]
        if n > 2 and all(np.array_equal(g, expected[left]) for g in received):
            return (f"every entry rank {rank} received holds rank {left}'s value: each rank "
                    "sent its own value at every step, so only the neighbour's value ever "
                    "arrives. What a rank sends on must change from step to step.")
        for i in range(n):
            for j in range(i + 1, n):
                if np.array_equal(got[i], got[j]) and not np.array_equal(expected[i],
                                                                          expected[j]):
                    return (f"entries {i} and {j} hold the same array: you kept receiving into "
                            "one buffer, so every entry stored from it shows the last value "
                            "received there.")
        matches = [next((j for j, e in enumerate(expected) if np.array_equal(g, e)), None)
                   for g in got]
    except (TypeError, ValueError):
        return None
    if None not in matches:
        if all(matches[i] == (2 * rank - i) % n for i in range(n)):
            return (f"rank {rank} received every value but entry i holds the value of rank "
                    f"{matches}[i]: the index you store an arrival at and the rank it started "
                    f"on go round the ring in opposite directions.")
        return (f"rank {rank} received every value but stored them at the wrong index "
                f"(entry i holds rank {matches}[i]'s value).")
    return None


def check_ring_pass(student_fn: Callable, cluster, seed: int = 0, timeout: float = 5.0) -> bool:
    """Lab 02, exercise 1: ``ring_pass(comm, value)`` returns every rank's value on every rank.

    Runs on the cluster for world sizes 2 .. cluster.n, with float64, int64, 2-D float32 and a
    1 MiB payload; every rank must return the list of all values in rank order (compared with
    the inputs, as ``course_lib.parallel_gd.ring_pass`` returns them). A deadlock ends after
    ``timeout`` seconds with a hint.
    """
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = []
    for k in _world_sizes(cluster):
        cases += [_Case(f"world_size={k}, value shape (3,) float64", k, "ring",
                        ((3,), "float64", seed + k))]
    k = cluster.n
    cases += [_Case(f"world_size={k}, value shape (4,) int64", k, "ring", ((4,), "int64", seed)),
              _Case(f"world_size={k}, value shape (2, 3) float32", k, "ring",
                    ((2, 3), "float32", seed + 1)),
              _Case(f"world_size={k}, a large value: 131072 float64 (1 MiB)", k, "ring",
                    ((131072,), "float64", seed + 2))]
    return _run_check("check_ring_pass", student_fn, cluster, cases, _ring_expected,
                      _diagnose_ring, timeout=timeout, also=_ring_messages,
                      hint="in each of world_size - 1 steps a rank passes one value to one "
                           "neighbour and takes one from the other; every value ends at the "
                           "index of the rank it started on.")


# ---------------------------------------------------------------- exercise 2: global_gradient
def _gradient_parts(case):
    """Per-shard gradient sums and sizes, and the full gradient, for a gradient case."""
    from course_lib.models import LinearRegression
    k = case.world_size
    parts = [_rank_inputs("gradient", case.params, r, k) for r in range(k)]
    sums = [LinearRegression().grad_sum(theta, X_r, y_r) for X_r, y_r, theta, _ in parts]
    return sums, [len(p[1]) for p in parts], sum(sums) / case.params[0]


def _gradient_expected(case):
    return _gradient_parts(case)[2]


def _same_array(a, b):
    try:
        return a is not None and np.array_equal(np.asarray(a), b)
    except (TypeError, ValueError):
        return False


def _diagnose_gradient(case, expected, got, rank, buffers):
    """Map the mismatch to the usual mistakes: the wrong divisor, the wrong sign, own shard
    only, mean of shard means, the parts not combined, no transpose."""
    sums, sizes, full = _gradient_parts(case)
    m, k = case.params[0], case.world_size
    try:
        got = np.asarray(got, dtype=float)
    except (TypeError, ValueError):
        return None
    if got.shape == (k,) + full.shape:
        return (f"your result holds the {k} ranks' parts, one row each: they are not yet "
                f"combined into one gradient.")
    if got.shape == (sizes[rank],) and sizes[rank] != full.size:
        return (f"your result has one entry per row of rank {rank}'s shard ({sizes[rank]}), "
                f"the gradient one per parameter ({full.size}): the residuals still have to "
                f"be taken back through the features (X_shard transposed).")
    if got.shape != full.shape:
        return None
    close = lambda a: bool(np.allclose(got, a, rtol=1e-6, atol=1e-9))
    total = full * m
    if close(total):
        return f"that is the SUM of the gradients: it is not divided by m = n_total = {m}."
    if close(-full):
        return "your gradient has the opposite sign: it points downhill, not uphill."
    if close(full / 2):
        return ("your gradient is half the right one: the 1/2 in J cancels against the 2 "
                "that the square's derivative brings down.")
    if close(total / k):
        return (f"you divided the sum by world_size = {k}, the number of ranks: the mean is "
                f"over the m = {m} rows of the data.")
    if sizes[rank] and close(total / sizes[rank]):
        if sizes[rank] * k == m:
            return (f"your gradient is world_size = {k} times the right one: the sum over all "
                    f"the ranks is divided by one shard's size ({sizes[rank]}), as adding the "
                    f"shard means does, but it covers all m = {m} rows.")
        return (f"you divided the sum by rank {rank}'s shard size ({sizes[rank]}): the mean "
                f"is over all m = {m} rows, and the shards here have sizes {sizes}.")
    if sizes[rank] and close(total / (sizes[rank] * k)):
        return (f"you divided by world_size x rank {rank}'s shard size = {sizes[rank] * k}: "
                f"that is m only when the shards have equal sizes; here they have {sizes}.")
    if close(sums[rank] / m) or (sizes[rank] and close(sums[rank] / sizes[rank])) \
            or close(sums[rank]) or close(sums[rank] * k / m):
        return (f"that is rank {rank}'s own shard only: each rank's gradient sum covers its "
                "own rows, and the other ranks' sums never reached it.")
    means = [s / n for s, n in zip(sums, sizes, strict=True) if n]
    if means and close(sum(means) / k):
        return (f"that is the mean of the shard means (1/k times the sum of each shard's mean "
                f"gradient). It equals the full gradient only when all shards have the same "
                f"size; here they have {sizes}.")
    if means and close(sum(means)):
        return (f"that is the sum of the shard means: a shard's mean weighs its rows by 1 / "
                f"its size, so with sizes {sizes} the rows do not count alike.")
    return None


def check_global_gradient(student_fn: Callable, cluster, seed: int = 0,
                          timeout: float = 5.0) -> bool:
    """Lab 02, exercise 2: ``global_gradient(comm, X_shard, y_shard, theta, n_total)``.

    Every rank must return the full-data gradient ``X.T @ (X @ theta - y) / m`` of the
    linear-regression loss, as ``course_lib.parallel_gd.global_gradient`` does, for world sizes
    2 .. cluster.n: even shards, uneven ones, 1000 samples and an empty shard.
    """
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [_Case(f"world_size={k}, m=40, 3 features (shards {_sizes(40, k)})", k, "gradient",
                   (40, 3, seed + k)) for k in _world_sizes(cluster)]
    k = cluster.n
    for m, d, s in ((10, 2, 1), (1000, 8, 2), (k - 1, 3, 3)):
        cases.append(_Case(f"world_size={k}, m={m}, {d} features (shards {_sizes(m, k)})", k,
                           "gradient", (m, d, seed + s)))
    return _run_check("check_global_gradient", student_fn, cluster, cases, _gradient_expected,
                      _diagnose_gradient, timeout=timeout,
                      hint="each rank's shard gives a partial SUM of the gradient (also "
                           "for an empty shard); every rank needs the whole sum, over the "
                           "n_total rows of all the data.")


def _sizes(m, k):
    from course_lib.sharding import shard_bounds
    return [b - a for a, b in (shard_bounds(m, r, k) for r in range(k))]


# ---------------------------------------------------------------- use it: train on the cluster
def train_on_cluster(student_fn: Callable, cluster, n_samples=200, n_features=3, lr=0.1,
                     num_epochs=30, seed=0, timeout=10.0):
    """Batch GD with ``student_fn`` as the gradient, each rank on its own shard of the data.

    Returns ``(thetas, spread)``: rank 0's parameters after every epoch (``num_epochs + 1``
    rows) and the largest difference between any two ranks' parameters (0 when every rank
    computes the same gradient). Compare ``thetas`` with ``course_lib.gd.batch_gd`` on all the
    data (data from ``data.make_linear(n_samples, n_features, noise=0.5, seed=seed)``).
    """
    per_rank = cluster.run(_train_on_rank, pack_function(student_fn), n_samples, n_features, lr,
                           num_epochs, seed, timeout, timeout=timeout + 30 + num_epochs)
    spread = max(float(np.max(np.abs(t - per_rank[0]))) for t in per_rank)
    return per_rank[0], spread
