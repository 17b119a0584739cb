"""Lab 09 checks: the 1F1B order of one pipeline stage, and a row-parallel linear layer.

Introduced in labs/09_model_parallelism.ipynb, on the framework of :mod:`course_lib.checks`:
``check_1f1b_order(one_f_one_b, cluster)`` compares the student's order with
``pipeline.schedule_order`` stage by stage, plays it in the simulator (bubble, live
micro-batches), then runs it for real with ``pipeline.pipeline_step`` on the cluster's ranks
against one process; ``check_row_parallel(forward, backward, cluster)`` runs a row-parallel
linear on every rank against ``nn.Linear`` on the whole input.
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib import pipeline
from course_lib.checks.framework import (
    CheckFailed,
    not_implemented,
    pack_function,
    sequence_difference,
)

ORDER_CASES = [(0, 4, 8), (1, 4, 8), (3, 4, 8), (0, 2, 1), (0, 4, 2), (2, 4, 2), (0, 1, 3),
               (1, 3, 16)]  # (stage, num_stages, num_microbatches)


# ---------------------------------------------------------------- exercise 1: the 1F1B order
def _diagnose_order(stage, N, M, got):
    """What the student's order did, in words."""
    try:
        pipeline.check_order(got, stage, M)
    except ValueError as e:
        return f"{e}. Each micro-batch m needs one ('F', m) and, later, one ('B', m)."
    if got == pipeline.schedule_order("gpipe", stage, N, M):
        return ("that is GPipe's order (all forwards, then all backwards): 1F1B starts the "
                "backwards after a warm-up of num_stages - stage - 1 forwards.")
    def leading_forwards(order):
        return next((i for i, (op, _) in enumerate(order) if op == "B"), len(order))
    got_lead = leading_forwards(got)
    want_lead = leading_forwards(pipeline.schedule_order("1f1b", stage, N, M))
    if got_lead != want_lead:
        warmup = min(N - stage - 1, M)
        return (f"stage {stage} of {N} warms up with min(num_stages - stage - 1, "
                f"num_microbatches) = {warmup} forwards, then the steady state starts with one "
                f"more forward: {want_lead} forwards before its first backward; yours ran "
                f"{got_lead}.")
    if [m for op, m in got if op == "B"] != sorted(m for op, m in got if op == "B"):
        return "run the backwards in the order of the micro-batches: the oldest first."
    return ("after the warm-up, alternate: one forward (the next micro-batch), then one "
            "backward (the oldest whose forward has run); when the forwards run out, the "
            "remaining backwards (the cool-down).")


def _order(fn, stage, N, M):
    got = fn(stage, N, M)
    return [tuple(step) for step in got] if isinstance(got, (list, tuple)) else got


def run_order_on_rank(payload, num_microbatches, num_layers=4):
    """On every rank: one pipeline step in the student's order against one process (see
    ``testing.pipeline.pipeline_matches_one_process``)."""
    import cloudpickle

    from course_lib.testing.pipeline import pipeline_matches_one_process
    return pipeline_matches_one_process(cloudpickle.loads(payload), num_microbatches,
                                        num_layers=num_layers)


def check_1f1b_order(student_fn: Callable, cluster=None) -> bool:
    """Lab 09, exercise 1: ``one_f_one_b(stage, num_stages, num_microbatches)`` returns the
    1F1B order of that stage; checked case by case, in the simulator, then (with ``cluster``)
    run for real on its ranks against one process."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    name = "check_1f1b_order"
    for number, (stage, N, M) in enumerate(ORDER_CASES, start=1):
        where = f"{name}: case {number}/{len(ORDER_CASES)} (stage {stage} of {N}, M = {M})"
        try:
            got = _order(student_fn, stage, N, M)
        except NotImplementedError:
            return not_implemented(name)
        except Exception as err:
            raise CheckFailed(f"{where}\n  your function raised {type(err).__name__}: {err}\n"
                              f"Hint: return a list of ('F', m) and ('B', m) pairs.") from err
        expected = pipeline.schedule_order("1f1b", stage, N, M)
        if got != expected:
            raise CheckFailed(f"{where}\n{sequence_difference(expected, got)}\n"
                              f"Hint: {_diagnose_order(stage, N, M, got)}")
    N, M = 4, 8
    sim = pipeline.simulate("1f1b", N, M, orders=[_order(student_fn, s, N, M) for s in range(N)])
    print(f"  simulated, N = {N}, M = {M}: bubble {sim.bubble:.3f} (formula "
          f"{pipeline.bubble_fraction(N, M):.3f}), live micro-batches per stage {sim.peak_live}")
    if cluster is not None:
        payload = pack_function(student_fn)
        for M in (1, 3, 6):
            reports = cluster.run(run_order_on_rank, payload, M)
            worst = max(r["grad"] for r in reports)
            if worst > 1e-10 or reports[-1]["loss"] > 1e-10:
                raise CheckFailed(f"{name}: on {cluster.n} ranks with M = {M} the gradients "
                                  f"differ from one process by {worst:.3g}\nHint: the order "
                                  "is right, so look at how the function is called.")
        print(f"  run on {cluster.n} ranks, M = 1, 3, 6: gradients equal one process's")
    print(f"✓ {name}: {len(ORDER_CASES)}/{len(ORDER_CASES)} cases match the reference")
    return True


# ---------------------------------------------------------------- exercise 2: row-parallel
def row_parallel_on_rank(payload, batch=6, in_features=8, out_features=5, seed=0):
    """On every rank: the student's row-parallel forward and backward on this rank's columns,
    against ``nn.Linear`` on the whole input (float64). Returns the largest differences, and
    what a typical mistake would have given (for the hint)."""
    import cloudpickle
    import torch

    from course_lib.comm import get_comm
    from course_lib.sharding import shard_bounds
    forward, backward = (cloudpickle.loads(p) for p in payload)
    comm = get_comm("torch", timeout=10.0)
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features).double()
    x = torch.randn(batch, in_features, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(batch, out_features, dtype=torch.float64)
    y = linear(x)
    y.backward(grad_y)
    a, b = shard_bounds(in_features, comm.rank, comm.world_size)
    x_shard, w_shard = x.detach()[:, a:b].clone(), linear.weight.detach()[:, a:b].clone()
    bias = linear.bias.detach().clone()
    partial = x_shard @ w_shard.T
    got_y = forward(x_shard.clone(), w_shard.clone(), bias.clone(), comm)
    grads = backward(grad_y.clone(), x_shard.clone(), w_shard.clone())

    def diff(got, want):
        got = torch.as_tensor(got, dtype=want.dtype)
        return float("inf") if got.shape != want.shape else float((got - want).abs().max())
    wants = (x.grad[:, a:b], linear.weight.grad[:, a:b], linear.bias.grad)
    return {"y": diff(got_y, y.detach()), "partial": diff(got_y, partial + bias),
            "bias_n_times": diff(got_y, y.detach() + (comm.world_size - 1) * bias),
            "grads": [diff(g, w) for g, w in zip(grads, wants, strict=True)]
            if isinstance(grads, (tuple, list)) and len(grads) == 3 else None,
            "shapes": [tuple(torch.as_tensor(g).shape) for g in grads]
            if isinstance(grads, (tuple, list)) else None,
            "want_shapes": [tuple(w.shape) for w in wants]}


def check_row_parallel(forward: Callable, backward: Callable, cluster) -> bool:
    """Lab 09, exercise 2: ``row_parallel_forward(x_shard, weight_shard, bias, comm)`` and
    ``row_parallel_backward(grad_y, x_shard, weight_shard)`` on every rank of ``cluster``,
    against ``nn.Linear`` on the whole input."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.cluster import RemoteError
    name = "check_row_parallel"
    payload = (pack_function(forward), pack_function(backward))
    for number, (batch, n_in, n_out) in enumerate([(6, 8, 5), (3, 12, 7), (1, 4, 1)], start=1):
        where = f"{name}: case {number}/3 (batch {batch}, Linear({n_in}, {n_out}), " \
                f"{cluster.n} ranks)"
        try:
            reports = cluster.run(row_parallel_on_rank, payload, batch, n_in, n_out)
        except RemoteError as err:
            if any("NotImplementedError" in text for text in err.errors.values()):
                return not_implemented(name)
            first = min(err.errors)
            raise CheckFailed(f"{where}\n  your functions raised on rank(s) "
                              f"{sorted(err.errors)}: {err.errors[first].splitlines()[-1]}\n"
                              "Hint: read the traceback; allreduce with "
                              "collectives.allreduce(y, comm), in place.") from None
        for rank, r in enumerate(reports):
            if r["y"] > 1e-10:
                hint = ("y = x W^T + b: each rank's x_shard @ weight_shard.T is a partial sum; "
                        "allreduce the partial sums, then add the bias once.")
                if r["partial"] < 1e-10:
                    hint = ("your y is this rank's partial sum: allreduce it "
                            "(collectives.allreduce(y, comm)) before adding the bias.")
                elif r["bias_n_times"] < 1e-10:
                    hint = ("the bias was added on every rank before the allreduce, so it "
                            "counts N times: add it once, after the allreduce.")
                raise CheckFailed(f"{where}\n  rank {rank}: y differs from nn.Linear by "
                                  f"{r['y']:.3g}\nHint: {hint}")
            if r["grads"] is None:
                raise CheckFailed(f"{where}\n  row_parallel_backward returned {r['shapes']}\n"
                                  "Hint: return (grad_x_shard, grad_weight_shard, grad_bias).")
            for what, d, got, want in zip(("grad_x_shard", "grad_weight_shard", "grad_bias"),
                                          r["grads"], r["shapes"], r["want_shapes"],
                                          strict=True):
                if d > 1e-10:
                    hint = {"grad_x_shard": "grad_x_shard = grad_y @ weight_shard",
                            "grad_weight_shard": "grad_weight_shard = grad_y.T @ x_shard",
                            "grad_bias": "grad_bias = grad_y.sum(0)"}[what]
                    shape = f" (shape {got}, expected {want})" if got != want else ""
                    raise CheckFailed(f"{where}\n  rank {rank}: {what} differs{shape}\nHint: "
                                      f"{hint}; no communication: grad_y is already the same "
                                      "on every rank.")
    print(f"✓ {name}: 3/3 cases match nn.Linear on {cluster.n} ranks")
    return True
