"""Figures of notebook 05 (allreduce): the ring step by step, naive vs tree, the cost model.

The ring step by step is drawn from the library's own ring: :func:`record_ring` runs
``collectives.ring_allreduce`` on :mod:`course_lib.comm.recording` (every rank a thread of this
process, every message recorded with the sender's buffer as it was) and reads each step off the
record: who sent which chunk to whom, and what every rank held after it. The schedule it shows
(rank r's right neighbour is r+1 mod N; chunks from ``sharding.shard_bounds``; steps s = 0 .. N-2):

    reduce-scatter step s: rank r sends chunk (r - s - 1) mod N to rank r+1, which adds it
    all-gather     step s: rank r sends chunk (r - s)     mod N to rank r+1, which copies it

Every function returns a matplotlib ``Figure`` (built without pyplot) and saves it when given
``path``. ``save_all(out_dir)`` regenerates the PNGs in ``images/``:

    python -c "from course_lib.figures import allreduce as f; f.save_all('images')"
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from course_lib import costmodel
from course_lib.collectives import TAG_AG, TAG_RS, ring_allreduce
from course_lib.comm import Message, run_ranks
from course_lib.figures import finish


# ----------------------------------------------------------------------------- the ring
@dataclass
class RingStep:
    """The state of every rank after one step of the ring (notebook 05_allreduce).

    phase: "start", "reduce-scatter" or "all-gather"; step: 1 .. N-1 within the phase (0 for
    the start); sends: (src, dst, chunk) of this step; holds[r, c, q]: chunk c of rank r contains
    rank q's data; buffers: each rank's buffer (N x length) after the step."""

    phase: str
    step: int
    sends: list[tuple[int, int, int]]
    holds: np.ndarray
    buffers: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        """counts[r, c]: how many ranks' data chunk c of rank r holds (N = fully reduced)."""
        return self.holds.sum(axis=-1)


def _ring_messages(messages: list[Message], world_size: int) -> list[list[Message]]:
    """Each rank's ring messages (reduce-scatter, then all-gather) in the order it sent them."""
    ring = [m for m in messages if m.tag in (TAG_RS, TAG_AG)]  # not the agreement round's
    return [[m for m in ring if m.src == r] for r in range(world_size)]


def record_ring(world_size: int, data: np.ndarray | None = None, seed: int = 0) -> list[RingStep]:
    """Run the library's ring allreduce on ``world_size`` ranks in this process and return every
    state it went through: ``[start, 2(N-1) steps...]`` as ``RingStep``s (notebook 05).

    ``data`` (world_size x length, default small random integers) is rank r's buffer in row r.
    The ranks are threads talking over :class:`course_lib.comm.RecordingComm`; a rank's state
    after a step is its buffer as it was when it sent its next message (or at the end)."""
    n = world_size
    if data is None:
        data = np.random.default_rng(seed).integers(0, 10, size=(n, 3 * n)).astype(float)
    start = np.array(data, dtype=float, copy=True)
    if start.ndim != 2 or start.shape[0] != n:
        raise ValueError(f"data must be ({world_size}, length), got shape {start.shape}")
    if n > 62:
        raise ValueError(f"at most 62 ranks (who holds what is one bit per rank), not {n}")
    values = [row.copy() for row in start]
    _, sent = run_ranks(ring_allreduce, values)
    # Whose data each chunk holds, by the same ring on other buffers: rank q contributes the
    # bit 2**q (one element per chunk), and a sum of distinct bits is their union.
    who = [np.full(n, 1 << r, np.int64) for r in range(n)]
    _, sent_who = run_ranks(ring_allreduce, who)
    by_rank, who_by_rank = _ring_messages(sent, n), _ring_messages(sent_who, n)

    def after(k: int) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's buffer and bits after k steps: as it sent message k, or at the end."""
        if k == 2 * (n - 1):
            return np.array(values), np.array(who)
        return (np.array([by_rank[r][k].sender_state for r in range(n)]),
                np.array([who_by_rank[r][k].sender_state for r in range(n)]))

    def holds(bits: np.ndarray) -> np.ndarray:
        return (bits[:, :, None] >> np.arange(n)) & 1 == 1  # [rank, chunk, contributor]

    states = [RingStep("start", 0, [], np.eye(n, dtype=bool)[:, None, :].repeat(n, 1), start)]
    for k in range(1, 2 * (n - 1) + 1):
        phase, step = ("reduce-scatter", k) if k < n else ("all-gather", k - (n - 1))
        # one element per chunk in the bits' run: a message's offset is its chunk
        sends = [(m.src, m.dst, m.offset) for m in (who_by_rank[r][k - 1] for r in range(n))]
        buffers, bits = after(k)
        states.append(RingStep(phase, step, sends, holds(bits), buffers))
    return states


def _count_colors(world_size):
    cmap = mpl.colormaps["YlGnBu"]
    return [cmap(0.12 + 0.83 * k / max(world_size - 1, 1)) for k in range(world_size)]


def _draw_ring_step(ax, state, world_size, colors):
    n, h = world_size, 0.56          # cells are h tall on a pitch of 1: arrows live in the gaps
    received = {(dst, c) for _, dst, c in state.sends}
    for r in range(n):
        for c in range(n):
            k = int(state.counts[r, c])
            edge = ("k", 2.6) if (r, c) in received else ("0.55", 0.6)
            ax.add_patch(Rectangle((c + 0.06, r - h / 2), 0.88, h, facecolor=colors[k - 1],
                                   edgecolor=edge[0], lw=edge[1]))
            who = np.flatnonzero(state.holds[r, c])
            text = ("Σ all" if k == n else "+".join(map(str, who))) if n <= 5 else f"{k}/{n}"
            ax.text(c + 0.5, r, text, ha="center", va="center", fontsize=8 if n <= 4 else 6.5,
                    color="white" if k > 0.6 * n else "black")
    style = dict(arrowstyle="-|>", color="C3", lw=1.6, mutation_scale=11)
    for src, dst, c in state.sends:
        if dst == src + 1:
            ax.annotate("", xy=(c + 0.5, dst - h / 2), xytext=(c + 0.5, src + h / 2),
                        arrowprops=style)
        else:                          # the wrap-around hop, last rank -> rank 0
            ax.annotate("", xy=(c + 0.5, src + 0.78), xytext=(c + 0.5, src + h / 2),
                        arrowprops=style)
            ax.annotate("", xy=(c + 0.5, dst - h / 2), xytext=(c + 0.5, dst - 0.78),
                        arrowprops=style)
            ax.text(c + 0.5, src + 0.84, f"to {dst}", ha="center", va="top", fontsize=7,
                    color="C3")
            ax.text(c + 0.5, dst - 0.84, f"from {src}", ha="center", va="bottom", fontsize=7,
                    color="C3")
    ax.set_xlim(0, n)
    ax.set_ylim(n + 0.05, -1.05)
    ax.set_xticks(np.arange(n) + 0.5, [f"chunk {c}" if n <= 4 else str(c) for c in range(n)],
                  fontsize=7)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def ring_steps_figure(world_size=4, path=None):
    """Ring allreduce step by step: one panel per step, 2(N-1) panels (notebook 05).

    Rows of a panel are ranks, columns are chunks; a cell's color (and text) says whose data it
    sums, a thick edge marks the chunk just received, red arrows show what each rank sent."""
    if world_size < 2:
        raise ValueError("the ring needs at least 2 ranks to draw")
    n = world_size
    states = record_ring(n)
    colors = _count_colors(n)
    fig = Figure(figsize=(2.7 * (n - 1) + 0.8, 2 * (0.55 * n + 1.0) + 0.9), layout="constrained")
    axes = fig.subplots(2, n - 1, squeeze=False)
    for state in states[1:]:
        row = 0 if state.phase == "reduce-scatter" else 1
        ax = axes[row, state.step - 1]
        _draw_ring_step(ax, state, n, colors)
        src, _, sent = state.sends[0]
        back = (src - sent) % n       # what the library's ring sent: chunk (r - back) mod N
        chunk = f"r-{back}" if back else "r"
        ax.set_title(f"{state.phase} {state.step}/{n - 1}\nrank r sends chunk {chunk} to r+1",
                     fontsize=9)
        if state.step > 1:
            ax.set_yticklabels([])
    axes[0, 0].set_ylabel("reduce-scatter: receiver adds", fontsize=9)
    axes[1, 0].set_ylabel("all-gather: receiver copies", fontsize=9)
    labels = [f"{k} ranks' data" if k > 1 else "own data only" for k in range(1, n)]
    handles = [Patch(facecolor=colors[k], edgecolor="0.55", label=lab)
               for k, lab in enumerate(labels)]
    handles += [Patch(facecolor=colors[-1], edgecolor="0.55", label=f"all {n}: reduced"),
                Patch(facecolor="white", edgecolor="k", lw=2.6, label="just received")]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6),
               fontsize=8, frameon=False)
    fig.suptitle(f"Ring allreduce on {n} ranks: {2 * (n - 1)} steps; in each, every rank sends "
                 f"one chunk (1/{n} of the buffer) to its right neighbour\n(as recorded from "
                 f"collectives.ring_allreduce; chunk and rank numbers mod {n}; at the start "
                 "every rank holds only its own data)", fontsize=10)
    return finish(fig, path)


# ------------------------------------------------------------------------ naive and tree
def naive_messages(world_size):
    """(step, src, dst, phase) of the naive allreduce: all to rank 0, one at a time, and back."""
    gather = [(i, i + 1, 0, "reduce") for i in range(world_size - 1)]
    bcast = [(world_size - 1 + i, 0, i + 1, "broadcast") for i in range(world_size - 1)]
    return gather + bcast


def tree_messages(world_size):
    """(step, src, dst, phase) of the binomial-tree allreduce: reduce to rank 0 in
    ceil(log2 p) steps (in step k, ranks r with r mod 2^(k+1) = 2^k send to r - 2^k), then the
    same edges in reverse to broadcast."""
    levels = int(np.ceil(np.log2(world_size))) if world_size > 1 else 0
    reduce = [(k, r, r - 2 ** k, "reduce") for k in range(levels)
              for r in range(world_size) if r % 2 ** (k + 1) == 2 ** k]
    bcast = [(2 * levels - 1 - k, dst, src, "broadcast") for k, src, dst, _ in reduce]
    return reduce + sorted(bcast)


def _draw_messages(ax, messages, world_size, num_steps):
    for r in range(world_size):
        ax.axhline(r, color="0.8", lw=0.8, zorder=0)
    for step, src, dst, phase in messages:
        color = "C0" if phase == "reduce" else "C1"
        ax.annotate("", xy=(step + 0.92, dst), xytext=(step + 0.08, src),
                    arrowprops=dict(arrowstyle="-|>", color=color, lw=1.4, mutation_scale=10))
    half = max(step for step, *_ in messages) + 1 if messages else 0
    half = half // 2
    ax.axvline(half, color="0.5", ls=":", lw=1)
    ax.text(half + 0.1, world_size - 0.6, "rank 0 holds the sum", fontsize=8, color="0.35")
    ax.set_xlim(-0.2, num_steps + 0.2)
    ax.set_ylim(world_size - 0.5, -0.5)
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)], fontsize=8)
    ax.set_xticks(range(num_steps + 1))
    ax.set_xlabel("time step (one full-size message per arrow)")


def naive_and_tree_figure(world_size=8, path=None):
    """Message patterns of the naive (to root and back) and binomial-tree allreduce side by side,
    on the same time axis (notebook 05)."""
    p = world_size
    naive, tree = naive_messages(p), tree_messages(p)
    num_steps = 2 * (p - 1)
    levels = int(np.ceil(np.log2(p))) if p > 1 else 0
    fig = Figure(figsize=(12, 0.42 * p + 2.2), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, sharey=True)
    _draw_messages(ax1, naive, p, num_steps)
    _draw_messages(ax2, tree, p, num_steps)
    ax1.set_title(f"naive: 2(p-1) = {num_steps} steps, every message goes through rank 0's link",
                  fontsize=10)
    ax2.set_title(f"binomial tree: 2·⌈log2 p⌉ = {2 * levels} steps, "
                  "up to p/2 messages at once", fontsize=10)
    fig.legend(handles=[Patch(color="C0", label="reduce: send to be summed"),
                        Patch(color="C1", label="broadcast: send the sum")],
               loc="outside lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle(f"Allreduce on p = {p} ranks: who sends to whom, step by step", fontsize=11)
    return finish(fig, path)


# ------------------------------------------------------------------------- cost model
def _bytes(n):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} B"


_STYLE = {"naive": "C3", "tree": "C1", "recursive_doubling": "C2", "rabenseifner": "C4",
          "ring": "C0"}


def cost_model_figure(link="100GbE", n_bytes=100e6, p_fixed=8, path=None):
    """Predicted allreduce time against ranks (2 .. 4096) at ``n_bytes``, and against message
    size at ``p_fixed`` ranks, for every algorithm and the lower bound (notebook 05)."""
    if isinstance(link, str):
        link = costmodel.LINKS[link]
    ps = 2 ** np.arange(1, 13)
    sizes = np.geomspace(8, 1e9, 200)
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for name in costmodel.ALGORITHMS:
        ax1.plot(ps, costmodel.allreduce_time(name, n_bytes, ps, link), "o-", ms=3,
                 color=_STYLE[name], label=name)
        ax2.plot(sizes, costmodel.allreduce_time(name, sizes, p_fixed, link),
                 color=_STYLE[name], label=name)
    ax1.plot(ps, costmodel.lower_bound(n_bytes, ps, link), "k--", lw=1.2,
             label="lower bound 2(p-1)/p·n/B")
    ax2.plot(sizes, costmodel.lower_bound(sizes, p_fixed, link), "k--", lw=1.2,
             label="lower bound 2(p-1)/p·n/B")
    ax1.set(xscale="log", yscale="log", xlabel="number of ranks p", ylabel="seconds",
            title=f"{_bytes(n_bytes)} allreduce: time against p")
    ax1.set_xticks(ps, [str(p) for p in ps], fontsize=8)
    ax1.minorticks_off()
    ax2.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="seconds",
            title=f"p = {p_fixed}: time against message size")
    ax2.set_ylim(bottom=0.3 * link.alpha)
    n_star = costmodel.crossover_bytes("tree", "ring", p_fixed, link)
    a_tree = costmodel.allreduce_time("tree", 0, p_fixed, link)
    if np.isfinite(n_star) and sizes[0] < n_star < sizes[-1]:
        ax2.axvline(n_star, color="0.5", ls=":", lw=1)
        ax2.text(n_star * 0.87, 5 * a_tree, f"ring beats tree\nabove {_bytes(n_star)}",
                 fontsize=8, color="0.3", ha="right", va="bottom")
    a_ring = costmodel.allreduce_time("ring", 0, p_fixed, link)
    ax2.text(sizes[0] * 2, a_ring * 1.25, f"naive and ring: {2 * (p_fixed - 1)} steps each",
             fontsize=8, color="0.3")
    ax2.text(sizes[0] * 2, 0.4 * link.alpha, "latency-bound:\ntime ≈ steps·alpha",
             fontsize=8, color="0.3", va="bottom")  # below every line: under each step count
    ax2.text(sizes[-1], 0.4 * link.alpha, "bandwidth-bound:\ntime ≈ bytes per link·beta",
             fontsize=8, color="0.3", ha="right", va="bottom")
    ax1.legend(fontsize=8)
    fig.suptitle(f"alpha-beta model, {link}", fontsize=11)
    return finish(fig, path)


def latency_takes_over(n_bytes, link):
    """The number of ranks beyond which the ring's latency term 2(p-1) alpha exceeds its
    bandwidth term 2 (p-1)/p n beta: p = n beta / alpha (notebook 05)."""
    return n_bytes * link.beta / link.alpha


def links_figure(n_bytes=100e6, links=None, path=None):
    """Predicted naive, tree and ring allreduce time against ranks (2 .. 4096) at ``n_bytes``,
    one panel per link of ``links`` (default ``costmodel.LINKS``), with the lower bound and
    the rank count where the ring's latency term takes over (notebook 05)."""
    links = list((links or costmodel.LINKS).values())
    ps = 2 ** np.arange(1, 13)
    fig = Figure(figsize=(3.3 * len(links), 3.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(links), sharex=True))
    for ax, link in zip(axes, links, strict=True):
        for name in ("naive", "tree", "ring"):
            ax.plot(ps, costmodel.allreduce_time(name, n_bytes, ps, link), "o-", ms=2.5,
                    color=_STYLE[name], label=name)
        ax.plot(ps, costmodel.lower_bound(n_bytes, ps, link), "k--", lw=1, label="lower bound")
        p_star = latency_takes_over(n_bytes, link)
        if ps[0] < p_star < ps[-1]:
            ax.axvline(p_star, color="0.5", ls=":", lw=1.2,
                       label="ring: latency term =\nbandwidth term")
            ax.text(p_star * 0.88, 0.03, f"p = {p_star:.0f}", transform=ax.get_xaxis_transform(),
                    fontsize=7, color="0.3", ha="right", va="bottom")
        ax.set(xscale="log", yscale="log", xlabel="number of ranks p",
               title=f"{link.name}\n{link.alpha * 1e6:g} us, {link.bandwidth / 1e9:g} GB/s")
        ax.set_xticks(ps[::2], [str(p) for p in ps[::2]], fontsize=7)
        ax.minorticks_off()
    axes[0].set_ylabel("seconds")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{_bytes(n_bytes)} allreduce, alpha-beta model, on each network", fontsize=11)
    return finish(fig, path)


def emulated_link_figure(rows, loopback_rows=(), path=None):
    """Measured allreduce times on an emulated link (rows of ``bench.allreduce_rank_bench`` with
    a link, several world sizes) as dots over the alpha-beta model's lines: time against the
    number of ranks at the largest size, time against size at the largest world size (with
    the same runs on bare loopback, the machine's own floor, dashed), and the ring's busbw
    against the link's bandwidth (notebook 05)."""
    from course_lib.runtime import netem
    link = netem.make_link(rows[0]["link"])
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    ns = sorted({r["world_size"] for r in rows})
    sizes = sorted({r["size"] for r in rows})
    big, p_max = sizes[-1], ns[-1]

    def pick(rs, **where):
        return [r for r in rs if all(r[k] == v for k, v in where.items())]

    fig = Figure(figsize=(13, 4.2), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    p_line, n_line = np.arange(2, p_max + 1), np.geomspace(sizes[0], big, 100)
    for name in algorithms:
        color = _STYLE.get(name, "C2")
        on_big = pick(rows, algorithm=name, size=big)
        ax1.plot([r["world_size"] for r in on_big], [r["time_us"] / 1e3 for r in on_big], "o",
                 color=color, label=f"{name} measured")
        ax1.plot(p_line, [netem.predict_allreduce(name, big, p, link) * 1e3 for p in p_line],
                 "-", color=color, lw=1, label=f"{name} model")
        at_p = pick(rows, algorithm=name, world_size=p_max)
        ax2.loglog([r["size"] for r in at_p], [r["time_us"] / 1e3 for r in at_p], "o",
                   color=color)
        ax2.loglog(n_line, [netem.predict_allreduce(name, n, p_max, link) * 1e3 for n in n_line],
                   "-", color=color, lw=1, label=name)
        bare = pick(loopback_rows, algorithm=name, world_size=p_max)
        if bare:
            ax2.loglog([r["size"] for r in bare], [r["time_us"] / 1e3 for r in bare], "--",
                       color=color, lw=1, alpha=0.6)
    for k, p in enumerate(ns):
        ring = pick(rows, algorithm="ring", world_size=p)
        ax3.semilogx([r["size"] for r in ring], [100 * r["busbw"] * 1e9 / link.bandwidth
                                                 for r in ring], "o-", color=f"C{k}",
                     label=f"ring, {p} ranks")
    ax3.axhline(100, color="k", ls="--", lw=1)
    ax1.set(xlabel="number of ranks", ylabel="ms", xticks=ns,
            title=f"{_bytes(big)} allreduce: time against ranks")
    ax2.set(xlabel="bytes per rank", ylabel="ms", title=f"{p_max} ranks: time against size")
    ax2.text(0.02, 0.98, "dots: measured\nlines: model" +
             ("\ndashed: bare loopback" if loopback_rows else ""), transform=ax2.transAxes,
             fontsize=7, va="top", color="0.3")
    ax3.set(xlabel="bytes per rank", ylabel="busbw, % of the link's bandwidth", ylim=(0, 110),
            title="the ring's bus bandwidth")
    ax1.legend(fontsize=7, ncol=2)
    ax2.legend(fontsize=7, loc="lower right")
    ax3.legend(fontsize=7)
    fig.suptitle(f"allreduce on an emulated link: {link}", fontsize=11)
    return finish(fig, path)


def save_all(out_dir):
    """Write notebook 05's figures as PNGs into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "05_ring_steps.png": lambda p: ring_steps_figure(4, path=p),
        "05_naive_and_tree.png": lambda p: naive_and_tree_figure(8, path=p),
        "05_cost_model.png": lambda p: cost_model_figure(path=p),
    }
    for name, draw in files.items():
        draw(out / name)
    return [str(out / name) for name in files]
