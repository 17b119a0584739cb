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

Each top-level child of the model with trainable parameters is one *unit* (FSDP's wrapping):
its trainable parameters are flattened into one vector, cut into N contiguous shards with
``shard_bounds`` (any size: the last shards may be one element shorter), and the optimizer sees
one tensor per unit, this rank's shard. Frozen parameters (``requires_grad=False``) are in no
unit: every rank keeps them whole, like buffers, with no gradient and no optimizer state::

    model = ZeroDataParallel(net, lambda shards: torch.optim.Adam(shards, lr=1e-3), comm, stage=3)
    loss = loss_fn(model(x_local), y_local)   # this rank's part of the global batch
    loss.backward()
    model.step()                              # average, update, and (stages 1-2) all-gather

Stage 3 takes a mixed-precision policy, as FSDP2's ``MixedPrecisionPolicy``:
``precision=ZeroPrecision(torch.bfloat16)`` gathers the parameters and computes in bf16 (half
the bytes sent), reduce-scatters the gradients in bf16 (or ``reduce_dtype``), and keeps this
rank's shard, its gradient and the optimizer in the model's float32: the master weights.

It stays one file: the four stages share one class (they differ in a few branches, which is the
lesson), and the memory plan beside it predicts what that class holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.collectives import allreduce, ring_allgather, ring_reduce_scatter
from course_lib.comm import Comm
from course_lib.runtime.arguments import check_count
from course_lib.sharding import shard_bounds

STAGES = (0, 1, 2, 3)  # 0: plain data parallelism (an allreduce), for comparison


def _flatten(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@dataclass(frozen=True)
class ZeroPrecision:
    """Mixed precision for ZeRO stage 3, as FSDP2's ``MixedPrecisionPolicy``: the parameters are
    all-gathered and computed in ``param_dtype``, the gradients reduce-scattered in
    ``reduce_dtype`` (None: ``param_dtype``), then this rank's gradient shard is cast to the
    shard's dtype (the model's, float32) for the optimizer, which updates the float32 shard.
    Floating-point tensors passed to the forward are cast to ``param_dtype`` (FSDP2's
    ``cast_forward_inputs``), and the output stays in it. Frozen parameters, whole on every
    rank, are cast to ``param_dtype`` once. Introduced in
    notebooks/10_sharded_data_parallelism.ipynb."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if name == "reduce_dtype" and dtype is None:  # None: param_dtype
                continue
            if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{name} must be a floating-point torch.dtype (torch.bfloat16, "
                                 f"torch.float16, torch.float32), not {dtype!r}")


class _Unit:
    """One module's parameters as a flat vector, sharded over the ranks; with ``precision``,
    the parameters are ``param_dtype`` copies of the shards."""

    def __init__(self, module, comm, sharded=True, precision=None):
        self.module, self.comm = module, comm
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.stop = shard_bounds(self.numel, comm.rank, comm.world_size)
        with torch.no_grad():  # what this rank owns (data parallelism: nothing of its own)
            self.shard = (_flatten(self.params)[self.start:self.stop].clone() if sharded
                          else None)
        self.param_dtype = self.reduce_dtype = None  # None: the shard's dtype
        if precision is not None:
            self.param_dtype = precision.param_dtype
            self.reduce_dtype = precision.reduce_dtype or precision.param_dtype
            for p in self.params:  # the compute copies; the shard above is the master
                p.data = p.data.to(self.param_dtype)
        self.reduced = False  # its gradients of this step are reduce-scattered already

    def full(self, algorithm, dtype=None):
        """Every rank's shard, all-gathered in ``dtype`` (None: the shard's), as a flat vector."""
        full = self.shard.new_zeros(self.numel, dtype=dtype)  # zeros: the native path sums
        full[self.start:self.stop] = self.shard  # cast here: the gather sends ``dtype``
        _all_gather(full, self.comm, algorithm)
        return full

    def gather(self, algorithm):
        """Every rank's shard into a full flat vector, copied into the parameters."""
        full = self.full(algorithm, self.param_dtype)
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
        gradient. ``keep_full=True`` (stage 1) keeps the full gradients as views of the one
        flat buffer that is reduce-scattered, as DDP's buckets do (their other chunks then
        hold partial sums, which nothing reads); ``False`` frees them (stages 2 and 3)."""
        flat = _flatten([p.grad if p.grad is not None else torch.zeros_like(p)
                         for p in self.params]).to(self.reduce_dtype)  # what is sent
        if keep_full:  # the gradients become views of ``flat``: one copy, not two
            offset = 0
            for p in self.params:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        _reduce_scatter(flat, self.comm, algorithm)
        mine = flat[self.start:self.stop].div_(self.comm.world_size)  # the sum -> the mean
        # for the optimizer, in the shard's dtype; a copy unless keep_full: a view would keep
        # the whole buffer alive
        mine = mine.to(self.shard.dtype, copy=not keep_full)
        # several backwards before a step: their gradients add up, as in plain torch
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad + mine
        self.reduced = True
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
        dist.all_reduce(flat, group=getattr(comm, "group", None))


def _allreduce(flat, comm, algorithm):
    """Sum ``flat`` over the ranks (DDP): the ring's reduce-scatter then all-gather, or Gloo's."""
    if comm.world_size == 1:
        return
    if algorithm == "ring":
        allreduce(flat, comm, "ring", check=False)
    else:
        dist.all_reduce(flat, group=getattr(comm, "group", None))


def _all_gather(full, comm, algorithm):
    """Fill ``full`` with every rank's chunk (each rank has written its own)."""
    if comm.world_size == 1:
        return
    if algorithm == "ring":
        ring_allgather(full, comm, check=False)
    else:  # chunks are zero elsewhere, so a sum gathers them
        dist.all_reduce(full, group=getattr(comm, "group", None))


def _cast_floating(x, dtype):
    return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x


class DoesNotFit(MemoryError):
    """The training state would not fit the memory budget of a rank: raised before training,
    with the numbers. Introduced in notebooks/10_sharded_data_parallelism.ipynb."""


class ZeroDataParallel(nn.Module):
    """``module`` trained data-parallel with ZeRO ``stage`` 0-3 over ``comm`` (see the module
    docstring). ``make_optimizer(shards)`` builds the optimizer over this rank's shards (stage
    0: over all parameters). ``algorithm``: "ring" (the course's collectives) or "native".
    ``memory_budget``: bytes a rank may hold for the training state; a model whose state would
    not fit (by :func:`planned_memory`, with ``optimizer_numbers`` numbers of optimizer state per
    parameter: Adam's 2) raises :class:`DoesNotFit` before anything is sharded, and a step that
    held more raises it after. One ``backward`` per ``step`` (or several: gradients add up).
    ``precision``: a :class:`ZeroPrecision` (stage 3 only; stages 0-2 refuse it).

    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""

    def __init__(self, module: nn.Module,
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 comm: Comm, stage: int = 1, algorithm: str = "ring",
                 memory_budget: int | None = None, optimizer_numbers: int = 2,
                 precision: ZeroPrecision | None = None) -> None:
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
        if algorithm not in ("ring", "native"):
            raise ValueError(f"algorithm must be 'ring' or 'native', not {algorithm!r}")
        if precision is not None and (stage != 3 or not isinstance(precision, ZeroPrecision)):
            raise ValueError("precision takes a ZeroPrecision, at stage 3 only (stages 0-2 keep "
                             f"the model's dtype): not {precision!r} at stage {stage}")
        self.precision = precision
        self.module, self.comm, self.stage, self.algorithm = module, comm, stage, algorithm
        self.memory_budget = memory_budget
        if memory_budget is not None:
            plan = planned_memory(module, comm.world_size, stage, optimizer_numbers)
            if plan["total"] > memory_budget:
                raise DoesNotFit(does_not_fit_message(module, comm.world_size, stage,
                                                      memory_budget, optimizer_numbers))
        self.memory_at_update = None  # memory() just before the last optimizer update
        self.peak = None              # memory() when this rank held the most, since reset_peak()
        self.units = [_Unit(m, comm, stage > 0, precision) for m in units_of(module)]
        # frozen parameters: in no unit (nothing to train, so nothing to shard); kept whole
        self.frozen = [p for p in module.parameters() if not p.requires_grad]
        if precision is not None:  # nothing updates them: no master copy to keep
            for p in self.frozen:
                p.data = p.data.to(precision.param_dtype)
        if stage == 0:
            self.optimizer = make_optimizer([p for u in self.units for p in u.params])
        else:
            self.optimizer = make_optimizer([u.shard for u in self.units])
        for unit in self.units:
            if stage == 3:
                unit.release()
                self._gather_around(unit)
            if stage >= 2:
                self._reduce_when_ready(unit)

    def _gather_around(self, unit):
        """Stage 3: gather a unit's parameters before its forward and before its backward,
        free them after its forward (and, in ``_reduce_when_ready``, after its backward)."""
        module, algorithm = unit.module, self.algorithm

        def before_forward(m, args):
            unit.gather(algorithm)
            self._note_peak()

        def after_forward(m, args, out):
            unit.release()
            if torch.is_tensor(out) and out.requires_grad:  # its gradient arrives first
                out.register_hook(lambda grad: unit.gather(algorithm))
        module.register_forward_pre_hook(before_forward)
        module.register_forward_hook(after_forward)

    def _reduce_when_ready(self, unit):
        """Stages 2-3: as soon as a unit's gradients are all in (during the backward), reduce-
        scatter them and free the full gradients (stage 3: and the parameters), so that at most
        one unit's full gradients exist at a time."""
        ready = set()

        def grad_ready(p):
            ready.add(id(p))
            if len(ready) == len(unit.params):
                ready.clear()
                self._note_peak()  # the unit's full gradients, before they are freed
                unit.reduce_scatter_grads(self.algorithm, keep_full=False)
                if self.stage == 3:
                    unit.release()
        for p in unit.params:
            p.register_post_accumulate_grad_hook(grad_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.precision is not None:  # floating-point inputs in param_dtype, as FSDP2's
            dtype = self.precision.param_dtype
            args = [_cast_floating(a, dtype) for a in args]
            kwargs = {k: _cast_floating(v, dtype) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    def step(self) -> None:
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
        for unit in self.units:  # stage 1; stages 2-3: a unit the backward did not reach
            if self.stage and not unit.reduced:
                unit.reduce_scatter_grads(self.algorithm, keep_full=self.stage == 1)
                if self.stage == 3:
                    unit.release()
            unit.reduced = False
        self.memory_at_update = self._note_peak()  # the update needs the gradients: the most
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for unit in self.units:
            if self.stage in (1, 2):
                unit.gather(self.algorithm)
            if self.stage:
                for p in unit.params:
                    p.grad = None
        self._note_peak()  # the optimizer state exists from the first update on
        if self.memory_budget is not None and self.peak["total"] > self.memory_budget:
            raise DoesNotFit(f"rank {self.comm.rank}: ZeRO stage {self.stage} held "
                             f"{self.peak['total']} bytes, more than the budget of "
                             f"{self.memory_budget}: {self.peak}")

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter (frozen ones too), whole, in ``parameters()`` order, as detached
        copies (stage 3 gathers the shards, the float32 masters with ``precision``)."""
        whole = {}
        for unit in self.units:
            if self.stage == 3:
                full, offset = unit.full(self.algorithm), 0
                for p in unit.params:
                    whole[id(p)] = full[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                continue
            whole.update((id(p), p.detach().clone()) for p in unit.params)
        return [whole[id(p)] if id(p) in whole else p.detach().clone()
                for p in self.module.parameters()]

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: full parameters (frozen ones too), gradients (full
        and shards), optimizer state, parameter shards, and their total. (``memory_at_update``:
        the same just before the last update; ``peak``: when the total was largest.)"""
        seen = set()  # a storage counts once: stage 1's gradients are views of one buffer

        def size(tensors):
            total = 0
            for t in tensors:
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().size()
            return total
        params = [p for u in self.units for p in u.params]
        shards = [u.shard for u in self.units] if self.stage else []
        held = {"parameters": size(params + self.frozen),
                "gradients": size([p.grad for p in params] + [s.grad for s in shards]),
                "optimizer": size(v for s in self.optimizer.state.values() for v in s.values()
                                  if torch.is_tensor(v) and v.dim() > 0),
                "shards": size(shards)}
        held["total"] = sum(held.values())
        return held

    def _note_peak(self):
        held = self.memory()
        if self.peak is None or held["total"] > self.peak["total"]:
            self.peak = held
        return held

    def reset_peak(self) -> None:
        """Forget the peak: ``peak`` then tracks from now on."""
        self.peak = None


def units_of(module: nn.Module) -> list[nn.Module]:
    """The units ZeRO shards one at a time: the top-level children with trainable parameters,
    if they hold them all, else the whole module (none if nothing is trainable). Introduced in
    notebooks/10_sharded_data_parallelism.ipynb."""
    children = [m for m in module.children() if _numel(m)]  # a frozen child: not a unit
    if children and sum(_numel(m) for m in children) == _numel(module):
        return children
    return [module] if _numel(module) else []


def _numel(module, trainable=True):
    return sum(p.numel() for p in module.parameters() if p.requires_grad == trainable)


def planned_memory(module: nn.Module, world_size: int, stage: int,
                   optimizer_numbers: int = 2) -> dict[str, int]:
    """Bytes one rank of ``world_size`` will hold at most while training ``module`` with
    :class:`ZeroDataParallel` at ``stage``, by kind (as ``memory()`` counts them): the paper's
    accounting plus what this implementation adds (stages 1-2 keep their parameter shard
    beside the full parameters; stage 2 the full gradients of one unit during the backward;
    stage 3 the unit being computed, gathered, with its full gradients). Frozen parameters count
    as parameters only, whole on every rank.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    p = next(module.parameters())
    b, N, K = p.element_size(), world_size, optimizer_numbers
    sizes = [_numel(m) for m in units_of(module)]
    psi = sum(sizes)
    # ceil(n / N) per unit: rank 0's shards, the first and so the longest (shard_bounds)
    shard = sum(-(-n // N) for n in sizes) if stage else 0
    largest, frozen = max(sizes, default=0), _numel(module, trainable=False)
    plan = {"parameters": b * ((psi if stage < 3 else largest) + frozen),
            "gradients": b * {0: psi, 1: psi, 2: largest + shard, 3: largest + shard}[stage],
            "optimizer": b * K * (shard if stage else psi),
            "shards": b * shard}
    plan["total"] = sum(plan.values())
    return plan


def does_not_fit_message(module: nn.Module, world_size: int, stage: int, budget: int,
                         optimizer_numbers: int = 2) -> str:
    """Why the state of ``module`` does not fit ``budget`` bytes per rank at ``stage`` on
    ``world_size`` ranks, with the numbers and the fewest ranks that would fit.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    plan = planned_memory(module, world_size, stage, optimizer_numbers)
    parts = ", ".join(f"{kind} {_mb(plan[kind])}" for kind in
                      ("parameters", "gradients", "optimizer", "shards") if plan[kind])
    ranks = f"{world_size} rank" + ("s" if world_size > 1 else "")
    lines = [f"ZeRO stage {stage} on {ranks} needs {_mb(plan['total'])} per rank "
             f"({parts}), more than the budget of {_mb(budget)}."]
    fits = [(s, n) for s in STAGES for n in (world_size, 2 * world_size, 4 * world_size,
                                              8 * world_size, 16 * world_size)
            if planned_memory(module, n, s, optimizer_numbers)["total"] <= budget]
    if fits:
        s, n = min(fits, key=lambda sn: (sn[1], sn[0]))  # fewest ranks, then least sent
        lines.append(f"It would fit with stage {s} on {n} ranks "
                     f"({_mb(planned_memory(module, n, s, optimizer_numbers)['total'])}).")
    else:
        element = next(module.parameters()).element_size()
        largest = max((_numel(m) for m in units_of(module)), default=0) * element
        lines.append(f"Even sharding over {16 * world_size} ranks does not fit: at stage 3 a "
                     f"rank still gathers its largest unit whole ({_mb(2 * largest)} with its "
                     "gradients); split that layer (tensor parallelism, notebook 09) or raise "
                     "the budget.")
    return "\n".join(lines)


def _mb(n_bytes):
    """1234567 -> '1.18 MiB', 1216 -> '1.19 KiB', 96 -> '96 B'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size:
            return f"{n_bytes / size:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def zero_memory(num_params: int, world_size: int, stage: int, optimizer_numbers: int = 2,
                bytes_per_number: int = 4) -> dict[str, float]:
    """Bytes per rank by the ZeRO paper's accounting, for ``num_params`` parameters: DDP holds
    parameters, gradients and K = ``optimizer_numbers`` optimizer numbers per parameter; stage 1
    shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    check_count("world_size", world_size)
    psi, N, K = num_params * bytes_per_number, world_size, optimizer_numbers
    params = psi / N if stage >= 3 else psi
    grads = psi / N if stage >= 2 else psi
    state = K * psi / N if stage >= 1 else K * psi
    return {"parameters": params, "gradients": grads, "optimizer": state,
            "total": params + grads + state}
