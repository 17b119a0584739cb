"""Pipeline parallelism: a sequential model cut into stages, one per rank; micro-batches flow
through them, activations forward and their gradients back, point to point.

Introduced in notebooks/09_model_parallelism.ipynb. Three schedules, side by side:

- ``"naive"``: the whole batch as one piece: while one stage works, the N-1 others wait.
- ``"gpipe"``: M micro-batches, all forwards then all backwards (Huang et al. 2019). The idle
  share of each stage, the *bubble*, is (N-1)/(M+N-1); every stage holds the activations of
  all M micro-batches at the turn.
- ``"1f1b"``: after a warm-up of N-s-1 forwards, stage s alternates one forward and one backward
  (PipeDream-Flush, Narayanan et al. 2021): the same bubble, but at most N-s micro-batches'
  activations alive at once instead of M.

:func:`simulate` predicts a schedule's Gantt chart, bubble and live activations;
:func:`pipeline_step` runs it for real on the ranks, over ``comm``, with a deadline on every
receive and a :class:`~course_lib.runtime.timeline.Timeline` of what each stage did. It stays one
file: the simulator predicts what ``pipeline_step`` does, and notebook 09 compares the two side
by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from course_lib.comm import Comm, CommError, during, wait_all
from course_lib.runtime.timeline import DISABLED, Timeline
from course_lib.sharding import shard_bounds

SCHEDULES = ("naive", "gpipe", "1f1b")
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


def schedule_order(schedule: str, stage: int, num_stages: int,
                   num_microbatches: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs its forwards ``("F", m)`` and backwards ``("B", m)``.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in 0..{num_stages - 1}, not {stage}")
    M = 1 if schedule == "naive" else num_microbatches
    if M < 1:
        raise ValueError(f"num_microbatches must be >= 1, not {num_microbatches}")
    if schedule != "1f1b":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warmup = min(num_stages - stage - 1, M)  # later stages need fewer forwards in flight
    order = [("F", m) for m in range(warmup)]
    for m in range(warmup, M):  # steady state: one forward, then the oldest backward
        order += [("F", m), ("B", m - warmup)]
    return order + [("B", m) for m in range(M - warmup, M)]


def check_order(order: Sequence[Sequence], stage: int, num_microbatches: int) -> None:
    """Raise ValueError unless ``order`` runs ``("F", m)`` and then ``("B", m)`` exactly once
    for every micro-batch m < M. Introduced in notebooks/09_model_parallelism.ipynb."""
    expected = {(op, m) for op in "FB" for m in range(num_microbatches)}
    got = [tuple(step) for step in order]
    if sorted(got) != sorted(expected):
        missing, extra = sorted(expected - set(got)), sorted(set(got) - expected)
        raise ValueError(f"stage {stage}: an order runs F and B once for each of the "
                         f"{num_microbatches} micro-batches; missing {missing}, unexpected "
                         f"{extra}, {len(got)} steps for {2 * num_microbatches}")
    for m in range(num_microbatches):
        if got.index(("B", m)) < got.index(("F", m)):
            raise ValueError(f"stage {stage}: the backward of micro-batch {m} comes before "
                             "its forward")


class Simulation(NamedTuple):
    """What :func:`simulate` returns. Introduced in notebooks/09_model_parallelism.ipynb."""

    intervals: list[list[tuple[str, int, float, float]]]  # per stage: (op, m, start, end)
    makespan: float
    bubble: float
    peak_live: list[int]


def simulate(schedule: str, num_stages: int, num_microbatches: int, t_forward: float = 1.0,
             t_backward: float = 2.0, t_message: float = 0.0,
             orders: Sequence[Sequence[tuple]] | None = None,
             virtual_stages: int = 1) -> Simulation:
    """Play a schedule with fixed times per micro-batch: forward and backward of one stage, and
    one message between stages. ``orders``: each stage's own order (default
    :func:`schedule_order`; ``"interleaved"`` with ``virtual_stages`` = v chunks per rank:
    :func:`interleaved_order`). Returns ``Simulation(intervals, makespan, bubble, peak_live)``:
    ``intervals[s]`` = [(op, m, start, end)], bubble = idle share of the busiest stage,
    ``peak_live[s]`` = most micro-batches whose activations stage s holds at once.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    N, v = num_stages, virtual_stages if schedule == "interleaved" else 1
    if orders is None and schedule == "interleaved":
        orders = [interleaved_order(s, N, num_microbatches, v) for s in range(N)]
    orders = orders or [schedule_order(schedule, s, N, num_microbatches) for s in range(N)]
    # every op runs on a virtual stage: stage s itself, or chunk c of rank s = c * N + s
    orders = [[(op, m, step[2] * N + s if len(step) > 2 else s) for step in order
               for op, m in [step[:2]]] for s, order in enumerate(orders)]
    last = N * v - 1
    end, free, nxt = {}, [0.0] * N, [0] * N
    intervals = [[] for _ in range(N)]
    while any(nxt[s] < len(orders[s]) for s in range(N)):
        progressed = False
        for s in range(N):
            while nxt[s] < len(orders[s]):
                op, m, k = orders[s][nxt[s]]
                # a forward needs the previous stage's forward of m; a backward the next
                # stage's backward of m (the last stage: its own forward of m)
                dep = (("F", k - 1, m) if k else None) if op == "F" else \
                      (("B", k + 1, m) if k < last else ("F", k, m))
                if dep is not None and dep not in end:
                    break
                # a message only between two stages: the last one's backward follows its own
                # forward at once
                ready = 0.0 if dep is None else end[dep] + (t_message if dep[1] != k else 0)
                start = max(free[s], ready)
                # a chunk holds 1/v of its rank's layers, so it takes 1/v of the time
                free[s] = end[(op, k, m)] = start + (t_forward if op == "F" else t_backward) / v
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
    live = peak = 0
    for op, *_ in order:
        live += 1 if op == "F" else -1
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
    (sleeping, so four stages fit on two cores), and scales by a learnt scalar.

    Introduced in notebooks/09_model_parallelism.ipynb."""

    def __init__(self, forward_s: float = 0.01, backward_s: float = 0.02) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return _SleepGrad.apply(x * self.scale, self.backward_s)  # needs grad on every stage


# ---------------------------------------------------------------- running a step on the ranks
class StepResult(NamedTuple):
    """What :func:`pipeline_step` returns. Introduced in notebooks/09_model_parallelism.ipynb."""

    loss: float | None  # on the last stage only
    peak_live: int
    peak_activation_bytes: int


def pipeline_step(stage_module: nn.Module, comm: Comm, num_microbatches: int,
                  x: torch.Tensor | None = None, y: torch.Tensor | None = None,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  schedule: str | Callable[[int, int, int], Sequence[tuple[str, int]]] = "1f1b",
                  timeline: Timeline = DISABLED, timeout: float | None = None) -> StepResult:
    """Forward and backward of one training step for this rank's stage (stage = ``comm.rank``),
    in the order of ``schedule``: a name of :data:`SCHEDULES`, or a function
    ``(stage, num_stages, num_microbatches) -> [("F", m), ("B", m), ...]``;
    the gradients accumulate in ``stage_module``'s parameters, equal to one process on the
    whole batch. Stage 0 passes the batch ``x``, the last stage the targets ``y`` and
    ``loss_fn`` (a mean over the batch). Returns ``StepResult(loss on the last stage else None,
    peak live micro-batches, peak bytes of activations saved for backward)``.

    Introduced in notebooks/09_model_parallelism.ipynb."""
    stage, N = comm.rank, comm.world_size
    first, last = stage == 0, stage == N - 1
    if first and x is None or last and (y is None or loss_fn is None):
        raise ValueError(f"stage {stage}: the first stage needs x, the last y and loss_fn")
    if first and not 1 <= num_microbatches <= len(x):
        raise ValueError(f"num_microbatches must be in 1..{len(x)} (the batch), "
                         f"not {num_microbatches}")
    timeout = comm.timeout if timeout is None else timeout
    if callable(schedule):  # a function (stage, num_stages, num_microbatches) -> order
        order = list(schedule(stage, N, num_microbatches))
        check_order(order, stage, num_microbatches)
    else:
        order = schedule_order(schedule, stage, N, num_microbatches)
    M = len(order) // 2
    # where this stage's activations live: received ones are placed there (a CUDA stage's too)
    device = next(stage_module.parameters(), torch.empty(0)).device
    saved, live_bytes, peak_bytes, live, peak_live = {}, 0, 0, 0, 0
    inputs, outputs, sends, total = {}, {}, [], 0.0

    def recv(buf, peer, tag, what, m):
        with during(f"stage {stage} (rank {comm.rank}): {what} of micro-batch {m} from stage "
                    f"{peer} failed", PipelineError), timeline.span(f"{what} {m}", "recv"):
            # sizes need no check: the shape header comes first, a gradient has the shape of
            # the activation it belongs to
            return comm.recv(buf, peer, tag=tag, timeout=timeout, check_size=False)

    def send(buf, peer, tag, what, m):
        # posting fails at once when the peer's process is already gone
        with during(f"stage {stage} (rank {comm.rank}): {what} of micro-batch {m} to stage "
                    f"{peer} failed", PipelineError):
            return comm.isend(buf, peer, tag=tag, check_size=False)

    for op, m in order:
        if op == "F":
            if first:
                a, b = shard_bounds(len(x), m, M)
                inp = x[a:b]
            else:
                # the header: [ndim, shape (up to 6 sizes), index of the dtype in DTYPES]
                header = recv(torch.zeros(8, dtype=torch.int64), stage - 1, TAG_SHAPE,
                              "activation shape", m)
                shape, dtype = header[1:1 + header[0]].tolist(), DTYPES[int(header[7])]
                inp = recv(torch.empty(shape, dtype=dtype, device=device), stage - 1,
                           TAG_ACTIVATION, "activation", m).requires_grad_()
            nbytes = [0]

            def pack(t, nbytes=nbytes):  # count what autograd keeps for this backward
                nbytes[0] += t.numel() * t.element_size()
                return t
            with timeline.span(f"F{m}", "forward"), torch.autograd.graph.saved_tensors_hooks(
                    pack, lambda t: t):
                out = stage_module(inp)
                if last:
                    a, b = shard_bounds(len(y), m, M)  # weight: the full batch's mean
                    out = loss_fn(out, y[a:b]) * ((b - a) / len(y))
            inputs[m], outputs[m], saved[m] = inp, out, nbytes[0]
            live, live_bytes = live + 1, live_bytes + nbytes[0]
            peak_live, peak_bytes = max(peak_live, live), max(peak_bytes, live_bytes)
            if not last:
                act = out.detach().contiguous()  # what is sent; out keeps the graph for B
                header = torch.zeros(8, dtype=torch.int64)
                header[0], header[7] = act.dim(), DTYPES.index(act.dtype)
                header[1:1 + act.dim()] = torch.tensor(act.shape)
                sends += [send(header, stage + 1, TAG_SHAPE, "shape", m),
                          send(act, stage + 1, TAG_ACTIVATION, "activation", m)]
        else:
            out = outputs.pop(m)
            if last:
                total += out.item()
                grad = None
            else:
                grad = recv(torch.empty_like(out), stage + 1, TAG_GRADIENT, "gradient", m)
            with timeline.span(f"B{m}", "backward"):
                out.backward(grad)
            inp = inputs.pop(m)
            live, live_bytes = live - 1, live_bytes - saved.pop(m)
            if not first:
                sends.append(send(inp.grad.contiguous(), stage - 1, TAG_GRADIENT, "gradient", m))
    # every send was posted without waiting (a blocking send to a stage busy sending itself
    # could deadlock): now wait until all were received, their buffers kept alive till then
    with during(f"stage {stage} (rank {comm.rank}): a send was not received", PipelineError):
        wait_all(sends, timeout)
    return StepResult(total if last else None, peak_live, peak_bytes)

