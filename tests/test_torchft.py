"""torchft's live recovery, the production counterpart of notebook 11's checkpoint-and-restart: a
replica SIGKILLed mid-run, the survivor trains on alone with a quorum of 1, the restarted replica
fetches the survivor's weights over HTTP and rejoins, bit for bit. torchft is optional: these
tests are skipped without it, except the one that checks the message saying how to install it.
"""

import subprocess
import sys

import pytest

from course_lib.testing import torchft as ft
from course_lib.testing.timing import assert_no_hang

STEPS, KILL_AT = 25, 4


@pytest.fixture(scope="module")
def run():
    """One real run (Lighthouse + 2 replica processes, replica 1 killed and restarted), shared
    by the tests below: each costs seconds of PyTorch imports."""
    pytest.importorskip("torchft", reason="optional: pip install -c constraints.txt torchft")
    return ft.live_recovery(steps=STEPS, kill_at=KILL_AT, step_time=0.1, timeout=10.0)


def test_without_torchft_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    assert not ft.available()
    with pytest.raises(ImportError, match=r"pip install -c constraints\.txt torchft"):
        ft.live_recovery()


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="kill_at"):
        ft.live_recovery(steps=10, kill_at=10)
    with pytest.raises(ValueError, match="victim"):
        ft.live_recovery(replicas=2, victim=2)


def test_the_survivor_trains_on_alone_during_the_outage(run):
    kill = KILL_AT - 1  # replica 1 committed steps 0..2, then died before step 3
    assert run.kill_step == kill and run.kill_s > 0
    assert run.steps[0] == list(range(len(run.steps[0])))  # no gap: never stopped
    assert len(run.steps[0]) >= STEPS
    assert run.quorum[:kill] == [2] * kill
    assert run.outage_steps >= 1 and run.quorum[kill:kill + run.outage_steps] == \
        [1] * run.outage_steps
    assert run.resume_s > 0
    assert_no_hang(run.resume_s, 1)  # about the Lighthouse's heartbeat timeout (1 s)


def test_the_restarted_replica_rejoins_with_the_survivors_weights(run):
    kill = KILL_AT - 1
    assert run.rejoin_step == kill + run.outage_steps
    assert run.steps[1] == list(range(kill)) + list(range(run.rejoin_step, len(run.steps[0])))
    assert run.quorum[run.rejoin_step:] == [2] * (len(run.quorum) - run.rejoin_step)
    assert run.weights_equal and run.max_difference == 0.0
    assert run.final_equal
    assert 0 < run.restart_s <= run.recover_s  # holds under load: a part of the whole
    assert_no_hang(run.fetch_s, 0)  # the survivor's weights, fetched once
    assert "bit for bit" in run.summary()


def test_the_loss_decreases(run):
    assert run.loss_final < run.loss_start / 2
    assert sum(run.losses[-5:]) < sum(run.losses[:5])


def test_no_process_is_left_behind(run):
    import psutil
    left = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "course_lib.testing.torchft" in " ".join(proc.cmdline()):
                left.append(proc)
        except psutil.Error:  # gone while we looked: not left behind
            pass
    assert left == []


def test_a_replica_without_a_lighthouse_says_what_it_waited_for(tmp_path):
    """Every wait has a deadline, and the error names the replica, the operation and what it
    waited for (here before importing torch: cheap)."""
    pytest.importorskip("torchft", reason="optional: pip install -c constraints.txt torchft")
    proc = subprocess.run(
        [sys.executable, "-m", "course_lib.testing.torchft", "--replica", "1", "--timeout", "1",
         "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1
    assert last.startswith("torchft replica 1: failed while waiting for the Lighthouse to "
                           "start: TimeoutError: no "), proc.stderr[-2000:]
    assert "lighthouse.port after 1 s" in last


def test_torchfts_diloco_trains_the_course_diloco_to_float32_rounding(cluster):
    """torchft's DiLoCo (a real Lighthouse, a Manager per replica group) and notebook 08's, on
    the same data, model and optimizers: the same model after 20 steps (two outer steps), the
    same bytes averaged."""
    pytest.importorskip("torchft", reason="optional: pip install -c constraints.txt torchft")
    import numpy as np

    from course_lib import local_sgd
    theirs = ft.torchft_diloco(replicas=2, sync_every=10, steps=20)
    ours = local_sgd.run_diloco(cluster, 10, steps=20, eval_every=20)
    assert np.abs(ours["theta"] - theirs["theta"]).max() < 1e-5
    assert ours["loss"][-1] == pytest.approx(theirs["loss"], rel=1e-4)
    # two syncs of the parameters: ours sends the ring's 2 (N-1)/N of them, N = 2
    assert ours["bytes_total"] == theirs["bytes"] == 2 * theirs["theta"].size * 4
