"""Lab 02 checks on a real 3-engine cluster: right answers pass, realistic wrong ones fail with
the right hint, a deadlock ends at the deadline, and the cluster is usable afterwards.

Also the references they compare with: ``parallel_gd.ring_pass`` against the native all_gather,
``parallel_gd.global_gradient`` over ``course_lib.comm`` against the native allreduce and the
single-process gradient. The student functions below are defined in this test module, which
the engines cannot import: the checks send them by value (cloudpickle), as from a notebook.
"""

import numpy as np
import pytest

from course_lib import gd, models, parallel_gd
from course_lib.checks import CheckFailed
from course_lib.checks import lab02_parallel_computing as CP
from course_lib.data import make_linear
from course_lib.testing.timing import assert_no_hang

TIMEOUT = 2.0  # seconds a deadlocked student function waits before its CommTimeout


CLUSTER_SIZE = 3  # the shared cluster of tests/conftest.py
CLUSTER_TIMEOUT = 30


# ---------------------------------------------------------------- student answers, right ones
def ring_oddeven(comm, value):
    """Blocking send and recv, deadlock-free: even ranks send first, odd ranks receive first."""
    p, r = comm.world_size, comm.rank
    values = [None] * p
    values[r] = value.copy()
    for step in range(p - 1):
        incoming = np.empty_like(value)
        if r % 2 == 0:
            comm.send(values[(r - step) % p], (r + 1) % p)
            comm.recv(incoming, (r - 1) % p)
        else:
            comm.recv(incoming, (r - 1) % p)
            comm.send(values[(r - step) % p], (r + 1) % p)
        values[(r - step - 1) % p] = incoming
    return values


def ring_native(comm, value):
    """torch.distributed's own all_gather over the same group: the production answer."""
    import torch
    import torch.distributed as dist
    out = [torch.empty_like(torch.from_numpy(value)) for _ in range(comm.world_size)]
    dist.all_gather(out, torch.from_numpy(value.copy()), group=comm.group)
    return out  # tensors: the check accepts them


def gradient_ring(comm, X_shard, y_shard, theta, n_total):
    return sum(ring_oddeven(comm, X_shard.T @ (X_shard @ theta - y_shard))) / n_total


# ---------------------------------------------------------------- wrong ones
def ring_send_then_recv(comm, value):
    p, r = comm.world_size, comm.rank
    values = [None] * p
    values[r] = value.copy()
    for step in range(p - 1):
        incoming = np.empty_like(value)
        comm.send(values[(r - step) % p], (r + 1) % p)
        comm.recv(incoming, (r - 1) % p)
        values[(r - step - 1) % p] = incoming
    return values


def ring_one_buffer(comm, value):
    p, r = comm.world_size, comm.rank
    values = [None] * p
    values[r] = value.copy()
    incoming, outgoing = np.empty_like(value), value.copy()
    for step in range(p - 1):
        comm.sendrecv(outgoing, (r + 1) % p, incoming, (r - 1) % p)
        values[(r - step - 1) % p] = incoming  # the same buffer every time
        outgoing = incoming.copy()
    return values


def ring_wrong_order(comm, value):
    p, r = comm.world_size, comm.rank
    values, outgoing = [value.copy()], value.copy()
    for _ in range(p - 1):
        incoming = np.empty_like(value)
        comm.sendrecv(outgoing, (r + 1) % p, incoming, (r - 1) % p)
        values.append(incoming)  # arrival order, not rank order
        outgoing = incoming
    return values


def ring_never_forwards(comm, value):
    p, r = comm.world_size, comm.rank
    values = [None] * p
    values[r] = value.copy()
    for step in range(p - 1):
        incoming = np.empty_like(value)
        comm.sendrecv(value, (r + 1) % p, incoming, (r - 1) % p)  # its own value, every step
        values[(r - step - 1) % p] = incoming
    return values


def ring_stub(comm, value):
    raise NotImplementedError


def gradient_no_division(comm, X_shard, y_shard, theta, n_total):
    return sum(parallel_gd.ring_pass(comm, X_shard.T @ (X_shard @ theta - y_shard)))


def gradient_own_shard(comm, X_shard, y_shard, theta, n_total):
    return X_shard.T @ (X_shard @ theta - y_shard) / n_total


def gradient_mean_of_means(comm, X_shard, y_shard, theta, n_total):
    mean = X_shard.T @ (X_shard @ theta - y_shard) / max(len(X_shard), 1)
    return sum(parallel_gd.ring_pass(comm, mean)) / comm.world_size


def gradient_mean_on_empty_shard(comm, X_shard, y_shard, theta, n_total):
    mean = models.LinearRegression().grad(theta, X_shard, y_shard)  # fails on an empty shard
    return sum(parallel_gd.ring_pass(comm, mean * len(X_shard))) / n_total


def gradient_send_then_recv(comm, X_shard, y_shard, theta, n_total):
    return sum(ring_send_then_recv(comm, X_shard.T @ (X_shard @ theta - y_shard))) / n_total


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("fn", [parallel_gd.ring_pass, ring_oddeven, ring_native])
def test_ring_pass_accepts_right_answers(cluster, fn, capsys):
    assert CP.check_ring_pass(fn, cluster, timeout=TIMEOUT) is True
    assert "✓ check_ring_pass: 5/5 cases" in capsys.readouterr().out


@pytest.mark.parametrize("fn,hint", [
    (ring_send_then_recv, "blocking-send cycle"),
    (ring_one_buffer, "you kept receiving into one buffer"),
    (ring_wrong_order, "at the wrong index"),
    (ring_never_forwards, "each rank sent its own value at every step"),
])
def test_ring_pass_rejects_wrong_answers_with_a_hint(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        CP.check_ring_pass(fn, cluster, timeout=TIMEOUT)


def ring_with(index=lambda r, s, p: (r - s - 1) % p, right=lambda r, p: (r + 1) % p,
              left=lambda r, p: (r - 1) % p, steps=lambda p: p - 1, buffer="fresh",
              forwards="what arrived", keeps="all"):
    """The ring of exercise 1 with knobs for the usual mistakes."""
    def ring(comm, value):
        p, r = comm.world_size, comm.rank
        values = [None] * p
        values[r] = outgoing = value.copy()
        for step in range(steps(p)):
            incoming = {"fresh": lambda: np.empty_like(value),
                        "float64": lambda: np.empty(value.shape),
                        "float32": lambda: np.empty(value.shape, dtype=np.float32),
                        "flat": lambda: np.empty(value.size, dtype=value.dtype),
                        "value": lambda: value}[buffer]()
            if forwards == "the next slot":
                outgoing = values[(r - step + 1) % p]  # not filled yet
            comm.sendrecv(outgoing, right(r, p), incoming, left(r, p))
            values[index(r, step, p)] = incoming
            outgoing = incoming
        if keeps == "received":
            return [v for i, v in enumerate(values) if i != r]
        return values if keeps == "all" or r == 0 else [value]
    return ring


@pytest.mark.parametrize("fn,hint", [
    (ring_with(index=lambda r, s, p: (r + s + 1) % p),
     r"case 2/5 [\s\S]*Hint: rank 0 received every value but entry i holds the value of rank "
     r"\[0, 2, 1\]\[i\]: the index you store an arrival at and the rank it started on go round"),
    (ring_with(right=lambda r, p: (r - 1) % p, left=lambda r, p: (r + 1) % p),
     r"case 2/5 [\s\S]*go round the ring in opposite directions"),
    (ring_with(index=lambda r, s, p: (r - s) % p),
     r"case 1/5 [\s\S]*Hint: rank 0's own entry \(0\) was overwritten and entry 1 was never "
     r"filled"),
    (ring_with(steps=lambda p: p - 2), r"Hint: entry 1 of rank 0's list was never filled \(None\)"
                                       r": your loop ran one step too few"),
    (ring_with(left=lambda r, p: (r + 1) % p),
     r"case 2/5 [\s\S]*CommTimeout: rank \d: sendrecv from rank[\s\S]*Hint: the ranks waited in "
     r"vain for messages to arrive \(rank (\d) for rank (?!\1)\d"),
    (ring_with(buffer="float64"), r"case 3/5 \(world_size=3, value shape \(4,\) int64\)[\s\S]*"
                                  r"Hint: entry 1 is float64, the values are int64: the bytes "
                                  r"arrived, read as another type"),
    (ring_with(buffer="float32"), r"case 1/5 [\s\S]*CommError: [\s\S]*Hint: a message did not fit "
                                  r"its receive buffer: rank 1 sent 24 bytes"),
    (ring_with(buffer="flat"), r"case 4/5 [\s\S]*Hint: entry 1 has shape \(6,\), the values have "
                               r"shape \(2, 3\)"),
    (ring_with(buffer="value"), r"Hint: rank 0 received into value, the caller's array"),
    (ring_with(forwards="the next slot"),
     r"raised on rank\(s\) \[0, 1\].*NoneType[\s\S]*Hint: your function handed comm a None"),
    (ring_with(keeps="received"), r"Hint: rank 0's list has world_size - 1 = 1 entries, the "
                                  r"values it received: its own value is missing"),
    (ring_with(keeps="rank 0"), r"Hint: rank 1 returned 1 of the 2 values: every rank \(not only "
                                r"one\)"),
    (ring_with(steps=lambda p: p), r"case 1/5 [\s\S]*rank 0's list is right, but it sent 2 "
                                   r"messages; a ring pass needs world_size - 1 = 1\nHint: your "
                                   r"last step only passed each value back"),
    (ring_with(steps=lambda p: 2 * p), r"sent 4 messages; [\s\S]*Hint: every value reaches"),
], ids=["index the other way", "ring reversed, index not", "index off by one",
        "one step short", "receives from the rank it sends to", "float64 buffer",
        "float32 buffer",
        "flat buffer", "receives into value", "forwards an unfilled entry",
        "own value left out", "only rank 0 keeps the list", "one step too many",
        "twice around"])
def test_more_ring_pass_mistakes(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        CP.check_ring_pass(fn, cluster, timeout=TIMEOUT)
    assert "(rank - step - 1)" not in str(failed.value)


def test_a_deadlock_fails_within_the_deadline_and_the_cluster_recovers(cluster):
    import time
    start = time.monotonic()
    with pytest.raises(CheckFailed, match=r"(?s)case 1/5 .*CommTimeout: rank \d: send to rank"):
        CP.check_ring_pass(ring_send_then_recv, cluster, timeout=TIMEOUT)
    assert_no_hang(time.monotonic() - start, TIMEOUT, timed_out=True)
    assert CP.check_ring_pass(parallel_gd.ring_pass, cluster, timeout=TIMEOUT)


def test_not_implemented_returns_false(cluster, capsys):
    assert CP.check_ring_pass(ring_stub, cluster) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn", [parallel_gd.global_gradient, gradient_ring])
def test_global_gradient_accepts_right_answers(cluster, fn):
    assert CP.check_global_gradient(fn, cluster, timeout=TIMEOUT) is True


@pytest.mark.parametrize("fn,hint", [
    (gradient_no_division, "not divided by m = n_total"),
    (gradient_own_shard, "own shard only"),
    (gradient_mean_of_means, "mean of the shard means"),
    (gradient_mean_on_empty_shard, r"(?s)raised on rank\(s\) \[2\].*empty"),
    (gradient_send_then_recv, "blocking-send cycle"),
])
def test_global_gradient_rejects_wrong_answers_with_a_hint(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        CP.check_global_gradient(fn, cluster, timeout=TIMEOUT)


def gradient_with(divide="n_total", sign=1, combine="sum", local="sum", transposed=True):
    """The global gradient of exercise 2 with knobs for the usual mistakes."""
    def gradient(comm, X_shard, y_shard, theta, n_total):
        r = X_shard @ theta - y_shard
        g = sign * (X_shard.T @ r if transposed else r)
        if local == "own times world":
            return g * comm.world_size / n_total
        parts = parallel_gd.ring_pass(comm, g)
        if combine == "parts":
            return parts
        if combine == "rank 0" and comm.rank != 0:
            return g / n_total
        return sum(parts) / {"n_total": n_total, "world_size": comm.world_size,
                             "shard": max(len(X_shard), 1), "2 n_total": 2 * n_total,
                             "shard x world_size": max(len(X_shard), 1) * comm.world_size
                             }[divide]
    return gradient


@pytest.mark.parametrize("fn,hint", [
    (gradient_with(divide="world_size"), r"Hint: you divided the sum by world_size = 2, the "
                                         r"number of ranks"),
    (gradient_with(divide="shard"), r"case 1/5 [\s\S]*Hint: your gradient is world_size = 2 "
                                    r"times the right one"),
    (gradient_with(divide="2 n_total"), r"Hint: your gradient is half the right one"),
    (gradient_with(divide="shard x world_size"),
     r"case 2/5 [\s\S]*Hint: you divided by world_size x rank 0's shard size = 42: that is m only "
     r"when the shards have equal sizes; here they have \[14, 13, 13\]"),
    (gradient_with(sign=-1), r"Hint: your gradient has the opposite sign"),
    (gradient_with(combine="parts"), r"rank 0's result: expected shape \(4,\), got shape \(2, 4\)"
                                     r"\nHint: your result holds the 2 ranks' parts"),
    (gradient_with(combine="rank 0"), r"rank 1's result[\s\S]*Hint: that is rank 1's own shard "
                                      r"only"),
    (gradient_with(local="own times world"), r"Hint: that is rank 0's own shard only"),
    (gradient_with(transposed=False), r"Hint: your result has one entry per row of rank 0's "
                                      r"shard \(20\), the gradient one per parameter \(4\)"),
], ids=["divided by world_size", "divided by the shard's size", "divided by 2 m",
        "divided by shard size x world_size", "opposite sign", "parts not added",
        "rank 0 only", "own shard x world_size", "no transpose"])
def test_more_global_gradient_mistakes(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        CP.check_global_gradient(fn, cluster, timeout=TIMEOUT)
    assert "X_shard.T @" not in str(failed.value)


def test_references_agree_with_the_native_allreduce_and_one_process(cluster):
    via_comm = cluster.run(parallel_gd.comm_shard_gradient, 1000, 5, 0)
    native = cluster.run(parallel_gd.shard_gradient, 1000, 5, 0)
    expected = parallel_gd.full_gradient(1000, 5, 0)
    assert [r["n_local"] for r in via_comm] == [334, 333, 333]
    for mine, theirs in zip(via_comm, native, strict=True):
        np.testing.assert_allclose(mine["full"], theirs["full"], rtol=1e-12)
        np.testing.assert_allclose(mine["full"], expected, rtol=1e-12)
    assert all(np.array_equal(r["full"], via_comm[0]["full"]) for r in via_comm)  # bitwise


def test_train_on_cluster_follows_single_process_batch_gd(cluster):
    thetas, spread = CP.train_on_cluster(gradient_ring, cluster, n_samples=50, num_epochs=10)
    X, y, _ = make_linear(50, 3, noise=0.5, seed=0)
    hist = gd.batch_gd(models.LinearRegression(), X, y, np.zeros(4), 0.1, 10)
    assert spread == 0.0 and thetas.shape == (11, 4)
    np.testing.assert_allclose(thetas, np.array(hist.thetas), rtol=1e-10, atol=1e-12)


def test_needs_two_engines():
    class One:
        n = 1
    with pytest.raises(ValueError, match="at least 2 engines"):
        CP.check_ring_pass(parallel_gd.ring_pass, One())
