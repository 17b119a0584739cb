"""Checks for labs/17_debugging_clinic.ipynb: five broken data-parallel jobs to diagnose and fix
(notebook 17).

In the lab, under each job::

    from course_lib.checks import lab17_debugging_clinic as checks
    checks.check_job(1, kind_1, fixed_step_1, cluster)

``kind_1`` is the student's diagnosis, one of :data:`KINDS`; ``fixed_step_1(model, X, y, ids,
comm, number, lr) -> (samples read, loss)`` their repaired step. The check sends the step to the
engines (cloudpickle, by value) and runs it with ``clinic.run`` for a few steps, each wait with a
deadline: a job that still hangs comes back with where every rank waited (the stacks), never a
frozen notebook. The run passes when every rank read its own shard of each batch (nothing read
twice, nothing left out) and every rank's parameters equal one process on the whole batch after
every step, and every rank returned a mean loss (of the samples it read, or of the whole batch).
A wrong diagnosis, or a fix that still shows the job's bug, gets a hint that names the tool that
finds such a bug and what it shows here; a fix with a bug of another kind gets what that bug
does (which tensor, by what factor, which loss), never the fix.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from course_lib import clinic, data
from course_lib.checks.framework import CheckFailed, not_implemented, pack_function

STEPS = 6
RUN_TIMEOUT = 8.0       # the whole run, on the cluster (6 steps take a second or two)
# each wait of the student's comm: longer than the run's deadline, so that a hang is stopped by
# the cluster, which then says where every rank waited
STUDENT_TIMEOUT = 2 * RUN_TIMEOUT
KINDS = {
    "hang": "a call that never returns on some ranks: a collective only some ranks reach, or "
            "a deadlocking order of sends and receives",
    "mismatch": "ranks call collectives that do not pair up (another shape, order or op)",
    "divergence": "the ranks' copies of the model stop being equal",
    "sharding": "the ranks do not read each its own part of the batch",
    "scaling": "every rank agrees, but each update is a multiple of one process's",
}
# which tool shows each job's bug: the hint for a wrong diagnosis (what to run, not what to fix)
TOOLS = {
    1: "run the broken job and read the error every rank raised: which collective, which "
       "shapes, which ranks (the course's agreement check)",
    2: "run the broken job with a deadline and read where every rank waited in the "
       "ClusterTimeout (course_lib.runtime.stacks)",
    3: "run the broken job and give the runs to clinic.first_divergence: at which step and "
       "tensor do the ranks' checksums first differ?",
    4: "run the broken job and give the runs to clinic.coverage: who read which samples?",
    5: "run the broken job and compare a rank with clinic.one_process "
       "(clinic.against_one_process): how large is its first update?",
}
ANSWERS = {1: "mismatch", 2: "hang", 3: "divergence", 4: "sharding", 5: "scaling"}


def run_student_job(payload: bytes, steps: int = STEPS,
                    timeout: float = STUDENT_TIMEOUT) -> dict:
    """On every rank: the student's step (cloudpickled) run by ``clinic.run``, or
    ``{"rank", "error"}`` when it raised (``{"not_implemented": True}`` for the template's)."""
    import cloudpickle
    import torch.distributed as dist
    fn = cloudpickle.loads(payload)
    try:
        return clinic.run(fn, steps=steps, timeout=timeout)
    except NotImplementedError:
        return {"not_implemented": True}
    except Exception as e:  # the student's error, to name in the check's message
        return {"rank": dist.get_rank(), "error": f"{type(e).__name__}: {e}".splitlines()[0]}


def diagnose(runs: list[dict], reference: dict) -> str | None:
    """What is still wrong with a finished run, as the tools see it; None when right."""
    found = _problem(runs, reference)
    return None if found is None else found[1]


def _problem(runs: list[dict], reference: dict) -> tuple[str, str, str] | None:
    """(kind, what the tools show, a hint for a fix that shows it), or None when right. The
    kinds are those of :data:`KINDS`, "error" (another exception) and "loss" (the model is
    right, the loss the step returned is not)."""
    errors = [r for r in runs if "error" in r]
    if errors:
        listed = "; ".join(f"rank {r['rank']}: {r['error'][:160]}" for r in errors[:4])
        told = f"your step raised on rank(s) {[r['rank'] for r in errors]}: {listed}"
        if any(re.search(MISMATCH, r["error"]) for r in errors):
            return ("mismatch", told, "the ranks still call a collective whose shape, dtype or "
                    "operation differs between them: the error names each rank's.")
        return ("error", told, "read the error: it comes from your fixed step, on the ranks "
                "named.")
    split = clinic.first_divergence(runs)
    if split is not None:
        return ("divergence",
                f"the ranks' parameters differ from step {split['step']} on, first in tensor "
                f"{split['tensor']} (ranks grouped by checksum: {split['groups']})",
                f"the ranks' copies of {split['tensor']} part at step {split['step']}: what "
                f"updates it is not the same on every rank.")
    cover = clinic.coverage(runs)
    if cover["overlap"] or cover["unread"]:
        pairs = ", ".join(f"ranks {a} and {b}: {n}" for (a, b), n in cover["overlap"].items())
        return ("sharding",
                f"over {len(runs[0]['losses'])} steps, samples read twice ({pairs or 'none'}) "
                f"and {cover['unread']} samples of the batches read by no rank",
                "each rank must read its own part of each batch: every sample once, by one "
                "rank.")
    compare = clinic.against_one_process(runs[0], reference)
    worst = max(compare["max_difference"])
    if worst > 1e-9:
        step = next(i for i, d in enumerate(compare["max_difference"]) if d > 1e-9)
        return ("scaling",
                f"every rank agrees, but differs from one process on the whole batch by up to "
                f"{worst:.2e} (from step {step}); the first update is "
                f"{compare['first_update_ratio']:.3g} x one process's",
                _scaling_hint(runs[0], reference, len(runs)))
    return _loss_problem(runs, reference)


# the course's agreement check, and Gloo's own words for collectives that do not pair up
MISMATCH = r"differ across ranks|do not agree|mismatch|size mismatch"


def _times(k: float, world_size: int, per_rank: int, what: str) -> str:
    """``k x what``, with what a known ratio is: "4 x one process's (4: the number of ranks)"."""
    known = {world_size: f"{world_size}: the number of ranks",
             1 / world_size: f"1/{world_size}: one over the number of ranks",
             per_rank: f"{per_rank}: the samples each rank reads",
             1 / per_rank: f"1/{per_rank}: one over the samples each rank reads",
             world_size * per_rank: f"{world_size * per_rank}: the samples of the batch"}
    for value, said in known.items():
        if abs(k - value) < 1e-6 * max(value, 1):
            return f"{said.split(':')[0]} x {what} ({said})"
    return f"{k:.3g} x {what}"


def _scaling_hint(run: dict, reference: dict, world_size: int) -> str:
    """Which tensors' first update is off, and by what factor."""
    sizes = [(name, p.numel()) for name, p in clinic.make_model(0).named_parameters()]
    mine = run["params"][1] - run["params"][0]
    ref = reference["params"][1] - reference["params"][0]
    per_rank = len(run["samples"][0])
    ratios, at = {}, 0
    for name, n in sizes:
        ratios[name] = float(np.linalg.norm(mine[at:at + n]) / np.linalg.norm(ref[at:at + n]))
        at += n
    off = {name: k for name, k in ratios.items() if abs(k - 1) > 1e-6}
    if not off:
        return ("the first update is right, the later ones are not: something in your step "
                "changes from one step to the next.")
    if all(k < 1e-12 for k in ratios.values()):
        return ("the parameters did not move in the first step: no gradient reached the "
                "update.")
    if len(off) < len(ratios):
        name, k = next(iter(off.items()))
        said = _times(k, world_size, per_rank, "one process's")
        return (f"the first update of {name} is {said}, and those of "
                f"{sorted(set(ratios) - set(off))} are right: {sorted(off)} went another way "
                f"through your step.")
    low, high = min(off.values()), max(off.values())
    if high - low > 1e-6 * high:
        return (f"the first updates are {low:.3g} to {high:.3g} x one process's, a different "
                f"multiple for every tensor: not a factor on the gradient, something else "
                f"changed the parameters too.")
    said = _times(high, world_size, per_rank, "one process's")
    return (f"every tensor's first update is {said}: the gradient each rank applies is that "
            f"many times the batch's mean gradient.")


@functools.lru_cache(maxsize=1)
def _digits():
    """The training digits as tensors, as ``clinic.run`` reads them (loaded once)."""
    X, y, _, _ = data.load_digits()
    return torch.from_numpy(X), torch.from_numpy(y)


@functools.lru_cache(maxsize=1)
def _one_process():
    """``clinic.one_process`` for the check's steps (deterministic: computed once)."""
    return clinic.one_process(steps=STEPS)


def _loss_problem(runs: list[dict], reference: dict) -> tuple[str, str, str] | None:
    """The loss each rank returned: the mean over the samples it read, or over the batch."""
    X, y = _digits()
    model = clinic.make_model(0)
    for run in runs:
        for step, (loss, samples) in enumerate(zip(run["losses"], run["samples"], strict=True)):
            try:
                got = float(loss)
            except (TypeError, ValueError):
                return ("loss", f"rank {run['rank']} returned {loss!r:.60} as the loss of step "
                        f"{step}", "return the loss as a number (loss.item()).")
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(torch.from_numpy(run["params"][step]),
                                                    model.parameters())
                own = F.cross_entropy(model(X[samples]), y[samples]).item()
            whole = reference["losses"][step]
            if any(abs(got - want) <= 1e-7 * abs(want) for want in (own, whole)):
                continue
            said = _times(got / whole, len(runs), len(samples), "the mean loss of the batch")
            if " (" not in said:
                said = _times(got / own, len(runs), len(samples), "the mean loss of the rank's "
                              "samples")
            return ("loss",
                    f"the model trains as one process does, but rank {run['rank']} returned "
                    f"the loss {got:.6g} at step {step}: the mean loss of the samples it read "
                    f"is {own:.6g}, of the whole batch {whole:.6g}",
                    f"the loss your step returns is {said}. It must be a mean loss: of the "
                    f"rank's samples, or of the whole batch.")
    return None


def run_job(step_fn: Callable, cluster, steps: int = STEPS, deadline: float = RUN_TIMEOUT
            ) -> list[dict] | None:
    """Run a (broken) job on ``cluster``: each rank's runs (for the tools of notebook 17), or
    None after printing how it failed (its error, or where each rank waited), never raising.
    A call past ``deadline`` is stopped before any wait of its comm gives up (twice as long),
    so a hang shows where every rank waits."""
    from course_lib.runtime.cluster import ClusterError
    try:
        runs = cluster.run(run_student_job, pack_function(step_fn), steps, 2 * deadline,
                           timeout=deadline)
    except ClusterError as e:
        print(f"{type(e).__name__}: {e}")
        return None
    errors = [r for r in runs if "error" in r]
    for r in errors:
        print(f"rank {r['rank']} raised {r['error']}")
    if errors:
        return None
    losses = runs[0]["losses"]
    print(f"the job finished: {steps} steps on {len(runs)} ranks, rank 0's loss "
          f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    return runs


def check_job(number: int, kind: str | Callable[[], str], fixed_step: Callable,
              cluster) -> bool:
    """Job ``number`` (1-5): ``kind`` (or ``kind()``), the diagnosis, must be the job's;
    ``fixed_step`` must train as one process does, on every rank of ``cluster``, within the
    deadlines. Prints ✓ and returns True; raises CheckFailed with a hint otherwise (False while
    a template raises NotImplementedError)."""
    __tracebackhide__ = True
    from course_lib.runtime.cluster import ClusterTimeout
    name = f"check_job({number})"
    if number not in ANSWERS:
        raise ValueError(f"number must be one of {sorted(ANSWERS)}, not {number!r}")
    if callable(kind):
        try:
            kind = kind()
        except NotImplementedError:
            return not_implemented(name)
    if kind not in KINDS:
        listed = "\n".join(f"  {k!r}: {v}" for k, v in KINDS.items())
        raise CheckFailed(f"{name}: the diagnosis must be one of\n{listed}\nnot {kind!r}")
    if kind != ANSWERS[number]:
        raise CheckFailed(f"{name}: {kind!r} is not what job {number} shows.\nHint: "
                          f"{TOOLS[number]}")
    try:
        runs = cluster.run(run_student_job, pack_function(fixed_step), STEPS, STUDENT_TIMEOUT,
                           timeout=RUN_TIMEOUT)
    except ClusterTimeout as e:
        where = str(e).split("Where they were (course_lib.runtime.stacks):\n")[-1]
        raise CheckFailed(f"{name}: your fixed job did not finish within {RUN_TIMEOUT:g}s. "
                          f"Where each rank waited:\n{where}\nHint: every collective and every "
                          "send must be met by its partners; read what each rank waits for."
                          ) from None
    if any(r.get("not_implemented") for r in runs):
        return not_implemented(name)
    found = _problem(runs, _one_process())
    if found:
        found_kind, problem, hint = found
        if found_kind == ANSWERS[number]:  # the job's kind of bug, still (or again) there
            hint = (f"still a bug of job {number}'s kind ({found_kind}): {hint} (To see it: "
                    f"{TOOLS[number]}.)")
        else:
            hint = f"your fix has a bug of another kind ({found_kind}): {hint}"
        raise CheckFailed(f"{name}: {problem}\nHint: {hint}")
    print(f"✓ {name}: diagnosed as {kind!r}; fixed: {len(runs)} ranks train as one process "
          f"for {STEPS} steps")
    return True


# ---------------------------------------------------------------- exercise 6: the flight records
def _entry(op: str = "all_reduce", n: int = 2410, seq: int = 1) -> dict:
    return {"seq": seq, "op": op, "sizes": [[n]], "dtypes": ["Double"]}


def _planted_records() -> list[tuple[str, list[list[dict]]]]:
    """Flight records with one known parting each (and one without), numbered from 41 as after
    earlier jobs."""
    def ranks(n, length=4, seq=41):
        return [[_entry(seq=seq + i) for i in range(length)] for _ in range(n)]
    skipped = ranks(4)
    skipped[1] = skipped[1][:3]  # rank 1 skipped one: three where the others issued four
    sizes = ranks(4)
    sizes[2][1] = _entry(n=2048, seq=42)  # rank 2 reduced the weight alone at #2
    ops = ranks(4)
    ops[3][2] = _entry(op="broadcast", seq=43)  # rank 3 broadcast where the others reduced
    two = ranks(5)
    for r in (1, 4):
        two[r] = two[r][:2]  # ranks 1 and 4 of 5 stopped after two
    return [("rank 1 issued one collective fewer", skipped),
            ("rank 2 issued another size at #2", sizes),
            ("rank 3 issued another operation at #3", ops),
            ("ranks 1 and 4 of 5 stopped after two collectives", two),
            ("every rank issued the same four", ranks(3))]


def check_parting(student_fn: Callable, records: list[list[dict]]) -> bool:
    """Lab 17, exercise 6: ``parting(records)`` returns ``{"collective": k, "ranks": [...]}``,
    the first collective (numbered from 1 in the records) at which the ranks' flight records
    part and the ranks against the majority, or None when all agree, as ``clinic.parting``;
    on the job's own ``records`` and on planted ones, a wrong answer named."""
    __tracebackhide__ = True
    name = "check_parting"
    cases = [("the job's own records", records), *_planted_records()]
    for number, (label, case) in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({label})"
        try:
            got = student_fn([list(r) for r in case])
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              "Hint: the records may have different lengths.") from err
        found = clinic.parting(case)
        want = None if found is None else {k: found[k] for k in ("collective", "ranks")}
        if got == want:
            continue
        raise CheckFailed(f"{where}\n  you returned {got!r}, expected {want!r}\nHint: "
                          f"{_parting_hint(got, want, case)}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} sets of flight records read as "
          f"clinic.parting reads them")
    return True


def _parting_hint(got, want, records) -> str:
    lengths = sorted({len(r) for r in records})
    if want is None:
        return "every rank issued the same collectives: return None."
    if got is None or isinstance(got, dict) and got.get("collective", 0) > want["collective"]:
        if len(lengths) > 1 and want["collective"] > lengths[0]:
            return (f"the records hold {lengths} entries: zip() stops at the shortest, and a "
                    "rank that issued fewer (or more) collectives goes unseen.")
        return "compare each collective's operation and its sizes, not one of them alone."
    if not (isinstance(got, dict) and {"collective", "ranks"} <= set(got)):
        return 'return {"collective": k, "ranks": [...]}, or None when the records agree.'
    if got["collective"] == want["collective"] - 1:
        return ("you count from 0: number the collectives from 1, as the flight recorder "
                "does.")
    if got["collective"] != want["collective"]:
        return "the first collective at which any rank differs: not a later one."
    if set(got["ranks"]) == set(range(len(records))) - set(want["ranks"]):
        return ("you named the ranks that agree: name those against the majority (the ranks "
                "that parted).")
    return "name every rank whose entry (or its absence) differs from the majority's."
