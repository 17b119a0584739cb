"""The figures of notebooks/12_scaling_out.ipynb: the parameter server against ring-allreduce,
measured on the emulated network, then modelled to thousands of workers.

``measured_throughput`` draws the rows of :func:`course_lib.scaling.measure` (a running cluster,
so in the notebook only); ``efficiency_vs_workers`` is pure computation (the alpha-beta model of
:mod:`course_lib.scaling`), so ``save_all(out_dir)`` writes it into ``images/`` as
``12_ps_vs_ring.png`` (``python -m course_lib images``)::

    from course_lib.figures import scaling_out as figures
    figures.measured_throughput(rows)
    figures.efficiency_vs_workers()
"""

from __future__ import annotations

import numpy as np

from course_lib import costmodel, scaling
from course_lib.figures import save_figure

COLORS = {"ps1": "C3", "ps": "C1", "ring": "C0"}


def _names(servers):
    return {**scaling.NAMES, "ps": f"PS, {servers} servers"}


def measured_throughput(rows, ax=None):
    """Samples per second against N for each method (rows of ``scaling.measure``): measured as
    dots on solid lines, the formula dashed in the same colour, and ideal scaling (N times one
    worker alone) dotted. Introduced in notebooks/12_scaling_out.ipynb."""
    import matplotlib.pyplot as plt

    from course_lib import netem
    if ax is None:
        ax = plt.subplots(figsize=(7, 4))[1]
    one = [r for r in rows if r["method"] == "one"]
    ns = sorted({r["workers"] for r in rows if r["method"] != "one"})
    for method in [m for m in scaling.METHODS if any(r["method"] == m for r in rows)]:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["workers"])
        servers = sorted({r["servers"] for r in mine})
        label = scaling.NAMES[method] if method != "ps" else (
            f"PS, {servers[0]} servers" if len(servers) == 1 else "PS, S servers")
        xs = [r["workers"] for r in mine]
        ax.plot(xs, [r["samples_per_s"] for r in mine], "o-", color=COLORS[method],
                label=f"{label}: measured")
        ax.plot(xs, [r["model_samples_per_s"] for r in mine], "--", color=COLORS[method],
                lw=1.2, label=f"{label}: formula")
    if one:
        base = one[0]["samples_per_s"]
        ax.plot([1] + ns, [base * n for n in [1] + ns], ":", color="0.4",
                label="ideal: N x one worker alone")
        ax.plot([1], [base], "ks", ms=5)
    r0 = rows[0]
    ax.set(xlabel="workers N", ylabel="samples per second", xticks=[1] + ns)
    ax.set_title(f"{8 * r0['params'] / 2**20:g} MiB model, {r0['compute_s'] * 1e3:g} ms compute "
                 f"per step, link {netem.make_link(r0['link'])}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="x-small", ncol=2)
    return ax


def efficiency_vs_workers(workload=scaling.RESNET50, links=tuple(costmodel.LINKS),
                          servers="N/4", workers=scaling.WORKERS, axes=None):
    """The model's scaling efficiency against N (1 .. 4096) for the PS with 1 server, the PS
    with ``servers`` servers and the ring, one panel per link preset, with Horovod's reported
    90% at 512 GPUs (its README; 25 Gbit/s RoCE, Inception V3 and ResNet-101) as a reference
    point. Returns the axes. Introduced in notebooks/12_scaling_out.ipynb."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter
    if axes is None:
        axes = plt.subplots(1, len(links), figsize=(3.3 * len(links), 3.8), sharey=True,
                            layout="constrained")[1]  # room for the suptitle
    axes = np.atleast_1d(axes)
    rows = scaling.model_rows(workload, links, workers, servers)
    names, ref = _names(servers), scaling.HOROVOD_512
    for ax, link in zip(axes, links, strict=True):
        model = scaling._cost_link(link)
        for method in scaling.METHODS:
            mine = [r for r in rows if r["link"] == model.name and r["method"] == method]
            ax.plot([r["workers"] for r in mine], [100 * r["efficiency"] for r in mine], "o-",
                    ms=2.5, color=COLORS[method], label=names[method])
        ax.plot([ref["gpus"]], [100 * ref["efficiency"]], "k*", ms=9,
                label=f"Horovod: {ref['efficiency']:.0%} at {ref['gpus']} GPUs\n"
                      "(its README; 25 Gbit/s RoCE)")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.set_xticks([1, 8, 64, 512, 4096])
        ax.set(xlabel="workers N", ylim=(0, 105),
               title=f"{model.name}\n{model.alpha * 1e6:g} us, {model.bandwidth / 1e9:g} GB/s")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (%)")
    axes[-1].legend(fontsize="x-small", loc="lower left")  # where the last panel has room
    axes[0].figure.suptitle(
        f"{workload.name}: {workload.n_bytes / 1e6:.0f} MB of gradient per "
        f"{workload.compute_s * 1e3:.0f} ms of compute, no overlap (alpha-beta model)",
        fontsize=10)
    return axes


def tc_versus_emulated(rows, ax=None):
    """Seconds per allreduce for each world size and algorithm (rows of
    :func:`course_lib.hosts.tc_versus_emulated`): the alpha-beta model, the emulated link and the
    kernel's tc-shaped cables side by side. Introduced in notebooks/12_scaling_out.ipynb."""
    import matplotlib.pyplot as plt
    if ax is None:
        ax = plt.subplots(figsize=(7, 3.5))[1]
    ways = [("model", "alpha-beta model", "0.75"), ("emulated", "emulated link (netem.py)", "C0"),
            ("tc", "real cables, tc tbf", "C3")]
    x = np.arange(len(rows))
    for k, (key, label, color) in enumerate(ways):
        bars = ax.bar(x + (k - 1) * 0.27, [r[key] * 1e3 for r in rows], 0.27, color=color,
                      label=label)
        if key == "tc":
            ax.bar_label(bars, [f"{r['tc'] / r['model']:.2f}x" for r in rows], fontsize=7)
    ax.set_xticks(x, [f"{r['algorithm']}\nN = {r['world_size']}" for r in rows])
    r0 = rows[0]
    ax.set(ylabel="ms per allreduce",
           title=f"{r0['bytes'] / 2**20:g} MiB allreduce, {r0['rate']} per host each way "
                 "(labels: tc / model)")
    ax.legend(fontsize="small")
    return ax


def save_all(out_dir):
    """Write the model figure (no cluster needed) into ``out_dir``; returns the paths.
    Introduced in notebooks/12_scaling_out.ipynb."""
    axes = efficiency_vs_workers()
    return [save_figure(axes[0].figure, out_dir, "12_ps_vs_ring.png")]
