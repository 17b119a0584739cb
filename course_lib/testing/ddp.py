"""What runs on the ranks to check the from-scratch data parallelism against the real thing.

Introduced in notebooks/06_data_parallel_sgd.ipynb. ``train_on_rank`` trains a small network on
the digits with this rank's slice of every global batch and returns the parameters after each
step; ``single_process`` does the same with the whole batch in one process. Equal parameters
mean N ranks with B/N samples each == one process with B samples; equal to ``strategy="torch"``
means equal to torch's DistributedDataParallel::

    runs = cluster.run(testing.ddp.train_on_rank, "overlap")    # one list per rank
    ref = testing.ddp.single_process()
    max(abs(a - b).max() for a, b in zip(runs[0]["params"], ref))   # ~1e-16 in float64

The loss of a rank is its summed loss times N / B, so the average over the ranks is the mean
over the global batch even when B is not divisible by N. Variants of the network exercise the
corner cases: ``tied`` (one weight used twice), ``frozen`` (the first layer does not train) and
``unused`` (a layer no rank uses, and one only rank 0 uses).

``torch_ddp_buckets`` watches torch's DDP bucket its gradients, step by step, through a
communication hook (``record_bucket``); ``course_ddp_buckets`` lists the course's buckets for
the same model and caps::

    seen = cluster.run(testing.ddp.torch_ddp_buckets)[0]   # [(cap_mb, step, buckets)]
    ours = cluster.run(testing.ddp.course_ddp_buckets)[0]  # {cap_mb: buckets}
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import data, ddp, horovod, models
from course_lib.runtime import timeline
from course_lib.sharding import shard_bounds

VARIANTS = ("mlp", "tied", "frozen", "unused", "batchnorm")


class Net(nn.Module):
    """``models.mlp`` on the digits, plus the layers a variant needs."""

    def __init__(self, hidden=(64,), variant="mlp", seed=0):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
        self.variant = variant
        self.body = models.mlp(64, list(hidden), 10, seed=seed)
        if variant in ("tied", "unused"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 1)
                self.a, self.b = nn.Linear(10, 10, bias=False), nn.Linear(10, 10)
        if variant == "tied":
            self.b.weight = self.a.weight
        if variant == "frozen":
            self.body[0].requires_grad_(False)
        if variant == "batchnorm":  # buffers: running mean and variance, trained by no gradient
            self.body.insert(1, nn.BatchNorm1d(self.body[0].out_features))

    def forward(self, x):
        out = self.body(x)
        if self.variant == "tied":
            return self.b(torch.relu(self.a(out)))
        if self.variant == "unused":  # a is used by rank 0 only, b by nobody
            import torch.distributed as dist
            if dist.is_initialized() and dist.get_rank() == 0:
                return out + 0.1 * self.a(out)
        return out


def _setup(batch, steps, hidden, variant, dtype, seed, device="cpu"):
    X, y, _, _ = data.load_digits()
    rng = np.random.default_rng(seed)
    order = [rng.choice(len(X), size=batch, replace=False) for _ in range(steps)]
    net = Net(hidden, variant, seed).to(getattr(torch, dtype)).to(device)
    return (torch.from_numpy(X).to(getattr(torch, dtype)).to(device),
            torch.from_numpy(y).long().to(device), order, net)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().copy()


def _flat_buffers(model):
    buffers = [b.detach().double().reshape(-1) for b in model.buffers()]
    return torch.cat(buffers).cpu().numpy().copy() if buffers else np.zeros(0)


def train_on_rank(strategy="overlap", algorithm="native", steps=3, batch=64, hidden=(64,),
                  variant="mlp", dtype="float64", bucket_cap_mb=0.01, lr=0.1, momentum=0.9,
                  wrapper="ddp", record=False, seed=0, accumulate=1, broadcast_buffers=True,
                  device="cpu"):
    """Train on this rank's slices; returns ``{"params": [flat vector after each step],
    "buffers": [flat buffers after each step], "no_grad": [trainable parameters whose grad was
    None at the last step], "timeline": Timeline or None}``.

    ``strategy`` is one of ``ddp.STRATEGIES`` or ``"torch"`` (torch's DDP); ``wrapper`` picks
    ``"ddp"`` (the DDP-like module), ``"optimizer"`` (Horovod style), ``"functional"``
    (``horovod.average_gradients`` after backward) or ``"naive"``
    (``ddp.average_gradients_naive``).
    ``accumulate=k`` cuts the rank's slice into k micro-batches, all but the last backward
    inside ``no_sync()`` (gradient accumulation). ``device``: where the model and the data
    live ("cuda": the gradients are CUDA tensors).
    """
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    X, y, order, model = _setup(batch, steps, hidden, variant, dtype, seed, device)
    tl = timeline.Timeline(rank, enabled=record)
    unused = variant == "unused"
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    net = model
    if strategy == "torch":
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                                  find_unused_parameters=unused,
                                                  broadcast_buffers=broadcast_buffers)
    elif wrapper == "ddp":
        net = ddp.DistributedDataParallel(model, strategy, bucket_cap_mb, algorithm,
                                          find_unused_parameters=unused, timeline=tl,
                                          broadcast_buffers=broadcast_buffers)
    elif wrapper == "optimizer":
        ddp.broadcast_parameters(model)
        opt = horovod.DistributedOptimizer(opt, model.named_parameters(), strategy,
                                           bucket_cap_mb, algorithm,
                                           find_unused_parameters=unused, timeline=tl)
        horovod.broadcast_optimizer_state(opt)
    elif wrapper not in ("functional", "naive"):
        raise ValueError("wrapper must be 'ddp', 'optimizer', 'functional' or 'naive', not "
                         f"{wrapper!r}")
    params, buffers = [], []
    for idx in order:
        lo, hi = shard_bounds(batch, rank, world)
        for m in range(accumulate):
            a, b = shard_bounds(hi - lo, m, accumulate)
            part = idx[lo + a:lo + b]
            quiet = m < accumulate - 1 and hasattr(net, "no_sync")
            with net.no_sync() if quiet else contextlib.nullcontext():
                loss = F.cross_entropy(net(X[part]), y[part], reduction="sum")
                (loss * (world / batch)).backward()
        if wrapper == "functional" and strategy != "torch":
            horovod.average_gradients(model.parameters(), strategy, bucket_cap_mb, algorithm)
        elif wrapper == "naive":  # one blocking allreduce per gradient, whatever the strategy
            ddp.average_gradients_naive(model.parameters())
        # the Horovod-style optimizer records its own step
        with tl.span("step") if wrapper != "optimizer" else contextlib.nullcontext():
            opt.step()
        no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        opt.zero_grad()
        params.append(_flat(model))
        buffers.append(_flat_buffers(model))
    return {"params": params, "buffers": buffers, "no_grad": no_grad,
            "timeline": tl if record else None}


def single_process(steps=3, batch=64, hidden=(64,), variant="mlp", dtype="float64", lr=0.1,
                   momentum=0.9, seed=0):
    """The reference: one process, the whole global batch each step; flat parameters per step."""
    X, y, order, model = _setup(batch, steps, hidden, variant, dtype, seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    params = []
    for idx in order:
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
        params.append(_flat(model))
    return params


def max_difference(runs, reference):
    """The largest element-wise difference, over ranks and steps, from ``reference``."""
    return max(float(np.abs(a - b).max()) for run in runs
               for a, b in zip(run["params"], reference, strict=True))


def missing_rank(timeout=2.0, strategy="overlap"):
    """Rank 0 trains one step; the other ranks never call backward. Rank 0 must fail with a
    ``DDPError`` naming itself, the bucket and its size within ``timeout``; returns
    ``(error message or None, seconds waited)``."""
    import time

    import torch.distributed as dist
    X, y, order, model = _setup(8, 1, (16,), "mlp", "float32", 0)
    net = ddp.DistributedDataParallel(model, strategy, timeout=timeout)
    if dist.get_rank() != 0:
        return None, 0.0
    start = time.perf_counter()
    try:
        F.cross_entropy(net(X[order[0]]), y[order[0]]).backward()
    except ddp.DDPError as e:
        return str(e), time.perf_counter() - start
    return None, time.perf_counter() - start


def unused_without_flag():
    """A reducer over two layers of which backward reaches one, without
    ``find_unused_parameters``: ``finish`` must raise a DDPError naming the other."""
    net = nn.ModuleDict({"used": nn.Linear(2, 1), "spare": nn.Linear(2, 1)})
    reducer = ddp.OverlappingReducer(net.named_parameters())
    net["used"](torch.ones(1, 2)).sum().backward()
    reducer.finish()


def broadcasts_on_rank():
    """Ranks start from different weights and optimizer states; after ``broadcast_parameters``
    and ``broadcast_optimizer_state`` they hold rank 0's. Returns (weights, momentum, lr)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    model = models.mlp(4, 3, 2, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.25 if rank == 0 else 1.0, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # creates momentum buffers, different on every rank
    ddp.broadcast_parameters(model)
    horovod.broadcast_optimizer_state(opt)
    mom = [opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()]
    return _flat(model), torch.cat(mom).numpy(), opt.param_groups[0]["lr"]


def mismatched_models(where="wrapper"):
    """Rank 1 builds a wider model than rank 0: the wrapper's first broadcast (``"wrapper"``)
    or the gradient buckets (``"reducer"``) must raise a DDPError on every rank that lists
    both layouts, before any gradient moves."""
    import torch.distributed as dist
    model = models.mlp(4, (16,) if dist.get_rank() == 0 else (17,), 2)
    if where == "wrapper":
        ddp.DistributedDataParallel(model, timeout=5.0)
    model(torch.ones(1, 4)).sum().backward()
    horovod.average_gradients(model.parameters(), timeout=5.0)


def record_bucket(state, bucket):
    """A torch DDP communication hook (``register_comm_hook(state, record_bucket)``), called
    once per bucket of every step: appends the names of the bucket's parameters to
    ``state["seen"]`` (``state["names"]`` maps ``id(p)`` to a name), then averages the bucket
    as DDP does without a hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    state["seen"].append([state["names"][id(p)] for p in bucket.parameters()])
    return allreduce_hook(None, bucket)


def torch_ddp_buckets(hidden=(512, 512, 512), caps=(None, 0.25), steps=2, batch=32,
                      find_unused_parameters=False, seed=0):
    """On every rank: for each cap, ``models.mlp(64, hidden, 10)`` wrapped in torch's DDP
    (``bucket_cap_mb=cap``; None is its default) trains ``steps`` steps on random data; returns
    ``[(cap, step, buckets)]``, each bucket the list of parameter names DDP's communication hook
    received, in the order it called the hook."""
    record = []
    for cap in caps:
        model = models.mlp(64, list(hidden), 10, seed=seed)
        state = {"names": {id(p): n for n, p in model.named_parameters()}, "seen": []}
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap,
                                                  find_unused_parameters=find_unused_parameters)
        net.register_comm_hook(state, record_bucket)
        gen = torch.Generator().manual_seed(seed)
        for step in range(1, steps + 1):
            state["seen"] = []
            net(torch.randn(batch, 64, generator=gen)).sum().backward()
            record.append((cap, step, state["seen"]))
    return record


def course_ddp_buckets(hidden=(512, 512, 512), caps=(None, 0.25), strategy="overlap", seed=0):
    """On every rank: the buckets (lists of parameter names) of ``ddp.DistributedDataParallel``
    around ``models.mlp(64, hidden, 10)`` for each ``bucket_cap_mb`` in ``caps``, as
    ``{cap: buckets}``."""
    return {cap: ddp.DistributedDataParallel(models.mlp(64, list(hidden), 10, seed=seed),
                                             strategy, bucket_cap_mb=cap).buckets
            for cap in caps}
