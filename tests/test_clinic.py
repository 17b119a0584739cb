"""The debugging clinic (notebook 17): every broken job fails within its deadline or runs to the
end, and each tool names what it must: the stacks of a hung job name the waiting collective and
the peer, the agreement check and PyTorch's DETAIL fingerprints name the mismatched shapes, the
checksums name the first step and tensor, the coverage names the shared samples, and the merged
trace holds every rank's events and names the straggler."""

import subprocess
import sys

import pytest

from course_lib import clinic
from course_lib.runtime import stacks
from course_lib.runtime.cluster import ClusterTimeout, RemoteError
from course_lib.testing.timing import assert_no_hang

CLUSTER_SIZE = 4
STEPS = 4


@pytest.fixture(scope="module")
def reference():
    return clinic.one_process(steps=STEPS)


def test_the_right_job_equals_one_process(cluster, reference):
    runs = cluster.run(clinic.train, steps=STEPS)
    assert clinic.first_divergence(runs) is None
    check = clinic.against_one_process(runs[0], reference)
    assert max(check["max_difference"]) < 1e-12 and abs(check["first_update_ratio"] - 1) < 1e-9
    assert clinic.coverage(runs)["overlap"] == {} and clinic.coverage(runs)["unread"] == 0


def test_a_barrier_only_rank_0_reaches_is_shown_where_every_rank_waits(cluster):
    with pytest.raises(ClusterTimeout) as hung:
        cluster.run(clinic.train, bug="barrier", steps=STEPS, timeout=4)
    text = str(hung.value)
    assert "rank(s) 0: train (clinic.py" in text and "barrier (" in text
    assert "waiting: rank 0: barrier over torch (world size 4)" in text
    for r in (1, 2, 3):
        assert f"waiting: rank {r}: irecv from rank 0 of 15 x int64" in text  # its record
    assert "rank(s) 1, 2, 3: train (clinic.py" in text and "check_agreement (agreement.py" in text


def test_a_ring_of_blocking_sends_is_shown_waiting_in_send(cluster):
    with pytest.raises(ClusterTimeout) as hung:
        cluster.run(clinic.train, bug="deadlock", steps=STEPS, timeout=4)
    text = str(hung.value)
    for r in range(4):
        assert f"waiting: rank {r}: send to rank {(r + 1) % 4} of 2048 x float64" in text, text
    killed = stacks.summary(cluster.stacks()).splitlines()  # deaf to SIGINT, so killed
    assert len(killed) == 4 and all("its engine is gone" in line for line in killed), killed


def test_stacks_any_time_and_from_the_command_line(cluster):
    """Every rank of an idle cluster answers, idle; the CLI finds the same engines."""
    cluster.run(int, 0)  # restarts engines a hang left killed
    snaps = cluster.stacks()
    assert [s["rank"] for s in snaps] == [0, 1, 2, 3]
    assert stacks.summary(snaps) == "rank(s) 0, 1, 2, 3: idle (not in a cluster call)"
    out = subprocess.run([sys.executable, "-m", "course_lib", "cluster", "stacks"],
                         capture_output=True, text=True, timeout=600).stdout
    assert "rank(s) 0, 1, 2, 3: idle" in out, out


def test_mismatched_collectives_are_named_by_both_checks(cluster):
    with pytest.raises(RemoteError) as raised:
        cluster.run(clinic.train, bug="order", steps=STEPS)
    assert "rank 3: (32,) float64" in str(raised.value).splitlines()[0]
    fingerprints = cluster.run(clinic.native_order_bug)
    assert all(f.startswith("Detected mismatch between collectives on ranks") for f in
               fingerprints), fingerprints
    assert "TensorShape=[32]" in fingerprints[3] and "TensorShape=[32, 64]" in fingerprints[0]
    assert "TensorOptions" not in fingerprints[3]


def test_the_first_divergence_names_the_step_and_the_tensor(cluster):
    runs = cluster.run(clinic.train, bug="seeds", steps=STEPS)
    assert clinic.first_divergence(runs) == {"step": 0, "tensor": "0.weight",
                                             "groups": [[0], [1], [2], [3]]}
    late = [dict(r, checksums=runs[0]["checksums"][:2] + r["checksums"][2:]) for r in runs]
    assert clinic.first_divergence(late)["step"] == 2  # equal before step 2, not after


def test_summed_gradients_and_shared_shards_agree_between_ranks_and_are_found(cluster,
                                                                              reference):
    summed = cluster.run(clinic.train, bug="sum", steps=STEPS)
    assert clinic.first_divergence(summed) is None
    ratio = clinic.against_one_process(summed[0], reference)["first_update_ratio"]
    assert abs(ratio - 4) < 1e-9
    shards = cluster.run(clinic.train, bug="shards", steps=STEPS)
    cover = clinic.coverage(shards)
    assert cover["overlap"] == {(0, 2): 16 * STEPS, (1, 3): 16 * STEPS}
    assert cover["unread"] == 32 * STEPS and cover["read"] == 64 * STEPS


def test_the_merged_trace_holds_every_rank_and_names_the_straggler(cluster):
    runs = cluster.run(clinic.train, bug="straggler", steps=STEPS, profile=True)
    merged = clinic.merged_trace(runs)
    by_rank = {r: [e for e in merged["traceEvents"] if e["pid"] == r and e.get("ph") == "X"]
               for r in range(4)}
    assert all(len(events) > 10 for events in by_rank.values())
    labels = clinic.time_by_label(merged)
    assert all(t["allreduce"] > 0 for t in labels.values())
    assert all(len(run["timeline"].of("allreduce")) == STEPS for run in runs)  # the spans too
    found = clinic.straggler(merged)
    assert found["rank"] == 1 and found["last_in_steps"][1] >= STEPS - 1, found
    assert labels[1]["data"] > STEPS * clinic.STRAGGLER_SECONDS * 0.9


def test_unknown_bug_is_refused():
    with pytest.raises(ValueError, match="bug must be one of"):
        clinic.train(bug="typo")


def test_the_wrong_interface_on_two_hosts_is_named_by_its_address():
    from course_lib.runtime import hosts
    reason = hosts.unavailable_reason()
    if reason:
        pytest.skip(f"two hosts: {reason}")
    wrong = clinic.across_hosts("lo", timeout=60)
    assert not wrong["ok"] and "connectFullMesh failed" in wrong["error"], wrong
    assert wrong["remote"] == "127.0.0.1"
    assert_no_hang(wrong["seconds"], 10, instead=60)  # Gloo's connect, not the 60 s deadline
    right = clinic.across_hosts(None, timeout=600)  # a hang guard: torch's imports under load
    assert right["ok"], right


def test_the_flight_recorder_names_the_rank_that_skipped_a_collective():
    """Rank 1 skips one of four allreduces of one size: Gloo pairs the rest without a word, the
    last one times out on the others, and the ranks' flight records, diffed, name rank 1. On a
    cluster of its own: the timed-out allreduces are left pending in its process group."""
    from course_lib import start_cluster
    with start_cluster(n=3, share=False) as own:
        out = own.run(clinic.skipped_collective, 1, 2, 4, 2.0, timeout=120)
        late = own.run(clinic.late_for_barrier, 2, 1.0, timeout=120)
    with start_cluster(n=3, share=False) as own:  # uneven shards: 33, 32, 32 digits
        uneven = own.run(clinic.uneven_data, 97, 8, 0.5, 2.0, timeout=120)
    assert [u["batches"] for u in uneven] == [5, 4, 4]
    assert [u["error"] is None for u in uneven] == [False, True, True]
    assert "allreduce #5 did not finish within 2 s" in uneven[0]["error"]
    assert clinic.parting([u["record"] for u in uneven]) == {
        "collective": 5, "ranks": [0], "issued": [("all_reduce", [[2410]])], "usual": None}
    assert clinic.diverged([u["record"] for u in uneven]) == (
        "collective #5 (all_reduce of [[2410]]): only rank(s) [0] issued it; the others issued "
        "4 collectives")
    # monitored_barrier: rank 0 names the late rank; the others are sent to rank 0's log
    assert late[0]["error"] == "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 1000 ms"
    assert "Rank 1 successfully reached monitoredBarrier" in late[1]["error"]
    assert late[2]["error"]  # it arrived when everyone had given up
    assert [o["error"] is None for o in out] == [False, True, False]
    assert "allreduce #4 did not finish within 2 s" in out[0]["error"]
    assert [len(o["record"]) for o in out] == [4, 3, 4]
    assert all(e["op"] == "all_reduce" and e["sizes"] == [[8]] for o in out for e in o["record"])
    assert clinic.diverged([o["record"] for o in out]) == (
        "collective #4 (all_reduce of [[8]]): rank(s) [1] never issued it; they issued 3 "
        "collectives, the others 4")
    same = [[{"op": "broadcast", "sizes": [[2]]}]] * 2
    assert clinic.diverged(same) == "every rank issued the same 1 collectives"
    assert clinic.diverged([[{"op": "all_reduce", "sizes": [[2]]}],
                            [{"op": "all_reduce", "sizes": [[3]]}],
                            [{"op": "all_reduce", "sizes": [[2]]}]]) == (
        "collective #1 (all_reduce of [[2]]): rank(s) [1] issued [('all_reduce', [[3]])] "
        "instead")


def test_py_spy_shows_the_native_wait_under_a_rank_stuck_in_an_allreduce():
    """clinic.native_stack: rank 0 of two waits in an allreduce rank 1 never calls; py-spy's
    native dump shows torch's C++ wait under the Python call, and both processes are gone."""
    import psutil
    dump = clinic.native_stack()
    if dump.startswith(("py-spy is not installed", "py-spy could not read")):
        pytest.skip(f"{dump} (pip install py-spy; reading another process needs ptrace, "
                    "allowed to root or with kernel.yama.ptrace_scope=0)")
    lines = clinic.readable_stack(dump)
    assert lines[0].startswith("Thread") and "c10d::Work::wait (libtorch_cpu.so)" in lines
    assert any(line.startswith("all_reduce (torch/distributed/distributed_c10d.py:")
               for line in lines)
    assert lines[-1] == "<module> (<string>:9)"
    left = [p for p in psutil.process_iter(["cmdline"])
            if "dist.init_process_group(\"gloo\", init_method=f\"file://{store}\""
            in " ".join(p.info["cmdline"] or [])]
    assert not left
