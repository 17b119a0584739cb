"""Checkpoints: a process killed in the middle of a write loses nothing with the atomic save (and
everything with the in-place one); damaged files are named and skipped; a resume is bit-exact;
a sharded checkpoint is used only once committed; fault points fire where and when armed."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib import checkpoint as C
from course_lib.runtime import fault_points
from course_lib.testing.checkpoint import save_killed_mid_write

CLUSTER_SIZE = 2


def _run(code, **env):
    """Run ``code`` in a fresh Python; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


def test_naive_save_killed_mid_write_loses_the_previous_checkpoint(tmp_path):
    path = tmp_path / "model.pt"
    C.naive_save({"w": torch.ones(3), "step": 1}, path)
    assert save_killed_mid_write(path, naive=True) == -signal.SIGKILL
    with pytest.raises(RuntimeError, match="PytorchStreamReader|zip archive"):  # half a file
        torch.load(path, weights_only=True)


def test_atomic_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    C.save({"w": torch.ones(3), "step": 1}, tmp_path, step=1)
    assert save_killed_mid_write(tmp_path) == -signal.SIGKILL
    state, path = C.load_latest(tmp_path)
    assert path.name == "step-00000001.pt" and state["step"] == 1
    assert (tmp_path / C.LATEST).read_text() == "step-00000001.pt"
    orphans = list(tmp_path.glob(".*.tmp-*"))
    assert orphans, "the killed writer's temporary file should be left"
    assert C.remove_orphans(tmp_path) == orphans and not list(tmp_path.glob(".*.tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "not a checkpoint"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(tmp_path, damage):
    for step in (1, 2):
        C.save({"w": torch.full((1000,), float(step)), "step": step}, tmp_path, step)
    newest = tmp_path / "step-00000002.pt"
    data = newest.read_bytes()
    newest.write_bytes({"truncate": data[:len(data) // 2],
                        "flip a byte": data[:-10] + bytes([data[-10] ^ 1]) + data[-9:],
                        "not a checkpoint": b"PK" + data[40:]}[damage])
    said = []
    state, path = C.load_latest(tmp_path, report=said.append)
    assert state["step"] == 1 and path.name == "step-00000001.pt"
    assert len(said) == 1 and str(newest) in said[0]
    assert ("checksum mismatch" if damage != "not a checkpoint" else "not a course") in said[0]


def test_only_the_newest_are_kept_and_an_empty_directory_has_none(tmp_path):
    assert C.load_latest(tmp_path / "missing") == (None, None)
    for step in range(0, 50, 10):
        C.save({"step": step}, tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000030.pt",
                                                               "step-00000040.pt"]
    assert C.load_latest(tmp_path)[0]["step"] == 40


def _train(model, optimizer, X, y, steps, start=0):
    """SGD with dropout (torch's generator) on batches drawn by numpy's generator."""
    for _ in range(start, steps):
        rows = np.random.choice(len(X), 8, replace=False)
        loss = torch.nn.functional.mse_loss(model(X[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _setup():
    torch.manual_seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    X = torch.randn(64, 5, dtype=torch.float64)
    return model, optimizer, X, X.sum(1, keepdim=True)


def test_resume_is_bit_exact(tmp_path):
    model, optimizer, X, y = _setup()
    _train(model, optimizer, X, y, 20)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, optimizer, X, y = _setup()
    _train(model, optimizer, X, y, 12)
    C.save(C.training_state(model, optimizer, step=12), tmp_path, 12)
    torch.manual_seed(123)  # the generators move on, as in a new process
    np.random.seed(123)
    model, optimizer, _, _ = _setup()
    step, _, _ = C.restore(C.load_latest(tmp_path)[0], model, optimizer)
    _train(model, optimizer, X, y, 20, start=step)
    for p, q in zip(model.parameters(), uninterrupted, strict=True):
        assert torch.equal(p, q)


def test_a_sharded_checkpoint_counts_only_once_committed(cluster, tmp_path):
    from course_lib.testing.checkpoint import save_and_load_sharded
    reports = cluster.run(save_and_load_sharded, str(tmp_path))
    assert [r["loaded_step"] for r in reports] == [20, 20]
    assert all(torch.equal(r["part"], torch.full((3,), 20.0 + r["rank"])) for r in reports)
    # a crash between the ranks' writes: step 30 has rank 0's file and no marker
    (tmp_path / "step-00000030").mkdir()
    (tmp_path / "step-00000020" / "rank-1.pt").write_bytes(b"damaged")
    said = []
    part, folder = C.load_sharded(tmp_path, 0, 2, report=said.append)
    assert folder.name == "step-00000010" and torch.equal(part, torch.full((3,), 10.0))
    assert "no COMMITTED marker" in said[0] and "rank-1.pt" in said[1]
    assert C.load_sharded(tmp_path, 0, 3, report=said.append) == (None, None)
    assert "saved by 2 ranks, not 3" in said[-1]


def test_fault_points_fire_at_the_count_once_and_for_their_rank(tmp_path):
    out = _run("""
        from course_lib.runtime import fault_points
        fault_points.arm_from_environment()
        for step in range(1, 10):
            print(step, flush=True)
            fault_points.point("train-step")
    """, COURSE_LIB_FAULTS=f"train-step:kill@4:rank=1:once={tmp_path / 'fired'}", RANK="1")
    assert out.returncode == -signal.SIGKILL and out.stdout.split() == ["1", "2", "3", "4"]
    again = _run("""
        from course_lib.runtime import fault_points
        fault_points.arm_from_environment()
        for step in range(1, 10):
            fault_points.point("train-step")
        print("finished")
    """, COURSE_LIB_FAULTS=f"train-step:kill@4:rank=1:once={tmp_path / 'fired'}", RANK="1")
    assert again.returncode == 0 and "finished" in again.stdout  # once: not again
    assert fault_points.parse("train-step:kill@4:rank=1", rank=0) == []
    with pytest.raises(fault_points.FaultSpecError, match="at and rank must be integers"):
        fault_points.parse("train-step:kill@x")
    with pytest.raises(fault_points.FaultSpecError, match="action must be one of"):
        fault_points.parse("train-step:explode@2")
    fault_points.disarm()


def test_the_simulated_best_interval_is_youngs():
    """Checkpointing every sqrt(2CM) finishes within 1% of the best interval simulated, and
    ten times more or less often costs more."""
    young = C.young_interval(cost=1 / 60, mtbf=3.0)
    assert young == pytest.approx((2 * 3.0 / 60) ** 0.5)
    times = {t: C.time_to_finish(t, work=200, runs=100) for t in np.geomspace(0.05, 2, 12)}
    at_young = C.time_to_finish(young, work=200, runs=100)
    assert at_young <= 1.01 * min(times.values())
    assert C.time_to_finish(young / 10, work=200, runs=100) > 1.05 * at_young
    assert C.time_to_finish(young * 10, work=200, runs=100) > 1.05 * at_young
    assert C.time_to_finish(1.0, work=10, mtbf=1e9, cost=0.0) == pytest.approx(10.0)


def test_dcp_commits_with_metadata_last_but_overwrites_in_place(cluster, tmp_path):
    """torch.distributed.checkpoint writes one file per rank and .metadata; saved again into
    the same directory by a writer that dies before .metadata, the step-10 checkpoint is gone:
    the old metadata now reads the failed save's numbers (step 20)."""
    from course_lib.testing.checkpoint import dcp_round_trip
    reports = cluster.run(dcp_round_trip, str(tmp_path))
    for r in reports:
        assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"] and r["exact"]
        assert r["step_after_crash"] == 20 and r["values_after_crash"] == [20.0]


def test_bench_measures_saves_and_redoes_at_most_k_steps_per_failure(tmp_path):
    from course_lib.bench import checkpoint as bench
    saves = bench.save_times([1 << 16, 1 << 18], tmp_path, repeats=1)
    assert [r["size"] for r in saves] == [1 << 16, 1 << 18]
    assert all(r["atomic_ms"] > 0 and r["dcp_ms"] > 0 and r["load_ms"] > 0 for r in saves)
    for K in (2, 8):
        run = bench.run_with_failures(K, work=40, step_s=0.002, mtbf_steps=10, restart_s=0.0,
                                      state_bytes=1 << 16, directory=tmp_path / f"k{K}")
        assert run["failures"] > 0 and run["redone"] <= run["failures"] * K
        assert run["saves"] >= 40 // K
    left = set(Path(tempfile.gettempdir()).glob("bench-ckpt-*"))
    rows = bench.interval_rows([2, 8], work=20, step_s=0.002, mtbf_steps=10,
                               state_bytes=1 << 16, restart_s=0.0, repeats=1)
    assert set(Path(tempfile.gettempdir()).glob("bench-ckpt-*")) <= left  # none left behind
    text = bench.format_tables(saves, rows, 0.002, 10)
    assert "ceiling" in text and "Young's sqrt(2CM)" in text


def test_reshard_reads_are_the_boxes_a_shard_shares_with_the_saved_chunks():
    saved = [((0, 0), (16, 256)), ((16, 0), (16, 256)), ((32, 0), (16, 256)), ((48, 0), (16, 256))]
    # dp2 x tp2's rank 1: rows 0-31, columns 128-255: half a row block from files 0 and 1
    assert C.reshard_reads(saved, ((0, 128), (32, 128))) == [
        {"chunk": 0, "storage_offsets": (0, 128), "dest_offsets": (0, 0), "lengths": (16, 128)},
        {"chunk": 1, "storage_offsets": (0, 128), "dest_offsets": (16, 0), "lengths": (16, 128)}]
    # a shard across a boundary reads the end of one chunk and the start of the next
    assert C.reshard_reads([((0,), (10,)), ((10,), (10,))], ((7,), (5,))) == [
        {"chunk": 0, "storage_offsets": (7,), "dest_offsets": (0,), "lengths": (3,)},
        {"chunk": 1, "storage_offsets": (0,), "dest_offsets": (3,), "lengths": (2,)}]
    assert C.reshard_reads([((0,), (10,)), ((10,), (10,))], ((10,), (10,)))[0]["chunk"] == 1
    # every element of the shard read exactly once, whatever the two layouts
    for saved_n, wanted_n in ((4, 3), (3, 4), (5, 2), (1, 7)):
        rows = 60
        saved = [((i * rows // saved_n,), ((i + 1) * rows // saved_n - i * rows // saved_n,))
                 for i in range(saved_n)]
        for j in range(wanted_n):
            start, end = j * rows // wanted_n, (j + 1) * rows // wanted_n
            reads = C.reshard_reads(saved, ((start,), (end - start,)))
            covered = sorted(x + r["dest_offsets"][0] for r in reads
                             for x in range(r["lengths"][0]))
            assert covered == list(range(end - start))
    with pytest.raises(ValueError, match="saved chunk 0 has 1 dimensions, the shard 2"):
        C.reshard_reads([((0,), (4,))], ((0, 0), (2, 2)))


def test_dcp_latest_skips_a_step_without_its_metadata(tmp_path):
    assert C.dcp_latest(tmp_path / "none", report=print) is None
    for step in (1, 2):
        C.dcp_save({"w": torch.full((5,), float(step))}, tmp_path, step)
    (tmp_path / "step-00000003").mkdir()  # a save that died before .metadata
    said = []
    assert C.dcp_latest(tmp_path, report=said.append).name == "step-00000002"
    assert said == [f"skipping {tmp_path / 'step-00000003'}: no .metadata (a save that died "
                    "before its commit)"]
