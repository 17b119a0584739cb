"""Lab 10 checks: a ZeRO-1 step from the student's own ring, against data parallelism (DDP).

Introduced in labs/10_sharded_data_parallelism.ipynb, on the framework of
:mod:`course_lib.checks`::

    from course_lib.checks import lab10_sharded_data_parallelism as checks
    cluster = start_cluster(n=4, backend="gloo")
    checks.check_ring_collectives(ring_reduce_scatter, ring_allgather, cluster)   # lab 05's
    checks.check_zero1_step(zero1_step, ring_reduce_scatter, ring_allgather, cluster)
    checks.check_zero_memory_per_rank(zero_memory_per_rank)                       # no cluster

``check_zero1_step`` runs the student's step on the first N ranks of the cluster (N = 2, 3, 4,
``comm.subgroups``) on parameter vectors whose length N does not divide (and one shorter than
N), for several steps with a different local gradient on every rank, and compares every rank's
parameters after every step with DDP's (the mean gradient, then the same momentum update on the
whole vector, computed in one process) to 1e-12. The reduce-scatter and all-gather it hands the
step are the student's own, wrapped so that the check sees which tensor each call got and what
the parameters held just before the all-gather: a wrong answer comes back as what the code did
(the sum instead of the mean, another rank's chunk, no all-gather, a momentum of DDP's size...).
"""

from __future__ import annotations

import re

import numpy as np

from course_lib.checks import lab05_allreduce
from course_lib.checks.framework import Case, CheckFailed, not_implemented, pack_function, run_check
from course_lib.sharding import shard_bounds

STUDENT_TIMEOUT = 5.0  # seconds each wait of the student's ring may take: a deadlock is a hint
ZERO1_CASES = [(2, 7), (3, 10), (4, 66), (4, 3)]  # (world size, parameters): ragged; n < N
STEPS = 3
LR, MOMENTUM = 0.1, 0.9
TOLERANCE = 1e-12
COMPARE = ("compare your step with DDP's, piece by piece: which chunk each rank updates, with "
           "which gradient (the mean over the ranks), which momentum, and what it all-gathers "
           "after the update.")


# ---------------------------------------------------------------- exercise 1: the ring, again
def check_ring_collectives(reduce_scatter, all_gather, cluster) -> bool:
    """Lab 10, exercise 1: the ring reduce-scatter and all-gather of lab 05, by lab 05's checks
    (``check_ring_reduce_scatter``, ``check_ring_allgather``) on every rank of ``cluster``.
    Returns True when both pass, False while either is not implemented.
    Introduced in labs/10_sharded_data_parallelism.ipynb."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    ok_reduce_scatter = lab05_allreduce.check_ring_reduce_scatter(reduce_scatter, cluster)
    ok_all_gather = lab05_allreduce.check_ring_allgather(all_gather, cluster)
    return bool(ok_reduce_scatter and ok_all_gather)


# ---------------------------------------------------------------- exercise 2: the ZeRO-1 step
def case_params(n, seed=0):
    """The parameters before the first step: the same on every rank and on the client.
    Introduced in labs/10_sharded_data_parallelism.ipynb."""
    return np.random.default_rng([seed, n]).normal(size=n)


def case_grads(n, world_size, step, seed=0):
    """Every rank's local gradient at ``step`` (a different one on each rank).
    Introduced in labs/10_sharded_data_parallelism.ipynb."""
    return [np.random.default_rng([seed, n, world_size, step, q]).normal(size=n)
            for q in range(world_size)]


def ddp_reference(n, world_size, steps=STEPS, lr=LR, momentum=MOMENTUM, seed=0):
    """Data parallelism's steps, in one process: the mean of the ranks' gradients (what the
    allreduce divided by N gives every rank), then SGD with momentum on the whole vector
    (torch's rule: m = momentum * m + g, params -= lr * m). One dict per step: params and
    momentum before and after, and the ranks' gradients.
    Introduced in labs/10_sharded_data_parallelism.ipynb."""
    params, m, out = case_params(n, seed), np.zeros(n), []
    for k in range(steps):
        grads = case_grads(n, world_size, k, seed)
        new_m = momentum * m + np.sum(grads, axis=0) / world_size
        new_params = params - lr * new_m
        out.append({"before": params, "m_before": m, "grads": grads, "after": new_params,
                    "m_after": new_m})
        params, m = new_params, new_m
    return out


def zero1_on_rank(payload, n, world_size, steps=STEPS, lr=LR, momentum=MOMENTUM, seed=0,
                  timeout=STUDENT_TIMEOUT):
    """On every rank: ``steps`` of the student's ZeRO-1 step (cloudpickled with their
    reduce-scatter and all-gather) on the first ``world_size`` ranks; None on the others.

    Returns one report per step: the parameters after it, whether the caller's grads changed,
    what the step returned, and every collective it called (which tensor: params, grads or a
    copy; for an all-gather, the tensor's values just before it); a step that raised ends the
    list with ``{"error": ...}``, so that the steps before it are still checked.
    Introduced in labs/10_sharded_data_parallelism.ipynb."""
    import cloudpickle
    import torch

    from course_lib.comm.subgroups import subgroup_comm
    comm = subgroup_comm(world_size, timeout)
    if comm is None:
        return None
    step_fn, reduce_scatter, all_gather = (cloudpickle.loads(p) for p in payload)
    params = torch.from_numpy(case_params(n, seed))
    momentum_shard, reports = None, []
    for k in range(steps):
        local = case_grads(n, comm.world_size, k, seed)[comm.rank]
        grads = torch.from_numpy(local.copy())
        calls = []

        def which(buf, params=params, grads=grads):
            if not torch.is_tensor(buf):
                return f"a {type(buf).__name__}"
            for name, t in (("params", params), ("grads", grads)):
                if buf.data_ptr() == t.data_ptr() and buf.numel() == t.numel():
                    return name
            for name, t in (("params", params), ("grads", grads)):
                if buf.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                    return f"a slice of {name}"
            return "a copy"

        def spy_reduce_scatter(buf, comm, calls=calls, which=which):
            calls.append({"op": "reduce_scatter", "buf": which(buf)})
            return reduce_scatter(buf, comm)

        def spy_all_gather(buf, comm, calls=calls, which=which):
            before = buf.detach().clone().numpy() if torch.is_tensor(buf) else None
            calls.append({"op": "all_gather", "buf": which(buf), "before": before})
            return all_gather(buf, comm)

        try:
            out = step_fn(params, grads, momentum_shard, comm, lr, momentum,
                          spy_reduce_scatter, spy_all_gather)
        except Exception as err:  # reported after the steps before it are checked
            reports.append({"error": {**_error_report(err), "calls": [
                {"op": c["op"], "buf": c["buf"]} for c in calls]}})
            break
        returned = {"kind": "None" if out is None else type(out).__name__,
                    "shape": tuple(out.shape) if hasattr(out, "shape") else None,
                    "which": which(out) if torch.is_tensor(out) else None}
        reports.append({"params": params.detach().numpy().copy(), "returned": returned,
                        "grads_changed": not np.array_equal(grads.numpy(), local),
                        "calls": calls})
        momentum_shard = out
    return reports


def _error_report(err):
    """An exception raised on a rank, as text: its first line is "Type: message", then its
    frames in the form ``cluster.RemoteError`` gives them ("File path:line, in name"), so that
    a notebook shows the student's own lines (``framework._remote_own_frames``)."""
    import traceback
    frames = traceback.extract_tb(err.__traceback__)[1:]  # from the student's step inward
    lines = [f"{type(err).__name__}: {err}"]
    for f in frames:
        lines += [f"File {f.filename}:{f.lineno}, in {f.name}", f"    {(f.line or '').strip()}"]
    return {"type": type(err).__name__, "text": "\n".join(lines),
            "innermost": frames[-1].name if frames else ""}


def _ranges(indices):
    """[0, 1, 2, 5] -> '[0:3] and [5:6]'."""
    indices, spans = sorted(indices), []
    for i in indices:
        if spans and spans[-1][1] == i:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    return " and ".join(f"[{a}:{b}]" for a, b in spans)


def _close(got, want):
    return got.shape == want.shape and (got.size == 0 or
                                        float(np.max(np.abs(got - want))) <= TOLERANCE)


def _value_hint(rank, N, n, k, ref, got, chunks):
    """What the values of ``chunks`` (each from its owner) say: the sum instead of the mean, a
    local gradient, no momentum; None when nothing fits."""
    r = ref[k]
    p0, m_prev, grads = r["before"], r["m_before"], r["grads"]
    total = np.sum(grads, axis=0)
    owner = {c: (a, b) for c in chunks for a, b in [shard_bounds(n, c, N)] if b > a}

    def fits(make):  # make(c, a, b): the values chunk c would hold
        return bool(owner) and all(_close(got[a:b], make(c, a, b))
                                   for c, (a, b) in owner.items())
    if fits(lambda c, a, b: p0[a:b] - N * LR * r["m_after"][a:b]):
        return (f"rank {rank}'s update is N = {N} times DDP's: the reduce-scatter leaves the "
                f"SUM of the {N} ranks' gradients in your chunk, while DDP steps with their "
                f"mean.")
    for scale, words in ((1, ""), (1 / N, " (divided by N)")):
        if fits(lambda c, a, b, s=scale: p0[a:b] - LR * (MOMENTUM * m_prev[a:b]
                                                         + s * grads[c][a:b])):
            return (f"rank {rank}'s chunk was updated with its own local gradient{words}, not "
                    f"with the sum over the ranks that the reduce-scatter left on rank {rank}.")
    if fits(lambda c, a, b: p0[a:b] - LR * (MOMENTUM * m_prev[a:b]
                                            + (1 - MOMENTUM) * total[a:b] / N)):
        return ("your momentum is dampened (the gradient weighted by 1 - momentum): torch's "
                "SGD, and DDP's step here, add the whole mean gradient to momentum x the "
                "previous momentum.")
    if k > 0 and fits(lambda c, a, b: p0[a:b] - LR * total[a:b] / N):
        return (f"step 1 was right, but step {k + 1} is plain SGD with the mean gradient, "
                f"without the momentum of the steps before: the momentum shard must carry "
                f"over from one step to the next (the caller passes back what the step "
                f"returns).")
    return None


def _params_hint(rank, N, n, k, ref, report):
    """Why rank ``rank``'s parameters after step ``k`` differ from DDP's, from what it did."""
    a, b = shard_bounds(n, rank, N)
    got, want = report["params"], ref[k]["after"]
    own_right = _close(got[a:b], want[a:b])
    gathers = [c for c in report["calls"] if c["op"] == "all_gather"]
    on_params = [c for c in gathers if c["buf"] == "params"]
    unchanged = (f"rank {rank}'s params did not change: the caller sees only what happens to "
                 f"the tensor it passed in (params = params - ..., or a copy of params, is a "
                 f"new tensor, which the caller never sees).")
    scattered = [c["buf"] for c in report["calls"] if c["op"] == "reduce_scatter"]
    if "params" in scattered:
        return ("your step reduce-scattered params: what the ranks must sum is their "
                "gradients (a copy of grads); the parameters are the same on every rank.")
    if not on_params:
        did = ("your step never called all_gather" if not gathers else
               f"your step all-gathered {gathers[0]['buf']}, not params")
        if gathers and gathers[0]["buf"] == "a slice of params":
            return (f"your step all-gathered a slice of params, not params: the all-gather "
                    f"fills every chunk of the tensor it is given, so it takes the whole "
                    f"vector, in which rank {rank}'s chunk is params[{a}:{b}].")
        if b > a and _close(got, ref[k]["before"]):
            return unchanged
        if own_right:
            return (f"only rank {rank}'s own chunk params[{a}:{b}] is right ({did}). Each rank "
                    f"updates its own chunk only: the other chunks' new values are on their "
                    f"owners, and nothing brought them to rank {rank}.")
        specific = _value_hint(rank, N, n, k, ref, got, [rank])
        return f"{did}; and {specific or 'even the own chunk is wrong. ' + COMPARE}"
    before = on_params[0]["before"]
    changed = set(np.flatnonzero(before != ref[k]["before"]).tolist())
    own = set(range(a, b))
    if own - changed:
        if not changed and own_right:
            return (f"your step all-gathered params before updating them: the all-gather sent "
                    f"every rank the old values, and the update that came after it stays on "
                    f"rank {rank} alone (only its own chunk params[{a}:{b}] is right). The "
                    f"all-gather is what carries each owner's update to the others.")
        if not changed:
            return unchanged
        whose = [q for q in range(N) if set(range(*shard_bounds(n, q, N))) == changed]
        named = f" (rank {whose[0]}'s chunk)" if whose else ""
        return (f"before its all-gather rank {rank} had changed params{_ranges(changed)}"
                f"{named}, but its chunk is params[{a}:{b}] = shard_bounds({n}, {rank}, {N}): "
                f"the chunk whose sum the reduce-scatter left on rank {rank} (its return value). "
                f"The all-gather then hands every rank each owner's own chunk, so only what the "
                f"owners changed inside their own chunks survives.")
    return _value_hint(rank, N, n, k, ref, got, range(N)) or COMPARE


def _chunks_hint(N, n, k, ref, reports):
    """The first rank that, before its all-gather of params, had changed something else than
    its own chunk ``shard_bounds(n, rank, N)``, in words; None when every rank kept to its own."""
    for rank, steps in enumerate(reports):
        gathers = [c for c in steps[k].get("calls", [])
                   if c["op"] == "all_gather" and c["buf"] == "params"]
        if not gathers:
            continue
        a, b = shard_bounds(n, rank, N)
        changed = set(np.flatnonzero(gathers[0]["before"] != ref[k]["before"]).tolist())
        if changed and changed != set(range(a, b)):
            return (f"before its all-gather rank {rank} had changed params{_ranges(changed)}, "
                    f"but its chunk is params[{a}:{b}] = shard_bounds({n}, {rank}, {N}): the "
                    f"chunk whose sum the reduce-scatter left on it, and the one the all-gather "
                    f"takes from it. A vector that N does not divide is cut unevenly, and every "
                    f"cut must be shard_bounds'.")
    return None


def _momentum_hint(rank, N, n, returned):
    """What is wrong with the momentum shard a step returned, or None."""
    a, b = shard_bounds(n, rank, N)
    if returned["which"] in ("params", "grads"):
        return (f"your zero1_step returned {returned['which']}: return the momentum shard "
                f"instead; the caller keeps it and passes it back at the next step.")
    if returned["shape"] is None:
        return (f"your zero1_step returned {returned['kind']}: return the momentum shard (a "
                f"tensor of this rank's stop - start = {b - a} numbers); the caller keeps it "
                f"and passes it back at the next step.")
    if returned["shape"] == (b - a,):
        return None
    if returned["shape"] == (n,):
        return (f"rank {rank} keeps a momentum of {n} numbers, one per parameter: that is "
                f"DDP's memory, every rank holding the whole optimizer state. ZeRO-1 keeps on "
                f"rank {rank} the momentum of its chunk only, shard_bounds({n}, {rank}, {N}) = "
                f"({a}, {b}): {b - a} numbers, 1/N of it.")
    return (f"rank {rank}'s momentum shard has shape {returned['shape']}; its chunk "
            f"shard_bounds({n}, {rank}, {N}) = ({a}, {b}) has {b - a} parameters, and its "
            f"momentum shard one number per parameter of the chunk.")


def _calls_hint(rank, calls):
    """ZeRO-1 calls one reduce-scatter (of the gradient) and one all-gather (of the
    parameters) per step; the hint when it did something else, or None."""
    count = {op: [c["buf"] for c in calls if c["op"] == op]
             for op in ("reduce_scatter", "all_gather")}
    if len(count["reduce_scatter"]) == 1 and len(count["all_gather"]) == 1:
        return None
    extra = ""
    if any(buf != "params" for buf in count["all_gather"]):
        extra = (" You also all-gathered the gradient: a reduce-scatter plus an all-gather is "
                 "DDP's allreduce, and rank r needs only its own chunk of the sum.")
    return (f"the values are right, but rank {rank}'s step made "
            f"{len(count['reduce_scatter'])} reduce-scatter(s) {count['reduce_scatter']} and "
            f"{len(count['all_gather'])} all-gather(s) {count['all_gather']}.{extra} ZeRO-1 "
            f"makes one of each per step, the bytes of DDP's one allreduce: reduce-scatter (a "
            f"copy of) the gradient, all-gather the parameters.")


def _cluster_failure(where, err):
    """A failure of the run itself (not of a step: those come back in the reports)."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import ClusterTimeout, RemoteError
    if isinstance(err, RemoteError):
        first = min(err.errors)
        hint = ("your functions run on the engines: define or import everything they use "
                "inside the notebook cells, and do not use the cluster object in them.")
        raise CheckFailed(f"{where}\n  rank {first}: {err.errors[first].splitlines()[0]}\n"
                          f"Hint: {hint}") from err
    hint = ("your step did not return: an endless loop, or a wait without a deadline?"
            if isinstance(err, ClusterTimeout) else
            "an engine died while running your step; the next call restarts it.")
    raise CheckFailed(f"{where}\n  {type(err).__name__}: {err}\nHint: {hint}") from None


def _step_failure(name, where, errors, fns, n, N):
    """Some ranks raised in a step (``errors``: rank -> ``_error_report``): False for a
    NotImplementedError (naming exercise 1 if it came from the ring), else a CheckFailed that
    shows the exception of the first rank that raised one of its own."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import RemoteError
    unfinished = [e for e in errors.values() if e["type"] == "NotImplementedError"]
    if unfinished:
        ring = {getattr(fns[1], "__name__", None), getattr(fns[2], "__name__", None)}
        innermost = unfinished[0]["innermost"]
        if innermost in ring - {getattr(fns[0], "__name__", None)}:
            print(f"… {name}: your {innermost} (exercise 1) is not implemented yet — finish "
                  f"exercise 1 (or import the library's ring), then run this check again.")
            return False
        return not_implemented(name)
    own = {r: e for r, e in errors.items() if e["type"] != "CommTimeout"} or errors
    first = min(own)
    last = own[first]["text"].splitlines()[0]
    waited = sorted(set(errors) - set(own))
    waited = f" (rank(s) {waited} then waited for it past their deadline)" if waited else ""
    hint = "see where it raised (in a notebook: under 'Your code', below)."
    sliced = next((c for e in errors.values() for c in e.get("calls", [])
                   if c["buf"].startswith("a slice of")), None)
    if sliced:
        hint = (f"your step called {sliced['op']} on {sliced['buf']}: the ring cuts the tensor "
                f"it is given into N chunks, so every rank must hand it the whole vector (a "
                f"slice is cut into other chunks, and the messages no longer fit).")
    elif own[first]["type"] == "CommTimeout":
        hint = ("the ranks waited for each other past their deadline: do all ranks call the "
                "same collectives, on tensors of the same length, in the same order?")
    elif "size of tensor" in last or "shape" in last:
        a, b = shard_bounds(n, first, N)
        sizes = {int(x) for x in re.findall(r"size of tensor \w \((\d+)\)", last)}
        hint = ("two tensors of different lengths met: params and grads have len(params) "
                "numbers; the chunk, the gradient's chunk and the momentum shard stop - start.")
        if sizes == {n, b - a}:
            hint = (f"a tensor of len(params) = {n} numbers met one of rank {first}'s chunk, "
                    f"shard_bounds({n}, {first}, {N}) = ({a}, {b}): {b - a} numbers. A momentum "
                    f"of {n} numbers would be DDP's memory: in ZeRO-1 the momentum shard, the "
                    f"gradient's chunk and params[start:stop] all have stop - start numbers.")
    cause = RemoteError(f"zero1_step raised on rank(s) {sorted(errors)}",
                        {r: e["text"] for r, e in errors.items()})
    raise CheckFailed(f"{where}\n  your zero1_step raised on rank {first}{waited}: {last}\n"
                      f"Hint: {hint}") from cause


def _payload(name, fns):
    """The student's functions, packed for the engines; CheckFailed if they cannot be."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    try:
        return tuple(pack_function(fn) for fn in fns)
    except Exception as e:
        raise CheckFailed(f"{name}: your functions cannot be sent to the engines ({e}).\nHint: "
                          "do not refer to the cluster or open files inside them.") from None


def check_zero1_step(zero1_step, reduce_scatter, all_gather, cluster, seed=0,
                     timeout=STUDENT_TIMEOUT) -> bool:
    """Lab 10, exercise 2: ``zero1_step(params, grads, momentum_shard, comm, lr, momentum,
    reduce_scatter, all_gather) -> momentum_shard`` on the first N = 2, 3, 4 ranks of
    ``cluster`` (those it has), ``STEPS`` steps each, every rank's parameters compared after
    every step with DDP's to 1e-12; then the momentum shard's length, the caller's grads, and
    one reduce-scatter and one all-gather per step. Prints a pass line and returns True,
    returns False while a function raises NotImplementedError, raises CheckFailed with what the
    code did otherwise. Introduced in labs/10_sharded_data_parallelism.ipynb."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_zero1_step"
    fns = (zero1_step, reduce_scatter, all_gather)
    payload = _payload(name, fns)
    cases = [(N, n) for N, n in ZERO1_CASES if N <= cluster.n]
    for number, (N, n) in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({n} parameters on {N} ranks)"
        try:
            reports = cluster.run(zero1_on_rank, payload, n, N, STEPS, LR, MOMENTUM, seed,
                                  timeout, timeout=STEPS * timeout + 30)[:N]
        except Exception as err:  # RemoteError, ClusterTimeout, EngineDied
            _cluster_failure(where, err)
        ref = ddp_reference(n, N, STEPS, LR, MOMENTUM, seed)
        for k in range(STEPS):
            at = f"{where}, after step {k + 1}"
            errors = {rank: steps[k]["error"] for rank, steps in enumerate(reports)
                      if "error" in steps[k]}
            if errors:
                return _step_failure(name, f"{where}, in step {k + 1}", errors, fns, n, N)
            for rank, steps in enumerate(reports):
                got, want = steps[k]["params"], ref[k]["after"]
                if not _close(got, want):
                    worst = int(np.argmax(np.abs(got - want)))
                    hint = _params_hint(rank, N, n, k, ref, steps[k])
                    if COMPARE in hint:  # no mistake of its own: look at every rank's chunk
                        hint = _chunks_hint(N, n, k, ref, reports) or hint
                    raise CheckFailed(
                        f"{at}\n  rank {rank}: params differ from DDP's (largest difference "
                        f"at index {worst}: expected {want[worst]:.6g}, got {got[worst]:.6g})\n"
                        f"Hint: {hint}")
            for rank, steps in enumerate(reports):
                hint = _momentum_hint(rank, N, n, steps[k]["returned"])
                if hint:
                    raise CheckFailed(f"{at}\n  rank {rank}: the params are right, the returned "
                                      f"momentum shard is not\nHint: {hint}")
            for rank, steps in enumerate(reports):
                if steps[k]["grads_changed"]:
                    raise CheckFailed(
                        f"{at}\n  rank {rank}: your step changed the caller's grads\nHint: "
                        f"reduce-scatter a copy (g = grads.clone()). grads is this rank's local "
                        f"gradient, which the caller may still need (to clip or log it, to add "
                        f"the next micro-batch's to it); after the ring it would hold partial "
                        f"sums in every chunk but rank {rank}'s.")
            for rank, steps in enumerate(reports):
                hint = _calls_hint(rank, steps[k]["calls"])
                if hint:
                    raise CheckFailed(f"{at}\nHint: {hint}")
    sizes = sorted({N for N, _ in cases})
    ranks = ", ".join(map(str, sizes[:-1])) + (" and " if len(sizes) > 1 else "") + str(sizes[-1])
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases ({STEPS} steps each, on {ranks} ranks) "
          f"match DDP to {TOLERANCE:g} on every rank")
    return True


# ---------------------------------------------------------------- exercise 3: the accounting
def formula(stage, b=2):
    """The bytes per rank of ``stage`` in words, with b = bytes_per_number (the paper's 2) and
    K = optimizer_bytes. Introduced in labs/10_sharded_data_parallelism.ipynb."""
    return {0: f"(2·{b} + K)Ψ, nothing sharded", 1: f"{2 * b}Ψ + KΨ/N, the optimizer state sharded",
            2: f"{b}Ψ + ({b} + K)Ψ/N, the gradients and the optimizer state sharded",
            3: f"(2·{b} + K)Ψ/N, everything sharded"}[stage]


def zero_memory_reference(num_params, world_size, stage, optimizer_bytes=12,
                          bytes_per_number=2):
    """Bytes per rank by the ZeRO paper's accounting: :func:`course_lib.zero.zero_memory`, whose
    optimizer state is counted in numbers of ``bytes_per_number`` bytes (K bytes = K /
    bytes_per_number numbers). Introduced in labs/10_sharded_data_parallelism.ipynb."""
    from course_lib.zero import zero_memory
    return zero_memory(num_params, world_size, stage, optimizer_bytes / bytes_per_number,
                       bytes_per_number)["total"]


MEMORY_CASES = [(7.5e9, 64, 0, 12, 2), (7.5e9, 64, 1, 12, 2), (7.5e9, 64, 2, 12, 2),
                (7.5e9, 64, 3, 12, 2), (13e9, 6, 1, 12, 2), (13e9, 6, 2, 12, 2),
                (1e6, 4, 2, 4, 4), (1e6, 4, 3, 8, 4), (66, 1, 3, 12, 2)]


def _memory_hint(expected, got, args):
    """Which terms the student divided by N, or whether K was multiplied by the bytes."""
    num_params, N, stage, K, b = args
    try:
        got = float(got)
    except (TypeError, ValueError):
        return "return the total, one number of bytes."
    right = float(expected)
    for scale, unit in ((1e9, "GB (1e9 bytes)"), (2 ** 30, "GiB (2^30 bytes)"),
                        (1e6, "MB"), (2 ** 20, "MiB")):
        if np.isclose(got * scale, right, rtol=1e-6, atol=0):
            return f"that is the total in {unit}: return it in bytes."
    split = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True),
             3: (True, True, True)}[stage]

    def total(p_b=b, g_b=b, k=K, n=N, terms=("p", "g", "k")):
        parts = {"p": p_b * num_params / (n if split[0] else 1),
                 "g": g_b * num_params / (n if split[1] else 1),
                 "k": k * num_params / (n if split[2] else 1)}
        return sum(parts[t] for t in terms)
    variants = [
        (total(terms=("p", "k")), "you left out the gradients: b bytes for each parameter, "
                                  "sharded from stage 2 on."),
        (total(terms=("g", "k")), "you left out the parameters themselves: b bytes each, "
                                  "sharded at stage 3."),
        (total(terms=("p", "g")), "you left out the optimizer state: optimizer_bytes (K) "
                                  "bytes per parameter, sharded from stage 1 on."),
        (total(p_b=2, g_b=2), f"bytes_per_number is {b} here: you counted 2 bytes a number."),
        (total(k=K / b), f"optimizer_bytes = {K} is bytes per parameter already: you divided it "
                         f"by bytes_per_number."),
        (total(n=N - 1) if N > 1 else None, f"you divided by N - 1 = {N - 1}: a shard is 1/N of "
                                            f"the whole, one for each of the N ranks."),
    ]
    for value, text in variants:
        if value is not None and not np.isclose(value, right, rtol=1e-9, atol=0) and \
                np.isclose(got, value, rtol=1e-9, atol=0):
            return text
    correct = {0: (0, False), 1: (0, True), 2: (1, True), 3: (2, True)}[stage]
    for k_bytes in (K, K * b):
        for shared in (0, 1, 2):  # how many of parameters and gradients (b bytes each) /N
            for opt in (False, True):
                value = (b * num_params * ((2 - shared) + shared / N)
                         + k_bytes * num_params / (N if opt else 1))
                if (shared, opt) == correct and k_bytes == K or \
                        not np.isclose(got, value, rtol=1e-9, atol=0):
                    continue
                if k_bytes != K:
                    return (f"optimizer_bytes = {K} is already bytes per parameter (Adam in mixed "
                            f"precision: an fp32 copy of the parameter and two fp32 moments, "
                            f"4 + 4 + 4): do not multiply it by bytes_per_number.")
                stages = {v: s for s, v in {0: (0, False), 1: (0, True), 2: (1, True),
                                            3: (2, True)}.items()}
                if (shared, opt) in stages:
                    s = stages[(shared, opt)]
                    return (f"that is stage {s}'s accounting, {formula(s, b)}; stage {stage} is "
                            f"{formula(stage, b)}.")
                which = ("the parameters or the gradients" if shared == 1 else
                         "both the parameters and the gradients")
                return (f"you divided {which} by N but not the optimizer state. ZeRO shards "
                        f"the optimizer state first (stage 1), then the gradients (stage 2), "
                        f"then the parameters (stage 3); stage {stage} is "
                        f"{formula(stage, b)}.")
    return None


def check_zero_memory_per_rank(student_fn) -> bool:
    """Lab 10, exercise 3: ``zero_memory_per_rank(num_params, world_size, stage,
    optimizer_bytes=12, bytes_per_number=2)`` returns the bytes per rank of the ZeRO paper's
    accounting, against :func:`zero_memory_reference` on models of 66 to 13e9 parameters.
    Introduced in labs/10_sharded_data_parallelism.ipynb."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [Case(f"Ψ = {p:.3g}, N = {N}, stage {s}, K = {K} bytes, {b} bytes per number",
                  lambda p=p, N=N, s=s, K=K, b=b: (p, N, s, K, b))
             for p, N, s, K, b in MEMORY_CASES]
    return run_check("check_zero_memory_per_rank", student_fn, zero_memory_reference, cases,
                     hint="compare with the ZeRO paper's accounting, term by term: the "
                          "parameters, the gradients and the optimizer state, and which of "
                          "them this stage divides by N.",
                     result_name="bytes per rank", rtol=1e-9, atol=0, diagnose=_memory_hint)


# ---------------------------------------------------------------- exercise 4: FSDP's rows
# (world size, shapes of one unit): rows that divide, rows that do not (10 over 4: 3, 3, 3, 1),
# fewer rows than ranks (3 over 4: the last rank holds none), a bias, three dimensions
ROWS_CASES = [(2, [(4, 3), (4,)]), (4, [(10, 3), (10,), (3, 2)]),
              (3, [(5, 2, 2), (7,), (1, 4)])]


def case_wholes(shapes, seed=0):
    """The whole tensors of one case: seeded, the same on every rank (float64)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]


def rows_on_rank(payload, shapes, world_size, timeout=STUDENT_TIMEOUT):
    """On every rank: the student's ``gather_rows`` on this rank's pieces of the case's tensors
    and ``reduce_scatter_rows`` on gradients that differ by rank ((rank + 1) x the tensors),
    on the first ``world_size`` ranks (None on the others); what each returned (numpy arrays)
    and how many collectives each called, or ``{"error"}``.
    Introduced in labs/10_sharded_data_parallelism.ipynb."""
    import cloudpickle

    from course_lib import fsdp
    from course_lib.comm.subgroups import subgroup_comm
    comm = subgroup_comm(world_size, timeout)
    if comm is None:
        return None
    gather_rows, reduce_scatter_rows, reduce_scatter, all_gather = (
        cloudpickle.loads(p) for p in payload)
    calls = {"all_gather": 0, "reduce_scatter": 0}

    def spy(fn, name):
        def called(buf, comm):
            calls[name] += 1
            return fn(buf, comm)
        return called
    wholes = case_wholes(shapes)
    pieces = [fsdp.piece_of(w, comm.rank, comm.world_size) for w in wholes]
    out = {}
    try:
        got = gather_rows(pieces, [w.shape for w in wholes], comm, spy(all_gather, "all_gather"))
        out["gathered"] = [np.asarray(t.detach()) for t in got]
        grads = [(comm.rank + 1) * w for w in wholes]
        got = reduce_scatter_rows(grads, comm, spy(reduce_scatter, "reduce_scatter"))
        out["reduced"] = [np.asarray(t.detach()) for t in got]
    except Exception as err:
        out["error"] = _error_report(err)
    out["calls"] = dict(calls)
    return out


def _rows_hint(kind, N, shapes, got, want, calls):
    """What a wrong gather or reduce-scatter of rows did, from what it returned."""
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want, strict=True)):
        return (f"return one tensor per parameter, of its shape: "
                f"{[tuple(w.shape) for w in want]}, you returned "
                f"{[tuple(g.shape) for g in got]}.")
    if calls != 1:
        return (f"you called the {kind} {calls} times: lay this rank's pieces end to end in "
                f"one flat buffer, one chunk per rank, and call it once (one collective per "
                f"unit, as FSDP does).")
    if kind == "reduce-scatter":
        ratio = [float(np.sum(g * w) / np.sum(w * w)) for g, w in zip(got, want, strict=True)
                 if np.any(w)]
        if ratio and all(abs(k - N) < 1e-9 for k in ratio):
            return f"each piece is {N} x the right one: divide the sum by N for the mean."
    even = all(s[0] % N == 0 for s in (s if len(s) else (1,) for s in shapes))
    if even:
        return ("the buffer is rank by rank: chunk k holds rank k's pieces of every parameter "
                "in turn; read each parameter's rows from every chunk, in rank order.")
    return ("with rows that do not divide by N, pad each piece to ceil(rows / N) rows, so that "
            "every rank's chunk has the same size and the ring's chunk k is rank k's pieces; "
            "drop the padding when you read the rows back.")


def check_fsdp_rows(gather_rows, reduce_scatter_rows, reduce_scatter, all_gather, cluster,
                    timeout=STUDENT_TIMEOUT) -> bool:
    """Lab 10, exercise 4: ``gather_rows(pieces, shapes, comm, all_gather)`` returns the whole
    tensors from every rank's rows (``fsdp.piece_of``), ``reduce_scatter_rows(grads, comm,
    reduce_scatter)`` this rank's rows of the gradients' mean, each with one collective, as
    ``course_lib.fsdp`` does, on every case of :data:`ROWS_CASES` and every rank; a wrong
    answer named. Introduced in labs/10_sharded_data_parallelism.ipynb."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib import fsdp
    name = "check_fsdp_rows"
    fns = (gather_rows, reduce_scatter_rows, reduce_scatter, all_gather)
    payload = _payload(name, fns)
    cases = [(N, shapes) for N, shapes in ROWS_CASES if N <= cluster.n]
    for number, (N, shapes) in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} (shapes {shapes} on {N} ranks)"
        try:
            reports = cluster.run(rows_on_rank, payload, shapes, N, timeout,
                                  timeout=2 * timeout + 30)[:N]
        except Exception as err:
            _cluster_failure(where, err)
        wholes = case_wholes(shapes)
        mean = [w * (N + 1) / 2 for w in wholes]  # the mean of (rank + 1) x w over N ranks
        for rank, report in enumerate(reports):
            if "error" in report:
                if report["error"]["type"] == "NotImplementedError":
                    return not_implemented(name)
                uneven = any((s[0] if len(s) else 1) % N for s in shapes)
                hint = ("\nHint: with rows that do not divide by N, pad each piece to "
                        "ceil(rows / N) rows: then every rank's buffer has the same size and "
                        "chunk k is rank k's pieces." if uneven else "")
                raise CheckFailed(f"{where}\n  rank {rank} raised "
                                  f"{report['error']['text']}{hint}")
            checks = (("all-gather", report["gathered"], [w.numpy() for w in wholes]),
                      ("reduce-scatter", report["reduced"],
                       [fsdp.piece_of(m, rank, N).numpy() for m in mean]))
            for kind, got, want in checks:
                calls = report["calls"]["all_gather" if kind == "all-gather"
                                        else "reduce_scatter"]
                right = len(got) == len(want) and all(_close(g, w) for g, w in
                                                      zip(got, want, strict=True))
                if right and calls == 1:
                    continue
                fn = "gather_rows" if kind == "all-gather" else "reduce_scatter_rows"
                said = "is right" if right else "differs from the right rows"
                raise CheckFailed(f"{where}\n  rank {rank}: what your {fn} returned {said}"
                                  f"\nHint: {_rows_hint(kind, N, shapes, got, want, calls)}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} units gathered whole and reduce-scattered to "
          f"each rank's rows of the mean, one collective each, on every rank")
    return True
