"""Synchronous data parallelism from scratch: what DistributedDataParallel and Horovod do inside.

Introduced in notebooks/06_data_parallel_sgd.ipynb. Every rank holds a full copy of the model,
computes the gradient of its slice of the global batch, and the ranks average their gradients
before every step, so all copies stay equal and the run equals one process on the global batch.
How the averaging is done is what makes it fast or slow. This file reads from top to bottom, from
the naive averager to the one torch DDP and Horovod use, then the wrappers built on them:

    1. naive          ``average_gradients_naive``: one blocking allreduce per gradient after
                      backward; a model of K tensors pays the latency alpha K times
    2. tensor fusion  ``bucket_groups``, ``assign_buckets``: which gradients share one flat
                      buffer (a bucket), one allreduce each: one bucket per parameter
                      (``per_parameter``), one for everything (``flat``), or buckets closed once
                      they hold at least ``bucket_cap_mb``, filled in reverse parameter order,
                      the order backward produces the gradients (``bucketed``)
    3. after backward ``Reducer``: copy a bucket's gradients in, allreduce it, wait, next
                      bucket; the three strategies above differ only in their buckets
    4. overlap        ``OverlappingReducer``: each bucket's allreduce starts asynchronously from
                      an autograd hook as soon as its last gradient is ready, while backward
                      computes the earlier layers; the waits happen at the end of backward
                      (torch DDP) or in ``step`` (Horovod)
    5. the wrappers   ``broadcast_parameters``, ``DistributedDataParallel`` and the Horovod-style
                      ``DistributedOptimizer``, which own a reducer and call it; it never calls
                      them back

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

The file is longer than the ~300 lines of one sitting on purpose: the four averagers stay side by
side because the differences between them are the lesson (as picotron keeps
``DataParallelNaive`` beside ``DataParallelBucket``). The checks around torch.distributed's calls
(a process group, deadlines, the ranks' agreement on sizes) are in :mod:`course_lib.dist_checks`.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from course_lib.collectives import allreduce
from course_lib.comm import DEFAULT_TIMEOUT, TorchComm
from course_lib.dist_checks import DDPError, agree, dist_or_fail, layout, wait_work
from course_lib.engine import mark_group_broken

if TYPE_CHECKING:
    from course_lib.timeline import Timeline

__all__ = ["ALGORITHMS", "DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_MB", "STRATEGIES", "Bucket",
           "DDPError", "DistributedDataParallel", "DistributedOptimizer", "Handle",
           "OverlappingReducer", "Reducer", "assign_buckets", "average_gradients",
           "average_gradients_naive", "broadcast_optimizer_state", "broadcast_parameters",
           "bucket_groups", "make_reducer"]

STRATEGIES = ("per_parameter", "flat", "bucketed", "overlap")
ALGORITHMS = ("native", "ring")
# torch DDP (2.13): bucket_cap_mb left at its default (None) means 25 MiB, and then a first
# bucket of 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) so that communication starts early; a cap
# that is given applies to the first bucket too.
DEFAULT_BUCKET_CAP_MB = 25
FIRST_BUCKET_MB = 1.0


def _check_choice(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, not {value!r}")
    return value


# ----------------------------------------------------------------- 1. naive: one per gradient
def average_gradients_naive(params: Iterable[torch.nn.Parameter],
                            timeout: float = DEFAULT_TIMEOUT) -> list[torch.nn.Parameter]:
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


# ----------------------------------------------------------------- 2. tensor fusion: buckets
def bucket_groups(sizes_and_dtypes: list[tuple[int, torch.dtype]], strategy: str,
                  bucket_cap_mb: float | None = None,
                  first_bucket_mb: float | None = None) -> list[list[int]]:
    """The buckets of a strategy as lists of parameter indices: one per parameter
    (``per_parameter``), one per dtype (``flat``), or :func:`assign_buckets` per dtype
    (``bucketed``, ``overlap``) with torch DDP's caps: ``bucket_cap_mb=None`` means 25 MiB and
    a first bucket of 1 MiB; a cap that is given caps the first bucket too, unless
    ``first_bucket_mb`` says otherwise. Two caps name the extremes: ``0`` gives every tensor
    its own bucket (under ``overlap``, one allreduce launched from each gradient's hook) and
    ``math.inf`` one bucket for everything. ``sizes_and_dtypes``: (bytes, dtype) per
    parameter, in model order. Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    _check_choice(strategy, STRATEGIES, "strategy")
    if not (bucket_cap_mb is None or bucket_cap_mb >= 0):
        raise ValueError(f"bucket_cap_mb must be >= 0 (0: a bucket per tensor) or None, got "
                         f"{bucket_cap_mb!r}")
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
    """Group parameters into buckets for tensor fusion; returns lists of indices into ``sizes``.

    ``sizes`` are the parameters' sizes in bytes, in model order. Buckets are filled in REVERSE
    order (backward produces the last layer's gradients first), and a bucket is closed as soon
    as it holds at least ``cap_bytes`` (the first one: ``first_cap_bytes``, if given, kept small
    so that the first allreduce starts early).

    torch DDP (2.13) uses this rule only from its second step on: step 1 reduces every
    gradient in one bucket and records the order in which they become ready; before step 2 it
    rebuilds its buckets by this rule, walking that order (not the reverse parameter order),
    with ``cap_bytes = bucket_cap_mb * 2**20`` and ``first_cap_bytes`` = 1 MiB while
    ``bucket_cap_mb`` is left at its default (a cap that is given caps the first bucket too).
    Its buckets equal these from step 2 on for a model whose gradients become ready in reverse
    parameter order (an MLP: each layer used once, in order). With
    ``find_unused_parameters=True`` torch instead fills its buckets once, at construction,
    from the first parameter to the last, and never rebuilds them.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """
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
    """One fusion buffer: the gradients of ``params`` side by side in ``flat``.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], names: list[str]) -> None:
        self.index, self.params, self.names = index, params, names
        self.numels = [p.numel() for p in params]
        # One contiguous buffer so that one allreduce moves every gradient in it (one latency
        # instead of one per tensor); views[j] is parameter j's slice of it, shaped like it.
        # The .grad tensors live elsewhere, so gradients are copied in before the allreduce and
        # the averages copied back after (torch DDP can instead make .grad a view of the bucket:
        # gradient_as_bucket_view=True).
        self.flat = torch.zeros(sum(self.numels), dtype=params[0].dtype, device=params[0].device)
        self.views = [v.view_as(p) for v, p in zip(self.flat.split(self.numels), params,
                                                   strict=True)]
        self.calls = 0
        self.reset()

    def reset(self) -> None:
        """Ready for the next backward pass: no gradient in, no allreduce in flight."""
        self.ready, self.handle = set(), None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def describe(self) -> str:
        """``bucket 0 (4 tensors, 1200 elements, 4.7 KiB)``, for error messages."""
        size = (f"{self.nbytes / 2**20:.2f} MiB" if self.nbytes >= 2**20
                else f"{self.nbytes / 2**10:.1f} KiB")
        return f"bucket {self.index} ({len(self.params)} tensors, {self.flat.numel()} " \
               f"elements, {size})"


class Handle:
    """An allreduce in flight: ``wait`` returns once it is done or raises :class:`DDPError`.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket, self.start, self.end = bucket, time.perf_counter(), None
        self.work: torch.distributed.Work | None = None  # the native allreduce
        self.future: Future | None = None                # or the course's ring, on its thread

    def finished(self, *_: Any) -> None:
        """Record the end time (the native work's done-callback, or the ring's last line)."""
        self.end = time.perf_counter()

    def wait(self, timeout: float) -> None:
        """Wait for the allreduce, with a deadline."""
        what = f"allreduce of {self.bucket.describe()}"
        if self.work is not None:
            wait_work(self.work, timeout, what)
        else:
            try:
                self.future.result(timeout)
            except FutureTimeout:
                mark_group_broken(what)  # the ring is still running: repaired before next call
                raise DDPError(f"rank {dist_or_fail().get_rank()}: {what} did not complete "
                               f"within {timeout:g}s") from None
        if self.end is None:
            self.finished()


# ----------------------------------------------------------------- 3. after backward
class Reducer:
    """Averages the gradients of ``named_params`` over all ranks AFTER backward: ``finish()``
    exchanges the buckets one after the other, each allreduce waited for before the next
    (``per_parameter``, ``flat`` and ``bucketed``: they differ only in the buckets).

    Hooks mark each gradient ready during backward. With ``finish_after_backward=True`` (torch
    DDP) the first gradient of a pass also asks autograd to call ``finish()`` once the pass is
    over, so the averages are in ``.grad`` when ``backward()`` returns; otherwise (Horovod) the
    caller calls ``finish()``. The buckets are :func:`bucket_groups`': ``bucket_cap_mb=None`` is
    torch DDP's default (25 MiB, the first bucket 1 MiB); ``first_bucket_mb`` overrides the
    first bucket's cap. Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 strategy: str = "bucketed", bucket_cap_mb: float | None = None,
                 algorithm: str = "native", find_unused_parameters: bool = False,
                 timeline: Timeline | None = None, timeout: float = DEFAULT_TIMEOUT,
                 first_bucket_mb: float | None = None,
                 finish_after_backward: bool = False) -> None:
        self.strategy = _check_choice(strategy, STRATEGIES, "strategy")
        self.algorithm = _check_choice(algorithm, ALGORITHMS, "algorithm")
        seen, named = set(), []
        for name, p in named_params:
            if p.requires_grad and id(p) not in seen:  # frozen ones left out, tied ones once
                seen.add(id(p))
                named.append((name, p))
        if not named:
            raise ValueError("no parameter requires a gradient: nothing to average")
        self.find_unused, self.timeline, self.timeout = find_unused_parameters, timeline, timeout
        self.finish_after_backward = finish_after_backward
        self.dist = dist_or_fail()
        self.world_size, self.rank = self.dist.get_world_size(), self.dist.get_rank()
        groups = bucket_groups([(p.numel() * p.element_size(), p.dtype) for _, p in named],
                               strategy, bucket_cap_mb, first_bucket_mb)
        self.buckets = [Bucket(b, [named[i][1] for i in idx], [named[i][0] for i in idx])
                        for b, idx in enumerate(groups)]
        self.where = {id(p): (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        agree(layout([b.flat for b in self.buckets]), "the gradient buckets [buckets, "
              "elements, checksum]: are the models the same?", timeout, named[0][1].device)
        self.enabled = True  # False inside no_sync(): gradients only accumulate locally
        self.started, self.comm = False, None
        self.backward_start = None  # for the timeline; the DDP wrapper sets it at backward's start
        self.next_launch = 0  # buckets start strictly in order, so every rank's order agrees
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook) for _, p in named]

    # -- one backward pass
    def _hook(self, p: torch.nn.Parameter) -> None:
        """Autograd's hook: ``p.grad`` is final. At the first gradient of a pass, queue
        :meth:`_backward_ended`, which autograd runs once every gradient of the pass exists."""
        if self.enabled and not self.started:
            if self.backward_start is None:
                self.backward_start = time.perf_counter()
            if self.finish_after_backward or self.timeline is not None:
                # autograd's end-of-pass callback, the one torch DDP's reducer uses as well
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        self.grad_ready(p)

    def _backward_ended(self) -> None:
        end = time.perf_counter()
        if self.timeline is not None:
            self.timeline.add("backward", "backward", self.backward_start or end, end)
        self.backward_start = None
        if self.finish_after_backward:
            self.finish()

    def grad_ready(self, p: torch.nn.Parameter) -> None:
        """``p.grad`` is final for this backward pass (the hooks call this)."""
        self._mark_ready(p)

    def _mark_ready(self, p):
        """Mark ``p``'s gradient ready; its (bucket, place in it), or None inside no_sync()."""
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
        """Complete the exchange of this backward pass: launch, wait, write the averages into
        ``.grad``. A no-op when no gradient arrived since the last."""
        if not self.started:
            return
        t_wait = self._check_complete()
        for bucket in self.buckets:  # one exchange at a time, all after backward
            for j in range(len(bucket.params)):
                self._copy_in(bucket, j)
            self._launch(bucket).wait(self.timeout)
        self._complete(t_wait)

    def _check_complete(self):
        missing = [b.names[j] for b in self.buckets for j in range(len(b.params))
                   if j not in b.ready]
        if missing and not self.find_unused:
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
        handle = bucket.handle = Handle(bucket)
        if self.algorithm == "native":
            handle.work = self.dist.all_reduce(bucket.flat, async_op=True)
            handle.work.get_future().add_done_callback(handle.finished)
        else:
            handle.future = _ring_pool().submit(self._ring, handle)
        return handle

    def _ring(self, handle):
        if self.comm is None:
            self.comm = TorchComm(timeout=self.timeout)
        bucket = handle.bucket
        allreduce(bucket.flat, self.comm, "ring_pipelined", op="sum", check=bucket.calls == 0)
        bucket.calls += 1
        handle.finished()

    def _complete(self, t_wait):
        """Wait for every bucket, write the averages into ``.grad``, record the timeline."""
        used = self._used_everywhere() if self.find_unused else None  # after every bucket
        for bucket in self.buckets:
            bucket.handle.wait(self.timeout)
            self._copy_out(bucket, used)
        if self.timeline is not None:
            self.timeline.add("wait", "wait", t_wait, time.perf_counter())
        self.started, self.next_launch, self.backward_start = False, 0, None

    def _copy_out(self, bucket, used):
        # the averages are in the bucket's buffer: .grad must hold them for the optimizer
        with torch.no_grad():
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if used is not None and not used[id(p)]:
                    continue  # unused on every rank: grad stays None, as in torch DDP
                if p.grad is None:
                    p.grad = view.clone()  # a copy: the buffer is reused by the next pass
                else:
                    p.grad.copy_(view)
        h = bucket.handle
        if self.timeline is not None:
            self.timeline.add(f"bucket {bucket.index}", "allreduce", h.start, h.end,
                              bytes=bucket.nbytes, tensors=len(bucket.params))
        bucket.reset()

    def _used_everywhere(self):
        """One small allreduce of a used-flag per parameter (torch DDP's local_used_map)."""
        flags = torch.tensor([float(j in b.ready) for b in self.buckets
                              for j in range(len(b.params))],  # on the gradients' device (NCCL)
                             device=self.buckets[0].flat.device if self.buckets else "cpu")
        wait_work(self.dist.all_reduce(flags, async_op=True), self.timeout,
                  f"allreduce of the {len(flags)} used-parameter flags")
        params = [p for b in self.buckets for p in b.params]
        return {id(p): f > 0 for p, f in zip(params, flags.tolist(), strict=True)}

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


def average_gradients(params: Iterable[torch.nn.Parameter], strategy: str = "bucketed",
                      bucket_cap_mb: float | None = None, algorithm: str = "native",
                      timeline: Timeline | None = None,
                      timeout: float = DEFAULT_TIMEOUT) -> list[torch.nn.Parameter]:
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
        reducer.started = True  # a rank without any gradient still joins every allreduce
        reducer.finish()
    finally:
        reducer.remove()
    return params


# ----------------------------------------------------------------- 4. overlap with backward
class OverlappingReducer(Reducer):
    """The optimised version (``strategy="overlap"``): each bucket's allreduce starts from the
    hook of its last gradient, asynchronously, while backward computes the earlier layers;
    ``finish()`` launches what is left and waits for all of them with a deadline. This is what
    torch DDP and Horovod do. Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 strategy: str = "overlap", *args: Any, **kwargs: Any) -> None:
        super().__init__(named_params, strategy, *args, **kwargs)

    def grad_ready(self, p: torch.nn.Parameter) -> None:
        ready = self._mark_ready(p)
        if ready is None:
            return
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
                 strategy: str = "overlap", *args: Any, **kwargs: Any) -> Reducer:
    """The reducer of a strategy: :class:`OverlappingReducer` for ``overlap``, else the
    after-backward :class:`Reducer` with the strategy's buckets.
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    cls = OverlappingReducer if strategy == "overlap" else Reducer
    return cls(named_params, strategy, *args, **kwargs)


_RING: dict[str, ThreadPoolExecutor] = {}  # the thread that runs the course's ring, one per process


def _ring_pool() -> ThreadPoolExecutor:
    if "pool" not in _RING:
        _RING["pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="course-ring")
    return _RING["pool"]


# ----------------------------------------------------------------- 5. the wrappers
def _tensors(obj):
    """Tensors of a module (parameters and buffers), or of an iterable of tensors / pairs."""
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    return [t[1] if isinstance(t, tuple) else t for t in obj]


def broadcast_parameters(params: torch.nn.Module | Iterable[torch.Tensor | tuple[str, Any]],
                         root: int = 0, timeout: float = DEFAULT_TIMEOUT,
                         check: bool = True) -> None:
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


class DistributedDataParallel(torch.nn.Module):
    """A from-scratch ``torch.nn.parallel.DistributedDataParallel``: broadcasts rank 0's
    parameters on construction, and when ``loss.backward()`` returns every ``.grad`` holds the
    average over the ranks. ``buckets`` lists the parameter names of each bucket. The caps are
    torch DDP's (2.13): ``bucket_cap_mb=None`` means 25 MiB with a first bucket of 1 MiB; a
    cap that is given applies to the first bucket too (``first_bucket_mb`` overrides it);
    ``0`` gives each tensor its own allreduce, launched from its gradient's hook, and
    ``math.inf`` one bucket for everything.
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

    def __init__(self, module: torch.nn.Module, strategy: str = "overlap",
                 bucket_cap_mb: float | None = None, algorithm: str = "native",
                 find_unused_parameters: bool = False, timeline: Timeline | None = None,
                 timeout: float = DEFAULT_TIMEOUT, first_bucket_mb: float | None = None,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        for value, allowed, name in [(strategy, STRATEGIES, "strategy"),
                                     (algorithm, ALGORITHMS, "algorithm")]:
            _check_choice(value, allowed, name)  # before any process group is needed
        self.module, self.timeline, self.timeout = module, timeline, timeout
        broadcast_parameters(module, timeout=timeout)  # the ranks agree on every size here
        self.broadcast_buffers, self._sync_buffers_next = broadcast_buffers, True
        # torch DDP's contract: the averages are in .grad when backward() returns, so the
        # reducer finishes by itself at the end of every backward pass
        self.reducer = make_reducer(module.named_parameters(), strategy, bucket_cap_mb, algorithm,
                                    find_unused_parameters, timeline, timeout,
                                    first_bucket_mb=first_bucket_mb, finish_after_backward=True)

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
        self.reducer.backward_start = time.perf_counter()  # the timeline's backward span


class DistributedOptimizer:
    """Horovod's ``hvd.DistributedOptimizer``, from scratch: wraps an optimizer, starts the
    gradient allreduces from hooks during backward, and waits for them in ``step()``.
    Everything else (``param_groups``, ``state_dict``, ``zero_grad`` ...) is the wrapped one's.
    Buckets as in :class:`DistributedDataParallel`.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 strategy: str = "overlap", bucket_cap_mb: float | None = None,
                 algorithm: str = "native", find_unused_parameters: bool = False,
                 timeline: Timeline | None = None, timeout: float = DEFAULT_TIMEOUT,
                 first_bucket_mb: float | None = None) -> None:
        self.optimizer, self.timeline = optimizer, timeline
        names = {id(p): n for n, p in (named_parameters or [])}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        named = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]
        # Horovod's contract: backward only starts the allreduces, step() waits for them
        self.reducer = make_reducer(named, strategy, bucket_cap_mb, algorithm,
                                    find_unused_parameters, timeline, timeout,
                                    first_bucket_mb=first_bucket_mb)

    def synchronize(self) -> None:
        """Wait until every gradient is averaged (Horovod's ``optimizer.synchronize()``)."""
        self.reducer.finish()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self.synchronize()
        start = time.perf_counter()
        result = self.optimizer.step(closure)
        if self.timeline is not None:
            self.timeline.add("step", "step", start, time.perf_counter())
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, strategy={self.reducer.strategy!r})"
