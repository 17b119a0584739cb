"""``python -m course_lib bench ps``: parameter-server throughput vs servers, workers and mode.

Introduced in notebooks/04_parameter_server.ipynb. One local cluster of ``max(S + W)`` engines
is started once and reused; ranks not needed by a configuration get the role "idle". The model
is a synthetic quadratic with many parameters (default 2M float64 = 16 MiB) so that the time
goes into moving parameters and gradients, not into computing them::

    python -m course_lib bench ps                              # 1-2 servers x 1-3 workers
    python -m course_lib bench ps --params 4M --steps 10 --csv ps.csv
    python -m course_lib bench ps --link 1Gbit/s,50us --params 250K --modes sync

Columns: pushes/s (worker steps per second, all workers together), samples/s, and the bytes
each server moved per second (in + out). With one server every byte passes through one
process: adding workers stops adding throughput; a second server splits that traffic. On an
emulated network (``--link``, :mod:`course_lib.runtime.netem`) each sync row also carries the steps
per second the servers applied and what the alpha-beta model predicts (``predicted_sync_steps``).
"""

from __future__ import annotations

import sys

import numpy as np

from course_lib.bench.common import argtype, parse_list, parse_size, text_table, write_csv
from course_lib.models import Quadratic
from course_lib.runtime import netem

HELP = "parameter-server throughput vs servers, workers, sync/async"


def predicted_sync_steps(n_params, servers, workers, link, steps=8):
    """Sync steps per second on an emulated ``link``, by playing the protocol's messages through
    the link model (:class:`netem.Interface`, one per rank, on a clock of its own).

    Each step every worker sends each server its shard of the gradient, in server order; a
    server that has all W shards replies to the workers in the order their pushes arrived; a
    worker pushes again once it has every server's reply. Interfaces are full duplex, so a server
    already receiving the next pushes while it still replies. One server's interface carries all
    W workers' traffic; S servers split it. Introduced in notebooks/04_parameter_server.ipynb."""
    shard = 8 * n_params / servers  # float64
    worker_nic = [netem.Interface(link) for _ in range(workers)]
    server_nic = [netem.Interface(link) for _ in range(servers)]
    ready, step_ends = [0.0] * workers, []
    for _ in range(steps):
        arrived = [[] for _ in range(servers)]
        for w in range(workers):
            for s in range(servers):
                start, _ = worker_nic[w].depart(shard, now=ready[w])
                arrived[s].append((server_nic[s].arrive(start, shard), w))
        replied = [0.0] * workers
        for s in range(servers):
            all_in = max(t for t, _ in arrived[s])
            for _, w in sorted(arrived[s]):
                start, _ = server_nic[s].depart(shard, now=all_in)
                replied[w] = max(replied[w], worker_nic[w].arrive(start, shard))
            step_ends.append(all_in)
        ready = replied
    ends = step_ends[servers - 1::servers]  # when the last server had every push of a step
    return (len(ends) - 1) / (ends[-1] - ends[0])


def ps_bench(cluster, servers=(1, 2), workers=(1, 2, 3), modes=("sync", "async"),
             n_params=2 * 2**20, steps=16, batch_size=32, timeout=30.0):
    """Rows (dicts) of throughput for every (mode, servers, workers) that fits on the cluster;
    on a cluster with an emulated link, sync rows add measured and predicted steps per second.
    Introduced in notebooks/04_parameter_server.ipynb."""
    from course_lib import ps
    problem, theta0 = Quadratic(), np.zeros(n_params)
    rows = []
    for mode in modes:
        for S in servers:
            for W in workers:
                if S + W > cluster.n:
                    continue
                # global batch = W * batch_size: every worker pushes `steps` times
                X = np.zeros((steps * batch_size * W, 1))
                y = np.zeros(len(X))
                spec = ps.make_spec(S, W, world_size=cluster.n)
                r = ps.train(cluster, spec, problem, X, y, theta0, lr=0.1, num_epochs=1,
                             batch_size=batch_size * W,
                             mode=mode, timeout=timeout)
                total_steps = sum(w["steps"] for w in r.workers)
                rows.append(dict(
                    mode=mode, servers=S, workers=W, params=n_params,
                    pushes_per_s=r.pushes_per_s,
                    samples_per_s=sum(sum(w["counts"]) for w in r.workers) / r.elapsed,
                    server_mb_per_s=max(r.bytes_per_server()) / r.elapsed / 1e6,
                    mean_staleness=float(r.staleness.mean()) if total_steps else 0.0,
                    time_s=r.elapsed, steps_per_s=r.step_rate if mode == "sync" else None,
                    server_mb_per_step=max(r.bytes_per_server()) / steps / 1e6,
                    predicted_steps_per_s=(predicted_sync_steps(n_params, S, W, cluster.link)
                                           if mode == "sync" and cluster.link else None)))
    return rows


def format_ps_table(rows):
    """The rows as a text table (with the model's sync steps/s on an emulated link).
    Introduced in notebooks/04_parameter_server.ipynb."""
    title = (f"# parameter server throughput ({rows[0]['params']} float64 parameters)"
             if rows else "# no rows")

    def rate(value):
        return "-" if value is None else f"{value:.1f}"

    return "\n".join([title] + text_table(
        ["mode", "servers", "workers", "params", "pushes/s", "samples/s", "MB/s/server",
         "staleness", "time_s", "steps/s", "model"],
        [[r["mode"], r["servers"], r["workers"], r["params"], f"{r['pushes_per_s']:.1f}",
          f"{r['samples_per_s']:.0f}", f"{r['server_mb_per_s']:.0f}",
          f"{r['mean_staleness']:.2f}", f"{r['time_s']:.2f}", rate(r.get("steps_per_s")),
          rate(r.get("predicted_steps_per_s"))] for r in rows], ">" * 11))


def ints(text):
    """'1,2' -> [1, 2]: a comma list of server or worker counts."""
    return parse_list(text, what="servers and workers", example="1,2")


def arguments(parser):
    """The options of ``python -m course_lib bench ps``."""
    a = parser.add_argument
    a("--servers", type=argtype(ints), default=[1, 2], help="comma list (default 1,2)")
    a("--workers", type=argtype(ints), default=[1, 2, 3], help="comma list (default 1,2,3)")
    a("--modes", default="sync,async", help="sync, async or both (default sync,async)")
    a("--params", default="2M", help="number of float64 parameters, like 500K or 4M (default 2M)")
    a("--steps", type=int, default=16, help="pushes per worker (default 16)")
    a("--batch-size", type=int, default=32, help="samples per push (default 32)")
    a("--engines", type=int, default=None,
      help="cluster size (default max servers + max workers)")
    a("--timeout", type=float, default=30.0, help="deadline of each wait, s (default 30)")
    a("--link", type=argtype(netem.make_link), default=None,
      help="an emulated network, like 1Gbit/s,50us (default: none, loopback as it is)")
    a("--csv", help="also write the rows to this CSV file")


def main(args):
    from course_lib.runtime.cluster import start_cluster
    try:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not modes or set(modes) - {"sync", "async"}:
            raise ValueError(f"--modes: choose sync, async or sync,async, not {args.modes!r}")
        n_params = parse_size(args.params)
        engines = args.engines or max(args.servers) + max(args.workers)
        print(f"# starting {engines} engines", file=sys.stderr)
        with start_cluster(n=engines, timeout=300, link=args.link) as cluster:
            rows = ps_bench(cluster, args.servers, args.workers, modes, n_params, args.steps,
                            args.batch_size, args.timeout)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"bench ps: {e}", file=sys.stderr)
        return 1
    print(format_ps_table(rows))
    skipped = [(s, w) for s in args.servers for w in args.workers if s + w > engines]
    if skipped:
        print(f"# skipped (more ranks than {engines} engines): {skipped}")
    if args.csv:
        write_csv(rows, args.csv)
    return 0
