"""Gradient compression: fewer bits per step (fp16, top-k with error feedback).

Introduced in notebooks/08_local_sgd_and_compression.ipynb. Each rank holds a flat 1-D gradient;
a compressor averages it over the ranks of the process group the cluster set up, sending less
than the float32 allreduce of data-parallel SGD::

    from course_lib import compression
    comp = compression.make_compressor("topk", ratio=0.01)   # one object per rank: it has state
    mean_grad = comp.allreduce(flat_grad)                    # every rank gets the same average
    comp.bytes_sent                                          # bytes this rank has sent so far

Three schemes, and what each rank sends per step for a gradient of n float32 numbers on N ranks
(Gloo's CPU allreduce moves as much as a ring; its all-gather sends each rank's part to the
N-1 others; notebook 08 checks both against the loopback counters of the kernel)::

    NoCompression   allreduce in float32          2 (N-1)/N * 4n bytes
    FP16            allreduce in float16          2 (N-1)/N * 2n bytes       (2x less)
    TopK(ratio)     all-gather k = ratio * n      (N-1) * k * (4 + 4) bytes  (values + int32
                    values and their indices                                  indices)

Top-k alone drops most of every gradient; **error feedback** (Stich et al. 2018; Lin et al. 2018,
"Deep Gradient Compression") keeps what was not sent in a per-rank residual and adds it to the
next gradient, so every coordinate is sent eventually and nothing is lost, only delayed.

Every compressor checks on its first call that all ranks agree on the length and dtype of the
gradient and on k (a collective given different sizes on different ranks can abort Gloo), and
every wait has a deadline whose error names the rank, the operation and the sizes.

It stays one file: the byte formulas, the compressors and the measurements of their bytes and
time on the ranks check one another, and notebook 08 reads them together.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from course_lib.collectives import ring_allgather, ring_allreduce
from course_lib.comm import DEFAULT_TIMEOUT, get_comm, wait_work
from course_lib.runtime import netem

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster

# what TopK calls to communicate: (flat_grad, residual, k) -> (mean, new_residual)
Exchange = Callable[[torch.Tensor, torch.Tensor | None, int], tuple[torch.Tensor, torch.Tensor]]

INDEX_DTYPE = torch.int32  # indices on the wire: 4 bytes each, as many as a float32 value


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in an allreduce of ``nbytes``: 2 (N-1)/N * nbytes (a ring).

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    return 2 * (world_size - 1) * nbytes / world_size


def allgather_bytes(nbytes_per_rank: float, world_size: int) -> float:
    """Bytes each rank sends in an all-gather of ``nbytes_per_rank`` from every rank: (N-1) x.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    return (world_size - 1) * nbytes_per_rank


def topk_compress(grad: torch.Tensor, residual: torch.Tensor | None,
                  k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k with error feedback: ``(values, indices, new_residual)``.

    ``corrected = grad + residual`` (``residual=None`` means zeros); the ``k`` entries of
    ``corrected`` with the largest magnitude are sent (``values = corrected[indices]``, in no
    particular order) and the rest is kept: ``new_residual`` is ``corrected`` with those
    entries set to zero, so ``new_residual + sent == grad + residual`` exactly. With
    ``k >= len(grad)`` everything is sent and the residual is all zeros. Among equal magnitudes
    any choice is valid. Lab 08 asks for this function.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb.
    """
    if not isinstance(grad, torch.Tensor) or grad.ndim != 1:
        raise ValueError(f"grad must be a 1-D torch tensor, got {type(grad).__name__} of shape "
                         f"{tuple(getattr(grad, 'shape', ()))}")
    if residual is not None and (residual.shape != grad.shape or residual.dtype != grad.dtype):
        raise ValueError(f"residual must match grad: {tuple(residual.shape)} {residual.dtype} vs "
                         f"{tuple(grad.shape)} {grad.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:  # bool is an int subclass
        raise ValueError(f"k must be an integer >= 1 (top-0 sends nothing), got {k!r}")
    corrected = grad if residual is None else grad + residual
    k = min(k, corrected.numel())
    indices = torch.topk(corrected.abs(), k, sorted=False).indices
    values = corrected[indices]
    new_residual = corrected.clone()  # a copy: corrected may be grad itself (no residual yet)
    new_residual[indices] = 0
    return values, indices, new_residual


def all_gather(tensor: torch.Tensor, timeout: float = DEFAULT_TIMEOUT) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype on all ranks), as a list in rank order.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    wait_work(dist.all_gather(out, tensor.contiguous(), async_op=True), timeout,
              f"all_gather of {tensor.numel()} x {str(tensor.dtype).replace('torch.', '')}")
    return out


def all_reduce_mean(tensor: torch.Tensor, timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """The mean over ranks of ``tensor`` (summed in its own dtype, then divided).

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    out = tensor.clone()  # all_reduce works in place: the caller's gradient stays as it was
    wait_work(dist.all_reduce(out, async_op=True), timeout,
              f"all_reduce of {out.numel()} x {str(out.dtype).replace('torch.', '')}")
    return out.div_(dist.get_world_size())


def topk_allreduce(flat_grad: torch.Tensor, residual: torch.Tensor | None, k: int,
                   timeout: float = DEFAULT_TIMEOUT) -> tuple[torch.Tensor, torch.Tensor]:
    """The average over ranks of every rank's top-k, and this rank's new residual.

    Each rank compresses with :func:`topk_compress`; values (in the gradient's dtype) and int32
    indices are exchanged with two all-gathers (k is the same on every rank, so the sizes agree)
    and every rank adds them into a dense vector in rank order, then divides by the world size:
    every rank ends with bit-identical results. Lab 08 asks for this function.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb.
    """
    values, indices, new_residual = topk_compress(flat_grad, residual, k)
    dense = torch.zeros_like(flat_grad)
    for v, i in zip(all_gather(values, timeout), all_gather(indices.to(INDEX_DTYPE), timeout),
                    strict=True):
        dense.index_add_(0, i.long(), v)  # add, not assign: ranks may pick the same index
    return dense.div_(dist.get_world_size()), new_residual


# ---------------------------------------------------------------- the compressors
class NoCompression:
    """Plain data parallelism: a float32 (the gradient's dtype) allreduce, then divide by N.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""

    name: str = "none"
    code: int = 0  # the scheme as a number, for the agreement round's int64 table

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout, self.bytes_sent, self.steps, self._n = timeout, 0.0, 0, None

    def step_bytes(self, n: int, itemsize: int, world_size: int) -> float:
        """Bytes this rank sends per step for a gradient of ``n`` elements of ``itemsize``."""
        return ring_allreduce_bytes(n * itemsize, world_size)

    def _agree(self, flat_grad):
        """First call: do all ranks agree on (length, dtype, k, scheme)? Later: same length."""
        if flat_grad.ndim != 1:
            raise ValueError(f"{self.name}: the gradient must be flat (1-D), got shape "
                             f"{tuple(flat_grad.shape)}")
        mine = (flat_grad.numel(), flat_grad.element_size(), self.k_for(flat_grad.numel()),
                self.code)
        if self._n is None:
            table = all_gather(torch.tensor(mine, dtype=torch.int64), self.timeout)
            rows = [tuple(t.tolist()) for t in table]
            if any(row != rows[0] for row in rows):
                names = {c.code: c.name for c in SCHEMES.values()}
                shown = ", ".join(f"rank {r}: {names.get(row[3], '?')} n={row[0]} "
                                  f"itemsize={row[1]} k={row[2]}" for r, row in enumerate(rows))
                raise ValueError(f"{self.name}: ranks disagree on the gradient: {shown}")
            self._n = mine[0]
        elif mine[0] != self._n:
            raise ValueError(f"rank {dist.get_rank()}: {self.name} was set up for a gradient of "
                             f"{self._n} elements, got {mine[0]}")

    def k_for(self, n: int) -> int:
        """How many entries a gradient of ``n`` sends (all of them here)."""
        return n

    def allreduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat_grad`` over all ranks (a new tensor); counts the bytes sent."""
        self._agree(flat_grad)
        out = self._exchange(flat_grad)
        self.steps += 1
        self.bytes_sent += self.step_bytes(flat_grad.numel(), flat_grad.element_size(),
                                           dist.get_world_size())
        return out

    def _exchange(self, flat_grad):
        return all_reduce_mean(flat_grad, self.timeout)


class FP16(NoCompression):
    """Cast to float16, divide by N, allreduce in float16, cast back: half the bytes.

    The same steps as torch's ``fp16_compress_hook`` for DDP. float16 keeps about 3 decimal
    digits and overflows above 65504, which gradients of a small model never reach (large
    models scale the loss first: mixed-precision training).
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""

    name, code = "fp16", 1

    def step_bytes(self, n: int, itemsize: int, world_size: int) -> float:
        return ring_allreduce_bytes(n * 2, world_size)

    def _exchange(self, flat_grad):
        # divided before the sum, as torch's hook does: a sum of N float16 gradients may overflow
        half = flat_grad.to(torch.float16).div_(dist.get_world_size())
        wait_work(dist.all_reduce(half, async_op=True), self.timeout,
                  f"all_reduce of {half.numel()} x float16")
        return half.to(flat_grad.dtype)


class TopK(NoCompression):
    """Send the k = ceil(ratio * n) largest entries and their indices; keep the rest as a
    residual added to the next gradient (``error_feedback=True``) or drop it (False).

    ``exchange(flat_grad, residual, k) -> (mean, new_residual)`` does the communication;
    :func:`topk_allreduce` by default (lab 08 plugs in its own).
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""

    name, code = "topk", 2

    def __init__(self, ratio: float, error_feedback: bool = True, exchange: Exchange | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        super().__init__(timeout)
        self.ratio, self.error_feedback = ratio, error_feedback
        self.exchange = exchange or topk_allreduce
        self.residual = None

    def k_for(self, n: int) -> int:
        # round first: 0.07 * 100 is 7.000000000000001 in floats, whose ceil would be 8
        return max(1, min(n, math.ceil(round(self.ratio * n, 9))))

    def step_bytes(self, n: int, itemsize: int, world_size: int) -> float:
        return allgather_bytes(self.k_for(n) * (itemsize + 4), world_size)  # + an int32 index

    def _exchange(self, flat_grad):
        residual = self.residual if self.error_feedback else None
        mean, new_residual = self.exchange(flat_grad, residual, self.k_for(flat_grad.numel()))
        if self.error_feedback:
            self.residual = new_residual
        return mean


SCHEMES = {"none": NoCompression, "fp16": FP16, "topk": TopK}


def make_compressor(name: str, ratio: float = 0.01, error_feedback: bool = True,
                    exchange: Exchange | None = None,
                    timeout: float = DEFAULT_TIMEOUT) -> NoCompression:
    """A fresh compressor from plain arguments (what a rank receives from ``cluster.run``).

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    if name not in SCHEMES:
        raise ValueError(f"name (the compression) must be one of {tuple(SCHEMES)}, not {name!r}")
    if name == "topk":
        return TopK(ratio, error_feedback, exchange, timeout)
    return SCHEMES[name](timeout)


def loopback_bytes() -> int | None:
    """Bytes sent so far over this machine's loopback interface (Linux), or None elsewhere.

    The kernel's own counter: the difference around a collective is what really went on the
    wire between ranks on one machine (plus anything else using loopback at the time).
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    # fields: 8 receive counters, then transmit bytes first
                    return int(counters.split()[8])
    except OSError:
        return None
    return None


def exchange_on_rank(name: str, n: int, ratio: float = 0.01, repeats: int = 5, trials: int = 3,
                     seed: int = 0) -> tuple[float, int | None, int | None]:
    """On every rank: ``trials`` times ``repeats`` exchanges of an ``n``-element float32
    gradient with scheme ``name``. Returns ``(counted, loopback, idle)``: the bytes this rank's
    compressor counted in one trial; the least growth of the machine's loopback counter in a
    trial (other traffic only adds to it); and its growth in an idle pause as long as that trial,
    right after it: the machine's other traffic. None where the counter cannot be read.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    torch.manual_seed(seed + dist.get_rank())
    comp = make_compressor(name, ratio=ratio)
    grad = torch.randn(n)
    comp.allreduce(grad)  # the first call also runs the agreement round: not measured
    best = (None, None)
    for _ in range(trials):
        comp.bytes_sent = 0.0
        wait_work(dist.barrier(async_op=True), DEFAULT_TIMEOUT, "barrier before counting")
        before, start = loopback_bytes(), time.perf_counter()
        for _ in range(repeats):
            comp.allreduce(grad)
        wait_work(dist.barrier(async_op=True), DEFAULT_TIMEOUT, "barrier after counting")
        after, took = loopback_bytes(), time.perf_counter() - start
        time.sleep(took)
        if before is not None and (best[0] is None or after - before < best[0]):
            best = (after - before, loopback_bytes() - after)
    return (comp.bytes_sent, *best)


def measure_wire_bytes(cluster: Cluster, name: str, n: int, ratio: float = 0.01,
                       repeats: int = 5,
                       trials: int = 3) -> tuple[float, int | None, int | None]:
    """Bytes sent by all ranks together in ``repeats`` steps of scheme ``name``: ``(counted,
    loopback, idle)``. ``counted`` adds up what the compressors say (the formulas above);
    ``loopback`` is what the kernel saw cross the loopback interface (rank 0's reading, least
    of ``trials``; every rank runs on this machine) and ``idle`` what crossed it in a pause as
    long, right after: other traffic, which a busy machine adds. None where unreadable.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    results = cluster.run(exchange_on_rank, name, n, ratio, repeats, trials)
    return (sum(r[0] for r in results), *results[0][1:])


def exchange_time_on_rank(name: str, n: int, ratio: float = 0.01, repeats: int = 3,
                          seed: int = 0) -> tuple[float, float]:
    """On every rank: seconds of one exchange of an ``n``-element float32 gradient with scheme
    ``name``, written on the course's collectives, so that it crosses the cluster's emulated
    link if it has one (``cluster.set_link``; :mod:`course_lib.runtime.netem`): "none" a ring
    allreduce in float32, "fp16" in float16 (with the conversions), "topk" the top-k selection and
    ring all-gathers of the values and int32 indices, then their sum. Returns ``(seconds, bytes sent
    by this rank)``: the median over ``repeats`` from a start all ranks share, and the formula.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    comm = get_comm("torch", check_sizes=False)
    rank, world = comm.rank, comm.world_size
    torch.manual_seed(seed + rank)
    grad, k = torch.randn(n), max(1, int(ratio * n))

    def none():
        return ring_allreduce(grad.clone(), comm)

    def fp16():
        return ring_allreduce(grad.half(), comm).float()

    def topk():
        values, indices, _ = topk_compress(grad, None, k)
        all_values, all_indices = torch.zeros(world * k), torch.zeros(world * k, dtype=INDEX_DTYPE)
        # each rank writes its own chunk; the ring all-gather fills in the others'
        all_values[rank * k:(rank + 1) * k] = values
        all_indices[rank * k:(rank + 1) * k] = indices.to(INDEX_DTYPE)
        ring_allgather(all_values, comm)
        ring_allgather(all_indices, comm)
        return torch.zeros(n).index_add_(0, all_indices.long(), all_values)

    exchange = {"none": none, "fp16": fp16, "topk": topk}[name]
    sent = {"none": ring_allreduce_bytes(4 * n, world), "fp16": ring_allreduce_bytes(2 * n, world),
            "topk": allgather_bytes(k * (4 + INDEX_DTYPE.itemsize), world)}[name]
    exchange()  # warm-up: scratch buffers, first messages
    times = []
    for _ in range(repeats):
        start = netem.start_clock(comm)
        exchange()
        times.append(time.monotonic() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # an exchange ends when its slowest rank does
    return float(np.median(slowest.numpy())), sent

