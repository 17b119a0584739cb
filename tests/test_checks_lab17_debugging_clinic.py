"""Lab 17's checks: a right fix passes; each broken job, handed in as its own fix, fails with
what the tool of notebook 17 shows for it (the error, the ranks' stacks, the first divergence,
the coverage, the update against one process); a wrong diagnosis gets the tool to use, never
the fix; a template's NotImplementedError is a notice, not a failure."""

import re

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
    assert "Where they were (course_lib.runtime.stacks)" in capsys.readouterr().out


def test_a_wrong_diagnosis_names_the_tool_not_the_fix(cluster):
    with pytest.raises(CheckFailed) as failed:
        checks.check_job(4, "scaling", right_step, cluster)
    assert "'scaling' is not what job 4 shows" in str(failed.value)
    assert "clinic.coverage" in str(failed.value) and "shard_bounds" not in str(failed.value)
    with pytest.raises(CheckFailed, match="the diagnosis must be one of"):
        checks.check_job(4, "off by one", right_step, cluster)


def fix(model, X, y, ids, comm, number, lr, *, shard="own", reduction="mean", divide="world",
        biases=True, returns="own", count=None, barrier=None, zero_grad_late=False,
        params_summed=False):
    """A fixed step, with knobs that put one of the usual mistakes back into it."""
    r, n = comm.rank, comm.world_size
    lo, hi = shard_bounds(len(ids), r, n)
    mine = {"own": ids[lo:hi], "all": ids, "rank % 2": ids[slice(*shard_bounds(len(ids), r % 2,
                                                                            n))],
            "one short": ids[lo:hi - 1], "strided": ids[r::n]}[shard]
    loss = F.cross_entropy(model(X[mine]), y[mine], reduction=reduction)
    model.zero_grad()
    loss.backward()
    if zero_grad_late:
        model.zero_grad()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if not biases and p.dim() == 1:
            continue
        if not params_summed:
            collectives.allreduce(p.grad, comm, "ring")
        if divide == "twice" or (divide == "weights only" and p.dim() > 1) or \
                divide in ("world", "len(mine) too"):
            p.grad /= n
        if divide == "twice" or divide == "len(mine) too":
            p.grad /= n if divide == "twice" else len(mine)
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
        if params_summed:
            for p in model.parameters():
                collectives.allreduce(p.data, comm, "ring")
        if barrier and number % 3 == 2:
            if r == 0:
                accuracy = (model(X[ids]).argmax(1) == y[ids]).double().mean().item()
            if barrier == "every rank" or (barrier == "rank 0 only" and r == 0):
                comm.barrier()
    own = loss.item()
    if count is not None:  # job 1: the loss (and count) through one more allreduce
        if count == "float32 on the last rank":
            total = torch.tensor([own, len(mine)],
                                 dtype=torch.float32 if r == n - 1 else torch.float64)
            collectives.allreduce(total, comm, "ring")
        elif count == "max on the last rank":
            total = torch.tensor([own], dtype=torch.float64)
            collectives.allreduce(total, comm, "ring", op="max" if r == n - 1 else "sum")
        elif count == "only on the last rank":
            total = torch.tensor([own], dtype=torch.float64)
            if r == n - 1:
                collectives.allreduce(total, comm, "ring")
        elif count == "weighted":
            total = torch.tensor([own * len(mine), len(mine)], dtype=torch.float64)
            collectives.allreduce(total, comm, "ring")
            return mine.tolist(), float(total[0] / total[1])
        else:
            total = torch.tensor([own], dtype=torch.float64)
            collectives.allreduce(total, comm, "ring")
        own = float(total[0]) / (1 if count == "not divided" else n)
    said = {"own": own, "sum": own * len(mine), "per rank": own / n,
            "accuracy": accuracy if barrier and number % 3 == 2 and r == 0 else own}[returns]
    return mine.tolist(), said


def fix_with(**knobs):
    def step(model, X, y, ids, comm, number, lr):
        return fix(model, X, y, ids, comm, number, lr, **knobs)
    return step


@pytest.mark.parametrize("number, kind, knobs", [
    (1, "mismatch", dict(count="weighted")),
    (2, "hang", dict(barrier="every rank")),
    (4, "sharding", dict(shard="strided")),
], ids=["weighted loss", "barrier on every rank", "strided shards"])
def test_other_right_fixes_pass(cluster, number, kind, knobs):
    assert checks.check_job(number, kind, fix_with(**knobs), cluster)


OTHER = r"Hint: your fix has a bug of another kind"
SCALING = r"every rank agrees, but differs from one process .*\nHint: your fix has a bug of " \
          r"another kind \(scaling\): "
LOSS = r"the model trains as one process does, but rank 0 returned the loss .*\n" + OTHER + \
       r" \(loss\): the loss your step returns is "
MISTAKES = [  # (job, its kind, knobs, what the check must say)
    (1, "mismatch", dict(count="float32 on the last rank"),
     r"shapes/dtypes differ across ranks: .* rank 3: \(2,\) float32.*\nHint: still a bug of job "
     r"1's kind \(mismatch\): the ranks still call a collective whose shape, dtype or operation "
     r"differs"),
    (1, "mismatch", dict(count="max on the last rank"), r"ops differ across ranks.*\nHint: still "
                                                        r"a bug of job 1's kind \(mismatch\)"),
    (1, "mismatch", dict(count="not divided"),
     LOSS + r"4 x the mean loss of the batch \(4: the number of ranks\)"),
    (1, "mismatch", dict(count="plain", divide=None),
     SCALING + r"every tensor's first update is 4 x one process's \(4: the number of ranks\)"),
    (1, "mismatch", dict(count="plain", returns="sum"),
     LOSS + r"16 x the mean loss of the batch \(16: the samples each rank reads\)"),
    (1, "mismatch", dict(count="only on the last rank"),
     r"rank 3: \(1,\) float6.*\nHint: still a bug of job 1's kind \(mismatch\)"),
    (2, "hang", dict(barrier="rank 0 only"),
     r"did not finish within 8s[\s\S]*waiting: rank 0: barrier[\s\S]*Hint: every collective"),
    (2, "hang", dict(barrier="every rank", returns="accuracy"),
     r"rank 0 returned the loss 0\.84375 at step 2: .*\n" + OTHER + r" \(loss\): the loss your "
     r"step returns is 0\.567 x the mean loss of the rank's samples\. It must be a mean loss"),
    (2, "hang", dict(barrier="every rank", divide=None), SCALING + r"every tensor's first update "
                                                                  r"is 4 x one process's"),
    (2, "hang", dict(barrier="every rank", divide="twice"),
     SCALING + r"every tensor's first update is 1/4 x one process's \(1/4: one over the number "
     r"of ranks\)"),
    (2, "hang", dict(barrier="every rank", biases=False),
     r"differ from step 1 on, first in tensor 0\.bias.*\n" + OTHER + r" \(divergence\): the "
     r"ranks' copies of 0\.bias part at step 1"),
    (2, "hang", dict(barrier="every rank", shard="all"),
     r"samples read twice .*\n" + OTHER + r" \(sharding\): each rank must read its own part"),
    (3, "divergence", dict(divide="weights only"),
     SCALING + r"the first update of 0\.bias is 4 x one process's \(4: the number of ranks\), "
     r"and those of \['0\.weight', '2\.weight'\] are right"),
    (3, "divergence", dict(divide="twice"), SCALING + r"every tensor's first update is 1/4 x"),
    (3, "divergence", dict(zero_grad_late=True), SCALING + r"the parameters did not move in the "
                                                          r"first step"),
    (3, "divergence", dict(params_summed=True, divide=None),
     SCALING + r"the first updates are [\d.]+ to [\d.]+ x one process's, a different multiple "
     r"for every tensor"),
    (3, "divergence", dict(returns="sum"), LOSS + r"16 x the mean loss of the rank's samples "
                                                  r"\(16: the samples each rank reads\)"),
    (3, "divergence", dict(returns="per rank"), LOSS + r"1/4 x the mean loss of the rank's "
                                                       r"samples"),
    (4, "sharding", dict(shard="all"), r"ranks 2 and 3: 384\) and 0 samples .*\nHint: still a bug "
                                       r"of job 4's kind \(sharding\).*clinic\.coverage"),
    (4, "sharding", dict(shard="rank % 2"), r"\(ranks 0 and 2: 96, ranks 1 and 3: 96\) and 192 "
                                            r"samples of the batches read by no rank"),
    (4, "sharding", dict(shard="one short"), r"samples read twice \(none\) and 24 samples"),
    (4, "sharding", dict(divide=None), SCALING + r"every tensor's first update is 4 x"),
    (4, "sharding", dict(returns="sum"), LOSS + r"16 x"),
    (4, "sharding", dict(shard="strided", biases=False), OTHER + r" \(divergence\)"),
    (5, "scaling", dict(returns="sum"), LOSS + r"16 x"),
    (5, "scaling", dict(divide=None),
     r"first update is 4 x one process's\nHint: still a bug of job 5's kind \(scaling\): every "
     r"tensor's first update is 4 x one process's \(4: the number of ranks\)"),
    (5, "scaling", dict(divide="len(mine) too"),
     r"still a bug of job 5's kind \(scaling\): every tensor's first update is 1/16 x one "
     r"process's \(1/16: one over the samples each rank reads\)"),
    (5, "scaling", dict(reduction="sum", divide="len(mine) too", returns="sum"),
     LOSS + r"256 x the mean loss of the rank's samples"),
    (5, "scaling", dict(returns="per rank"), LOSS + r"1/4 x"),
    (5, "scaling", dict(biases=False), OTHER + r" \(divergence\)"),
]


@pytest.mark.parametrize("number, kind, knobs, said", MISTAKES)
def test_a_fix_with_a_new_bug_is_told_that_bug(cluster, number, kind, knobs, said):
    with pytest.raises(CheckFailed, match=said) as failed:
        checks.check_job(number, kind, fix_with(**knobs), cluster)
    if "another kind" in str(failed.value):  # the fix's bug, not the job's tool again
        assert checks.TOOLS[number] not in str(failed.value)


def test_templates_are_a_notice(cluster, capsys):
    def diagnosis():
        raise NotImplementedError("exercise 3: fill in diagnosis_3")
    assert checks.check_job(3, diagnosis, template, cluster) is False
    assert checks.check_job(3, "divergence", template, cluster) is False


# ---------------------------------------------------------------- exercise 6: the flight records
def job_records():
    """Records as clinic.uneven_data leaves them on 4 ranks: rank 0 one allreduce more."""
    entry = [{"seq": 7 + i, "op": "all_reduce", "sizes": [[2410]], "dtypes": ["Double"]}
             for i in range(4)]
    return [entry, entry[:3], entry[:3], entry[:3]]


def right_parting(records):
    from collections import Counter
    for i in range(max(map(len, records))):
        seen = [repr((r[i]["op"], r[i]["sizes"])) if i < len(r) else None for r in records]
        most = Counter(seen).most_common(1)[0][0]
        if len(set(seen)) > 1:
            return {"collective": i + 1, "ranks": [k for k, s in enumerate(seen) if s != most]}
    return None


def from_zero(records):
    found = right_parting(records)
    return found and {**found, "collective": found["collective"] - 1}


def with_zip(records):
    for i, entries in enumerate(zip(*records, strict=False)):
        if len({repr((e["op"], e["sizes"])) for e in entries}) > 1:
            return right_parting([r[:i + 1] for r in records])
    return None


def ops_only(records):
    return right_parting([[{**e, "sizes": None} for e in r] for r in records])


def majority(records):
    found = right_parting(records)
    return found and {**found, "ranks": sorted(set(range(len(records))) - set(found["ranks"]))}


def test_the_right_reading_of_the_records_passes(capsys):
    assert checks.check_parting(right_parting, job_records()) is True
    assert "✓ check_parting: 6/6" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, hint", [
    (from_zero, "you count from 0"),
    (with_zip, "zip() stops at the shortest"),
    (ops_only, "compare each collective's operation and its sizes"),
    (majority, "you named the ranks that agree"),
    (lambda records: 4, 'return {"collective": k, "ranks": [...]}'),
])
def test_each_mistaken_reading_is_named(mistake, hint):
    with pytest.raises(CheckFailed, match=re.escape(hint)):
        checks.check_parting(mistake, job_records())


def test_the_template_is_a_notice_not_a_failure(capsys):
    def parting(records):
        raise NotImplementedError
    assert checks.check_parting(parting, job_records()) is False
