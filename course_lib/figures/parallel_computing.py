"""The figures of notebooks/02_parallel_computing.ipynb: memory architectures.

``save_all(out_dir)`` writes them into ``images/`` (``python -m course_lib images``).
"""

from __future__ import annotations

from pathlib import Path

from course_lib.figures import raise_small_text


def plot_memory_architectures(path=None):
    """Four sketches: shared memory (UMA), NUMA, distributed memory, hybrid. Returns a Figure."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    fig = Figure(figsize=(12, 3.4), layout="constrained")
    axes = fig.subplots(1, 4)

    def box(ax, x, y, w, h, text, color):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color,
                                    ec="black", lw=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def line(ax, x0, y0, x1, y1, **kw):
        ax.plot([x0, x1], [y0, y1], color=kw.get("color", "black"), lw=kw.get("lw", 1.5),
                ls=kw.get("ls", "-"))

    cpu, mem, net = "#cfe2f3", "#fce5cd", "#d9ead3"
    ax = axes[0]  # UMA: every CPU reaches one memory over one bus, at the same cost
    box(ax, 0.1, 0.72, 0.8, 0.16, "memory", mem)
    line(ax, 0.1, 0.55, 0.9, 0.55, lw=3)
    line(ax, 0.5, 0.55, 0.5, 0.72)
    for i in range(4):
        box(ax, 0.05 + 0.235 * i, 0.2, 0.19, 0.16, "CPU", cpu)
        line(ax, 0.145 + 0.235 * i, 0.36, 0.145 + 0.235 * i, 0.55)
    ax.text(0.5, 0.48, "bus", ha="center", fontsize=8)
    ax.set_title("shared memory: UMA (SMP)\nevery CPU reaches memory\nin the same time", fontsize=9)
    ax = axes[1]  # NUMA: two SMPs, each with its own memory, joined by a slower link
    for k, x in enumerate((0.02, 0.53)):
        box(ax, x, 0.72, 0.45, 0.16, f"memory {k}", mem)
        for i in range(2):
            box(ax, x + 0.01 + 0.23 * i, 0.25, 0.2, 0.16, "CPU", cpu)
            line(ax, x + 0.11 + 0.23 * i, 0.41, x + 0.11 + 0.23 * i, 0.72)
    line(ax, 0.47, 0.33, 0.53, 0.33, color="C3", lw=3)
    ax.text(0.5, 0.12, "interconnect: remote memory\nis slower", ha="center", fontsize=8,
            color="C3")
    ax.set_title("shared memory: NUMA\none address space,\nunequal access times", fontsize=9)
    ax = axes[2]  # distributed: each CPU has its own memory; messages cross a network
    box(ax, 0.05, 0.05, 0.9, 0.14, "network", net)
    for i in range(4):
        x = 0.03 + 0.24 * i
        box(ax, x, 0.62, 0.2, 0.14, "mem", mem)
        box(ax, x, 0.35, 0.2, 0.14, "CPU", cpu)
        line(ax, x + 0.1, 0.49, x + 0.1, 0.62)
        line(ax, x + 0.1, 0.19, x + 0.1, 0.35, ls="--")
    ax.set_title("distributed memory\nprivate memories,\nmessages over a network", fontsize=9)
    ax = axes[3]  # hybrid: shared-memory nodes (CPUs + GPUs) joined by a network
    box(ax, 0.05, 0.05, 0.9, 0.14, "network", net)
    for k, x in enumerate((0.03, 0.52)):
        ax.add_patch(FancyBboxPatch((x, 0.3), 0.45, 0.6, boxstyle="round,pad=0.01", fc="white",
                                    ec="grey", ls=":"))
        box(ax, x + 0.03, 0.72, 0.39, 0.12, f"node {k} memory", mem)
        box(ax, x + 0.03, 0.5, 0.17, 0.12, "CPU", cpu)
        box(ax, x + 0.25, 0.5, 0.17, 0.12, "CPU", cpu)
        box(ax, x + 0.03, 0.34, 0.39, 0.1, "GPU  GPU", "#ead1dc")
        line(ax, x + 0.225, 0.19, x + 0.225, 0.3, ls="--")
    ax.set_title("hybrid\nshared memory in a node,\na network between nodes", fontsize=9)
    for ax in axes:
        ax.set(xlim=(0, 1), ylim=(0, 1))
        ax.axis("off")
    raise_small_text(fig)
    if path is not None:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


def save_all(out_dir):
    """Write notebook 02's figure(s) into ``out_dir`` (``python -m course_lib images``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "02_memory_architectures.png"
    plot_memory_architectures(path)
    return [path]
