"""What tests and notebook 10 run on every rank: ZeRO stages against one process on the global
batch and against torch FSDP2 (``fully_shard``). Introduced in
notebooks/10_sharded_data_parallelism.ipynb."""

from __future__ import annotations

import copy
from collections import Counter
from functools import partial

import torch
from torch import nn

from course_lib.comm import get_comm
from course_lib.comm.subgroups import subgroup_comm
from course_lib.sharding import shard_bounds
from course_lib.zero import ZeroDataParallel, ZeroPrecision, planned_memory

OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def make_model(seed=0, sizes=(5, 7, 3)):
    """A float64 MLP whose layer sizes the world sizes 2-4 do not divide (42 and 24
    parameters). Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.Tanh(),
                         nn.Linear(sizes[1], sizes[2])).double()


def make_data(batch=12, sizes=(5, 7, 3), seed=1):
    """The global batch, the same on every rank: inputs of ``sizes[0]`` features, targets of
    ``sizes[-1]``. Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, sizes[0], generator=g, dtype=torch.float64),
            torch.randn(batch, sizes[-1], generator=g, dtype=torch.float64))


def one_process(optimizer="adam", steps=3, batch=12, seed=0, model="small"):
    """The reference: the whole model, the whole batch, one process. Returns the parameters.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    make, sizes = MODELS[model]
    model = make(seed=seed)
    opt = OPTIMIZERS[optimizer](model.parameters())
    x, y = make_data(batch, sizes)
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def zero_matches_one_process(stage, optimizer="adam", steps=3, world_size=None,
                             algorithm="ring", batch=12, seed=0, model="small", device="cpu"):
    """``steps`` of ZeRO ``stage`` on this rank's rows of the global batch; returns the largest
    difference of the parameters from :func:`one_process`, the largest change of the frozen
    ones, this rank's memory by kind and the bytes it sent per step, or None outside
    ``world_size``. ``model``: a name of ``MODELS``: "small" (2 layers, :func:`make_model`),
    "deep" (16 layers, :func:`deep_model`), "frozen-first" or "frozen-middle"
    (:func:`frozen_model`). ``device``: where the model and the batch live (the reference
    stays on the CPU).
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    comm = subgroup_comm(world_size)
    if comm is None:
        return None
    make, sizes = MODELS[model]
    name, model = model, ZeroDataParallel(make(seed=seed).to(device), OPTIMIZERS[optimizer],
                                          comm, stage, algorithm)
    peak = [0]

    def record(module, args):  # runs after the unit's own gather: what the forward holds
        peak[0] = max(peak[0], model.memory()["parameters"])
    for unit in model.units:
        unit.module.register_forward_pre_hook(record)
    x, y = (t.to(device) for t in make_data(batch, sizes))
    a, b = shard_bounds(batch, comm.rank, comm.world_size)
    sent = comm.bytes_sent
    for _ in range(steps):
        nn.functional.mse_loss(model(x[a:b]), y[a:b]).backward()
        model.step()
    sent = (comm.bytes_sent - sent) / steps
    reference = one_process(optimizer, steps, batch, seed, name)
    diff = max(float((p.cpu() - q).abs().max())
               for p, q in zip(model.full_parameters(), reference, strict=True))
    frozen = max((float((p.cpu() - q).abs().max()) for p, q in
                  zip(model.full_parameters(), make(seed=seed).parameters(), strict=True)
                  if not q.requires_grad), default=0.0)
    return {"diff": diff, "frozen_changed": frozen, "memory": model.memory(),
            "at_update": model.memory_at_update,
            "peak": model.peak, "sent_per_step": sent,
            "plan": planned_memory(make(seed=seed), comm.world_size, stage),
            "peak_parameters_in_forward": peak[0], "world_size": comm.world_size}


def fsdp2_matches(stage=3, optimizer="adam", steps=3, batch=12, seed=0):
    """The same training with torch FSDP2 (``fully_shard`` on each layer, then the model, over
    every rank) and with ZeRO ``stage``; returns the largest difference of their parameters.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    comm = get_comm("torch")
    x, y = make_data(batch)
    a, b = shard_bounds(batch, comm.rank, comm.world_size)
    ours = ZeroDataParallel(make_model(seed), OPTIMIZERS[optimizer], comm, stage)
    theirs = copy.deepcopy(make_model(seed))
    mesh = init_device_mesh("cpu", (comm.world_size,))
    for layer in theirs:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt = OPTIMIZERS[optimizer](theirs.parameters())
    for _ in range(steps):
        nn.functional.mse_loss(ours(x[a:b]), y[a:b]).backward()
        ours.step()
        nn.functional.mse_loss(theirs(x[a:b]), y[a:b]).backward()
        opt.step()
        opt.zero_grad()
    full = [p.full_tensor().detach() for p in theirs.parameters()]
    return max(float((p - q).abs().max())
               for p, q in zip(ours.full_parameters(), full, strict=True))


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}


def fsdp2_precision_matches(param_dtype="bf16", reduce_dtype=None, optimizer="adam", steps=3,
                            batch=12, seed=0):
    """ZeRO-3 with ``ZeroPrecision(param_dtype, reduce_dtype)`` (names of ``DTYPES``) and torch
    FSDP2 with the same ``MixedPrecisionPolicy``, on a float32 :func:`make_model` over every
    rank, beside ZeRO-3 in float32 (``optimizer``: a name of ``OPTIMIZERS``). Returns each
    one's losses on this rank's rows, the largest difference of ZeRO-3's float32 parameters
    from FSDP2's (and of the float32 run's), the dtypes each saw (the first layer's parameters,
    input and output in the forward, the sharded parameters, their gradients, the optimizer's
    state) and the bytes ours sent per step by dtype (the float32 run's in all).
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    param_dtype, reduce_dtype = DTYPES[param_dtype], DTYPES[reduce_dtype]
    comm, plain_comm = get_comm("torch"), get_comm("torch")
    sent, isend = Counter(), comm.isend

    def counting_isend(buf, *args, **kwargs):  # what the course's collectives send, by dtype
        sent[str(buf.dtype).removeprefix("torch.")] += buf.numel() * buf.element_size()
        return isend(buf, *args, **kwargs)
    comm.isend = counting_isend
    ours = ZeroDataParallel(make_model(seed).float(), OPTIMIZERS[optimizer], comm, 3,
                            precision=ZeroPrecision(param_dtype, reduce_dtype))
    plain = ZeroDataParallel(make_model(seed).float(), OPTIMIZERS[optimizer], plain_comm, 3)
    theirs = make_model(seed).float()
    mesh = init_device_mesh("cpu", (comm.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in theirs:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)
    opt = OPTIMIZERS[optimizer](theirs.parameters())
    x, y = (t.float() for t in make_data(batch))
    rows = slice(*shard_bounds(batch, comm.rank, comm.world_size))

    def dtypes(tensors):
        return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})

    def train(model, layer, shards, optimizer, step):
        """``steps`` steps of ``model``: its losses and the dtypes seen."""
        seen = {}

        def before(module, args):  # registered after the wrapper's gather: what it computes in
            seen.update(parameters=dtypes(module.parameters()), input=dtypes(args))
        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(lambda module, args, out: seen.update(output=dtypes([out])))
        losses = []
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x[rows]).float(), y[rows])
            losses.append(float(loss))
            loss.backward()
            seen["gradients"] = dtypes(s.grad for s in shards)  # of the sharded parameters
            step()
        seen.update(shards=dtypes(shards), optimizer=dtypes(
            v for state in optimizer.state.values() for v in state.values() if v.dim() > 0))
        return losses, seen

    def torch_step():
        opt.step()
        opt.zero_grad()
    out = {}
    out["losses"], out["dtypes"] = train(ours, ours.units[0].module,
                                         [u.shard for u in ours.units], ours.optimizer, ours.step)
    out["sent"] = {dtype: n / steps for dtype, n in sent.items()}
    out["torch_losses"], out["torch_dtypes"] = train(theirs, theirs[0], list(theirs.parameters()),
                                                     opt, torch_step)
    out["fp32_losses"], _ = train(plain, plain.units[0].module, [u.shard for u in plain.units],
                                  plain.optimizer, plain.step)
    out["fp32_sent"] = plain_comm.bytes_sent / steps
    full = [p.full_tensor().detach() for p in theirs.parameters()]
    for name, model in (("diff", ours), ("fp32_diff", plain)):
        out[name] = max(float((p - q).abs().max())
                        for p, q in zip(model.full_parameters(), full, strict=True))
    return out


def deep_model(layers=16, width=32, seed=0):
    """A float64 MLP of ``layers`` Linear(width, width) + Tanh: many equal layers, so that
    ZeRO-3's one gathered layer is a small part of the whole. Introduced in
    notebooks/10_sharded_data_parallelism.ipynb."""
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks).double()


def train_under_budget(budget, stage=3, world_size=None, steps=5, layers=16, width=32,
                       batch=16, seed=0):
    """Train :func:`deep_model` with ZeRO ``stage`` under a memory budget of ``budget`` bytes
    per rank (Adam). Returns the losses on the global batch, the most this rank held and the
    largest difference from one process on the whole batch without a budget; or, when the
    state does not fit, the refusal (raised before training). None outside ``world_size``.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    from course_lib.zero import DoesNotFit
    comm = subgroup_comm(world_size)
    if comm is None:
        return None
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, width, generator=g, dtype=torch.float64)
    y = torch.randn(batch, width, generator=g, dtype=torch.float64)
    def adam(params):
        return torch.optim.Adam(params, lr=3e-3)
    try:
        model = ZeroDataParallel(deep_model(layers, width, seed), adam, comm, stage,
                                 memory_budget=budget)
    except DoesNotFit as refusal:
        return {"refused": str(refusal), "world_size": comm.world_size}
    reference = deep_model(layers, width, seed)
    optimizer = adam(reference.parameters())
    a, b = shard_bounds(batch, comm.rank, comm.world_size)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x[a:b]), y[a:b])
        loss.backward()
        model.step()
        whole = nn.functional.mse_loss(reference(x), y)  # the global batch's loss
        losses.append(float(whole))
        whole.backward()
        optimizer.step()
        optimizer.zero_grad()
    diff = max(float((p - q.detach()).abs().max())
               for p, q in zip(model.full_parameters(), reference.parameters(), strict=True))
    return {"refused": None, "losses": losses, "peak": model.peak, "diff": diff,
            "world_size": comm.world_size}


def frozen_model(seed=0, frozen="first"):
    """A float64 MLP of 3 Linear layers (5 -> 7 -> 4 -> 3) with frozen parameters: a whole layer
    and one tensor of another. ``frozen``: "first" (the first layer, which the backward then
    does not reach, and the last layer's bias) or "middle" (the middle layer, which the
    gradient passes through, and the first layer's bias).
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4), nn.Tanh(),
                          nn.Linear(4, 3)).double()
    layer, bias = {"first": (0, 4), "middle": (2, 0)}[frozen]
    model[layer].requires_grad_(False)
    model[bias].bias.requires_grad_(False)
    return model


MODELS = {"small": (make_model, (5, 3)), "deep": (deep_model, (32, 32)),
          "frozen-first": (partial(frozen_model, frozen="first"), (5, 3)),
          "frozen-middle": (partial(frozen_model, frozen="middle"), (5, 3))}


def sharded_optimizer_against_torch(steps: int = 3, seed: int = 0) -> dict:
    """The course's :class:`zero_optimizer.ShardedOptimizer` and torch's
    ``ZeroRedundancyOptimizer`` (Adam, two parameter groups) on two copies of one model, the
    gradients of this rank's rows averaged over the ranks, ``steps`` steps; then each one's
    consolidated state on rank 0, and a plain Adam in one process that continues from the
    course's state. Returns the partitions, the largest difference of the parameters, of the
    saved states, and of one more step taken by the plain Adam and by both sharded ones.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from course_lib.collectives import allreduce
    from course_lib.zero_optimizer import ShardedOptimizer
    comm = get_comm("torch")
    ours, theirs = make_model(seed, (5, 16, 3)), make_model(seed, (5, 16, 3))  # the same

    def groups(model):  # weights and biases apart, another learning rate for the biases
        named = list(model.named_parameters())
        return [{"params": [p for n, p in named if n.endswith("weight")]},
                {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.05}]

    opts = [ShardedOptimizer(groups(ours), torch.optim.Adam, comm, lr=0.01),
            ZeroRedundancyOptimizer(groups(theirs)[0]["params"], torch.optim.Adam, lr=0.01)]
    opts[1].add_param_group(groups(theirs)[1])
    x, y = make_data(12, (5, 16, 3))
    rows = slice(*shard_bounds(12, comm.rank, comm.world_size))

    def train(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            for p in model.parameters():
                allreduce(p.grad, comm, op="average", check=False)
            opt.step()

    for model, opt in zip((ours, theirs), opts, strict=True):
        train(model, opt, steps)
    params = max(float((a - b).abs().max()) for a, b in zip(ours.parameters(),
                                                               theirs.parameters(), strict=True))
    torch_owner = {id(p): r for r, groups_r in enumerate(opts[1]._partition_parameters())
                   for g in groups_r for p in g["params"]}
    every = [p for g in opts[1].param_groups for p in g["params"]]
    for opt in opts:
        opt.consolidate_state_dict(to=0)
    out = dict(params=params, owners=opts[0].owners,
               torch_owners=[torch_owner[id(p)] for p in every])
    if comm.rank == 0:
        mine, torch_state = opts[0].state_dict(), opts[1].state_dict()
        out["state"] = max(float((mine["state"][i][k] - torch_state["state"][i][k]).abs().max())
                           for i in mine["state"] for k in ("exp_avg", "exp_avg_sq"))
        plain_model = copy.deepcopy(ours)  # one process continues from the course's state
        plain = torch.optim.Adam(groups(plain_model)[0]["params"], lr=0.01)
        plain.add_param_group(groups(plain_model)[1])
        plain.load_state_dict(mine)
        plain.zero_grad()
        nn.functional.mse_loss(plain_model(x), y).backward()
        plain.step()
        out["plain_model"] = [p.detach().clone() for p in plain_model.parameters()]
    dist.barrier()
    for model, opt in zip((ours, theirs), opts, strict=True):  # one more step, whole batch
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if comm.rank == 0:
        out["continued"] = max(float((a - b).abs().max()) for a, b in zip(
            ours.parameters(), out.pop("plain_model"), strict=True))
        out["continued_torch"] = max(float((a - b).abs().max()) for a, b in zip(
            ours.parameters(), theirs.parameters(), strict=True))
    return out
