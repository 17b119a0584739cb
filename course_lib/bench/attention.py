"""``python -m course_lib bench attention``: splitting the sequence, measured on a cluster and
against the models. Introduced in notebooks/14_transformers_and_long_sequences.ipynb.

For each world size N and sequence length T (float32, 4 heads of 32, one sequence):

* **balance**: each rank's attention CPU time in ring attention's forward, contiguous chunks
  against the zig-zag, as the slowest rank over the mean (counted in pairs of chunks of T/2N:
  4N against a mean of 2(N+1) for contiguous ranks, 2N+1 each for the zig-zag);
* **the links**: one forward's seconds on each emulated link of ``--links``, slower and
  slower: ring attention (zig-zag), Ulysses and tensor parallelism's attention (H/N heads of
  every token, then its output projection's allreduce), each beside the alpha-beta model of its
  messages (ring: N - 1 key/value blocks passed on, each hidden under a block's computation if
  that takes longer; Ulysses: two all-to-alls; TP: one ring allreduce of the output), and
  torch's own attention on the whole sequence in one process, the native baseline;
* **memory**: the activation bytes one block keeps per rank with TP and TP + SP, by formula.

    python -m course_lib bench attention                     # N = 2, 4; T = 512, 1024
    python -m course_lib bench attention --lengths 2048 --links "1Gbit/s,50us" --csv a.csv
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from course_lib import costmodel, netem
from course_lib import sequence_parallel as sp
from course_lib.bench.common import argtype, memcpy_bandwidth, parse_list, text_table, write_csv
from course_lib.cluster import start_cluster
from course_lib.testing.context_parallel import time_attention_on_rank

HELP = "ring attention (contiguous, zig-zag), Ulysses, TP: balance, time as the link slows"
HEADS, DIM, ITEM = 4, 32, 4  # the timed attention: heads, head size, float32


def ints(text: str) -> list[int]:
    """'2,4' -> [2, 4]."""
    return parse_list(text, what="world sizes and lengths", example="2,4")


def links(text: str) -> list[netem.Link]:
    """'10Gbit/s,10us;1Gbit/s,50us' -> two emulated links."""
    return [netem.make_link(part.strip()) for part in text.split(";") if part.strip()]


def arguments(parser):
    """The options of ``python -m course_lib bench attention``."""
    a = parser.add_argument
    a("--world-sizes", type=argtype(ints), default=[2, 4], help="comma list (default 2,4)")
    a("--lengths", type=argtype(ints), default=[512, 1024], help="comma list (default 512,1024)")
    a("--links", type=argtype(links), default=links("10Gbit/s,10us;1Gbit/s,50us;100Mbit/s,100us"),
      help="emulated networks of the timed forwards, ';'-separated "
           "(default 10Gbit/s,10us;1Gbit/s,50us;100Mbit/s,100us)")
    a("--repeats", type=int, default=3, help="forwards per point (default 3)")
    a("--csv", help="also write the rows to this CSV file")


def one_process_seconds(length: int, repeats: int) -> float:
    """torch's attention on the whole sequence in this process: the native baseline."""
    q, k, v = (torch.randn(1, HEADS, length, DIM) for _ in range(3))
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


def model_seconds(method: str, length: int, n: int, link: netem.Link, busy_s: float) -> float:
    """The alpha-beta model of one forward on ``link``; ``busy_s``: a zig-zag ring rank's
    attention compute, measured (Ulysses computes its heads' whole T x T, masked half
    included: 4N/(2N+1) times the zig-zag rank's chunk pairs)."""
    model = link.costmodel()
    if method == "ring":  # N - 1 blocks passed on, each overlapping one block's computation
        block = 2 * HEADS * (length // n) * DIM * ITEM  # keys and values of one rank
        per_step = busy_s / n
        return (n - 1) * max(model.alpha + block * model.beta, per_step) + per_step
    dense = busy_s * 4 * n / (2 * n + 1)  # whole heads: every pair of chunks computed
    if method == "tp":  # every token of H/N heads, then the output projection's allreduce
        return dense + costmodel.allreduce_time("ring", HEADS * length * DIM * ITEM, n, model)
    qkv = 3 * HEADS * (length // n) * DIM * ITEM  # this rank's Q, K and V of every head
    return (costmodel.all_to_all_time(qkv, n, model) + dense
            + costmodel.all_to_all_time(qkv / 3, n, model))


def main(args):
    if args.repeats < 1:
        print("bench attention: --repeats must be at least 1", file=sys.stderr)
        return 1
    rows = []
    try:
        for n in args.world_sizes:
            print(f"# starting {n} engines", file=sys.stderr)
            with start_cluster(n=n, timeout=300) as cluster:
                for length in args.lengths:
                    if length % (2 * n) or HEADS % n:
                        raise ValueError(f"length {length} is not divisible by 2N = {2 * n} "
                                         f"(or {HEADS} heads by N)")
                    rows += measure(cluster, n, length, args.links, args.repeats)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"bench attention: {e}", file=sys.stderr)
        return 1
    header = ["N", "T", "link", "slowest/mean contiguous", "zig-zag", "ring ms", "model",
              "Ulysses ms", "model", "TP ms", "model", "torch 1 proc ms", "TP KiB", "TP+SP KiB"]
    print("\n".join(text_table(header, [[
        r["world_size"], r["length"], r["link"], f"{r['contiguous_imbalance']:.2f}",
        f"{r['zigzag_imbalance']:.2f}"] + [f"{r[k]:.1f}" for k in (
            "ring_ms", "ring_model_ms", "ulysses_ms", "ulysses_model_ms", "tp_ms", "tp_model_ms")]
        + [f"{r['native_ms']:.2f}", f"{r['tp_kib']:.0f}", f"{r['tp_sp_kib']:.0f}"]
        for r in rows])))
    print(f"# ceiling: memcpy {memcpy_bandwidth():.1f} GB/s on one core. Work of the slowest "
          "rank over the mean, in pairs of chunks: contiguous 2N/(N+1), zig-zag 1.00. Memory "
          "per rank: one block of d = 128, float32, by sequence_parallel.activation_bytes_formula")
    if args.csv:
        write_csv(rows, args.csv)
    return 0


def measure(cluster, n: int, length: int, link_list: list, repeats: int) -> list[dict]:
    """One row per link: the balance (off the link), then each method's forward on the link."""
    busy = {lay: [r["busy_s"] for r in cluster.run(time_attention_on_rank, "ring", length, lay,
                                                   repeats)]
            for lay in ("contiguous", "zigzag")}
    compute = float(np.mean(busy["zigzag"]))  # a rank's attention, balanced
    native = one_process_seconds(length, repeats)
    rows = []
    for link in link_list:
        cluster.set_link(link)
        try:
            ms = {m: 1e3 * max(r["seconds"] for r in cluster.run(
                time_attention_on_rank, m, length, "zigzag", repeats))
                for m in ("ring", "ulysses", "tp")}
        finally:
            cluster.set_link(None)
        rows.append(dict(
            world_size=n, length=length, link=str(link),
            contiguous_imbalance=max(busy["contiguous"]) / np.mean(busy["contiguous"]),
            zigzag_imbalance=max(busy["zigzag"]) / np.mean(busy["zigzag"]),
            **{f"{m}_ms": ms[m] for m in ms},
            **{f"{m}_model_ms": 1e3 * model_seconds(m, length, n, link, compute) for m in ms},
            native_ms=1e3 * native,
            tp_kib=sp.activation_bytes_formula(1, length, 128, 4, n, False, 4) / 1024,
            tp_sp_kib=sp.activation_bytes_formula(1, length, 128, 4, n, True, 4) / 1024))
    return rows
