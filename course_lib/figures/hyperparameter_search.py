"""The figures of notebooks/13_hyperparameter_search.ipynb: which engine ran which trial when
(a Gantt chart per search), the best accuracy so far against time and epochs, the speed-up
against the number of engines, and a plot that follows a search while it runs.

    from course_lib.figures import hyperparameter_search as figures
    figures.gantt([sh, asha])
"""

from __future__ import annotations

import time

from course_lib.figures import for_slides, least_points, raise_small_text, save_figure, text_fits


@for_slides
def gantt(results, axes=None):
    """One row per engine, one bar per job (coloured by rung, its configuration id written in
    it when there is room), white where the engine sat idle; one panel per search result.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import matplotlib.pyplot as plt
    if axes is None:
        fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.2 + 0.9 * len(results) * (
            1 + len(results[0].ranks) / 6)), sharex=True, squeeze=False)
        axes = axes[:, 0]
    fig = axes[0].figure
    size = max(6.0, least_points(fig))  # the ids, readable when the figure is a slide
    span = max(r.elapsed for r in results)  # the shared time axis
    for ax, result in zip(axes, results, strict=True):
        points = ax.get_position().width * fig.get_figwidth() * 72 / span  # per second
        rungs = max(j.rung for j in result.jobs) + 1
        for job in result.jobs:
            if job.rank is None:
                continue
            row = result.ranks.index(job.rank) if job.rank in result.ranks else job.rank
            left, width = job.start - result.started, job.end - job.start
            ax.barh(row, width, left=left, height=0.8, color=f"C{job.rung}",
                    edgecolor="white", linewidth=0.5)
            if text_fits(width * points, str(job.config_id), size, margin=4):
                ax.text(left + width / 2, row, str(job.config_id), ha="center", va="center",
                        fontsize=size, color="white")
        ax.set_yticks(range(len(result.ranks)), [f"rank {r}" for r in result.ranks],
                      fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{result.name}: busy {result.busy_fraction():.0%} of "
                     f"{len(result.ranks)} engines x {result.elapsed:.2f} s, best accuracy "
                     f"{result.best[0]:.3f}", fontsize=9)
        for rung in range(rungs):
            ax.barh(0, 0, color=f"C{rung}", label=f"rung {rung}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xlabel("seconds")
    return axes


@for_slides
def best_so_far(results, x="seconds", ax=None):
    """Best validation accuracy so far against ``x`` ("seconds" or "epochs" spent), one line
    per search (a list of results for one search over seeds: its median, and the range).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import matplotlib.pyplot as plt
    import numpy as np
    if ax is None:
        ax = plt.subplots(figsize=(6, 3.5))[1]
    column = {"seconds": 0, "epochs": 1}[x]
    for i, runs in enumerate(results):
        runs = runs if isinstance(runs, (list, tuple)) else [runs]
        curves = [r.best_so_far() for r in runs]
        end = max(c[-1, column] for c in curves)
        grid = np.linspace(0, end, 200)
        steps = np.array([np.interp(grid, c[:, column], c[:, 2], left=np.nan) for c in curves])
        grid, steps = grid[~np.isnan(steps).all(axis=0)], steps[:, ~np.isnan(steps).all(axis=0)]
        label = runs[0].name + (f" ({len(runs)} seeds)" if len(runs) > 1 else "")
        ax.plot(grid, np.nanmedian(steps, axis=0), color=f"C{i}", label=label)
        if len(runs) > 1:
            ax.fill_between(grid, np.nanmin(steps, axis=0), np.nanmax(steps, axis=0),
                            color=f"C{i}", alpha=0.15)
    ax.set(xlabel="seconds" if x == "seconds" else "epochs spent",
           ylabel="best validation accuracy so far")
    ax.legend(fontsize="small")
    return ax


def time_to_reach(result, target):
    """``(seconds, epochs spent)`` when ``result``'s best accuracy so far first reached
    ``target``, or ``None`` if it never did: where its curve of :func:`best_so_far` crosses
    ``target``. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    curve = result.best_so_far()
    reached = curve[curve[:, 2] >= target] if len(curve) else curve
    return (float(reached[0, 0]), int(reached[0, 1])) if len(reached) else None


@for_slides
def speedup(rows, ax=None):
    """Speed-up of each search against the number of engines (rows: dict(search, engines,
    seconds)), with the ideal line. Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import matplotlib.pyplot as plt
    if ax is None:
        ax = plt.subplots(figsize=(5, 3.5))[1]
    searches = list(dict.fromkeys(r["search"] for r in rows))
    engines = sorted({r["engines"] for r in rows})
    for i, name in enumerate(searches):
        mine = {r["engines"]: r["seconds"] for r in rows if r["search"] == name}
        base = mine[min(mine)] * min(mine)
        ax.plot(sorted(mine), [base / mine[n] for n in sorted(mine)], "o-", color=f"C{i}",
                label=name)
    ax.plot(engines, engines, "k--", lw=1, label="ideal")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.minorticks_off()
    ax.set(xlabel="engines", ylabel="speed-up")
    ax.set_xticks(engines, [str(n) for n in engines])
    ax.set_yticks(engines, [str(n) for n in engines])
    ax.legend(fontsize="small")
    return ax


class LivePlot:
    """A figure that follows a running search: pass it as ``on_result=`` and it redraws the
    best accuracy so far and the jobs finished, at most every ``every`` s, in place (in a
    notebook; elsewhere it only keeps count). Introduced in
    notebooks/13_hyperparameter_search.ipynb."""

    def __init__(self, title="search", every=0.25):
        self.title, self.every, self.last, self.handle = title, every, 0.0, None
        self.started, self.updates = time.time(), 0

    def __call__(self, jobs):
        now = time.time()
        if now - self.last < self.every:
            return
        self.last = now
        self.draw(jobs)

    def draw(self, jobs):
        """Draw ``jobs`` (the search's jobs so far), in place of the last drawing in a
        notebook; returns the figure, closed."""
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7.5, 2.8))
        ends = sorted(jobs, key=lambda j: j.end)
        best, ys = 0.0, []
        for job in ends:
            best = max(best, job.acc)
            ys.append(best)
        ax.step([j.end - self.started for j in ends], ys, where="post", label="best so far")
        ax.plot([j.end - self.started for j in ends], [j.acc for j in ends], ".", ms=4,
                color="0.5", label="each job, when it finished")
        ax.set_xlim(left=0)  # from the search's start: the wait for the first results shows
        ax.set(xlabel="seconds since the search started", ylabel="validation accuracy",
               title=f"{self.title}: {len(jobs)} jobs done, best {best:.3f}")
        ax.title.set_fontsize(9)
        if jobs:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        raise_small_text(fig)
        fig.tight_layout()
        self.updates += 1
        try:
            from IPython import get_ipython
            from IPython.display import display
            if get_ipython() is not None:
                if self.handle is None:
                    self.handle = display(fig, display_id=True)
                else:
                    self.handle.update(fig)
        finally:
            plt.close(fig)
        return fig


def save_all(out_dir):
    """Write the simulated Gantt charts of synchronous successive halving and ASHA on 16
    engines into ``out_dir``; returns the paths.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    import numpy as np

    from course_lib import hpsearch, hpsearch_loop
    rng = np.random.default_rng(0)
    configs = [hpsearch.sample(hpsearch.SPACE, rng) for _ in range(81)]
    budget = hpsearch.halving_budget(81, 1, 27, 3)
    results = [hpsearch_loop.simulate(hpsearch.SuccessiveHalving(configs, 1, 27, 3), 16,
                                 name="successive halving (simulated)"),
               hpsearch_loop.simulate(hpsearch.ASHA(iter(configs * 4), 1, 27, 3, budget), 16,
                                 name="ASHA (simulated)")]
    axes = gantt(results)
    return [save_figure(axes[0].figure, out_dir, "13_gantt_sh_vs_asha.png")]
