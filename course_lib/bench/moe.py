"""``python -m course_lib bench moe``: a mixture of experts measured, in one process and on a
cluster. Introduced in notebooks/15_mixture_of_experts.ipynb.

* **balance** (one process): the transformer with 4 experts per block trained with and without
  the load-balancing loss: the tokens each expert of the first block got at each step (the
  heat map of notebook 15), the busiest expert's share at the end; and the cross-entropy beside
  the dense model with as many active parameters per token and with as many in all;
* **capacity** (each N of ``--world-sizes``): expert parallelism with a router that favours
  expert 0 (``--skew``), for each capacity factor: the choices dropped, each rank's expert CPU
  time (the hot expert's rank is the straggler) and the step time;
* **all-to-all**: seconds per size on the emulated link, pairwise exchange and the naive one
  through rank 0 against their models, and Gloo's ``all_to_all_single`` (which runs inside Gloo,
  off the emulated link: the machine's own speed);
* **experts split or sliced**: one forward and backward of the same layer with expert
  parallelism (each rank its tokens and E/N experts) and tensor parallelism (every rank every
  token and 1/N of each expert): bytes each rank sent, measured, and the step time on each link
  against the model (computation without a link + messages x alpha + bytes x beta).

    python -m course_lib bench moe                      # N = 4; 1 KiB to 1 MiB; 10G and 100M
    python -m course_lib bench moe --steps 600 --world-sizes 2,4 --csv moe.csv
"""

from __future__ import annotations

import sys

import numpy as np

from course_lib import costmodel
from course_lib import transformer as tf
from course_lib.bench.attention import cores, links
from course_lib.bench.common import (
    argtype,
    format_size,
    memcpy_bandwidth,
    parse_list,
    parse_sizes,
    text_table,
    write_csv,
)
from course_lib.moe import MoEConfig
from course_lib.runtime import netem
from course_lib.runtime.cluster import start_cluster
from course_lib.testing.moe import all_to_all_time_on_rank, moe_step_on_rank

HELP = "mixture of experts: load with and without the balance loss, capacity, all-to-all, EP vs TP"
EXPERTS = 4


def arguments(parser):
    """The options of ``python -m course_lib bench moe``."""
    a = parser.add_argument
    a("--world-sizes", type=argtype(lambda t: parse_list(t, what="world sizes", example="2,4")),
      default=[4], help="comma list (default 4)")
    a("--steps", type=int, default=150, help="training steps of the balance runs (default 150)")
    a("--sizes", type=argtype(parse_sizes), default=parse_sizes("1KiB,32KiB,1MiB"),
      help="all-to-all bytes per rank (default 1KiB,32KiB,1MiB)")
    a("--links", type=argtype(links), default=links("10Gbit/s,10us;100Mbit/s,100us"),
      help="emulated networks, ';'-separated (default 10Gbit/s,10us;100Mbit/s,100us)")
    a("--capacity-factors", type=argtype(lambda t: [None if x == "none" else float(x)
                                                    for x in t.split(",")]),
      default=[None, 2.0, 1.25, 1.0], help="'none' for no limit (default none,2,1.25,1)")
    a("--skew", type=float, default=3.0, help="the router's push towards expert 0 (default 3)")
    a("--repeats", type=int, default=3, help="timed steps per point (default 3)")
    a("--csv", help="also write the rows to this CSV file")


# ---------------------------------------------------------------- one process: the load
def train_runs(steps: int, seed: int = 0, progress: bool = False) -> dict:
    """Train the dense model, the dense model as large as the mixture in all, and the mixture
    (4 experts, top-1) with and without the load-balancing loss, on the same batches. Returns,
    per run, the cross-entropy per step and (mixtures) the tokens per expert of the first
    block at each step, an array (steps, experts). ``progress=True`` shows a bar
    (``tqdm.auto``) naming the run under way, removed when done."""
    from tqdm.auto import tqdm  # only when training: a progress bar
    data = tf.encode(tf.load_text())
    configs = {"dense": tf.GPTConfig(),
               "dense, as many parameters in all": tf.GPTConfig(hidden=4 * 64 * EXPERTS),
               "experts, balance loss": MoEConfig(experts=EXPERTS),
               "experts, no balance loss": MoEConfig(experts=EXPERTS, aux_weight=0.0)}
    runs = {}
    bar = tqdm(total=steps * len(configs), desc="training", disable=not progress, leave=False)
    try:
        for name, cfg in configs.items():
            bar.set_postfix_str(name)
            loads: list = []

            def record(model, loads=loads, cfg=cfg):
                if cfg.experts:
                    loads.append(model.blocks[0].mlp.routing.load.numpy().copy())
                bar.update()

            model = tf.GPT(cfg, seed=seed)
            losses = tf.train(model, data, steps=steps, seed=seed, after_step=record)
            runs[name] = dict(losses=np.array(losses), loads=np.array(loads),
                              parameters=model.num_parameters())
    finally:
        bar.close()
    return runs


# ---------------------------------------------------------------- on a cluster
def measure_capacity(cluster, factors: list, skew: float, repeats: int) -> list[dict]:
    """Expert parallelism with a skewed router, each capacity factor: per-rank rows, expert
    CPU seconds, step seconds; dropped choices in all."""
    rows = []
    for factor in factors:
        got = cluster.run(moe_step_on_rank, "ep", skew, factor, EXPERTS, repeats=repeats)
        rows.append(dict(world_size=cluster.n, capacity_factor=factor or "none",
                         dropped=sum(r["dropped"] for r in got),
                         rows=[r["rows"] for r in got], busy_ms=[1e3 * r["busy_s"] for r in got],
                         step_ms=max(1e3 * r["seconds"] for r in got)))
    return rows


def measure_all_to_all(cluster, sizes: list[int], link: netem.Link, repeats: int) -> list[dict]:
    """Each size: pairwise and naive on ``link`` with their models, native off it."""
    rows = []
    model = link.costmodel()
    for size in sizes:
        row = dict(world_size=cluster.n, bytes=size, link=str(link))
        cluster.set_link(link)
        try:
            for algorithm in ("pairwise", "naive"):
                row[f"{algorithm}_ms"] = 1e3 * max(cluster.run(
                    all_to_all_time_on_rank, algorithm, size, repeats))
                row[f"{algorithm}_model_ms"] = 1e3 * costmodel.all_to_all_time(
                    size, cluster.n, model, algorithm)
        finally:
            cluster.set_link(None)
        row["native_ms"] = 1e3 * max(cluster.run(all_to_all_time_on_rank, "native", size,
                                                 repeats))
        rows.append(row)
    return rows


def messages(method: str, n: int) -> int:
    """Messages one rank sends in a step: EP, four all-to-alls of rows (dispatch and combine,
    forward and backward), the counts' all-to-all and the load's ring allreduce; TP, two ring
    allreduces."""
    return 4 * (n - 1) + (n - 1) + 2 * (n - 1) if method == "ep" else 2 * 2 * (n - 1)


def measure_split(cluster, link_list: list, repeats: int) -> list[dict]:
    """EP and TP of the same layer: bytes sent per rank and step time per link, with models."""
    rows = []
    base = {m: min((cluster.run(moe_step_on_rank, m, repeats=repeats) for _ in range(2)),
                   key=lambda rows: max(r["seconds"] for r in rows)) for m in ("ep", "tp")}
    for link in link_list:
        model = link.costmodel()
        cluster.set_link(link)
        try:
            got = {m: cluster.run(moe_step_on_rank, m, repeats=repeats) for m in ("ep", "tp")}
        finally:
            cluster.set_link(None)
        row = dict(world_size=cluster.n, link=str(link))
        for m in ("ep", "tp"):
            sent = max(r["sent"] for r in got[m])
            compute = max(r["seconds"] for r in base[m])
            row.update({f"{m}_sent": sent, f"{m}_ms": 1e3 * max(r["seconds"] for r in got[m]),
                        f"{m}_model_ms": 1e3 * (compute + messages(m, cluster.n) * model.alpha
                                                + sent * model.beta)})
        rows.append(row)
    return rows


def main(args):
    if args.repeats < 1 or args.steps < 1:
        print("bench moe: --repeats and --steps must be at least 1", file=sys.stderr)
        return 1
    bad = [n for n in args.world_sizes if EXPERTS % n]
    if bad:
        print(f"bench moe: {EXPERTS} experts do not split over {bad[0]} ranks", file=sys.stderr)
        return 1
    runs = train_runs(args.steps)
    capacity, a2a, split = [], [], []
    try:
        for n in args.world_sizes:
            print(f"# starting {n} engines", file=sys.stderr)
            with start_cluster(n=n, timeout=300) as cluster:
                capacity += measure_capacity(cluster, args.capacity_factors, args.skew,
                                             args.repeats)
                a2a += measure_all_to_all(cluster, args.sizes, args.links[-1], args.repeats)
                split += measure_split(cluster, args.links, args.repeats)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"bench moe: {e}", file=sys.stderr)
        return 1
    print(format_tables(runs, capacity, a2a, split))
    print(f"# ceiling: memcpy {memcpy_bandwidth():.1f} GB/s on one core; {cores()} cores "
          "(N ranks on fewer cores compute at cores/N of a core's speed)")
    if args.csv:  # one file: each row names its table
        balance = [dict(run=name, parameters=r["parameters"],
                        final_loss=float(r["losses"][-10:].mean())) for name, r in runs.items()]
        tables = dict(balance=balance, capacity=capacity, all_to_all=a2a, split=split)
        rows = [dict(table=name, **r) for name, table in tables.items() for r in table]
        write_csv(rows, args.csv, list(dict.fromkeys(k for r in rows for k in r)))
    return 0


def busiest_share(loads: np.ndarray, last: int = 10) -> float:
    """The busiest expert's share of the choices over the last ``last`` steps."""
    total = loads[-last:].sum(axis=0)
    return float(total.max() / total.sum())


def format_tables(runs, capacity, a2a, split) -> str:
    """The four tables, each with its header."""
    out = ["# balance: cross-entropy (nats per byte, last 10 steps) and the busiest expert's "
           f"share of the first block's tokens (even: 1/{EXPERTS})"]
    out += text_table(["run", "parameters", "loss", "busiest expert"], [
        [name, f"{r['parameters']:,}", f"{r['losses'][-10:].mean():.3f}",
         f"{busiest_share(r['loads']):.0%}" if len(r["loads"]) else "-"]
        for name, r in runs.items()])
    out.append("# capacity: expert parallelism, router skewed towards expert 0")
    out += text_table(["N", "capacity", "dropped", "rows per rank", "expert ms per rank",
                       "step ms"], [
        [r["world_size"], r["capacity_factor"], r["dropped"], r["rows"],
         [round(b, 1) for b in r["busy_ms"]], f"{r['step_ms']:.1f}"] for r in capacity])
    out.append("# all-to-all: ms per call, measured and model (native: Gloo, off the link)")
    out += text_table(["N", "bytes", "link", "pairwise", "model", "naive", "model", "native"], [
        [r["world_size"], format_size(r["bytes"]), r["link"]]
        + [f"{r[k]:.2f}" for k in ("pairwise_ms", "pairwise_model_ms", "naive_ms",
                                   "naive_model_ms", "native_ms")] for r in a2a])
    out.append("# experts split (EP) or sliced (TP): one step of the layer, bytes sent per rank "
               "and ms, measured and model")
    out += text_table(["N", "link", "EP sent", "EP ms", "model", "TP sent", "TP ms", "model"], [
        [r["world_size"], r["link"], format_size(r["ep_sent"]), f"{r['ep_ms']:.1f}",
         f"{r['ep_model_ms']:.1f}", format_size(r["tp_sent"]), f"{r['tp_ms']:.1f}",
         f"{r['tp_model_ms']:.1f}"] for r in split])
    return "\n".join(out)
