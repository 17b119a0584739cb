"""Figures of notebook 06 (data-parallel SGD): gradient buckets, and the synchronous step.

Introduced in notebooks/06_data_parallel_sgd.ipynb. ``bucket_figure`` draws a model's
parameters in the order backward produces their gradients (last layer first), each as wide as
its bytes, coloured by the bucket :func:`course_lib.ddp.assign_buckets` puts it in;
``sync_step_figure`` draws one step of synchronous data parallelism on N ranks. Every function
returns a matplotlib ``Figure`` (built without pyplot) and saves it when given ``path``;
``save_all(out_dir)`` writes the PNGs::

    python -c "from course_lib.figures import data_parallel_sgd as f; f.save_all('images')"
"""

from __future__ import annotations

from pathlib import Path

import matplotlib as mpl
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from course_lib.figures import finish


def bucket_figure(names, sizes, cap_bytes, title=None, path=None):
    """Parameters in reverse order (backward's order), width = bytes, colour = bucket.

    ``names`` and ``sizes`` (bytes) are in model order, as ``model.named_parameters()`` gives
    them. Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    from course_lib.ddp import assign_buckets
    if len(names) != len(sizes) or not sizes:
        raise ValueError(f"need one size per name, got {len(names)} names, {len(sizes)} sizes")
    buckets = assign_buckets(list(sizes), cap_bytes)
    total = float(sum(sizes))
    fig = Figure(figsize=(10, 2.6))
    ax = fig.add_subplot()
    colours = mpl.colormaps["tab10"]
    x = 0.0
    for b, indices in enumerate(buckets):
        start = x
        for i in indices:
            w = sizes[i] / total
            ax.add_patch(Rectangle((x, 0.2), w, 0.6, facecolor=colours(b % 10), alpha=0.75,
                                   edgecolor="white", linewidth=1.0))
            if w > 0.06:
                ax.text(x + w / 2, 0.5, names[i], ha="center", va="center", fontsize=8)
            x += w
        bucket_bytes = sum(sizes[i] for i in indices)
        ax.annotate("", (start, 0.1), (x, 0.1),
                    arrowprops=dict(arrowstyle="<->", color=colours(b % 10)))
        ax.text((start + x) / 2, -0.05, f"bucket {b}\n{bucket_bytes / 2**10:.0f} KiB",
                ha="center", va="top", fontsize=8, color=colours(b % 10))
    ax.set(xlim=(0, 1), ylim=(-0.45, 1.0), yticks=[],
           xlabel="share of the gradient bytes, in the order backward produces them "
                  "(last layer first) →")
    ax.set_xticks([])
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"{len(sizes)} tensors, {total / 2**10:.0f} KiB, cap "
                          f"{cap_bytes / 2**10:g} KiB: {len(buckets)} buckets")
    return finish(fig, path)


def bucket_sweep_figure(caps_mb, series, compute_ms, comm_ms, title="", path=None):
    """Step time against the bucket cap: ``series`` maps a label to (step ms per cap, buckets
    per cap); lines at compute alone and at compute plus one allreduce of every gradient.
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    fig = Figure(figsize=(7.5, 4), layout="constrained")
    ax = fig.add_subplot()
    for label, (step_ms, buckets) in series.items():
        ax.semilogx(caps_mb, step_ms, "o-", label=f"{label} (buckets: {list(buckets)})")
    ax.axhline(compute_ms, color="0.5", ls="--", label="compute alone")
    ax.axhline(compute_ms + comm_ms, color="k", ls=":",
               label="compute + one allreduce of every gradient")
    ax.set(xlabel="bucket cap (MiB)", ylabel="step time (ms), median", ylim=(0, None),
           title=title)
    ax.legend(fontsize=8)
    return finish(fig, path)


def _sub(r):
    """The rank as a subscript: 0 -> '₀'."""
    return "".join("₀₁₂₃₄₅₆₇₈₉"[int(d)] for d in str(r))


def sync_step_figure(world_size=3, path=None):
    """One step of synchronous data parallelism: broadcast once, then on every rank a local
    gradient, one allreduce (average) across all ranks, the same update.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    fig = Figure(figsize=(10, 1.3 + 0.8 * world_size))
    ax = fig.add_subplot()
    phases = [("same start\n(broadcast\nfrom rank 0)", "tab:brown"),
              ("forward +\nbackward on this\nrank's B/N samples", "tab:orange"),
              ("allreduce:\nsum of the\nN gradients", "tab:purple"),
              ("divide by N:\nthe global-\nbatch gradient", "tab:red"),
              ("update\nθ ← θ − η ĝ", "tab:green")]
    width, gap = 1.6, 0.35
    for r in range(world_size):
        y = world_size - 1 - r
        ax.text(-0.2, y + 0.35, f"rank {r}", ha="right", va="center", fontsize=9)
        for k, (label, colour) in enumerate(phases):
            if k == 2:
                continue
            ax.add_patch(Rectangle((k * (width + gap), y), width, 0.7, facecolor=colour,
                                   alpha=0.35, edgecolor=colour))
            inside = {0: "θ", 1: f"g{_sub(r)} = ∇J(θ; S{_sub(r)})", 3: "ĝ = Σ / N",
                      4: "θ − η ĝ"}[k]  # what the rank holds after this phase
            ax.text(k * (width + gap) + width / 2, y + 0.35, inside, ha="center", va="center",
                    fontsize=9)
            if r == 0:
                ax.text(k * (width + gap) + width / 2, world_size - 0.05, label, ha="center",
                        va="bottom", fontsize=8)
    x = 2 * (width + gap)
    ax.add_patch(Rectangle((x, 0), width, world_size - 0.3, facecolor="tab:purple", alpha=0.35,
                           edgecolor="tab:purple"))
    ax.text(x + width / 2, world_size - 0.05, phases[2][0], ha="center", va="bottom",
            fontsize=8)
    ax.text(x + width / 2, (world_size - 0.3) / 2,
            "Σ = " + " + ".join(f"g{_sub(r)}" for r in range(world_size)) + "\non every rank",
            ha="center", va="center", fontsize=9)
    for r in range(world_size):
        y = world_size - 1 - r + 0.35
        for k in range(4):
            ax.add_patch(FancyArrowPatch((k * (width + gap) + width, y),
                                         ((k + 1) * (width + gap), y), arrowstyle="->",
                                         mutation_scale=10, color="0.4"))
    ax.set(xlim=(-1.0, 5 * (width + gap)), ylim=(-0.2, world_size + 0.9))
    ax.axis("off")
    ax.set_title("one synchronous step: every rank ends with the same parameters")
    return finish(fig, path)


def last_step_figure(timelines, title="", path=None):
    """The last recorded step of each strategy, every rank's compute and communication rows, on
    one time axis: ``timelines`` maps a strategy name to its ranks' Timelines (``record=True``).
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    from course_lib.runtime import timeline
    fig = Figure(figsize=(10, 2.2 + 1.6 * len(timelines)), layout="constrained")
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
    longest = 0.0
    for ax, (strategy, tls) in zip(axes, timelines.items(), strict=True):
        last_step = min(tl.of("forward")[-1].start for tl in tls)
        longest = max(longest, max(e.end for tl in tls for e in tl.events) - last_step)
        timeline.gantt(tls, ax=ax, since=last_step, title=f"{strategy}: the last step on every "
                       "rank")
    axes[0].set_xlim(0, longest * 1e3 * 1.02)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path)


def save_all(out_dir):
    """Write notebook 06's figures as PNGs into ``out_dir``; returns the paths."""
    from course_lib import models
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = models.mlp(64, [256, 256], 10)
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    files = {"06_buckets.png": lambda p: bucket_figure(names, sizes, 128 * 2**10, path=p),
             "06_sync_step.png": lambda p: sync_step_figure(3, path=p)}
    for name, draw in files.items():
        draw(out / name)
    return [out / name for name in files]
