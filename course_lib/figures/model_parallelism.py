"""The figures of notebooks/09_model_parallelism.ipynb: pipeline schedules as Gantt charts
(simulated and measured), and the bubble and live activations against the micro-batches.

``save_all(out_dir)`` writes the simulated schedules into ``images/`` (pure computation);
the measured figures need a running cluster and are drawn in the notebook::

    from course_lib.figures import model_parallelism as figures
    figures.schedules_figure(num_stages=4, num_microbatches=8)
"""

from __future__ import annotations

import numpy as np

from course_lib import pipeline
from course_lib.figures import for_slides, least_points, save_figure, text_fits

COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "goldenrod"}
LIGHT = {"F": "#9ecae1", "B": "#fdbf86", "W": "#eedc9a"}  # a rank's second chunk of layers


def simulated_gantt(sim, ax, title=None, xmax=None, chunks=None):
    """One row per stage: its forwards (blue), backwards (orange) and weight gradients (gold,
    a split backward's W) with the micro-batch number where the box has room for it; white is
    the bubble. ``xmax``: the time axis's end
    (default: the step's end); ``chunks[s][i]``: the chunk of stage s's i-th box (interleaved
    1F1B, ZB-V), drawn light from chunk 1 on. Introduced in notebooks/09_model_parallelism.ipynb."""
    xmax = xmax or sim.makespan
    ax.set_xlim(0, xmax)
    # points per unit of time: the axes' width before the figure's layout widens it
    points = ax.get_position().width * ax.figure.get_figwidth() * 72 / xmax
    size = max(7.0, least_points(ax.figure))  # the numbers, readable when the figure is a slide
    for s, row in enumerate(sim.intervals):
        for i, (op, m, start, end) in enumerate(row):
            light = bool(chunks and chunks[s][i])
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8),
                           facecolors=(LIGHT if light else COLOURS)[op], edgecolors="white",
                           linewidth=0.5)
            if text_fits((end - start) * points, str(m), size):
                ax.text((start + end) / 2, s, str(m), ha="center", va="center", fontsize=size,
                        color="black" if light or op == "W" else "white")
    ax.set_yticks(range(len(sim.intervals)), [f"stage {s}" for s in range(len(sim.intervals))])
    ax.invert_yaxis()
    ax.set_xlabel("time (units of one forward)")
    ax.set_title(title or f"bubble {sim.bubble:.0%}, live at most {max(sim.peak_live)}",
                 fontsize=10)
    return ax


@for_slides
def schedules_figure(num_stages=4, num_microbatches=8, t_forward=1.0, t_backward=2.0,
                     virtual_stages=2):
    """Naive, GPipe, 1F1B and interleaved 1F1B (``virtual_stages`` chunks per rank) on N stages,
    simulated for the same batch: the naive schedule's one piece is M micro-batches' work. The
    naive run, about N times longer, has an axis of its own, with the end of the other three
    marked on it; those three share one axis. Time unit: one micro-batch's forward.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    N, M, v = num_stages, num_microbatches, virtual_stages
    sims = {}
    for schedule in ("naive", "gpipe", "1f1b", "interleaved"):
        k = M if schedule == "naive" else 1  # the naive schedule: the whole batch at once
        sims[schedule] = pipeline.simulate(schedule, N, M, k * t_forward, k * t_backward,
                                           virtual_stages=v)
    fig, axes = plt.subplots(len(sims), 1, figsize=(12, 6.75))  # a slide's shape
    for ax in axes[2:]:  # the naive run keeps an axis of its own
        ax.sharex(axes[1])
    streamed = max(sims[s].makespan for s in sims if s != "naive")
    unit = f"units of one micro-batch's forward; a backward takes {t_backward / t_forward:g}"
    for ax, (schedule, sim) in zip(axes, sims.items(), strict=True):
        if schedule == "naive":
            title = (f"naive (the whole batch at once): {sim.makespan:g} units, bubble "
                     f"{sim.bubble:.0%} = (N-1)/N; its own time axis, {sim.makespan / streamed:.1f}"
                     " times as long as the ones below")
            simulated_gantt(sim, ax, title)
            ax.set_xlabel(f"time ({unit})", fontsize=9)
            ends = {"interleaved": sims["interleaved"].makespan, "GPipe and 1F1B":
                    sims["gpipe"].makespan}
            for end in ends.values():
                ax.axvline(end, color="k", ls="--", lw=1)
            # on stage 0's row, empty between its forward and its backward
            ax.annotate(" ".join(f"{name} end{'s' if name == 'interleaved' else ''} at {end:g};"
                                 for name, end in ends.items()).rstrip(";") + " (dashed)",
                        (max(ends.values()), 0), xytext=(4, 0), textcoords="offset points",
                        fontsize=8, va="center", ha="left")
            continue
        chunks = None
        if schedule == "interleaved":
            chunks = [[step[2] for step in pipeline.interleaved_order(s, N, M, v)]
                      for s in range(N)]
            title = (f"interleaved 1F1B (M = {M}, {v} chunks per rank, light = 2nd chunk): "
                     f"{sim.makespan:g} units, bubble {sim.bubble:.0%} = (N-1)/({v}M+N-1)")
        else:
            title = (f"{'GPipe' if schedule == 'gpipe' else '1F1B'} (M = {M}): "
                     f"{sim.makespan:g} units, bubble {sim.bubble:.0%} = (N-1)/(M+N-1), at most "
                     f"{max(sim.peak_live)} micro-batches alive")
        simulated_gantt(sim, ax, title, xmax=streamed, chunks=chunks)
        ax.set_xlabel("")
        if ax is not axes[-1]:
            ax.tick_params(labelbottom=False)
    axes[-1].set_xlabel(f"time ({unit})", fontsize=9)
    fig.suptitle(f"N = {N} stages, one batch: blue forward, orange backward, number = "
                 "micro-batch, white = the bubble", fontsize=10)
    fig.tight_layout(h_pad=1.2)
    return fig


@for_slides
def zero_bubble_figure(num_stages=4, num_microbatches=8):
    """1F1B, ZB-H1 and ZB-V simulated on one time axis for the same work: a forward F, and a
    backward of 2F that the zero-bubble schedules split into B (the input's gradient) and W
    (the weights'), F each. ZB-V's second chunk of each rank is drawn light.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    N, M = num_stages, num_microbatches
    sims = {s: pipeline.simulate(s, N, M) for s in ("1f1b", "zb-h1", "zb-v")}
    fig, axes = plt.subplots(3, 1, figsize=(10, 6.6), sharex=True)
    end = max(sim.makespan for sim in sims.values())
    formulas = {"1f1b": "(N-1)/(M+N-1)", "zb-h1": "(N-1)/(3M+N-1)", "zb-v": "(N-1)/(6M+N-1)"}
    names = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "zb-v": "ZB-V (two chunks per rank, in a V)"}
    for ax, (schedule, sim) in zip(axes, sims.items(), strict=True):
        chunks = ([[c for _, _, c in pipeline.zb_v_order(s, N, M)] for s in range(N)]
                  if schedule == "zb-v" else None)
        held = "chunks (half a stage each)" if schedule == "zb-v" else "micro-batches"
        simulated_gantt(sim, ax, f"{names[schedule]}: {sim.makespan:g} units, bubble "
                        f"{sim.bubble:.0%} = {formulas[schedule]}, at most "
                        f"{max(sim.peak_live)} {held} alive", xmax=end, chunks=chunks)
        if schedule == "zb-v":  # a row is a rank: stages s and 2N-1-s
            ax.set_yticks(range(N), [f"rank {s}" for s in range(N)])
        ax.set_xlabel("")
    axes[-1].set_xlabel("time (units of one forward; B and W one each, 1F1B's backward two)",
                        fontsize=9)
    fig.suptitle(f"N = {N} stages, M = {M}: blue forward, orange backward (B), gold weight "
                 "gradient (W), white = the bubble", fontsize=10)
    fig.tight_layout(h_pad=1.2)
    return fig


@for_slides
def collective_matmul_figure(results):
    """Left: the share of the all-gather's time the collective matmul hid, measured (points,
    one per link) against the α-β model min(1, m/c) over c/m, a block's message time over its
    product's. Right: the layer's forward with the gather apart and hidden, per link.
    ``results``: ``{link text: testing.tensor_parallel.hidden_fraction(...)}``.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ratios = [r["message"] / r["product"] for r in results.values()]
    xs = np.geomspace(min(0.1, min(ratios) / 2), max(10, max(ratios) * 2), 200)
    left.plot(xs, np.minimum(1, 1 / xs), color="k", label="model: min(1, m/c)")
    for k, (link, r) in enumerate(results.items()):
        left.plot(r["message"] / r["product"], r["measured"], "o", color=f"C{k}", label=link)
    left.set_xscale("log")
    left.set_xlabel("c / m: one block's message time over its product's")
    left.set_ylabel("share of the all-gather hidden")
    left.set_ylim(0, 1.1)
    left.legend(fontsize=8)
    left.set_title("hidden where a block's product covers its message", fontsize=10)
    names = list(results)
    at = np.arange(len(names))
    for k, (key, label) in enumerate((("apart", "all-gather, then matmul"),
                                      ("hidden", "collective matmul"))):
        right.bar(at + (k - 0.5) * 0.38, [1e3 * results[n][key] for n in names], 0.38,
                  label=label)
    right.set_xticks(at, names, fontsize=8)
    right.set_ylabel("forward of the layer (ms)")
    right.legend(fontsize=8)
    right.set_title("the same layer, the same messages", fontsize=10)
    fig.tight_layout()
    return fig


@for_slides
def measured_vs_simulated(reports, schedule, num_microbatches, t_forward, t_backward):
    """The measured Gantt chart of one step (every stage's Timeline) over the simulated one.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt

    from course_lib.runtime import timeline
    reports = [r for r in reports if r is not None]
    N = len(reports)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 2 + 1.3 * N))
    sim = pipeline.simulate(schedule, N, num_microbatches, t_forward * 1e3, t_backward * 1e3)
    start = min(r["start"] for r in reports)
    timeline.gantt([r["timeline"] for r in reports], ax=bottom, since=start,
                   title=f"measured on this machine: {max(r['seconds'] for r in reports) * 1e3:.0f}"
                         " ms")
    right = max(sim.makespan, bottom.get_xlim()[1])  # one time axis for both
    simulated_gantt(sim, top, f"simulated {schedule}, N = {N}, M = {num_microbatches}: "
                              f"{sim.makespan:.0f} ms, bubble {sim.bubble:.0%}", xmax=right)
    top.set_xlabel("time (ms)")
    bottom.set_xlim(0, right)
    fig.tight_layout()
    return fig


@for_slides
def bubble_figure(rows):
    """Measured bubble against M (points) over (N-1)/(M+N-1) (lines), and the peak live
    micro-batches of GPipe and 1F1B. ``rows``: of ``bench.pipeline.measure``.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    markers = {"gpipe": "o", "1f1b": "x", "naive": "s"}
    for k, N in enumerate(sorted({r["stages"] for r in rows})):
        colour = f"C{k}"
        ms = np.geomspace(1, max(r["microbatches"] for r in rows), 50)
        left.plot(ms, [pipeline.bubble_fraction(N, m) for m in ms], color=colour,
                  label=f"(N-1)/(M+N-1), N = {N}")
        for schedule in dict.fromkeys(r["schedule"] for r in rows):
            mine = [r for r in rows if r["stages"] == N and r["schedule"] == schedule]
            left.plot([r["microbatches"] for r in mine], [r["bubble"] for r in mine],
                      markers[schedule], color=colour, label=f"measured {schedule}, N = {N}")
            right.plot([r["microbatches"] for r in mine], [r["peak_live"] for r in mine],
                       markers[schedule] + "-", color=colour, label=f"{schedule}, N = {N}")
    left.set_xscale("log", base=2)
    left.set_xlabel("micro-batches M")
    left.set_ylabel("bubble (idle share of a stage)")
    left.legend(fontsize="small")
    left.set_title("the bubble shrinks as M grows", fontsize=10)
    right.set_xscale("log", base=2)
    right.set_xlabel("micro-batches M")
    right.set_ylabel("micro-batches alive at once (peak)")
    right.set_title("GPipe keeps all M alive, 1F1B at most N", fontsize=10)
    right.legend(fontsize="small")
    fig.tight_layout()
    return fig


@for_slides
def tp_vs_pp_figure(results):
    """Step time of tensor vs pipeline parallelism for each link. ``results``: ``{link label:
    {"tensor": s, "pipeline": s}}`` (the slowest rank's, from
    ``testing.pipeline.tp_and_pp_on_link``). Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = list(results)
    xs = np.arange(len(labels))
    for k, style in enumerate(("tensor", "pipeline")):
        ax.bar(xs + (k - 0.5) * 0.38, [1e3 * results[lab][style] for lab in labels], 0.38,
               label=f"{style} parallel", color=f"C{k}")
    ax.set_xticks(xs, labels)
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_ylabel("one training step (ms)")
    ax.set_title("the same model, the same ranks, the same link: how each style pays", fontsize=10)
    ax.legend()
    fig.tight_layout()
    return fig


def save_all(out_dir):
    """Write the simulated schedules into ``out_dir``; returns the paths.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    return [save_figure(schedules_figure(), out_dir, "09_pipeline_schedules.png"),
            save_figure(zero_bubble_figure(), out_dir, "09_zero_bubble.png")]
