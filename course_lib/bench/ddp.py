"""``python -m course_lib bench ddp``: a data-parallel training step, from scratch vs torch DDP.

Introduced in notebooks/06_data_parallel_sgd.ipynb. Every rank of a local Gloo cluster trains
the same MLP (about 8M float32 parameters by default) on random batches; one step is forward,
backward, gradient averaging and an SGD update. Every configuration runs in the same run,
interleaved round by round so that a busy moment of the machine hits them all alike, and the
table reports the median over rounds of the slowest rank's step time::

    python -m course_lib bench ddp                          # 2 ranks, about 8M parameters
    python -m course_lib bench ddp --hidden 2560,2048 --batch 64 --csv ddp.csv
    python -m course_lib bench ddp --algorithm ring         # the course's own ring allreduce

Rows: the four strategies of :mod:`course_lib.ddp` (one allreduce per parameter tensor, one
flat buffer, buckets, buckets overlapped with backward) and torch's ``DistributedDataParallel``;
a bucket-size sweep of the overlapped strategy and of torch DDP; and one process without any
communication, on the per-rank batch (weak scaling) and on the global batch (strong scaling).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from course_lib.bench.common import parse_list, text_table, write_csv
from course_lib.comm.dist_checks import wait_work

HELP = "data-parallel step time: each strategy vs torch DDP"

TORCH = "torch DDP"
ONE_PROCESS = "1 process"
COLUMNS = ["strategy", "bucket_mb", "buckets", "ranks", "batch", "params", "step_ms",
           "samples_per_s", "vs_torch"]
DEFAULT_HIDDEN = (1024,) * 8       # with 1024 inputs and 10 outputs: 8.4M parameters
DEFAULT_BUCKETS = (1, 5, 25, 100)  # MiB; 25 is torch DDP's default cap (given, as here, it
                                   # caps the first bucket too: no 1 MiB first bucket)
TARGET = 0.95                      # the overlapped strategy against torch DDP
WAIT_S = 120.0                     # deadline of a barrier (rank 0 may be timing alone)


def make_configs(strategies, buckets=DEFAULT_BUCKETS, bucket_mb=25, world_size=2,
                 sweep_torch=True, one_process=True):
    """The ``(strategy, bucket_mb, batch_scale)`` triples of a run, in table order.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    configs = [(s, bucket_mb if s in ("bucketed", "overlap") else None, 1) for s in strategies]
    configs.append((TORCH, bucket_mb, 1))
    for mb in buckets:
        if mb != bucket_mb:
            configs.append(("overlap", mb, 1))
            if sweep_torch:
                configs.append((TORCH, mb, 1))
    if one_process:
        configs += [(ONE_PROCESS, None, 1), (ONE_PROCESS, None, world_size)]
    return configs


def _wrap(strategy, bucket_mb, model, algorithm):
    """The model wrapped for ``strategy``; and how many allreduces one step makes."""
    if strategy == ONE_PROCESS:
        return model, 0
    if strategy == TORCH:
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, bucket_cap_mb=bucket_mb), None
    from course_lib import ddp
    net = ddp.DistributedDataParallel(model, strategy=strategy, bucket_cap_mb=bucket_mb,
                                      algorithm=algorithm)  # the caps torch DDP would use
    return net, len(net.buckets)


def _torch_buckets(net):
    """Buckets of a torch DDP model after its first step (a private API: informative only)."""
    try:
        return len(str(net._get_ddp_logging_data()["rebuilt_bucket_sizes"]).split())
    except (AttributeError, KeyError, RuntimeError):
        return -1


def ddp_rank_bench(configs, in_features=1024, hidden=DEFAULT_HIDDEN, out_features=10, batch=32,
                   steps=2, rounds=5, warmup=1, algorithm="native", seed=0):
    """Time one training step of every config on this rank; returns the same rows everywhere.

    ``configs``: ``(strategy, bucket_mb, batch_scale)`` triples (see :func:`make_configs`): a
    strategy of ``ddp.STRATEGIES``, ``TORCH``, or ``ONE_PROCESS`` (rank 0 alone, without
    communication, on ``batch_scale * batch`` samples while the other ranks wait). Each round
    runs ``steps`` steps of every config in turn; a row holds the median over ``rounds`` of the
    slowest rank's mean step time (forward + backward + averaging + SGD step).

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_lib import models
    if rounds < 1 or steps < 1 or warmup < 0 or batch < 1:
        raise ValueError(f"need rounds, steps, batch >= 1 and warmup >= 0; got {rounds}, "
                         f"{steps}, {batch}, {warmup}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    runs = []
    for strategy, bucket_mb, scale in configs:
        model = models.mlp(in_features, list(hidden), out_features, seed=seed)
        net, buckets = _wrap(strategy, bucket_mb, model, algorithm)
        n = batch * scale
        runs.append(dict(strategy=strategy, bucket_mb=bucket_mb, scale=scale, net=net,
                         buckets=buckets, opt=torch.optim.SGD(model.parameters(), lr=1e-3),
                         x=torch.randn(n, in_features, generator=gen),
                         y=torch.randint(0, out_features, (n,), generator=gen)))
    n_params = sum(p.numel() for p in models.mlp(in_features, list(hidden), out_features)
                   .parameters())

    def step(run):
        loss = F.cross_entropy(run["net"](run["x"]), run["y"])
        run["opt"].zero_grad()
        loss.backward()      # the wrappers average the gradients before backward returns
        run["opt"].step()

    times = np.zeros((len(runs), rounds))
    for it in range(-warmup, rounds):
        for k, run in enumerate(runs):  # interleaved: drift on the machine hits every config
            wait_work(dist.barrier(async_op=True), WAIT_S,
                      f"barrier before timing {run['strategy']} (round {it})")
            t0 = time.perf_counter()
            if rank == 0 or run["strategy"] != ONE_PROCESS:
                for _ in range(steps):
                    step(run)
            if it >= 0:
                times[k, it] = (time.perf_counter() - t0) / steps
    slowest = torch.from_numpy(times)
    wait_work(dist.all_reduce(slowest, op=dist.ReduceOp.MAX, async_op=True), WAIT_S,
              f"allreduce of the {slowest.numel()} step times")  # ONE_PROCESS: others' ~0
    median = np.median(slowest.numpy(), axis=1)
    rows = []
    for k, run in enumerate(runs):
        alone = run["strategy"] == ONE_PROCESS
        ranks, n = (1 if alone else world_size), batch * run["scale"]
        buckets = _torch_buckets(run["net"]) if run["buckets"] is None else run["buckets"]
        rows.append(dict(strategy=run["strategy"], bucket_mb=run["bucket_mb"], buckets=buckets,
                         ranks=ranks, batch=n, params=n_params, step_ms=median[k] * 1e3,
                         samples_per_s=ranks * n / median[k], vs_torch=None))
    return add_ratios(rows)


def add_ratios(rows):
    """Fill ``vs_torch`` (throughput over torch DDP's, measured in the same run): against torch
    DDP with the same bucket size, else against its first row. Returns ``rows``.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    torch_ms = {r["bucket_mb"]: r["step_ms"] for r in rows if r["strategy"] == TORCH}
    first = next((r["step_ms"] for r in rows if r["strategy"] == TORCH), None)
    for r in rows:
        if first is not None and r["strategy"] != ONE_PROCESS:
            r["vs_torch"] = torch_ms.get(r["bucket_mb"], first) / r["step_ms"]
    return rows


def scaling(rows):
    """``(weak, speedup)``: the 1-process step time on the per-rank batch over the overlapped
    step (1.0 = perfect weak scaling), and the 1-process time on the global batch over it (the
    speed-up; ideal = number of ranks). None where a row is missing.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    dist_rows = [r for r in rows if r["strategy"] not in (ONE_PROCESS, TORCH)]
    best = next((r for r in dist_rows if r["strategy"] == "overlap"), None) or \
        (dist_rows[0] if dist_rows else None)
    alone = {r["batch"]: r["step_ms"] for r in rows if r["strategy"] == ONE_PROCESS}
    if best is None:
        return None, None
    weak = alone.get(best["batch"])
    strong = alone.get(best["batch"] * best["ranks"])
    return (weak / best["step_ms"] if weak else None,
            strong / best["step_ms"] if strong else None)


def format_ddp_table(rows, algorithm="native", target=True):
    """The rows as a text table, with the scaling lines (and the target line) underneath.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    if not rows:
        return "# no rows"
    r0, n = rows[0], max(r["ranks"] for r in rows)
    lines = [f"# one training step of an MLP with {r0['params']:,} float32 parameters "
             f"({r0['params'] * 4 / 2**20:.1f} MiB of gradients), {n} ranks (Gloo), "
             f"{algorithm} allreduce; median of the slowest rank"]
    lines += text_table(
        ["strategy", "bucket_MB", "buckets", "ranks", "batch", "step_ms", "samples/s", "vs torch"],
        [[r["strategy"], "-" if r["bucket_mb"] is None else f"{r['bucket_mb']:g}",
          "?" if r["buckets"] is None or r["buckets"] < 0 else r["buckets"], r["ranks"],
          r["batch"], f"{r['step_ms']:.1f}", f"{r['samples_per_s']:.0f}",
          "-" if r["vs_torch"] is None else f"{r['vs_torch']:.2f}x"] for r in rows])
    weak, speedup = scaling(rows)
    b = next((r["batch"] for r in rows if r["strategy"] == "overlap"), r0["batch"])
    if weak is not None:
        lines.append(f"# weak scaling efficiency, overlap: 1 process x {b} samples vs {n} ranks x "
                     f"{b}: {weak:.2f} (1.00 = communication fully hidden)")
    if speedup is not None:
        lines.append(f"# speed-up, overlap: 1 process x {b * n} samples vs {n} ranks x {b}: "
                     f"{speedup:.2f}x (ideal {n}x, efficiency {speedup / n:.0%})")
    if target:
        lines.append(target_line(rows))
    return "\n".join(lines)


def target_line(rows):
    """``# target: bucketed+overlap >= 0.95x torch DDP: ...``, from the rows at torch DDP's
    bucket size. Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    torch_row = next((r for r in rows if r["strategy"] == TORCH), None)
    mine = next((r for r in rows if r["strategy"] == "overlap" and torch_row is not None
                 and r["bucket_mb"] == torch_row["bucket_mb"]), None)
    if mine is None:
        return f"# target: bucketed+overlap >= {TARGET:.2f}x torch DDP: not measured"
    verdict = "met" if mine["vs_torch"] >= TARGET else "NOT met"
    return (f"# target: bucketed+overlap >= {TARGET:.2f}x torch DDP at "
            f"{torch_row['bucket_mb']:g} MB: {mine['vs_torch']:.3f}x, {verdict}")


# ---------------------------------------------------------------- the command line
def parse_hidden(text):
    """``"2560,2048"`` or ``"1024x8"`` (8 layers of 1024) -> a tuple of layer widths."""
    text = str(text).replace(" ", "")
    try:
        if "x" in text:
            width, depth = text.split("x")
            sizes = (int(width),) * int(depth)
        else:
            sizes = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--hidden: expected widths like 2560,2048 or 1024x8, not {text!r}")
    return sizes


def parse_buckets(text: str) -> list[float]:
    """``--buckets``: bucket caps in MB, each > 0 (``"1,5,25,100"``)."""
    return parse_list(text, float, 0, what="--buckets", example="1,5,25,100 (MB)")


def arguments(parser):
    """The options of ``python -m course_lib bench ddp``."""
    a = parser.add_argument
    a("--world-size", type=int, default=2, help="ranks of the local Gloo cluster (default 2)")
    a("--steps", type=int, default=2, help="steps per config and round (default 2)")
    a("--rounds", type=int, default=5, help="timed rounds; the table shows medians (default 5)")
    a("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    a("--in-features", type=int, default=1024, help="input width of the MLP (default 1024)")
    a("--hidden", default="1024x8",
      help="hidden widths: a comma list like 2560,2048 or WIDTHxDEPTH (default 1024x8: 8.4M "
           "parameters)")
    a("--buckets", default="1,5,25,100", help="bucket sizes of the sweep, MB (default 1,5,25,100)")
    a("--algorithm", choices=["native", "ring"], default="native",
      help="allreduce of the from-scratch strategies: the process group's or the course's ring")
    a("--no-sweep-torch", dest="sweep_torch", action="store_false",
      help="sweep bucket sizes for the overlapped strategy only")
    a("--timeout", type=float, default=300.0, help="deadline of the whole run, s (default 300)")
    a("--csv", help="also write the rows to this CSV file")


def main(args):
    """Run ``bench ddp`` with parsed ``args``; 0 when it ran."""
    from course_lib import ddp
    from course_lib.runtime.cluster import start_cluster
    try:
        hidden, buckets = parse_hidden(args.hidden), parse_buckets(args.buckets)
        if args.world_size < 2:
            raise ValueError("--world-size must be >= 2: data parallelism needs 2 ranks")
        configs = make_configs(ddp.STRATEGIES, [b if b % 1 else int(b) for b in buckets],
                               world_size=args.world_size, sweep_torch=args.sweep_torch)
        print(f"# starting {args.world_size} engines", file=sys.stderr)
        with start_cluster(n=args.world_size, backend="gloo", timeout=args.timeout) as cluster:
            rows = cluster.run(ddp_rank_bench, configs, args.in_features, hidden, 10, args.batch,
                               args.steps, args.rounds, 1, args.algorithm)[0]
    except (RuntimeError, TimeoutError, ValueError) as e:  # ClusterError, DDPError, bad options
        print(f"bench ddp: {e}", file=sys.stderr)
        return 1
    print(format_ddp_table(rows, args.algorithm))
    if args.csv:
        write_csv(rows, args.csv, COLUMNS)
    return 0
