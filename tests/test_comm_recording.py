"""The recording transport (course_lib.comm.recording): the library's ring run on it equals
numpy's sum, its recorded schedule is the ring's, and it keeps comm's checks and deadlines."""

import time

import numpy as np
import pytest

from course_lib import collectives as C
from course_lib.comm import CommError, CommTimeout, RecordingComm, run_ranks
from course_lib.sharding import shard_bounds
from course_lib.testing.timing import assert_no_hang


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_on_the_recording_transport_equals_numpys_sum(world_size):
    rng = np.random.default_rng(world_size)
    data = rng.standard_normal((world_size, 4 * world_size + 3))  # chunks of unequal size
    buffers = [row.copy() for row in data]
    results, _ = run_ranks(C.ring_allreduce, buffers)
    for rank, buf in enumerate(buffers):
        assert results[rank] is buf  # in place
        np.testing.assert_allclose(buf, data.sum(axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_recorded_schedule_is_2_n_minus_1_steps_of_n_messages_of_one_chunk(world_size):
    n, length = world_size, 5 * world_size + 2
    buffers = [np.full(length, float(r)) for r in range(n)]
    _, messages = run_ranks(C.ring_allreduce, buffers)
    chunks = [shard_bounds(length, c, n) for c in range(n)]
    # reduce-scatter step s sends chunk r-s-1 from rank r; all-gather step s chunk r-s
    for tag, shift in [(C.TAG_RS, 1), (C.TAG_AG, 0)]:
        phase = [m for m in messages if m.tag == tag]
        assert sorted({m.step for m in phase}) == list(range(n - 1))
        for s in range(n - 1):
            step = [m for m in phase if m.step == s]
            assert sorted(m.src for m in step) == list(range(n))  # N messages, one per rank
            for m in step:
                assert m.dst == (m.src + 1) % n
                start, stop = chunks[(m.src - s - shift) % n]
                assert (m.offset, m.count, m.nbytes) == (start, stop - start, 8 * (stop - start))
    ring = [m for m in messages if m.tag in (C.TAG_RS, C.TAG_AG)]
    assert len(ring) == 2 * (n - 1) * n
    # everything else is the agreement round: one record from every rank to every other
    assert len(messages) - len(ring) == n * (n - 1)


def test_sender_state_is_the_senders_buffer_when_it_sent():
    buffers = [np.full(4, 10.0 ** r) for r in range(2)]
    _, messages = run_ranks(C.ring_allreduce, buffers, check=False)
    first, later = [[m for m in messages if m.src == 0][k] for k in (0, 1)]
    np.testing.assert_array_equal(first.sender_state, [1, 1, 1, 1])  # before any step
    np.testing.assert_array_equal(later.sender_state, [11, 11, 1, 1])  # chunk 0 reduced


@pytest.mark.parametrize("algorithm", ["naive", "tree", "ring_pipelined"])
def test_every_algorithm_runs_on_it(algorithm):
    data = np.arange(5 * 37, dtype=np.int64).reshape(5, 37)
    buffers = [row.copy() for row in data]
    run_ranks(C.allreduce, buffers, algorithm=algorithm)
    for buf in buffers:
        np.testing.assert_array_equal(buf, data.sum(axis=0))


def test_receives_match_in_order_and_a_wrong_size_is_named():
    def exchange(buf, comm):
        if comm.rank == 0:
            for n in (3, 4, 5):
                comm.send(np.full(n, float(n)), 1)
            return None
        requests = [comm.irecv(np.zeros(4), 0) for _ in range(3)]
        got = []
        for r in reversed(requests):  # waited last first: still matched in the order posted
            try:
                got.append(r.wait().tolist())
            except CommError as e:
                got.append(str(e))
        return got[::-1]

    results, _ = run_ranks(exchange, [np.zeros(1), np.zeros(1)])
    wrong = ("rank 1: irecv from rank 0 of 4 x float64 (32 bytes) over recording (world size 2): "
             "rank 0 sent {} bytes ({} x float64) but the receive buffer holds 32 bytes")
    assert results[1][0].startswith(wrong.format(24, 3))
    assert results[1][1] == [4.0] * 4
    assert results[1][2].startswith(wrong.format(40, 5))


def test_a_missing_rank_is_a_deadline_and_a_failing_rank_stops_the_others():
    def one_never_sends(buf, comm):
        if comm.rank == 0:
            comm.recv(buf, 1)

    t = time.monotonic()
    with pytest.raises(CommTimeout, match="rank 0: recv from rank 1 of 3 x float64 .* did not "
                                          "complete within 0.3s"):
        run_ranks(one_never_sends, [np.zeros(3), np.zeros(3)], timeout=0.3)
    assert_no_hang(time.monotonic() - t, 0.3, timed_out=True)

    def one_raises(buf, comm):
        if comm.rank == 1:
            raise KeyError("boom")
        comm.recv(buf, 1)

    t = time.monotonic()
    with pytest.raises(KeyError, match="boom"):  # the cause, not the others' CommError
        run_ranks(one_raises, [np.zeros(3), np.zeros(3)], timeout=30)
    assert_no_hang(time.monotonic() - t, 0, instead=30)  # the waiting rank did not sit it out


def test_bad_peers_and_a_shape_mismatch_raise_as_on_the_other_transports():
    def to_itself(buf, comm):
        comm.send(buf, comm.rank)

    with pytest.raises(ValueError, match="rank 0: send to itself"):
        run_ranks(to_itself, [np.zeros(2)])
    with pytest.raises(ValueError, match="shapes/dtypes differ across ranks"):
        run_ranks(C.ring_allreduce, [np.zeros(5), np.zeros(6), np.zeros(5)])
    assert RecordingComm.transport == "recording"
