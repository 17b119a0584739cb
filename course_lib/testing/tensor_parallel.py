"""What runs on the ranks to check the from-scratch tensor parallelism against one process and
against torch's own (``torch.distributed.tensor.parallel``).

Introduced in notebooks/09_model_parallelism.ipynb. Every rank builds the same unsplit MLP from a
seed, splits it with :mod:`course_lib.tensor_parallel` over the first ``world_size`` ranks, runs
forward and backward on the same input and compares with the unsplit model in one process::

    runs = cluster.run(testing.tensor_parallel.tp_matches_one_process, 2)  # None past rank 1
    runs[0]["max"], runs[0]["counts"]         # ~1e-16 in float64, {'forward': 1, 'backward': 1}
    cluster.run(testing.tensor_parallel.tp_matches_torch)[0]["max"]       # ours vs torch's TP

A parameter's gradient is compared shard to slice: rank r's column-parallel weight gradient with
rows ``layer.rows`` of the unsplit one, a row-parallel one with columns ``layer.cols``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from course_lib.comm.subgroups import subgroup_comm
from course_lib.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    TensorParallel,
)

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


def reference_model(kind="mlp", blocks=1, d_model=12, hidden=16, activation="gelu", seed=0):
    """The unsplit float64 model, the same on every rank: ``blocks`` MLP blocks
    (``Sequential(Linear, act, Linear)`` each) for ``kind="mlp"``, or one
    ``Linear(d_model, hidden)`` for ``kind="gather"`` (split with ``gather_output=True``).

    Introduced in notebooks/09_model_parallelism.ipynb."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "gather":
            return nn.Linear(d_model, hidden).double()
        if kind != "mlp":
            raise ValueError(f"kind must be 'mlp' or 'gather', not {kind!r}")
        mlps = [nn.Sequential(nn.Linear(d_model, hidden), ACTIVATIONS[activation](),
                              nn.Linear(hidden, d_model)) for _ in range(blocks)]
        return (mlps[0] if blocks == 1 else nn.Sequential(*mlps)).double()


def split_reference_model(model, tp):
    """``reference_model``'s model split over ``tp``'s ranks (its weights copied, not shared).

    Introduced in notebooks/09_model_parallelism.ipynb."""
    if isinstance(model, nn.Linear):
        return ColumnParallelLinear.from_linear(model, tp, gather_output=True)
    if isinstance(model[0], nn.Linear):
        return ParallelMLP.from_mlp(model, tp)
    return nn.Sequential(*[ParallelMLP.from_mlp(block, tp) for block in model])


def _input(model, batch, seed):
    """The input, the same on every rank: ``batch`` rows of the first layer's width."""
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return torch.randn(batch, first.in_features, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(first.weight.device)


def _forward_backward(net, x, seed, input_grad=True):
    """Output and input gradient (None without ``input_grad``) of ``sum(net(x) * w)``, ``w``
    random from ``seed``."""
    x = x.detach().clone().requires_grad_(input_grad)
    out = net(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                    dtype=out.dtype).to(out.device)
    (out * w).sum().backward()
    return out.detach(), x.grad


def _slice_of(layer, name, full):
    """The part of an unsplit parameter (or gradient) that ``layer`` holds on this rank."""
    if isinstance(layer, ColumnParallelLinear):
        return full[layer.rows[0]:layer.rows[1]]
    if isinstance(layer, RowParallelLinear) and name == "weight":
        return full[:, layer.cols[0]:layer.cols[1]]
    return full


def compare_with_one_process(comm, batch=8, d_model=12, hidden=16, seed=0, blocks=1, kind="mlp",
                             activation="gelu", input_grad=True, device="cpu"):
    """Split the reference model over ``comm``'s ranks and compare with it, unsplit, here.

    Returns ``{"output", "input_grad": max abs difference, "param_grads": {name: difference},
    "max": the largest, "counts": the collectives, {"forward": n, "backward": n}}``.
    ``input_grad=False``: the input needs no gradient (as a network's first layer's), so the
    first layer's backward allreduce is skipped and "input_grad" is None. ``device``: where
    both models and the input live ("cuda": the same on a GPU).
    Introduced in notebooks/09_model_parallelism.ipynb."""
    model = reference_model(kind, blocks, d_model, hidden, activation, seed).to(device)
    tp = TensorParallel(comm)
    net = split_reference_model(model, tp)
    x = _input(model, batch, seed + 1)
    ref_out, ref_dx = _forward_backward(model, x, seed + 2, input_grad)
    out, dx = _forward_backward(net, x, seed + 2, input_grad)
    full = dict(model.named_parameters())
    grads = {}
    for name, p in net.named_parameters():
        owner, _, leaf = name.rpartition(".")
        layer = net.get_submodule(owner) if owner else net
        grads[name] = float((p.grad - _slice_of(layer, leaf, full[name].grad)).abs().max())
    diffs = {"output": float((out - ref_out).abs().max()),
             "input_grad": None if dx is None else float((dx - ref_dx).abs().max()),
             "param_grads": grads}
    diffs["max"] = max(diffs["output"], diffs["input_grad"] or 0.0, *grads.values())
    diffs["counts"] = dict(tp.counts)
    return diffs


def tp_matches_one_process(world_size=None, batch=8, d_model=12, hidden=16, seed=0, blocks=1,
                           kind="mlp", activation="gelu", input_grad=True, device="cpu"):
    """On every rank: ``compare_with_one_process`` over the first ``world_size`` ranks (default
    all); the other ranks return None. Introduced in notebooks/09_model_parallelism.ipynb."""
    comm = subgroup_comm(world_size)
    if comm is None:
        return None
    return compare_with_one_process(comm, batch, d_model, hidden, seed, blocks, kind,
                                    activation, input_grad, device)


def tp_matches_torch(world_size=None, batch=8, d_model=12, hidden=16, seed=0, activation="gelu"):
    """On every rank: one MLP block split by us and by torch (``parallelize_module`` with
    ``{"0": ColwiseParallel(), "2": RowwiseParallel()}`` on a CPU DeviceMesh over Gloo), forward
    and backward on the same input. Returns the max abs differences ``{"output", "input_grad",
    "param_grads": {name: ours vs torch's local shard}, "max"}``; None past ``world_size``.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    comm = subgroup_comm(world_size)
    if comm is None:
        return None
    model = reference_model("mlp", 1, d_model, hidden, activation, seed)
    ours = ParallelMLP.from_mlp(model, TensorParallel(comm))
    mesh = DeviceMesh.from_group(comm.group or dist.group.WORLD, "cpu")
    theirs = parallelize_module(copy.deepcopy(model), mesh,
                                {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = _input(model, batch, seed + 1)
    out, dx = _forward_backward(ours, x, seed + 2)
    t_out, t_dx = _forward_backward(theirs, x, seed + 2)
    mine = dict(ours.named_parameters())
    grads = {name: float((mine[name].grad - p.grad.to_local()).abs().max())
             for name, p in theirs.named_parameters()}
    diffs = {"output": float((out - t_out).abs().max()),
             "input_grad": float((dx - t_dx).abs().max()), "param_grads": grads}
    diffs["max"] = max(diffs["output"], diffs["input_grad"], *grads.values())
    return diffs


def collective_matmul_matches(batch=2, tokens=12, d_model=6, hidden=8, world_size=None,
                              seed=0):
    """The column-parallel layer on this rank's ``tokens / N`` tokens (float64), its all-gather
    apart (``GatheredLinear``) and hidden behind the products (``CollectiveLinear``): the
    largest difference of the output and of the gradients of x, the weight and the bias, and
    each one's collectives counted. None outside ``world_size``.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    from course_lib.sequence_parallel import CollectiveLinear, GatheredLinear
    comm = subgroup_comm(world_size)
    if comm is None:
        return None
    n, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, d_model, generator=g, dtype=torch.float64)
    weight = torch.randn(hidden, d_model, generator=g, dtype=torch.float64)
    bias = torch.randn(hidden, generator=g, dtype=torch.float64)
    rows = slice(r * hidden // n, (r + 1) * hidden // n)  # this rank's columns of the output
    mine = x[:, r * tokens // n:(r + 1) * tokens // n]
    results = {}
    for name, layer in (("apart", GatheredLinear), ("hidden", CollectiveLinear)):
        tp = TensorParallel(comm)
        leaves = [t.detach().clone().requires_grad_() for t in (mine, weight[rows], bias[rows])]
        out = layer.apply(*leaves, tp)
        out.backward(torch.ones_like(out))
        results[name] = (out.detach(), [t.grad for t in leaves], tp.counts)
    (out_a, grads_a, counts_a), (out_h, grads_h, counts_h) = results["apart"], results["hidden"]
    plain = nn.functional.linear(x, weight[rows], bias[rows])  # one process, all tokens
    return {"output": max(float((out - plain).abs().max()) for out in (out_a, out_h)),
            "grads": max(float((a - h).abs().max()) for a, h in zip(grads_a, grads_h,
                                                                    strict=True)),
            "counts": (counts_a, counts_h)}


def collective_matmul_times(link=None, tokens=512, d_model=512, hidden=2048, repeats=5,
                            world_size=None, timeout=30.0):
    """On this rank, the column-parallel layer's forward (float32; ``tokens / N`` tokens per
    rank, ``hidden / N`` output features), every rank starting together, medians of
    ``repeats`` after one warm-up: ``"gather"`` (the ring all-gather alone), ``"apart"``
    (all-gather, then the matmul), ``"hidden"`` (:func:`sequence_parallel.collective_matmul`),
    and inside it ``"exposed"`` (its waits: the gather's time the products did not cover) and
    ``"product"`` (one block's product); ``"message"``: one block's time on the emulated
    ``link`` (α + bytes / B; 0 without a link); ``"timeline"``: the last collective matmul's
    spans. None outside ``world_size``. Introduced in notebooks/09_model_parallelism.ipynb."""
    import time

    from course_lib.runtime import netem
    from course_lib.runtime.timeline import Timeline
    from course_lib.sequence_parallel import collective_matmul, gather_sequence
    comm = subgroup_comm(world_size, timeout)
    if comm is None:
        return None
    comm.link = netem.make_link(link) if link else None
    n, tp = comm.world_size, TensorParallel(comm)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(1, tokens // n, d_model, generator=g)
    weight, bias = torch.randn(hidden // n, d_model, generator=g), torch.zeros(hidden // n)
    runs = {"gather": [], "apart": [], "hidden": [], "exposed": [], "product": []}
    for _ in range(repeats + 1):
        for name in ("gather", "apart", "hidden"):
            tl = Timeline(comm.rank)
            comm.barrier()
            start = netem.start_together(comm)
            if name == "gather":
                gather_sequence(x, tp)
            elif name == "apart":
                nn.functional.linear(gather_sequence(x, tp), weight, bias)
            else:
                collective_matmul(x, weight, bias, tp, timeline=tl)
            runs[name].append(time.monotonic() - start)
        spans = {cat: [e.end - e.start for e in tl.events if e.cat == cat]
                 for cat in ("wait", "compute")}
        runs["exposed"].append(sum(spans["wait"]))
        runs["product"].append(sum(spans["compute"]) / n)
    times = {k: sorted(v[1:])[repeats // 2] for k, v in runs.items()}
    times["message"] = comm.link.seconds(x.numel() * x.element_size()) if comm.link else 0.0
    return {**times, "timeline": tl}


def hidden_fraction(reports):
    """From every rank's :func:`collective_matmul_times`: the share of the all-gather's time
    the collective matmul hid, measured (1 - its exposed waits / the gather alone, the mean
    over the ranks) and by the α-β model (min(1, m / c): a block's product m covers its
    message c), with the means of m, c, the gather and both forwards. Introduced in
    notebooks/09_model_parallelism.ipynb."""
    reports = [r for r in reports if r is not None]
    mean = {k: sum(r[k] for r in reports) / len(reports)
            for k in ("gather", "apart", "hidden", "exposed", "product", "message")}
    measured = sum(1 - r["exposed"] / r["gather"] for r in reports) / len(reports)
    m, c = mean["product"], mean["message"]
    return {"measured": measured, "model": min(1.0, m / c) if c else 1.0, **mean}
