"""Synchronous data parallelism from scratch: what DistributedDataParallel and Horovod do inside.

Introduced in notebooks/06_data_parallel_sgd.ipynb. Every rank holds a full copy of the model,
computes the gradient of its slice of the global batch, and the ranks average their gradients
before every step, so all copies stay equal and the run equals one process on the global batch.
How the averaging is done is what makes it fast or slow; four strategies, side by side
(the machinery is in :mod:`course_lib.buckets`):

    per_parameter  one allreduce per parameter tensor after backward: many small messages,
                   each paying the latency alpha (the teaching baseline)
    flat           all gradients copied into one buffer, one allreduce (tensor fusion)
    bucketed       buffers closed once they hold at least ``bucket_cap_mb``, parameters in
                   reverse order (the order in which backward produces their gradients), one
                   after the other
    overlap        bucketed, and each bucket's allreduce starts asynchronously from an autograd
                   hook as soon as its last gradient is ready, while backward goes on; the
                   waits happen at the end of backward (torch DDP) or in ``step`` (Horovod)

The allreduce is the native one of the process group (``algorithm="native"``) or the course's
own pipelined ring (``"ring"``, run on a background thread as Horovod runs its collectives).
Gradients are divided by the world size before they are summed, as torch DDP's default
communication hook does::

    net = ddp.DistributedDataParallel(model, strategy="overlap")   # broadcasts rank 0's weights
    loss_fn(net(x), y).backward()                                  # gradients averaged on return
    opt.step()

    opt = ddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())   # Horovod style
    ddp.broadcast_parameters(model); ddp.broadcast_optimizer_state(opt)

Frozen parameters (``requires_grad=False``) are left out; a tied parameter appears once; with
``find_unused_parameters=True`` a parameter without a gradient on this rank contributes zeros,
and one unused on every rank keeps ``grad = None``, as in torch DDP.
"""

from __future__ import annotations

import io
import time
from contextlib import contextmanager

import torch

from course_lib.buckets import (
    ALGORITHMS,
    DEFAULT_BUCKET_CAP_MB,
    FIRST_BUCKET_MB,
    STRATEGIES,
    DDPError,
    OverlappingReducer,
    Reducer,
    agree,
    assign_buckets,
    dist_or_fail,
    layout,
    make_reducer,
    wait_work,
)
from course_lib.comm import DEFAULT_TIMEOUT

__all__ = ["ALGORITHMS", "DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_MB", "STRATEGIES", "DDPError",
           "DistributedDataParallel", "DistributedOptimizer", "OverlappingReducer", "Reducer",
           "assign_buckets", "average_gradients", "average_gradients_naive",
           "broadcast_optimizer_state", "broadcast_parameters", "make_reducer"]


def _tensors(obj):
    """Tensors of a module (parameters and buffers), or of an iterable of tensors / pairs."""
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    return [t[1] if isinstance(t, tuple) else t for t in obj]


def broadcast_parameters(params, root=0, timeout=DEFAULT_TIMEOUT, check=True):
    """Copy rank ``root``'s parameters (and buffers, for a module) to every rank, in place:
    one broadcast per dtype, of all tensors of that dtype flattened together. ``check=False``
    skips the agreement on sizes, for tensors whose sizes the ranks agreed on already.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """
    dist = dist_or_fail()
    tensors = _tensors(params)
    if check:
        agree(layout(tensors), "the tensors to broadcast [count, elements, checksum]", timeout,
              tensors[0].device if tensors else "cpu")
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        wait_work(dist.broadcast(flat, src=root, async_op=True), timeout,
                  f"broadcast of {len(group)} {dtype} tensors ({flat.numel()} elements) "
                  f"from rank {root}")
        with torch.no_grad():
            for t, part in zip(group, flat.split([t.numel() for t in group]), strict=True):
                t.copy_(part.view_as(t))


def broadcast_optimizer_state(optimizer, root=0, timeout=DEFAULT_TIMEOUT):
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


def average_gradients_naive(params, timeout=DEFAULT_TIMEOUT):
    """The naive version, to read on its own: after ``loss.backward()``, one blocking allreduce
    per parameter's gradient, then a division by the number of ranks. Correct, and slow: a
    model of K tensors pays the latency alpha K times. Every rank must have a gradient for the
    same parameters. (``average_gradients`` fuses them into buckets; the DDP wrapper's
    ``overlap`` also starts them during backward.)

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """
    dist = dist_or_fail()
    params = [p for p in params if p.requires_grad]
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        raise DDPError(f"rank {dist.get_rank()}: parameters {missing[:8]} have no gradient: "
                       "call backward first, or use average_gradients, which handles them")
    grads = [p.grad for p in params]
    agree(layout(grads), "the gradients [count, elements, checksum]", timeout,
          grads[0].device if grads else "cpu")
    for i, g in reversed(list(enumerate(grads))):  # backward produced the last layer's first
        wait_work(dist.all_reduce(g, async_op=True), timeout,
                  f"allreduce of the gradient of parameter {i} ({g.numel()} elements)")
        g /= dist.get_world_size()
    return params


def average_gradients(params, strategy="bucketed", bucket_cap_mb=None, algorithm="native",
                      timeline=None, timeout=DEFAULT_TIMEOUT):
    """After ``loss.backward()``: replace the ``.grad`` of every parameter in ``params`` by its
    average over the ranks, with the strategy ``per_parameter``, ``flat`` or ``bucketed``
    (``bucket_cap_mb`` as in :class:`DistributedDataParallel`).

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """
    if strategy == "overlap":
        raise ValueError("overlap starts during backward: use DistributedDataParallel or "
                         "DistributedOptimizer for it")
    params = [p for p in params if p.requires_grad]
    reducer = Reducer([(f"param{i}", p) for i, p in enumerate(params)], strategy, bucket_cap_mb,
                      algorithm, find_unused_parameters=True, timeline=timeline, timeout=timeout)
    try:
        for p in params:
            if p.grad is not None:
                reducer.grad_ready(p)
        reducer.started = True
        reducer.finish()
    finally:
        reducer.remove()
    return params


def _queue_at_end_of_backward(fn):
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class DistributedDataParallel(torch.nn.Module):
    """A from-scratch ``torch.nn.parallel.DistributedDataParallel``: broadcasts rank 0's
    parameters on construction, and when ``loss.backward()`` returns every ``.grad`` holds the
    average over the ranks. ``buckets`` lists the parameter names of each bucket. The caps are
    torch DDP's (2.13): ``bucket_cap_mb=None`` means 25 MiB with a first bucket of 1 MiB; a
    cap that is given applies to the first bucket too (``first_bucket_mb`` overrides it).
    Unlike torch, the buckets are made once, here, in reverse parameter order; torch DDP
    reduces everything in one bucket in its first step and then rebuilds its buckets by the
    same rule in the order the gradients became ready, which is the same buckets for a model
    that uses its layers once, in order (``assign_buckets`` says more).

    Buffers (BatchNorm's running mean and variance ...) are not trained, so no gradient keeps
    them equal: with ``broadcast_buffers=True`` (torch's default) rank 0's buffers are copied
    to every rank before each forward, as torch DDP does (not after a forward under
    ``no_sync()`` or ``torch.no_grad()``, again as torch does).

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """

    def __init__(self, module, strategy="overlap", bucket_cap_mb=None, algorithm="native",
                 find_unused_parameters=False, timeline=None, timeout=DEFAULT_TIMEOUT,
                 first_bucket_mb=None, broadcast_buffers=True):
        super().__init__()
        for value, allowed, name in [(strategy, STRATEGIES, "strategy"),
                                     (algorithm, ALGORITHMS, "algorithm")]:
            if value not in allowed:  # before any process group is needed
                raise ValueError(f"{name} must be one of {allowed}, not {value!r}")
        self.module, self.timeline, self.timeout = module, timeline, timeout
        broadcast_parameters(module, timeout=timeout)  # the ranks agree on every size here
        self.broadcast_buffers, self._sync_buffers_next = broadcast_buffers, True
        self.reducer = make_reducer(module.named_parameters(), strategy, bucket_cap_mb, algorithm,
                                    find_unused_parameters, timeline, timeout,
                                    on_first_grad=lambda: _queue_at_end_of_backward(self._finish),
                                    first_bucket_mb=first_bucket_mb)
        self._backward_start = None

    @property
    def buckets(self):
        return [b.names for b in self.reducer.buckets]

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients locally; the first backward after
        it averages the sum (gradient accumulation: a larger batch for the same messages)."""
        self.reducer.enabled = False
        try:
            yield
        finally:
            self.reducer.enabled = True

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        buffers = list(self.module.buffers())
        if self.broadcast_buffers and buffers and self._sync_buffers_next:
            broadcast_parameters(buffers, timeout=self.timeout, check=False)
        out = self.module(*args, **kwargs)
        # torch DDP: the next forward syncs buffers only if this one will average gradients
        self._sync_buffers_next = torch.is_grad_enabled() and self.reducer.enabled
        if self.timeline is not None:
            self.timeline.add("forward", "forward", start, time.perf_counter())
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._mark_backward_start)
        return out

    def _mark_backward_start(self, _grad):
        self._backward_start = time.perf_counter()

    def _finish(self):
        if self.timeline is not None:
            end = time.perf_counter()
            self.timeline.add("backward", "backward", self._backward_start or end, end)
        self._backward_start = None
        self.reducer.finish()


class DistributedOptimizer:
    """Horovod's ``hvd.DistributedOptimizer``, from scratch: wraps an optimizer, starts the
    gradient allreduces from hooks during backward, and waits for them in ``step()``.
    Everything else (``param_groups``, ``state_dict``, ``zero_grad`` ...) is the wrapped one's.
    Buckets as in :class:`DistributedDataParallel`.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """

    def __init__(self, optimizer, named_parameters=None, strategy="overlap", bucket_cap_mb=None,
                 algorithm="native", find_unused_parameters=False, timeline=None,
                 timeout=DEFAULT_TIMEOUT, first_bucket_mb=None):
        self.optimizer, self.timeline = optimizer, timeline
        names = {id(p): n for n, p in (named_parameters or [])}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        named = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]
        self.reducer = make_reducer(named, strategy, bucket_cap_mb, algorithm,
                                    find_unused_parameters, timeline, timeout,
                                    on_first_grad=self._backward_started,
                                    first_bucket_mb=first_bucket_mb)
        self._backward_start = None

    def _backward_started(self):
        self._backward_start = time.perf_counter()
        if self.timeline is not None:
            _queue_at_end_of_backward(self._backward_ended)

    def _backward_ended(self):
        self.timeline.add("backward", "backward", self._backward_start, time.perf_counter())

    def synchronize(self):
        """Wait until every gradient is averaged (Horovod's ``optimizer.synchronize()``)."""
        self.reducer.finish()

    def step(self, closure=None):
        self.synchronize()
        start = time.perf_counter()
        result = self.optimizer.step(closure)
        if self.timeline is not None:
            self.timeline.add("step", "step", start, time.perf_counter())
        return result

    def __getattr__(self, name):
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self):
        return f"DistributedOptimizer({self.optimizer!r}, strategy={self.reducer.strategy!r})"
