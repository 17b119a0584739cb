"""Lab 15's checks: right answers pass; each usual mistake gets the hint that names it; a
deadlocking all-to-all ends within its deadline and the cluster works afterwards.

The all-to-all answers below run on a real 3-engine cluster (Gloo), sent by value as from a
notebook; the dispatch answers run in this process against ``moe.route``."""

import math
import sys
import time

import cloudpickle
import pytest
import torch

from course_lib import collectives, moe
from course_lib.checks import CheckFailed
from course_lib.checks import lab15_mixture_of_experts as checks
from course_lib.testing.timing import assert_no_hang

# the engines cannot import this test module: send its functions by value, as in a notebook
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CLUSTER_SIZE = 3  # the shared cluster of tests/conftest.py
TIMEOUT = 2.0     # seconds a deadlocked answer waits before its CommTimeout


# ---------------------------------------------------------------- all-to-all answers
def offsets(counts):
    return [sum(counts[:q]) for q in range(len(counts) + 1)]


def pairwise(send, recv, comm, send_counts, recv_counts, steps=None, own=True, frm_of=None,
             send_block=None, recv_at=None, recv_rows=None):
    """The pairwise exchange, with knobs that turn it into the usual mistakes."""
    n, r = comm.world_size, comm.rank
    sa, ra = offsets(send_counts), offsets(recv_counts)
    place = recv_at or (lambda q: ra[q])
    rows = recv_rows or (lambda q: recv_counts[q])
    if own:
        recv[place(r):place(r) + rows(r)] = send[sa[r]:sa[r + 1]]
    for s in range(1, n) if steps is None else steps(n):
        to = (r + s) % n
        frm = (r - s) % n if frm_of is None else frm_of(r, s, n)
        block = to if send_block is None else send_block(to, frm)
        comm.sendrecv(send[sa[block]:sa[block + 1]], to, recv[place(frm):place(frm) + rows(frm)],
                      frm)
    return recv


def good(send, recv, comm, send_counts, recv_counts):
    return pairwise(send, recv, comm, send_counts, recv_counts)


def good_nonblocking(send, recv, comm, send_counts, recv_counts):
    """Each step with irecv / isend, a temporary receive buffer copied into place."""
    n, r = comm.world_size, comm.rank
    sa, ra = offsets(send_counts), offsets(recv_counts)
    recv[ra[r]:ra[r + 1]] = send[sa[r]:sa[r + 1]]
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        tmp = torch.empty_like(recv[ra[frm]:ra[frm + 1]])
        works = [comm.irecv(tmp, frm), comm.isend(send[sa[to]:sa[to + 1]], to)]
        for w in works:
            w.wait()
        recv[ra[frm]:ra[frm + 1]] = tmp
    return recv


def library(send, recv, comm, send_counts, recv_counts):
    return collectives.all_to_all(send, recv, comm, send_counts, recv_counts, check=False)


def blocking_step_order(send, recv, comm, send_counts, recv_counts):
    n, r = comm.world_size, comm.rank
    sa, ra = offsets(send_counts), offsets(recv_counts)
    recv[ra[r]:ra[r + 1]] = send[sa[r]:sa[r + 1]]
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        comm.send(send[sa[to]:sa[to + 1]], to)      # every rank sends first: nobody receives
        comm.recv(recv[ra[frm]:ra[frm + 1]], frm)
    return recv


def blocking_same_order(send, recv, comm, send_counts, recv_counts):
    n, r = comm.world_size, comm.rank
    sa, ra = offsets(send_counts), offsets(recv_counts)
    recv[ra[r]:ra[r + 1]] = send[sa[r]:sa[r + 1]]
    for q in range(n):                              # peers 0, 1, 2 ... on every rank
        if q != r:
            comm.send(send[sa[q]:sa[q + 1]], q)
    for q in range(n):
        if q != r:
            comm.recv(recv[ra[q]:ra[q + 1]], q)
    return recv


def sendrecv_same_order(send, recv, comm, send_counts, recv_counts):
    """Right rows, no deadlock, but every rank starts with rank 0 (or 1): one at a time."""
    n, r = comm.world_size, comm.rank
    sa, ra = offsets(send_counts), offsets(recv_counts)
    recv[ra[r]:ra[r + 1]] = send[sa[r]:sa[r + 1]]
    for q in range(n):
        if q != r:
            comm.sendrecv(send[sa[q]:sa[q + 1]], q, recv[ra[q]:ra[q + 1]], q)
    return recv


def receives_from_where_it_sends(send, recv, comm, send_counts, recv_counts):
    return pairwise(send, recv, comm, send_counts, recv_counts,
                    frm_of=lambda r, s, n: (r + s) % n)


def forgets_its_own_block(send, recv, comm, send_counts, recv_counts):
    return pairwise(send, recv, comm, send_counts, recv_counts, own=False)


def one_step_short(send, recv, comm, send_counts, recv_counts):
    return pairwise(send, recv, comm, send_counts, recv_counts, steps=lambda n: range(1, n - 1))


def starts_at_step_zero(send, recv, comm, send_counts, recv_counts):
    return pairwise(send, recv, comm, send_counts, recv_counts, steps=range)


def sends_the_block_of_the_sender(send, recv, comm, send_counts, recv_counts):
    return pairwise(send, recv, comm, send_counts, recv_counts,
                    send_block=lambda to, frm: frm)


def receive_sized_by_send_counts(send, recv, comm, send_counts, recv_counts):
    return pairwise(send, recv, comm, send_counts, recv_counts,
                    recv_rows=lambda q: send_counts[q])


def receive_placed_by_send_counts(send, recv, comm, send_counts, recv_counts):
    sa = offsets(send_counts)
    return pairwise(send, recv, comm, send_counts, recv_counts, recv_at=lambda q: sa[q])


def equal_blocks(send, recv, comm, send_counts, recv_counts):
    n = comm.world_size
    return pairwise(send, recv, comm, [len(send) // n] * n, [len(recv) // n] * n)


def returns_a_new_tensor(send, recv, comm, send_counts, recv_counts):
    return pairwise(send, recv.clone(), comm, send_counts, recv_counts)


def native_collective(send, recv, comm, send_counts, recv_counts):
    import torch.distributed as dist
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=comm.group)
    return recv


def not_written(send, recv, comm, send_counts, recv_counts):
    raise NotImplementedError("exercise 1: fill in my_all_to_all")


def sends_everything(send, recv, comm, send_counts, recv_counts):
    """The whole send buffer to every peer, not its block."""
    n, r = comm.world_size, comm.rank
    ra, sa = offsets(recv_counts), offsets(send_counts)
    recv[ra[r]:ra[r + 1]] = send[sa[r]:sa[r + 1]]
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        comm.sendrecv(send, to, recv[ra[frm]:ra[frm + 1]], frm)
    return recv


def inclusive_offsets(send, recv, comm, send_counts, recv_counts):
    """Offsets from the running sums including each block itself: one block late."""
    n, r = comm.world_size, comm.rank
    sa = [sum(send_counts[:q + 1]) for q in range(n)]
    ra = [sum(recv_counts[:q + 1]) for q in range(n)]
    recv[ra[r]:ra[r] + recv_counts[r]] = send[sa[r]:sa[r] + send_counts[r]]
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        comm.sendrecv(send[sa[to]:sa[to] + send_counts[to]], to,
                      recv[ra[frm]:ra[frm] + recv_counts[frm]], frm)
    return recv


def receives_into_a_copy(send, recv, comm, send_counts, recv_counts):
    """Receives into a new tensor and never copies it into recv."""
    n, r = comm.world_size, comm.rank
    sa, ra = offsets(send_counts), offsets(recv_counts)
    recv[ra[r]:ra[r + 1]] = send[sa[r]:sa[r + 1]]
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        block = recv[ra[frm]:ra[frm + 1]].clone()
        comm.sendrecv(send[sa[to]:sa[to + 1]], to, block, frm)
    return recv


def skips_empty_sends(send, recv, comm, send_counts, recv_counts):
    """Skips the whole step when its own block for the peer is empty."""
    n, r = comm.world_size, comm.rank
    sa, ra = offsets(send_counts), offsets(recv_counts)
    recv[ra[r]:ra[r + 1]] = send[sa[r]:sa[r + 1]]
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        if send_counts[to] == 0:
            continue
        comm.sendrecv(send[sa[to]:sa[to + 1]], to, recv[ra[frm]:ra[frm + 1]], frm)
    return recv


def own_block_by_recv_offsets(send, recv, comm, send_counts, recv_counts):
    """The own block cut out of send at recv's offsets."""
    r, ra = comm.rank, offsets(recv_counts)
    recv[ra[r]:ra[r + 1]] = send[ra[r]:ra[r + 1]]
    return pairwise(send, recv, comm, send_counts, recv_counts, own=False)


def own_block_first(send, recv, comm, send_counts, recv_counts):
    """The own block copied to the start of recv, not to its place among the senders."""
    sa = offsets(send_counts)
    r = comm.rank
    pairwise(send, recv, comm, send_counts, recv_counts, own=False)
    recv[:send_counts[r]] = send[sa[r]:sa[r + 1]]
    return recv


@pytest.mark.parametrize("fn", [good, good_nonblocking, library])
def test_right_all_to_alls_pass(cluster, fn, capsys):
    assert checks.check_all_to_all(fn, cluster, timeout=TIMEOUT) is True
    assert "✓ check_all_to_all: 5/5 cases match dist.all_to_all_single" in \
        capsys.readouterr().out


def test_not_implemented_is_reported_not_raised(cluster, capsys):
    assert checks.check_all_to_all(not_written, cluster, timeout=TIMEOUT) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn, hint", [
    (blocking_step_order, r"(?s)CommTimeout.*At the deadline: rank 0 in send to rank 1.*"
                          r"Blocking sends in a cycle"),
    (blocking_same_order, r"(?s)CommTimeout.*Every rank goes through its peers in the same "
                          r"order.*all send to rank 0 first"),
    (receives_from_where_it_sends, r"(?s)CommTimeout.*received from the rank it sent to, "
                                   r"\(r \+ s\) mod N"),
])
def test_a_deadlock_ends_within_the_deadline_with_its_cause(cluster, fn, hint):
    start = time.monotonic()
    with pytest.raises(CheckFailed, match=hint):
        checks.check_all_to_all(fn, cluster, timeout=TIMEOUT)
    assert_no_hang(time.monotonic() - start, TIMEOUT, timed_out=True)
    assert checks.check_all_to_all(good, cluster, timeout=TIMEOUT)  # the cluster recovered


@pytest.mark.parametrize("fn, hint", [
    (sendrecv_same_order, r"(?s)not the pairwise exchange: at step 1 ranks \[1, 2\] all send to "
                          r"rank 0.*same peer first"),
    (forgets_its_own_block, r"recv\[0:2\] must hold rank 0's block .* 2 row\(s\) never "
                            r"written.*the own block is not there"),
    (one_step_short, r"rank 1's block never arrived.*N - 1 = 2 steps"),
    (starts_at_step_zero, r"(?s)sendrecv to itself.*own block is a copy.*s = 1 \.\. N-1"),
    (sends_the_block_of_the_sender, r"rank 0 sent send\[4:6\] to rank 1; its block for rank 1 "
                                    r"is send\[2:4\]"),
    (receive_sized_by_send_counts, r"(?s)CommError.*rank 1 received rank 0's block into "
                                   r"recv\[0:0\]; it is recv\[0:3\].*Its size is "
                                   r"send_counts\[0\] = 0"),
    (receive_placed_by_send_counts, r"recv_at\[r \+ 1\]\] = send\[send_at\[r\]:send_at\[r \+ 1\]"
                                    r"\], both offsets from their own counts"),
    (equal_blocks, r"(?s)RuntimeError.*Hint: a slice of recv and a slice of send differ in "
                   r"rows. The blocks are uneven"),
    (returns_a_new_tensor, r"recv was never written .* returned another tensor"),
    (native_collective, r"no rank sent a message over comm"),
    (sends_everything, r"rank 0 sent send\[0:6\] to rank 1; its block for rank 1 is send\[2:4\]"),
    (inclusive_offsets, r"rank 0 sent send\[4:6\] to rank 1; its block for rank 1 is "
                        r"send\[2:4\]"),
    (receives_into_a_copy, r"rank 0 did receive rank 1's block, but into a buffer that is not "
                           r"part of recv"),
    (skips_empty_sends, r"(?s)case 2/5 .*CommTimeout.*Hint: rank 1 never called a receive from "
                        r"rank 0, whose block for it has 3 row\(s\)\. At that step rank 1's own "
                        r"block for rank 0 is empty"),
    (own_block_by_recv_offsets, r"(?s)case 2/5 .*RuntimeError.*Hint: a slice of recv and a slice "
                                r"of send differ in rows"),
    (own_block_first, r"on rank 1, recv\[0:2\] must hold rank 0's block for it \(2 rows\); it "
                      r"holds rank 1's rows 0-1 for rank 1: the block from rank 1 landed where"),
])
def test_usual_mistakes_get_their_hint(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint) as info:
        checks.check_all_to_all(fn, cluster, timeout=TIMEOUT)
    assert "Hint:" in str(info.value)


def test_the_marks_name_every_row():
    counts = [[1, 0, 3], [2, 2, 0], [0, 4, 1]]
    got = checks.case_recv(counts, 0)
    assert checks.row_labels(got) == [(0, 0, 0), (1, 0, 0), (1, 0, 1)]
    assert checks.describe_rows(checks.row_labels(got)) == \
        "rank 0's row 0 for rank 0, rank 1's rows 0-1 for rank 0"
    got[1:] = checks.FILL
    assert checks.describe_rows(checks.row_labels(got)) == \
        "rank 0's row 0 for rank 0, 2 row(s) never written (still -1)"


def test_needs_two_engines():
    class One:
        n = 1
    with pytest.raises(ValueError, match="at least 2 engines"):
        checks.check_all_to_all(good, One())


# ---------------------------------------------------------------- dispatch answers
def dispatch(logits, top_k, capacity_factor, softmax=True, renormalise=True, rounding=math.ceil,
             order="choices first", count="choices", top1_renormalised=False, with_k=True):
    """A from-scratch dispatch with knobs that turn it into the usual mistakes."""
    T, E = logits.shape
    probs = torch.softmax(logits, dim=-1) if softmax else logits
    top, expert = probs.topk(top_k, dim=-1)
    gate = top / top.sum(-1, keepdim=True) if (renormalise and top_k > 1) or \
        top1_renormalised else top
    if capacity_factor is None:
        limit = T * top_k
    else:
        limit = rounding(capacity_factor * (top_k if with_k else 1) * T / E)
    kept = checks.keep_in_order(expert, E, limit, order, gate)
    dropped = {"choices": (~kept).sum(), "tokens": (~kept).any(1).sum(),
               "estimate": max(T * top_k - E * limit, 0)}[count]
    return expert, gate, kept, int(dropped)


def routed(logits, top_k, capacity_factor):
    r = moe.route(logits, top_k, capacity_factor)
    return r.expert, r.gate, r.kept, r.dropped


def vectorised(logits, top_k, capacity_factor):
    """Another right answer: the queue positions by cumsum, as GShard computes them."""
    T, E = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top, expert = probs.topk(top_k, dim=-1)
    gate = top if top_k == 1 else top / top.sum(-1, keepdim=True)
    limit = T * top_k if capacity_factor is None else \
        math.ceil(capacity_factor * top_k * T / E)
    onehot = torch.nn.functional.one_hot(expert.T.reshape(-1), E)
    place = (onehot.cumsum(0) * onehot).sum(1)
    kept = (place <= limit).reshape(top_k, T).T
    return expert, gate, kept, int((~kept).sum())


def softmax_of_the_top(logits, top_k, capacity_factor):
    """Right too: top-2 gates as a softmax over the chosen logits; the capacity in integers."""
    from fractions import Fraction
    T, E = logits.shape
    top, expert = logits.topk(top_k, dim=-1)
    gate = torch.softmax(logits, dim=-1).gather(1, expert) if top_k == 1 else \
        torch.softmax(top, dim=-1)
    limit = T * top_k if capacity_factor is None else \
        math.ceil(Fraction(str(capacity_factor)) * top_k * T / E)
    kept = checks.keep_in_order(expert, E, limit, "choices first")
    return expert, gate, kept, (~kept).sum()


@pytest.mark.parametrize("fn", [routed, vectorised, dispatch, softmax_of_the_top])
def test_right_dispatches_pass(fn, capsys):
    assert checks.check_dispatch(fn) is True
    assert "✓ check_dispatch: 8/8 cases" in capsys.readouterr().out


def test_the_loops_agree_with_the_library():
    for _, T, E, k, f, seed in checks.DISPATCH_CASES:
        logits = checks.dispatch_logits(T, E, seed)
        r = moe.route(logits, k, f)
        limit = moe.capacity(T, E, k, f)
        assert torch.equal(checks.keep_in_order(r.expert, E, limit, "choices first"), r.kept)


def test_every_case_that_can_drop_drops():
    for _, T, E, k, f, seed in checks.DISPATCH_CASES:
        assert (moe.route(checks.dispatch_logits(T, E, seed), k, f).dropped > 0) == \
            (f is not None)


@pytest.mark.parametrize("knobs, hint", [
    (dict(softmax=False), r"the gates are the raw logits: take the softmax"),
    (dict(renormalise=False), r"(?s)case 2/8 .*renormalised to add up to 1"),
    (dict(top1_renormalised=True), r"(?s)case 1/8 .*every gate is 1: with top-1 the gate is the "
                                   r"expert's probability"),
    (dict(rounding=math.floor), r"(?s)case 3/8 .*your experts took at most 3 choices: 3\.75 "
                                r"rounded down"),
    (dict(with_k=False), r"(?s)case 4/8 .*your capacity is 3, which leaves out top_k"),
    (dict(order="tokens first"), r"second choices took slots before first choices"),
    (dict(order="later choices first"), r"second choices were served before first choices"),
    (dict(order="tokens reversed"), r"(?s)case 3/8 .*token order was not respected"),
    (dict(order="by gate"), r"most confident choices first"),
    (dict(count="tokens"), r"you counted the tokens that lost a choice"),
    (dict(count="estimate"), r"max\(T \* k - E \* capacity, 0\) = 0 assumes every slot is used"),
])
def test_usual_dispatch_mistakes_get_their_hint(knobs, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_dispatch(lambda logits, k, f: dispatch(logits, k, f, **knobs))


def test_other_dispatch_mistakes_are_described():
    def softmax_over_tokens(logits, k, f):
        return dispatch(torch.softmax(logits, dim=0), k, f, softmax=False)

    def sorted_by_index(logits, k, f):
        expert, gate, kept, dropped = dispatch(logits, k, f)
        order = expert.argsort(1)
        return expert.gather(1, order), gate.gather(1, order), kept.gather(1, order), dropped

    def squeezed(logits, k, f):
        expert, gate, kept, dropped = dispatch(logits, k, f)
        return expert.squeeze(1), gate.squeeze(1), kept.squeeze(1), dropped

    def no_limit_ignored(logits, k, f):
        return dispatch(logits, k, 1.0 if f is None else f)

    for fn, hint in [(softmax_over_tokens, r"softmax went over the tokens \(dim=0\)"),
                     (sorted_by_index, r"(?s)case 2/8 .*the right experts, in the wrong order"),
                     (squeezed, r"\(12, 1\) here: one row per token"),
                     (no_limit_ignored, r"capacity_factor None means no capacity")]:
        with pytest.raises(CheckFailed, match=hint):
            checks.check_dispatch(fn)


def capacity_dispatch(capacity):
    """The right dispatch with another capacity: ``capacity(f, k, T, E)``."""
    def fn(logits, top_k, capacity_factor):
        T, E = logits.shape
        expert, gate, _, _ = dispatch(logits, top_k, None)
        limit = T * top_k if capacity_factor is None else capacity(capacity_factor, top_k, T, E)
        kept = checks.keep_in_order(expert, E, limit, "choices first")
        return expert, gate, kept, int((~kept).sum())
    return fn


def first_choices_only(logits, top_k, capacity_factor):
    expert, gate, kept, _ = dispatch(logits, top_k, capacity_factor)
    if capacity_factor is not None:
        kept[:, 1:] = False
    return expert, gate, kept, int((~kept).sum())


def pooled_slots(logits, top_k, capacity_factor):
    """One pool of E x capacity slots for all experts, in the right order."""
    T, E = logits.shape
    expert, gate, _, _ = dispatch(logits, top_k, None)
    limit = T * top_k if capacity_factor is None else \
        math.ceil(capacity_factor * top_k * T / E)
    kept = checks.keep_in_order(expert, E, E * limit, "choices first")
    order = [(t, j) for j in range(top_k) for t in range(T)]
    for t, j in order[E * limit:]:
        kept[t, j] = False
    return expert, gate, kept, int((~kept).sum())


@pytest.mark.parametrize("fn, hint", [
    (capacity_dispatch(lambda f, k, T, E: math.ceil(f * T / E) * k),
     r"(?s)case 4/8 \(top-2, capacity factor 1\.0: 4\.5 slots\).*Hint: your capacity is 6 = "
     r"ceil\(2\.25\) x 2: rounded before it was multiplied by top_k"),
    (capacity_dispatch(lambda f, k, T, E: int(f * k * T / E) + 1),
     r"(?s)case 5/8 \(top-2, capacity factor 1\.0: exactly 5 slots\).*Hint: your experts took "
     r"up to 6 choices, one more than 5 slots: int\(x\) \+ 1"),
    (capacity_dispatch(lambda f, k, T, E: round(f * k * T / E)),
     r"(?s)case 4/8 .*Hint: your experts took at most 4 choices: 4\.5 rounded down"),
    (capacity_dispatch(lambda f, k, T, E: int(f * k * T // E)),
     r"(?s)case 3/8 .*Hint: your experts took at most 3 choices: 3\.75 rounded down"),
    (capacity_dispatch(lambda f, k, T, E: math.ceil(f * k * E / T)),
     r"(?s)case 3/8 .*Hint: your capacity is 1: E / T upside down"),
    (first_choices_only, r"(?s)case 4/8 .*Hint: no second choice was ever kept"),
    (pooled_slots, r"(?s)case 3/8 .*Hint: expert 0 kept \d+ choices, over its capacity of 4 "
                   r"\(each expert has its own capacity"),
], ids=["k after the ceiling", "int + 1", "round", "floor division", "E / T",
        "first choices only", "pooled slots"])
def test_capacity_mistakes_get_their_hint(fn, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_dispatch(fn)
    assert "ceil(capacity_factor * top_k * T / E)" not in str(failed.value)  # not the answer


def test_dispatch_not_implemented_is_reported_not_raised(capsys):
    def todo(logits, k, f):
        raise NotImplementedError("exercise 2: fill in my_dispatch")
    assert checks.check_dispatch(todo) is False
    assert "not implemented yet" in capsys.readouterr().out
