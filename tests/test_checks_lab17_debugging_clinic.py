"""Lab 17's checks: a right fix passes; each broken job, handed in as its own fix, fails with
what the tool of notebook 17 shows for it (the error, the ranks' stacks, the first divergence,
the coverage, the update against one process); a wrong diagnosis gets the tool to use, never
the fix; a template's NotImplementedError is a notice, not a failure."""

import pytest
import torch
import torch.nn.functional as F

from course_lib import collectives
from course_lib.checks import lab17_debugging_clinic as checks
from course_lib.checks.framework import CheckFailed
from course_lib.sharding import shard_bounds

CLUSTER_SIZE = 4


def right_step(model, X, y, ids, comm, number, lr, biases=True, extra=0, reduction="mean"):
    lo, hi = shard_bounds(len(ids), comm.rank, comm.world_size)
    mine = ids[lo:hi + extra]
    loss = F.cross_entropy(model(X[mine]), y[mine], reduction=reduction)
    model.zero_grad()
    loss.backward()
    for p in model.parameters():
        if biases or p.dim() > 1:
            collectives.allreduce(p.grad, comm, "ring")
            p.grad /= comm.world_size
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return mine.tolist(), loss.item()


def no_biases(*args):
    return right_step(*args, biases=False)


def one_more(*args):
    return right_step(*args, extra=1)


def summed(*args):
    return right_step(*args, reduction="sum")


def waits_for_rank_0(model, X, y, ids, comm, number, lr):
    out = right_step(model, X, y, ids, comm, number, lr)
    if number == 1 and comm.rank != 0:
        comm.barrier()
    return out


def shapes_differ(model, X, y, ids, comm, number, lr):
    out = right_step(model, X, y, ids, comm, number, lr)
    total = torch.zeros(2 if comm.rank == comm.world_size - 1 else 1, dtype=torch.float64)
    collectives.allreduce(total, comm, "ring")
    return out


def template(model, X, y, ids, comm, number, lr):
    raise NotImplementedError("exercise 3: fill in fixed_step_3")


def test_a_right_fix_passes(cluster, capsys):
    assert checks.check_job(3, "divergence", right_step, cluster)
    assert "✓ check_job(3)" in capsys.readouterr().out


@pytest.mark.parametrize("number, kind, step, said", [
    (3, "divergence", no_biases, "differ from step 1 on, first in tensor 0.bias"),
    (4, "sharding", one_more, "samples read twice (ranks 0 and 1: 6, ranks 1 and 2: 6, "
                              "ranks 2 and 3: 6)"),
    (5, "scaling", summed, "the first update is 16 x one process's"),
    (1, "mismatch", shapes_differ, "shapes/dtypes differ across ranks"),
])
def test_a_fix_that_is_still_broken_is_shown_as_the_tool_sees_it(cluster, number, kind, step,
                                                                  said):
    with pytest.raises(CheckFailed) as failed:
        checks.check_job(number, kind, step, cluster)
    assert said in str(failed.value), str(failed.value)
    assert checks.TOOLS[number] in str(failed.value)


def test_a_fix_that_still_hangs_shows_where_each_rank_waits(cluster):
    with pytest.raises(CheckFailed) as failed:
        checks.check_job(2, "hang", waits_for_rank_0, cluster)
    text = str(failed.value)
    assert "did not finish within" in text and "barrier over torch" in text, text
    assert "waiting: rank 0: irecv from rank 1" in text or "waiting: rank 0:" in text, text


def test_run_job_prints_how_a_broken_job_ends(cluster, capsys):
    assert checks.run_job(no_biases, cluster) is not None
    assert "the job finished: 6 steps on 4 ranks" in capsys.readouterr().out
    assert checks.run_job(waits_for_rank_0, cluster, deadline=3) is None
    assert "Where they were (course_lib.stacks)" in capsys.readouterr().out


def test_a_wrong_diagnosis_names_the_tool_not_the_fix(cluster):
    with pytest.raises(CheckFailed) as failed:
        checks.check_job(4, "scaling", right_step, cluster)
    assert "'scaling' is not what job 4 shows" in str(failed.value)
    assert "clinic.coverage" in str(failed.value) and "shard_bounds" not in str(failed.value)
    with pytest.raises(CheckFailed, match="the diagnosis must be one of"):
        checks.check_job(4, "off by one", right_step, cluster)


def test_templates_are_a_notice(cluster, capsys):
    def diagnosis():
        raise NotImplementedError("exercise 3: fill in diagnosis_3")
    assert checks.check_job(3, diagnosis, template, cluster) is False
    assert checks.check_job(3, "divergence", template, cluster) is False
