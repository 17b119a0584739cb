"""The figures of notebooks/12_scaling_out.ipynb: the parameter server against ring-allreduce,
measured on the emulated network, then modelled to thousands of workers.

``measured_throughput`` draws the rows of :func:`course_lib.ps_vs_ring.measure` (a running cluster,
so in the notebook only); ``efficiency_vs_workers`` is pure computation (the alpha-beta model of
:mod:`course_lib.ps_vs_ring`), so ``save_all(out_dir)`` writes it into ``images/`` as
``12_ps_vs_ring.png`` (``python -m course_lib images``), with Uber's published numbers
(``horovod_vs_tensorflow``) and the cost of staging a GPU's data through host memory
(``gpu_transfer``); ``job_timeline`` draws a Kubernetes job's pods as they were observed::

    from course_lib.figures import scaling_out as figures
    figures.measured_throughput(rows)
    figures.efficiency_vs_workers()
"""

from __future__ import annotations

import numpy as np

from course_lib import costmodel, ps_vs_ring
from course_lib.figures import for_slides, save_figure

COLORS = {"ps1": "C3", "ps": "C1", "ring": "C0"}


def _names(servers):
    return {**ps_vs_ring.NAMES, "ps": f"PS, {servers} servers"}


@for_slides
def measured_throughput(rows, ax=None):
    """Samples per second against N for each method (rows of ``ps_vs_ring.measure``): measured as
    dots on solid lines, the formula dashed in the same colour, and ideal scaling (N times one
    worker alone) dotted. Introduced in notebooks/12_scaling_out.ipynb."""
    import matplotlib.pyplot as plt

    from course_lib.runtime import netem
    if ax is None:
        ax = plt.subplots(figsize=(7, 4))[1]
    one = [r for r in rows if r["method"] == "one"]
    ns = sorted({r["workers"] for r in rows if r["method"] != "one"})
    for method in [m for m in ps_vs_ring.METHODS if any(r["method"] == m for r in rows)]:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["workers"])
        servers = sorted({r["servers"] for r in mine})
        label = ps_vs_ring.NAMES[method] if method != "ps" else (
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


@for_slides
def efficiency_vs_workers(workload=ps_vs_ring.RESNET50, links=tuple(costmodel.LINKS),
                          servers="N/4", workers=ps_vs_ring.WORKERS, axes=None):
    """The model's scaling efficiency against N (1 .. 4096) for the PS with 1 server, the PS
    with ``servers`` servers and the ring, one panel per link preset, with Horovod's reported
    90% at 512 GPUs (its README; 25 Gbit/s RoCE, Inception V3 and ResNet-101) as a reference
    point. Returns the axes. Introduced in notebooks/12_scaling_out.ipynb."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter
    if axes is None:
        axes = plt.subplots(1, len(links), figsize=(3.3 * len(links), 4.1), sharey=True,
                            layout="constrained")[1]  # room for the suptitle and legend
    axes = np.atleast_1d(axes)
    rows = ps_vs_ring.model_rows(workload, links, workers, servers)
    names, ref = _names(servers), ps_vs_ring.HOROVOD_512
    for ax, link in zip(axes, links, strict=True):
        model = ps_vs_ring.cost_link(link)
        for method in ps_vs_ring.METHODS:
            mine = [r for r in rows if r["link"] == model.name and r["method"] == method]
            ax.plot([r["workers"] for r in mine], [100 * r["efficiency"] for r in mine], "o-",
                    ms=2.5, color=COLORS[method], label=names[method])
        ax.plot([ref["gpus"]], [100 * ref["efficiency"]], "k*", ms=9,
                label=f"Horovod: {ref['efficiency']:.0%} at {ref['gpus']} GPUs "
                      "(its README; 25 Gbit/s RoCE)")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.set_xticks([1, 8, 64, 512, 4096])
        ax.set(xlabel="workers N", ylim=(0, 105),
               title=f"{model.name}\n{model.alpha * 1e6:g} us, {model.bandwidth / 1e9:g} GB/s")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (%)")
    # one legend for all panels, below them: readable, and it covers no curve
    axes[0].figure.legend(*axes[-1].get_legend_handles_labels(), loc="outside lower center",
                          ncol=4, fontsize=9, frameon=False)
    axes[0].figure.suptitle(
        f"{workload.name}: {workload.n_bytes / 1e6:.0f} MB of gradient per "
        f"{workload.compute_s * 1e3:.0f} ms of compute, no overlap (alpha-beta model)",
        fontsize=10)
    return axes


@for_slides
def tc_versus_emulated(rows, ax=None):
    """Seconds per allreduce for each world size and algorithm (rows of
    :func:`course_lib.bench.allreduce.tc_versus_emulated`): the alpha-beta model, the emulated
    link and the kernel's tc-shaped cables side by side.
    Introduced in notebooks/12_scaling_out.ipynb."""
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


@for_slides
def horovod_vs_tensorflow(rows=None, axes=None):
    """Uber's published numbers, drawn here (:data:`course_lib.ps_vs_ring.UBER_128`,
    :data:`~course_lib.ps_vs_ring.RDMA_SPEEDUP`; sources in their comments). Left: scaling
    efficiency at 128 GPUs of standard distributed TensorFlow (about half: said in words, drawn
    hatched), Horovod over TCP and over RDMA; with ``rows`` of
    :func:`course_lib.ps_vs_ring.measure`, this machine's parameter server and ring at the
    largest N measured, on the emulated link.
    Right: what RDMA gained over TCP for each model against its gradient's size (fp32).
    Introduced in notebooks/12_scaling_out.ipynb."""
    import matplotlib.pyplot as plt
    if axes is None:
        axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained",
                            gridspec_kw={"width_ratios": [1.4, 1]})[1]
    ax, right = axes
    bars = [(f"{r['system']}, {r['network']}\n{r['models']}, {r['gpus']} GPUs",
             100 * r["efficiency"], r["approx"], "C3" if "TensorFlow" in r["system"] else "C0")
            for r in ps_vs_ring.UBER_128]
    title = "scaling efficiency: Uber at 128 GPUs"
    if rows:
        ratio = ps_vs_ring.ring_over_ps(rows)
        n = ratio["workers"]
        mine = {r["method"]: r for r in rows if r["workers"] == n and r["method"] != "one"}
        names = {**ps_vs_ring.NAMES, "ps": f"PS, {ratio.get('servers', 'S')} servers"}
        bars += [(f"here: {names[m]}\nemulated link, N = {n}", 100 * mine[m]["efficiency"],
                  False, COLORS[m]) for m in ("ps1", "ps", "ring") if m in mine]
        title += f"; this machine at N = {n}"
    y = np.arange(len(bars))[::-1]  # the first bar on top
    for yi, (_, value, approx, color) in zip(y, bars, strict=True):
        ax.barh(yi, value, 0.7, color=color, alpha=0.45 if approx else 0.9,
                hatch="//" if approx else None, edgecolor="k", lw=0.5)
        ax.text(value + 1, yi, f"{'about ' if approx else ''}{value:.0f}%", va="center",
                fontsize=9)
    ax.axvline(100, color="0.5", ls=":", lw=1)
    ax.set_yticks(y, [b[0] for b in bars], fontsize=8.5)
    ax.set(xlabel="throughput / (N x one GPU's) (%)", xlim=(0, 112), title=title)
    if len(bars) > len(ps_vs_ring.UBER_128):
        ax.axhline(y[len(ps_vs_ring.UBER_128)] + 0.5, color="0.3", lw=0.8)
    models = list(ps_vs_ring.RDMA_SPEEDUP)
    for i, m in enumerate(models):
        low, high = ps_vs_ring.RDMA_SPEEDUP[m]
        right.bar(i, 100 * high, 0.6, color="C0" if high < 0.1 else "C3")
        if high > low:  # "three to four percent": the range, drawn as its two ends
            right.plot([i - 0.3, i + 0.3], [100 * low] * 2, color="k", lw=1)
        right.text(i, 100 * high + 0.8, f"{100 * low:.0f}-{100 * high:.0f}%" if high > low
                   else f"{100 * high:.0f}%", ha="center", fontsize=9)
    right.set_xticks(range(len(models)), [  # a float32 gradient: 4 bytes a parameter
        f"{m}\n{4 * ps_vs_ring.PARAMETERS[m] / 1e6:.0f} MB\ngradient" for m in models], fontsize=8)
    right.set(ylabel="RDMA over TCP: speed-up (%)", ylim=(0, 36),
              title="Horovod, 25 Gbit/s: RDMA against TCP")
    return axes


SIZES = 2.0 ** np.arange(20, 31)  # 1 MiB .. 1 GiB: whole chunks, so no ragged last chunk


@for_slides
def gpu_transfer(rows=None, sizes=SIZES, chunk_bytes=4 << 20, axes=None):
    """What staging through host memory costs, by :func:`course_lib.costmodel.path_time`:
    effective bandwidth (bytes / seconds) against size, 1 MB to 1 GB, of each path of
    :func:`course_lib.costmodel.gpu_paths` (PCIe 4.0 x16, InfiniBand HDR, NVLink), staged paths
    both store-and-forward (dashed) and pipelined in chunks of ``chunk_bytes`` (dotted); across
    nodes and inside a node. With ``rows`` of :func:`course_lib.staging.measure`, a first panel
    shows each way measured here beside its model. Introduced in notebooks/12_scaling_out.ipynb."""
    import matplotlib.pyplot as plt

    from course_lib.bench.common import format_size
    panels = 3 if rows else 2
    if axes is None:
        axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4), layout="constrained")[1]
    axes = list(np.atleast_1d(axes))
    drawn = list(axes)  # what is returned: every panel, the measured one first
    if rows:
        ax = axes.pop(0)
        ways = [("direct", "C2"), ("staged", "C3"), ("pipelined", "C1")]
        for k, (way, color) in enumerate(ways):
            x = np.arange(len(rows)) + (k - 1) * 0.27
            ax.bar(x, [r[f"{way}_s"] * 1e3 for r in rows], 0.27, color=color, label=way)
            ax.plot(x, [r[f"model_{way}_s"] * 1e3 for r in rows], "k_", ms=14, mew=2,
                    label="model" if k == 0 else None)
        ax.set_xticks(range(len(rows)), [f"{format_size(r['bytes'])}\n"
                                         f"{r['link'].split(';')[0].replace(' (', chr(10) + '(')}"
                                         for r in rows], fontsize=7.5)
        ax.set(ylabel="ms (median)", title="here: memcpy as the staging copy")
        ax.legend(fontsize=8)
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    paths = costmodel.gpu_paths()
    for ax, where in zip(axes, ("across nodes", "inside a node"), strict=True):
        mine = [(name.split(", ", 1)[1], stages) for name, stages in paths.items()
                if name.startswith(where)]
        for k, (label, stages) in enumerate(mine):
            color = f"C{k}"
            if "staged" in label:
                ax.plot(sizes / 1e6, sizes / costmodel.path_time(sizes, stages) / 1e9, "o--",
                        ms=3, color=color, label=f"{label},\nstore and forward")
                ax.plot(sizes / 1e6, sizes / costmodel.path_time(sizes, stages, chunk_bytes)
                        / 1e9, "o:", ms=3, color=color, lw=2,
                        label=f"{label},\npipelined in {format_size(chunk_bytes)} chunks")
            else:
                ax.plot(sizes / 1e6, sizes / costmodel.path_time(sizes, stages) / 1e9, "o-",
                        ms=3, color=color, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set(xlabel="message size (MB)", ylabel="effective GB/s (size / time)",
               title=f"model: {where}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2,
                  frameon=False)
    return drawn


@for_slides
def job_timeline(run, ax=None):
    """The phases of each pod of a :class:`course_lib.k8s.watch.JobRun` as they were observed
    (Pending, Running, Succeeded or Failed) and, on top, the job's state (its last condition,
    what ``kubectl get pytorchjob`` shows) over the same time.
    Introduced in notebooks/12_scaling_out.ipynb."""
    import matplotlib.pyplot as plt
    if ax is None:
        ax = plt.subplots(figsize=(8, 2.6), layout="constrained")[1]
    colors = {"Pending": "0.75", "Created": "C4", "Running": "C0", "Succeeded": "C2",
              "Failed": "C3"}
    end = max(max(pod.phases[-1][0] for pod in run.pods.values()), 1e-3) * 1.12
    # the job's state: each condition that turned True, from when it did
    state = sorted((c["lastTransitionTime"], c["type"]) for c in run.conditions
                   if c["status"] == "True" or c["type"] == "Running")
    rows = [(name, pod.phases) for name, pod in run.pods.items()]
    rows.append((f"PyTorchJob {run.name}\n(state)", state))
    seen = set()
    for y, (_, spans) in enumerate(rows):
        for (t, what), nxt in zip(spans, [*spans[1:], (end, None)], strict=True):
            ax.barh(y, max(nxt[0] - t, end * 0.004), left=t, color=colors[what], height=0.5,
                    label=what if what not in seen else None)
            seen.add(what)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=9)
    ax.set(xlabel="seconds since the job was created", xlim=(0, end),
           title=f"PyTorchJob {run.name}: what was observed (local processes, no API server)")
    return ax


def save_all(out_dir):
    """Write the figures that need no cluster into ``out_dir``; returns the paths.
    Introduced in notebooks/12_scaling_out.ipynb."""
    axes = efficiency_vs_workers()
    paths = [save_figure(axes[0].figure, out_dir, "12_ps_vs_ring.png")]
    axes = horovod_vs_tensorflow()
    paths.append(save_figure(axes[0].figure, out_dir, "12_horovod_vs_tensorflow.png"))
    axes = gpu_transfer()
    paths.append(save_figure(axes[0].figure, out_dir, "12_gpudirect.png"))
    return paths
