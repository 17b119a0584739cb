"""``python -m course_lib bench checkpoint``: what a checkpoint costs, and how often to take one.

Introduced in notebooks/11_fault_tolerance.ipynb. Two tables:

1. Save time against the state's size: ``torch.save`` (into the page cache, no fsync), the
   course's atomic save (``checkpoint.save``: checksum, fsync, rename, fsync the directory) and
   PyTorch's DCP (``torch.distributed.checkpoint.save``, one process), and the load. Ceiling
   printed beside: this disk's own speed for the same bytes written and fsynced.
2. Time to finish ``--work`` steps with failures injected at random (exponential, mean
   ``--mtbf`` steps), checkpointing every K steps: each failure throws the state away, loads
   the last checkpoint and redoes the steps since. Measured against the first-order model
   (1 + C/(K t) + (K t/2 + R)/M per unit of work, for K t well below M) and Young's
   interval sqrt(2 C M).
   A step is ``--step-ms`` of sleep plus an update of the state, so the disk, not the
   machine's two cores, sets C::

    python -m course_lib bench checkpoint                    # ~25 s
    python -m course_lib bench checkpoint --sizes 16M,256M --mtbf 50
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from course_lib import checkpoint
from course_lib.bench.common import (
    BenchError,
    argtype,
    format_size,
    parse_list,
    parse_sizes,
    text_table,
    write_csv,
)

HELP = "checkpoint save time vs size; time to finish with failures vs the interval (Young)"


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _disk_write(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_times(sizes, directory, repeats=3):
    """One row per size (bytes of float32 state): median ms of each way to save, and of the
    load, beside the disk's write + fsync of the same bytes. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    # DCP warns that it runs in one process and that it overwrites the directory (its default)
    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    directory = Path(directory)
    rows = []
    for size in sizes:
        state, raw = {"w": torch.randn(max(size // 4, 1))}, bytes(size)
        disk = _timed(lambda: _disk_write(directory / "raw", raw), repeats)  # noqa: B023
        plain = _timed(lambda: torch.save(state, directory / "plain.pt"), repeats)  # noqa: B023
        atomic = _timed(lambda: checkpoint.save(state, directory / "atomic", 1),  # noqa: B023
                        repeats)
        dist = _timed(lambda: dcp.save(state, checkpoint_id=directory / "dcp",  # noqa: B023
                                       no_dist=True), repeats)
        load = _timed(lambda: checkpoint.load_latest(directory / "atomic"), repeats)
        rows.append({"size": size, "disk_ms": 1e3 * disk, "torch_save_ms": 1e3 * plain,
                     "atomic_ms": 1e3 * atomic, "dcp_ms": 1e3 * dist, "load_ms": 1e3 * load,
                     "atomic_vs_torch_save": atomic / plain})
    return rows


def run_with_failures(interval, work=200, step_s=0.01, mtbf_steps=100, state_bytes=4 << 20,
                      restart_s=0.05, directory=None, seed=0):
    """Train ``work`` steps (sleep ``step_s`` and update a state of ``state_bytes``),
    checkpointing every ``interval`` steps, with failures at random times (exponential, mean
    ``mtbf_steps`` steps of time): each costs ``restart_s``, a load of the last checkpoint and
    the steps since. Returns the measured seconds, counts, and the mean save and step times.
    Without a ``directory``, a temporary one is made and removed. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    import torch
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as temporary:
            return run_with_failures(interval, work, step_s, mtbf_steps, state_bytes, restart_s,
                                     temporary, seed)
    rng = np.random.default_rng(seed)
    directory = Path(directory)
    mtbf_s = mtbf_steps * step_s
    state = {"w": torch.zeros(state_bytes // 4), "step": 0}
    checkpoint.save(state, directory, 0, keep=1)
    start = time.perf_counter()
    next_failure = start + rng.exponential(mtbf_s)
    saves = failures = redone = 0
    save_s, steps_s = [], []
    while state["step"] < work:
        t = time.perf_counter()
        time.sleep(step_s)
        state["w"].add_(1.0)
        state["step"] += 1
        steps_s.append(time.perf_counter() - t)
        if time.perf_counter() >= next_failure:  # the state is lost: back to the checkpoint
            failures += 1
            lost_at = state["step"]
            time.sleep(restart_s)
            state = checkpoint.load_latest(directory, report=lambda line: None)[0]
            redone += lost_at - state["step"]
            next_failure = time.perf_counter() + rng.exponential(mtbf_s)
            continue
        if state["step"] % interval == 0:
            t = time.perf_counter()
            checkpoint.save(state, directory, state["step"], keep=1)
            save_s.append(time.perf_counter() - t)
            saves += 1
    return {"seconds": time.perf_counter() - start, "saves": saves, "failures": failures,
            "redone": redone, "save_s": float(np.mean(save_s)) if save_s else 0.0,
            "step_s": float(np.mean(steps_s))}


def interval_rows(intervals, work=200, step_s=0.01, mtbf_steps=100, state_bytes=4 << 20,
                  restart_s=0.05, repeats=2):
    """One row per checkpoint interval K: measured time to finish (mean over ``repeats``
    failure draws) beside the first-order model with the measured save and step times. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    rows = []
    for K in intervals:
        runs = [run_with_failures(K, work, step_s, mtbf_steps, state_bytes, restart_s, seed=s)
                for s in range(repeats)]
        C = float(np.mean([r["save_s"] for r in runs if r["saves"]] or [0.0]))
        t = float(np.mean([r["step_s"] for r in runs]))  # a step as this machine ran it
        M = mtbf_steps * step_s
        ideal = work * t
        model = ideal * (1 + C / (K * t) + (K * t / 2 + restart_s) / M)
        rows.append({"interval": K, "seconds": float(np.mean([r["seconds"] for r in runs])),
                     "model_s": model, "ideal_s": ideal, "save_ms": 1e3 * C,
                     "failures": float(np.mean([r["failures"] for r in runs])),
                     "redone": float(np.mean([r["redone"] for r in runs]))})
    return rows


def young_steps(rows, step_s, mtbf_steps):
    """Young's interval in steps, from the save cost measured in ``rows``. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    C = float(np.median([r["save_ms"] for r in rows])) / 1e3
    return checkpoint.young_interval(C, mtbf_steps * step_s) / step_s


def format_tables(save_rows, interval_rows_, step_s, mtbf_steps):
    """Both tables as text, with the ceiling and Young's interval."""
    out = ["# save time by size (median ms); disk = the same bytes written and fsynced"]
    out += text_table(
        [["size", "disk", "torch.save", "atomic", "DCP", "load", "atomic/torch.save"]],
        [[format_size(r["size"]), f"{r['disk_ms']:.1f}", f"{r['torch_save_ms']:.1f}",
          f"{r['atomic_ms']:.1f}", f"{r['dcp_ms']:.1f}", f"{r['load_ms']:.1f}",
          f"{r['atomic_vs_torch_save']:.1f}x"] for r in save_rows], "<>>>>>>")
    biggest = save_rows[-1]
    rate = biggest["size"] / biggest["disk_ms"] / 1e3
    out.append(f"# ceiling: this disk writes and fsyncs {rate:.0f} MB/s; torch.save without "
               "fsync returns once the page cache has the bytes")
    if interval_rows_:
        best = min(interval_rows_, key=lambda r: r["seconds"])
        young = young_steps(interval_rows_, step_s, mtbf_steps)
        out.append(f"# time to finish {interval_rows_[0]['ideal_s']:.1f} s of work, failures "
                   f"every {mtbf_steps} steps on average, checkpoint every K steps")
        out += text_table(
            [["K", "measured (s)", "model (s)", "saves (ms)", "failures", "steps redone"]],
            [[r["interval"], f"{r['seconds']:.2f}", f"{r['model_s']:.2f}",
              f"{r['save_ms']:.1f}", f"{r['failures']:.1f}", f"{r['redone']:.1f}"]
             for r in interval_rows_], ">>>>>>")
        out.append(f"# best measured K = {best['interval']}; Young's sqrt(2CM) = {young:.0f} "
                   "steps")
    return "\n".join(out)


def arguments(parser):
    """The options of ``python -m course_lib bench checkpoint``."""
    a = parser.add_argument
    a("--sizes", type=argtype(parse_sizes), default=[1 << 20, 16 << 20],
      help="state sizes, like 1M,16M (default)")
    a("--intervals", type=argtype(lambda t: parse_list(t, what="--intervals",
                                                       example="2,5,10,20,50")),
      default=[2, 5, 10, 20, 50], help="checkpoint every K steps, a comma list (2,5,10,20,50)")
    a("--work", type=int, default=200, help="steps of work to finish (default 200)")
    a("--step-ms", type=float, default=10.0, help="one step's time (default 10 ms)")
    a("--mtbf", type=int, default=100, help="mean steps between failures (default 100)")
    a("--state", type=argtype(parse_sizes), default=[4 << 20],
      help="state size of the failure runs (default 4M)")
    a("--repeats", type=int, default=2, help="failure draws per K (default 2)")
    a("--csv", help="also write the rows to this file")


def main(args):
    """Run ``bench checkpoint`` with parsed ``args``."""
    if args.work < 1 or args.step_ms <= 0 or args.mtbf < 1 or args.repeats < 1:
        print("bench checkpoint: --work, --step-ms, --mtbf and --repeats must be positive",
              file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as directory:
            saves = save_times(args.sizes, directory)
        intervals = interval_rows(args.intervals, args.work, args.step_ms / 1e3, args.mtbf,
                                  args.state[0], repeats=args.repeats)
    except (OSError, BenchError) as e:
        print(f"bench checkpoint: {e}", file=sys.stderr)
        return 1
    print(format_tables(saves, intervals, args.step_ms / 1e3, args.mtbf))
    if args.csv:
        write_csv(saves + intervals, args.csv)
    return 0
