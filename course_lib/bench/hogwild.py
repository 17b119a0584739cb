"""``python -m course_lib bench hogwild``: Hogwild throughput vs workers, lock vs lock-free.

Introduced in notebooks/03_hogwild.ipynb. On the sparse problem of :mod:`course_lib.hogwild`
each configuration (workers x {lock-free, locked}) runs ``--repeats`` times, the
configurations interleaved so that a burst of load elsewhere on the machine hits them all
alike; the table shows medians and the ratios between them, measured in the same run::

    python -m course_lib bench hogwild                       # 1 and 2 workers, about 30 s
    python -m course_lib bench hogwild --workers 1,2,4 --csv hogwild.csv

Samples/s count every worker's samples over the slowest worker's time from the common start
(process start-up excluded: workers wait on a barrier and time themselves).
"""

import statistics
import sys
import time

from course_lib import hogwild, sparse_problem
from course_lib.bench.common import argtype, parse_list, text_table, write_csv

HELP = "Hogwild samples/s vs workers, lock vs lock-free"

COLUMNS = ["problem", "workers", "mode", "samples_per_s", "speedup_vs_1", "vs_locked",
           "conflict_rate", "conflicts_per_update", "final_loss", "loss_vs_serial", "repeats"]


def measure(workers=(1, 2), repeats=5, n_samples=20_000, n_features=20_000, nnz=32,
            num_epochs=3, lr=0.5, seed=0, timeout=120.0):
    """Run every (workers, lock) pair ``repeats`` times, interleaved; one row per pair."""
    data = sparse_problem.make_sparse_classification(n_samples, n_features, nnz, seed=seed)
    _, serial = sparse_problem.serial_sgd(data, lr=lr, num_epochs=num_epochs, seed=seed)
    configs = [(w, lock) for w in workers for lock in (False, True)]
    runs = {c: [] for c in configs}
    for _ in range(repeats):
        for w, lock in configs:
            runs[(w, lock)].append(hogwild.run_sparse(data, num_workers=w, lock=lock, lr=lr,
                                                      num_epochs=num_epochs, seed=seed,
                                                      timeout=timeout))
    speed = {c: statistics.median(r.samples_per_s for r in rs) for c, rs in runs.items()}
    base = speed.get((1, False)) or speed[configs[0]]
    rows = []
    for (w, lock), rs in runs.items():
        loss = statistics.median(r.final_loss for r in rs)
        rows.append({
            "problem": f"sparse logistic, {n_samples} x {n_features}, {nnz} nnz/row",
            "workers": w, "mode": "locked" if lock else "lock-free",
            "samples_per_s": speed[(w, lock)], "speedup_vs_1": speed[(w, lock)] / base,
            "vs_locked": speed[(w, False)] / speed[(w, True)] if not lock else 1.0,
            "conflict_rate": statistics.median(r.conflict_rate for r in rs),
            "conflicts_per_update": statistics.median(r.conflicts / max(r.samples, 1)
                                                      for r in rs),
            "final_loss": loss, "loss_vs_serial": loss / serial[-1], "repeats": repeats})
    return rows, serial[-1]


def format_table(rows, serial_loss, nnz=32, n_features=20_000):
    """The rows as text, with the targets of notebook 03 checked underneath."""
    out = [f"# Hogwild on {rows[0]['problem']}: median of {rows[0]['repeats']} interleaved runs",
           f"# serial SGD final loss {serial_loss:.5f}; two rows share a feature with "
           f"probability {sparse_problem.collision_probability(nnz, n_features):.3f}"]
    out += text_table(
        [["workers", "mode", "samples/s", "vs 1", "vs locked", "conflicts", "conflicts", "final",
          "loss /"],
         ["", "", "", "worker", "", "/update", "coords/upd", "loss", "serial"]],
        [[r["workers"], r["mode"], f"{r['samples_per_s']:.0f}", f"{r['speedup_vs_1']:.2f}x",
          f"{r['vs_locked']:.2f}x" if r["mode"] == "lock-free" else "-",
          f"{r['conflict_rate']:.4f}", f"{r['conflicts_per_update']:.4f}",
          f"{r['final_loss']:.5f}", f"{r['loss_vs_serial']:.3f}"] for r in rows], "><>>>>>>>")
    two = {r["mode"]: r for r in rows if r["workers"] == 2}
    if "lock-free" in two:
        free = two["lock-free"]
        out += ["", f"# 2 lock-free workers vs 1 worker: {free['speedup_vs_1']:.2f}x "
                    "(target >= 1.6x)",
                f"# 2 lock-free workers vs 2 locked: {free['vs_locked']:.2f}x (target >= 1.5x)",
                f"# final loss {abs(free['loss_vs_serial'] - 1):.2%} from serial SGD "
                "(target <= 5%)"]
    return "\n".join(out)


def _workers(text):
    return parse_list(text, what="--workers", example="1,2,4")


def arguments(parser):
    """The options of ``python -m course_lib bench hogwild``."""
    a = parser.add_argument
    a("--workers", type=argtype(_workers), default=[1, 2], help="comma list (default 1,2)")
    a("--repeats", type=int, default=5, help="runs of each configuration (default 5)")
    a("--samples", type=int, default=20_000, help="rows of the sparse data (default 20000)")
    a("--features", type=int, default=20_000, help="columns (default 20000)")
    a("--nnz", type=int, default=32, help="non-zeros per row (default 32: density 0.16%%)")
    a("--epochs", type=int, default=3, help="epochs per run (default 3)")
    a("--lr", type=float, default=0.5)
    a("--timeout", type=float, default=120.0, help="deadline of one run, s (default 120)")
    a("--csv", help="also write one row per configuration to this file")


def _spin(n):
    t = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    return time.perf_counter() - t


def python_ceiling(workers=2, n=3_000_000, repeats=3):
    """The speed-up this machine gives ``workers`` interpreter-bound processes at once: a pure
    Python loop timed alone, then in ``workers`` processes together (best of ``repeats``).
    Hogwild's per-sample loop is interpreter-bound, so its speed-up cannot exceed this."""
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_spin, [1000] * workers)  # the processes exist before timing starts
        alone = min(_spin(n) for _ in range(repeats))
        together = min(max(pool.map(_spin, [n] * workers, chunksize=1)) for _ in range(repeats))
    return workers * alone / together


def main(args):
    try:
        rows, serial = measure(args.workers, args.repeats, args.samples, args.features,
                               args.nnz, args.epochs, args.lr, timeout=args.timeout)
    except hogwild.HogwildError as err:
        print(f"bench hogwild: {err}", file=sys.stderr)
        return 1
    print(format_table(rows, serial, args.nnz, args.features))
    ceiling = python_ceiling(max(args.workers))
    print(f"# ceiling: {max(args.workers)} pure-Python processes run {ceiling:.2f}x as fast as "
          "one on this machine (an interpreter-bound speed-up cannot beat it)")
    if args.csv:
        write_csv(rows, args.csv, COLUMNS)
    return 0
