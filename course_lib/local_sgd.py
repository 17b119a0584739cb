"""Local SGD (k local steps, then average) and compressed data-parallel SGD, on real ranks.

Introduced in notebooks/08_local_sgd_and_compression.ipynb. Every rank trains ``models.mlp`` on
its shard of ``data.load_digits()`` with plain SGD (AdamW for DiLoCo, below), drawing its
batches from a torch generator seeded per rank, and the ranks talk in one of two ways::

    from course_lib import local_sgd
    local_sgd.run_local_sgd(cluster, sync_every=8)        # average the parameters every 8 steps
    local_sgd.run_compressed(cluster, "topk", ratio=0.01)  # allreduce a compressed gradient

Each returns rank 0's record: the full-training-set loss and accuracy every ``eval_every``
steps, the bytes this rank has sent by then, and the final test accuracy. ``sync_every=1``
is synchronous data-parallel SGD: equal to one process on the global batch
(:func:`single_process_sgd`); ``sync_every=None`` never averages until the very end (N
independent models, then one-shot averaging). Between averages the ranks' models differ: the
loss recorded is that of their average, computed for the record only (not counted as traffic).
torch DDP with its fp16 and PowerSGD communication hooks, trained the same way and recorded in
the same form for comparison, is in :mod:`course_lib.testing.local_sgd`.

**DiLoCo** (Douillard et al. 2023) grew out of local SGD: H inner steps of AdamW on every rank,
then one outer step on the model the ranks share, whose gradient is the *pseudo-gradient*
Δ = θ_shared - mean over ranks of θ_local (how far the ranks moved, averaged), applied by SGD
with Nesterov momentum (:func:`outer_step`). It sends one allreduce of the parameters every H
steps where data-parallel AdamW sends one of the gradients every step: 1/H of the bytes.
**Streaming DiLoCo** (Douillard et al. 2025) cuts the parameters into F fragments that sync in
turn, H/F steps apart: the same bytes per H steps, 1/F of them at a time.
:func:`diloco_on_rank` runs both and data-parallel AdamW, counting the bytes each rank's
communicator sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import collectives, compression, data, models, sharding
from course_lib.comm import DEFAULT_TIMEOUT, get_comm

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster


class Replica:
    """One rank's model (as a flat parameter vector), data shard and batch generator.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""

    def __init__(self, rank: int, world_size: int, batch_size: int, hidden: Sequence[int],
                 seed: int, dtype: str, by_label: bool = False) -> None:
        self.dtype = getattr(torch, dtype)
        X, y, X_test, y_test = data.load_digits()
        if by_label:  # non-IID shards: sorted by label, each rank sees only a few digits
            order = np.argsort(y, kind="stable")
            X, y = X[order], y[order]
        self.X, self.y = torch.tensor(X, dtype=self.dtype), torch.tensor(y)
        self.X_test, self.y_test = torch.tensor(X_test, dtype=self.dtype), torch.tensor(y_test)
        self.start, self.stop = sharding.shard_bounds(len(X), rank, world_size)
        self.batch_size = batch_size
        self.model = models.mlp(X.shape[1], hidden, 10, seed=seed).to(self.dtype)
        self.theta = torch.nn.utils.parameters_to_vector(self.model.parameters()).detach()
        self.generator = torch.Generator().manual_seed(1000 * seed + rank)  # per-rank batches

    def next_batch(self) -> torch.Tensor:
        """Indices (into the full training set) of this rank's next batch, with replacement."""
        n = self.stop - self.start
        return self.start + torch.randint(n, (self.batch_size,), generator=self.generator)

    def _load(self, theta):
        torch.nn.utils.vector_to_parameters(theta, self.model.parameters())

    def grad(self, theta: torch.Tensor,
             idx: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
        """(batch loss, flat gradient) at ``theta`` on rows ``idx`` (default: the next batch)."""
        self._load(theta)
        idx = self.next_batch() if idx is None else idx
        self.model.zero_grad()
        loss = F.cross_entropy(self.model(self.X[idx]), self.y[idx])
        loss.backward()
        return loss.item(), torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])

    def evaluate(self, theta: torch.Tensor | None = None,
                 test: bool = False) -> tuple[float, float]:
        """(mean cross-entropy, accuracy) of ``theta`` (None: the model as it is) on the full
        training (or test) set."""
        if theta is not None:
            self._load(theta)
        X, y = (self.X_test, self.y_test) if test else (self.X, self.y)
        with torch.no_grad():
            logits = self.model(X)
            return (F.cross_entropy(logits, y).item(),
                    (logits.argmax(1) == y).double().mean().item())


def record_point(history: dict[str, list], step: int, sent: float, loss: float, acc: float,
                 local_loss: float | None = None) -> None:
    """Append one evaluation (step, bytes sent so far, loss, accuracy) to ``history``.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    history["step"].append(step)
    history["bytes"].append(sent)
    history["loss"].append(loss)
    history["accuracy"].append(acc)
    if local_loss is not None:
        history["local_loss"].append(local_loss)


def run_result(name: str, history: dict[str, list], rep: Replica, theta: torch.Tensor,
               sent: float, steps: int, **extra: Any) -> dict[str, Any]:
    """A run's record: its ``history`` as arrays, ``name``, the test accuracy of ``theta``,
    the bytes sent in all and per step, ``theta`` (float64 numpy) and ``extra``.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    _, test_acc = rep.evaluate(theta, test=True)
    out = {key: np.array(values) for key, values in history.items()}
    return dict(out, name=name, test_accuracy=test_acc, bytes_total=sent,
                bytes_per_step=sent / steps, theta=theta.double().numpy().copy(), **extra)


def local_sgd_on_rank(sync_every: int | None = 1, steps: int = 200, batch_size: int = 32,
                      lr: float = 0.2, hidden: Sequence[int] = (64,), eval_every: int = 20,
                      seed: int = 0, dtype: str = "float32", by_label: bool = False,
                      timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """On every rank: local SGD, averaging the parameters every ``sync_every`` steps (None: only
    once, at the end). ``local_loss`` is the mean over ranks of each rank's own model's loss.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
        raise ValueError(f"sync_every must be an integer >= 1 or None, got {sync_every!r}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rep = Replica(rank, world_size, batch_size, hidden, seed, dtype, by_label)
    theta = rep.theta.clone()
    per_sync = compression.ring_allreduce_bytes(theta.numel() * theta.element_size(), world_size)
    history = {"step": [], "bytes": [], "loss": [], "accuracy": [], "local_loss": []}
    sent, syncs = 0.0, 0
    record_point(history, 0, 0.0, *rep.evaluate(theta), rep.evaluate(theta)[0])
    for step in range(1, steps + 1):
        _, g = rep.grad(theta)
        theta = theta - lr * g
        if (sync_every and step % sync_every == 0) or (step == steps and (
                sync_every is None or steps % sync_every)):  # always end with an average
            theta = compression.all_reduce_mean(theta, timeout)
            sent, syncs = sent + per_sync, syncs + 1
        if step % eval_every == 0 or step == steps:
            mean_theta = compression.all_reduce_mean(theta, timeout)  # for the record only
            own = compression.all_reduce_mean(torch.tensor([rep.evaluate(theta)[0]]), timeout)
            record_point(history, step, sent, *rep.evaluate(mean_theta), own.item())
    name = f"local SGD k={sync_every}" if sync_every else "local SGD k=inf (one-shot average)"
    return run_result(name, history, rep, theta, sent, steps, syncs=syncs, sync_every=sync_every)


def compressed_sgd_on_rank(compression_name: str = "none", ratio: float = 0.01,
                           error_feedback: bool = True, exchange: bytes | None = None,
                           steps: int = 200, batch_size: int = 32, lr: float = 0.2,
                           hidden: Sequence[int] = (64,), eval_every: int = 20, seed: int = 0,
                           dtype: str = "float32",
                           timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """On every rank: data-parallel SGD whose gradient is averaged by a compressor each step.

    ``exchange``: a cloudpickled ``exchange(flat_grad, residual, k) -> (mean, new_residual)``
    for top-k (lab 08 sends the student's), or None for :func:`compression.topk_allreduce`.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rep = Replica(rank, world_size, batch_size, hidden, seed, dtype)
    comp = compression.make_compressor(
        compression_name, ratio, error_feedback,
        None if exchange is None else cloudpickle.loads(exchange), timeout)
    theta = rep.theta.clone()
    history = {"step": [], "bytes": [], "loss": [], "accuracy": []}
    record_point(history, 0, 0.0, *rep.evaluate(theta))
    for step in range(1, steps + 1):
        _, g = rep.grad(theta)
        theta = theta - lr * comp.allreduce(g)
        if step % eval_every == 0 or step == steps:
            record_point(history, step, comp.bytes_sent, *rep.evaluate(theta))
    name = {"none": "sync SGD (float32 allreduce)", "fp16": "fp16 allreduce",
            "topk": f"top-{ratio:g} {'with' if error_feedback else 'without'} error feedback"}
    return run_result(name[compression_name], history, rep, theta, comp.bytes_sent, steps)


def outer_step(shared: torch.Tensor, local_mean: torch.Tensor, momentum: torch.Tensor,
               lr: float = 0.7, mu: float = 0.9) -> None:
    """DiLoCo's outer step, in place: the pseudo-gradient Δ = ``shared`` - ``local_mean`` (the
    way back from where the ranks went, as a gradient points uphill), then SGD with Nesterov
    momentum: ``momentum`` ← μ·momentum + Δ, ``shared`` ← shared - lr·(Δ + μ·momentum), as
    ``torch.optim.SGD(nesterov=True)`` does. Introduced in
    notebooks/08_local_sgd_and_compression.ipynb."""
    delta = shared - local_mean
    momentum.mul_(mu).add_(delta)
    shared.sub_(lr * (delta + mu * momentum))


def fragment_sync_steps(sync_every: int, fragments: int) -> list[int]:
    """When each fragment syncs within a period of ``sync_every`` inner steps (1-based, mod
    sync_every): fragment f at ⌊sync_every (f + 1) / fragments⌋, one fragment every H/F steps in
    turn, the same timing as torchft's Streaming DiLoCo (so fragment 0 first syncs after H/F
    steps; the paper lets every fragment run H steps before its first sync).
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    if fragments < 1 or sync_every % fragments:
        raise ValueError(f"sync_every = {sync_every} must be a multiple of fragments = "
                         f"{fragments} >= 1: one fragment syncs at a time")
    return [sync_every * (f + 1) // fragments % sync_every for f in range(fragments)]


def diloco_on_rank(sync_every: int | None = 10, fragments: int = 1, steps: int = 200,
                   batch_size: int = 32, inner_lr: float = 3e-3, outer_lr: float = 0.7,
                   outer_momentum: float = 0.9, hidden: Sequence[int] = (64,),
                   eval_every: int = 20, seed: int = 0, dtype: str = "float32",
                   outer: bytes | None = None,
                   timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """On every rank: AdamW on its shard, and every ``sync_every`` steps a DiLoCo outer step
    (``fragments`` > 1: Streaming DiLoCo, fragment f of the flat parameters syncing at
    :func:`fragment_sync_steps`); ``sync_every=None``: data-parallel AdamW, the gradients
    averaged every step. Every allreduce is the course's ring over this rank's communicator,
    whose ``bytes_sent`` is the record's bytes; ``peak_sync_bytes``: the most one sync sent.
    The loss recorded is the shared model's (DiLoCo) or the one model's (AdamW). ``outer``: a
    cloudpickled function in place of :func:`outer_step` (lab 08 sends the student's).
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    outer_fn = outer_step if outer is None else cloudpickle.loads(outer)
    comm = get_comm("torch", timeout=timeout)
    N = comm.world_size
    rep = Replica(comm.rank, N, batch_size, hidden, seed, dtype)
    local = torch.nn.Parameter(rep.theta.clone())
    inner = torch.optim.AdamW([local], lr=inner_lr)
    P = local.numel()
    bounds = [sharding.shard_bounds(P, f, fragments) for f in range(fragments)]
    when = fragment_sync_steps(sync_every, fragments) if sync_every else []
    shared = rep.theta.clone()
    momenta = torch.zeros_like(shared)  # the outer optimizer's state, fragment by fragment
    history = {"step": [], "bytes": [], "loss": [], "accuracy": []}
    record_point(history, 0, 0.0, *rep.evaluate(shared))
    peak = 0

    def mean_over_ranks(t):  # the course's ring; the most one call sent is kept
        nonlocal peak
        before = comm.bytes_sent
        t = collectives.allreduce(t, comm, check=False) / N
        peak = max(peak, comm.bytes_sent - before)
        return t
    for step in range(1, steps + 1):
        _, g = rep.grad(local.detach())
        if sync_every is None:  # data parallel: the mean gradient, every step
            g = mean_over_ranks(g.contiguous())
        local.grad = g
        inner.step()
        for f, (a, b) in enumerate(bounds):
            if sync_every and step % sync_every == when[f]:
                mean = mean_over_ranks(local.detach()[a:b].clone())
                outer_fn(shared[a:b], mean, momenta[a:b], outer_lr, outer_momentum)
                with torch.no_grad():
                    local[a:b] = shared[a:b]  # every rank starts again from the shared model
        if step % eval_every == 0 or step == steps:
            record_point(history, step, comm.bytes_sent,
                         *rep.evaluate(local.detach() if sync_every is None else shared))
    if sync_every is None:
        name = "data-parallel AdamW"
    else:
        name = f"DiLoCo H={sync_every}" + (f", {fragments} fragments" if fragments > 1 else "")
    final = local.detach() if sync_every is None else shared
    return run_result(name, history, rep, final, comm.bytes_sent, steps,
                      peak_sync_bytes=peak, sync_every=sync_every, fragments=fragments)


def powersgd_elements(shapes: Sequence[Sequence[int]], rank: int,
                      min_compression_rate: float = 2) -> int:
    """Elements PowerSGD allreduces per step for parameters of these ``shapes``: a tensor seen
    as an n x m matrix (n = first dim) sends P (n x r) and Q (m x r), (n + m) r elements, when
    that is ``min_compression_rate`` times smaller than n m; otherwise (biases) all n m.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    total = 0
    for shape in shapes:
        n = shape[0]
        m = int(np.prod(shape)) // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return total


# ---------------------------------------------------------------- on the client
def rank0_result(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record; every rank must end with the same parameters (they were averaged).
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    worst = max(float(np.abs(r["theta"] - results[0]["theta"]).max()) for r in results)
    if worst > 1e-5:
        raise RuntimeError(f"ranks ended with different parameters (max difference {worst:.3g})")
    return results[0]


def run_local_sgd(cluster: Cluster, sync_every: int | None = 1, timeout: float = 120,
                  **kwargs: Any) -> dict[str, Any]:
    """:func:`local_sgd_on_rank` on every rank of ``cluster``; rank 0's record.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
        raise ValueError(f"sync_every must be an integer >= 1 or None, got {sync_every!r}")
    return rank0_result(cluster.run(local_sgd_on_rank, sync_every, **kwargs, timeout=timeout))


def run_diloco(cluster: Cluster, sync_every: int | None = 10, fragments: int = 1,
               timeout: float = 120, **kwargs: Any) -> dict[str, Any]:
    """:func:`diloco_on_rank` on every rank of ``cluster`` (``sync_every=None``: data-parallel
    AdamW); rank 0's record. Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    fragment_sync_steps(sync_every or fragments, fragments)  # refused here, before any rank runs
    return rank0_result(cluster.run(diloco_on_rank, sync_every, fragments, **kwargs,
                                    timeout=timeout))


def run_compressed(cluster: Cluster, compression_name: str = "none", ratio: float = 0.01,
                   error_feedback: bool = True, exchange: bytes | None = None,
                   timeout: float = 120, **kwargs: Any) -> dict[str, Any]:
    """:func:`compressed_sgd_on_rank` on every rank of ``cluster``; rank 0's record.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    return rank0_result(cluster.run(compressed_sgd_on_rank, compression_name, ratio, error_feedback,
                              exchange, **kwargs, timeout=timeout))


def single_process_sgd(world_size: int, steps: int = 5, batch_size: int = 32, lr: float = 0.1,
                       hidden: Sequence[int] = (64,), seed: int = 0,
                       dtype: str = "float64") -> np.ndarray:
    """The reference: one process, SGD on the global batch (every rank's batch together, drawn
    from the same per-rank generators). Returns the final flat parameters (numpy float64).
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    reps = [Replica(r, world_size, batch_size, hidden, seed, dtype) for r in range(world_size)]
    model, theta = reps[0].model, reps[0].theta.clone()
    for _ in range(steps):
        idx = torch.cat([rep.next_batch() for rep in reps])
        reps[0]._load(theta)
        model.zero_grad()
        F.cross_entropy(model(reps[0].X[idx]), reps[0].y[idx]).backward()
        theta = theta - lr * torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return theta.double().numpy()


def format_table(results: list[dict[str, Any]], baseline: dict[str, Any] | None = None) -> str:
    """One line per run: bytes per step, as a fraction of ``baseline``'s (default the first
    run's), final training loss and test accuracy.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    base = (baseline or results[0])["bytes_per_step"]
    lines = [f"{'scheme':<40} {'bytes/step':>11} {'vs fp32':>8} {'train loss':>11} "
             f"{'test acc':>9}"]
    for r in results:
        lines.append(f"{r['name']:<40} {r['bytes_per_step']:>11,.0f} "
                     f"{r['bytes_per_step'] / base:>8.3f} {r['loss'][-1]:>11.4f} "
                     f"{r['test_accuracy']:>9.3f}")
    return "\n".join(lines)
