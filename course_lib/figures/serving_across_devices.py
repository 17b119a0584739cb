"""Figures of notebooks/18_serving_across_devices.ipynb: decode on the roofline, static against
continuous batching, the speculative speed-up, and a deployment planned on paper.

Introduced in notebooks/18_serving_across_devices.ipynb."""

from __future__ import annotations

import numpy as np

from course_lib import serving
from course_lib.figures import for_slides, save_figure
from course_lib.speculative import expected_speedup


@for_slides
def roofline_figure(batches, seconds, params: int, itemsize: int, flops: float,
                    bandwidth: float, prefill: tuple | None = None):
    """Left: a decode step's time against the batch, measured, beside the roofline's
    ``max(params itemsize / W, 2 params B / F)``; right: the time per output token, with the
    prefill's time per prompt token (``prefill``: lengths and seconds) for comparison.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    import matplotlib.pyplot as plt
    b = np.asarray(batches, dtype=float)
    s = np.asarray(seconds)
    memory, compute = params * itemsize / bandwidth, 2 * params * b / flops
    roof = np.maximum(memory, compute)
    ridge = flops * itemsize / (2 * bandwidth)
    fig, (step, token) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    step.loglog(b, s * 1e3, "o-", label="decode step, measured")
    step.loglog(b, roof * 1e3, "k--", label="roofline: weights read, or FLOPs")
    step.axvline(ridge, color="C3", ls=":", label=f"critical batch {ridge:.0f}")
    step.set(xlabel="batch (sequences decoded together)", ylabel="ms per step",
             title="One decode step against the batch")
    token.loglog(b, s / b * 1e6, "o-", label="decode, per output token")
    token.loglog(b, roof / b * 1e6, "k--", label="roofline")
    if prefill is not None:
        lengths, prefill_s = (np.asarray(x, dtype=float) for x in prefill)
        token.loglog(lengths, prefill_s / lengths * 1e6, "s-", color="C2",
                     label="prefill, per prompt token (x = prompt length)")
    token.axvline(ridge, color="C3", ls=":")
    token.set(xlabel="tokens in one forward", ylabel="µs per token",
              title="Per token: batching pays until the ridge")
    for ax in (step, token):
        ax.legend(fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    return fig


@for_slides
def batching_figure(runs: dict):
    """Each policy's requests over time (waiting, then running) and the cache positions it
    allocated against those it used. ``runs``: policy name -> (requests, log) of
    :func:`paged_attention.serve`. Introduced in notebooks/18_serving_across_devices.ipynb."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(runs), figsize=(12, 6.4), layout="constrained",
                             sharex=True, squeeze=False)
    end = max(r.finished for requests, _ in runs.values() for r in requests)
    for column, (name, (requests, log)) in enumerate(runs.items()):
        gantt, cache = axes[0, column], axes[1, column]
        for i, r in enumerate(requests):
            gantt.barh(i, r.admitted - r.arrival, left=r.arrival, color="0.8")
            gantt.barh(i, r.finished - r.admitted, left=r.admitted, color="C0")
        gantt.set(title=f"{name}: requests (grey waiting, blue running)",
                  ylabel="request", xlim=(0, end * 1.02))
        gantt.invert_yaxis()
        t = [s["time"] for s in log]
        cache.fill_between(t, [s["allocated"] for s in log], step="post", color="C1", alpha=0.4,
                           label="allocated")
        cache.fill_between(t, [s["used"] for s in log], step="post", color="C0", alpha=0.8,
                           label="holding a token")
        cache.set(xlabel="seconds", ylabel="cache positions", title=f"{name}: the KV cache")
        cache.legend(fontsize=9, loc="upper right")
    return fig


@for_slides
def speculative_figure(rows: list[dict]):
    """Measured speed-up over the target alone against k for each draft, beside
    :func:`speculative.expected_speedup` with that draft's measured acceptance and cost and the
    target's measured cost of checking k + 1 tokens. ``rows``: dicts with draft, k, speedup,
    alpha, cost, verify.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.8), layout="constrained")
    for i, draft in enumerate(dict.fromkeys(r["draft"] for r in rows)):
        mine = [r for r in rows if r["draft"] == draft]
        ks = [r["k"] for r in mine]
        ax.plot(ks, [r["speedup"] for r in mine], "o-", color=f"C{i}", label=f"{draft}, measured")
        ax.plot(ks, [float(expected_speedup(r["alpha"], r["k"], r["cost"], r.get("verify", 1)))
                     for r in mine],
                "x--", color=f"C{i}", label=f"{draft}, (1 - a^(k+1)) / ((1 - a)(k c + v))")
    ax.axhline(1, color="k", lw=0.8)
    ax.set(xlabel="k (draft tokens per round)", ylabel="speed-up over the target alone",
           title="Speculative decoding: the draft's acceptance and cost decide")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return fig


@for_slides
def deployment_figure(model: serving.ServedModel = serving.LLAMA3_70B,
                      chip: serving.Chip = serving.TPU_V5E, chips: int = 8, length: int = 8192,
                      itemsize: float = 1):
    """A deployment on paper, tensor-parallel over ``chips``: memory per chip by kind against
    the batch (the chip's memory dashed), and each decode step's latency against throughput per
    chip as the batch grows.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    import matplotlib.pyplot as plt
    batches = np.array([1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256])
    held = [serving.serving_memory(model, int(b), length, chips, itemsize=itemsize)
            for b in batches]
    fig, (memory, frontier) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    memory.stackplot(batches, [h["weights"] / 1e9 for h in held],
                     [h["kv_cache"] / 1e9 for h in held], labels=["weights", "KV cache"])
    memory.axhline(chip.memory / 1e9, color="k", ls="--", label=f"{chip.name} memory")
    memory.set(xlabel="batch (requests)", ylabel="GB per chip",
               title=f"{model.name}, {chips} chips, {length} tokens, {itemsize:g} byte numbers")
    memory.legend(fontsize=9)
    for context in (2048, 8192, 32768):
        t = np.array([serving.decode_step_time(model, int(b), context, chip, chips,
                                               itemsize=itemsize) for b in batches])
        fits = np.array([sum(serving.serving_memory(model, int(b), context, chips,
                                                    itemsize=itemsize).values()) <= chip.memory
                         for b in batches])
        frontier.plot((batches / t / chips)[fits], (t * 1e3)[fits], "o-",
                      label=f"{context} tokens")
    frontier.set(xlabel="tokens per second per chip", ylabel="ms per decode step",
                 title="Latency against throughput (what fits)")
    frontier.legend(fontsize=9)
    frontier.grid(True, alpha=0.3)
    return fig


def save_all(out_dir):
    """Write the deployment planned on paper into ``out_dir``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    return [save_figure(deployment_figure(), out_dir, "18_deployment.png")]
