"""Tensor fusion and overlap: the gradient buckets inside DistributedDataParallel and Horovod.

Introduced in notebooks/06_data_parallel_sgd.ipynb. A :class:`Reducer` owns the gradients of a
model's parameters, grouped into buckets (flat fusion buffers), and averages them over the ranks
in one backward pass. Hooks on the parameters (``register_post_accumulate_grad_hook``) tell it
when each gradient is final. The plain :class:`Reducer` exchanges every bucket after backward,
one after the other; :class:`OverlappingReducer` launches a bucket's allreduce asynchronously
as soon as its last gradient is ready, while backward computes the gradients of earlier
layers, and ``finish()`` waits for all of them with a deadline. :mod:`course_lib.ddp` builds the
DDP-like wrapper and the Horovod-style optimizer on it.
"""

from __future__ import annotations

import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from course_lib.comm import DEFAULT_TIMEOUT
from course_lib.comm import wait_work as comm_wait_work
from course_lib.engine import mark_group_broken

STRATEGIES = ("per_parameter", "flat", "bucketed", "overlap")
ALGORITHMS = ("native", "ring")
# torch DDP (2.13): bucket_cap_mb left at its default (None) means 25 MiB, and then a first
# bucket of 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) so that communication starts early; a cap
# that is given applies to the first bucket too.
DEFAULT_BUCKET_CAP_MB = 25
FIRST_BUCKET_MB = 1.0
_RING = {}  # the background thread that runs the course's ring, one per process


class DDPError(RuntimeError):
    """A gradient exchange failed or missed its deadline.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""


def dist_or_fail():
    """``torch.distributed``, initialised, or a clear error.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise DDPError("torch.distributed is not initialised: run on a cluster's ranks "
                       "(start_cluster) or under torchrun / mpiexec")
    return dist


def wait_work(work, timeout, what):
    """:func:`course_lib.comm.wait_work`, raising :class:`DDPError`.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    comm_wait_work(work, timeout, what, DDPError)


def agree(record, what, timeout, device="cpu"):
    """Check that every rank holds the same small int64 ``record`` (sizes, a checksum) before
    a native collective whose sizes must match: a mismatch there can abort Gloo or return a
    wrong sum. Raises :class:`DDPError` on every rank, naming each rank's record. (The
    from-scratch collectives use :func:`course_lib.agreement.check_agreement` instead: it needs
    no process group; see that module.) Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    import torch
    dist = dist_or_fail()
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    wait_work(dist.all_gather(table, mine, async_op=True), timeout,
              f"agreement on {what} ({len(record)} integers)")
    rows = [t.tolist() for t in table]
    if any(row != rows[0] for row in rows):
        listed = ", ".join(f"rank {r}: {row}" for r, row in enumerate(rows[:8]))
        raise DDPError(f"rank {dist.get_rank()}: the ranks disagree on {what}: {listed}")


def layout(tensors):
    """``[count, elements, checksum of shapes and dtypes]``: what ranks must agree on.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    text = ";".join(f"{tuple(t.shape)}{t.dtype}" for t in tensors)
    return [len(tensors), sum(t.numel() for t in tensors), zlib.crc32(text.encode())]


def _check_choice(value, allowed, what):
    if value not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, not {value!r}")
    return value


def assign_buckets(sizes, cap_bytes, first_cap_bytes=None):
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
        if filled >= (cap_bytes if buckets else first_cap_bytes):
            buckets.append(current)
            current, filled = [], 0
    return buckets + ([current] if current else [])


class Bucket:
    """One fusion buffer: the gradients of ``params`` side by side in ``flat``.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, index, params, names):
        import torch
        self.index, self.params, self.names = index, params, names
        self.numels = [p.numel() for p in params]
        self.flat = torch.zeros(sum(self.numels), dtype=params[0].dtype, device=params[0].device)
        self.views = [v.view_as(p) for v, p in zip(self.flat.split(self.numels), params,
                                                   strict=True)]
        self.calls = 0
        self.reset()

    def reset(self):
        self.ready, self.handle = set(), None

    @property
    def nbytes(self):
        return self.flat.numel() * self.flat.element_size()

    def describe(self):
        size = (f"{self.nbytes / 2**20:.2f} MiB" if self.nbytes >= 2**20
                else f"{self.nbytes / 2**10:.1f} KiB")
        return f"bucket {self.index} ({len(self.params)} tensors, {self.flat.numel()} " \
               f"elements, {size})"


class Handle:
    """An allreduce in flight: ``wait`` returns once it is done or raises :class:`DDPError`.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, bucket):
        self.bucket, self.start, self.end = bucket, time.perf_counter(), None
        self.work = self.future = None

    def finished(self, *_):
        self.end = time.perf_counter()

    def wait(self, timeout):
        what = f"allreduce of {self.bucket.describe()}"
        if self.work is not None:
            wait_work(self.work, timeout, what)
        else:  # the course's ring, on the background thread
            try:
                self.future.result(timeout)
            except FutureTimeout:
                mark_group_broken(what)  # the ring is still running: repaired before next call
                raise DDPError(f"rank {dist_or_fail().get_rank()}: {what} did not complete "
                               f"within {timeout:g}s") from None
        if self.end is None:
            self.finished()


def bucket_groups(sizes_and_dtypes, strategy, bucket_cap_mb=None, first_bucket_mb=None):
    """The buckets of a strategy as lists of parameter indices: one per parameter
    (``per_parameter``), one per dtype (``flat``), or :func:`assign_buckets` per dtype
    (``bucketed``, ``overlap``) with torch DDP's caps: ``bucket_cap_mb=None`` means 25 MiB and
    a first bucket of 1 MiB; a cap that is given caps the first bucket too, unless
    ``first_bucket_mb`` says otherwise. ``sizes_and_dtypes``: (bytes, dtype) per parameter, in
    model order. Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    _check_choice(strategy, STRATEGIES, "strategy")
    if not (bucket_cap_mb is None or bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be > 0 or None, got {bucket_cap_mb!r}")
    if strategy == "per_parameter":
        return [[i] for i in reversed(range(len(sizes_and_dtypes)))]
    if first_bucket_mb is None and bucket_cap_mb is None:  # torch: 1 MiB at the default cap only
        first_bucket_mb = FIRST_BUCKET_MB
    cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    cap = 2.0**62 if strategy == "flat" else cap_mb * 2**20
    first = cap if first_bucket_mb is None or strategy == "flat" else first_bucket_mb * 2**20
    groups = []
    for dtype in sorted({d for _, d in sizes_and_dtypes}, key=str):  # one dtype per buffer
        idx = [i for i, (_, d) in enumerate(sizes_and_dtypes) if d == dtype]
        sizes = [sizes_and_dtypes[i][0] for i in idx]
        groups += [[idx[k] for k in g] for g in assign_buckets(sizes, cap, first)]
    return groups


class Reducer:
    """Averages the gradients of ``named_params`` over all ranks AFTER backward: ``finish()``
    exchanges the buckets one after the other, each allreduce waited for before the next
    (``per_parameter``, ``flat`` and ``bucketed``: they differ only in the buckets).

    Hooks mark each gradient ready during backward; ``on_first_grad`` is called at the first
    gradient of a backward pass (the DDP wrapper queues its end-of-backward callback there).
    The buckets are :func:`bucket_groups`': ``bucket_cap_mb=None`` is torch DDP's default (25
    MiB, the first bucket 1 MiB); ``first_bucket_mb`` overrides the first bucket's cap.
    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """

    def __init__(self, named_params, strategy="bucketed", bucket_cap_mb=None, algorithm="native",
                 find_unused_parameters=False, timeline=None, timeout=DEFAULT_TIMEOUT,
                 on_first_grad=None, first_bucket_mb=None):
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
        self.on_first_grad, self.started, self.comm = on_first_grad, False, None
        self.next_launch = 0  # buckets start strictly in order, so every rank's order agrees
        self.hooks = [p.register_post_accumulate_grad_hook(self.grad_ready) for _, p in named]

    # -- one backward pass
    def grad_ready(self, p):
        """``p.grad`` is final for this backward pass (the hooks call this)."""
        self._mark_ready(p)

    def _mark_ready(self, p):
        """Mark ``p``'s gradient ready; its (bucket, place in it), or None inside no_sync()."""
        if not self.enabled:
            return None
        if not self.started:
            self.started = True
            if self.on_first_grad is not None:
                self.on_first_grad()
        bucket, j = self.where[id(p)]
        if j in bucket.ready:
            raise DDPError(f"rank {self.rank}: the gradient of '{bucket.names[j]}' arrived twice "
                           "in one backward pass: finish the exchange (step) between passes")
        bucket.ready.add(j)
        return bucket, j

    def finish(self):
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
        import torch
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
            handle.future = _ring_thread().submit(self._ring, handle)
        return handle

    def _ring(self, handle):
        from course_lib.collectives import allreduce
        from course_lib.comm_torch import TorchComm
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
        self.started, self.next_launch = False, 0

    def _copy_out(self, bucket, used):
        import torch
        with torch.no_grad():
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if used is not None and not used[id(p)]:
                    continue  # unused on every rank: grad stays None, as in torch DDP
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
        h = bucket.handle
        if self.timeline is not None:
            self.timeline.add(f"bucket {bucket.index}", "allreduce", h.start, h.end,
                              bytes=bucket.nbytes, tensors=len(bucket.params))
        bucket.reset()

    def _used_everywhere(self):
        """One small allreduce of a used-flag per parameter (torch DDP's local_used_map)."""
        import torch
        flags = torch.tensor([float(j in b.ready) for b in self.buckets
                              for j in range(len(b.params))])
        wait_work(self.dist.all_reduce(flags, async_op=True), self.timeout,
                  f"allreduce of the {len(flags)} used-parameter flags")
        params = [p for b in self.buckets for p in b.params]
        return {id(p): f > 0 for p, f in zip(params, flags.tolist(), strict=True)}

    def remove(self):
        """Take the hooks off the parameters."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


class OverlappingReducer(Reducer):
    """The optimised version (``strategy="overlap"``): each bucket's allreduce starts from the
    hook of its last gradient, asynchronously, while backward computes the earlier layers;
    ``finish()`` launches what is left and waits for all of them with a deadline. This is what
    torch DDP and Horovod do. Introduced in notebooks/06_data_parallel_sgd.ipynb."""

    def __init__(self, named_params, strategy="overlap", *args, **kwargs):
        super().__init__(named_params, strategy, *args, **kwargs)

    def grad_ready(self, p):
        ready = self._mark_ready(p)
        if ready is None:
            return
        self._copy_in(*ready)  # now, so the bucket is full the moment its last gradient is
        # Launch strictly in bucket order: a complete bucket behind an incomplete one waits, so
        # that every rank issues the same sequence of collectives (Gloo pairs them by order).
        while self.next_launch < len(self.buckets):
            nxt = self.buckets[self.next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)

    def finish(self):
        if not self.started:
            return
        t_wait = self._check_complete()
        for bucket in self.buckets[self.next_launch:]:  # incomplete: an unused parameter
            for j in range(len(bucket.params)):
                if j not in bucket.ready:
                    self._copy_in(bucket, j)
            self._launch(bucket)
        self._complete(t_wait)


def make_reducer(named_params, strategy="overlap", *args, **kwargs):
    """The reducer of a strategy: :class:`OverlappingReducer` for ``overlap``, else the
    after-backward :class:`Reducer` with the strategy's buckets.
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    cls = OverlappingReducer if strategy == "overlap" else Reducer
    return cls(named_params, strategy, *args, **kwargs)


def _ring_thread():
    if "pool" not in _RING:
        _RING["pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="course-ring")
    return _RING["pool"]
