"""The ring of blocking sends under a real mpiexec: completes small, deadlocks large, never hangs.

Also the same ring over ``course_lib.comm`` on a cluster: ``sendrecv`` works, a blocking send
then receive ends in a CommTimeout naming rank, operation and size.
"""

import os
import shutil
import sys

import psutil
import pytest

from course_lib import send_cycle as S

MIB = 1 << 20
needs_mpi = pytest.mark.skipif(
    shutil.which("mpiexec") is None and not os.path.exists(os.path.join(sys.prefix, "bin",
                                                                        "mpiexec")),
    reason="no mpiexec (pip install mpi4py mpich)")


def _leftovers():
    """Processes of the ring program still alive (other than this test process)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] != os.getpid() and "course_lib.send_cycle" in cmd:
            found.append((p.info["pid"], cmd))
    return found


@needs_mpi
def test_small_messages_complete_large_ones_deadlock_and_nothing_is_left():
    results = S.run_cycle([0, 1024, MIB, 2 * MIB], "send", world_size=2, deadline=1.0)
    assert [r.status for r in results] == ["completed", "completed", "deadlocked", "not run"]
    stuck = results[2]
    assert stuck.seconds == 1.0 and stuck.nbytes == MIB
    assert "send to rank" in stuck.detail and f"{MIB} bytes" in stuck.detail
    assert _leftovers() == []


@needs_mpi
def test_synchronous_send_deadlocks_at_any_size():
    (r,) = S.run_cycle([1], "ssend", world_size=2, deadline=1.0)
    assert r.status == "deadlocked"


@needs_mpi
@pytest.mark.parametrize("mode,world_size", [("sendrecv", 2), ("sendrecv", 3),
                                             ("oddeven", 3), ("isend", 3)])
def test_the_fixes_complete_at_every_size(mode, world_size):
    results = S.run_cycle([1, 64 * 1024, MIB], mode, world_size=world_size, deadline=5.0)
    assert [r.status for r in results] == ["completed"] * 3, results
    assert all(r.world_size == world_size and r.mode == mode for r in results)


@needs_mpi
def test_sweep_relaunches_after_a_deadlock_and_finds_the_eager_limit():
    results = S.sweep([1024, MIB, 2 * MIB, 4 * MIB], "send", deadline=1.0, max_deadlocks=2)
    assert [r.status for r in results] == ["completed", "deadlocked", "deadlocked", "not run"]
    ok, stuck = S.find_eager_limit(0, MIB, resolution=16 * 1024, deadline=1.0)
    assert ok is not None and stuck == ok + 16 * 1024  # the limit lies between them
    assert _leftovers() == []


@needs_mpi
def test_a_launch_past_its_timeout_is_killed_with_all_its_ranks():
    with pytest.raises(S.SendCycleError, match="did not finish within 2s and was killed"):
        S.run_cycle([MIB], "send", world_size=2, deadline=60.0, timeout=2.0)
    assert _leftovers() == []


def test_reports_are_read_even_when_lines_of_ranks_run_together():
    text = ('noise {"status": "deadlocked", "nbytes": 8}{"status": "deadlocked", "nbytes": 8}\n'
            '{"status": "completed", "nbytes": 4, "seconds": 0.1, "correct": true} {bad\n')
    reports = list(S.json_objects(text))
    assert [r["status"] for r in reports] == ["deadlocked", "deadlocked", "completed"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        S.run_cycle([1], "broadcast")
    with pytest.raises(ValueError, match="world_size"):
        S.run_cycle([1], "send", world_size=1)


def test_ring_over_course_comm_on_a_cluster(cluster):
    from course_lib.runtime.cluster import RemoteError
    reports = cluster.run(S.ring_exchange, MIB, "sendrecv")
    assert [(r["rank"], r["from"], r["got"]) for r in reports] == [(0, 1, 1.0), (1, 0, 0.0)]
    with pytest.raises(RemoteError, match="CommTimeout") as info:
        cluster.run(S.ring_exchange, 1024, "send", 1.0)
    assert "rank 0: send to rank 1 of 128 x float64 (1024 bytes)" in info.value.errors[0]
    assert cluster.run(S.ring_exchange, 8, "sendrecv")[0]["got"] == 1.0  # repaired
