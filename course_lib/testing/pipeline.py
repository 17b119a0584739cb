"""What tests, the demo and notebook 09 run on every rank: the pipeline against one process and
against ``torch.distributed.pipelining``. Introduced in notebooks/09_model_parallelism.ipynb."""

from __future__ import annotations

import copy
import os
import time

import torch
from torch import nn

from course_lib import pipeline
from course_lib.comm import get_comm
from course_lib.comm.subgroups import subgroup_comm
from course_lib.runtime.timeline import DISABLED, Timeline

WORK = ("forward", "backward", "weight")  # a stage's busy time: F, B and W spans


def make_mlp(num_layers=6, width=8, seed=0, dtype=torch.float64):
    """``num_layers`` blocks of Linear + Tanh (the last one a Linear alone), the same on every
    rank for a seed. Introduced in notebooks/09_model_parallelism.ipynb."""
    torch.manual_seed(seed)
    layers = []
    for i in range(num_layers):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.Tanh()) if i < num_layers - 1
                      else nn.Linear(width, width))
    return nn.Sequential(*layers).to(dtype)


def make_batch(batch=16, width=8, seed=1, dtype=torch.float64):
    """Inputs and regression targets, the same on every rank for a seed.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, width, generator=g, dtype=dtype),
            torch.randn(batch, width, generator=g, dtype=dtype))


def run_stage(stage, comm, num_microbatches, x, y, schedule="1f1b", timeline=DISABLED):
    """``pipeline.pipeline_step`` of this rank's ``stage`` with MSE: the batch ``x`` goes to
    the first stage, the targets ``y`` to the last (both on rank 0 for ``"zb-v"``, whose
    ``stage`` is the rank's two chunks). Introduced in notebooks/09_model_parallelism.ipynb."""
    first = comm.rank == 0
    last = first if schedule == "zb-v" else comm.rank == comm.world_size - 1
    return pipeline.pipeline_step(stage, comm, num_microbatches, x=x if first else None,
                                  y=y if last else None,
                                  loss_fn=nn.functional.mse_loss if last else None,
                                  schedule=schedule, timeline=timeline)


def pipeline_matches_one_process(schedule="1f1b", num_microbatches=4, counts=None,
                                 num_layers=6, batch=16, width=8, world_size=None, seed=0,
                                 timeout=10.0, device="cpu"):
    """Run one step of the pipeline on this rank's stage and the whole model in one process
    (on every rank); returns ``{"grad": max difference of the stage's gradients, "loss":
    difference of the loss (last stage, else None), "peak_live": ..., "stage": rank}``, or None
    on ranks outside ``world_size``. ``device``: where the model and the batch live ("cuda":
    activations and gradients cross between stages as CUDA tensors).
    Introduced in notebooks/09_model_parallelism.ipynb."""
    comm = subgroup_comm(world_size, timeout)
    if comm is None:
        return None
    N, v_shaped = comm.world_size, schedule == "zb-v"
    model = make_mlp(num_layers, width, seed).to(device)
    x, y = (t.to(device) for t in make_batch(batch, width, seed + 1))
    counts = counts or pipeline.balance([1.0] * num_layers, 2 * N if v_shaped else N)

    def my_part(model):  # this rank's stage, or its two chunks of the V
        parts = pipeline.split_model(model, counts)
        return pipeline.v_chunks(parts, comm.rank) if v_shaped else [parts[comm.rank]]
    mine = my_part(copy.deepcopy(model))
    last = comm.rank == (0 if v_shaped else N - 1)
    result = run_stage(mine if v_shaped else mine[0], comm, num_microbatches, x, y, schedule)
    loss = nn.functional.mse_loss(model(x), y)  # the reference: one process, whole batch
    loss.backward()
    grad = max(float((a.grad - b.grad).abs().max())
               for part, ref in zip(mine, my_part(model), strict=True)
               for a, b in zip(part.parameters(), ref.parameters(), strict=True))
    return {"stage": comm.rank, "grad": grad, "peak_live": result.peak_live,
            "loss": abs(result.loss - loss.item()) if last else None}


def timed_step(schedule="1f1b", num_microbatches=8, forward_s=0.02, backward_s=0.04,
               compute_layers=0, batch=None, width=16, steps=2, world_size=None, link=None,
               timeout=30.0):
    """Time ``steps`` pipeline steps (the first one warms up). Each stage is one
    :class:`pipeline.SleepLayer` (a fixed time per micro-batch), or with ``compute_layers`` > 0
    that many real Linear + Tanh layers of ``width`` (float32). Returns this rank's Timeline of
    the last step, its common start, the step's seconds, peak live micro-batches and peak bytes
    of saved activations; None outside ``world_size``.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    from course_lib.runtime import netem
    comm = subgroup_comm(world_size, timeout)
    if comm is None:
        return None
    if link is not None:
        comm.link = netem.make_link(link)
    rank = comm.rank

    def make_stage(share, seed):  # a share of a rank's work: all of it, or one chunk of a V
        if compute_layers:
            return make_mlp(max(1, round(compute_layers * share)), width, seed=seed,
                            dtype=torch.float32)
        return pipeline.SleepLayer(forward_s * share, backward_s * share)
    stage = ([make_stage(0.5, k) for k in pipeline.v_places(rank, comm.world_size)]
             if schedule == "zb-v" else make_stage(1.0, rank))
    x, y = make_batch(batch or num_microbatches, width, dtype=torch.float32)
    for _ in range(steps):
        tl = Timeline(rank)
        comm.barrier()
        netem.start_together(comm)  # every stage starts at one agreed instant
        start = tl.now()
        result = run_stage(stage, comm, num_microbatches, x, y, schedule, tl)
        elapsed = tl.now() - start
    return {"timeline": tl, "start": start, "seconds": elapsed, "peak_live": result.peak_live,
            "peak_bytes": result.peak_activation_bytes}


def torch_timed_step(schedule="1f1b", num_microbatches=8, compute_layers=2, width=16,
                     batch=None, steps=2, world_size=None, timeout=30.0):
    """:func:`timed_step`'s step with real compute (the same layers, seeds and batch), run by
    ``torch.distributed.pipelining``'s schedule of the same name (``ScheduleGPipe``,
    ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` with one stage per rank for
    ``"zb-h1"``, ``ScheduleZBVZeroBubble`` for ``"zb-v"``). Returns ``{"seconds": this rank's
    time of the last step from the common start}``; None outside ``world_size``.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    from course_lib.comm.subgroups import subgroup
    from course_lib.runtime import netem
    comm = subgroup_comm(world_size, timeout)
    if comm is None:
        return None
    group = subgroup(world_size) or dist.group.WORLD
    N, rank, v_shaped = comm.world_size, comm.rank, schedule == "zb-v"
    places = pipeline.v_places(rank, N) if v_shaped else [rank]  # as timed_step's seeds
    layers = max(1, round(compute_layers * (0.5 if v_shaped else 1.0)))
    stages = [pp.PipelineStage(make_mlp(layers, width, seed=k, dtype=torch.float32), k,
                               2 * N if v_shaped else N, torch.device("cpu"), group=group)
              for k in places]
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
           "zb-h1": pp.ScheduleInterleavedZeroBubble, "zb-v": pp.ScheduleZBVZeroBubble}[schedule]
    runner = cls(stages if schedule.startswith("zb") else stages[0], num_microbatches,
                 loss_fn=nn.functional.mse_loss)
    x, y = make_batch(batch or num_microbatches, width, dtype=torch.float32)
    first, last = 0 in places, (2 * N - 1 if v_shaped else N - 1) in places
    for _ in range(steps):
        comm.barrier()
        start = netem.start_together(comm)
        runner.step(*((x,) if first else ()), **({"target": y, "losses": []} if last else {}))
        seconds = time.monotonic() - start
    return {"seconds": seconds}


def sleeping_model(forward_ms=(2, 2, 2, 2, 4, 4, 8, 8)):
    """One :class:`pipeline.SleepLayer` per entry: ``forward_ms`` in forward and twice that in
    backward per micro-batch, so layer costs are known and ranks do not compete for cores.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    return nn.Sequential(*[pipeline.SleepLayer(f / 1e3, 2 * f / 1e3) for f in forward_ms])


def split_step_seconds(counts, forward_ms=(2, 2, 2, 2, 4, 4, 8, 8), batch=16,
                       num_microbatches=8, steps=2):
    """Median seconds of a 1F1B step of :func:`sleeping_model` cut into stages of ``counts``
    layers, and this stage's busy seconds per step. Introduced in
    notebooks/09_model_parallelism.ipynb."""
    from course_lib.runtime import netem
    comm = get_comm("torch")
    rank = comm.rank
    stage = pipeline.split_model(sleeping_model(forward_ms), counts)[rank]
    x, y = make_batch(batch, 4, dtype=torch.float32)
    seconds, busy = [], []
    for _ in range(steps + 1):
        tl = Timeline(rank)
        comm.barrier()
        start = netem.start_together(comm)
        run_stage(stage, comm, num_microbatches, x, y, timeline=tl)
        seconds.append(time.monotonic() - start)
        busy.append(sum(e.end - e.start for e in tl.events if e.cat in WORK))
    return {"seconds": sorted(seconds[1:])[steps // 2], "busy": sorted(busy[1:])[steps // 2]}


def measured_bubble(reports):
    """From every stage's report of :func:`timed_step`: ``(bubble, step seconds)``, the idle
    share of the busiest stage over the step (first start to last end of any stage).
    Introduced in notebooks/09_model_parallelism.ipynb."""
    reports = [r for r in reports if r is not None]
    start = min(r["start"] for r in reports)
    end = max(e.end for r in reports for e in r["timeline"].events)
    busy = max(sum(e.end - e.start for e in r["timeline"].events if e.cat in WORK)
               for r in reports)
    return 1 - busy / (end - start), end - start


def tp_and_pp_on_link(link=None, batch=32, d_model=256, num_microbatches=4, steps=3,
                      timeout=30.0):
    """One model of N MLP blocks (d_model -> 4 d_model -> d_model, N = the ranks), trained one
    step (forward + backward) two ways on the same ranks and the same emulated ``link``: tensor
    parallel (every block split over all ranks: one allreduce of batch x d_model each way per
    block) and pipeline parallel (block s on rank s, 1F1B, ``num_microbatches``: point to point
    between stages). Returns the median seconds of each (``steps`` after one warm-up).
    Introduced in notebooks/09_model_parallelism.ipynb."""
    from course_lib.runtime import netem
    from course_lib.tensor_parallel import ParallelMLP, TensorParallel
    comm = get_comm("torch", timeout=timeout)
    comm.link = netem.make_link(link) if link else None
    N, rank = comm.world_size, comm.rank
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                          nn.Linear(4 * d_model, d_model)) for _ in range(N)])
    x, y = make_batch(batch, d_model, dtype=torch.float32)
    tp = TensorParallel(comm)
    tp_model = nn.Sequential(*[ParallelMLP.from_mlp(block, tp) for block in model])
    stage = copy.deepcopy(model[rank])
    times = {"tensor": [], "pipeline": []}
    for _ in range(steps + 1):
        comm.barrier()
        start = netem.start_together(comm)
        inp = x.clone().requires_grad_()  # inside a network, a block's input needs a gradient
        nn.functional.mse_loss(tp_model(inp), y).backward()
        times["tensor"].append(time.monotonic() - start)
        comm.barrier()
        start = netem.start_together(comm)
        run_stage(stage, comm, num_microbatches, x, y)
        times["pipeline"].append(time.monotonic() - start)
    return {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in times.items()}


def silent_stage(silent=1, timeout=2.0, die=False):
    """Every stage runs a 1F1B step but stage ``silent``, which never sends (or whose process
    exits at once, with ``die``): each other rank returns ``(the error's text, seconds until
    it came)``, the silent one ``("silent", 0)``.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    comm = get_comm("torch", timeout=timeout)
    if comm.rank == silent:
        if die:
            os._exit(1)
        return "silent", 0.0
    N, rank = comm.world_size, comm.rank
    model = make_mlp(N, 8)
    x, y = make_batch(8, 8)
    t = time.monotonic()
    try:
        run_stage(pipeline.split_model(model, [1] * N)[rank], comm, 4, x, y)
    except pipeline.PipelineError as e:
        return str(e), time.monotonic() - t
    return "finished", time.monotonic() - t


def torch_pipelining_matches(schedule="1f1b", num_microbatches=4, num_layers=6, batch=16,
                             width=8, seed=0):
    """The same step with ``torch.distributed.pipelining`` (over the cluster's Gloo group:
    ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` with one stage per
    rank for ``"zb-h1"``, ``ScheduleZBVZeroBubble`` with two for ``"zb-v"``) and with
    :func:`pipeline.pipeline_step`; returns the max difference of this rank's gradients and of
    the loss (on the rank with the last stage). Introduced in
    notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )
    comm = get_comm("torch")
    rank, N, v_shaped = comm.rank, comm.world_size, schedule == "zb-v"
    model = make_mlp(num_layers, width, seed)
    x, y = make_batch(batch, width, seed + 1)
    counts = pipeline.balance([1.0] * num_layers, 2 * N if v_shaped else N)
    places = pipeline.v_places(rank, N) if v_shaped else [rank]  # which stages this rank runs
    ours = [pipeline.split_model(copy.deepcopy(model), counts)[k] for k in places]
    theirs = [pipeline.split_model(copy.deepcopy(model), counts)[k] for k in places]
    first, last = 0 in places, len(counts) - 1 in places
    result = run_stage(ours if v_shaped else ours[0], comm, num_microbatches, x, y, schedule)
    stages = [PipelineStage(part, k, len(counts), torch.device("cpu"), group=dist.group.WORLD)
              for part, k in zip(theirs, places, strict=True)]
    if schedule in ("gpipe", "1f1b"):
        runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
            stages[0], num_microbatches, loss_fn=nn.functional.mse_loss)
    else:
        cls = ScheduleZBVZeroBubble if v_shaped else ScheduleInterleavedZeroBubble
        runner = cls(stages, num_microbatches, loss_fn=nn.functional.mse_loss)
    losses = []
    inputs = (x,) if first else ()
    runner.step(*inputs, **({"target": y, "losses": losses} if last else {}))
    grad = max(float((a.grad - b.grad).abs().max())
               for mine, its in zip(ours, theirs, strict=True)
               for a, b in zip(mine.parameters(), its.parameters(), strict=True))
    loss = abs(result.loss - float(torch.stack(losses).mean())) if last else None
    return {"stage": rank, "grad": grad, "loss": loss}


def torch_orders(schedule, num_stages, num_microbatches):
    """Each rank's order as ``torch.distributed.pipelining`` computes it, in our notation:
    ``"zb-h1"`` from ``ScheduleInterleavedZeroBubble`` with one stage per rank, ``"zb-v"`` from
    ``ScheduleZBVZeroBubble`` (steps ``(op, m, chunk)``). Their order generators run without
    a process group: the schedule object is made without its stages (a private method of
    torch's, so a torch that renamed it raises AttributeError).
    Introduced in notebooks/09_model_parallelism.ipynb."""
    from torch.distributed.pipelining import schedules as S
    N, M = num_stages, num_microbatches
    names = {S._ComputationType.FORWARD: "F", S._ComputationType.BACKWARD_INPUT: "B",
             S._ComputationType.BACKWARD_WEIGHT: "W"}
    cls = {"zb-h1": S.ScheduleInterleavedZeroBubble, "zb-v": S.ScheduleZBVZeroBubble}[schedule]
    runner = cls.__new__(cls)  # what __init__ sets before it computes the orders
    runner.pp_group_size, runner._n_microbatches = N, M
    runner.n_local_stages, runner.num_stages = (2, 2 * N) if schedule == "zb-v" else (1, N)
    runner.number_of_rounds = max(1, M // N)
    runner.microbatches_per_round = M // runner.number_of_rounds
    orders = []
    for rank in range(N):
        steps = [a for a in runner._calculate_single_rank_operations(rank) if a is not None]
        orders.append([(names[a.computation_type], a.microbatch_index)
                       + ((0 if a.stage_index == rank else 1,) if schedule == "zb-v" else ())
                       for a in steps])
    return orders


def split_backward_seconds(num_layers=4, width=512, batch=256, repeats=5, seed=0):
    """A stage of ``num_layers`` Linear + Tanh layers (float32) in one process: the median
    seconds of its whole backward (autograd), and of the same backward split into B (the
    input's gradient, the weights put off: :func:`pipeline.weights_put_off`) and W (the
    weights' gradients: :func:`pipeline.weight_grads`). Returns ``{"backward", "B", "W"}``.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    stage = make_mlp(num_layers, width, seed, dtype=torch.float32)
    x = make_batch(batch, width, seed + 1, dtype=torch.float32)[0].requires_grad_()
    grad = torch.ones(batch, width)
    times = {"backward": [], "B": [], "W": []}
    for _ in range(repeats + 1):  # the first round warms up
        out = stage(x)
        start = time.perf_counter()
        out.backward(grad)
        times["backward"].append(time.perf_counter() - start)
        kept = []
        with pipeline.weights_put_off(stage, kept):
            out = stage(x)
        start = time.perf_counter()
        out.backward(grad)
        middle = time.perf_counter()
        for layer, layer_input, grad_out in kept:
            for param, g in pipeline.weight_grads(layer, layer_input, grad_out):
                param.grad += g
        end = time.perf_counter()
        times["B"].append(middle - start)
        times["W"].append(end - middle)
    return {k: sorted(v[1:])[repeats // 2] for k, v in times.items()}
