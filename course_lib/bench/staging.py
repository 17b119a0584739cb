"""``python -m course_lib bench staging``: a transfer staged through host memory against a direct
one, measured between two ranks, then the model for PCIe, InfiniBand and NVLink.

Introduced in notebooks/12_scaling_out.ipynb (:mod:`course_lib.staging`). Rank 0 sends each size
to rank 1 three ways, interleaved, ``--repeats`` times: directly (what GPUDirect RDMA or P2P
does), staged (a copy into a host buffer before the send and out of it after the receive:
what cudaMemcpy to and from host memory would be, here a memcpy) and staged in chunks (the
copies overlap the transfer). On bare loopback, then on the emulated ``--link``::

    python -m course_lib bench staging                      # 16M,64M; loopback and 10 Gbit/s
    python -m course_lib bench staging --sizes 4M-64M --link 1Gbit/s,50us --csv staging.csv
    python -m course_lib bench staging --model-only         # the GPU paths' model alone

Columns: each way's median time, what it added to the direct send and what the model
(:func:`course_lib.costmodel.path_time`: memcpy, link, memcpy) says it adds; every byte is
checked on arrival. The ceiling printed beside them: this machine's single-core memcpy, the
staging copy's own speed. The direct send is the native baseline every ratio is taken against.
"""

from __future__ import annotations

import sys

from course_lib import costmodel, staging
from course_lib.bench.common import (
    argtype,
    format_size,
    memcpy_bandwidth,
    parse_size,
    parse_sizes,
    text_table,
    write_csv,
)
from course_lib.runtime import netem

HELP = "a transfer staged through host memory vs direct (GPUDirect), measured and modelled"


def arguments(parser):
    """The options of ``python -m course_lib bench staging``."""
    a = parser.add_argument
    a("--sizes", type=argtype(parse_sizes), default=[16 << 20, 64 << 20],
      help="bytes, like 16M,64M or 4M-64M (doubling; default 16M,64M)")
    a("--link", type=argtype(netem.make_link), default=netem.make_link("10Gbit/s,25us"),
      help="the emulated network after loopback (default 10Gbit/s,25us)")
    a("--chunk", type=argtype(parse_size), default=1 << 20,
      help="chunk of the pipelined staging (default 1M)")
    a("--repeats", type=int, default=5, help="transfers per way and size (default 5)")
    a("--model-only", action="store_true", help="print the GPU paths' model only (no cluster)")
    a("--csv", help="also write the measured rows to this CSV file")


def model_table(sizes=(1 << 20, 16 << 20, 256 << 20, 1 << 30), chunk_bytes=4 << 20):
    """The model's effective GB/s of each GPU-to-GPU path of ``costmodel.gpu_paths()``."""
    header = ["path"] + [format_size(n) for n in sizes]
    body = []
    for name, stages in costmodel.gpu_paths().items():
        body.append([name] + [f"{n / costmodel.path_time(n, stages) / 1e9:.1f}" for n in sizes])
        if "staged" in name:
            body.append([f"  pipelined, {format_size(chunk_bytes)} chunks"] +
                        [f"{n / costmodel.path_time(n, stages, chunk_bytes) / 1e9:.1f}"
                         for n in sizes])
    lines = [f"# the model, effective GB/s (size / time): {costmodel.PCIE['PCIe 4.0 x16']}, "
             f"{costmodel.LINKS['InfiniBand HDR']}, {costmodel.LINKS['NVLink']}"]
    return "\n".join(lines + text_table(header, body))


def main(args):
    from course_lib.runtime.cluster import start_cluster
    if args.model_only:
        print(model_table())
        return 0
    if args.repeats < 1:
        print("bench staging: --repeats must be at least 1", file=sys.stderr)
        return 1
    rows = []
    try:
        print("# starting 2 engines", file=sys.stderr)
        with start_cluster(n=2, timeout=300) as cluster:
            for link in (None, args.link):
                rows += staging.measure(cluster, args.sizes, link, args.chunk, args.repeats)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"bench staging: {e}", file=sys.stderr)
        return 1
    print(staging.format_rows(rows))
    print(f"# ceiling: memcpy {memcpy_bandwidth():.1f} GB/s on one core (64 MiB), the staging "
          "copy's own speed; the direct send is the baseline (what GPUDirect leaves)")
    print()
    print(model_table())
    if args.csv:
        write_csv(rows, args.csv)
    return 0
