"""``python -m course_lib demo`` (``make demo``): the headless tour an instructor runs.

Starts a local cluster, runs each part of the course briefly, prints one summary table and
writes the figures to ``demo_output/``. Each part is a function in ``PARTS``: it takes the
running cluster and the output folder and returns rows ``(what, result, check_passed)``.

An entry point, not a lesson: it imports the whole course (and the benchmarks' and tests'
helpers) at the top, as a command line does; only matplotlib waits for the one figure it draws.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from course_lib import (
    chief,
    data,
    decoding,
    gd,
    hpsearch,
    hpsearch_loop,
    ps,
    serving,
    sparse_problem,
    zero,
)
from course_lib import hogwild as hw
from course_lib.bench import ddp as bench_ddp
from course_lib.bench import serving as bench_serving
from course_lib.bench.allreduce import allreduce_rank_bench, format_size
from course_lib.figures import hyperparameter_search as hpsearch_figures
from course_lib.figures import save_figure
from course_lib.models import LinearRegression
from course_lib.parallel_gd import check_full_gradient
from course_lib.pipeline import bubble_fraction
from course_lib.runtime.cluster import Cluster, start_cluster
from course_lib.testing import context_parallel as context_runs
from course_lib.testing import ddp as ddp_check
from course_lib.testing import mesh as mesh_runs
from course_lib.testing import moe as moe_runs
from course_lib.testing import pipeline as pipeline_runs
from course_lib.testing import zero as zero_runs
from course_lib.transformer import GPT, GPTConfig

Row = tuple[str, str, bool]  # (what, result, check passed)


def gradient_descent(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Batch GD, SGD and mini-batch SGD on the same linear regression.

    Demonstrates notebooks/01_gradient_descent.ipynb."""
    X, y, _ = data.make_linear(n_samples=512, n_features=4, noise=0.5, seed=0)
    problem, theta0 = LinearRegression(), np.zeros(X.shape[1])
    best = problem.loss(np.linalg.lstsq(X, y, rcond=None)[0], X, y)
    runs = {"batch GD": gd.batch_gd(problem, X, y, theta0, lr=0.3, num_epochs=300),
            "SGD": gd.sgd(problem, X, y, theta0, lr=0.02, num_epochs=5, seed=0),
            "mini-batch SGD (32)": gd.minibatch_sgd(problem, X, y, theta0, lr=0.1, num_epochs=40,
                                                   batch_size=32, seed=0)}
    _plot_losses(runs, best, out_dir / "demo_gd_loss_curves.png")
    return [(name, f"{len(h.losses) - 1} updates, loss {h.final_loss:.4f} (optimum {best:.4f})",
             h.final_loss < 1.05 * best) for name, h in runs.items()]  # within 5% of optimum


def full_gradient(cluster: Cluster, out_dir: Path) -> list[Row]:
    """The full gradient as the sum of per-rank shard gradients.

    Demonstrates notebooks/00_welcome_and_cluster.ipynb (and notebook 02)."""
    error, _ = check_full_gradient(cluster, n_samples=1000, n_features=8)
    return [(f"sum of {cluster.n} shard gradients", f"max |error| vs 1 process {error:.1e}",
             error < 1e-12)]


def allreduce(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Ring allreduce against the naive one on an emulated 1 Gbit/s network, where the lesson
    shows, then against the native one on bare loopback, 4 MiB.

    Demonstrates notebooks/05_allreduce.ipynb."""
    size, link = 4 * 2**20, "1Gbit/s,50us"
    try:
        spec = cluster.set_link(link)
        emulated = cluster.run(allreduce_rank_bench, "torch", ["naive", "ring"], [size],
                               "float32", iters=3, warmup=1)[0]
    finally:
        cluster.set_link(None)
    loopback = cluster.run(allreduce_rank_bench, "torch", ["native", "naive", "ring"], [size],
                           "float32", iters=5, warmup=1)[0]
    e = {r["algorithm"]: r for r in emulated}
    t = {r["algorithm"]: r["time_us"] for r in loopback}
    speedup = e["naive"]["time_us"] / e["ring"]["time_us"]
    model = e["naive"]["predicted_us"] / e["ring"]["predicted_us"]  # 2 at 2 ranks, ~4 at 4
    ms = {name: (r["time_us"] / 1e3, r["predicted_us"] / 1e3) for name, r in e.items()}
    return [(f"ring allreduce {format_size(size)}, {cluster.n} ranks, emulated {spec}",
             f"ring {ms['ring'][0]:.0f} ms (model {ms['ring'][1]:.0f}), naive "
             f"{ms['naive'][0]:.0f} ms (model {ms['naive'][1]:.0f}): the ring is "
             f"{speedup:.1f}x as fast (model {model:.1f}x)",
             # each ring step also costs this laptop a few ms of its own (notebook 05)
             speedup >= 0.6 * model and all(r["wrong"] == 0 for r in emulated)),
            (f"ring allreduce {format_size(size)}, {cluster.n} ranks, bare loopback",
             f"{t['ring'] / 1e3:.1f} ms; native {t['native'] / 1e3:.1f} ms, naive "
             f"{t['naive'] / 1e3:.1f} ms (ring's speed: {t['native'] / t['ring']:.1f}x native's, "
             f"{t['naive'] / t['ring']:.1f}x naive's; loopback has no links to spare: see "
             "notebook 05)", all(r["wrong"] == 0 for r in loopback))]


def parameter_server(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Sync vs async parameter server, 1 server and the other ranks as workers.

    Demonstrates notebooks/04_parameter_server.ipynb."""
    X, y, _ = data.make_linear(n_samples=600, n_features=8, noise=0.5, seed=0)
    problem, theta0 = LinearRegression(), np.zeros(X.shape[1])
    spec = ps.make_spec(1, cluster.n - 1, world_size=cluster.n)
    kw = dict(lr=0.05, num_epochs=4, batch_size=32)
    ref = gd.minibatch_sgd(problem, X, y, theta0, seed=0, **kw).final_theta
    rows = []
    for mode in ("sync", "async"):
        # async: a random pause before each push (mean 5 ms), as uneven workers have, so that
        # pushes interleave; without it these tiny steps take turns and are never stale
        r = ps.train(cluster, spec, problem, X, y, theta0, mode=mode,
                     delay=0.005 if mode == "async" else 0.0, **kw)
        loss = problem.loss(r.theta, X, y)
        ok = (np.abs(r.theta - ref).max() < 1e-6 if mode == "sync"
              else loss < 1.1 * problem.loss(ref, X, y))
        rows.append((f"parameter server {mode}, 1 server + {cluster.n - 1} workers",
                     f"loss {loss:.4f}, {r.pushes_per_s:.0f} pushes/s, mean staleness "
                     f"{r.staleness.mean():.2f}", bool(ok)))
    return rows


def hogwild(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Hogwild speed-up on sparse logistic regression: 2 lock-free workers vs 1 and vs locked
    (notebooks/03_hogwild.ipynb). The engines are not used: these are worker processes on
    shared memory."""
    dataset = sparse_problem.make_sparse_classification(n_samples=10_000, n_features=10_000,
                                                        nnz=16, seed=0)
    _, serial = sparse_problem.serial_sgd(dataset, lr=0.5, num_epochs=2)
    runs = {c: [] for c in [(1, False), (2, False), (2, True)]}
    for _ in range(3):  # interleaved, median
        for w, lock in runs:
            runs[(w, lock)].append(hw.run_sparse(dataset, num_workers=w, lock=lock, lr=0.5,
                                                 num_epochs=2))
    speed = {c: float(np.median([r.samples_per_s for r in rs])) for c, rs in runs.items()}
    free = runs[(2, False)][-1]
    close = abs(free.final_loss / serial[-1] - 1) < 0.05
    return [("Hogwild, 2 lock-free workers (sparse)",
             f"{speed[(2, False)] / speed[(1, False)]:.2f}x 1 worker, "
             f"{speed[(2, False)] / speed[(2, True)]:.2f}x locked; loss {free.final_loss:.4f} "
             f"vs serial {serial[-1]:.4f}, {free.conflict_rate:.2%} updates conflicted", close)]


def data_parallel(cluster: Cluster, out_dir: Path) -> list[Row]:
    """From-scratch DDP (buckets overlapped with backward) against torch's DDP: parameters after
    3 steps on the digits, and the step time of each measured side by side
    (notebooks/06_data_parallel_sgd.ipynb)."""
    ours = cluster.run(ddp_check.train_on_rank, "overlap", steps=3)
    reference = cluster.run(ddp_check.train_on_rank, "torch", steps=3)[0]["params"]
    error = ddp_check.max_difference(ours, reference)
    configs = [("overlap", 1, 1), (bench_ddp.TORCH, 1, 1)]
    rows = cluster.run(bench_ddp.ddp_rank_bench, configs, 256, (256,) * 4, 10, 32, 2, 3)[0]
    return [(f"from-scratch DDP vs torch DDP, {cluster.n} ranks",
             f"parameters after 3 steps differ by {error:.1e}; step throughput "
             f"{rows[0]['vs_torch']:.2f}x torch DDP's", error < 1e-10)]


def pipeline(cluster: Cluster, out_dir: Path) -> list[Row]:
    """A 1F1B pipeline over every rank: gradients equal to one process, and the bubble of
    sleeping stages (10 ms forward, 20 ms backward) measured against (N-1)/(M+N-1)
    (notebooks/09_model_parallelism.ipynb)."""
    M = 2 * cluster.n  # micro-batches: twice the stages, a bubble of (N-1)/(3N-1)
    error = max(r["grad"] for r in cluster.run(pipeline_runs.pipeline_matches_one_process,
                                               "1f1b", M))
    bubble, seconds = pipeline_runs.measured_bubble(
        cluster.run(pipeline_runs.timed_step, "1f1b", M, 0.01, 0.02))
    formula = bubble_fraction(cluster.n, M)
    return [(f"1F1B pipeline, {cluster.n} stages, {M} micro-batches",
             f"gradients differ from one process by {error:.1e}; bubble {bubble:.2f} measured, "
             f"{formula:.2f} by (N-1)/(M+N-1)", error < 1e-10 and abs(bubble - formula) < 0.1)]


def sharded(cluster: Cluster, out_dir: Path) -> list[Row]:
    """ZeRO-3 over every rank: the memory a rank holds against DDP's, training under a budget
    one process cannot, and the same parameters as torch FSDP2
    (notebooks/10_sharded_data_parallelism.ipynb)."""
    one = zero.planned_memory(zero_runs.deep_model(), 1, 0)["total"]
    # 10% above what ZeRO-3 on these ranks needs: 42% of what one process (or a DDP rank)
    # holds on 4 ranks, 60% on 2
    budget = int(1.1 * zero.planned_memory(zero_runs.deep_model(), cluster.n, 3)["total"])
    reports = cluster.run(zero_runs.train_under_budget, budget, 3)
    held = max(r["peak"]["total"] for r in reports)
    fsdp = max(cluster.run(zero_runs.fsdp2_matches, 3, "adam"))
    ok = (all(r["refused"] is None for r in reports) and held <= budget
          and max(r["diff"] for r in reports) < 1e-10 and fsdp < 1e-10)
    return [(f"ZeRO-3, {cluster.n} ranks, budget {budget / 1024:.0f} KiB per rank",
             f"holds {held / 1024:.0f} KiB per rank vs DDP's {one / 1024:.0f} KiB; equal to one "
             f"process ({max(r['diff'] for r in reports):.0e}) and to torch FSDP2 ({fsdp:.0e})",
             ok)]


def fault_tolerance(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Data-parallel training with the chief's checkpoints every 5 steps, rank 1 killed at its
    13th step, the engines restarted and training resumed: steps lost, and the parameters
    against the uninterrupted run (notebooks/11_fault_tolerance.ipynb)."""
    work = Path(tempfile.mkdtemp(prefix="demo-ckpt-"))
    K = 5
    clean = chief.supervise(cluster, work / "clean", 24, K, report=lambda line: None)
    run = chief.supervise(cluster, work / "killed", 24, K, report=lambda line: None,
                          faults=[f"train-step:kill@13:rank={cluster.n - 1}"])
    exact = all(torch.equal(p, clean.params[0]) for p in run.params)
    return [(f"rank {cluster.n - 1} killed, {cluster.n} ranks, checkpoints every {K} steps",
             f"{run.restarts} restart, {run.recomputed} step(s) computed twice (at most {K}); "
             f"parameters equal to the uninterrupted run: {exact}",
             run.restarts == 1 and max(run.recomputed) <= K and exact)]


def hyperparameter_search(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Synchronous successive halving against ASHA on the same epochs, with trials that sleep
    for their training time: how busy the engines were, and a Gantt chart of both.

    Demonstrates notebooks/13_hyperparameter_search.ipynb."""
    kw = dict(min_epochs=1, max_epochs=9, eta=3, trial=hpsearch_loop.sleep_trial, epoch_s=0.03)
    sh = hpsearch.successive_halving(cluster, num_configs=27, **kw)
    asha = hpsearch.asha(cluster, budget=sh.epochs_spent, **kw)
    save_figure(hpsearch_figures.gantt([sh, asha])[0].figure, out_dir,
                "demo_hpsearch_gantt.png")

    def first_promotion_before_rung0_ends(r):
        return min(j.start for j in r.jobs if j.rung == 1) < max(
            j.end for j in r.jobs if j.rung == 0)
    ok = (asha.epochs_spent == sh.epochs_spent and first_promotion_before_rung0_ends(asha)
          and not first_promotion_before_rung0_ends(sh))
    rng = np.random.default_rng(0)
    configs = [hpsearch.sample(hpsearch.SPACE, rng) for _ in range(81)]
    sim = [hpsearch_loop.simulate(policy, 64) for policy in (
        hpsearch.SuccessiveHalving(configs, 1, 27, 3),
        hpsearch.ASHA(iter(configs * 4), 1, 27, 3, hpsearch.halving_budget(81, 1, 27, 3)))]
    return [(f"ASHA vs synchronous successive halving, {sh.epochs_spent} epochs",
             f"engines busy {asha.busy_fraction():.0%} vs {sh.busy_fraction():.0%}; "
             f"{asha.elapsed:.1f}s vs {sh.elapsed:.1f}s; ASHA promotes before rung 0 ends", ok),
            ("the same, simulated: 81 configurations, 64 engines",
             f"engines busy {sim[1].busy_fraction():.0%} vs {sim[0].busy_fraction():.0%}; "
             f"ASHA done in {sim[0].elapsed / sim[1].elapsed:.1f}x less time",
             sim[1].elapsed < sim[0].elapsed)]


def long_sequences(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Ring attention over every rank (float64, forward and backward) against one process, and
    each rank's causal work with contiguous chunks and with the zig-zag
    (notebooks/14_transformers_and_long_sequences.ipynb)."""
    length = 64 * cluster.n
    rows = {layout: cluster.run(context_runs.ring_attention_error_on_rank, length, 0, layout)
            for layout in ("contiguous", "zigzag")}
    error = max(r["error"] for layout in rows.values() for r in layout)
    blocks = {layout: [r["blocks"] for r in ranks] for layout, ranks in rows.items()}
    return [(f"ring attention, {cluster.n} ranks, sequence of {length}",
             f"output and gradients differ from one process by {error:.1e}; blocks attended per "
             f"rank: contiguous {blocks['contiguous']}, zig-zag {blocks['zigzag']}",
             error < 1e-10 and blocks["contiguous"] == list(range(1, cluster.n + 1))
             and len(set(blocks["zigzag"])) == 1)]


def mixture_of_experts(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Expert parallelism over every rank (float64, top-2, capacity 1.0: tokens dropped) against
    one process, and the course's all-to-all against Gloo's on 1 MiB per rank
    (notebooks/15_mixture_of_experts.ipynb)."""
    experts = 2 * cluster.n
    rows = cluster.run(moe_runs.expert_parallel_error_on_rank, experts, 2, 1.0)
    error = max(r["error"] for r in rows)
    same = all(r["same_dropped"] for r in rows)
    ours, native = (max(cluster.run(moe_runs.all_to_all_time_on_rank, a, 2**20))
                    for a in ("pairwise", "native"))
    return [(f"expert parallelism, {experts} experts on {cluster.n} ranks",
             f"output and gradients differ from one process by {error:.1e}; the same "
             f"{sum(r['dropped'] for r in rows)} choices dropped: {same}",
             error < 1e-10 and same),
            ("all-to-all, pairwise exchange vs Gloo (1 MiB per rank)",
             f"{1e3 * ours:.2f} ms vs {1e3 * native:.2f} ms: {ours / native:.1f}x native's time",
             ours > 0 and native > 0)]


def planning_a_run(cluster: Cluster, out_dir: Path) -> list[Row]:
    """The transformer on a mesh of every rank (context and tensor parallelism when there
    are 4, tensor parallelism on 2), equal to one process, and the planner's bytes per rank
    beside what each rank held (notebooks/16_planning_a_run.ipynb)."""
    shape = ({"dp": cluster.n} if cluster.n % 2 else
             {"tp": 2} if cluster.n == 2 else {"cp": cluster.n // 2, "tp": 2})
    rows = cluster.run(mesh_runs.mesh_training_on_rank, shape, 2)
    error = max(max(r["loss_error"], r["param_error"]) for r in rows)
    wrong = mesh_runs.plan_differences(rows, shape)
    held = rows[0]["memory"]
    return [(f"transformer on a mesh {shape}",
             f"losses and parameters differ from one process by {error:.1e}; planned bytes per "
             f"rank = held ({sum(held.values()) / 1024:.0f} KiB): {not wrong}",
             error < 1e-10 and not wrong)]


def serving_across_devices(cluster: Cluster, out_dir: Path) -> list[Row]:
    """Greedy decoding split over every rank by tensor parallelism (one head each) against one
    process, and continuous batching with a paged cache against static batching with a
    contiguous one, on the same requests and the same cache memory
    (notebooks/18_serving_across_devices.ipynb)."""
    cfg = GPTConfig(context=64, d_model=16 * cluster.n, n_heads=cluster.n)
    model = GPT(cfg).eval()
    prompts = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    ranks = cluster.run(serving.generate_on_rank, model.state_dict(), vars(cfg), prompts, 20)
    alone = decoding.generate(model, prompts, 20)
    same = all(torch.equal(r["tokens"], alone) for r in ranks)
    static, paged = bench_serving.batching_rows(model, 16)  # the same requests, both ways
    return [(f"tensor-parallel decoding, {cluster.n} ranks",
             f"20 tokens of 2 prompts equal to one process: {same}; "
             f"{ranks[0]['allreduces_per_step']} allreduces a token", same),
            ("continuous (paged) vs static (contiguous) batching, 16 requests",
             f"{paged['tokens_per_s']:.0f} vs {static['tokens_per_s']:.0f} tokens/s, "
             f"{paged['steps']} vs {static['steps']} steps; the same answers: "
             f"{paged['same_answers']}",
             paged["same_answers"] and paged["steps"] < static["steps"])]


PARTS = [gradient_descent, full_gradient, allreduce, parameter_server, hogwild, data_parallel,
         pipeline, sharded, fault_tolerance, hyperparameter_search, long_sequences,
         mixture_of_experts, planning_a_run, serving_across_devices]


def _plot_losses(runs, best, path):
    import matplotlib  # here: the Agg backend (no window) is chosen only when the demo draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, h in runs.items():
        ax.semilogy(np.linspace(0, 1, len(h.losses)), np.array(h.losses) - best + 1e-12,
                    label=name)
    ax.set(xlabel="fraction of the run", ylabel="loss - optimum", title="Same data, three methods")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(n: int = 4, out_dir: str | Path = "demo_output") -> int:
    """Run every part; print the table; return 0 when every check passed.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    with start_cluster(n=n) as cluster:
        start = time.perf_counter() - t0
        rows.append(("cluster", f"{n} engines + {cluster.backend} process group in {start:.1f}s",
                     True))
        for part in PARTS:
            t = time.perf_counter()
            for what, result, ok in part(cluster, out_dir):
                rows.append((what, f"{result}  [{time.perf_counter() - t:.1f}s]", ok))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'part':<{width}}  ok  result")
    print(f"{'-' * width}  --  {'-' * 60}")
    for what, result, ok in rows:
        print(f"{what:<{width}}  {'✓' if ok else '✗'}   {result}")
    failed = [r[0] for r in rows if not r[2]]
    print(f"\ndemo: {len(rows) - len(failed)}/{len(rows)} checks passed in "
          f"{time.perf_counter() - t0:.0f}s; figures in {out_dir}/")
    return 1 if failed else 0
