"""``python -m course_lib bench attention``: splitting the sequence, measured on a cluster and
against the models. Introduced in notebooks/14_transformers_and_long_sequences.ipynb.

For each world size N (float32, 4 heads of 32, one sequence), four tables:

* **balance** (each T of ``--lengths``): each rank's attention CPU time in ring attention's
  forward, contiguous chunks against the zig-zag, as the slowest rank over the mean (counted
  in pairs of chunks of T/2N: 4N against a mean of 2(N+1) for contiguous ranks, 2N+1 each for
  the zig-zag);
* **links** (the longest T): one forward's milliseconds on each emulated link of ``--links``,
  slower and slower: ring attention (zig-zag), Ulysses and tensor parallelism's attention (H/N
  heads of every token, then its output projection's allreduce), each beside its model, and
  torch's attention on the whole sequence in one process, the native baseline;
* **overlap** (each T, on the slowest link): ring attention passing the next block on while it
  computes, against the naive ring that sends after computing, each beside its model
  (``costmodel.ring_attention_time``): the transfer hides once the sequence is long enough;
* **memory** (each T): the activation bytes one block (d = 128) keeps per rank with TP, TP + SP,
  ring attention and Ulysses, measured (``saved_tensors_hooks``) beside their formula.

The models: the link's alpha-beta time of each method's messages plus its computation, the
slowest rank's CPU seconds measured in the same forwards (every thread: computing and copying
messages), times N / cores when N ranks share fewer cores (4 ranks on 2 cores: each computes
at half speed, which a cluster's own cores would not).

    python -m course_lib bench attention                     # N = 2, 4; T = 512, 1024
    python -m course_lib bench attention --lengths 2048 --links "1Gbit/s,50us" --csv a.csv
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from course_lib import costmodel
from course_lib import sequence_parallel as sp
from course_lib.bench.common import argtype, memcpy_bandwidth, parse_list, text_table, write_csv
from course_lib.runtime import netem
from course_lib.runtime.cluster import start_cluster
from course_lib.testing.context_parallel import (
    block_split_on_rank,
    time_attention_on_rank,
    time_ring_overlap_on_rank,
)

HELP = "ring attention, Ulysses, TP: balance, time as the link slows, overlap, memory"
HEADS, DIM, ITEM = 4, 32, 4  # the timed attention: heads, head size, float32
MEMORY_D = 128               # the model width of the block whose memory is measured
METHODS = ("ring", "ulysses", "tp")


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


def cores() -> int:
    """The cores this process may run on (a container or taskset may allow fewer)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def one_process_seconds(length: int, repeats: int) -> float:
    """torch's attention on the whole sequence in this process: the native baseline."""
    q, k, v = (torch.randn(1, HEADS, length, DIM) for _ in range(3))
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


def model_seconds(method: str, length: int, n: int, link: netem.Link | None, cpu_s: float,
                  overlap: bool = True) -> float:
    """The model of one forward of ``method``: ``cpu_s`` (the slowest rank's CPU seconds, times
    N / cores when the ranks share fewer cores) plus the link's alpha-beta time of its messages
    (ring: N - 1 key/value blocks, each hidden under a step's computation if ``overlap``;
    Ulysses: two all-to-alls, of Q, K, V and of the output; TP: one ring allreduce of the
    output). No link: the computation alone."""
    compute = cpu_s * max(1.0, n / cores())
    if link is None:
        return compute
    model = link.costmodel()
    if method == "ring":
        block = 2 * HEADS * (length // n) * DIM * ITEM  # keys and values of one rank
        return costmodel.ring_attention_time(block, n, compute, model, overlap)
    if method == "tp":
        return compute + costmodel.allreduce_time("ring", HEADS * length * DIM * ITEM, n, model)
    qkv = 3 * HEADS * (length // n) * DIM * ITEM  # this rank's Q, K and V of every head
    return (compute + costmodel.all_to_all_time(qkv, n, model)
            + costmodel.all_to_all_time(qkv / 3, n, model))


def timed(cluster, method: str, length: int, link: netem.Link | None, repeats: int,
          overlap: bool = True) -> tuple[float, float]:
    """Seconds of one forward of ``method`` on ``link`` (the slowest rank) and its model."""
    cluster.set_link(link)
    try:
        rows = cluster.run(time_attention_on_rank, method, length, "zigzag", repeats,
                           overlap=overlap)
    finally:
        cluster.set_link(None)
    cpu = max(r["cpu_s"] for r in rows)
    return (max(r["seconds"] for r in rows),
            model_seconds(method, length, cluster.n, link, cpu, overlap))


def measure_balance(cluster, length: int, repeats: int) -> dict:
    """Each rank's attention CPU seconds in ring attention, contiguous and zig-zag."""
    return {lay: np.array([r["busy_s"] for r in cluster.run(
        time_attention_on_rank, "ring", length, lay, repeats)]) for lay in ("contiguous", "zigzag")}


def measure_links(cluster, length: int, link_list: list, repeats: int) -> list[dict]:
    """One row per link: each method's forward milliseconds and its model."""
    rows = []
    for link in link_list:
        row = dict(world_size=cluster.n, length=length, link=str(link))
        for m in METHODS:
            seconds, model = timed(cluster, m, length, link, repeats)
            row.update({f"{m}_ms": 1e3 * seconds, f"{m}_model_ms": 1e3 * model})
        rows.append(row)
    return rows


def measure_overlap(cluster, lengths: list[int], link: netem.Link, repeats: int) -> list[dict]:
    """One row per length: ring attention on ``link`` with and without the overlap, and with
    no link (the computation alone), measured in turns within each round (a busy machine
    slows the three alike), and the models (from the computation's CPU seconds);
    ``transfer_ms``: the N - 1 blocks' time on the link, and ``hidden``: the share of it the
    overlap saved, (serial - overlap) / transfer."""
    rows = []
    for length in lengths:
        got = cluster.run(time_ring_overlap_on_rank, length, str(link), repeats)
        block = 2 * HEADS * (length // cluster.n) * DIM * ITEM  # keys and values of one rank
        row = dict(world_size=cluster.n, length=length, link=str(link),
                   transfer_ms=1e3 * (cluster.n - 1) * link.seconds(block))
        for name, overlap in (("overlap", True), ("serial", False), ("alone", True)):
            cpu = max(r[f"{name}_cpu_s"] for r in got)
            on = link if name != "alone" else None
            row.update({f"{name}_ms": 1e3 * max(r[f"{name}_s"] for r in got),
                        f"{name}_model_ms": 1e3 * model_seconds("ring", length, cluster.n, on,
                                                                cpu, overlap)})
        row["hidden"] = (row["serial_ms"] - row["overlap_ms"]) / row["transfer_ms"]
        rows.append(row)
    return rows


def measure_memory(cluster, lengths: list[int], flash: bool = False) -> list[dict]:
    """One row per length: the bytes one block keeps per rank for each split, measured and by
    formula, and in one process (measured). ``flash``: TP, TP + SP and Ulysses compute their
    heads with FlashAttention."""
    rows = []
    for length in lengths:
        row = dict(world_size=cluster.n, length=length)
        for split in sp.SPLITS:
            got = cluster.run(block_split_on_rank, split, 1, length, MEMORY_D, HEADS,
                              dtype=torch.float32, flash=flash)
            row[f"{split}_bytes"] = max(r["kept"] for r in got)
            row[f"{split}_formula"] = sp.activation_bytes_formula(
                1, length, MEMORY_D, HEADS, cluster.n, split, ITEM, flash=flash)
            row["one_process_bytes"] = got[0]["one_process"]
        rows.append(row)
    return rows


def check_length(length: int, n: int) -> None:
    if length % (2 * n) or HEADS % n:
        raise ValueError(f"length {length} is not divisible by 2N = {2 * n} "
                         f"(or {HEADS} heads by N)")


def main(args):
    if args.repeats < 1:
        print("bench attention: --repeats must be at least 1", file=sys.stderr)
        return 1
    balance, link_rows, overlap_rows, memory_rows = [], [], [], []
    try:
        for n in args.world_sizes:
            for length in args.lengths:
                check_length(length, n)
            print(f"# starting {n} engines", file=sys.stderr)
            with start_cluster(n=n, timeout=300) as cluster:
                for length in args.lengths:
                    busy = measure_balance(cluster, length, args.repeats)
                    balance.append(dict(world_size=n, length=length, **{
                        f"{lay}_imbalance": b.max() / b.mean() for lay, b in busy.items()}))
                link_rows += measure_links(cluster, max(args.lengths), args.links, args.repeats)
                overlap_rows += measure_overlap(cluster, args.lengths, args.links[-1],
                                                args.repeats)
                memory_rows += measure_memory(cluster, args.lengths)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"bench attention: {e}", file=sys.stderr)
        return 1
    native = {t: 1e3 * one_process_seconds(t, args.repeats) for t in args.lengths}
    print(format_tables(balance, link_rows, overlap_rows, memory_rows, native))
    print(f"# ceiling: memcpy {memcpy_bandwidth():.1f} GB/s on one core; {cores()} cores, so "
          "N ranks compute at cores/N of a core's speed when N > cores (the models count it)")
    if args.csv:  # one file: each row names its table
        tables = dict(balance=balance, links=link_rows, overlap=overlap_rows, memory=memory_rows)
        rows = [dict(table=name, **r) for name, table in tables.items() for r in table]
        write_csv(rows, args.csv, list(dict.fromkeys(k for r in rows for k in r)))
    return 0


def format_tables(balance, link_rows, overlap_rows, memory_rows, native) -> str:
    """The four tables, each with its header."""
    out = ["# balance: the slowest rank's attention work over the mean (pairs of chunks: "
           "contiguous 2N/(N+1), zig-zag 1.00)"]
    out += text_table(["N", "T", "contiguous", "zig-zag"], [[
        r["world_size"], r["length"], f"{r['contiguous_imbalance']:.2f}",
        f"{r['zigzag_imbalance']:.2f}"] for r in balance])
    out.append("# links: one forward, ms, measured and model (torch in one process: "
               + ", ".join(f"T = {t}: {ms:.2f} ms" for t, ms in native.items()) + ")")
    out += text_table(["N", "T", "link", "ring", "model", "Ulysses", "model", "TP", "model"], [
        [r["world_size"], r["length"], r["link"]]
        + [f"{r[f'{m}{s}']:.1f}" for m in METHODS for s in ("_ms", "_model_ms")]
        for r in link_rows])
    out.append("# overlap: ring attention, ms, passing the next block on while computing, "
               "after it (serial) and with no link (alone); hidden: (serial - overlap) / the "
               "blocks' time on the link")
    out += text_table(["N", "T", "link", "overlap", "model", "serial", "model", "alone",
                       "link time", "hidden"], [
        [r["world_size"], r["length"], r["link"]]
        + [f"{r[k]:.1f}" for k in ("overlap_ms", "overlap_model_ms", "serial_ms",
                                   "serial_model_ms", "alone_ms", "transfer_ms")]
        + [f"{r['hidden']:.0%}"] for r in overlap_rows])
    out.append(f"# memory: KiB one block (d = {MEMORY_D}, float32) keeps per rank, measured "
               "(formula)")
    out += text_table(["N", "T", "one process", *sp.SPLITS], [
        [r["world_size"], r["length"], f"{r['one_process_bytes'] / 1024:.0f}"]
        + [f"{r[f'{s}_bytes'] / 1024:.0f} ({r[f'{s}_formula'] / 1024:.0f})" for s in sp.SPLITS]
        for r in memory_rows])
    return "\n".join(out)
