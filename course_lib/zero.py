"""Sharded data parallelism: ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020), built from the
ring reduce-scatter and all-gather of notebook 05.

Introduced in notebooks/10_sharded_data_parallelism.ipynb. Data parallelism (notebook 06) keeps
the whole training state on every rank: parameters, gradients and optimizer state (Adam: two
numbers per parameter). ZeRO keeps one copy of the state *across* the ranks instead:

- stage 1: each rank keeps the optimizer state of its 1/N shard of the parameters only. The
  gradients are reduce-scattered (each rank gets the sum of its shard), each rank updates its
  shard, and the parameters are all-gathered. Same bytes as DDP's allreduce (which *is* a
  reduce-scatter plus an all-gather), 1/N of the optimizer state.
- stage 2: after the reduce-scatter only the gradient shard is kept; the full gradients are freed.
- stage 3: the parameters are sharded too. A layer's parameters are all-gathered just before
  its forward, freed after it, gathered again before its backward and freed after it (FSDP):
  1.5x DDP's bytes, 1/N of all the state.

Each top-level child of the model with parameters is one *unit* (FSDP's wrapping): its
parameters are flattened into one vector, cut into N contiguous shards with ``shard_bounds``
(any size: the last shards may be one element shorter), and the optimizer sees one tensor per
unit, this rank's shard::

    model = ZeroDataParallel(net, lambda shards: torch.optim.Adam(shards, lr=1e-3), comm, stage=3)
    loss = loss_fn(model(x_local), y_local)   # this rank's part of the global batch
    loss.backward()
    model.step()                              # average, update, and (stages 1-2) all-gather
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib.collectives import allreduce, ring_allgather, ring_reduce_scatter
from course_lib.data import shard_bounds

STAGES = (0, 1, 2, 3)  # 0: plain data parallelism (an allreduce), for comparison


def _flatten(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


class _Unit:
    """One module's parameters as a flat vector, sharded over the ranks."""

    def __init__(self, module, comm):
        self.module, self.comm = module, comm
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.stop = shard_bounds(self.numel, comm.rank, comm.world_size)
        with torch.no_grad():
            self.shard = _flatten(self.params)[self.start:self.stop].clone()  # what rank owns

    def gather(self, algorithm):
        """Every rank's shard into a full flat vector, copied into the parameters."""
        full = self.shard.new_zeros(self.numel)
        full[self.start:self.stop] = self.shard
        _all_gather(full, self.comm, algorithm)
        offset = 0
        for p in self.params:
            if p.untyped_storage().size() == 0:  # freed by release(): allocate it again
                p.data.untyped_storage().resize_(p.numel() * p.element_size())
            p.data.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def release(self):
        """Free the full parameters (their storage: autograd's saved references stay valid
        and see the data again after the next gather)."""
        for p in self.params:
            p.data.untyped_storage().resize_(0)

    def reduce_scatter_grads(self, algorithm, keep_full):
        """Sum the gradients over the ranks; this rank's shard of the mean becomes the shard's
        gradient. ``keep_full=False`` frees the full gradients (stages 2 and 3)."""
        flat = _flatten([p.grad if p.grad is not None else torch.zeros_like(p)
                         for p in self.params])
        _reduce_scatter(flat, self.comm, algorithm)
        self.shard.grad = flat[self.start:self.stop] / self.comm.world_size
        if not keep_full:
            for p in self.params:
                p.grad = None


def _reduce_scatter(flat, comm, algorithm):
    """Sum ``flat`` over the ranks, at least on this rank's chunk (``shard_bounds``)."""
    if comm.world_size == 1:
        return
    if algorithm == "ring":
        ring_reduce_scatter(flat, comm, check=False)
    else:  # Gloo has no reduce-scatter of uneven chunks: an allreduce gives every chunk
        import torch.distributed as dist
        dist.all_reduce(flat, group=getattr(comm, "group", None))


def _allreduce(flat, comm, algorithm):
    """Sum ``flat`` over the ranks (DDP): the ring's reduce-scatter then all-gather, or Gloo's."""
    if comm.world_size == 1:
        return
    if algorithm == "ring":
        allreduce(flat, comm, "ring", check=False)
    else:
        import torch.distributed as dist
        dist.all_reduce(flat, group=getattr(comm, "group", None))


def _all_gather(full, comm, algorithm):
    """Fill ``full`` with every rank's chunk (each rank has written its own)."""
    if comm.world_size == 1:
        return
    if algorithm == "ring":
        ring_allgather(full, comm, check=False)
    else:  # chunks are zero elsewhere, so a sum gathers them
        import torch.distributed as dist
        dist.all_reduce(full, group=getattr(comm, "group", None))


class ZeroDataParallel(nn.Module):
    """``module`` trained data-parallel with ZeRO ``stage`` 0-3 over ``comm`` (see the module
    docstring). ``make_optimizer(shards)`` builds the optimizer over this rank's shards (stage
    0: over all parameters). ``algorithm``: "ring" (the course's collectives) or "native".

    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""

    def __init__(self, module, make_optimizer, comm, stage=1, algorithm="ring"):
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
        if algorithm not in ("ring", "native"):
            raise ValueError(f"algorithm must be 'ring' or 'native', not {algorithm!r}")
        self.module, self.comm, self.stage, self.algorithm = module, comm, stage, algorithm
        self.memory_at_update = None  # memory() just before the last optimizer update
        children = [m for m in module.children() if any(True for _ in m.parameters())]
        units = children if children and sum(
            sum(p.numel() for p in m.parameters()) for m in children) == sum(
            p.numel() for p in module.parameters()) else [module]
        self.units = [_Unit(m, comm) for m in units]
        if stage == 0:
            self.optimizer = make_optimizer([p for u in self.units for p in u.params])
        else:
            self.optimizer = make_optimizer([u.shard for u in self.units])
        if stage == 3:
            for unit in self.units:
                unit.release()
                self._hook(unit)

    def _hook(self, unit):
        """Stage 3: gather a unit's parameters before its forward and before its backward,
        free them after each."""
        module, algorithm = unit.module, self.algorithm
        def after_forward(m, args, out):
            unit.release()
            if torch.is_tensor(out) and out.requires_grad:  # its gradient arrives first
                out.register_hook(lambda grad: unit.gather(algorithm))
        module.register_forward_pre_hook(lambda m, args: unit.gather(algorithm))
        module.register_forward_hook(after_forward)
        done = set()

        def grad_ready(p):  # after the unit's last gradient of this backward: free it
            done.add(id(p))
            if len(done) == len(unit.params):
                done.clear()
                unit.release()
        for p in unit.params:
            p.register_post_accumulate_grad_hook(grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self):
        """After ``loss.backward()``: average the gradients over the ranks, update, and make
        the parameters whole again (stages 1-2)."""
        if self.stage == 0:  # data parallelism: allreduce the full gradients
            for unit in self.units:
                flat = _flatten([p.grad for p in unit.params])
                _allreduce(flat, self.comm, self.algorithm)
                flat /= self.comm.world_size
                offset = 0
                for p in unit.params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            self.memory_at_update = self.memory()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return
        for unit in self.units:
            unit.reduce_scatter_grads(self.algorithm, keep_full=self.stage == 1)
        self.memory_at_update = self.memory()  # what the update needs: the most state held
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for unit in self.units:
            if self.stage < 3:
                unit.gather(self.algorithm)
            else:  # a unit whose input needs no gradient misses its after-backward hook
                unit.release()
            for p in unit.params:
                p.grad = None

    def full_parameters(self):
        """Every parameter, whole (stage 3 gathers them for the moment), as detached copies."""
        out = []
        for unit in self.units:
            if self.stage == 3:
                unit.gather(self.algorithm)
            out += [p.detach().clone() for p in unit.params]
            if self.stage == 3:
                unit.release()
        return out

    def memory(self):
        """Bytes this rank holds now, by kind: full parameters, gradients (full and shards),
        optimizer state, parameter shards. (``memory_at_update``: the same just before the
        last update, when the gradients are held.)"""
        def size(t):
            return t.untyped_storage().size() if t is not None else 0
        params = [p for u in self.units for p in u.params]
        state = [v for s in self.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0]
        shards = [u.shard for u in self.units] if self.stage else []
        return {"parameters": sum(size(p) for p in params),
                "gradients": sum(size(p.grad) for p in params)
                + sum(size(s.grad) for s in shards),
                "optimizer": sum(size(v) for v in state),
                "shards": sum(size(s) for s in shards)}


def zero_memory(num_params, world_size, stage, optimizer_numbers=2, bytes_per_number=4):
    """Bytes per rank by the ZeRO paper's accounting, for ``num_params`` parameters: DDP holds
    parameters, gradients and K = ``optimizer_numbers`` optimizer numbers per parameter; stage 1
    shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    psi, N, K = num_params * bytes_per_number, world_size, optimizer_numbers
    params = psi / N if stage >= 3 else psi
    grads = psi / N if stage >= 2 else psi
    state = K * psi / N if stage >= 1 else K * psi
    return {"parameters": params, "gradients": grads, "optimizer": state,
            "total": params + grads + state}
