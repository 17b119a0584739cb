"""``python -m course_lib bench cluster``: how long a cluster takes to start, engines forked from
a warm template against fresh Pythons, and bare ipyparallel beside them.

Introduced in notebooks/00_welcome_and_cluster.ipynb (:mod:`course_lib.runtime.warm_start`). For
each number of engines, ``--repeats`` times, interleaved: the seconds from ``start_cluster(n)`` to
its first ``run`` returning, with ``warm=True`` (engines forked from a template that imported
PyTorch), with ``warm=False`` (each engine a fresh Python), and bare ipyparallel
(``ipp.Cluster(n).start_and_connect_sync()`` to its first ``apply``: no process group, no
PyTorch)::

    python -m course_lib bench cluster                   # 1, 2, 4, 8 engines, 5 times each
    python -m course_lib bench cluster --engines 4 --repeats 3

Columns: each way's median and spread (fastest to slowest). The ceiling printed beside them:
what one fresh Python takes to start and to import PyTorch here, the cost a fork saves.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from course_lib.bench.common import text_table

HELP = "cluster start time: engines forked from a warm template vs fresh, and bare ipyparallel"
WAYS = ("warm", "plain", "bare ipyparallel")


def arguments(parser):
    """The options of ``python -m course_lib bench cluster``."""
    a = parser.add_argument
    a("--engines", default="1,2,4,8", help="numbers of engines (default 1,2,4,8)")
    a("--repeats", type=int, default=5, help="starts per way and size (default 5)")


def start_seconds(way: str, n: int) -> float:
    """Seconds from asking for ``n`` engines to the first call on all of them returning."""
    start = time.perf_counter()
    if way == "bare ipyparallel":
        import ipyparallel as ipp
        cluster = ipp.Cluster(n=n, log_level=40)
        client = cluster.start_and_connect_sync()
        try:
            client.wait_for_engines(n, timeout=120, interactive=False)
            client[:].apply_sync(os.getpid)
            return time.perf_counter() - start
        finally:
            cluster.stop_cluster_sync()
    from course_lib.runtime.cluster import start_cluster
    with start_cluster(n=n, warm=way == "warm") as cluster:
        cluster.run(os.getpid)
        return time.perf_counter() - start


def python_ceiling() -> tuple[float, float]:
    """Seconds a fresh Python takes to start, and to start and import PyTorch."""
    def run(code):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - start
    return run("pass"), run("import torch")


def main(args):
    from course_lib.runtime.cluster import SHARED_ENV
    os.environ.pop(SHARED_ENV, None)  # a fresh cluster each time, never a kept one
    try:
        sizes = [int(x) for x in args.engines.split(",")]
    except ValueError:
        print(f"bench cluster: --engines takes numbers like 1,2,4, not {args.engines!r}",
              file=sys.stderr)
        return 1
    if args.repeats < 1 or min(sizes) < 1:
        print("bench cluster: --repeats and every --engines must be at least 1",
              file=sys.stderr)
        return 1
    body = []
    for n in sizes:
        times = {way: [] for way in WAYS}
        for _ in range(args.repeats):  # interleaved: a busy moment slows every way alike
            for way in WAYS:
                times[way].append(start_seconds(way, n))
        row = [str(n)]
        for way in WAYS:
            row.append(f"{statistics.median(times[way]):.2f} "
                       f"({min(times[way]):.2f}-{max(times[way]):.2f})")
        row.append(f"{statistics.median(times['plain']) / statistics.median(times['warm']):.1f}x")
        body.append(row)
        print(f"# {n} engines done", file=sys.stderr)
    print("\n".join(text_table(["engines"] + [f"{w}, s (spread)" for w in WAYS]
                               + ["plain / warm"], body)))
    bare, torch_import = python_ceiling()
    print(f"# ceiling: a fresh Python starts in {bare:.2f} s, {torch_import:.2f} s with PyTorch "
          f"imported ({os.cpu_count()} cores): what each engine's fork saves")
    return 0
