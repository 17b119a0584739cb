"""Horovod's side of data parallelism, from scratch, on the reducers of :mod:`course_lib.ddp`.

Introduced in notebooks/06_data_parallel_sgd.ipynb. torch's DDP wraps the model and averages
during ``backward()``; Horovod wraps the optimizer (``hvd.DistributedOptimizer``): hooks start
the allreduces during backward, and ``step()`` waits for them. With it come the optimizer's state
to broadcast, so that every rank starts equal, and a call that averages a list of gradients when
the caller says so (Horovod's ``grouped_allreduce``)::

    opt = horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    ddp.broadcast_parameters(model)
    horovod.broadcast_optimizer_state(opt)
    loss_fn(model(x), y).backward()            # hooks start the allreduces
    opt.step()                                 # waits for them, then updates

    loss_fn(model(x), y).backward()            # or, without hooks:
    horovod.average_gradients(model.parameters(), "bucketed")
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from course_lib.comm import DEFAULT_TIMEOUT
from course_lib.comm.dist_checks import dist_or_fail, wait_work
from course_lib.ddp import Reducer, ReducerConfig, make_reducer
from course_lib.runtime.timeline import DISABLED, Timeline


class DistributedOptimizer:
    """Horovod's ``hvd.DistributedOptimizer``, from scratch: wraps an optimizer, starts the
    gradient allreduces from hooks during backward, and waits for them in ``step()``.
    Everything else (``param_groups``, ``state_dict``, ``zero_grad`` ...) is the wrapped one's.
    The options are :class:`course_lib.ddp.ReducerConfig`'s, as in ``ddp.DistributedDataParallel``;
    a ``timeline`` records every pass and step.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 strategy: str = "overlap", bucket_cap_mb: float | None = None,
                 algorithm: str = "native", find_unused_parameters: bool = False,
                 timeline: Timeline = DISABLED, timeout: float = DEFAULT_TIMEOUT,
                 first_bucket_mb: float | None = None) -> None:
        config = ReducerConfig(strategy, bucket_cap_mb, first_bucket_mb, algorithm,
                               find_unused_parameters, timeout)
        self.optimizer, self.timeline = optimizer, timeline
        names = {id(p): n for n, p in (named_parameters or [])}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        named = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]
        # Horovod's contract: backward only starts the allreduces, step() waits for them
        self.reducer = make_reducer(named, config, timeline)

    def synchronize(self) -> None:
        """Wait until every gradient is averaged (Horovod's ``optimizer.synchronize()``)."""
        self.reducer.finish()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self.synchronize()
        start = time.perf_counter()
        result = self.optimizer.step(closure)
        self.timeline.add("step", "step", start, time.perf_counter())
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, strategy={self.reducer.strategy!r})"


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer | DistributedOptimizer,
                              root: int = 0, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Give every rank rank ``root``'s optimizer state (hyperparameters and buffers such as
    momentum), so that a run restored from a checkpoint on one rank starts equal everywhere.
    The state travels serialised: its length, then its bytes, two broadcasts with deadlines.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """
    dist = dist_or_fail()
    device = optimizer.param_groups[0]["params"][0].device
    payload = torch.zeros(0, dtype=torch.uint8)
    if dist.get_rank() == root:
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    wait_work(dist.broadcast(size, src=root, async_op=True), timeout,
              f"broadcast of the optimizer state's size from rank {root}")
    data = payload.to(device) if dist.get_rank() == root else \
        torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    wait_work(dist.broadcast(data, src=root, async_op=True), timeout,
              f"broadcast of the optimizer state ({int(size.item())} bytes) from rank {root}")
    if dist.get_rank() != root:  # written by rank 0 of this same job a moment ago
        state = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)
        optimizer.load_state_dict(state)


def average_gradients(params: Iterable[torch.nn.Parameter], strategy: str = "bucketed",
                      bucket_cap_mb: float | None = None, algorithm: str = "native",
                      timeline: Timeline = DISABLED,
                      timeout: float = DEFAULT_TIMEOUT) -> list[torch.nn.Parameter]:
    """After ``loss.backward()``: replace the ``.grad`` of every parameter in ``params`` by its
    average over the ranks, with the after-backward :class:`course_lib.ddp.Reducer` of the
    strategy ``per_parameter``, ``flat`` or ``bucketed`` (``bucket_cap_mb`` as in
    ``ddp.DistributedDataParallel``). A parameter without a gradient on this rank contributes
    zeros; one without a gradient on every rank keeps ``grad = None``.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """
    if strategy == "overlap":
        raise ValueError("overlap starts during backward: use DistributedDataParallel or "
                         "DistributedOptimizer for it")
    params = [p for p in params if p.requires_grad]
    config = ReducerConfig(strategy, bucket_cap_mb, algorithm=algorithm,
                           find_unused_parameters=True, timeout=timeout)
    reducer = Reducer([(f"param{i}", p) for i, p in enumerate(params)], config, timeline)
    for hook in reducer.hooks:  # backward is over: the gradients are given below
        hook.remove()
    for p in params:
        if p.grad is not None:
            reducer.grad_ready(p)
    reducer.started = True  # a rank without any gradient still joins every allreduce
    reducer.finish()
    return params
