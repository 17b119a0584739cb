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
from course_lib.figures import save_figure

COLOURS = {"F": "tab:blue", "B": "tab:orange"}


def simulated_gantt(sim, ax, title=None):
    """One row per stage: its forwards (blue) and backwards (orange) with the micro-batch
    number; white is the bubble. Introduced in notebooks/09_model_parallelism.ipynb."""
    for s, row in enumerate(sim.intervals):
        for op, m, start, end in row:
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=COLOURS[op],
                           edgecolors="white", linewidth=0.5)
            ax.text((start + end) / 2, s, str(m), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(len(sim.intervals)), [f"stage {s}" for s in range(len(sim.intervals))])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time (units of one forward)")
    ax.set_title(title or f"bubble {sim.bubble:.0%}, live at most {max(sim.peak_live)}",
                 fontsize=10)
    return ax


def schedules_figure(num_stages=4, num_microbatches=8, t_forward=1.0, t_backward=2.0):
    """Naive, GPipe, 1F1B and interleaved 1F1B (2 chunks per rank) on N stages, simulated one
    under the other, for the same batch:
    the naive schedule's one piece is M micro-batches' work. Time unit: one micro-batch's
    forward. Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    schedules = [*pipeline.SCHEDULES, "interleaved"]
    fig, axes = plt.subplots(len(schedules), 1, figsize=(10, 8.5), sharex=True)
    longest = 0.0
    for ax, schedule in zip(axes, schedules, strict=True):
        k = num_microbatches if schedule == "naive" else 1  # the whole batch at once
        sim = pipeline.simulate(schedule, num_stages, num_microbatches, k * t_forward,
                                k * t_backward, virtual_stages=2)
        M = 1 if schedule == "naive" else num_microbatches
        if schedule == "interleaved":
            title = (f"interleaved 1F1B, 2 chunks per rank (M = {M}): {sim.makespan:g} units, "
                     f"bubble {sim.bubble:.0%} = (N-1)/(2M+N-1), each box half a stage")
        else:
            title = (f"{schedule} (M = {M}): {sim.makespan:g} units, bubble {sim.bubble:.0%} = "
                     f"(N-1)/(M+N-1), at most {max(sim.peak_live)} micro-batch(es) alive")
        simulated_gantt(sim, ax, title)
        ax.set_xlabel("")
        longest = max(longest, sim.makespan)
    axes[-1].set_xlim(0, longest)
    axes[-1].set_xlabel("time (units of one micro-batch's forward; backward takes "
                        f"{t_backward / t_forward:g})")
    fig.suptitle(f"N = {num_stages} stages, one batch: blue forward, orange backward, number = "
                 "micro-batch, white = the bubble", fontsize=10)
    fig.tight_layout()
    return fig


def measured_vs_simulated(reports, schedule, num_microbatches, t_forward, t_backward):
    """The measured Gantt chart of one step (every stage's Timeline) over the simulated one.
    Introduced in notebooks/09_model_parallelism.ipynb."""
    import matplotlib.pyplot as plt

    from course_lib import timeline
    reports = [r for r in reports if r is not None]
    N = len(reports)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 2 + 1.3 * N))
    sim = pipeline.simulate(schedule, N, num_microbatches, t_forward * 1e3, t_backward * 1e3)
    simulated_gantt(sim, top, f"simulated {schedule}, N = {N}, M = {num_microbatches}: "
                              f"{sim.makespan:.0f} ms, bubble {sim.bubble:.0%}")
    top.set_xlabel("time (ms)")
    start = min(r["start"] for r in reports)
    timeline.gantt([r["timeline"] for r in reports], ax=bottom, since=start,
                   title=f"measured on this machine: {max(r['seconds'] for r in reports) * 1e3:.0f}"
                         " ms")
    right = max(top.get_xlim()[1], bottom.get_xlim()[1])
    top.set_xlim(0, right)
    bottom.set_xlim(0, right)
    fig.tight_layout()
    return fig


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
    return [save_figure(schedules_figure(), out_dir, "09_pipeline_schedules.png")]
