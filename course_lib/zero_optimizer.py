"""ZeRO stage 1 as an optimizer: the form of ``torch.distributed.optim.ZeroRedundancyOptimizer``.

Introduced in notebooks/10_sharded_data_parallelism.ipynb. :class:`zero.ZeroDataParallel` owns
the model and its optimizer. Code written for torch expects the other form: a data-parallel
model (DDP, which averages the gradients) and an optimizer that *is* a ``torch.optim.Optimizer``
and keeps only its share of the state::

    model = DistributedDataParallel(net)
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, comm, lr=1e-3)
    loss_fn(model(x), y).backward()     # every rank: the averaged gradients
    opt.step()                          # its own parameters' update, then everyone's gathered

Each parameter belongs to one rank, chosen as torch does: the largest first, each to the rank
that holds the fewest elements so far. A rank keeps the optimizer state (Adam: two numbers per
element) of its own parameters only, updates them, and an all-gather of the updated
parameters (padded to the largest share) gives every rank all of them. The state saved is
torch's too: :meth:`ShardedOptimizer.consolidate_state_dict` gathers every rank's state on one
rank, whose :meth:`~ShardedOptimizer.state_dict` is then an ordinary optimizer's, loadable into
a plain ``torch.optim.Adam`` over the same parameters, or into this optimizer on any number of
ranks (:meth:`~ShardedOptimizer.load_state_dict` keeps each rank's share).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from course_lib.collectives import ring_allgather
from course_lib.comm import Comm


def partition(param_groups: list[dict], world_size: int) -> list[int]:
    """The rank that owns each parameter (in the order of the groups): in each group, the
    largest first, each to the rank holding the fewest elements so far (ties: the lowest rank),
    counting over all groups, as ``ZeroRedundancyOptimizer`` partitions them.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    sizes = [0] * world_size
    owner: dict[int, int] = {}
    for group in param_groups:
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = int(np.argmin(sizes))
            owner[id(p)] = rank
            sizes[rank] += p.numel()
    return [owner[id(p)] for group in param_groups for p in group["params"]]


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (with ``defaults``) over ``params``, each rank keeping the state of
    the parameters it owns (:func:`partition`) and updating those; every rank holds every
    parameter after :meth:`step`. The gradients must be averaged already (DDP's job), as for
    ``ZeroRedundancyOptimizer``. Introduced in notebooks/10_sharded_data_parallelism.ipynb."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 comm: Comm, **defaults: Any) -> None:
        super().__init__(params, defaults)
        self.comm, self.optimizer_class = comm, optimizer_class
        self.owners = partition(self.param_groups, comm.world_size)
        mine = iter(o == comm.rank for o in self.owners)
        self.local = optimizer_class(
            [{**settings(g), "params": [p for p in g["params"] if next(mine)]}
             for g in self.param_groups], **defaults)
        self._consolidated: dict | None = None

    def all_params(self) -> list[torch.Tensor]:
        """Every parameter, in the order of the groups (the indices of a state dict)."""
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update this rank's parameters, then gather everyone's."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self.local.param_groups, strict=True):
            local.update(settings(group))  # a learning-rate scheduler changes ours
        self.local.step()
        self.gather_parameters()
        return loss

    def gather_parameters(self) -> None:
        """Every rank's parameters to every rank: per dtype, one ring all-gather of the ranks'
        shares, each padded to the largest (the all-gather needs equal chunks)."""
        params, N = self.all_params(), self.comm.world_size
        for dtype in sorted({p.dtype for p in params}, key=str):
            shares = [[p for p, o in zip(params, self.owners, strict=True)
                       if o == r and p.dtype == dtype] for r in range(N)]
            longest = max(sum(p.numel() for p in share) for share in shares)
            if longest == 0:
                continue
            flat = torch.zeros(N * longest, dtype=dtype)
            mine = shares[self.comm.rank]
            if mine:
                part = torch.cat([p.detach().reshape(-1) for p in mine])
                flat[self.comm.rank * longest:][:part.numel()] = part
            ring_allgather(flat, self.comm, check=False)
            for r, share in enumerate(shares):
                at = r * longest
                for p in share:
                    p.copy_(flat[at:at + p.numel()].view_as(p))
                    at += p.numel()

    # ------------------------------------------------------------ saving and loading
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Send every rank's optimizer state to rank ``to`` (every rank calls it), where
        :meth:`state_dict` then returns the whole optimizer's."""
        buffer = io.BytesIO()
        torch.save(self.local.state_dict(), buffer)
        payload = np.frombuffer(buffer.getvalue(), dtype=np.uint8)
        if self.comm.rank != to:
            self.comm.send(np.array([payload.size], np.int64), to)
            self.comm.send(payload.copy(), to)
            return
        states = []
        for r in range(self.comm.world_size):
            if r == to:  # a copy: whoever loads the saved state must not share our tensors
                states.append(copy.deepcopy(self.local.state_dict()))
                continue
            size = np.zeros(1, np.int64)
            self.comm.recv(size, r)
            data = np.empty(int(size[0]), np.uint8)
            self.comm.recv(data, r)
            states.append(torch.load(io.BytesIO(data.tobytes()), weights_only=False))
        whole: dict = {}
        for r, local in enumerate(states):  # local index i of rank r -> its global index
            indices = [i for i, o in enumerate(self.owners) if o == r]
            whole.update({indices[i]: s for i, s in local["state"].items()})
        self._consolidated = whole

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, as one ``optimizer_class`` over every parameter would
        save it: only on the rank that :meth:`consolidate_state_dict` sent it to."""
        if self._consolidated is None:
            raise RuntimeError(f"rank {self.comm.rank}: call consolidate_state_dict(to=...) on "
                               "every rank first, then state_dict() on that rank")
        groups, at = [], 0  # every hyperparameter, the optimizer class's defaults too
        for g, local in zip(self.param_groups, self.local.param_groups, strict=True):
            groups.append({**settings(local), **settings(g),
                           "params": list(range(at, at + len(g["params"])))})
            at += len(g["params"])
        return {"state": dict(self._consolidated), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole optimizer's state (this one's, or a plain optimizer's over the same
        parameters): every rank keeps its own parameters' share."""
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"the state has {len(state_dict['param_groups'])} parameter "
                             f"groups; this optimizer {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(settings(saved))
        mine = [i for i, o in enumerate(self.owners) if o == self.comm.rank]
        local_groups, at = [], 0
        for group, local in zip(self.param_groups, self.local.param_groups, strict=True):
            count = len(local["params"])
            local_groups.append({**settings(group), "params": list(range(at, at + count))})
            at += count
        self.local.load_state_dict({
            "state": {i: state_dict["state"][g] for i, g in enumerate(mine)
                      if g in state_dict["state"]},
            "param_groups": local_groups})


def settings(group: dict) -> dict:
    """A parameter group's hyperparameters: everything but its parameters.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    return {k: v for k, v in group.items() if k != "params"}
