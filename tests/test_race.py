"""The lost-update race between real processes, its fixes, and the machine description.

The unlocked runs use ``window=True`` (each worker yields the CPU between its read and its write)
so that lost updates show up on any machine, loaded or idle, with one core or many:
the sleep guarantees that the workers overlap in time.
"""

import os

import psutil
import pytest

from course_lib import race


def _race_workers():
    """Live worker processes of this test process (not multiprocessing's resource tracker)."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "spawn_main" in " ".join(p.cmdline())]


def test_unlocked_counter_loses_updates():
    r = race.shared_counter(num_workers=2, increments=3000, mode="unlocked", window=True)
    assert r.expected == 6000 and r.kind == "counter" and r.num_workers == 2
    assert 0 < r.lost < 6000 and r.got == r.expected - r.lost
    assert r.seconds > 0


@pytest.mark.parametrize("mode", ["locked", "reduction"])
def test_lock_and_reduction_are_exact(mode):
    r = race.shared_counter(num_workers=3, increments=2000, mode=mode, window=True)
    assert (r.expected, r.got, r.lost) == (6000, 6000, 0)


def test_parallel_for_sum():
    n = 20_000
    exact = n * (n - 1) // 2
    racy = race.parallel_for_sum(n, num_workers=2, mode="unlocked", window=True)
    assert racy.expected == exact and racy.lost > 0
    for mode in ("locked", "reduction"):
        r = race.parallel_for_sum(n, num_workers=3, mode=mode)  # uneven blocks: 6667, 6667, 6666
        assert (r.got, r.lost, r.kind) == (exact, 0, "sum")
    assert race.parallel_for_sum(0, num_workers=2).got == 0


def test_a_worker_that_dies_is_named():
    with pytest.raises(race.RaceError, match=r"worker 1 \(pid \d+\) exited with code 1"):
        race.run_workers("counter", [(0, 10), (None, 5)], True, "unlocked", False, 30)
    assert _race_workers() == []


def test_a_worker_past_the_deadline_is_killed():
    with pytest.raises(race.RaceError, match=r"still running after 1s were killed"):
        race.shared_counter(num_workers=2, increments=10**9, timeout=1)
    assert _race_workers() == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        race.shared_counter(2, 10, mode="atomic")
    with pytest.raises(ValueError):
        race.parallel_for_sum(10, num_workers=0)


def test_machine_info():
    info = race.machine_info()
    assert info["cpu_count"] == os.cpu_count()
    assert set(info) >= {"usable_cpus", "model", "sockets", "memory_gib", "numa_nodes"}
    if info["numa_nodes"]:
        assert all(len(n["distances"]) == len(info["numa_nodes"]) for n in info["numa_nodes"])
