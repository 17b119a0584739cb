"""The figures of notebooks/07_large_minibatch.ipynb: accuracy against the global batch,
stragglers per rank, and the order statistics of random delays.

``plot_accuracy_vs_batch`` draws the rows of :func:`course_lib.large_batch.accuracy_vs_batch`
and ``plot_straggler_table`` those of :func:`course_lib.stragglers.straggler_experiment`: both
need measured data (minutes of training, a running cluster), so they are drawn in the notebook
only. ``plot_order_statistics`` is pure computation (the closed form and a small Monte Carlo of
:mod:`course_lib.stragglers`), so ``save_all(out_dir)`` writes it into ``images/``
(``python -m course_lib images``). Each function draws on ``ax`` (a new pyplot figure when none
is given) and returns the axes::

    from course_lib.figures import large_minibatch as figures
    figures.plot_order_statistics()
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from course_lib.figures import for_slides
from course_lib.stragglers import expected_step_time, simulate_step_times


@for_slides
def plot_accuracy_vs_batch(rows, ax=None):
    """Mean test accuracy (line) and every seed (dots) against the global batch size.

    Introduced in notebooks/07_large_minibatch.ipynb."""
    if ax is None:
        import matplotlib.pyplot as plt
        ax = plt.subplots(figsize=(6.5, 3.8))[1]
    names = {"fixed": "fixed lr", "scaled": "linear scaling", "warmup": "scaling + warmup"}
    for k, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        mine = [r for r in rows if r["variant"] == variant]
        xs = [r["batch_size"] for r in mine]
        line, = ax.plot(xs, [100 * r["mean"] for r in mine], "o-", label=names[variant])
        for r in mine:
            jitter = 1 + 0.04 * (k - 1)
            ax.plot([r["batch_size"] * jitter] * len(r["accuracies"]),
                    100 * np.asarray(r["accuracies"]), ".", color=line.get_color(), alpha=0.35)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="global batch size B", ylabel="test accuracy (%)", ylim=(-2, 100),
           title="Same epochs, larger batches (dots: seeds; 0 = diverged)")
    ax.legend(fontsize=8)
    return ax


@for_slides
def plot_straggler_table(rows, ax=None):
    """Stacked bars per rank: compute (dark) and time waiting in the allreduce (light).

    Introduced in notebooks/07_large_minibatch.ipynb."""
    if ax is None:
        import matplotlib.pyplot as plt
        ax = plt.subplots(figsize=(7, 3))[1]
    delays = sorted({r["delay"] for r in rows})
    labels = []
    for i, r in enumerate(rows):
        x = i + delays.index(r["delay"])  # a gap between the groups
        ax.bar(x, r["compute_s"] * 1e3, color="tab:blue" if not r["slowed"] else "tab:red",
               label="compute" if i == 0 else None)
        ax.bar(x, r["wait_s"] * 1e3, bottom=r["compute_s"] * 1e3, color="lightgray",
               label="waiting in all_reduce" if i == 0 else None)
        group = f"straggler +{r['delay'] * 1e3:.0f} ms" if r["delay"] else "no straggler"
        labels.append((x, f"r{r['rank']}\n{group}" if r["rank"] == 0 else f"r{r['rank']}"))
    ax.set_xticks([x for x, _ in labels], [t for _, t in labels], fontsize=8)
    ax.set(ylabel="ms per step", title="One slow rank sets every rank's step time")
    ax.legend(fontsize=8)
    return ax


@for_slides
def plot_order_statistics(workers=(1, 2, 4, 8, 16, 32, 64, 128, 256), backups=(0, 1, 2, 4),
                          mean_delay=1.0, num_steps=2000, ax=None):
    """Expected step time vs workers for several numbers of backups: formula (lines) and
    simulation (dots). Introduced in notebooks/07_large_minibatch.ipynb."""
    if ax is None:
        import matplotlib.pyplot as plt
        ax = plt.subplots(figsize=(6, 3.5))[1]
    for b in backups:
        ns = [n for n in workers if n > b]
        ax.plot(ns, [expected_step_time(n, b, mean_delay) for n in ns], label=f"b = {b}")
        ax.plot(ns, [simulate_step_times(n, b, mean_delay, num_steps=num_steps).mean()
                     for n in ns], "k.", ms=4)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="workers N", ylabel="expected wait / mean delay",
           title="Waiting for the slowest: E[(N-b)-th of N], Exp delays")
    ax.legend(title="backups (dots: simulated)", fontsize=8)
    return ax


def save_all(out_dir):
    """Write notebook 07's cheap figure into ``out_dir`` (``python -m course_lib images``).

    Only the order statistics (pure computation, a fraction of a second); the accuracy and
    straggler figures need measured data and are drawn in the notebook only."""
    from matplotlib.figure import Figure
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "07_order_statistics.png"
    fig = Figure(figsize=(6, 3.5))
    plot_order_statistics(ax=fig.subplots())
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return [path]
