"""Pipeline parallelism: a sequential model cut into stages, one per rank; micro-batches flow
through them, activations forward and their gradients back, point to point.

Introduced in notebooks/09_model_parallelism.ipynb. Five schedules, side by side:

- ``"naive"``: the whole batch as one piece: while one stage works, the N-1 others wait.
- ``"gpipe"``: M micro-batches, all forwards then all backwards (Huang et al. 2019). The idle
  share of each stage, the *bubble*, is (N-1)/(M+N-1); every stage holds the activations of
  all M micro-batches at the turn.
- ``"1f1b"``: after a warm-up of N-s-1 forwards, stage s alternates one forward and one backward
  (PipeDream-Flush, Narayanan et al. 2021): the same bubble, but at most N-s micro-batches'
  activations alive at once instead of M.
- ``"zb-h1"``: zero bubble (Qi et al. 2024). The backward splits in two: B, the gradient of the
  stage's input, which the stage before waits for, and W, the gradient of its weights, which
  nobody waits for. 1F1B's order with B alone on the critical path, stage s putting off its
  first s W's: with F = B = W the bubble is a third of 1F1B's, at most N micro-batches alive.
- ``"zb-v"`` (:func:`zb_v_order`): two chunks per rank placed in a V (rank s holds stages s and
  2N-1-s), so the first rank also computes the loss and never waits at the start: with
  F = B = W one step leaves each rank N-1 half-stage forwards idle, half of ZB-H1's (the paper,
  counting steady training with the optimizer's synchronisation bypassed, calls it zero), at
  most 2N chunk activations (N micro-batches' worth) alive.

:func:`simulate` predicts a schedule's Gantt chart, bubble and live activations;
:func:`pipeline_step` runs it for real on the ranks, over ``comm``, with a deadline on every
receive and a :class:`~course_lib.runtime.timeline.Timeline` of what each stage did. It stays one
file: the simulator predicts what ``pipeline_step`` does, and notebook 09 compares the two side
by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
from torch import nn

from course_lib.comm import Comm, CommError, during, wait_all
from course_lib.runtime.timeline import DISABLED, Timeline
from course_lib.sharding import shard_bounds

SCHEDULES = ("naive", "gpipe", "1f1b", "zb-h1")
SPLIT_BACKWARD = ("zb-h1", "zb-v")  # their backward runs as B (input) and W (weights)
TAG_SHAPE, TAG_ACTIVATION, TAG_GRADIENT = 90, 91, 92
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class PipelineError(CommError):
    """A stage could not finish its part of a step; the message names the stage and the
    micro-batch. Introduced in notebooks/09_model_parallelism.ipynb."""


# ---------------------------------------------------------------- schedules and the simulator
def bubble_fraction(num_stages: int, num_microbatches: float, virtual_stages: int = 1) -> float:
    """The idle share of every stage, (N-1)/(v*M+N-1), with equal stages and free messages.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    for name, value in [("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("virtual_stages", virtual_stages)]:  # M may be real: a curve's x
        if not value >= 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


def schedule_bubble(schedule: str, num_stages: int, num_microbatches: int) -> float:
    """The idle share of one step of a schedule with free messages: (N-1)/(M+N-1) for GPipe and
    1F1B (any forward and backward times), (N-1)/(3M+N-1) for ZB-H1, a third of the idle time,
    and (N-1)/(6M+N-1) for ZB-V, a sixth: each rank idles N-1 half-stage forwards (rank s, s of
    them at the start and N-1-s at the end). The last two with F = B = W (B and W each half the
    backward), M >= N for ZB-H1 and M >= 2N-1 for ZB-V.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    N, M = num_stages, num_microbatches
    if schedule == "naive":
        return bubble_fraction(N, 1)
    if schedule in ("gpipe", "1f1b"):
        return bubble_fraction(N, M)
    least = {"zb-h1": N, "zb-v": 2 * N - 1}.get(schedule)
    if least is None:
        raise ValueError(f"schedule must be one of {(*SCHEDULES, 'zb-v')}, not {schedule!r}")
    if M < least:
        raise ValueError(f"{schedule}'s bubble formula needs M >= {least} micro-batches for "
                         f"N = {N} stages, got {M}")
    return (N - 1) / ((3 if schedule == "zb-h1" else 6) * M + N - 1)


def schedule_order(schedule: str, stage: int, num_stages: int,
                   num_microbatches: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs its forwards ``("F", m)`` and backwards ``("B", m)``
    (for ``"zb-h1"``: B the input gradient, then ``("W", m)`` the weight gradient).

    Introduced in notebooks/09_model_parallelism.ipynb."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in 0..{num_stages - 1}, not {stage}")
    M = 1 if schedule == "naive" else num_microbatches
    if M < 1:
        raise ValueError(f"num_microbatches must be >= 1, not {num_microbatches}")
    if schedule in ("naive", "gpipe"):
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warmup = min(num_stages - stage - 1, M)  # later stages need fewer forwards in flight
    order = [("F", m) for m in range(warmup)]
    for m in range(warmup, M):  # steady state: one forward, then the oldest backward
        order += [("F", m), ("B", m - warmup)]
    order += [("B", m) for m in range(M - warmup, M)]
    if schedule == "1f1b":
        return order
    # zb-h1: each B is followed by the oldest W not run yet, except that stage s lets its first
    # s W's wait (a later stage gets its forwards one by one, so it has room for N - s more
    # micro-batches than 1F1B keeps); the W's still waiting run last, filling the drain
    split, waiting = [], []
    for op, m in order:
        split.append((op, m))
        if op == "B":
            waiting.append(m)
            if len(waiting) > stage:
                split.append(("W", waiting.pop(0)))
    return split + [("W", m) for m in waiting]


def v_places(stage: int, num_stages: int) -> list[int]:
    """The two stages of 2N that rank ``stage`` holds in a V (ZB-V): ``stage`` on the way down,
    2N-1-``stage`` on the way back up. Introduced in notebooks/09_model_parallelism.ipynb."""
    return [stage, 2 * num_stages - 1 - stage]


def zb_v_order(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int, int]]:
    """ZB-V (Qi et al. 2024): rank ``stage`` holds chunk 0 = stage ``stage`` and chunk 1 = stage
    2N-1-``stage`` of 2N; its ``(op, m, chunk)`` steps, op in F, B (input gradient), W (weight
    gradient). Warm-up: forwards on chunk 0 until the V's bottom is reached, chunk 1's first
    micro-batches run F-B-W at once; steady state: F-B-W on chunk 0, then on chunk 1; drain: the
    B's first, the W's put off to fill the wait.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    N, M, s = num_stages, num_microbatches, stage
    if not 0 <= s < N:
        raise ValueError(f"stage must be in 0..{N - 1}, not {s}")
    if M < 1:
        raise ValueError(f"num_microbatches must be >= 1, not {num_microbatches}")
    total = max(M, 2 * N - 1)  # the pattern needs 2N-1 micro-batches; extra ones dropped below
    next_op = {(op, c): 0 for op in "FBW" for c in (0, 1)}  # the next micro-batch of each

    def run(op, chunk):
        m = next_op[op, chunk]
        next_op[op, chunk] += 1
        return (op, m, chunk)
    order = [run("F", 0) for _ in range(2 * (N - s) - 1)]  # down the V to its bottom
    for _ in range(s):  # chunk 1's forwards begin as micro-batches come back up
        order += [run("F", 1), run("F", 0)]
    for _ in range(N - s):  # the first micro-batches through chunk 1 go straight back
        order += [run("F", 1), run("B", 1), run("W", 1)]
    while next_op["F", 0] < total or next_op["F", 1] < next_op["F", 0]:  # steady state
        if next_op["F", 0] < total:
            order.append(run("F", 0))
        order += [run("B", 0), run("W", 0), run("F", 1), run("B", 1), run("W", 1)]
    for _ in range(s):  # the drain: B's first, their W's wait
        order += [run("B", 0), run("B", 1)]
    for _ in range(N - s):
        order += [run("B", 0), run("W", 0)]
    order += [run("W", 1) for _ in range(next_op["B", 1] - next_op["W", 1])]
    order += [run("W", 0) for _ in range(next_op["B", 0] - next_op["W", 0])]
    return [step for step in order if step[1] < M]


def check_order(order: Sequence[Sequence], stage: int, num_microbatches: int) -> None:
    """Raise ValueError unless ``order`` runs ``("F", m)`` and then ``("B", m)`` exactly once
    for every micro-batch m < M (and, if it splits the backward, ``("W", m)`` after its B).
    Introduced in notebooks/09_model_parallelism.ipynb."""
    got = [tuple(step) for step in order]
    ops = "FBW" if any(step[0] == "W" for step in got) else "FB"
    expected = {(op, m) for op in ops for m in range(num_microbatches)}
    if sorted(got) != sorted(expected):
        missing, extra = sorted(expected - set(got)), sorted(set(got) - expected)
        raise ValueError(f"stage {stage}: an order runs {' and '.join(ops)} once for each of "
                         f"the {num_microbatches} micro-batches; missing {missing}, unexpected "
                         f"{extra}, {len(got)} steps for {len(ops) * num_microbatches}")
    for m in range(num_microbatches):
        for before, after in zip(ops, ops[1:], strict=False):
            if got.index((after, m)) < got.index((before, m)):
                name = {"B": "backward", "W": "weight gradient"}[after]
                raise ValueError(f"stage {stage}: the {name} of micro-batch {m} comes before "
                                 f"its {'forward' if before == 'F' else 'backward'}")


class Simulation(NamedTuple):
    """What :func:`simulate` returns. Introduced in notebooks/09_model_parallelism.ipynb."""

    intervals: list[list[tuple[str, int, float, float]]]  # per stage: (op, m, start, end)
    makespan: float
    bubble: float
    peak_live: list[int]


def simulate(schedule: str, num_stages: int, num_microbatches: int, t_forward: float = 1.0,
             t_backward: float = 2.0, t_message: float = 0.0,
             orders: Sequence[Sequence[tuple]] | None = None,
             virtual_stages: int = 1, t_weight: float | None = None) -> Simulation:
    """Play a schedule with fixed times per micro-batch: forward and backward of one stage, and
    one message between stages. ``orders``: each stage's own order (default
    :func:`schedule_order`; ``"interleaved"`` with ``virtual_stages`` = v chunks per rank:
    :func:`interleaved_order`; ``"zb-v"``: :func:`zb_v_order`). A schedule that splits the
    backward runs B in ``t_backward - t_weight`` and W in ``t_weight`` (default: half the
    backward, so that F = B = W with the default times). Returns
    ``Simulation(intervals, makespan, bubble, peak_live)``: ``intervals[s]`` = [(op, m, start,
    end)], bubble = idle share of the busiest stage, ``peak_live[s]`` = most micro-batches whose
    activations stage s holds at once (until their W, if the backward is split; in chunks for
    ``"zb-v"``).

    Introduced in notebooks/09_model_parallelism.ipynb."""
    N = num_stages
    v = {"interleaved": virtual_stages, "zb-v": 2}.get(schedule, 1)
    if orders is None and schedule == "interleaved":
        orders = [interleaved_order(s, N, num_microbatches, v) for s in range(N)]
    if orders is None and schedule == "zb-v":
        orders = [zb_v_order(s, N, num_microbatches) for s in range(N)]
    orders = orders or [schedule_order(schedule, s, N, num_microbatches) for s in range(N)]
    t_weight = t_backward / 2 if t_weight is None else t_weight
    if not 0 <= t_weight < t_backward:
        raise ValueError(f"t_weight must be in [0, t_backward), got {t_weight}")
    split = any(step[0] == "W" for order in orders for step in order)
    seconds = {"F": t_forward, "B": t_backward - t_weight if split else t_backward,
               "W": t_weight}

    def virtual(s, chunk):  # chunk c of rank s: interleaved c * N + s, or a V
        if schedule == "zb-v":
            return v_places(s, N)[chunk]
        return chunk * N + s
    orders = [[(op, m, virtual(s, step[2]) if len(step) > 2 else s) for step in order
               for op, m in [step[:2]]] for s, order in enumerate(orders)]
    rank_of = {virtual(s, c): s for s in range(N) for c in range(v)}
    last = N * v - 1
    end, free, nxt = {}, [0.0] * N, [0] * N
    intervals = [[] for _ in range(N)]
    while any(nxt[s] < len(orders[s]) for s in range(N)):
        progressed = False
        for s in range(N):
            while nxt[s] < len(orders[s]):
                op, m, k = orders[s][nxt[s]]
                # a forward needs the previous stage's forward of m; a backward the next
                # stage's backward of m (the last stage: its own forward of m); a W its own B
                dep = {"F": ("F", k - 1, m) if k else None,
                       "B": ("B", k + 1, m) if k < last else ("F", k, m),
                       "W": ("B", k, m)}[op]
                if dep is not None and dep not in end:
                    break
                # a message only between two ranks: not from a stage to itself, nor between
                # the two chunks of one rank (the bottom of a V)
                ready = 0.0 if dep is None else \
                    end[dep] + (t_message if rank_of[dep[1]] != s else 0)
                start = max(free[s], ready)
                # a chunk holds 1/v of its rank's layers, so it takes 1/v of the time
                free[s] = end[(op, k, m)] = start + seconds[op] / v
                intervals[s].append((op, m, start, free[s]))
                nxt[s] += 1
                progressed = True
        if not progressed:  # a full sweep and no stage could start anything
            stuck = {s: orders[s][nxt[s]][:2] for s in range(N) if nxt[s] < len(orders[s])}
            raise ValueError(f"the orders deadlock: each stage waits for another ({stuck})")
    makespan = max(free)
    busy = max(sum(e - b for _, _, b, e in row) for row in intervals)
    return Simulation(intervals, makespan, 1 - busy / makespan,
                      [_peak_live(order) for order in orders])


def interleaved_order(stage: int, num_stages: int, num_microbatches: int,
                      virtual_stages: int = 2) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Narayanan et al. 2021): rank ``stage`` holds v chunks of layers
    (virtual stages stage, stage + N, ...) and runs ``("F", m, chunk)`` / ``("B", m, chunk)``
    for each: micro-batches in groups of N, chunk by chunk; a warm-up of
    2(N - stage - 1) + (v - 1) N forwards, then one forward and one backward. M must be a
    multiple of N. Introduced in notebooks/09_model_parallelism.ipynb."""
    N, M, v = num_stages, num_microbatches, virtual_stages
    if M % N:
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of the {N} stages: "
                         f"num_microbatches={M} is not a multiple of {N}")

    def step(op, k):  # the k-th forward (or backward) of this rank
        # k runs through blocks of N v: N micro-batches on chunk 0, the same N on chunk 1, ...,
        # then the next N micro-batches; backwards take the chunks in reverse
        group, chunk = divmod(k, N * v)
        chunk //= N
        return (op, group * N + k % N, chunk if op == "F" else v - 1 - chunk)
    total = M * v
    warmup = min(2 * (N - stage - 1) + (v - 1) * N, total)
    order = [step("F", k) for k in range(warmup)]
    for k in range(warmup, total):
        order += [step("F", k), step("B", k - warmup)]
    return order + [step("B", k) for k in range(total - warmup, total)]


def _peak_live(order):
    """Most micro-batches (chunks) whose activations are held at once: from F until B frees
    them, or until W when the backward is split (W needs the layers' inputs)."""
    freed_by = "W" if any(op == "W" for op, *_ in order) else "B"
    live = peak = 0
    for op, *_ in order:
        live += 1 if op == "F" else -1 if op == freed_by else 0
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------- splitting a model
def balance(layer_times: Sequence[float], num_stages: int) -> list[int]:
    """Cut layers with these times into ``num_stages`` contiguous groups so that the slowest
    group is as fast as possible (dynamic programming); returns the number of layers per stage.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    n = len(layer_times)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} layers cannot make {num_stages} stages of at least one layer")
    prefix = [0.0]  # prefix[i] - prefix[j]: the time of layers j..i-1
    for t in layer_times:
        prefix.append(prefix[-1] + t)
    # best[k][i]: the slowest stage when the first i layers make k stages; cut[k][i]: last cut
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):  # stage k: layers j..i-1; the k - 1 before it: j >= k - 1
                slowest = max(best[k - 1][j], prefix[i] - prefix[j])
                if slowest < best[k][i]:
                    best[k][i], cut[k][i] = slowest, j
    counts, i = [], n
    for k in range(num_stages, 0, -1):  # walk the cuts back from the last stage
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def layer_times(model: nn.Sequential, x: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each layer of an ``nn.Sequential`` on the input ``x``
    (the median of ``repeats``), layer by layer: what :func:`balance` cuts by.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    model(x)  # untimed: the first call of a layer pays for its lazy set-up
    times, inp = [], x.detach()
    for layer in model:
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = layer(inp.requires_grad_())
            out.backward(torch.ones_like(out))
            runs.append(time.perf_counter() - start)
        times.append(sorted(runs)[len(runs) // 2])
        inp = out.detach()
    model.zero_grad(set_to_none=True)
    return times


def split_model(model: nn.Sequential, counts: Sequence[int]) -> list[nn.Sequential]:
    """The stages of an ``nn.Sequential``: ``counts[s]`` layers each, in order.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    layers = list(model)
    if sum(counts) != len(layers) or min(counts) < 1:
        raise ValueError(f"counts {counts} must be >= 1 each and add up to the model's "
                         f"{len(layers)} layers")
    bounds = [sum(counts[:s]) for s in range(len(counts) + 1)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class _SleepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepLayer(nn.Module):
    """A layer that takes a fixed time: ``forward_s`` in forward, ``backward_s`` in backward
    (sleeping, so four stages fit on two cores), and scales by a learnt scalar. In a split
    backward (zero-bubble schedules), B sleeps ``backward_s - weight_s`` and W ``weight_s``
    (default: half the backward each).

    Introduced in notebooks/09_model_parallelism.ipynb."""

    def __init__(self, forward_s: float = 0.01, backward_s: float = 0.02,
                 weight_s: float | None = None) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.weight_s = backward_s / 2 if weight_s is None else weight_s
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        put_off = not self.scale.requires_grad  # the weight's gradient waits for W
        backward_s = self.backward_s - self.weight_s if put_off else self.backward_s
        return _SleepGrad.apply(x * self.scale, backward_s)  # needs grad on every stage

    def weight_grad(self, x: torch.Tensor, grad_out: torch.Tensor) -> list[tuple]:
        """W: ``[(parameter, its gradient)]`` from the layer's input and its output's gradient."""
        time.sleep(self.weight_s)
        return [(self.scale, (grad_out * x).sum())]


def weight_grads(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> list[tuple]:
    """W, the half of the backward that nobody waits for: ``[(parameter, its gradient)]`` of a
    layer from its input ``x`` and its output's gradient. For ``nn.Linear`` y = x Aᵀ + b:
    dA = dyᵀ x and db = the sum of dy over the batch (the input's gradient dx = dy A is B's).
    Introduced in notebooks/09_model_parallelism.ipynb."""
    if isinstance(layer, nn.Linear):
        x2, dy2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grads = [(layer.weight, dy2.T @ x2)]
        return grads + ([(layer.bias, dy2.sum(0))] if layer.bias is not None else [])
    return layer.weight_grad(x, grad_out)


@contextmanager
def weights_put_off(module: nn.Module, kept: list) -> Iterator[None]:
    """Inside, a forward through ``module`` records no edge to the weights of its ``nn.Linear``
    layers (and of layers with a ``weight_grad`` method): its backward computes only input
    gradients (B), and each such layer appends ``[layer, its input, its output's gradient]``
    to ``kept`` for :func:`weight_grads` (W; the gradient is filled in by B). Other parameters
    get their gradients in B. Introduced in notebooks/09_model_parallelism.ipynb."""
    layers = [m for m in module.modules()
              if isinstance(m, nn.Linear) or hasattr(m, "weight_grad")]
    frozen = [p for m in layers for p in m.parameters(recurse=False) if p.requires_grad]

    def keep(layer, args, out):
        entry = [layer, args[0].detach(), None]
        kept.append(entry)
        out.register_hook(lambda grad_out: entry.__setitem__(2, grad_out))
    hooks = [m.register_forward_hook(keep) for m in layers]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for hook in hooks:
            hook.remove()


# ---------------------------------------------------------------- running a step on the ranks
class StepResult(NamedTuple):
    """What :func:`pipeline_step` returns. Introduced in notebooks/09_model_parallelism.ipynb."""

    loss: float | None  # on the last stage only
    peak_live: int
    peak_activation_bytes: int


def pipeline_step(stage_module: nn.Module | Sequence[nn.Module], comm: Comm,
                  num_microbatches: int, x: torch.Tensor | None = None,
                  y: torch.Tensor | None = None,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  schedule: str | Callable[[int, int, int], Sequence[tuple]] = "1f1b",
                  timeline: Timeline = DISABLED, timeout: float | None = None) -> StepResult:
    """Forward and backward of one training step for this rank's stage (stage = ``comm.rank``),
    in the order of ``schedule``: a name of :data:`SCHEDULES`, ``"zb-v"``, or a function
    ``(stage, num_stages, num_microbatches) -> [("F", m), ("B", m), ...]``;
    the gradients accumulate in ``stage_module``'s parameters, equal to one process on the
    whole batch. An order with ``("W", m)`` steps splits each backward: B computes the input's
    gradient and sends it at once, W the weights' gradients later (:func:`weights_put_off`).
    ``"zb-v"``: ``stage_module`` is this rank's two chunks ``[stage s, stage 2N-1-s]`` of 2N
    (:func:`v_chunks`), and rank 0 holds both ends of the model. The rank with the first stage
    passes the batch ``x``, the one with the last the targets ``y`` and ``loss_fn`` (a mean over
    the batch). Returns ``StepResult(loss on the last stage else None, peak live micro-batches
    (chunks for zb-v), peak bytes of activations saved for backward)``.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    stage, N = comm.rank, comm.world_size
    v_shaped = schedule == "zb-v"
    chunks = list(stage_module) if v_shaped else [stage_module]
    if v_shaped and len(chunks) != 2:
        raise ValueError(f"stage {stage}: zb-v runs two chunks per rank, got {len(chunks)}")
    virtual = v_places(stage, N) if v_shaped else [stage]  # each chunk's place
    last_place = 2 * N - 1 if v_shaped else N - 1

    def rank_of(place):  # the rank holding stage ``place`` of the model
        return place if place < N else 2 * N - 1 - place
    first, last = 0 in virtual, last_place in virtual
    if first and x is None or last and (y is None or loss_fn is None):
        raise ValueError(f"stage {stage}: the first stage needs x, the last y and loss_fn")
    if first and not 1 <= num_microbatches <= len(x):
        raise ValueError(f"num_microbatches must be in 1..{len(x)} (the batch), "
                         f"not {num_microbatches}")
    timeout = comm.timeout if timeout is None else timeout
    if callable(schedule):  # a function (stage, num_stages, num_microbatches) -> order
        order = list(schedule(stage, N, num_microbatches))
        check_order(order, stage, num_microbatches)
    elif v_shaped:
        order = zb_v_order(stage, N, num_microbatches)
    else:
        order = schedule_order(schedule, stage, N, num_microbatches)
    order = [(step[0], step[1], step[2] if len(step) > 2 else 0) for step in order]
    split = any(op == "W" for op, _, _ in order)
    M = len({m for _, m, _ in order})  # naive: the whole batch as one
    # where this stage's activations live: received ones are placed there (a CUDA stage's too)
    device = next(chunks[0].parameters(), torch.empty(0)).device
    saved, live_bytes, peak_bytes, live, peak_live = {}, 0, 0, 0, 0
    inputs, outputs, kept, sends, total = {}, {}, {}, [], 0.0
    handed = {}  # at the bottom of the V: what chunk 0 hands chunk 1 (and its gradient back)
    neighbour = "rank" if v_shaped else "stage"  # in a V, a rank holds two stages

    def recv(buf, peer, tag, what, m):
        with during(f"stage {stage} (rank {comm.rank}): {what} of micro-batch {m} from "
                    f"{neighbour} {peer} failed", PipelineError), \
                timeline.span(f"{what} {m}", "recv"):
            # sizes need no check: the shape header comes first, a gradient has the shape of
            # the activation it belongs to
            return comm.recv(buf, peer, tag=tag, timeout=timeout, check_size=False)

    def send(buf, peer, tag, what, m):
        # posting fails at once when the peer's process is already gone
        with during(f"stage {stage} (rank {comm.rank}): {what} of micro-batch {m} to "
                    f"{neighbour} {peer} failed", PipelineError):
            return comm.isend(buf, peer, tag=tag, check_size=False)

    def receive(what, place, m, like=None):
        """The activation (from stage ``place`` before) or the gradient (``like`` the output
        it belongs to, from the stage after) of micro-batch m."""
        peer = rank_of(place)
        if peer == stage:  # the V's bottom: from this rank's other chunk
            return handed.pop((what, m))
        if what == "gradient":
            return recv(torch.empty_like(like), peer, TAG_GRADIENT, what, m)
        # the header: [ndim, shape (up to 6 sizes), index of the dtype in DTYPES]
        header = recv(torch.zeros(8, dtype=torch.int64), peer, TAG_SHAPE, "activation shape", m)
        shape, dtype = header[1:1 + header[0]].tolist(), DTYPES[int(header[7])]
        return recv(torch.empty(shape, dtype=dtype, device=device), peer, TAG_ACTIVATION, what,
                    m)

    def pass_on(what, tensor, place, m):
        """Send micro-batch m's activation (or gradient) to the rank of stage ``place``."""
        peer = rank_of(place)
        if peer == stage:
            handed[what, m] = tensor
            return
        if what == "activation":
            header = torch.zeros(8, dtype=torch.int64)
            header[0], header[7] = tensor.dim(), DTYPES.index(tensor.dtype)
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape)
            sends.append(send(header, peer, TAG_SHAPE, "shape", m))
        tag = TAG_ACTIVATION if what == "activation" else TAG_GRADIENT
        sends.append(send(tensor, peer, tag, what, m))

    for op, m, c in order:
        place, key = virtual[c], (m, c)  # this step's stage of the model, and its records
        if op == "F":
            if place == 0:
                a, b = shard_bounds(len(x), m, M)
                # with the weights put off, B needs something to differentiate: the input
                inp = x[a:b].detach().requires_grad_() if split else x[a:b]
            else:
                inp = receive("activation", place - 1, m).requires_grad_()
            nbytes = [0]

            def pack(t, nbytes=nbytes):  # count what autograd keeps for this backward
                nbytes[0] += t.numel() * t.element_size()
                return t
            kept[key] = []
            with timeline.span(f"F{m}", "forward"), torch.autograd.graph.saved_tensors_hooks(
                    pack, lambda t: t), weights_put_off(chunks[c], kept[key]) if split \
                    else nullcontext():
                out = chunks[c](inp)
                if place == last_place:
                    a, b = shard_bounds(len(y), m, M)  # weight: the full batch's mean
                    out = loss_fn(out, y[a:b]) * ((b - a) / len(y))
            # W keeps each layer's input (autograd no longer does, its weight being put off)
            nbytes[0] += sum(t.numel() * t.element_size() for _, t, _ in kept[key])
            inputs[key], outputs[key], saved[key] = inp, out, nbytes[0]
            live, live_bytes = live + 1, live_bytes + nbytes[0]
            peak_live, peak_bytes = max(peak_live, live), max(peak_bytes, live_bytes)
            if place < last_place:  # what is sent is detached; out keeps the graph for B
                pass_on("activation", out.detach().contiguous(), place + 1, m)
        elif op == "B":
            out = outputs.pop(key)
            if place == last_place:
                total += out.item()
                grad = None
            else:
                grad = receive("gradient", place + 1, m, like=out)
            with timeline.span(f"B{m}", "backward"):
                out.backward(grad)
            inp = inputs.pop(key)
            if not split:
                live, live_bytes = live - 1, live_bytes - saved.pop(key)
            if place > 0:
                pass_on("gradient", inp.grad.contiguous(), place - 1, m)
        else:  # W: the weights' gradients of micro-batch m, from what its F and B kept
            with timeline.span(f"W{m}", "weight"):
                for layer, layer_input, grad_out in kept.pop(key):
                    if grad_out is None:  # the layer's output did not reach the loss
                        continue
                    for param, g in weight_grads(layer, layer_input, grad_out):
                        param.grad = g if param.grad is None else param.grad + g
            live, live_bytes = live - 1, live_bytes - saved.pop(key)
    # every send was posted without waiting (a blocking send to a stage busy sending itself
    # could deadlock): now wait until all were received, their buffers kept alive till then
    with during(f"stage {stage} (rank {comm.rank}): a send was not received", PipelineError):
        wait_all(sends, timeout)
    return StepResult(total if last else None, peak_live, peak_bytes)


def v_chunks(parts: Sequence[nn.Module], stage: int) -> list[nn.Module]:
    """The two chunks rank ``stage`` runs under ``"zb-v"``: of the model's 2N stages ``parts``,
    stage s on the way down the V and stage 2N-1-s on the way back up.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    N = len(parts) // 2
    if len(parts) != 2 * N or not 0 <= stage < N:
        raise ValueError(f"zb-v cuts the model into 2N stages for N ranks: got {len(parts)} "
                         f"parts, stage {stage}")
    return [parts[place] for place in v_places(stage, N)]
