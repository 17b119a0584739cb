"""The figures of notebooks/11_fault_tolerance.ipynb: the loss of a run that was killed and
resumed, against the uninterrupted run, with the steps computed twice shaded; the same run's
two logs (JSONL, and TensorBoard's, where each step shows once); the time to finish against the
checkpoint interval, simulated and measured; a parameter server killed and restarted.

    from course_lib.figures import fault_tolerance as figures
    figures.loss_with_restarts(run.log, clean.log)
"""

from __future__ import annotations

from course_lib.figures import for_slides, save_figure


@for_slides
def loss_with_restarts(log, reference_log=None, ax=None):
    """Loss against global step for each attempt of a supervised run (from the chief's log),
    a vertical line at each failure, the recomputed steps shaded, over ``reference_log`` (the
    uninterrupted run). Introduced in notebooks/11_fault_tolerance.ipynb."""
    import matplotlib.pyplot as plt
    if ax is None:
        ax = plt.subplots(figsize=(7, 3.5))[1]
    if reference_log:
        ref = [r for r in reference_log if r["event"] == "step"]
        ax.plot([r["step"] for r in ref], [r["loss"] for r in ref], color="0.6", lw=4,
                label="uninterrupted run")
    attempts = sorted({r["attempt"] for r in log})
    last_step = 0
    for a in attempts:
        steps = [r for r in log if r["attempt"] == a and r["event"] == "step"]
        start = next(r for r in log if r["attempt"] == a and r["event"] == "start")
        if a > 0:
            ax.axvline(last_step + 0.5, color="C3", ls="--", lw=1)
            ax.axvspan(start["step"] + 0.5, last_step + 0.5, color="C3", alpha=0.15,
                       label="computed twice" if a == 1 else None)
            ax.annotate(f"killed; resumed from step {start['step']}", (last_step + 0.5, 0.95),
                        xycoords=("data", "axes fraction"), fontsize=8, color="C3",
                        ha="right", va="top", rotation=90)
        if steps:
            ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], "o-", ms=3,
                    color=f"C{a}", label=f"attempt {a}")
            last_step = steps[-1]["step"]
    ax.set_xlabel("global step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize="small")
    return ax


@for_slides
def checkpoint_interval(mtbf=3.0, cost=1 / 60, restart=5 / 60, work=200.0, intervals=None,
                        hours=None, ax=None):
    """Simulated hours to finish ``work`` hours of work against the checkpoint interval, with
    Young's sqrt(2CM) marked; ``intervals`` (hours) and their simulated ``hours``, if already
    computed. Introduced in notebooks/11_fault_tolerance.ipynb."""
    import matplotlib.pyplot as plt
    import numpy as np

    from course_lib.checkpoint import time_to_finish, young_interval
    if ax is None:
        ax = plt.subplots(figsize=(7, 3.5))[1]
    if intervals is None:
        intervals = np.geomspace(0.02, 3, 16)
    if hours is None:
        hours = [time_to_finish(t, work, mtbf, cost, restart) for t in intervals]
    intervals = np.asarray(intervals)
    young = young_interval(cost, mtbf)
    ax.semilogx(intervals * 60, hours, "o-", label="simulated")
    ax.axvline(young * 60, color="k", ls="--", lw=1,
               label=f"Young: sqrt(2CM) = {young * 60:.0f} min")
    plain_log_ticks(ax, [m for m in (1, 2, 5, 10, 20, 60, 180) if m <= intervals[-1] * 60])
    ax.set(xlabel="checkpoint interval (minutes)", ylabel=f"hours to finish {work:g} h of work",
           title=f"MTBF {mtbf:g} h, checkpoint {cost * 60:g} min, restart {restart * 60:g} min")
    ax.title.set_fontsize(10)
    ax.legend()
    return ax


def plain_log_ticks(ax, ticks):
    """Label a logarithmic x axis at ``ticks`` only, as plain numbers (no minor labels, which
    overlap on a short range). Introduced in notebooks/11_fault_tolerance.ipynb."""
    from matplotlib.ticker import NullFormatter
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())


def save_all(out_dir):
    """Write the checkpoint-interval figure into ``out_dir``; returns the paths.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    return [save_figure(checkpoint_interval().figure, out_dir, "11_checkpoint_interval.png")]


@for_slides
def measured_intervals(rows, young_steps, ax=None):
    """Measured time to finish against the checkpoint interval K (rows of
    ``bench.checkpoint.interval_rows``), with each run's failures and steps redone under its K,
    the first-order model beside it and Young's interval marked. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    import matplotlib.pyplot as plt
    if ax is None:
        ax = plt.subplots(figsize=(7, 3.5))[1]
    ks = [r["interval"] for r in rows]
    ax.semilogx(ks, [r["seconds"] for r in rows], "o-", label="measured")
    ax.semilogx(ks, [r["model_s"] for r in rows], "--", color="0.5",
                label="1 + C/(Kt) + (Kt/2 + R)/M")
    ax.axhline(rows[0]["ideal_s"], color="k", lw=0.8)
    ax.text(ks[0], rows[0]["ideal_s"], "  the work alone", va="bottom", fontsize=8)
    ax.axvline(young_steps, color="C3", ls=":", label=f"Young: {young_steps:.0f} steps")
    plain_log_ticks(ax, ks)
    xlabel = "checkpoint every K steps"
    if all("failures" in r for r in rows):  # how the failures fell: what moves a point
        ax.set_xticks(ks, [f"{r['interval']}\n{r['failures']:.3g} failures\n{r['redone']:.3g} "
                           "steps redone" for r in rows], fontsize=8)
        xlabel += " (under it: that run's failures and steps redone)"
    ax.set(xlabel=xlabel, ylabel="seconds to finish")
    ax.legend(fontsize="small")
    return ax


@for_slides
def tensorboard_and_log(scalars, log, axes=None):
    """The chief's two logs of one supervised run: left, the loss per step from TensorBoard's
    event files (``scalars``: ``[(step, value)]`` of ``tensorboard_view.read_scalars``) under
    the JSONL records of each attempt (``log``); right, how many times each step appears in
    each. Introduced in notebooks/11_fault_tolerance.ipynb."""
    from collections import Counter

    import matplotlib.pyplot as plt
    if axes is None:
        axes = plt.subplots(1, 2, figsize=(11, 3.5), width_ratios=[3, 2])[1]
    left, right = axes
    records = [r for r in log if r["event"] == "step"]
    left.plot([s for s, _ in scalars], [v for _, v in scalars], color="0.6", lw=4,
              label="TensorBoard's event files")
    for a in sorted({r["attempt"] for r in records}):
        mine = [r for r in records if r["attempt"] == a]
        left.plot([r["step"] for r in mine], [r["loss"] for r in mine], "o",
                  ms=3 + 3 * a, mfc="none" if a else f"C{a}", color=f"C{a}",
                  label=f"JSONL log, attempt {a}")
    left.set(xlabel="global step", ylabel="training loss")
    left.set_title("the loss per step, from each log", fontsize=10)
    left.legend(fontsize="small")
    in_log, in_board = Counter(r["step"] for r in records), Counter(s for s, _ in scalars)
    steps = range(1, max([*in_log, *in_board]) + 1)
    right.bar(steps, [in_log[s] for s in steps], 0.8, color="C3", alpha=0.35,
              label=f"JSONL log: {len(records)} records")
    right.step(steps, [in_board[s] for s in steps], where="mid", color="k",
               label=f"TensorBoard: {len(scalars)} points")
    right.set(xlabel="global step", ylabel="times logged", yticks=range(max(in_log.values()) + 1))
    right.set_title("each step once in TensorBoard (purge_step)", fontsize=10)
    right.legend(fontsize="small", loc="lower right")
    left.figure.tight_layout()
    return axes


@for_slides
def server_restart(result, axes=None):
    """A parameter server killed and restarted (``ps.train(..., server_restarts=1)``): the
    server's version in each reply to each worker, and each worker's batch loss, against time;
    the outage and the version restored marked.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    import matplotlib.pyplot as plt
    import numpy as np
    if axes is None:
        axes = plt.subplots(1, 2, figsize=(10, 3.5))[1]
    server = result.servers[0]
    t0 = min(w["t0"] for w in result.workers)
    for i, w in enumerate(result.workers):
        t = w["t0"] - t0 + np.asarray(w["times"])
        axes[0].plot(t, w["versions"], ".", ms=3, color=f"C{i}", label=f"worker rank {w['worker']}")
        loss = np.asarray(w["loss_sums"]) / np.maximum(w["counts"], 1)
        axes[1].plot(t, loss, ".", ms=3, color=f"C{i}", label=f"worker rank {w['worker']}")
    for i, r in enumerate(server["restarts"]):
        last = i == len(server["restarts"]) - 1
        down = (r["time"] - t0, (server["ready"] if last else r["time"]) - t0)
        for ax in axes:
            ax.axvspan(*down, color="C3", alpha=0.15, label="server down" if i == 0 else None)
        axes[0].annotate(f" killed;\n back {down[1] - down[0]:.1f} s later" if last else "",
                         (down[0], 0.95), xycoords=("data", "axes fraction"), fontsize=8,
                         color="C3", va="top")
    if server["restored_from"] is not None:
        axes[0].axhline(server["restored_from"], color="0.5", ls=":", lw=1,
                        label=f"restored: version {server['restored_from']}")
    axes[0].set(xlabel="seconds", ylabel="server version in the reply")
    axes[1].set(xlabel="seconds", ylabel="batch loss", yscale="log")
    axes[0].legend(fontsize="small", loc="lower right")
    axes[1].legend(fontsize="small", loc="upper right")
    return axes


@for_slides
def resharding(shape, saved_boxes, loaded, name, saved_as="saved", loaded_as="loaded",
               axes=None):
    """One tensor of shape ``shape`` twice: as the writers saved it (``saved_boxes``, one
    (offsets, sizes) box per saving rank, coloured by rank), and as another layout loads it
    (``loaded``: rank -> its box), each new rank's box outlined and labelled with the saved
    files it reads (those whose box it overlaps); ``saved_as`` and ``loaded_as`` name the two
    layouts in the titles. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from course_lib.checkpoint import reshard_reads
    if axes is None:
        axes = plt.subplots(1, 2, figsize=(9, 2.8), sharey=True)[1]
    for ax in axes:
        for index, ((r0, c0), (rows, cols)) in enumerate(saved_boxes):
            ax.add_patch(Rectangle((c0, r0), cols, rows, color=f"C{index}", alpha=0.45, lw=0))
        ax.set(xlim=(0, shape[1]), ylim=(shape[0], 0), xlabel="column")
    for index, ((r0, c0), (rows, cols)) in enumerate(saved_boxes):
        axes[0].text(c0 + cols / 2, r0 + rows / 2, f"saved by rank {index}", ha="center",
                     va="center", fontsize=8)
    for rank, box in sorted(loaded.items()):
        (r0, c0), (rows, cols) = box
        axes[1].add_patch(Rectangle((c0, r0), cols, rows, fill=False, lw=2, ec="k"))
        files = [read["chunk"] for read in reshard_reads(saved_boxes, box)]
        axes[1].text(c0 + cols / 2, r0 + rows / 2,
                     f"rank {rank}\nreads {', '.join(map(str, files))}", ha="center",
                     va="center", fontsize=8)
    axes[0].set_ylabel("row")
    axes[0].set_title(f"{name} {saved_as}: {len(saved_boxes)} files", fontsize=10)
    axes[1].set_title(f"{loaded_as}: each rank's block outlined", fontsize=10)
    return axes


@for_slides
def async_save(results, axes=None):
    """The time a save costs the run, as bars: ``dcp.save`` then the next steps, against
    ``async_save`` (the copy, the steps beside the write, any wait left for it), one panel per
    storage. ``results``: label -> the dict of ``testing.checkpoint.async_save_overlap``.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    import matplotlib.pyplot as plt
    if axes is None:
        axes = plt.subplots(len(results), 1, figsize=(7, 1.1 + 1.0 * len(results)),
                            sharex=True, squeeze=False)[1][:, 0]
    for ax, (label, o) in zip(axes, results.items(), strict=False):
        ms = {k: 1000 * v for k, v in o.items()}
        rows = [("save, then the steps", [("save", ms["save"], "C3"),
                                          ("steps", ms["plain"], "C0")]),
                ("async_save", [("copy", ms["blocked"], "C1"), ("steps beside the write",
                                                             ms["during"], "C0"),
                                ("wait", ms["wait"], "C3")])]
        for y, (_, parts) in enumerate(rows):
            left = 0.0
            for name, width, colour in parts:
                ax.barh(y, width, left=left, color=colour, alpha=0.7 if name != "steps" else 0.5)
                if width > 40:
                    ax.text(left + width / 2, y, name, ha="center", va="center", fontsize=8)
                left += width
        ax.set_yticks([0, 1], [name for name, _ in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{label}: {ms['hidden']:.0f} of the save's {ms['save']:.0f} ms hidden",
                     fontsize=9)
    axes[-1].set_xlabel("ms from the save's start")
    axes[0].figure.tight_layout()
    return axes
