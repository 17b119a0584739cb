"""Tests for course_lib.checks_allreduce: on a real 3-rank cluster, the lab 05 checks pass correct
ring reduce-scatter / all-gather / allreduce functions written independently of
course_lib.collectives, and fail realistic wrong ones with a CheckFailed carrying a targeted hint;
an unimplemented function makes them return False without raising."""

import sys

import cloudpickle
import numpy as np
import pytest
import torch

from course_lib.checks import CheckFailed
from course_lib.checks import lab05_allreduce as CA
from course_lib.runtime import cluster as C
from course_lib.sharding import shard_bounds

# the engines cannot import this test module: send its functions by value, as in a notebook
cloudpickle.register_pickle_by_value(sys.modules[__name__])


CLUSTER_SIZE = 3  # the shared cluster of tests/conftest.py


def _ring(comm):
    return comm.rank, comm.world_size, (comm.rank + 1) % comm.world_size, \
        (comm.rank - 1) % comm.world_size


# ---------------------------------------------------------------- reduce-scatter variants
def reduce_scatter(buf, comm, send_shift=1, steps=None, combine="add", owner_shift=0):
    """The ring reduce-scatter, with knobs that turn it into the usual mistakes."""
    rank, N, right, left = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    for s in range(N - 1 if steps is None else steps(N)):
        s0, s1 = bounds[(rank - s - send_shift) % N]
        r0, r1 = bounds[(rank - s - send_shift - 1) % N]
        tmp = torch.empty_like(buf[r0:r1])
        comm.sendrecv(buf[s0:s1], right, tmp, left)
        if combine == "add":
            buf[r0:r1] += tmp
        elif combine == "copy":
            buf[r0:r1] = tmp
    return bounds[(rank + owner_shift) % N]


def good_reduce_scatter(buf, comm):
    return reduce_scatter(buf, comm)


def good_reduce_scatter_nonblocking(buf, comm):
    """Same schedule with isend / irecv and a preallocated receive buffer."""
    rank, N, right, left = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    tmp = torch.empty(bounds[0][1] - bounds[0][0], dtype=buf.dtype)
    for s in range(N - 1):
        s0, s1 = bounds[(rank - s - 1) % N]
        r0, r1 = bounds[(rank - s - 2) % N]
        recv = comm.irecv(tmp[:r1 - r0], left)
        send = comm.isend(buf[s0:s1], right)
        recv.wait()
        send.wait()
        buf[r0:r1] += tmp[:r1 - r0]
    return bounds[rank]


def shifted_schedule(buf, comm):
    return reduce_scatter(buf, comm, send_shift=0)


def one_step_short(buf, comm):
    return reduce_scatter(buf, comm, steps=lambda N: N - 2)


def one_step_too_many(buf, comm):
    return reduce_scatter(buf, comm, steps=lambda N: N)


def copies_instead_of_adding(buf, comm):
    return reduce_scatter(buf, comm, combine="copy")


def drops_what_it_receives(buf, comm):
    return reduce_scatter(buf, comm, combine="drop")


def returns_next_chunk(buf, comm):
    return reduce_scatter(buf, comm, owner_shift=1)


def returns_nothing(buf, comm):
    reduce_scatter(buf, comm)


def blocking_send_cycle(buf, comm):
    rank, N, right, left = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    for s in range(N - 1):
        s0, s1 = bounds[(rank - s - 1) % N]
        r0, r1 = bounds[(rank - s - 2) % N]
        tmp = torch.empty_like(buf[r0:r1])
        comm.send(buf[s0:s1], right)   # every rank sends first: nobody receives
        comm.recv(tmp, left)
        buf[r0:r1] += tmp
    return bounds[rank]


def one_size_receive_buffer(buf, comm):
    """Receives every chunk into a buffer as long as chunk 0: an empty chunk never arrives."""
    rank, N, right, left = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    tmp = torch.empty(bounds[0][1] - bounds[0][0], dtype=buf.dtype)
    for s in range(N - 1):
        s0, s1 = bounds[(rank - s - 1) % N]
        r0, r1 = bounds[(rank - s - 2) % N]
        comm.sendrecv(buf[s0:s1], right, tmp, left)
        buf[r0:r1] += tmp[:r1 - r0]
    return bounds[rank]


def reversed_reduce_scatter(buf, comm):
    """Sends to the left and receives from the right."""
    rank, N, right, left = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    for s in range(N - 1):
        s0, s1 = bounds[(rank - s - 1) % N]
        r0, r1 = bounds[(rank - s - 2) % N]
        tmp = torch.empty_like(buf[r0:r1])
        comm.sendrecv(buf[s0:s1], left, tmp, right)
        buf[r0:r1] += tmp
    return bounds[rank]


def uses_an_undefined_helper(buf, comm):
    return helper_defined_nowhere(buf)  # noqa: F821


def direct_to_owners(buf, comm):
    """Right values, but each chunk goes straight to its owner: not the ring."""
    rank, N, _, _ = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    a, b = bounds[rank]
    for p in range(N):
        if p != rank:
            tmp = torch.empty_like(buf[a:b])
            comm.sendrecv(buf[slice(*bounds[p])], p, tmp, p)
            buf[a:b] += tmp
    return a, b


def not_implemented(buf, comm):
    raise NotImplementedError


def test_reduce_scatter_passes_correct_solutions(cluster, capsys):
    assert CA.check_ring_reduce_scatter(good_reduce_scatter, cluster) is True
    assert CA.check_ring_reduce_scatter(good_reduce_scatter_nonblocking, cluster, seed=1)
    assert "✓ check_ring_reduce_scatter: 6/6 cases" in capsys.readouterr().out


def test_not_implemented_returns_false(cluster, capsys):
    assert CA.check_ring_reduce_scatter(not_implemented, cluster) is False
    assert CA.check_ring_allgather(not_implemented, cluster) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn, hint", [
    (shifted_schedule, r"holds the full sum in chunk 1, not in chunk 0: the schedule is shifted"),
    (one_step_short, r"holds the data of 1 of 3 ranks \[0\]: an off-by-one"),
    (one_step_too_many, r"not the ring: rank 0 sent 3 message.*N-1 = 2 per phase"),
    (copies_instead_of_adding, r"the reduction is missing"),
    (drops_what_it_receives, r"buffer did not change: nothing received was added"),
    (returns_next_chunk, r"rank 0 returned \(5, 10\); it owns chunk 0 .* = \(0, 5\)"),
    (returns_nothing, r"rank 0 returned None"),
    (direct_to_owners, r"not the ring: rank 0 sent to rank\(s\) \[2\]"),
])
def test_reduce_scatter_mistakes_get_targeted_hints(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint) as info:
        CA.check_ring_reduce_scatter(fn, cluster)
    assert "case 1/6" in str(info.value) and "Hint:" in str(info.value)


def test_blocking_send_cycle_becomes_a_hint_and_the_cluster_recovers(cluster):
    with pytest.raises(CheckFailed, match=r"(?s)CommTimeout.*blocking send cycle.*sendrecv"):
        CA.check_ring_reduce_scatter(blocking_send_cycle, cluster, timeout=1.0)
    assert CA.check_ring_reduce_scatter(good_reduce_scatter, cluster)


def test_wrong_receive_length_and_missing_names_get_hints(cluster):
    with pytest.raises(CheckFailed, match=r"(?s)case 1/6 .*CommError.*received 16 bytes from "
                       r"rank \d into a buffer of 20 bytes.*exactly the length"):
        CA.check_ring_reduce_scatter(one_size_receive_buffer, cluster, timeout=1.0)
    with pytest.raises(CheckFailed, match=r"(?s)NameError.*define or import everything"):
        CA.check_ring_reduce_scatter(uses_an_undefined_helper, cluster)


def reduce_scatter_with(cut="shard_bounds", add_into="arrived", sends="partial sums",
                        tmp_dtype=None, receives_from="left", messages="chunks",
                        returns="bounds"):
    """The ring reduce-scatter with knobs for more of the usual mistakes."""
    def ring(buf, comm):
        rank, N, right, left = _ring(comm)
        n = len(buf)
        bounds = ([shard_bounds(n, c, N) for c in range(N)] if cut == "shard_bounds" else
                  [(c * (n // N), n if c == N - 1 else (c + 1) * (n // N)) for c in range(N)])
        start = buf.clone()
        src = left if receives_from == "left" else right
        for s in range(N - 1):
            s0, s1 = bounds[(rank - s - 1) % N]
            r0, r1 = bounds[(rank - s - 2) % N]
            if messages == "whole buffer":
                tmp = torch.empty_like(buf)
                comm.sendrecv(buf.clone(), right, tmp, src)
                buf[r0:r1] += tmp[r0:r1]
                continue
            tmp = (torch.empty(r1 - r0, dtype=tmp_dtype) if tmp_dtype is not None
                   else torch.empty_like(buf[r0:r1]))
            comm.sendrecv((start if sends == "starting values" else buf)[s0:s1], right, tmp, src)
            if add_into == "arrived":
                buf[r0:r1] += tmp
            else:
                buf[s0:s1] += tmp  # into the chunk it sent
        return buf if returns == "buf" else bounds[rank]
    return ring


@pytest.mark.parametrize("fn, hint", [
    (reduce_scatter_with(cut="n // N"), r"case 1/6 [\s\S]*rank 0 returned \(0, 4\)[\s\S]*Hint: "
                                        r"your chunks are cut len\(buf\) // N = 4 long"),
    (reduce_scatter_with(add_into="sent"), r"RuntimeError: The size of tensor[\s\S]*Hint: rank 0 "
                                           r"added a chunk of 5 elements into a chunk of 4 \(the "
                                           r"other ranks then waited for it in vain\)"),
    (reduce_scatter_with(sends="starting values"), r"Hint: chunk 0 of rank 0 holds its own data "
                                                   r"and its left neighbour's only"),
    (reduce_scatter_with(tmp_dtype=torch.float32), r"case 2/6 \(n=12, float64[\s\S]*Hint: rank 0 "
                                                   r"received 32 bytes[\s\S]*Rank 0's receive "
                                                   r"buffer is float32, the buffer being reduced "
                                                   r"float64"),
    (reduce_scatter_with(receives_from="right"), r"CommTimeout[\s\S]*Hint: rank\(s\) \[.*\] "
                                                 r"waited for a message from their RIGHT "
                                                 r"neighbour"),
    (reduce_scatter_with(messages="whole buffer"), r"not the ring: rank 0 sent 2 message\(s\) of "
                                                   r"\[56, 56\] bytes, each the whole buffer"),
    (reduce_scatter_with(returns="buf"), r"rank 0 returned a Tensor[\s\S]*Hint: your function "
                                         r"returned a Tensor: return the pair \(start, stop\)"),
], ids=["chunks of n // N", "adds into the chunk it sent", "passes on its starting values",
        "float32 receive buffer", "receives from the right", "whole buffers", "returns buf"])
def test_more_reduce_scatter_mistakes(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint) as info:
        CA.check_ring_reduce_scatter(fn, cluster, timeout=1.0)
    assert "(r - s - 1) mod N" not in str(info.value)


# ---------------------------------------------------------------- all-gather variants
def allgather(buf, comm, shift=0, steps=None):
    rank, N, right, left = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    for s in range(N - 1 if steps is None else steps(N)):
        s0, s1 = bounds[(rank - s - shift) % N]
        r0, r1 = bounds[(rank - s - shift - 1) % N]
        comm.sendrecv(buf[s0:s1], right, buf[r0:r1], left)
    return buf


def good_allgather(buf, comm):
    return allgather(buf, comm)


def allgather_reduce_scatter_indices(buf, comm):
    return allgather(buf, comm, shift=1)


def allgather_one_step_short(buf, comm):
    return allgather(buf, comm, steps=lambda N: N - 2)


def reversed_allgather(buf, comm):
    rank, N, right, left = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    for s in range(N - 1):
        s0, s1 = bounds[(rank - s) % N]
        r0, r1 = bounds[(rank - s - 1) % N]
        comm.sendrecv(buf[s0:s1], left, buf[r0:r1], right)
    return buf


def allgather_sends_its_own_chunk(buf, comm):
    rank, N, right, left = _ring(comm)
    bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
    for s in range(N - 1):
        r0, r1 = bounds[(rank - s - 1) % N]
        comm.sendrecv(buf[slice(*bounds[rank])], right, buf[r0:r1], left)
    return buf


@pytest.mark.parametrize("check, fn, hint", [
    ("check_ring_reduce_scatter", reversed_reduce_scatter, "RIGHT neighbour: the ring is reversed"),
    ("check_ring_allgather", reversed_allgather, "RIGHT neighbour: the ring is reversed"),
    ("check_ring_allgather", allgather_sends_its_own_chunk, "same chunk at every step"),
])
def test_messages_that_do_not_fit_get_a_hint_and_no_engine_dies(cluster, check, fn, hint):
    pids = [p["pid"] for p in cluster.run(C.engine_info)]
    with pytest.raises(CheckFailed, match=rf"(?s)case 1/6 .*CommError.*Hint: .*{hint}"):
        getattr(CA, check)(fn, cluster, timeout=1.0)
    assert [p["pid"] for p in cluster.run(C.engine_info)] == pids  # the same engines, alive


def test_allgather(cluster, capsys):
    assert CA.check_ring_allgather(good_allgather, cluster) is True
    assert "✓ check_ring_allgather: 6/6" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"another rank's placeholder values"):
        CA.check_ring_allgather(allgather_reduce_scatter_indices, cluster)
    with pytest.raises(CheckFailed, match=r"never received chunk\(s\) \[1\]: one step short"):
        CA.check_ring_allgather(allgather_one_step_short, cluster)


def allgather_with(combine="copy", into="buf", receives="(r - s - 1)", on="buf", steps=None,
                   receives_from="left"):
    """The ring all-gather with knobs for more of the usual mistakes."""
    def ring(buf, comm):
        rank, N, right, left = _ring(comm)
        target = buf.clone() if on == "a copy" else buf
        bounds = [shard_bounds(len(buf), c, N) for c in range(N)]
        for s in range(N - 1 if steps is None else steps(N)):
            s0, s1 = bounds[(rank - s) % N]
            r0, r1 = bounds[{"(r - s - 1)": rank - s - 1, "(r + s + 1)": rank + s + 1,
                             "what it sends": rank - s}[receives] % N]
            src = left if receives_from == "left" else right
            if combine == "add" or into == "a temporary":
                tmp = torch.empty_like(target[r0:r1])
                comm.sendrecv(target[s0:s1], right, tmp, src)
                if combine == "add":
                    target[r0:r1] += tmp
            else:
                comm.sendrecv(target[s0:s1], right, target[r0:r1], src)
        return target
    return ring


@pytest.mark.parametrize("fn, hint", [
    (allgather_with(combine="add"), r"Hint: rank 0's chunk\(s\) \[2\] hold the arriving chunk plus "
                                    r"what was there before"),
    (allgather_with(into="a temporary"), r"Hint: rank 0's buffer holds only what it started with"),
    (allgather_with(on="a copy"), r"Hint: rank 0's buffer holds only what it started with: "
                                  r"nothing was received into it"),
    (allgather_with(receives="(r + s + 1)"), r"CommError[\s\S]*Hint: rank \d received \d+ bytes "
                                             r"from rank \d into a buffer of \d+ bytes"),
    (allgather_with(receives="what it sends"), r"Hint: rank \d received \d+ bytes from rank \d"),
    (allgather_with(steps=lambda N: N), r"not the ring: rank 0 sent 3 message\(s\)"),
    (allgather_with(receives_from="right"), r"Hint: rank\(s\) \[.*\] waited for a message from "
                                            r"their RIGHT neighbour"),
], ids=["adds", "into a temporary", "on a copy", "index the other way",
        "into the chunk it sends", "one step too many", "receives from the right"])
def test_more_allgather_mistakes(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint) as info:
        CA.check_ring_allgather(fn, cluster, timeout=1.0)
    assert "(r - s) mod N" not in str(info.value)


# ---------------------------------------------------------------- the composed allreduce
def good_allreduce(buf, comm):
    good_reduce_scatter(buf, comm)
    good_allgather(buf, comm)
    return buf


def reduce_scatter_only(buf, comm):
    good_reduce_scatter(buf, comm)
    return buf


def allreduce_that_averages(buf, comm):
    good_allreduce(buf, comm)
    buf /= comm.world_size
    return buf


def test_allreduce_against_native(cluster, capsys):
    assert CA.check_ring_allreduce(good_allreduce, cluster) is True
    assert "✓ check_ring_allreduce: 6/6" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"run the all-gather after the reduce-scatter"):
        CA.check_ring_allreduce(reduce_scatter_only, cluster)
    with pytest.raises(CheckFailed, match=r"holds the sum divided by 3: the average"):
        CA.check_ring_allreduce(allreduce_that_averages, cluster)


def allgather_then_reduce_scatter(buf, comm):
    good_allgather(buf, comm)
    good_reduce_scatter(buf, comm)
    return buf


def allgather_only(buf, comm):
    return good_allgather(buf, comm)


def reduce_scatter_twice(buf, comm):
    good_reduce_scatter(buf, comm)
    good_reduce_scatter(buf, comm)
    return good_allgather(buf, comm)


def reduce_scatter_on_a_copy(buf, comm):
    good_reduce_scatter(buf.clone(), comm)
    return good_allgather(buf, comm)


def native_allreduce(buf, comm):
    import torch.distributed as dist
    dist.all_reduce(buf)
    return buf


def into_a_new_tensor(buf, comm):
    return good_allreduce(buf.clone(), comm)


def own_chunk_averaged(buf, comm):
    a, b = good_reduce_scatter(buf, comm)
    buf[a:b] /= comm.world_size
    return good_allgather(buf, comm)


@pytest.mark.parametrize("fn, hint", [
    (allgather_then_reduce_scatter, r"Hint: rank 0's chunk 0 is 3 x its own data: the all-gather "
                                    r"ran first"),
    (allgather_only, r"Hint: rank 0's buffer holds every rank's own chunk, unreduced"),
    (reduce_scatter_on_a_copy, r"Hint: rank 0's buffer holds every rank's own chunk, unreduced"),
    (reduce_scatter_twice, r"Hint: even rank 0's own chunk 0 is not the sum"),
    (native_allreduce, r"the values are right but rank 0 sent nothing through comm"),
    (into_a_new_tensor, r"Hint: rank 0's buffer did not change: the allreduce works in place"),
    (own_chunk_averaged, r"Hint: rank 0 holds the sum divided by 3: the average"),
], ids=["all-gather first", "all-gather only", "reduce-scatter on a copy",
        "reduce-scatter twice", "dist.all_reduce", "a new tensor", "own chunk averaged"])
def test_more_allreduce_mistakes(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        CA.check_ring_allreduce(fn, cluster, timeout=1.0)


def test_time_allreduce_returns_a_row_per_size(cluster):
    rows = CA.time_allreduce(good_allreduce, cluster, sizes=(4096, 8192), repeats=1)
    assert [r["size"] for r in rows] == [4096, 8192]
    assert all(r["yours_us"] > 0 and r["native_us"] > 0 for r in rows)


def test_case_inputs_are_exact_and_marked():
    for dtype in ("float16", "float32", "int32"):
        xs = CA.case_inputs("reduce-scatter", 17, dtype, 0, 3)
        exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
        assert np.array_equal(np.sum(xs, axis=0, dtype=np.float64), exact)
        assert np.array_equal(exact.astype(dtype).astype(np.float64), exact)
    marked = CA.case_inputs("all-gather", 10, "float32", 0, 3)
    a, b = shard_bounds(10, 1, 3)
    assert (marked[1][:a] <= CA.MARK).all() and (marked[1][a:b] > CA.MARK).all()


# ---------------------------------------------------------------- the stretch: a two-way ring
def two_way(buf, comm, mirror=True, second_to="left", mirror_gather=None):
    """The first half clockwise, the second counter-clockwise; knobs for the usual mistakes."""
    rank, N, right, left = _ring(comm)
    h = (len(buf) + 1) // 2
    halves = (buf[:h], buf[h:])
    bounds = [[shard_bounds(len(x), c, N) for c in range(N)] for x in halves]
    back, ahead = (left, right) if second_to == "left" else (right, left)
    for phase in ("reduce-scatter", "all-gather"):
        mirrored = mirror if phase == "reduce-scatter" or mirror_gather is None else mirror_gather
        sign = 1 if mirrored else -1   # the mirrored schedule: chunk indices r + s, not r - s
        shift = 1 if phase == "reduce-scatter" else 0
        for s in range(N - 1):
            a0, a1 = bounds[0][(rank - s - shift) % N]
            c0, c1 = bounds[0][(rank - s - shift - 1) % N]
            b0, b1 = bounds[1][(rank + sign * (s + shift)) % N]
            d0, d1 = bounds[1][(rank + sign * (s + shift + 1)) % N]
            if phase == "reduce-scatter":
                into0 = torch.empty_like(halves[0][c0:c1])
                into1 = torch.empty_like(halves[1][d0:d1])
            else:
                into0, into1 = halves[0][c0:c1], halves[1][d0:d1]
            works = [comm.irecv(into0, left), comm.irecv(into1, ahead),
                     comm.isend(halves[0][a0:a1], right), comm.isend(halves[1][b0:b1], back)]
            for w in works:
                w.wait()
            if phase == "reduce-scatter":
                halves[0][c0:c1] += into0
                halves[1][d0:d1] += into1
    return buf


def good_two_way(buf, comm):
    return two_way(buf, comm)


def two_way_without_mirroring(buf, comm):
    return two_way(buf, comm, mirror=False)


def both_halves_to_the_right(buf, comm):
    """Two one-way rings, one per half, both clockwise: right values, one direction idle."""
    return two_way(buf, comm, mirror=False, second_to="right")


def test_two_way_ring_passes_and_one_way_rings_fail(cluster, capsys):
    assert CA.check_bidirectional_ring_allreduce(good_two_way, cluster) is True
    assert "✓ check_bidirectional_ring_allreduce: 6/6" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"not the two-way ring: rank 0 sent nothing to its "
                                          r"left neighbour 2: that is the one-way ring"):
        CA.check_bidirectional_ring_allreduce(good_allreduce, cluster)
    with pytest.raises(CheckFailed, match=r"not the two-way ring: rank 0 sent nothing to its "
                                          r"left"):
        CA.check_bidirectional_ring_allreduce(both_halves_to_the_right, cluster)
    assert CA.check_bidirectional_ring_allreduce(not_implemented, cluster) is False


def test_two_way_ring_with_the_one_way_indices_gets_the_mirrored_schedule(cluster):
    with pytest.raises(CheckFailed, match=r"(?s)case 1/6 .*(second half .* is not|mirrored).*"
                                          r"mirror image"):
        CA.check_bidirectional_ring_allreduce(two_way_without_mirroring, cluster, timeout=1.0)


def test_time_against_ring_on_an_emulated_link(cluster):
    cluster.set_link("1Gbit/s,50us")
    try:
        rows = CA.time_against_ring(good_two_way, cluster, sizes=(4096, 65536), repeats=1)
    finally:
        cluster.set_link(None)
    assert [r["size"] for r in rows] == [4096, 65536]
    assert all(r["yours_us"] > 0 and r["ring_us"] > 0 and r["model_us"] > 0 for r in rows)


def two_way_averaged(buf, comm):
    good_two_way(buf, comm)
    buf /= comm.world_size
    return buf


def first_half_only(buf, comm):
    good_allreduce(buf[:(len(buf) + 1) // 2], comm)
    return buf


def second_half_without_its_allgather(buf, comm):
    rank, N, right, left = _ring(comm)
    h = (len(buf) + 1) // 2
    good_allreduce(buf[:h], comm)
    half = buf[h:]
    bounds = [shard_bounds(len(half), c, N) for c in range(N)]
    for s in range(N - 1):  # the mirrored reduce-scatter, then nothing
        s0, s1 = bounds[(rank + s + 1) % N]
        r0, r1 = bounds[(rank + s + 2) % N]
        tmp = torch.empty_like(half[r0:r1])
        comm.sendrecv(half[s0:s1], left, tmp, right)
        half[r0:r1] += tmp
    return buf


def second_half_cut_like_the_buffer(buf, comm):
    """The second half's chunks cut from the whole buffer's bounds: chunks too long."""
    rank, N, right, left = _ring(comm)
    h = (len(buf) + 1) // 2
    good_allreduce(buf[:h], comm)
    half = buf[h:]
    bounds = [tuple(min(x, len(half)) for x in shard_bounds(len(buf), c, N)) for c in range(N)]
    for s in range(N - 1):
        s0, s1 = bounds[(rank + s + 1) % N]
        r0, r1 = bounds[(rank + s + 2) % N]
        tmp = torch.empty_like(half[r0:r1])
        comm.sendrecv(half[s0:s1], left, tmp, right)
        half[r0:r1] += tmp
    for s in range(N - 1):
        s0, s1 = bounds[(rank + s) % N]
        r0, r1 = bounds[(rank + s + 1) % N]
        comm.sendrecv(half[s0:s1], left, half[r0:r1], right)
    return buf


def second_allgather_not_mirrored(buf, comm):
    return two_way(buf, comm, mirror_gather=False)


def waits_on_each_request(buf, comm):
    """Waits on every request as soon as it is posted: every rank waits on a receive first."""
    rank, N, right, left = _ring(comm)
    h = (len(buf) + 1) // 2
    half = buf[:h]
    bounds = [shard_bounds(len(half), c, N) for c in range(N)]
    for s in range(N - 1):
        s0, s1 = bounds[(rank - s - 1) % N]
        r0, r1 = bounds[(rank - s - 2) % N]
        tmp = torch.empty_like(half[r0:r1])
        comm.irecv(tmp, left).wait()
        comm.isend(half[s0:s1], right).wait()
        half[r0:r1] += tmp
    return buf


@pytest.mark.parametrize("fn, hint", [
    (two_way_averaged, r"Hint: rank 0 holds the sum divided by 3: the average"),
    (first_half_only, r"Hint: rank 0's first half is right, its second half buf\[7:\] is as it "
                      r"was"),
    (second_half_without_its_allgather, r"Hint: rank 0's first half is right, and in the second "
                                        r"half its own chunk 0 is the sum but the other chunks "
                                        r"are not"),
    (second_half_cut_like_the_buffer,
     r"Hint: rank \d received \d+ bytes from rank \d into a buffer of \d+ bytes[\s\S]*Each half "
     r"has its own N chunks|a chunk of half the buffer holds at most"),
    (second_allgather_not_mirrored, r"Hint: (rank \d received \d+ bytes from rank \d into a buffer "
                                    r"of \d+ bytes|rank 0's first half is right)[\s\S]*mirror"),
    (waits_on_each_request, r"CommTimeout[\s\S]*Hint: a rank waited past its deadline\. .*or every "
                            r"rank waits on a receive before it has posted its sends"),
], ids=["averaged", "first half only", "second half without all-gather",
        "second half cut like the buffer", "all-gather of the second half not mirrored",
        "waits on each request"])
def test_more_two_way_mistakes(cluster, fn, hint):
    with pytest.raises(CheckFailed, match=hint) as info:
        CA.check_bidirectional_ring_allreduce(fn, cluster, timeout=1.0)
    assert "(r + s + 1) mod N" not in str(info.value)
