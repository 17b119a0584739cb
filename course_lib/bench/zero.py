"""``python -m course_lib bench zero``: ZeRO's memory per rank, bytes sent and time per step,
against data parallelism (the course's and torch DDP) and torch FSDP2.

Introduced in notebooks/10_sharded_data_parallelism.ipynb. Every rank trains the same MLP
(``--layers`` Linear(width, width) + ReLU, float32, Adam; 32 x 384 by default, so one layer is
1/32 of the model) on its part of a global batch with:
the course's DDP (``zero.ZeroDataParallel`` stage 0) and ZeRO stages 1-3 over the ring, torch's
``DistributedDataParallel`` and FSDP2 (``fully_shard`` on every layer). Memory per rank is shown
three ways: counted from the tensors a rank holds at its peak (by kind), the process's peak
resident memory above what it held before the model was built (sampled every millisecond:
activations, buffers and the allocator included), and the ZeRO paper's accounting in float32
(K = 2 numbers of Adam state, plus the float32 parameter shard that stages 1-2 keep beside the
full parameters). Bytes sent per step are counted by the comm (``Comm.bytes_sent``)::

    python -m course_lib bench zero                          # N = 1, 2, 4; ~30 s
    python -m course_lib bench zero --link 1Gbit/s --ranks 4 # the ring on an emulated network

On an emulated link only the course's rows pay it: torch DDP and FSDP2 use Gloo's own
collectives, which run on loopback (their times are printed for the compute they share). The
ceiling printed beside: the link's time for DDP's bytes, and one rank's compute per step.
"""

import ctypes
import os
import sys
import threading
import time

from course_lib import zero
from course_lib.bench.common import BenchError, argtype, parse_list, text_table, write_csv
from course_lib.runtime import netem

HELP = "ZeRO stages 1-3: memory per rank, bytes sent, step time vs DDP and FSDP2"

IMPLEMENTATIONS = ("ddp", "zero1", "zero2", "zero3", "torch-ddp", "fsdp2")
NAMES = {"ddp": "DDP (ring)", "zero1": "ZeRO-1 (ring)", "zero2": "ZeRO-2 (ring)",
         "zero3": "ZeRO-3 (ring)", "torch-ddp": "torch DDP", "fsdp2": "torch FSDP2"}
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "torch-ddp": 0, "fsdp2": 3}

COLUMNS = ["implementation", "ranks", "step_ms", "vs_ddp", "sent_mib", "formula_sent_mib",
           "held_mib", "planned_mib", "paper_mib", "process_peak_mib", "parameters",
           "gradients", "optimizer", "shards", "num_params", "link"]


class PeakResident:
    """The process's peak resident memory above its level at the start, sampled every
    ``interval`` seconds by a thread (Linux: /proc/self/statm; elsewhere ``peak`` stays None)."""

    def __init__(self, interval=0.001):
        self.interval, self.peak = interval, None
        self._stop = threading.Event()

    @staticmethod
    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.resident() - self.start)
            time.sleep(self.interval)

    def __enter__(self):
        if os.path.exists("/proc/self/statm"):
            self.start, self.peak = self.resident(), 0
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.peak is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.resident() - self.start)


def _malloc_threshold(n_bytes):
    """glibc's mmap threshold, fixed (glibc only; elsewhere nothing happens). The memory passes
    (every one before any timed pass) use 64 KiB: every tensor is then its own mapping,
    returned when freed, so that resident memory follows what is held. The timed passes use
    32 MiB, where glibc's own threshold ends up in a long run: freed blocks are reused, and
    fresh pages (up to 1 ms per MiB on a virtual machine) are not faulted in at every step."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, n_bytes)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)        # and what the heap holds free goes back to the system
    except (OSError, AttributeError):
        pass


def _warm_up():
    """What a process allocates once, on its first Adam step (torch's lazy imports: ~70 MB),
    is paid here, not by the first implementation measured."""
    import torch
    w = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.Adam([w])
    (w * 2).sum().backward()
    optimizer.step()


def _model(layers, width, seed=0):
    import torch
    from torch import nn
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def zero_rank_bench(what, implementations=IMPLEMENTATIONS, world_size=None, layers=32,
                    width=384, batch=32, steps=3, link=None, timeout=60.0):
    """On every rank: train with each implementation on the first ``world_size`` ranks, and
    measure ``what``: "memory" (two steps: the second holds Adam's state) or "time" (``steps``
    steps, the first warms up). One dict per implementation (None outside the ranks).
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from course_lib.comm.subgroups import subgroup, subgroup_comm
    comm = subgroup_comm(world_size, timeout)
    if comm is None:
        return None
    comm.link = netem.make_link(link) if link else None
    _malloc_threshold(64 * 1024 if what == "memory" else 32 * 2**20)
    _warm_up()
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(batch, width, generator=g) for _ in range(2))
    a = comm.rank * batch // comm.world_size
    b = (comm.rank + 1) * batch // comm.world_size
    rows = []
    for name in implementations:
        comm.barrier()
        with PeakResident() as resident:
            model = _model(layers, width)
            wrapped, step = _wrap(name, model, comm, subgroup(world_size))
            sent, times = comm.bytes_sent, []
            for _ in range(2 if what == "memory" else steps):
                comm.barrier()
                start = time.perf_counter()
                nn.functional.mse_loss(wrapped(x[a:b]), y[a:b]).backward()
                step()
                times.append(time.perf_counter() - start)
        ours = isinstance(wrapped, zero.ZeroDataParallel)
        rows.append({"implementation": name, "ranks": comm.world_size,
                     "num_params": sum(p.numel() for p in model.parameters())}
                    | ({"held": wrapped.peak if ours else None, "process_peak": resident.peak,
                        "planned": zero.planned_memory(model, comm.world_size, STAGE[name])
                        if ours else None} if what == "memory" else
                       {"step_s": sorted(times[1:])[len(times[1:]) // 2],
                        "sent": (comm.bytes_sent - sent) / len(times) if ours else None}))
        del wrapped, step, model
    if dist.is_initialized():
        dist.barrier(group=subgroup(world_size))
    return rows


def _wrap(name, model, comm, group):
    """The model wrapped for ``name``, and the function that ends a step after the backward."""
    import torch
    import torch.distributed as dist

    def adam(params):
        return torch.optim.Adam(params, lr=1e-3)
    if name in ("ddp", "zero1", "zero2", "zero3"):
        wrapped = zero.ZeroDataParallel(model, adam, comm, STAGE[name], "ring")
        return wrapped, wrapped.step
    if name == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model, process_group=group)
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    optimizer = adam(wrapped.parameters())

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    wrapped.peak = None
    return wrapped, step


def measure(cluster, ranks=(1, 2, 4), implementations=IMPLEMENTATIONS, layers=32, width=384,
            batch=32, steps=3, link=None):
    """One row per (N, implementation), measured on ``cluster``'s first N ranks; the worst
    rank's memory and the slowest rank's step. Introduced in
    notebooks/10_sharded_data_parallelism.ipynb."""
    if max(ranks) > cluster.n or min(ranks) < 1:
        raise BenchError(f"ranks must be in 1..{cluster.n} (the cluster's ranks)")
    reports = {}  # every memory pass first: the processes' memory is not yet reused
    for what in ("memory", "time"):
        for N in ranks:
            reports[what, N] = [r for r in cluster.run(
                zero_rank_bench, what, implementations, N if N < cluster.n else None, layers,
                width, batch, steps, link) if r is not None]
    rows = []
    for N in ranks:
        for i in range(len(implementations)):
            per_rank = [m[i] | t[i] for m, t in zip(reports["memory", N], reports["time", N],
                                                     strict=True)]
            rows.append(_row(per_rank, link))
    ddp = {(r["ranks"], r["implementation"]): r["step_ms"] for r in rows}
    for r in rows:
        native = r["implementation"] in ("torch-ddp", "fsdp2")
        base = ddp.get((r["ranks"], "torch-ddp" if native else "ddp"))
        r["vs_ddp"] = r["step_ms"] / base if base else None
    return rows


def _row(per_rank, link):
    r0 = per_rank[0]
    name, N, psi = r0["implementation"], r0["ranks"], r0["num_params"]
    worst = max(per_rank, key=lambda r: (r["held"] or {}).get("total", 0))
    stage = STAGE[name]
    master = 1 if stage in (1, 2) else 0  # stages 1-2 keep an fp32 shard beside the parameters
    paper = zero.zero_memory(psi, N, stage, optimizer_numbers=2 + master, bytes_per_number=4)
    peaks = [r["process_peak"] for r in per_rank if r["process_peak"] is not None]
    held = worst["held"] or {}
    mib = 2.0 ** 20
    return {"implementation": name, "ranks": N,
            "step_ms": 1e3 * max(r["step_s"] for r in per_rank),
            "sent_mib": max(r["sent"] for r in per_rank) / mib if r0["sent"] is not None
            else None,
            "formula_sent_mib": (3 if stage == 3 else 2) * (N - 1) / N * 4 * psi / mib,
            "held_mib": held["total"] / mib if held else None,
            "planned_mib": worst["planned"]["total"] / mib if held else None,
            "paper_mib": paper["total"] / mib,
            "process_peak_mib": max(peaks) / mib if peaks else None,
            **{k: held.get(k, 0) / mib if held else None
               for k in ("parameters", "gradients", "optimizer", "shards")},
            "num_params": psi,
            "link": str(netem.make_link(link)) if link and name not in ("torch-ddp", "fsdp2")
            else "loopback"}


def _fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def format_table(rows, link=None):
    """The rows as text, with the ceiling: one rank's compute per step, and the time ``link``
    (the emulated network of the course's rows, if any) takes for DDP's bytes."""
    psi = rows[0]["num_params"]
    out = [f"# ZeRO, {psi / 1e6:.2f}M float32 parameters ({4 * psi / 2**20:.1f} MiB), Adam; "
           "memory per rank in MiB: held = counted from its tensors at its peak, planned = "
           "zero.planned_memory, paper = the ZeRO accounting (K = 2, +1 for the fp32 shard of "
           "stages 1-2), process = peak resident above the start",
           "# sent = bytes each rank sends per step, counted (formula: 2(N-1)/N x params, "
           "3(N-1)/N for stage 3); vs DDP: step time / DDP's (the course's rows: the course's "
           "DDP; torch's rows: torch DDP)"]
    out += text_table(
        [["implementation", "N", "step", "vs DDP", "sent", "formula", "held", "planned",
          "paper", "process", "link"],
         ["", "", "(ms)", "", "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(MiB)", ""]],
        [[NAMES[r["implementation"]], r["ranks"], f"{r['step_ms']:.0f}",
          _fmt(r["vs_ddp"], ".2f"), _fmt(r["sent_mib"]), f"{r['formula_sent_mib']:.1f}",
          _fmt(r["held_mib"]), _fmt(r["planned_mib"]), f"{r['paper_mib']:.1f}",
          _fmt(r["process_peak_mib"]), r["link"]] for r in rows], "<>>>>>>>>><")
    one = [r["step_ms"] for r in rows if r["ranks"] == 1 and r["implementation"] == "ddp"]
    linked = [r for r in rows if link and r["implementation"] == "ddp" and r["ranks"] > 1]
    ceiling = []
    if one:
        ceiling.append(f"one rank's compute per step {one[0]:.0f} ms (N = 1, nothing sent)")
    for r in linked:
        spec = netem.make_link(link)
        ceiling.append(f"DDP's bytes at N = {r['ranks']} take "
                       f"{1e3 * r['formula_sent_mib'] * 2**20 / spec.bandwidth:.0f} ms on "
                       f"{r['link']}")
    if ceiling:
        out.append("# ceiling: " + "; ".join(ceiling))
    return "\n".join(out)


def arguments(parser):
    """The options of ``python -m course_lib bench zero``."""
    a = parser.add_argument
    a("--ranks", type=argtype(lambda t: parse_list(t, what="--ranks", example="1,2,4")),
      default=[1, 2, 4], help="world sizes N, a comma list (default 1,2,4)")
    a("--implementations", default=",".join(IMPLEMENTATIONS),
      help=f"comma list of {', '.join(IMPLEMENTATIONS)} (default all)")
    a("--layers", type=int, default=32, help="Linear layers of the model (default 32)")
    a("--width", type=int, default=384, help="features per layer (default 384)")
    a("--batch", type=int, default=32, help="rows of the global batch (default 32)")
    a("--steps", type=int, default=3, help="timed steps, the first warms up (default 3)")
    a("--link", type=argtype(netem.make_link), default=None,
      help="an emulated network for the course's rows, like 1Gbit/s,50us (default none)")
    a("--csv", help="also write one row per (N, implementation) to this file")


def main(args):
    """Run ``bench zero`` with parsed ``args``."""
    from course_lib.runtime.cluster import start_cluster
    names = [s.strip() for s in args.implementations.split(",") if s.strip()]
    bad = [s for s in names if s not in IMPLEMENTATIONS]
    if bad or not names or args.layers < 1 or args.width < 1 or args.steps < 2:
        print(f"bench zero: implementations must be among {', '.join(IMPLEMENTATIONS)} (not "
              f"{', '.join(bad)}); layers, width >= 1, steps >= 2", file=sys.stderr)
        return 2
    if args.batch < max(args.ranks):
        print(f"bench zero: --batch {args.batch} gives some of {max(args.ranks)} ranks no rows",
              file=sys.stderr)
        return 2
    try:
        with start_cluster(n=max(args.ranks), timeout=600) as cluster:
            rows = measure(cluster, args.ranks, names, args.layers, args.width, args.batch,
                           args.steps, args.link.text if args.link else None)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"bench zero: {e}", file=sys.stderr)
        return 1
    print(format_table(rows, args.link.text if args.link else None))
    if args.csv:
        write_csv(rows, args.csv, COLUMNS)
    return 0
