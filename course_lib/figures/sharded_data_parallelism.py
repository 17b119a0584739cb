"""The figures of notebooks/10_sharded_data_parallelism.ipynb: memory per rank of each ZeRO stage
against the number of ranks (the paper's accounting), and measured against predicted.

``save_all(out_dir)`` writes the accounting figure into ``images/`` (pure computation)::

    from course_lib.figures import sharded_data_parallelism as figures
    figures.memory_vs_ranks(num_params=7.5e9)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from course_lib.zero import STAGES, zero_memory

NAMES = {0: "DDP", 1: "ZeRO-1 (optimizer state)", 2: "ZeRO-2 (+ gradients)",
         3: "ZeRO-3 (+ parameters)"}


def memory_vs_ranks(num_params=7.5e9, device_gb=80, ax=None):
    """GB per rank for each stage against N, mixed-precision Adam as in the ZeRO paper (2-byte
    parameters and gradients, K = 12 bytes of optimizer state per parameter), with one device's
    memory as a line. Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    if ax is None:
        ax = plt.subplots(figsize=(7, 4))[1]
    ranks = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    for stage in STAGES:
        gb = [zero_memory(num_params, n, stage, optimizer_numbers=6, bytes_per_number=2)
              ["total"] / 1e9 for n in ranks]
        ax.plot(ranks, gb, "o-", label=NAMES[stage])
    from matplotlib.ticker import FormatStrFormatter
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.axhline(device_gb, color="k", ls="--", lw=1)
    ax.text(ranks[-1], device_gb * 1.1, f"one {device_gb} GB device", ha="right", fontsize=8)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("GB per rank (parameters + gradients + Adam)")
    ax.set_title(f"{num_params / 1e9:g}B parameters: (2 + 2 + 12) bytes each, sharded",
                 fontsize=10)
    ax.legend(fontsize="small")
    return ax


def measured_memory(reports, num_params, world_size, bytes_per_number=8, optimizer_numbers=2,
                    ax=None):
    """Bytes one rank holds just before an update, by kind, per stage (bars), beside the
    paper's accounting (hatched). ``reports``: {stage: rank 0's ``at_update`` memory dict}.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    if ax is None:
        ax = plt.subplots(figsize=(8, 3.8))[1]
    kinds = ["parameters", "gradients", "optimizer"]
    stages = sorted(reports)
    xs = np.arange(len(stages))
    bottom = np.zeros(len(stages))
    for k, kind in enumerate(kinds):
        held = np.array([reports[s][kind] + (reports[s]["shards"] if kind == "parameters"
                                             and s == 3 else 0) for s in stages], float)
        ax.bar(xs - 0.2, held, 0.38, bottom=bottom, color=f"C{k}", label=f"held: {kind}")
        bottom += held
    predicted = [zero_memory(num_params, world_size, s, optimizer_numbers, bytes_per_number)
                 for s in stages]
    bottom = np.zeros(len(stages))
    for k, kind in enumerate(kinds):
        values = np.array([p[kind] for p in predicted])
        ax.bar(xs + 0.2, values, 0.38, bottom=bottom, color="none", edgecolor=f"C{k}",
               hatch="//", label=f"paper: {kind}")
        bottom += values
    ax.set_xticks(xs, [NAMES[s].split(" (")[0] for s in stages])
    ax.set_ylabel("bytes per rank")
    ax.legend(fontsize="x-small", ncol=2)
    return ax


def save_all(out_dir):
    """Write the accounting figure into ``out_dir``; returns the paths.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ax = memory_vs_ranks()
    path = out / "10_zero_memory.png"
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)
    return [path]
