"""The debugging clinic: short data-parallel training jobs, each with one classic bug, and the
tools that find them.

Introduced in notebooks/17_debugging_clinic.ipynb. :func:`train` runs on every rank of a cluster:
an MLP on the digits, data-parallel (each rank its shard of every batch, the gradients averaged
with the course's ring), with one bug of :data:`BUGS` switched on, or none::

    cluster.run(clinic.train, bug="barrier", timeout=5)   # hangs: the ClusterTimeout shows stacks
    runs = cluster.run(clinic.train, bug="seeds")          # runs; the ranks silently differ
    clinic.first_divergence(runs)                          # step 0, tensor 0.weight, ranks ...

The tools: where every rank is (:mod:`course_lib.runtime.stacks`, in every ``ClusterTimeout``);
which collective disagreed (the course's agreement check, or :func:`detail_group`'s
``TORCH_DISTRIBUTED_DEBUG=DETAIL``); when ranks diverged (:func:`first_divergence` on per-step
checksums); which samples each rank read (:func:`coverage`); where the time went
(:func:`merged_trace` of every rank's ``torch.profiler`` trace, :func:`straggler`); who issued a
collective fewer (:func:`flight_record`, PyTorch's flight recorder, and :func:`diverged`).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import tempfile
import time
import zlib
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import collectives, data
from course_lib.comm import get_comm
from course_lib.runtime.timeline import DISABLED, Timeline
from course_lib.sharding import shard_bounds

BUGS = {
    "order": "the last rank reduces its gradients in another order (bias before weight)",
    "barrier": "rank 0 saves a checkpoint behind a barrier the other ranks never reach",
    "deadlock": "every rank sends its gradients to the next with a blocking send, then receives",
    "shards": "the shard arithmetic uses rank % 2: two ranks read the same samples",
    "seeds": "each rank seeds its model with its rank: the copies start different",
    "sum": "the gradients are summed over the ranks, not averaged (a learning rate N times too "
           "large)",
    "straggler": "rank 1's data loading is slow",
}
STRAGGLER_SECONDS = 0.03  # rank 1's extra data-loading time per step ("straggler")


def make_model(seed: int = 0, hidden: int = 32) -> nn.Sequential:
    """The MLP every rank trains (64 pixels -> ``hidden`` -> 10 classes), float64, the same for
    a seed. Introduced in notebooks/17_debugging_clinic.ipynb."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10)).double()


def checksums(model: nn.Module) -> dict[str, int]:
    """A crc32 of each parameter's bytes: equal on two ranks only if the tensors are equal to
    the last bit. Introduced in notebooks/17_debugging_clinic.ipynb."""
    return {name: zlib.crc32(p.detach().cpu().numpy().tobytes())
            for name, p in model.named_parameters()}


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _batches(steps, batch, n, seed):
    rng = np.random.default_rng(seed)
    return [rng.choice(n, size=batch, replace=False) for _ in range(steps)]


def step(model: nn.Module, X: torch.Tensor, y: torch.Tensor, ids: np.ndarray, comm,
         number: int, lr: float, bug: str | None = None,
         timeline: Timeline = DISABLED) -> tuple[list[int], float]:
    """One step of data-parallel SGD on this rank, with ``bug``'s mistake: its shard of the
    batch ``ids``, the mean loss and its gradients, the gradients averaged over the ranks, the
    update. Returns the samples it read and the loss of the whole batch. Each part is a span of
    ``timeline`` and a ``torch.profiler`` label.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    with timeline.span("data", step=number), _label("data"):
        part = comm.rank % 2 if bug == "shards" else comm.rank
        lo, hi = shard_bounds(len(ids), part, comm.world_size)
        mine = ids[lo:hi]
        xb, yb = X[mine], y[mine]
        if bug == "straggler" and comm.rank == 1:
            time.sleep(STRAGGLER_SECONDS)  # a slow disk, a busy decoder
    with timeline.span("compute", step=number), _label("forward and backward"):
        loss = F.cross_entropy(model(xb), yb)  # the mean over this rank's shard
        model.zero_grad()
        loss.backward()
    with timeline.span("allreduce", step=number), _label("allreduce"):
        _reduce(model, comm, bug, number)
        total = torch.tensor([loss.item()])
        collectives.allreduce(total, comm, "ring")
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return mine.tolist(), float(total[0]) / comm.world_size


def run(step_fn, steps: int = 10, batch: int = 64, hidden: int = 32, lr: float = 1.0,
        seed: int = 0, profile: bool = False, timeout: float = 20.0,
        seed_by_rank: bool = False) -> dict:
    """On every rank: ``steps`` of ``step_fn(model, X, y, ids, comm, number, lr) -> (samples
    read, loss)`` on the digits, the same batches ``ids`` on every rank. Returns this rank's
    ``losses``, ``checksums`` (per tensor, before the first step and after each), ``params``
    (flat, likewise), ``samples`` (per step), its :class:`Timeline` (``step_fn`` may take
    ``timeline=``), and with ``profile`` its ``torch.profiler`` trace (Chrome JSON). Every wait
    of the comm has ``timeout``; ``seed_by_rank``: each rank's model seeded with its rank.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    comm = get_comm("torch", timeout=timeout)
    X, y, _, _ = data.load_digits()
    X, y = torch.from_numpy(X), torch.from_numpy(y)
    model = make_model(comm.rank if seed_by_rank else seed, hidden)
    tl = Timeline(comm.rank)
    out = {"rank": comm.rank, "losses": [], "checksums": [checksums(model)], "samples": [],
           "params": [_flat(model)]}
    kwargs = {"timeline": tl} if "timeline" in inspect.signature(step_fn).parameters else {}
    prof = _profiler() if profile else nullcontext()
    with prof:
        for number, ids in enumerate(_batches(steps, batch, len(X), seed)):
            samples, loss = step_fn(model, X, y, ids, comm, number, lr, **kwargs)
            out["samples"].append(list(samples))
            out["losses"].append(loss)
            out["checksums"].append(checksums(model))
            out["params"].append(_flat(model))
    out["timeline"] = tl
    if profile:
        out["trace"] = _trace_of(prof)
    return out


def train(bug: str | None = None, steps: int = 10, batch: int = 64, hidden: int = 32,
          lr: float = 1.0, seed: int = 0, profile: bool = False,
          timeout: float = 20.0) -> dict:
    """On every rank: :func:`run` of :func:`step` with ``bug`` (a key of :data:`BUGS`, or
    None). Introduced in notebooks/17_debugging_clinic.ipynb."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug must be one of {sorted(BUGS)} or None, not {bug!r}")
    return run(functools.partial(step, bug=bug), steps, batch, hidden, lr, seed, profile,
               timeout, seed_by_rank=bug == "seeds")


def _reduce(model, comm, bug, step):
    """The gradients averaged over the ranks (each the mean over its equal shard), with the
    bug's mistake."""
    grads = [p.grad for p in model.parameters()]
    if bug == "order" and comm.rank == comm.world_size - 1:
        grads = grads[1::2] + grads[0::2]  # biases first: the tensors no longer pair up
    if bug == "deadlock":  # a hand-made ring of blocking sends: every rank waits in send
        for g in grads:
            scratch = torch.empty_like(g)
            comm.send(g, (comm.rank + 1) % comm.world_size)
            comm.recv(scratch, (comm.rank - 1) % comm.world_size)
    if bug == "barrier" and comm.rank == 0 and step == 2:
        comm.barrier()  # "everyone wait until my checkpoint is written": nobody else comes
    for g in grads:
        collectives.allreduce(g, comm, "ring")  # the sum over the ranks
        if bug != "sum":
            g /= comm.world_size  # the mean: what one process on the whole batch computes


def one_process(steps: int = 10, batch: int = 64, hidden: int = 32, lr: float = 1.0,
                seed: int = 0) -> dict:
    """The reference: the same steps in one process on the whole batch (losses, checksums).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    X, y, _, _ = data.load_digits()
    X, y = torch.from_numpy(X), torch.from_numpy(y)
    model = make_model(seed, hidden)
    out = {"rank": "one process", "losses": [], "checksums": [checksums(model)],
           "params": [_flat(model)]}
    for idx in _batches(steps, batch, len(X), seed):
        loss = F.cross_entropy(model(X[idx]), y[idx])
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        out["losses"].append(loss.item())
        out["checksums"].append(checksums(model))
        out["params"].append(_flat(model))
    return out


# ---------------------------------------------------------------- the tools
def first_divergence(runs: list[dict]) -> dict | None:
    """The first step (0: before any update) and the first tensor at which the ranks' parameters
    differ, with the ranks grouped by their checksum; None when they agree throughout.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    for step, tables in enumerate(zip(*(r["checksums"] for r in runs), strict=True)):
        for name in tables[0]:
            groups: dict[int, list[int]] = {}
            for run, table in zip(runs, tables, strict=True):
                groups.setdefault(table[name], []).append(run["rank"])
            if len(groups) > 1:
                return {"step": step, "tensor": name, "groups": sorted(groups.values())}
    return None


def against_one_process(run: dict, reference: dict) -> dict:
    """A rank's run against :func:`one_process` (bits cannot match: the ring adds in another
    order): the largest parameter difference after each step, and the first update's size as a
    multiple of one process's (1 when right; N for gradients summed instead of averaged).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    mine, ref = run["params"], reference["params"]
    update = np.linalg.norm(mine[1] - mine[0]) / np.linalg.norm(ref[1] - ref[0])
    return {"max_difference": [float(np.abs(a - b).max()) for a, b in zip(mine, ref,
                                                                          strict=True)],
            "first_update_ratio": float(update)}


def coverage(runs: list[dict], batch: int = 64) -> dict:
    """Which samples the ranks read in each step, against the step's batch of ``batch``:
    ``overlap`` (pairs of ranks that read the same samples in a step, and how many over all
    steps), ``unread`` (samples of the batches nobody read), ``read`` (duplicates counted).
    Right: no overlap, nothing unread. Introduced in notebooks/17_debugging_clinic.ipynb."""
    overlap: dict[tuple, int] = {}
    unread = read = 0
    for step in zip(*(r["samples"] for r in runs), strict=True):
        sets = [set(s) for s in step]
        read += sum(len(s) for s in step)
        unread += batch - len(set().union(*sets))
        for i, a in enumerate(runs):
            for j in range(i + 1, len(runs)):
                if shared := len(sets[i] & sets[j]):
                    pair = (a["rank"], runs[j]["rank"])
                    overlap[pair] = overlap.get(pair, 0) + shared
    return {"overlap": overlap, "unread": unread, "read": read}


def _label(name):
    """A ``torch.profiler`` label (a span in every rank's trace)."""
    return torch.profiler.record_function(name)


def _profiler():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def _trace_of(prof) -> dict:
    """The profiler's Chrome trace as a dict (through a temporary file: the only way out)."""
    import json
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def merged_trace(runs: list[dict], path: str | None = None) -> dict:
    """Every rank's ``torch.profiler`` trace in one Chrome/Perfetto trace, one process per rank
    (ranks' clocks are this machine's: the spans line up). Written to ``path`` when given.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    import json
    events = []
    for run in runs:
        r = run["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        for e in run["trace"]["traceEvents"]:
            if e.get("ph") == "M":
                continue  # each trace's own process names
            events.append(dict(e, pid=r))
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def time_by_label(trace: dict) -> dict[int, dict[str, float]]:
    """Seconds each rank spent in each of the course's labels ("data", "forward and backward",
    "allreduce") of a merged trace. Introduced in notebooks/17_debugging_clinic.ipynb."""
    labels = ("data", "forward and backward", "allreduce")
    out: dict[int, dict[str, float]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("name") in labels:
            row = out.setdefault(e["pid"], dict.fromkeys(labels, 0.0))
            row[e["name"]] += e["dur"] / 1e6
    return dict(sorted(out.items()))


def straggler(trace: dict) -> dict:
    """The straggler of a merged trace: the rank that most often reaches a step's allreduce
    last (the others wait in it until it comes: an allreduce ends when its last rank
    arrives). Returns that rank, how many steps each rank was last, and the seconds each
    spent waiting in the allreduce. Introduced in notebooks/17_debugging_clinic.ipynb."""
    starts: dict[int, list[float]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("name") == "allreduce":
            starts.setdefault(e["pid"], []).append(e["ts"])
    ranks = sorted(starts)
    last = dict.fromkeys(ranks, 0)
    for step in zip(*(sorted(starts[r]) for r in ranks), strict=False):
        last[ranks[int(np.argmax(step))]] += 1
    waits = {r: t["allreduce"] for r, t in time_by_label(trace).items()}
    return {"rank": max(last, key=last.get), "last_in_steps": last, "waits": waits}


def detail_group():
    """On every rank: a new process group under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, whose every
    collective first checks that all ranks call the same one on the same shapes (a fingerprint
    exchanged on a helper group). Introduced in notebooks/17_debugging_clinic.ipynb."""
    import torch.distributed as dist
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    try:
        return dist.new_group(backend="gloo")
    finally:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
        dist.set_debug_level_from_env()


def native_order_bug(debug: bool = True) -> str:
    """On every rank: the "order" bug with torch's own allreduce, one per tensor, on a group
    under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; returns the error it raised (the fingerprints).
    Never called with ``debug=False`` here: a size mismatch reaching plain Gloo may abort the
    process. Introduced in notebooks/17_debugging_clinic.ipynb."""
    import torch.distributed as dist
    if not debug:
        raise ValueError("without DETAIL, mismatched sizes reach Gloo itself: it may abort the "
                         "process or return a wrong sum")
    group = detail_group()
    model = make_model()
    grads = [torch.ones_like(p) for p in model.parameters()]
    if dist.get_rank() == dist.get_world_size() - 1:
        grads = grads[1::2] + grads[0::2]
    try:
        for g in grads:
            dist.all_reduce(g, group=group)
    except RuntimeError as e:  # torch's message, its C++ location and TensorOptions cut short
        text = str(e).split("\nException raised from")[0]
        options = r"TensorOptions\((?:[^()]|\([^()]*\))*\)"  # one level of (default)s inside
        return re.sub(options, lambda m: re.search(r"device=(\w+)", m.group()).group(1), text)
    finally:
        dist.destroy_process_group(group)
    return "no error"


def across_hosts(interface: str | None = None, steps: int = 2, timeout: float = 60.0) -> dict:
    """The course's training script (``python -m course_lib.train``) under ``torchrun
    --nnodes 2`` on two hosts made of Linux namespaces (notebook 12; needs root), Gloo told to
    use ``interface`` on both (None: each host's ``eth0``). Returns ``{"ok", "seconds", "error":
    the first line of Gloo's failure or None, "remote": the address a rank failed to reach}``.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    import subprocess

    from course_lib import train
    from course_lib.runtime import hosts
    from course_lib.runtime.launch import finish_within
    out = os.path.join(tempfile.mkdtemp(prefix="course-clinic-"), "result.json")
    argv, env = train.two_hosts_argv(["--steps", steps, "--out", out,
                                      "--timeout", min(timeout, 60)])
    start = time.perf_counter()
    with hosts.make_hosts() as machines:
        logs = [tempfile.TemporaryFile(mode="w+") for _ in machines]
        procs = [h.popen(argv, env={**env, "GLOO_SOCKET_IFNAME": interface or h.interface},
                         stdout=log, stderr=subprocess.STDOUT, text=True)
                 for h, log in zip(machines, logs, strict=True)]
        deadline = time.monotonic() + timeout
        # the first host to fail ends the run: its peer may wait on the rendezvous for long
        while (time.monotonic() < deadline and any(p.poll() is None for p in procs)
               and not any(p.poll() for p in procs)):
            time.sleep(0.1)
        for p in procs:
            finish_within(p, 0)  # still running: killed, with its children
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    failure = next((line for text in outputs for line in text.splitlines()
                    if "connectFullMesh failed" in line and line.startswith("RuntimeError")),
                   None)
    remote = re.search(r"remote=\[([^\]]+)\]", failure or "")
    return {"ok": all(p.returncode == 0 for p in procs), "seconds": time.perf_counter() - start,
            "error": failure, "remote": remote.group(1) if remote else None}


# ---------------------------------------------------------------- the flight recorder
def flight_record(after: int = 0) -> list[dict]:
    """This rank's flight recorder: the collectives of the default process group it issued
    after number ``after``, oldest first, as PyTorch records them (on Gloo too, with no setting
    needed): ``{"seq", "op", "sizes", "dtypes"}``. Introduced in
    notebooks/17_debugging_clinic.ipynb."""
    import json

    from torch._C._distributed_c10d import _dump_fr_trace_json
    entries = json.loads(_dump_fr_trace_json(True, False)).get("entries", [])  # none yet: no key
    return [{"seq": e["collective_seq_id"], "op": e["profiling_name"].split(":")[-1],
             "sizes": e["input_sizes"], "dtypes": e["input_dtypes"]}
            for e in entries if not e["is_p2p"] and e["process_group"][1] == "default_pg"
            and e["collective_seq_id"] > after]


def skipped_collective(skip_rank: int = 1, skip_step: int = 2, steps: int = 4,
                       timeout: float = 2.0) -> dict:
    """On every rank: ``steps`` allreduces of the same size, but rank ``skip_rank`` skips
    the one numbered ``skip_step`` from 0 (the record numbers them from 1). Gloo pairs its next
    call with the others' skipped one (same sizes: nothing to notice) until the last allreduce
    waits for a partner that never comes; each wait has a deadline of ``timeout`` s. Returns
    ``{"rank", "record": this job's flight record, "error": what timed out here, or None}``.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    import torch.distributed as dist
    rank = dist.get_rank()
    before = max((e["seq"] for e in flight_record()), default=0)  # earlier jobs' collectives
    error = None
    for number in range(steps):
        if rank == skip_rank and number == skip_step:
            continue  # the bug: a collective behind a condition only this rank takes
        error = allreduce_within(torch.ones(8), number, timeout)
        if error:
            break
    return {"rank": rank, "record": flight_record(before), "error": error}


def allreduce_within(tensor: torch.Tensor, number: int, timeout: float) -> str | None:
    """``torch.distributed.all_reduce`` of ``tensor`` on the default group, waited for at most
    ``timeout`` s: None when done, else what did not finish (this rank's allreduce #``number``
    + 1). Introduced in notebooks/17_debugging_clinic.ipynb."""
    import datetime

    import torch.distributed as dist
    work = dist.all_reduce(tensor, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        return (f"rank {dist.get_rank()}: allreduce #{number + 1} did not finish within "
                f"{timeout:g} s ({e})")
    return None


def uneven_data(samples: int = 97, batch: int = 8, lr: float = 0.5,
                timeout: float = 2.0) -> dict:
    """On every rank: one epoch of data-parallel SGD over its own shard of the first
    ``samples`` digits (:func:`sharding.shard_bounds`: the shards differ by a sample at most),
    in batches of ``batch``, the gradients summed with ``torch.distributed.all_reduce`` (one
    flat tensor, the same size on every rank) and averaged, each wait with a deadline of
    ``timeout`` s. A rank whose shard makes one batch more waits at its last allreduce for
    ranks that have finished: the "uneven inputs" that DDP's ``join()`` handles for DDP's own
    allreduces. Returns
    ``{"rank", "batches", "record": this job's flight record, "error": what timed out here,
    or None}``. Introduced in notebooks/17_debugging_clinic.ipynb."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    X, y, _, _ = data.load_digits()
    X, y = torch.from_numpy(X), torch.from_numpy(y)
    lo, hi = shard_bounds(samples, rank, world)
    starts = range(lo, hi, batch)
    before = max((e["seq"] for e in flight_record()), default=0)
    model, error = make_model(), None
    for number, start in enumerate(starts):
        end = min(start + batch, hi)
        loss = F.cross_entropy(model(X[start:end]), y[start:end])
        model.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        error = allreduce_within(flat, number, timeout)
        if error:
            break
        with torch.no_grad():
            for p, g in zip(model.parameters(), flat.split([p.numel() for p in
                                                             model.parameters()]), strict=True):
                p -= lr * g.view_as(p) / world
    return {"rank": rank, "batches": len(starts), "record": flight_record(before),
            "error": error}


def parting(records: list[list[dict]]) -> dict | None:
    """From every rank's :func:`flight_record`: the first collective (numbered from 1 in the
    records given) that some rank issued differently (another op or sizes) or never issued,
    as ``{"collective", "ranks": the ranks against the majority, "issued": what each of them
    issued there (None: nothing), "usual": what the majority issued (None: nothing)}``; None
    when every rank issued the same. Introduced in notebooks/17_debugging_clinic.ipynb."""
    from collections import Counter
    for i in range(max(map(len, records), default=0)):
        seen = [(r[i]["op"], r[i]["sizes"]) if i < len(r) else None for r in records]
        keys = [repr(s) for s in seen]  # sizes are lists: compared by their text
        if len(set(keys)) == 1:
            continue
        most = Counter(keys).most_common(1)[0][0]  # what the majority issued
        odd = [rank for rank, key in enumerate(keys) if key != most]
        return {"collective": i + 1, "ranks": odd, "issued": [seen[r] for r in odd],
                "usual": seen[keys.index(most)]}
    return None


def diverged(records: list[list[dict]]) -> str:
    """:func:`parting`, said in words: the first collective that some rank issued differently
    or never issued, and which ranks those are (the ones against the majority).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    found = parting(records)
    if found is None:
        return f"every rank issued the same {len(records[0])} collectives"
    usual, odd = found["usual"], found["ranks"]
    what = f"collective #{found['collective']}"
    if usual is None:  # the majority stopped before it
        op, sizes = found["issued"][0]
        return (f"{what} ({op} of {sizes}): only rank(s) {odd} issued it; the others issued "
                f"{found['collective'] - 1} collectives")
    what += f" ({usual[0]} of {usual[1]})"
    if all(issued is None for issued in found["issued"]):
        return (f"{what}: rank(s) {odd} never issued it; they issued "
                f"{len(records[odd[0]])} collectives, the others "
                f"{max(map(len, records))}")
    return f"{what}: rank(s) {odd} issued {found['issued']} instead"


def late_for_barrier(late_rank: int = 2, timeout: float = 1.0) -> dict:
    """On every rank: ``torch.distributed.monitored_barrier`` with a deadline of ``timeout``
    s, which rank ``late_rank`` reaches 2 x ``timeout`` s late (stuck elsewhere: a data
    loader, a disk, a branch). On Gloo rank 0 waits for each rank's message in turn, each up to
    the deadline (``wait_all_ranks=True``), and names every rank that did not come; the others
    hear of it by their own deadline. Runs on a group of its own (the default one may still
    hold timed-out calls). Returns ``{"rank", "error": the first line of this rank's error, or
    None}``. Introduced in notebooks/17_debugging_clinic.ipynb."""
    import datetime
    import time

    import torch.distributed as dist
    group = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    if rank == late_rank:
        time.sleep(2 * timeout)
    error = None
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout),
                               wait_all_ranks=True)
    except RuntimeError as e:
        error = str(e).strip().splitlines()[0]
    dist.destroy_process_group(group)
    return {"rank": rank, "error": error}


_WAITING_RANK = """\
import datetime, os, sys, time
import torch, torch.distributed as dist
rank, store, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=seconds))
if rank == 0:
    print("waiting", os.getpid(), flush=True)
    try:
        dist.all_reduce(torch.ones(4))  # rank 1 never calls it: waits until the deadline
    except RuntimeError:
        pass
else:
    time.sleep(seconds)
"""


def native_stack(seconds: float = 8.0) -> str:
    """What ``py-spy dump --native`` shows of a rank waiting in a collective: two processes
    form a Gloo group (loopback only); rank 0 calls an allreduce that rank 1 never calls
    (deadline ``seconds``), and while it waits its stack is dumped, Python frames and the C++
    ones under them. Both processes are stopped after. Returns the dump, or why there is none
    (py-spy missing, or not allowed to read another process). Introduced in
    notebooks/17_debugging_clinic.ipynb."""
    import shutil
    import subprocess
    import sys
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return "py-spy is not installed: pip install py-spy"
    folder = tempfile.mkdtemp(prefix="course_lib-spy-")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    ranks = [subprocess.Popen([sys.executable, "-c", _WAITING_RANK, str(r), f"{folder}/store",
                               str(seconds)], stdout=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    try:
        line = ranks[0].stdout.readline()  # after the group formed: within torch's import
        if not line.startswith("waiting"):
            return f"rank 0 did not start waiting: {line!r}"
        time.sleep(1.0)  # into the allreduce's wait
        dump = subprocess.run([spy, "dump", "--native", "--pid", line.split()[1]],
                              capture_output=True, text=True, timeout=60)
        return dump.stdout if dump.returncode == 0 else (
            f"py-spy could not read the process: {dump.stderr.strip()[:300]}")
    finally:
        for process in ranks:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def readable_stack(dump: str) -> list[str]:
    """The lines of a ``py-spy dump --native`` a person reads first: the thread, the C++
    frames of torch.distributed and Gloo (templates cut short), and the Python frames.
    A message instead of a dump (py-spy missing or refused) comes back as it is.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    if not dump.startswith("Process "):
        return [dump]
    keep = []
    for line in dump.splitlines():
        text = line.strip()
        if text.startswith("Thread") or re.search(r":\d+\)$", text):  # Python: (file:line)
            keep.append(text)
        elif re.match(r"(c10d|gloo)::", text):
            keep.append(re.sub(r"<.*>", "<...>", text)[:110])
    return keep
