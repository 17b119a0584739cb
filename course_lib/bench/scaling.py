"""``python -m course_lib bench scaling``: the parameter server against ring-allreduce, measured on
an emulated link beside the alpha-beta model, then the model to thousands of workers.

Introduced in notebooks/12_scaling_out.ipynb (:mod:`course_lib.ps_vs_ring`). One local cluster of
``max N + max S`` engines is started once; every configuration trains the same model (a float64
vector, 1 MiB by default) synchronously, each step a sleep of ``--compute-ms`` (the compute)
then the exchange: the PS with 1 server, the PS with S servers (``--servers 4``, ``N`` or
``N/2``) and the from-scratch ring allreduce, for each N of ``--workers``::

    python -m course_lib bench scaling                      # N = 2, 4, 8; S = 4; ~40 s
    python -m course_lib bench scaling --servers N --workers 2,4 --csv ps_vs_ring.csv
    python -m course_lib bench scaling --model-only         # the model table alone, no cluster

Columns: steps/s, samples/s, the bytes (in + out) through the busiest interface per step (a
PS server's, else a worker's) and the scaling efficiency as Horovod reports it (throughput(N) /
(N x one worker alone)), each beside the model's, and measured / model steps per second. The
emulated link never delivers early, so that ratio is at most about 1; what the machine adds
(ranks share its cores) pulls it below: printed as the ceiling, with the single-core memcpy
bandwidth, is the ring's step on bare loopback. Then the model for ResNet-50 (25.6M fp32
parameters, 0.256 s of compute per step: ``ps_vs_ring.RESNET50``) on each network preset, N up to
4096. About 40 s on 2 busy cores, half of it starting 12 engines.
"""

from __future__ import annotations

import sys

from course_lib import ps_vs_ring
from course_lib.bench.common import (
    argtype,
    memcpy_bandwidth,
    parse_list,
    parse_size,
    write_csv,
)
from course_lib.runtime import netem

HELP = "PS (1 and S servers) vs ring-allreduce: measured on an emulated link, modelled to 4096"


def _workers(text):
    return parse_list(text, what="--workers", example="2,4,8")


def _servers(text):
    ps_vs_ring.num_servers(text, 8)  # raises ValueError on bad text
    return int(text) if text.strip().isdigit() else text.strip()


def arguments(parser):
    """The options of ``python -m course_lib bench scaling``."""
    a = parser.add_argument
    a("--workers", type=argtype(_workers), default=[2, 4, 8], help="comma list (default 2,4,8)")
    a("--servers", type=argtype(_servers), default=4,
      help="servers of the sharded PS: a number, N or N/k (default 4)")
    a("--params", default="128K", help="float64 parameters, like 64K or 1M (default 128K)")
    a("--compute-ms", type=float, default=50.0, help="compute per step, a sleep (default 50)")
    a("--steps", type=int, default=6, help="timed steps per configuration (default 6)")
    a("--batch", type=int, default=32, help="samples per worker step (default 32)")
    a("--link", type=argtype(netem.make_link), default=netem.make_link(ps_vs_ring.LINK),
      help=f"the emulated network (default {ps_vs_ring.LINK})")
    a("--model-only", action="store_true", help="print the model table only (no cluster)")
    a("--csv", help="also write the measured rows to this CSV file")


def _model_table():
    w = ps_vs_ring.RESNET50
    lines = [f"# the model to thousands: {w.name}, {w.source}; PS with 1 server, with N/4 "
             "servers, ring; no overlap of communication with compute"]
    return "\n".join(lines + [ps_vs_ring.format_model(ps_vs_ring.model_rows(w))])


def main(args):
    from course_lib.runtime.cluster import start_cluster
    if args.model_only:
        print(_model_table())
        return 0
    try:
        n_params = parse_size(args.params)
        if args.steps < 2:
            raise ValueError("--steps must be at least 2 (a rate needs two step ends)")
        engines = max(max(args.workers) + ps_vs_ring.num_servers(args.servers, n)
                      for n in args.workers)
        print(f"# starting {engines} engines", file=sys.stderr)
        with start_cluster(n=engines, timeout=300) as cluster:
            rows = ps_vs_ring.measure(cluster, args.workers, args.servers, n_params,
                                   args.compute_ms / 1e3, args.steps, args.batch, args.link)
            floor = ps_vs_ring.machine_floor(cluster, n_params, max(args.workers))
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"bench scaling: {e}", file=sys.stderr)
        return 1
    print(ps_vs_ring.format_measured(rows))
    print(f"# link: {args.link} (per message alpha + n/bw on each rank's interface, full "
          f"duplex); the model is the formula on it")
    print(f"# ceiling: memcpy {memcpy_bandwidth():.1f} GB/s on one core; the ring of "
          f"{8 * n_params / 2**20:g} MiB over {floor['workers']} ranks on bare loopback takes "
          f"{floor['step_s'] * 1e3:.1f} ms per step ({floor['per_message_s'] * 1e3:.2f} ms per "
          "message): the machine's own floor, its cores and not the link")
    print()
    print(_model_table())
    if args.csv:
        write_csv(rows, args.csv)
    return 0
