"""FSDP as practitioners write it: ``fully_shard`` applied module by module, an ordinary
optimizer, the gradients synchronised inside ``backward``.

Introduced in notebooks/10_sharded_data_parallelism.ipynb. :class:`zero.ZeroDataParallel`
wraps a whole model and owns its optimizer; PyTorch's FSDP2 (and torchtitan, and CS336's
assignment) is written the other way round::

    for block in model.blocks:
        fully_shard(block, comm)              # one unit per block, bottom up
    fully_shard(model, comm)                  # the rest (embeddings, final norm): the root
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # over this rank's shards
    loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()

Each call makes one **unit** of the parameters of ``module`` that no unit below claimed. Every
parameter is cut by rows (dimension 0) into N pieces of ceil(rows / N) rows, as ``torch.chunk``
cuts it, and this rank keeps its piece as a plain tensor: the registered parameter, float32,
the master weight the optimizer updates. FSDP2 wraps the same piece in a ``DTensor`` that also
records the global shape; here the unit records it, so that the piece is an ordinary tensor to
any optimizer, scheduler and ``state_dict``. Before the unit's forward its pieces are
all-gathered, as FSDP2 does, in one collective: each rank's pieces concatenated, each padded to
its ceil(rows / N) rows, make N equal chunks of one flat buffer (the *copy-in*), which the ring
all-gather fills and each parameter's rows are read back from (the *copy-out*). The module then
computes with the whole parameters, which are freed after its forward (``reshard_after_forward``)
and gathered again when the gradient of its output arrives; the root (the unit whose forward no
other unit's surrounds) keeps them for the backward that follows at once, as FSDP2's does. When
every gradient of the unit is in, they are reduce-scattered in the same layout and this rank's
piece of their mean becomes the piece's ``.grad``: ``loss.backward()`` leaves the optimizer
nothing to wait for.

The collectives run on one thread per rank, in the order they were started (a GPU gives them
a stream of its own), so the training thread computes meanwhile: the reduce-scatters overlap
the rest of the backward, and with ``prefetch`` a unit starts the next unit's gather before it
computes, at the cost of holding both units' whole parameters.

A :class:`MixedPrecisionPolicy` per unit gathers and computes in ``param_dtype``, reduces in
``reduce_dtype`` and returns ``output_dtype``, while the pieces and their gradients stay in the
model's float32. Parameters in no unit (say the LayerNorms, when only Linear and Embedding
layers are wrapped) stay whole on every rank: :func:`replicate` all-reduces their gradients.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from course_lib.collectives import allreduce, ring_allgather, ring_reduce_scatter
from course_lib.comm import Comm
from course_lib.runtime.timeline import DISABLED, Timeline


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """A unit's dtypes, as FSDP2's: its parameters gathered and computed in ``param_dtype``,
    its gradients reduce-scattered in ``reduce_dtype`` (None: ``param_dtype``), its output
    cast to ``output_dtype`` (None: left as computed); floating-point inputs cast to
    ``param_dtype`` when ``cast_forward_inputs``. Introduced in
    notebooks/10_sharded_data_parallelism.ipynb."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def _cast(x, dtype):
    """Floating-point tensors in (nested) tuples, lists and dicts cast to ``dtype``."""
    if dtype is None:
        return x
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, x)


def _rows(shape) -> int:
    return shape[0] if len(shape) else 1


def padded_size(shape: torch.Size, world_size: int) -> int:
    """The elements of one rank's piece of a parameter of ``shape``, padded: ceil(rows / N)
    rows. Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    return math.ceil(_rows(shape) / world_size) * (math.prod(shape[1:]) or 1)


def piece_of(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``tensor``: ceil(rows / N) of them from row rank x that, fewer
    (or none) at the end, as ``torch.chunk`` cuts them. Introduced in
    notebooks/10_sharded_data_parallelism.ipynb."""
    per = math.ceil(_rows(tensor.shape) / world_size)
    rows = tensor.reshape(_rows(tensor.shape), -1)[rank * per:(rank + 1) * per]
    return rows.reshape(-1, *tensor.shape[1:]) if tensor.dim() else rows.reshape(-1)


def gather_rows(pieces: list[torch.Tensor], shapes: list[torch.Size], comm: Comm,
                dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Every parameter whole, from every rank's ``pieces`` (:func:`piece_of`), in one
    collective: the *copy-in* lays this rank's pieces end to end, each padded to
    :func:`padded_size`, as its chunk of a flat buffer; the ring all-gather fills the other
    ranks' chunks; the *copy-out* reads each parameter's rows back, rank by rank, and drops the
    padding. ``dtype``: what is sent (None: the pieces'). Introduced in
    notebooks/10_sharded_data_parallelism.ipynb."""
    N, r = comm.world_size, comm.rank
    padded = [padded_size(shape, N) for shape in shapes]
    chunk = sum(padded)
    flat = torch.zeros(N * chunk, dtype=dtype or pieces[0].dtype)
    mine, at = flat[r * chunk:(r + 1) * chunk], 0
    for piece, size in zip(pieces, padded, strict=True):  # copy-in
        mine[at:at + piece.numel()] = piece.detach().reshape(-1)
        at += size
    ring_allgather(flat, comm, check=False)
    table, at, whole = flat.view(N, chunk), 0, []
    for shape, size in zip(shapes, padded, strict=True):  # copy-out
        whole.append(table[:, at:at + size].reshape(-1)[:math.prod(shape) or 1].view(shape))
        at += size
    return whole


def reduce_scatter_rows(grads: list[torch.Tensor], comm: Comm,
                        dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """This rank's rows (:func:`piece_of`) of the mean over the ranks of each whole gradient,
    in one collective: the gradients laid out as :func:`gather_rows` lays the pieces (rank by
    rank, each padded), the ring reduce-scatter leaves this rank the sum of its chunk, divided
    by N and cut back into pieces. ``dtype``: what is sent (None: the gradients').
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    N, r = comm.world_size, comm.rank
    padded = [padded_size(g.shape, N) for g in grads]
    chunk = sum(padded)
    table, at = torch.zeros(N, chunk, dtype=dtype or grads[0].dtype), 0
    for g, size in zip(grads, padded, strict=True):
        rows = torch.zeros(N * size, dtype=table.dtype)  # padded to N pieces of equal size
        rows[:g.numel()] = g.reshape(-1)
        table[:, at:at + size] = rows.view(N, size)
        at += size
    flat = table.view(-1)
    ring_reduce_scatter(flat, comm, check=False)
    mine = flat[r * chunk:(r + 1) * chunk] / N
    out, at = [], 0
    for g, size in zip(grads, padded, strict=True):
        n = piece_of(g, r, N).numel()
        out.append(mine[at:at + n].view(piece_of(g, r, N).shape))
        at += size
    return out


_running = threading.local()  # how many units' forwards run now, on this thread (this rank)


def shared(comm: Comm) -> dict:
    """What the units over one ``comm`` share: the one thread that runs their collectives, in
    the order they are started (a GPU's communication stream; here a thread, so that the
    training thread computes meanwhile), and the bytes of whole parameters held, now and at
    most (``held``, ``peak``).
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    if "_fsdp" not in comm.__dict__:
        comm._fsdp = {"thread": ThreadPoolExecutor(1, thread_name_prefix=f"fsdp-{comm.rank}"),
                      "held": 0, "peak": 0, "lock": threading.Lock()}
    return comm._fsdp


class Unit:
    """One ``fully_shard`` call's parameters: where each is registered, its global shape, this
    rank's piece (the registered parameter) and, while gathered, its whole tensor.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""

    def __init__(self, module: nn.Module, comm: Comm, policy: MixedPrecisionPolicy | None,
                 reshard_after_forward: bool, prefetch: bool = False,
                 timeline: Timeline = DISABLED) -> None:
        self.module, self.comm, self.shared = module, comm, shared(comm)
        self.policy = policy or MixedPrecisionPolicy()
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.timeline, self.name = timeline, type(module).__name__
        N, r = comm.world_size, comm.rank
        self.places, self.shapes, self.pieces, self.whole = [], [], [], []
        for owner in module.modules():
            for name, p in list(owner.named_parameters(recurse=False)):
                if hasattr(p, "_fsdp_unit") or not p.requires_grad:
                    continue  # another unit's piece, or frozen: whole on every rank
                piece = nn.Parameter(piece_of(p.detach(), r, N).clone())
                piece._fsdp_unit = self
                owner._parameters[name] = piece  # what model.parameters() now yields
                self.places.append((owner, name))
                self.shapes.append(p.shape)
                self.pieces.append(piece)
                self.whole.append(None)
        if not self.pieces:
            raise ValueError(f"fully_shard: {type(module).__name__} has no trainable parameter "
                             "that another unit has not taken")
        self.gathered = self.root = False
        self.pending: Future | None = None  # a gather started on the comm thread
        self.reducing: Future | None = None  # a reduce-scatter started on it
        self.grads_in = 0
        self.began = 0.0  # when its forward or backward started computing
        self.order: list[Unit] = []  # the units in the order of the first forward (the root's)

    # ------------------------------------------------------------ the two collectives
    def _on_comm_thread(self, cat: str, fn, *args) -> Future:
        """``fn(*args)`` on the comm thread after what was started before it, as a span of the
        timeline."""
        def run():
            with self.timeline.span(f"{cat} {self.name}", cat):
                return fn(*args)
        return self.shared["thread"].submit(run)

    def _count(self, n_bytes: int) -> None:
        with self.shared["lock"]:
            self.shared["held"] += n_bytes
            self.shared["peak"] = max(self.shared["peak"], self.shared["held"])

    def start_gather(self) -> None:
        """Start the all-gather of the pieces (in ``param_dtype``) on the comm thread, unless
        the unit is gathered or its gather started already: a prefetch."""
        if not self.gathered and self.pending is None:
            self._count(self._whole_bytes())  # held from now on: what the gather fills
            self.pending = self._on_comm_thread(
                "all-gather", gather_rows, [p.detach() for p in self.pieces], self.shapes,
                self.comm, self._param_dtype())

    def gather(self) -> None:
        """Wait for the pieces' all-gather (starting it if no prefetch did) and register the
        whole parameters."""
        if self.gathered:
            return
        self.start_gather()
        wholes, self.pending = self.pending.result(), None
        for i, whole in enumerate(wholes):
            if self.whole[i] is None:  # the first gather: a leaf that collects the gradient
                self.whole[i] = nn.Parameter(whole.clone())  # storage of its own
                self.whole[i].register_post_accumulate_grad_hook(self._grad_in)
            else:  # later ones refill its storage, which autograd may hold since the
                w = self.whole[i].data  # forward (.data: no version bump, as for a reload)
                w.untyped_storage().resize_(w.numel() * w.element_size())
                w.copy_(whole)
        for (owner, name), w in zip(self.places, self.whole, strict=True):
            owner._parameters[name] = w
        self.gathered = True

    def reshard(self) -> None:
        """Register the pieces again and free the whole parameters' storage."""
        if not self.gathered:
            return
        for (owner, name), piece, w in zip(self.places, self.pieces, self.whole, strict=True):
            owner._parameters[name] = piece
            w.untyped_storage().resize_(0)
        self._count(-self._whole_bytes())
        self.gathered = False

    def reduce_scatter(self) -> None:
        """Start summing every whole gradient (zeros where none came) over the ranks in
        ``reduce_dtype`` on the comm thread, while the backward goes on; the whole gradients
        are let go. :meth:`finish_reduce` adds this rank's piece of the mean to its ``.grad``."""
        grads = [w.grad if w.grad is not None else torch.zeros(w.shape) for w in self.whole]
        for w in self.whole:
            w.grad = None
        self.reducing = self._on_comm_thread(
            "reduce-scatter", reduce_scatter_rows, grads, self.comm,
            self.policy.reduce_dtype or self._param_dtype())
        self.grads_in = 0

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter and add this rank's piece of the mean to each piece's
        ``.grad`` (in the piece's dtype: several backwards add up, as in plain torch)."""
        if self.reducing is None:
            return
        mine, self.reducing = self.reducing.result(), None
        for piece, g in zip(self.pieces, mine, strict=True):
            g = g.to(piece.dtype)
            piece.grad = g if piece.grad is None else piece.grad + g

    # ------------------------------------------------------------ the hooks
    def _param_dtype(self):
        return self.policy.param_dtype or self.pieces[0].dtype

    def _record(self, phase: str) -> None:
        """This unit's forward or backward, from ``began`` to now, on the timeline (not the
        root's: it surrounds the other units')."""
        if not self.root:
            self.timeline.add(f"{phase} {self.name}", phase, self.began, time.perf_counter())

    def _whole_bytes(self) -> int:
        return sum(math.prod(s) for s in self.shapes) * self._param_dtype().itemsize

    def _next(self, backward: bool = False) -> Unit | None:
        """The unit that computes after this one, in the order of the first forward (None: none,
        or not known yet); in backward the order runs back, from the root to the last unit."""
        order = self.order
        if self not in order or len(order) < 2:
            return None
        i = order.index(self) + (-1 if backward else 1)
        return order[i] if i < len(order) else None  # order[-1]: the root's, in backward

    def _grad_in(self, whole: torch.Tensor) -> None:
        self.grads_in += 1
        if self.grads_in == len(self.whole):  # the unit's backward is done: sync, free
            self._record("backward")
            self.reduce_scatter()
            self.reshard()

    def before_forward(self, module, args, kwargs):
        depth = getattr(_running, "depth", 0)
        self.root = depth == 0  # no other unit's forward around it: the model's root
        _running.depth = depth + 1
        if self.root:  # the units inside it record their order in its list
            _running.order = self.order
        self.order = _running.order
        if self not in self.order:  # the first forward records the order
            self.order.append(self)
            self.name = f"{self.name} {len(self.order) - 1}"
        self.gather()
        nxt = self._next()
        if self.prefetch and nxt is not None:  # the next unit's gather, while this computes
            nxt.start_gather()
        self.began = time.perf_counter()
        if self.policy.cast_forward_inputs:
            return _cast(args, self.policy.param_dtype), _cast(kwargs, self.policy.param_dtype)
        return args, kwargs

    def after_forward(self, module, args, output):
        _running.depth -= 1
        self._record("forward")
        output = _cast(output, self.policy.output_dtype)
        needs_grad = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        # the root stays gathered when a backward follows at once (FSDP2 does the same)
        if self.reshard_after_forward and not (self.root and needs_grad):
            self.reshard()
        if needs_grad:  # the first gradient to reach the output gathers again
            for t in needs_grad:
                t.register_hook(self._before_backward)
        return output

    def _before_backward(self, grad):
        if not self.gathered:
            self.gather()
        nxt = self._next(backward=True)
        if self.prefetch and nxt is not None:
            nxt.start_gather()
        self.began = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        return grad

    def _after_backward(self) -> None:
        """At the end of backward: a unit some of whose parameters got no gradient has not
        synchronised yet; it does now (zeros for the missing ones), on every rank alike; its
        reduce-scatter is waited for, and a gather started for nothing is freed."""
        if self.gathered and self.grads_in:
            self.reduce_scatter()
        self.finish_reduce()
        if self.pending is not None:
            self.gather()
        self.reshard()


def fully_shard(module: nn.Module, comm: Comm, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, prefetch: bool = False,
                timeline: Timeline = DISABLED) -> nn.Module:
    """Shard ``module``'s parameters that no unit below it took (see the module docstring):
    its registered parameters become this rank's pieces, gathered around its forward and
    backward, their gradients reduce-scattered during backward. ``prefetch``: start the next
    unit's gather (in the order of the first forward; in backward, the previous unit's) before
    this one computes. ``timeline``: each gather, reduce-scatter, forward and backward as a
    span. Returns ``module``. Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    unit = Unit(module, comm, mp_policy, reshard_after_forward, prefetch, timeline)
    module.register_forward_pre_hook(unit.before_forward, with_kwargs=True)
    module.register_forward_hook(unit.after_forward)
    units = module.__dict__.setdefault("_fsdp_units", [])
    units.append(unit)
    return module


def replicate(module: nn.Module, comm: Comm) -> nn.Module:
    """Every trainable parameter of ``module`` that no unit took stays whole on every rank:
    its gradient is all-reduced (the mean over the ranks) as soon as it is accumulated.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    def average(p):  # on the comm thread, in turn with the units' collectives
        shared(comm)["thread"].submit(allreduce, p.grad, comm, "ring", check=False).result()
        p.grad /= comm.world_size
    for p in module.parameters():
        if p.requires_grad and not hasattr(p, "_fsdp_unit"):
            p.register_post_accumulate_grad_hook(average)
    return module


def units_in(module: nn.Module) -> list[Unit]:
    """Every unit made by ``fully_shard`` on ``module`` or below it, bottom up.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    return [u for m in reversed(list(module.modules())) for u in m.__dict__.get("_fsdp_units", [])]


def full_state_dict(module: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter by name, whole (each unit's pieces gathered, :func:`gather_rows`), or
    with ``grads`` their gradients' mean (zeros where a piece has none); every rank calls it.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    whole = {}
    for unit in units_in(module):
        pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
                  for p in unit.pieces]
        for piece, w in zip(unit.pieces, gather_rows(pieces, unit.shapes, unit.comm),
                            strict=True):
            whole[id(piece)] = w
    return {name: whole.get(id(p), p.grad if grads else p.detach()) for name, p in
            module.named_parameters()}
