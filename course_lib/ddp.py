"""Synchronous data parallelism from scratch: what torch's DistributedDataParallel does inside.

Introduced in notebooks/06_data_parallel_sgd.ipynb. Every rank computes the gradient of its slice
of the global batch, and the ranks average their gradients before every step, so their copies of
the model stay equal. How they average makes it fast or slow. From top to bottom:

    1. naive          ``average_gradients_naive``: one blocking allreduce per gradient
    2. tensor fusion  ``bucket_groups``, ``assign_buckets``: which gradients share one flat
                      buffer (a ``Bucket``; its allreduce in flight, a ``Handle``)
    3. after backward ``Reducer``: copy a bucket's gradients in, allreduce it, wait, next bucket
    4. overlap        ``OverlappingReducer``: a bucket's allreduce starts from an autograd hook
                      as soon as its last gradient is ready, while backward goes on
    5. the wrapper    ``broadcast_parameters``, ``DistributedDataParallel``: own a reducer

Elsewhere: the Horovod-style optimizer (:mod:`course_lib.horovod`), the course's ring on a thread
(:mod:`course_lib.background_ring`), the checks around the collectives (``dist_checks``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from course_lib.background_ring import BackgroundRing
from course_lib.comm import DEFAULT_TIMEOUT
from course_lib.comm.dist_checks import (
    DDPError,
    agree_layouts,
    all_reduce,
    broadcast,
    checked_gradients,
    dist_or_fail,
    wait_work,
)
from course_lib.runtime.arguments import check_choice
from course_lib.runtime.timeline import DISABLED, Timeline

STRATEGIES = ("per_parameter", "flat", "bucketed", "overlap")
ALGORITHMS = ("native", "ring")
# torch DDP (2.13): bucket_cap_mb left at None means 25 MiB, and a first bucket of 1 MiB so that
# communication starts early; a cap that is given applies to the first bucket too.
DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_MB = 25, 1.0


# ----------------------------------------------------------------- 1. naive: one per gradient
def average_gradients_naive(params: Iterable[torch.nn.Parameter],
                            timeout: float = DEFAULT_TIMEOUT) -> list[torch.nn.Parameter]:
    """The naive version, to read on its own: after ``loss.backward()``, one blocking allreduce
    per gradient, then a division by the number of ranks. Correct, and slow: a model of K
    tensors pays the latency alpha K times. Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    params, grads = checked_gradients(params, timeout)  # the same on every rank, or DDPError
    for i, g in reversed(list(enumerate(grads))):  # backward produced the last layer's first
        all_reduce(g, timeout, f"the gradient of parameter {i}")  # with a deadline
        g /= torch.distributed.get_world_size()
    return params


# ----------------------------------------------------------------- 2. tensor fusion: buckets
def bucket_groups(sizes_and_dtypes: list[tuple[int, torch.dtype]], strategy: str,
                  bucket_cap_mb: float | None = None,
                  first_bucket_mb: float | None = None) -> list[list[int]]:
    """A strategy's buckets, as lists of indices into ``sizes_and_dtypes`` ((bytes, dtype) per
    parameter, in model order): one per parameter (``per_parameter``), one per dtype (``flat``),
    or :func:`assign_buckets` per dtype with torch DDP's caps (``bucket_cap_mb=None``: 25 MiB, the
    first bucket 1 MiB unless ``first_bucket_mb`` says otherwise; ``0``: a bucket per tensor;
    ``math.inf``: one). Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    ReducerConfig(strategy, bucket_cap_mb)  # checks the strategy and the cap
    if strategy == "per_parameter" or (bucket_cap_mb == 0 and strategy != "flat"):
        return [[i] for i in reversed(range(len(sizes_and_dtypes)))]
    if first_bucket_mb is None and bucket_cap_mb is None:  # torch: 1 MiB at the default cap only
        first_bucket_mb = FIRST_BUCKET_MB
    cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    cap = 2.0**62 if strategy == "flat" else cap_mb * 2**20  # flat: a cap nothing reaches
    first = cap if first_bucket_mb is None or strategy == "flat" else first_bucket_mb * 2**20
    groups = []
    for dtype in sorted({d for _, d in sizes_and_dtypes}, key=str):  # one dtype per buffer
        idx = [i for i, (_, d) in enumerate(sizes_and_dtypes) if d == dtype]
        sizes = [sizes_and_dtypes[i][0] for i in idx]
        groups += [[idx[k] for k in g] for g in assign_buckets(sizes, cap, first)]
    return groups


def assign_buckets(sizes: list[int], cap_bytes: float,
                   first_cap_bytes: float | None = None) -> list[list[int]]:
    """Buckets (lists of indices) from the parameters' ``sizes`` in bytes, in model order: filled
    in REVERSE order (backward's), each closed once it holds ``cap_bytes`` (the first one:
    ``first_cap_bytes``, so that the first allreduce starts early). torch DDP's from its second
    step, for a model that uses its layers once, in order.
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if not (cap_bytes > 0 and first_cap_bytes > 0):
        raise ValueError(f"bucket caps must be > 0 bytes, got {cap_bytes} and {first_cap_bytes}")
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        filled += sizes[i]
        # the cap rule: close the bucket once it holds AT LEAST the cap, so a bucket may exceed
        # it by its last tensor, and a tensor larger than the cap closes its bucket at once
        if filled >= (cap_bytes if buckets else first_cap_bytes):
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])


class Bucket:
    """One fusion buffer: the gradients of ``params`` side by side in ``flat``, so that one
    allreduce moves them all (one latency instead of one per tensor); ``views[j]`` is parameter
    j's slice. Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], names: list[str]) -> None:
        self.index, self.params, self.names = index, params, names
        numels = [p.numel() for p in params]
        self.flat = torch.zeros(sum(numels), dtype=params[0].dtype, device=params[0].device)
        self.views = [v.view_as(p) for v, p in zip(self.flat.split(numels), params, strict=True)]
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.ready, self.handle = set(), None  # no gradient in, no allreduce in flight


class Handle:
    """A bucket's allreduce in flight, started when made (``work``: torch.distributed's or the
    ring's); ``wait`` it, with a deadline. Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, bucket: Bucket, collectives: Any) -> None:
        self.bucket, self.start, self.end = bucket, time.perf_counter(), None
        self.work = collectives.all_reduce(bucket.flat, async_op=True)  # returns at once
        self.work.get_future().add_done_callback(self.finished)

    def finished(self, *_: Any) -> None:
        self.end = time.perf_counter()  # the work's done-callback

    def wait(self, timeout: float) -> None:
        b, kib = self.bucket, self.bucket.nbytes / 2**10
        size = f"{kib / 2**10:.2f} MiB" if kib >= 2**10 else f"{kib:.1f} KiB"  # for the error
        wait_work(self.work, timeout, f"allreduce of bucket {b.index} ({len(b.params)} tensors, "
                  f"{b.flat.numel()} elements, {size})")
        if self.end is None:
            self.finished()


# ----------------------------------------------------------------- 3. after backward
@dataclass(frozen=True)
class ReducerConfig:
    """How a reducer averages, checked when made. ``find_unused_parameters``: a parameter may get
    no gradient (it contributes zeros; unused on every rank, its grad stays None, as in torch DDP).
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    strategy: str = "overlap"
    bucket_cap_mb: float | None = None
    first_bucket_mb: float | None = None
    algorithm: str = "native"
    find_unused_parameters: bool = False
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, STRATEGIES)
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        if not (self.bucket_cap_mb is None or self.bucket_cap_mb >= 0):
            raise ValueError(f"bucket_cap_mb must be >= 0 (0: a bucket per tensor) or None, "
                             f"got {self.bucket_cap_mb!r}")


class Reducer:
    """Averages the gradients of ``named_params`` AFTER backward: ``finish()`` exchanges the
    buckets one after the other, each waited for before the next (``per_parameter``, ``flat``,
    ``bucketed``). Hooks mark each gradient ready; at the end of a backward pass
    :meth:`_backward_ended` calls ``finish()`` if ``finish_after_backward`` (torch DDP: averages
    in ``.grad`` when ``backward()`` returns); else the caller does (Horovod, in ``step()``).
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 config: ReducerConfig = ReducerConfig(), timeline: Timeline = DISABLED,
                 finish_after_backward: bool = False) -> None:
        seen, named = set(), []
        for name, p in named_params:
            if p.requires_grad and id(p) not in seen:  # frozen ones left out, tied ones once
                seen.add(id(p))
                named.append((name, p))
        if not named:
            raise ValueError("no parameter requires a gradient: nothing to average")
        self.config, self.strategy, self.timeout = config, config.strategy, config.timeout
        self.timeline, self.finish_after_backward = timeline, finish_after_backward
        self.dist = dist_or_fail()
        self.world_size, self.rank = self.dist.get_world_size(), self.dist.get_rank()
        # whose all_reduce sums a bucket: torch's, or the course's ring on a thread (Horovod's way)
        self.collectives = BackgroundRing(self.timeout) if config.algorithm == "ring" else self.dist
        groups = bucket_groups([(p.numel() * p.element_size(), p.dtype) for _, p in named],
                               config.strategy, config.bucket_cap_mb, config.first_bucket_mb)
        self.buckets = [Bucket(b, [named[i][1] for i in idx], [named[i][0] for i in idx])
                        for b, idx in enumerate(groups)]
        self.where = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        agree_layouts([b.flat for b in self.buckets], "the gradient buckets [buckets, elements, "
                      "checksum]: are the models the same?", self.timeout)
        self.enabled, self.started = True, False  # enabled False: no_sync(), no averaging
        self.backward_start, self.next_launch = None, 0  # next_launch: buckets go in order
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook) for _, p in named]

    def _hook(self, p: torch.nn.Parameter) -> None:
        """Autograd's: ``p.grad`` is final. The first of a pass queues autograd's end-of-pass
        callback, as torch DDP's reducer does."""
        if self.enabled and not self.started:
            self.backward_start = self.backward_start or time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        self.grad_ready(p)

    def _backward_ended(self) -> None:
        self.timeline.add("backward", "backward", self.backward_start, time.perf_counter())
        self.backward_start = None
        if self.finish_after_backward:
            self.finish()

    def grad_ready(self, p: torch.nn.Parameter) -> tuple[Bucket, int] | None:
        """``p.grad`` is final for this pass: its (bucket, place in it), or None in no_sync()."""
        if not self.enabled:
            return None
        self.started = True
        bucket, j = self.where[id(p)]
        if j in bucket.ready:
            raise DDPError(f"rank {self.rank}: the gradient of '{bucket.names[j]}' arrived twice "
                           "in one backward pass: finish the exchange (step) between passes")
        bucket.ready.add(j)
        return bucket, j

    def finish(self) -> None:
        """Launch, wait, write the averages into ``.grad``; a no-op if no gradient arrived."""
        if not self.started:
            return
        t_wait = self._check_complete()
        for bucket in self.buckets:  # one exchange at a time, all after backward
            for j in range(len(bucket.params)):
                self._copy_in(bucket, j)
            self._launch(bucket).wait(self.timeout)
        self._complete(t_wait)

    def _check_complete(self):
        missing = [n for b in self.buckets for j, n in enumerate(b.names) if j not in b.ready]
        if missing and not self.config.find_unused_parameters:
            raise DDPError(f"rank {self.rank}: parameters {missing[:8]} got no gradient in this "
                           "backward pass; pass find_unused_parameters=True if the model does "
                           "not use every parameter in every step")
        return time.perf_counter()

    def _copy_in(self, bucket, j):
        grad = bucket.params[j].grad
        if grad is None:  # unused on this rank: it contributes zeros
            bucket.views[j].zero_()
        else:  # divide on the way in: the sum of the ranks' parts is then the average
            torch.div(grad, self.world_size, out=bucket.views[j])

    def _launch(self, bucket):
        self.next_launch += 1
        bucket.handle = Handle(bucket, self.collectives)
        return bucket.handle

    def _complete(self, t_wait):
        """Wait for every bucket, copy the averages into ``.grad``, record the timeline."""
        used = None
        if self.config.find_unused_parameters:  # one allreduce of a used-flag per parameter
            flags = torch.tensor([float(j in b.ready) for b in self.buckets for j in
                                  range(len(b.params))], device=self.buckets[0].flat.device)
            all_reduce(flags, self.timeout, "the used-parameter flags")  # torch: local_used_map
            used = dict(zip(self.where, flags.tolist(), strict=True))
        for bucket in self.buckets:
            bucket.handle.wait(self.timeout)
            with torch.no_grad():
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if used is not None and used[id(p)] == 0:
                        continue  # unused on every rank: grad stays None, as in torch DDP
                    if p.grad is None:
                        p.grad = view.clone()  # a copy: the buffer is reused by the next pass
                    else:
                        p.grad.copy_(view)
            self.timeline.add(f"bucket {bucket.index}", "allreduce", bucket.handle.start,
                              bucket.handle.end, bytes=bucket.nbytes, tensors=len(bucket.params))
            bucket.ready, bucket.handle = set(), None  # ready for the next pass
        self.timeline.add("wait", "wait", t_wait, time.perf_counter())
        self.started, self.next_launch, self.backward_start = False, 0, None


# ----------------------------------------------------------------- 4. overlap with backward
class OverlappingReducer(Reducer):
    """The optimised version (``strategy="overlap"``): each bucket's allreduce starts from the
    hook of its last gradient, asynchronously, while backward computes the earlier layers;
    ``finish()`` launches what is left and waits for all of them with a deadline. This is what
    torch DDP and Horovod do. Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def grad_ready(self, p: torch.nn.Parameter) -> tuple[Bucket, int] | None:
        ready = super().grad_ready(p)
        if ready is None:
            return None
        self._copy_in(*ready)  # now, so the bucket is full the moment its last gradient is
        # Backward produces the last layer's gradients first, and the buckets were filled in
        # that reverse order, so bucket 0 completes first. Launch strictly in bucket order all
        # the same: a complete bucket behind an incomplete one waits, so that every rank issues
        # the same sequence of collectives (Gloo and NCCL pair them by order, not by name).
        while self.next_launch < len(self.buckets):
            nxt = self.buckets[self.next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
        return ready

    def finish(self) -> None:
        if not self.started:
            return
        t_wait = self._check_complete()
        for bucket in self.buckets[self.next_launch:]:  # incomplete: an unused parameter
            for j in range(len(bucket.params)):
                if j not in bucket.ready:
                    self._copy_in(bucket, j)
            self._launch(bucket)
        self._complete(t_wait)


def make_reducer(named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 config: ReducerConfig = ReducerConfig(), timeline: Timeline = DISABLED,
                 finish_after_backward: bool = False) -> Reducer:
    """The reducer of ``config.strategy``: :class:`OverlappingReducer` for ``overlap``, else
    the after-backward :class:`Reducer`. Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    cls = OverlappingReducer if config.strategy == "overlap" else Reducer
    return cls(named_params, config, timeline, finish_after_backward)


# ----------------------------------------------------------------- 5. the wrapper
def broadcast_parameters(params: torch.nn.Module | Iterable[torch.Tensor | tuple[str, Any]],
                         root: int = 0, timeout: float = DEFAULT_TIMEOUT,
                         check: bool = True) -> None:
    """Copy rank ``root``'s parameters (and buffers, of a module) to every rank, in place: one
    broadcast per dtype, of all its tensors flattened together. ``check=False`` skips the
    agreement on sizes. Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    if isinstance(params, torch.nn.Module):
        tensors = list(params.parameters()) + list(params.buffers())
    else:  # tensors, or (name, tensor) pairs
        tensors = [t[1] if isinstance(t, tuple) else t for t in params]
    if check:
        agree_layouts(tensors, "the tensors to broadcast [count, elements, checksum]", timeout)
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        broadcast(flat, root, timeout, f"{len(group)} {dtype} tensors")  # with a deadline
        with torch.no_grad():
            for t, part in zip(group, flat.split([t.numel() for t in group]), strict=True):
                t.copy_(part.view_as(t))


class DistributedDataParallel(torch.nn.Module):
    """A from-scratch ``torch.nn.parallel.DistributedDataParallel``: broadcasts rank 0's
    parameters when made; when ``loss.backward()`` returns, every ``.grad`` holds the average
    over the ranks. Options: :class:`ReducerConfig`'s; a ``timeline`` records every pass. With
    ``broadcast_buffers`` rank 0's buffers (BatchNorm's statistics: no gradient keeps them equal)
    reach every rank before each forward, not after one under ``no_sync()`` or ``no_grad()``,
    as in torch DDP. Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, module: torch.nn.Module, strategy: str = "overlap",
                 bucket_cap_mb: float | None = None, algorithm: str = "native",
                 find_unused_parameters: bool = False, timeline: Timeline = DISABLED,
                 timeout: float = DEFAULT_TIMEOUT, first_bucket_mb: float | None = None,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.config = ReducerConfig(strategy, bucket_cap_mb, first_bucket_mb, algorithm,
                                    find_unused_parameters, timeout)  # before any collective
        self.module, self.timeline = module, timeline
        broadcast_parameters(module, timeout=timeout)  # the ranks agree on every size here
        self.broadcast_buffers, self._sync_buffers_next = broadcast_buffers, True
        self.reducer = make_reducer(module.named_parameters(), self.config, timeline,
                                    finish_after_backward=True)  # torch DDP's contract

    @property
    def buckets(self) -> list[list[str]]:
        return [b.names for b in self.reducer.buckets]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients locally; the first backward after
        it averages the sum (gradient accumulation: a larger batch for the same messages)."""
        self.reducer.enabled = False
        try:
            yield
        finally:
            self.reducer.enabled = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        buffers = list(self.module.buffers())
        if self.broadcast_buffers and buffers and self._sync_buffers_next:
            broadcast_parameters(buffers, timeout=self.config.timeout, check=False)
        out = self.module(*args, **kwargs)
        # torch DDP: the next forward syncs buffers only if this one will average gradients
        self._sync_buffers_next = torch.is_grad_enabled() and self.reducer.enabled
        self.timeline.add("forward", "forward", start, time.perf_counter())
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._mark_backward_start)
        return out

    def _mark_backward_start(self, _grad):
        self.reducer.backward_start = time.perf_counter()  # the timeline's backward span
