"""Lab 08 checks: top-k with error feedback, its exchange between ranks, training with it, and
DiLoCo's outer step.

Introduced in labs/08_local_sgd_and_compression.ipynb, on the framework of
:mod:`course_lib.checks`: ``check_topk_compress(topk_compress)`` (in this process, by properties,
since top-k may break ties any way), ``check_topk_allreduce(topk_allreduce, cluster)`` (on every
rank, against the reference, counting the bytes handed to the collectives with
:class:`CollectiveCounter`) and ``check_training(topk_allreduce, cluster)`` (training with and
without error feedback, next to the reference and to uncompressed SGD);
``check_outer_step(outer_step, cluster)`` (in this process against ``torch.optim.SGD`` with
Nesterov momentum on the pseudo-gradient, the usual mistakes named, then DiLoCo trained on the
ranks with the student's outer step against the reference's).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from course_lib.checks.framework import CheckFailed, not_implemented, pack_function

EXERCISE_1 = ("compare your function with the three parts of the formula above the exercise: "
              "what is corrected (the gradient and the residual), which k entries of it are "
              "sent, and what stays behind in the new residual.")


# ---------------------------------------------------------------- exercise 1, in this process
def _compress_cases(seed):
    """(label, grad, residual, k) with torch tensors; ties and edge cases included."""
    import torch
    g = torch.Generator().manual_seed(seed)
    ties = torch.tensor([2.0, -2.0, 0.5, 2.0, 1.0, -2.0, 0.25, 1.0])
    return [
        ("n=20, k=5, no residual", torch.randn(20, generator=g), None, 5),
        ("n=1000, k=10, with a residual", torch.randn(1000, generator=g),
         0.5 * torch.randn(1000, generator=g), 10),
        ("ties: four entries of magnitude 2, k=2", ties, None, 2),
        ("ties in grad + residual, k=3", ties, torch.tensor([0, 0, 1.5, 0, 1, 0, 0, 1.0]), 3),
        ("k == n: everything is sent", torch.randn(7, generator=g), torch.randn(7, generator=g), 7),
        ("k > n: everything is sent", torch.randn(5, generator=g), None, 9),
        ("float64, n=300, k=30", torch.randn(300, generator=g, dtype=torch.float64),
         torch.randn(300, generator=g, dtype=torch.float64), 30),
        ("a zero gradient, k=3", torch.zeros(12), None, 3),
    ]


def _problem_1(grad, residual, k, got):
    """What is wrong with ``got = (values, indices, new_residual)``, or None."""
    import torch
    corrected = grad if residual is None else grad + residual
    n, kk = len(grad), min(k, len(grad))
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return "return three things: values, indices, new_residual", None
    values, indices, new_residual = (torch.as_tensor(x) for x in got)
    if (values.shape == indices.shape == (kk,) and not values.is_floating_point()
            and indices.is_floating_point()):
        return ("your values are whole numbers and your indices are not",
                "the three come back in the order (values, indices, new_residual): yours has "
                "values and indices the other way round.")
    if values.shape != (kk,) or indices.shape != (kk,):
        return (f"expected {kk} values and {kk} indices, got shapes {tuple(values.shape)} and "
                f"{tuple(indices.shape)}", "send exactly min(k, len(grad)) entries.")
    idx = indices.long()
    if len(set(idx.tolist())) != kk or (kk and (idx.min() < 0 or idx.max() >= n)):
        return "indices must be distinct positions in 0..n-1", EXERCISE_1
    if new_residual.shape != grad.shape or new_residual.dtype != grad.dtype:
        return (f"new_residual must have grad's shape and dtype {tuple(grad.shape)} {grad.dtype}, "
                f"got {tuple(new_residual.shape)} {new_residual.dtype}", None)
    rest = torch.ones(n, dtype=torch.bool)
    rest[idx] = False
    if kk < n and corrected.abs()[idx].min() < corrected.abs()[rest].max():
        hint = EXERCISE_1
        if corrected.abs()[idx].max() <= corrected.abs()[rest].min():
            hint = ("you picked the k SMALLEST magnitudes: the entries sent are those of "
                    "largest magnitude.")
        elif residual is not None and grad.abs()[idx].min() >= grad.abs()[rest].max():
            hint = "choose among grad + residual, not grad alone: add the residual first."
        elif corrected[idx].min() >= corrected[rest].max():
            hint = "choose by magnitude, corrected.abs(): a large negative entry counts too."
        return "these are not the k entries of largest magnitude of grad + residual", hint
    if not torch.equal(values, corrected[idx]):
        hint = EXERCISE_1
        if torch.equal(values, corrected[idx].abs()):
            hint = "send the signed values corrected[indices], not their magnitudes."
        elif residual is not None and torch.equal(values, grad[idx]):
            hint = "send grad + residual at those positions: the residual rides along."
        return "values are not (grad + residual)[indices]", hint
    expected = corrected.clone()
    expected[idx] = 0
    if not torch.equal(new_residual, expected):
        only_grad, sent = grad.clone(), torch.zeros_like(corrected)
        only_grad[idx], sent[idx] = 0, corrected[idx]
        if torch.equal(new_residual, corrected):
            hint = "set the sent entries of the residual to zero: they have been sent."
        elif residual is not None and torch.equal(new_residual, residual):
            hint = ("your new residual is the old one, unchanged: it must hold what THIS step "
                    "did not send, of the gradient and the old residual together.")
        elif not new_residual.any():
            hint = "keep everything that was not sent in the residual (error feedback)."
        elif residual is not None and torch.equal(new_residual, only_grad):
            hint = ("your new residual leaves the old residual out: what was not sent of the "
                    "old residual is still owed too.")
        elif torch.equal(new_residual, sent):
            hint = ("your new residual holds the entries that WERE sent (zeros elsewhere): it "
                    "must hold what was not sent.")
        else:
            hint = ("new_residual + what was sent must give back grad + residual exactly: "
                    "nothing is lost, only delayed.")
        return "new_residual + sent != grad + residual", hint
    return None


def _in_place_hint(grad, residual, k, after):
    """How a function changed its caller's grad or residual, told from what they hold now."""
    import torch
    grad_after, residual_after = after[0], after[1]
    corrected = grad if residual is None else grad + residual
    zeroed = corrected.clone()
    zeroed[torch.topk(corrected.abs(), min(k, len(grad))).indices] = 0
    if residual is None and torch.equal(grad_after, zeroed):
        return ("the sent entries of grad itself were set to zero: with no residual, your "
                "corrected gradient IS grad (the same tensor, not a copy), and so is the new "
                "residual made from it.")
    if residual is not None and torch.allclose(grad_after, corrected):
        return ("grad now holds grad + residual: an in-place addition (grad += residual) "
                "changes the caller's tensor; the sum must be a new one.")
    if residual is not None and torch.equal(residual_after, zeroed):
        return ("the residual you were given now holds the new residual: it was updated in "
                "place; the new residual must be a new tensor.")
    return ("grad and residual belong to the caller: make new tensors instead of changing "
            "them (+=, [...] = 0).")


def check_topk_compress(student_fn: Callable, seed: int = 0) -> bool:
    """Lab 08, exercise 1: ``topk_compress(grad, residual, k) -> (values, indices,
    new_residual)`` on 8 cases (ties, k >= n, float64, no residual), without changing its
    inputs, and a ValueError for k = 0."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    import torch
    name = "check_topk_compress"
    cases = _compress_cases(seed)
    for number, (label, grad, residual, k) in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases) + 1} ({label})"
        args = (grad.clone(), None if residual is None else residual.clone(), k)
        try:
            got = student_fn(*args)
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            hint = ("with k >= len(grad) send everything: k = min(k, len(grad))." if k > len(grad)
                    else "residual=None means no residual yet (zeros)." if residual is None
                    else EXERCISE_1)
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              f"Hint: {hint}") from err
        if not torch.equal(args[0], grad) or (residual is not None
                                              and not torch.equal(args[1], residual)):
            raise CheckFailed(f"{where}\n  your function changed its input grad or residual in "
                              f"place.\nHint: {_in_place_hint(grad, residual, k, args)}")
        problem = _problem_1(grad, residual, k, got)
        if problem:
            text, hint = problem
            raise CheckFailed(f"{where}\n  {text}\nHint: {hint or EXERCISE_1}")
    where = f"{name}: case {len(cases) + 1}/{len(cases) + 1} (k=0)"
    try:
        student_fn(torch.ones(4), None, 0)
    except ValueError:
        pass
    except Exception as err:
        raise CheckFailed(f"{where}\n  raised {type(err).__name__}, not ValueError\nHint: "
                          "if k < 1: raise ValueError(...) before anything else.") from err
    else:
        raise CheckFailed(f"{where}\n  k=0 was accepted\nHint: top-0 sends nothing and learns "
                          "nothing: raise ValueError for k < 1.")
    print(f"✓ {name}: {len(cases) + 1}/{len(cases) + 1} cases pass (ties, k >= n, k = 0)")
    return True


# ---------------------------------------------------------------- exercise 2, on the ranks
class CollectiveCounter:
    """While active, records ``(collective, bytes handed to it)`` for every call this process
    makes to ``dist.all_reduce``, ``all_gather``, ``broadcast`` and ``all_to_all_single``."""

    OPS = ("all_reduce", "all_gather", "broadcast", "all_to_all_single")

    def __enter__(self):
        import torch.distributed as dist
        self.calls, self._saved = [], {op: getattr(dist, op) for op in self.OPS}
        for op, fn in self._saved.items():
            def counted(tensor, *args, _op=op, _fn=fn, **kwargs):
                t = args[0] if _op == "all_gather" else tensor  # all_gather(out_list, tensor)
                self.calls.append((_op, int(t.numel() * t.element_size())))
                return _fn(tensor, *args, **kwargs)
            setattr(dist, op, counted)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for op, fn in self._saved.items():
            setattr(dist, op, fn)


def exchange_inputs(n, seed, rank, with_residual, shared):
    """This rank's (grad, residual) for a case; ``shared``: the same k large entries on every
    rank, so the ranks pick overlapping indices (their values must be added, not assigned)."""
    import torch
    g = torch.Generator().manual_seed(1000 * seed + rank)
    grad = torch.randn(n, generator=g)
    if shared:
        grad[: n // 10 + 1] += 20.0
    residual = 0.5 * torch.randn(n, generator=g) if with_residual else None
    return grad, residual


def exchange_on_rank(payload, n, k, seed, with_residual, shared, timeout=10.0):
    """On every rank: the student's exchange (or the reference, ``payload=None``) on this rank's
    case; returns its mean, new residual and the collectives it called with their bytes."""
    import cloudpickle
    import torch.distributed as dist

    from course_lib.compression import topk_allreduce
    fn = topk_allreduce if payload is None else cloudpickle.loads(payload)
    grad, residual = exchange_inputs(n, seed, dist.get_rank(), with_residual, shared)
    with CollectiveCounter() as counter:
        mean, new_residual = fn(grad, residual, k)
    return {"mean": mean.numpy().copy(), "residual": new_residual.numpy().copy(),
            "calls": counter.calls}


def _remote(name, where, err):
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import ClusterTimeout, RemoteError
    if isinstance(err, RemoteError):
        if any("NotImplementedError" in text for text in err.errors.values()):
            return not_implemented(name)
        first = min(err.errors)
        raise CheckFailed(f"{where}\n  your function raised on rank(s) {sorted(err.errors)}: "
                          f"{err.errors[first].splitlines()[0]}\nHint: read the traceback; "
                          "everything it uses must be defined or imported in the notebook."
                          ) from None
    if isinstance(err, ClusterTimeout):
        raise CheckFailed(f"{where}\n  {err}\nHint: every rank must call the same collectives "
                          "with the same sizes (k values, then k indices).") from None
    raise CheckFailed(f"{where}\n  {type(err).__name__}: {err}\nHint: an engine process died "
                      "while running your function (the next call restarts it); run it once "
                      "by hand with cluster.run to see where.") from None


def _mean_hint(got, want, rank, world, n, k, seed, with_residual, shared):
    """Which usual mistake of the exchange gives rank ``rank``'s mean, replayed here from every
    rank's top-k (the reference's compression of the case's inputs)."""
    import torch

    from course_lib.compression import topk_compress
    parts = [topk_compress(*exchange_inputs(n, seed, r, with_residual, shared), k)[:2]
             for r in range(world)]

    def dense(pairs, add=True):
        out = torch.zeros(n)
        for vals, idx in pairs:
            if add:
                out.index_add_(0, idx, vals)
            else:
                out[idx] = vals
        return out.numpy()
    total = dense(parts)
    close = lambda a: bool(np.allclose(got, a, rtol=1e-5, atol=1e-6))  # noqa: E731
    if close(world * want):
        return "your result is the SUM over the ranks: every rank needs the mean."
    if close(total / k):
        return "you divided the sum by k: the mean is over the ranks."
    if close(dense(parts[rank:rank + 1]) / world) or close(dense(parts[rank:rank + 1])):
        return (f"your result holds rank {rank}'s own top-k only: every rank's values must "
                f"reach every rank.")
    if close(dense([(v, parts[rank][1]) for v, _ in parts]) / world):
        return (f"every rank's values were placed at rank {rank}'s OWN indices: each rank's "
                f"values go at the indices that rank sent with them.")
    if close(dense(parts, add=False) / world):
        return ("where two ranks picked the same index, your result keeps one rank's value: "
                "their values must be added, not assigned.")
    if shared:
        return ("ranks picked the same indices here: their values must be added, not "
                "assigned.")
    return "the mean over the ranks of every rank's top-k, each at its own indices."


def _bytes_hint(calls, n, k):
    """What the collectives were handed, against k float32 values and k int32 indices."""
    sizes = [b for _, b in calls]
    ops = {op for op, _ in calls}
    if "all_reduce" in ops and max(sizes) >= 4 * n:
        return ("an allreduce of the whole vector sends all n numbers: what travels is the k "
                "values and their k indices, gathered from every rank.")
    if max(sizes) >= 4 * n:
        return ("you gathered the whole vector (n numbers): only the k values and their k "
                "indices need to travel.")
    if 8 * k in sizes:
        return ("one of your collectives is handed 8 bytes per entry (int64 indices, or "
                "float64 values): both travel as 4-byte numbers, float32 values and int32 "
                "indices.")
    return ("what travels is the k values and their k indices of every rank, gathered (4 bytes "
            "each); count what you hand to the collectives.")


def check_topk_allreduce(student_fn: Callable, cluster, seed: int = 0) -> bool:
    """Lab 08, exercise 2: ``topk_allreduce(flat_grad, residual, k) -> (mean, new_residual)``
    on every rank of ``cluster``: equal to :func:`compression.topk_allreduce` on 4 cases, and
    handing the collectives exactly k values and k int32 indices per rank."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_topk_allreduce"
    try:
        payload = pack_function(student_fn)
    except Exception as e:
        raise CheckFailed(f"{name}: your function cannot be sent to the engines ({e}).\nHint: "
                          "do not refer to the cluster or open files inside it.") from None
    cases = [(1000, 10, True, False, "n=1000, k=10, with a residual"),
             (200, 21, False, True, "every rank picks the same indices"),
             (50, 50, True, False, "k == n: everything is sent"),
             (4810, 49, False, False, "the size of the lecture's model")]
    for number, (n, k, with_residual, shared, label) in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({label}, {cluster.n} ranks)"
        try:
            yours = cluster.run(exchange_on_rank, payload, n, k, seed, with_residual, shared)
        except Exception as err:
            if _remote(name, where, err) is False:
                return False
        ref = cluster.run(exchange_on_rank, None, n, k, seed, with_residual, shared)
        for rank, (got, want) in enumerate(zip(yours, ref, strict=True)):
            if not np.allclose(got["mean"], want["mean"], rtol=1e-5, atol=1e-6):
                hint = _mean_hint(got["mean"], want["mean"], rank, cluster.n, n, k, seed,
                                  with_residual, shared)
                raise CheckFailed(f"{where}\n  rank {rank}: the mean differs from the reference "
                                  f"(largest difference "
                                  f"{np.abs(got['mean'] - want['mean']).max():.3g})\nHint: {hint}")
            if not np.array_equal(got["residual"], want["residual"]):
                grad, residual = exchange_inputs(n, seed, rank, with_residual, shared)
                hint = "return the new residual that your topk_compress gave this rank."
                if residual is not None and np.array_equal(got["residual"], residual.numpy()):
                    hint = ("you returned the residual you were given: " + hint)
                elif not got["residual"].any():
                    hint = "you returned a residual of zeros: " + hint
                raise CheckFailed(f"{where}\n  rank {rank}: new_residual differs\nHint: {hint}")
            sent = sum(b for _, b in got["calls"])
            expected = sum(b for _, b in want["calls"])
            if sent != expected:
                ops = sorted({op for op, _ in got["calls"]})
                raise CheckFailed(f"{where}\n  rank {rank} handed {sent} bytes to {ops}; "
                                  f"k values + k int32 indices are {expected} bytes\nHint: "
                                  f"{_bytes_hint(got['calls'], n, k)}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match the reference on {cluster.n} ranks")
    return True


def count_scheme_bytes(n, steps=3, ratio=0.01):
    """On every rank (a self-check of :mod:`compression`): per scheme, the bytes the compressor
    counted over ``steps`` steps and the collectives it called with the bytes handed to each
    (after the first call's agreement round, which is not counted)."""
    import torch

    from course_lib.compression import make_compressor
    counted, calls = {}, {}
    for name in ("none", "fp16", "topk"):
        comp = make_compressor(name, ratio=ratio)
        comp.allreduce(torch.randn(n))
        comp.bytes_sent = 0.0
        with CollectiveCounter() as counter:
            for _ in range(steps):
                comp.allreduce(torch.randn(n))
        counted[name], calls[name] = comp.bytes_sent, counter.calls
    return counted, calls


def disagree_on_rank(n):
    """On every rank (a self-check): top-k on a gradient one element longer on each rank."""
    import torch
    import torch.distributed as dist

    from course_lib.compression import TopK
    return TopK(0.1).allreduce(torch.zeros(n + dist.get_rank()))


# ---------------------------------------------------------------- using it: training
def train_with(student_fn: Callable, cluster, ratio=0.01, steps=200, **kwargs):
    """Train with the student's exchange, with and without error feedback, and with an
    uncompressed float32 allreduce: ``{"float32": ..., "error feedback": ..., "no error
    feedback": ...}``, each rank 0's record from :func:`local_sgd.run_compressed`."""
    from course_lib import local_sgd
    payload = pack_function(student_fn)
    return {"float32": local_sgd.run_compressed(cluster, "none", steps=steps, **kwargs),
            "error feedback": local_sgd.run_compressed(cluster, "topk", ratio, True, payload,
                                                       steps=steps, **kwargs),
            "no error feedback": local_sgd.run_compressed(cluster, "topk", ratio, False, payload,
                                                          steps=steps, **kwargs)}


def check_training(student_fn: Callable, cluster, ratio=0.01, steps=200, margin=0.2) -> bool:
    """Lab 08, using exercise 2: with error feedback the final training loss is within
    ``margin`` (relative) of uncompressed SGD and of the reference top-k, the bytes per step are
    the reference's, and without error feedback the loss is more than ``margin`` worse."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib import local_sgd
    name = "check_training"
    try:
        runs = train_with(student_fn, cluster, ratio, steps)
    except Exception as err:
        if _remote(name, f"{name}: training with your topk_allreduce", err) is False:
            return False
    ref = local_sgd.run_compressed(cluster, "topk", ratio, True, steps=steps)
    dense, ef, no_ef = (runs[key] for key in ("float32", "error feedback", "no error feedback"))
    loss = {key: run["loss"][-1] for key, run in runs.items()}
    fails = []
    if ef["bytes_per_step"] != ref["bytes_per_step"]:
        fails.append(f"bytes per step {ef['bytes_per_step']:.0f}, reference "
                     f"{ref['bytes_per_step']:.0f}")
    if not loss["error feedback"] <= (1 + margin) * max(loss["float32"], ref["loss"][-1]):
        fails.append(f"with error feedback the loss is {loss['error feedback']:.4f}, more than "
                     f"{margin:.0%} above float32 SGD's {loss['float32']:.4f} and the "
                     f"reference's {ref['loss'][-1]:.4f}")
    if not loss["no error feedback"] > (1 + margin) * loss["error feedback"]:
        fails.append(f"without error feedback the loss is {loss['no error feedback']:.4f}, not "
                     f"clearly worse than with it ({loss['error feedback']:.4f}): is the "
                     "residual=None case really dropping what was not sent?")
    if fails:
        raise CheckFailed(f"{name} (top-{ratio:g}, {steps} steps, {cluster.n} ranks)\n  "
                          + "\n  ".join(fails) + "\nHint: exercises 1 and 2 must pass first; "
                          "then compare your functions with the reference on one step.")
    print(f"✓ {name}: with error feedback loss {loss['error feedback']:.4f} (float32 SGD "
          f"{loss['float32']:.4f}) sending {ef['bytes_per_step'] / dense['bytes_per_step']:.1%} "
          f"of the bytes; without it {loss['no error feedback']:.4f}")
    return True


# ---------------------------------------------------------------- exercise 3: DiLoCo's outer step
def _outer_cases(seed):
    """(label, shared, local_mean, momentum, lr, mu), float64."""
    import torch
    g = torch.Generator().manual_seed(seed)

    def randn(n, scale=1.0):
        return scale * torch.randn(n, generator=g, dtype=torch.float64)
    shared = randn(12)
    return [
        ("the first sync: no momentum yet", shared, shared + randn(12, 0.1),
         torch.zeros(12, dtype=torch.float64), 0.7, 0.9),
        ("a later sync, momentum from before", shared, shared + randn(12, 0.1), randn(12, 0.05),
         0.7, 0.9),
        ("lr 0.5, mu 0.5", randn(30), randn(30), randn(30), 0.5, 0.5),
        ("mu 0: no momentum", randn(7), randn(7), randn(7), 0.3, 0.0),
    ]


def _torch_outer(shared, local_mean, momentum, lr, mu):
    """The reference: torch's SGD with Nesterov momentum, its momentum buffer preset, on the
    gradient shared - local_mean. Returns (shared, momentum) after one step (with mu = 0 torch
    keeps no buffer: the momentum is then mu·momentum + Δ = Δ)."""
    import torch
    param = torch.nn.Parameter(shared.clone())
    sgd = torch.optim.SGD([param], lr=lr, momentum=mu, nesterov=mu > 0)
    param.grad = shared - local_mean
    if mu > 0:
        sgd.state[param]["momentum_buffer"] = momentum.clone()
    sgd.step()
    after = sgd.state[param].get("momentum_buffer", shared - local_mean)
    return param.detach(), after.clone()


def _outer_mistakes(shared, local_mean, momentum, lr, mu):
    """What the usual mistakes give, as (shared after, momentum after, hint)."""
    delta, flipped = shared - local_mean, local_mean - shared
    new_b = mu * momentum + delta
    return [
        (shared - lr * (flipped + mu * (mu * momentum + flipped)), mu * momentum + flipped,
         "the pseudo-gradient points the wrong way: Δ = shared - local_mean (the way back from "
         "where the ranks went, as a gradient points uphill); subtracting it moves the shared "
         "model towards the ranks."),
        (shared - lr * new_b, new_b,
         "that is plain momentum, shared - lr·(mu·momentum + Δ) (or Nesterov with the old "
         "momentum, the same thing): Nesterov looks one step ahead, shared - lr·(Δ + "
         "mu·momentum) with momentum already updated to mu·momentum + Δ."),
        (shared - lr * delta, momentum,
         "the momentum is neither used nor updated: momentum ← mu·momentum + Δ, then the "
         "Nesterov step."),
        (local_mean, momentum,
         "the shared model became the ranks' average: that is local SGD (lr 1, no momentum). "
         "DiLoCo steps along Δ with its own learning rate and momentum."),
    ]


def _outer_hint(student_fn, probe):
    """Which usual mistake the student's step makes, told on ``probe`` (a case with momentum
    from before, where the mistakes all give different results)."""
    import torch
    _, shared, local_mean, momentum, lr, mu = probe
    got = shared.clone()
    student_fn(got, local_mean.clone(), momentum.clone(), lr, mu)
    return next((hint for after, _, hint in _outer_mistakes(shared, local_mean, momentum, lr, mu)
                 if torch.allclose(got, after, rtol=0, atol=1e-12)),
                "Δ = shared - local_mean; momentum ← mu·momentum + Δ; shared ← shared - "
                "lr·(Δ + mu·momentum).")


def check_outer_step(student_fn: Callable, cluster=None, seed: int = 0) -> bool:
    """Lab 08, exercise 3: ``outer_step(shared, local_mean, momentum, lr, mu)`` updates
    ``shared`` and ``momentum`` in place as ``torch.optim.SGD(nesterov=True)`` on the
    pseudo-gradient shared - local_mean; then (with ``cluster``) DiLoCo trained with it on the
    ranks gives the reference's model."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    import torch
    name = "check_outer_step"
    cases = _outer_cases(seed)
    for number, (label, shared, local_mean, momentum, lr, mu) in enumerate(cases, start=1):
        where = f"{name}: case {number}/{len(cases)} ({label}, lr {lr}, mu {mu})"
        want_shared, want_b = _torch_outer(shared, local_mean, momentum, lr, mu)
        got_shared, got_b, got_mean = shared.clone(), momentum.clone(), local_mean.clone()
        try:
            student_fn(got_shared, got_mean, got_b, lr, mu)
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              "Hint: shared, local_mean and momentum are 1-D tensors; change "
                              "shared and momentum in place (sub_, mul_, add_).") from err
        if not torch.equal(got_mean, local_mean):
            raise CheckFailed(f"{where}\n  local_mean changed\nHint: local_mean is the "
                              "ranks' average, read only: compute Δ into a new tensor.")
        if torch.allclose(got_shared, want_shared, rtol=0, atol=1e-12) and \
                torch.allclose(got_b, want_b, rtol=0, atol=1e-12):
            continue
        if torch.equal(got_shared, shared) and not torch.allclose(want_shared, shared):
            hint = ("shared did not change: update it in place (shared.sub_(...)); "
                    "shared = shared - ... only rebinds your local name.")
        elif torch.allclose(got_shared, want_shared, rtol=0, atol=1e-12):
            hint = ("shared is right but momentum is not what it should be after the step: "
                    "update it in place, momentum.mul_(mu).add_(Δ), so the next sync sees it.")
        else:
            hint = _outer_hint(student_fn, cases[1])
        worst = float((got_shared - want_shared).abs().max())
        raise CheckFailed(f"{where}\n  shared after your step differs from torch's SGD "
                          f"(nesterov=True) by up to {worst:.3g}\nHint: {hint}")
    if cluster is not None:
        from course_lib import local_sgd
        kw = dict(steps=60, eval_every=60)
        mine = local_sgd.run_diloco(cluster, 10, outer=pack_function(student_fn), **kw)
        reference = local_sgd.run_diloco(cluster, 10, **kw)
        worst = float(np.abs(mine["theta"] - reference["theta"]).max())
        if worst > 1e-5:
            raise CheckFailed(f"{name}: DiLoCo on {cluster.n} ranks with your outer step ended "
                              f"{worst:.3g} away from the reference's model\nHint: the cases "
                              "passed, so look at what your function does with float32 views.")
        print(f"  DiLoCo H=10 on {cluster.n} ranks, 60 steps: loss {mine['loss'][-1]:.3f}, the "
              f"reference's {reference['loss'][-1]:.3f}")
    print(f"✓ {name}: {len(cases)}/{len(cases)} cases match torch's SGD with Nesterov momentum")
    return True
