"""Point-to-point messages: every operation over both transports, deadlines, and bad calls."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from course_lib.comm import CommTimeout, describe, get_comm
from course_lib.runtime import cluster as CL
from course_lib.runtime.launch import mpiexec_path
from course_lib.testing import comm as K
from course_lib.testing.timing import assert_no_hang

MPIEXEC = mpiexec_path() or "mpiexec"
needs_mpiexec = pytest.mark.skipif(not os.path.exists(MPIEXEC),
                                   reason="no mpiexec (pip install mpi4py mpich)")

# What every rank runs under mpiexec: the same checks as on the cluster, one JSON file per rank.
SCRIPT = """
import json, sys
from course_lib.testing import comm as K
transport, out = sys.argv[1], sys.argv[2]
if transport == "torch":
    from course_lib.comm import init_torch_from_launcher
    init_torch_from_launcher(timeout=20)
report = {"numpy": K.p2p_roundtrips(transport, kind="numpy"),
          "torch": K.p2p_roundtrips(transport, kind="torch"),
          "errors": K.p2p_errors(transport),
          "mismatch": K.p2p_size_mismatch(transport),
          "recv_timeout": K.p2p_timeout(1, "recv", transport, timeout=1.0, linger=1.2)}
if transport == "mpi":  # a Gloo timeout breaks the process group: one timeout is all it gets
    report["barrier_timeout"] = K.p2p_timeout(0, "barrier", transport, timeout=1.0, linger=1.2)
from course_lib.comm import get_comm
with open(f"{out}/rank{get_comm(transport).rank}.json", "w") as f:
    json.dump(report, f)
"""


CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py


def _check_errors(errors, rank, world_size):
    assert errors["self"] == f"ValueError: rank {rank}: send to itself; copy the buffer instead"
    assert errors["out of range"] == (f"ValueError: rank {rank}: recv peer must be a rank in "
                                      f"0..{world_size - 1}, not {world_size}")
    assert "isend peer must be a rank" in errors["negative"] and "not -1" in errors["negative"]
    assert "irecv peer must be a rank" in errors["not an int"]
    assert errors["non-contiguous"].startswith("ValueError") and "contiguous" in \
        errors["non-contiguous"]


def _check_mismatch(got, transport, world_size):
    """Rank 1's report of K.p2p_size_mismatch: each wrong size named, each right one intact."""
    def error(sent, op="recv"):
        return (f"rank 1: {op} from rank 0 of 4 x float32 (16 bytes) over {transport} (world "
                f"size {world_size}): rank 0 sent {sent * 4} bytes ({sent} x float32) but the "
                "receive buffer holds 16 bytes: a send and its receive must have the same size "
                "(the message was received and dropped)")
    assert got == [error(5), error(3), error(0), [3.0] * 4,   # blocking, one after the other
                   error(5, "irecv"), [1.0] * 4, [2.0] * 4], got  # posted first, waited reversed


def _check_timeout(result, rank, silent, transport, world_size, op="recv"):
    message, seconds = result
    if op == "recv":
        assert message == (f"rank {rank}: recv from rank {silent} of 256 x float32 (1024 bytes) "
                           f"over {transport} (world size {world_size}) did not complete within "
                           f"1s; is rank {silent} alive and calling the matching send?")
    else:
        assert message.startswith(f"rank {rank}: barrier over {transport} did not complete "
                                  "within 1s") and "a rank is missing" in message
    assert_no_hang(seconds, 1, timed_out=True)


# ---------------------------------------------------------------- torch.distributed on a cluster
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_every_operation_over_torch(cluster, kind):
    assert cluster.run(K.p2p_roundtrips, "torch", kind=kind) == [[], []]


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_a_message_that_does_not_fit_is_an_error_on_the_receiver_and_nobody_dies(cluster, kind):
    reports = cluster.run(K.p2p_size_mismatch, "torch", kind=kind)
    assert reports[0] == "sent"
    _check_mismatch(reports[1], "torch", 2)
    assert cluster.run(K.p2p_roundtrips, "torch", big_bytes=1024) == [[], []]  # the same group


def test_a_comm_that_checks_always_checks_messages_marked_unchecked(cluster):
    """``check_sizes="always"`` (what ``bench allreduce --check-messages`` times) overrides the
    ``check_size=False`` of the course's collectives."""
    reports = cluster.run(K.p2p_size_mismatch, "torch", check_sizes="always", check_size=False)
    _check_mismatch(reports[1], "torch", 2)


def test_bad_calls_over_torch(cluster):
    for rank, errors in enumerate(cluster.run(K.p2p_errors, "torch")):
        _check_errors(errors, rank, 2)


def test_timeout_over_torch_names_op_rank_peer_and_size(cluster):
    t = time.monotonic()
    with pytest.raises(CL.RemoteError) as info:  # comm timeout 1 s, no linger, let it raise
        cluster.run(K.p2p_timeout, 1, "recv", "torch", 1.0, 0.0, False, timeout=20)
    assert_no_hang(time.monotonic() - t, 1, timed_out=True)
    assert sorted(info.value.errors) == [0]
    assert info.value.errors[0].startswith(
        "CommTimeout: rank 0: recv from rank 1 of 256 x float32 (1024 bytes) over torch (world "
        "size 2) did not complete within 1s; is rank 1 alive"), info.value.errors[0]
    assert cluster.run(K.p2p_roundtrips, "torch", big_bytes=1024) == [[], []]  # repaired


def test_a_timeout_caught_on_the_rank_still_gets_the_group_repaired(cluster):
    said = cluster.run(K.p2p_timeout, 1, "recv", "torch", 1.0, 0.0, True, timeout=20)
    assert said[1] is None and "did not complete within 1s" in said[0][0]  # caught by rank 0
    assert cluster.run(K.p2p_roundtrips, "torch", big_bytes=1024) == [[], []]  # repaired first
    assert cluster.run(CL.allreduce_ranks) == [1.0, 1.0]


# ---------------------------------------------------------------- under mpiexec
def _launch(n, transport, tmp_path):
    env = dict(os.environ, MPIEXEC_TIMEOUT="60", OMP_NUM_THREADS="1")
    out = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-c", SCRIPT, transport,
                          str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    files = sorted(tmp_path.glob("rank*.json"))
    assert out.returncode == 0 and len(files) == n, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(f.read_text()) for f in files]


@needs_mpiexec
@pytest.mark.parametrize("transport, n", [("mpi", 3), ("torch", 3)])
def test_every_operation_under_mpiexec(transport, n, tmp_path):
    reports = _launch(n, transport, tmp_path)
    for rank, report in enumerate(reports):
        assert report["numpy"] == [] and report["torch"] == []
        _check_errors(report["errors"], rank, n)
        assert report["mismatch"] == ("sent" if rank == 0 else None if rank > 1 else
                                      report["mismatch"])
        if rank == 1:
            _check_mismatch(report["mismatch"], transport, n)
        if rank == 1:
            assert report["recv_timeout"] is None
        else:
            _check_timeout(report["recv_timeout"], rank, 1, transport, n)
        if transport == "mpi" and rank != 0:
            _check_timeout(report["barrier_timeout"], rank, 0, transport, n, op="barrier")


# ---------------------------------------------------------------- no peer needed
def test_describe_names_count_dtype_and_bytes():
    import torch
    assert describe(np.zeros(1024, np.float32)) == "1024 x float32 (4096 bytes)"
    assert describe(torch.zeros(3, 2, dtype=torch.float16)) == "6 x float16 (12 bytes)"
    assert describe(np.zeros(0)) == "0 x float64 (0 bytes)"


def test_unknown_transport():
    with pytest.raises(ValueError, match="transport must be 'torch' or 'mpi'"):
        get_comm("tcp")


def test_comm_timeout_is_a_timeout_error():
    assert issubclass(CommTimeout, TimeoutError) and issubclass(CommTimeout, RuntimeError)


@needs_mpiexec
def test_an_mpi4py_of_another_mpi_is_named_not_run_alone():
    """A process started as one of 3 (PMI_SIZE=3, what MPICH's mpiexec sets) whose MPI sees a
    world of 1, as an mpi4py built for another MPI than the mpiexec sees: a clear error, not a
    rank 0 that computes alone."""
    code = ("from course_lib.comm import get_comm\n"
            "try:\n    get_comm('mpi')\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PMI_SIZE="3"),
                         capture_output=True, text=True, timeout=600).stdout
    assert out.startswith("CommError mpiexec started 3 processes but MPI sees a world of 1"), out
    assert "another MPI" in out


def test_during_puts_who_and_what_first_and_keeps_the_kind_of_error():
    from course_lib.comm import CommError, CommTimeout, during
    from course_lib.pipeline import PipelineError
    with pytest.raises(CommTimeout, match=r"^ring attention, forward step 2: rank 1: recv "):
        with during("ring attention, forward step 2"):
            raise CommTimeout("rank 1: recv from rank 0 did not complete within 1s")
    with pytest.raises(PipelineError, match=r"^stage 1 \(rank 1\): a send was not received: x$"):
        with during("stage 1 (rank 1): a send was not received", PipelineError):
            raise CommError("x")
    with pytest.raises(ValueError, match="^not a comm error$"):  # anything else passes through
        with during("ring attention"):
            raise ValueError("not a comm error")


def test_a_torch_wait_never_ends_before_its_deadline():
    """torch's Work.wait keeps whole milliseconds: a deadline 0.99995 s away, truncated, would
    fire 1 ms early; rounded up it never does (and 0 s is 1 ms, not "no deadline")."""
    from datetime import timedelta

    from course_lib.comm.base import whole_milliseconds
    assert whole_milliseconds(0.99995) == timedelta(seconds=1)
    assert whole_milliseconds(1.0) == timedelta(seconds=1)
    assert whole_milliseconds(0.0) == whole_milliseconds(-1.0) == timedelta(milliseconds=1)
