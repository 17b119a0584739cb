"""Local SGD (k local steps, then average) and compressed data-parallel SGD, on real ranks.

Introduced in notebooks/08_local_sgd_and_compression.ipynb. Every rank trains ``models.mlp`` on
its shard of ``data.load_digits()`` with plain SGD, drawing its batches from a torch generator
seeded per rank, and the ranks talk in one of three ways::

    from course_lib import local_sgd
    local_sgd.run_local_sgd(cluster, sync_every=8)        # average the parameters every 8 steps
    local_sgd.run_compressed(cluster, "topk", ratio=0.01)  # allreduce a compressed gradient
    local_sgd.run_torch_ddp(cluster, "powersgd", rank=1)   # torch DDP with a comm hook

Each returns rank 0's record: the full-training-set loss and accuracy every ``eval_every``
steps, the bytes this rank has sent by then, and the final test accuracy. ``sync_every=1``
is synchronous data-parallel SGD: equal to one process on the global batch
(:func:`single_process_sgd`); ``sync_every=None`` never averages until the very end (N
independent models, then one-shot averaging). Between averages the ranks' models differ: the
loss recorded is that of their average, computed for the record only (not counted as traffic).
"""

from __future__ import annotations

import numpy as np

from course_lib import compression, data, models
from course_lib.comm import DEFAULT_TIMEOUT


class Replica:
    """One rank's model (as a flat parameter vector), data shard and batch generator.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""

    def __init__(self, rank, world_size, batch_size, hidden, seed, dtype, by_label=False):
        import torch
        self.dtype = getattr(torch, dtype)
        X, y, X_test, y_test = data.load_digits()
        if by_label:  # non-IID shards: sorted by label, each rank sees only a few digits
            order = np.argsort(y, kind="stable")
            X, y = X[order], y[order]
        self.X, self.y = torch.tensor(X, dtype=self.dtype), torch.tensor(y)
        self.X_test, self.y_test = torch.tensor(X_test, dtype=self.dtype), torch.tensor(y_test)
        self.start, self.stop = data.shard_bounds(len(X), rank, world_size)
        self.batch_size = batch_size
        self.model = models.mlp(X.shape[1], hidden, 10, seed=seed).to(self.dtype)
        self.theta = torch.nn.utils.parameters_to_vector(self.model.parameters()).detach()
        self.generator = torch.Generator().manual_seed(1000 * seed + rank)  # per-rank batches

    def next_batch(self):
        """Indices (into the full training set) of this rank's next batch, with replacement."""
        import torch
        n = self.stop - self.start
        return self.start + torch.randint(n, (self.batch_size,), generator=self.generator)

    def _load(self, theta):
        import torch
        torch.nn.utils.vector_to_parameters(theta, self.model.parameters())

    def grad(self, theta, idx=None):
        """(batch loss, flat gradient) at ``theta`` on rows ``idx`` (default: the next batch)."""
        import torch
        import torch.nn.functional as F
        self._load(theta)
        idx = self.next_batch() if idx is None else idx
        self.model.zero_grad()
        loss = F.cross_entropy(self.model(self.X[idx]), self.y[idx])
        loss.backward()
        return loss.item(), torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])

    def evaluate(self, theta=None, test=False):
        """(mean cross-entropy, accuracy) of ``theta`` (None: the model as it is) on the full
        training (or test) set."""
        import torch
        import torch.nn.functional as F
        if theta is not None:
            self._load(theta)
        X, y = (self.X_test, self.y_test) if test else (self.X, self.y)
        with torch.no_grad():
            logits = self.model(X)
            return (F.cross_entropy(logits, y).item(),
                    (logits.argmax(1) == y).double().mean().item())


def _record(history, step, sent, loss, acc, local_loss=None):
    history["step"].append(step)
    history["bytes"].append(sent)
    history["loss"].append(loss)
    history["accuracy"].append(acc)
    if local_loss is not None:
        history["local_loss"].append(local_loss)


def _result(name, history, rep, theta, sent, steps, **extra):
    _, test_acc = rep.evaluate(theta, test=True)
    out = {key: np.array(values) for key, values in history.items()}
    return dict(out, name=name, test_accuracy=test_acc, bytes_total=sent,
                bytes_per_step=sent / steps, theta=theta.double().numpy().copy(), **extra)


def local_sgd_on_rank(sync_every=1, steps=200, batch_size=32, lr=0.2, hidden=(64,),
                      eval_every=20, seed=0, dtype="float32", by_label=False,
                      timeout=DEFAULT_TIMEOUT):
    """On every rank: local SGD, averaging the parameters every ``sync_every`` steps (None: only
    once, at the end). ``local_loss`` is the mean over ranks of each rank's own model's loss.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    import torch
    import torch.distributed as dist
    if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
        raise ValueError(f"sync_every must be an integer >= 1 or None, got {sync_every!r}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rep = Replica(rank, world_size, batch_size, hidden, seed, dtype, by_label)
    theta = rep.theta.clone()
    per_sync = compression.ring_allreduce_bytes(theta.numel() * theta.element_size(), world_size)
    history = {"step": [], "bytes": [], "loss": [], "accuracy": [], "local_loss": []}
    sent, syncs = 0.0, 0
    _record(history, 0, 0.0, *rep.evaluate(theta), rep.evaluate(theta)[0])
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
            _record(history, step, sent, *rep.evaluate(mean_theta), own.item())
    name = f"local SGD k={sync_every}" if sync_every else "local SGD k=inf (one-shot average)"
    return _result(name, history, rep, theta, sent, steps, syncs=syncs, sync_every=sync_every)


def compressed_sgd_on_rank(compression_name="none", ratio=0.01, error_feedback=True,
                           exchange=None, steps=200, batch_size=32, lr=0.2, hidden=(64,),
                           eval_every=20, seed=0, dtype="float32",
                           timeout=DEFAULT_TIMEOUT):
    """On every rank: data-parallel SGD whose gradient is averaged by a compressor each step.

    ``exchange``: a cloudpickled ``exchange(flat_grad, residual, k) -> (mean, new_residual)``
    for top-k (lab 08 sends the student's), or None for :func:`compression.topk_allreduce`.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    import cloudpickle
    import torch.distributed as dist
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rep = Replica(rank, world_size, batch_size, hidden, seed, dtype)
    comp = compression.make_compressor(
        compression_name, ratio, error_feedback,
        None if exchange is None else cloudpickle.loads(exchange), timeout)
    theta = rep.theta.clone()
    history = {"step": [], "bytes": [], "loss": [], "accuracy": []}
    _record(history, 0, 0.0, *rep.evaluate(theta))
    for step in range(1, steps + 1):
        _, g = rep.grad(theta)
        theta = theta - lr * comp.allreduce(g)
        if step % eval_every == 0 or step == steps:
            _record(history, step, comp.bytes_sent, *rep.evaluate(theta))
    name = {"none": "sync SGD (float32 allreduce)", "fp16": "fp16 allreduce",
            "topk": f"top-{ratio:g} {'with' if error_feedback else 'without'} error feedback"}
    return _result(name[compression_name], history, rep, theta, comp.bytes_sent, steps)


def powersgd_elements(shapes, rank, min_compression_rate=2):
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


def torch_ddp_on_rank(hook="fp16", rank=1, start_iter=2, steps=200, batch_size=32, lr=0.2,
                      hidden=(64,), eval_every=20, seed=0, dtype="float32"):
    """On every rank: torch's DistributedDataParallel with a communication hook: "none" (its
    own allreduce), "fp16" (``fp16_compress_hook``) or "powersgd" (``powerSGD_hook`` of
    ``rank``, after ``start_iter`` plain steps). Bytes come from the shapes, priced as a ring.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if hook not in ("none", "fp16", "powersgd"):
        raise ValueError(f"hook must be 'none', 'fp16' or 'powersgd', not {hook!r}")
    world_size = dist.get_world_size()
    rep = Replica(dist.get_rank(), world_size, batch_size, hidden, seed, dtype)
    net = torch.nn.parallel.DistributedDataParallel(rep.model)
    shapes = [tuple(p.shape) for p in rep.model.parameters()]
    n_params, itemsize = sum(int(np.prod(s)) for s in shapes), rep.theta.element_size()
    state = None
    plain = compression.ring_allreduce_bytes(n_params * itemsize, world_size)
    if hook == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        per_step = compression.ring_allreduce_bytes(n_params * 2, world_size)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start_iter, random_seed=seed)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        per_step = compression.ring_allreduce_bytes(
            powersgd_elements(shapes, rank) * itemsize, world_size)
    else:
        per_step = plain
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    history = {"step": [], "bytes": [], "loss": [], "accuracy": []}
    _record(history, 0, 0.0, *rep.evaluate())
    sent = 0.0
    for step in range(1, steps + 1):
        idx = rep.next_batch()
        opt.zero_grad()
        F.cross_entropy(net(rep.X[idx]), rep.y[idx]).backward()
        opt.step()
        sent += plain if (hook == "powersgd" and step <= start_iter) else per_step
        if step % eval_every == 0 or step == steps:
            _record(history, step, sent, *rep.evaluate())
    name = {"none": "torch DDP", "fp16": "torch DDP + fp16_compress_hook",
            "powersgd": f"torch DDP + PowerSGD rank {rank}"}[hook]
    extra = {}
    if state is not None:  # the hook's own count of elements after compression
        extra["hook_elements_per_step"] = (state.total_numel_after_compression
                                           / max(steps - start_iter, 1))
    theta = torch.nn.utils.parameters_to_vector(rep.model.parameters()).detach()
    return _result(name, history, rep, theta, sent, steps, **extra)


def fp16_against_torch_hook_on_rank(batch_size=32, hidden=(64,), seed=0):
    """On every rank: one batch's gradient averaged three ways, as numpy arrays: ``ours``
    (:class:`compression.FP16`), ``torch`` (DDP + ``fp16_compress_hook``), ``float32``.
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    rep = Replica(dist.get_rank(), dist.get_world_size(), batch_size, hidden, seed, "float32")
    idx = rep.next_batch()
    _, g = rep.grad(rep.theta.clone(), idx)
    net = torch.nn.parallel.DistributedDataParallel(models.mlp(64, hidden, 10, seed=seed))
    net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    F.cross_entropy(net(rep.X[idx]), rep.y[idx]).backward()
    theirs = torch.cat([p.grad.reshape(-1) for p in net.module.parameters()])
    return {"ours": compression.FP16().allreduce(g).numpy(), "torch": theirs.numpy(),
            "float32": compression.NoCompression().allreduce(g).numpy()}


# ---------------------------------------------------------------- on the client
def _rank0(results):
    """Rank 0's record; every rank must end with the same parameters (they were averaged)."""
    worst = max(float(np.abs(r["theta"] - results[0]["theta"]).max()) for r in results)
    if worst > 1e-5:
        raise RuntimeError(f"ranks ended with different parameters (max difference {worst:.3g})")
    return results[0]


def run_local_sgd(cluster, sync_every=1, timeout=120, **kwargs):
    """:func:`local_sgd_on_rank` on every rank of ``cluster``; rank 0's record.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
        raise ValueError(f"sync_every must be an integer >= 1 or None, got {sync_every!r}")
    return _rank0(cluster.run(local_sgd_on_rank, sync_every, **kwargs, timeout=timeout))


def run_compressed(cluster, compression_name="none", ratio=0.01, error_feedback=True,
                   exchange=None, timeout=120, **kwargs):
    """:func:`compressed_sgd_on_rank` on every rank of ``cluster``; rank 0's record.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    return _rank0(cluster.run(compressed_sgd_on_rank, compression_name, ratio, error_feedback,
                              exchange, **kwargs, timeout=timeout))


def run_torch_ddp(cluster, hook="fp16", rank=1, timeout=120, **kwargs):
    """:func:`torch_ddp_on_rank` on every rank of ``cluster``; rank 0's record.

    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    return _rank0(cluster.run(torch_ddp_on_rank, hook, rank, **kwargs, timeout=timeout))


def single_process_sgd(world_size, steps=5, batch_size=32, lr=0.1, hidden=(64,), seed=0,
                       dtype="float64"):
    """The reference: one process, SGD on the global batch (every rank's batch together, drawn
    from the same per-rank generators). Returns the final flat parameters (numpy float64).
    Introduced in notebooks/08_local_sgd_and_compression.ipynb."""
    import torch
    import torch.nn.functional as F
    reps = [Replica(r, world_size, batch_size, hidden, seed, dtype) for r in range(world_size)]
    model, theta = reps[0].model, reps[0].theta.clone()
    for _ in range(steps):
        idx = torch.cat([rep.next_batch() for rep in reps])
        reps[0]._load(theta)
        model.zero_grad()
        F.cross_entropy(model(reps[0].X[idx]), reps[0].y[idx]).backward()
        theta = theta - lr * torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return theta.double().numpy()


def format_table(results, baseline=None):
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
