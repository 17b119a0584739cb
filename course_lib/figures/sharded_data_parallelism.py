"""The figures of notebooks/10_sharded_data_parallelism.ipynb: memory per rank of each ZeRO stage
against the number of ranks (the paper's accounting), and measured against predicted.

``save_all(out_dir)`` writes the accounting figure into ``images/`` (pure computation)::

    from course_lib.figures import sharded_data_parallelism as figures
    figures.memory_vs_ranks(num_params=7.5e9)
"""

from __future__ import annotations

import numpy as np

from course_lib.figures import for_slides, save_figure
from course_lib.zero import STAGES, zero_memory

NAMES = {0: "DDP", 1: "ZeRO-1 (optimizer state)", 2: "ZeRO-2 (+ gradients)",
         3: "ZeRO-3 (+ parameters)"}


@for_slides
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


@for_slides
def measured_memory(reports, num_params, world_size, bytes_per_number=8, optimizer_numbers=2,
                    ax=None):
    """Bytes one rank holds at its peak, by kind, per stage (bars), beside the paper's
    accounting (hatched). ``reports``: {stage: that rank's ``memory()`` dict}. Stages 1-2 keep
    a parameter shard of their own, which the paper counts in the optimizer state (its fp32
    master copy): it is drawn there, and the accounting counts one more number for it.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import matplotlib.pyplot as plt
    if ax is None:
        ax = plt.subplots(figsize=(8, 3.8))[1]
    kinds = ["parameters", "gradients", "optimizer"]
    stages = sorted(reports)

    def held(stage, kind):
        shard_is = "parameters" if stage == 3 else "optimizer"  # where the shard is counted
        return reports[stage][kind] + (reports[stage]["shards"] if kind == shard_is else 0)
    predicted = [zero_memory(num_params, world_size, s, optimizer_numbers + (s in (1, 2)),
                             bytes_per_number) for s in stages]
    xs = np.arange(len(stages))
    for offset, value, style in [(-0.2, lambda i, kind: held(stages[i], kind), "held"),
                                 (0.2, lambda i, kind: predicted[i][kind], "paper")]:
        bottom = np.zeros(len(stages))
        for k, kind in enumerate(kinds):
            values = np.array([value(i, kind) for i in range(len(stages))], float) / 1024
            look = (dict(color=f"C{k}") if style == "held" else
                    dict(color="none", edgecolor=f"C{k}", hatch="//"))
            ax.bar(xs + offset, values, 0.38, bottom=bottom, label=f"{style}: {kind}", **look)
            bottom += values
    ax.set_xticks(xs, [NAMES[s].split(" (")[0] for s in stages])
    ax.set_ylabel("KiB per rank")
    ax.legend(fontsize="x-small", ncol=2)
    return ax


@for_slides
def step_times(rows, link, ax=None):
    """Step time of the course's DDP and ZeRO stages on an emulated ``link`` (rows of
    ``bench.zero.measure`` at one N), each bar's hatched part the time the link needs for the
    bytes the rank sent (counted). Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import matplotlib.pyplot as plt

    from course_lib.runtime import netem
    if ax is None:
        ax = plt.subplots(figsize=(7, 3.5))[1]
    bandwidth = netem.make_link(link).bandwidth
    xs = np.arange(len(rows))
    wire = np.array([r["sent_mib"] * 2**20 / bandwidth * 1e3 for r in rows])
    ax.bar(xs, [r["step_ms"] for r in rows], 0.6, color="C0", label="measured step")
    ax.bar(xs, wire, 0.6, color="none", edgecolor="k", hatch="//",
           label="the bytes sent, at the link's bandwidth")
    for x, r in zip(xs, rows, strict=True):
        ax.text(x, r["step_ms"], f"{r['sent_mib']:.1f} MiB sent", ha="center", va="bottom",
                fontsize=8)
    names = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
    ax.set_xticks(xs, [names.get(r["implementation"], r["implementation"]) for r in rows])
    ax.set_ylabel("ms per step")
    ax.set_title(f"{rows[0]['ranks']} ranks, emulated link {netem.make_link(link)}", fontsize=10)
    ax.legend(fontsize="small", loc="upper left")
    ax.margins(y=0.15)
    return ax


def save_all(out_dir):
    """Write the accounting figure into ``out_dir``; returns the paths.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    return [save_figure(memory_vs_ranks().figure, out_dir, "10_zero_memory.png")]
