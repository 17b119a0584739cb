"""Figures of notebook 16: the plans of a model on a cluster (memory and step time of the
fastest splits) and the plan beside published runs."""

from dataclasses import replace

import numpy as np

from course_lib import costmodel
from course_lib import scale_plan as S
from course_lib.figures import for_slides, save_figure

MEMORY = ("parameters", "gradients", "optimizer", "activations")
TIME = ("compute", "tp", "cp", "pp", "bubble", "dp", "optimizer")


@for_slides
def plans_figure(model: str = "GPT 145B", devices: int = 1024, batch: int = 1024,
                 sequence: int = 2048, cluster: str = "A100 (Selene)",
                 between_gbs: float | None = None, shown: int = 6):
    """The ``shown`` fastest splits of ``model`` that fit ``devices`` of ``cluster`` (and the
    fastest that do not, marked), each one's memory per device by kind against the device's
    memory and its step time by term, with its model FLOPs utilisation. ``between_gbs``:
    another bandwidth between nodes, GB/s per GPU. Introduced in
    notebooks/16_planning_a_run.ipynb."""
    import matplotlib.pyplot as plt
    c = replace(S.CLUSTERS[cluster], devices=devices)
    if between_gbs:
        c = replace(c, between=costmodel.Link(f"{between_gbs:.3g} GB/s", c.between.alpha,
                                              1 / (between_gbs * 1e9)))
    rows = S.plan(S.MODELS[model], batch, sequence, c)
    fit = [r for r in rows if r["fits"]][:shown]
    over = sorted((r for r in rows if not r["fits"]), key=lambda r: r["time"]["total"])[:2]
    chosen = fit + over
    fig, (mem, step) = plt.subplots(1, 2, figsize=(12, 0.45 * len(chosen) + 2.4),
                                    layout="constrained")
    names = [S.describe(r["run"]) for r in chosen]
    y = np.arange(len(chosen))[::-1]
    left = np.zeros(len(chosen))
    for i, kind in enumerate(MEMORY):
        v = np.array([r["memory"][kind] for r in chosen]) / S.GiB
        mem.barh(y, v, left=left, color=f"C{i}", label=kind)
        left += v
    mem.axvline(c.memory / S.GiB, color="k", ls="--", label="device memory")
    mem.set(yticks=y, yticklabels=names, xlabel="GiB per device",
            title=f"{model}\non {devices} x {cluster}")
    mem.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    left = np.zeros(len(chosen))
    for i, term in enumerate(TIME):
        v = np.array([r["time"][term] for r in chosen])
        step.barh(y, v, left=left, color=f"C{i}", label=term)
        left += v
    for yi, r in zip(y, chosen, strict=True):
        text = f" MFU {r['mfu']:.0%}" if r["fits"] else f" does not fit: {r['breaks']}"
        step.text(r["time"]["total"], yi, text, va="center", fontsize=10)
    step.set(yticks=y, yticklabels=[], xlabel="seconds per step",
             title=f"batch {batch} x {sequence} tokens,\nbetween nodes "
                   f"{c.between.bandwidth / 1e9:.3g} GB/s",
             xlim=(0, 1.45 * max(r["time"]["total"] for r in chosen)))
    step.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    return fig


@for_slides
def published_figure():
    """The plan's TFLOP/s per GPU beside the published ones, for each run of
    :data:`scale_plan.PUBLISHED`. Introduced in notebooks/16_planning_a_run.ipynb."""
    import matplotlib.pyplot as plt
    rows = S.predict_published()
    fig, ax = plt.subplots(figsize=(12, 3.8), layout="constrained")
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["published"].tflops for r in rows], 0.4, label="published")
    ax.bar(x + 0.2, [r["tflops"] for r in rows], 0.4, label="planned")
    for xi, r in zip(x, rows, strict=True):
        ax.text(xi + 0.2, r["tflops"], f"{r['tflops'] / r['published'].tflops - 1:+.0%}",
                ha="center", va="bottom", fontsize=10)
    ax.set(xticks=x, ylabel="TFLOP/s per GPU", title="the plan beside published runs",
           xticklabels=[f"{r['published'].model}\n{r['published'].devices} GPUs\n"
                        f"{S.describe(r['published'].run).split(',')[0]}" for r in rows])
    plt.setp(ax.get_xticklabels(), fontsize=9)
    ax.legend()
    return fig


def save_all(out_dir):
    """Write the plans of a 145B model and the published runs into ``out_dir``.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return [save_figure(plans_figure(), out_dir, "16_plans.png"),
            save_figure(published_figure(), out_dir, "16_published_runs.png")]


@for_slides
def gpu_figure(report: dict):
    """A GPU report (:func:`course_lib.gpu.measure`): left, the FLOP/s reached by a bare matrix
    product and by the transformer's step against the datasheet's peaks (the ratio to the 16-bit
    peak is the MFU); right, the memory the planner counted against what CUDA's allocator
    held, by kind. Introduced in notebooks/16_planning_a_run.ipynb."""
    import matplotlib.pyplot as plt
    spec = report["environment"].get("card") or {}
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
    names = [f"matmul {d}" for d in report["matmul"]] + [
        f"GPT step {s['dtype']}\n{s['attention'].replace('_attention', '')} attention"
        for s in report["steps"]]
    rates = list(report["matmul"].values()) + [s["flops_per_s"] for s in report["steps"]]
    dtypes = list(report["matmul"]) + [s["dtype"] for s in report["steps"]]
    y = np.arange(len(names))[::-1]
    speed.barh(y, np.array(rates) / 1e12, color=["C0" if d == "bfloat16" else "C1"
                                                 for d in dtypes])
    for key, label, color in (("bf16", "16-bit peak", "C0"), ("fp32", "float32 peak", "C1")):
        if spec.get(key):
            speed.axvline(spec[key] / 1e12, color=color, ls="--", label=label)
    for yi, r, d in zip(y, rates, dtypes, strict=True):
        peak = spec.get("bf16" if d == "bfloat16" else "fp32")
        if peak:
            speed.text(r / 1e12, yi, f" {r / peak:.0%}", va="center", fontsize=10)
    copy = f"copy {report['copy'] / 1e12:.2f} TB/s" + (
        f" ({report['copy'] / spec['memory_bandwidth']:.0%} of the datasheet's)" if spec else "")
    speed.set(yticks=y, yticklabels=names, xlabel="TFLOP/s (model FLOPs per second)",
              title=f"{report['environment']['device']}; {copy}")
    if spec:
        speed.legend(loc="lower right", fontsize=10)
    mem = report["memory"]
    kinds = ["parameters", "gradients", "optimizer", "activations", "total"]
    x = np.arange(len(kinds))
    memory.bar(x - 0.2, [mem["planned"][k] / 2**30 for k in kinds], 0.4, label="planned")
    got = [mem["measured"][k] for k in kinds[:-1]] + [mem["measured"]["peak"]]
    if got[0] is not None:
        memory.bar(x + 0.2, [g / 2**30 for g in got], 0.4, label="CUDA allocator")
    kinds[-1] = "total / peak"
    cfg = mem["config"]
    memory.set(xticks=x, xticklabels=kinds, ylabel="GiB",
               title=f"GPT d={cfg['d_model']}, {cfg['n_layers']} layers, {mem['batch']}x"
                     f"{mem['length']} tokens, float32 + Adam")
    memory.legend(fontsize=10)
    return fig


@for_slides
def fp8_figure(outliers, errors, scaling, axes=None):
    """Two panels: the error of ordinary numbers beside an outlier, per format and scaling
    (``precision.outlier_errors``), and each step's error under current and delayed scaling
    when the activations jump (``precision.scaling_errors``), the saturated share marked.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    import matplotlib.pyplot as plt
    if axes is None:
        axes = plt.subplots(1, 2, figsize=(10, 3), layout="constrained")[1]
    for name, values in errors.items():
        axes[0].loglog(outliers, values, "o-", ms=4, label=name)
    axes[0].set(xlabel="the outlier column's size (x the others)",
                ylabel="relative error of the others", title="one scale per tensor or per block")
    axes[0].legend(fontsize=8)
    steps = range(len(scaling["current"]))
    axes[1].semilogy(steps, scaling["current"], "o-", ms=3, label="current scaling")
    axes[1].semilogy(steps, scaling["delayed"], "s--", ms=3, label="delayed scaling")
    worst = max(steps, key=lambda s: scaling["saturated"][s])
    axes[1].annotate(f"step {worst}: {scaling['saturated'][worst]:.0%} of the numbers saturated",
                     (worst, scaling["delayed"][worst]), xytext=(-200, -4),
                     textcoords="offset points", fontsize=8)
    axes[1].yaxis.set_minor_formatter(plt.NullFormatter())
    axes[1].set(xlabel="step", ylabel="relative error (e4m3)",
                title="activations 16x larger from one step on")
    axes[1].legend(fontsize=8, loc="center left")
    for ax in axes:
        ax.title.set_fontsize(10)
    return axes


@for_slides
def dry_run_figure(run: dict, planned: list, planned_memory: dict, axes=None):
    """One rank's dry run (:func:`course_lib.dry_run.dry_run`) against the plan: left, the GiB
    its collectives carry by kind and dimension (whole tensors), each bar labelled with its
    count, the plan's marked; right, the bytes it holds by kind, the plan's marked.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    import matplotlib.pyplot as plt
    if axes is None:
        axes = plt.subplots(1, 2, figsize=(10, 3), layout="constrained")[1]

    def by_kind(collectives):
        out: dict = {}
        for c in collectives:
            n, gib = out.get((c.kind, c.dim), (0, 0.0))
            out[(c.kind, c.dim)] = (n + 1, gib + 4 * c.elements / 2**30)  # float32
        return out
    seen, want = by_kind(run["collectives"]), by_kind(planned)
    names = sorted(set(seen) | set(want))
    labels = [f"{kind}\nover {dim}" for kind, dim in names]
    x = np.arange(len(names))
    bars = axes[0].bar(x, [seen.get(k, (0, 0))[1] for k in names], color="C0",
                       label="recorded")
    counts = [seen.get(k, (0, 0))[0] for k in names]
    axes[0].bar_label(bars, [f"{n} call{'s' * (n != 1)}" for n in counts], fontsize=8,
                      label_type="center", color="white")
    axes[0].plot(x, [want.get(k, (0, 0))[1] for k in names], "k_", ms=30, mew=2,
                 label="planned")
    axes[0].set_xticks(x, labels, fontsize=8)
    axes[0].set(ylabel="GiB in the step's collectives", title="what one rank's step sends for")
    axes[0].margins(y=0.15)
    axes[0].legend(fontsize=8)
    held = run["held"]
    x = np.arange(len(MEMORY))
    axes[1].bar(x, [held[k] / 2**30 for k in MEMORY], color=[f"C{i}" for i in range(4)])
    axes[1].plot(x, [planned_memory[k] / 2**30 for k in MEMORY], "k_", ms=30, mew=2,
                 label="planned")
    axes[1].set_yscale("log")
    axes[1].set_xticks(x, MEMORY, fontsize=8)
    axes[1].set(ylabel="GiB on the rank (held: the bars)", title="what it holds")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.title.set_fontsize(10)
    return axes
