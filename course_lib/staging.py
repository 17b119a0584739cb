"""Staging through host memory against a direct send: what GPUDirect saves, measured on two ranks.

Introduced in notebooks/12_scaling_out.ipynb. Without GPUDirect, a GPU's buffer reaches another
GPU through host memory: a copy out of the GPU (cudaMemcpy over PCIe) into a staging buffer, the
send, and on the other side a copy from the receive buffer into the GPU. GPUDirect RDMA lets the
network card read and write GPU memory itself; GPUDirect P2P and NVLink do the same between two
GPUs of one server. What the staging costs is two more full passes over the data (store and
forward), or, cut into chunks that are copied while earlier chunks travel, about one chunk's
copies (a pipeline): :func:`course_lib.costmodel.path_time`.

Here there is no GPU, so the staging copy is a memcpy (``np.copyto``), measured as such, and the
wire is the course's transport (Gloo between two ranks of a cluster, on loopback or on the
emulated link of :mod:`course_lib.runtime.netem`). Rank 0 sends ``n`` bytes to rank 1 three ways::

    direct      send(src)                               recv(dst)
    staged      copy src -> staging; send(staging)      recv(staging); copy staging -> dst
    pipelined   per chunk: copy, isend                  per chunk: wait, copy out

    from course_lib import staging
    rows = staging.measure(cluster, sizes=(4 << 20, 16 << 20), link="10Gbit/s,25us")
    print(staging.format_rows(rows))

Each row holds the median time of each way, the data checked intact on arrival, this machine's
memcpy bandwidth and the model's times for the same three paths (memcpy, link, memcpy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from course_lib import costmodel
from course_lib.comm import wait_all
from course_lib.comm.subgroups import subgroup_comm
from course_lib.runtime import netem
from course_lib.runtime.tables import format_size, text_table

if TYPE_CHECKING:
    from course_lib.comm import Comm
    from course_lib.runtime.cluster import Cluster

WAYS = ("direct", "staged", "pipelined")


def _chunks(n, chunk_bytes):
    # [lo, hi) byte ranges of chunk_bytes each, the last one shorter when n is not a multiple
    return [(lo, min(lo + chunk_bytes, n)) for lo in range(0, n, chunk_bytes)]


def send_direct(comm: Comm, buf: np.ndarray) -> None:
    """Rank 0: send ``buf`` to rank 1 as it is (what GPUDirect does). Introduced in
    notebooks/12_scaling_out.ipynb."""
    comm.send(buf, 1, check_size=False)


def recv_direct(comm: Comm, buf: np.ndarray) -> None:
    """Rank 1: receive into ``buf`` as it is. Introduced in notebooks/12_scaling_out.ipynb."""
    comm.recv(buf, 0, check_size=False)


def send_staged(comm: Comm, buf: np.ndarray, staging: np.ndarray) -> None:
    """Rank 0: copy ``buf`` into the host buffer ``staging`` (the cudaMemcpy device -> host),
    then send that. Introduced in notebooks/12_scaling_out.ipynb."""
    np.copyto(staging, buf)
    comm.send(staging, 1, check_size=False)


def recv_staged(comm: Comm, buf: np.ndarray, staging: np.ndarray) -> None:
    """Rank 1: receive into ``staging``, then copy it into ``buf`` (the cudaMemcpy host ->
    device). Introduced in notebooks/12_scaling_out.ipynb."""
    comm.recv(staging, 0, check_size=False)
    np.copyto(buf, staging)


def send_pipelined(comm: Comm, buf: np.ndarray, staging: np.ndarray, chunk_bytes: int) -> None:
    """Rank 0: chunk by chunk, copy into ``staging`` and start sending it; the next chunk is
    copied while the previous one travels (Gloo sends in its own thread). Each chunk has its own
    place in ``staging``; real pipelines reuse two or three slots. Introduced in
    notebooks/12_scaling_out.ipynb."""
    requests = []
    for i, (lo, hi) in enumerate(_chunks(len(buf), chunk_bytes)):
        np.copyto(staging[lo:hi], buf[lo:hi])
        # tag i: chunk i lands in the receive posted for chunk i, whatever order they arrive in
        requests.append(comm.isend(staging[lo:hi], 1, tag=i, check_size=False))
    wait_all(requests)


def recv_pipelined(comm: Comm, buf: np.ndarray, staging: np.ndarray, chunk_bytes: int) -> None:
    """Rank 1: post a receive per chunk, then copy each out as soon as it has arrived, while
    the later ones are still on the wire. Introduced in notebooks/12_scaling_out.ipynb."""
    pieces = _chunks(len(buf), chunk_bytes)
    requests = [comm.irecv(staging[lo:hi], 0, tag=i, check_size=False)
                for i, (lo, hi) in enumerate(pieces)]
    for request, (lo, hi) in zip(requests, pieces, strict=True):
        request.wait()
        np.copyto(buf[lo:hi], staging[lo:hi])


def memcpy_seconds(n_bytes: int, repeats: int = 5) -> float:
    """Median seconds of one ``np.copyto`` of ``n_bytes`` between two warm buffers: what a
    staging copy costs here. Introduced in notebooks/12_scaling_out.ipynb."""
    src, dst = np.ones(n_bytes, np.uint8), np.zeros(n_bytes, np.uint8)
    times = []
    for _ in range(repeats + 1):  # the first copy faults the pages in: not counted
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


def _rank(sizes, chunk_bytes, repeats, timeout):
    """Runs on every rank: ranks 0 and 1 move each size each way ``repeats`` times (the ways
    interleaved), all other ranks return None. On rank 1: {size: {way: [seconds...]}, the
    data's check, memcpy seconds}. Times run from an instant both ranks agreed on to the last
    byte in ``dst``."""
    comm = subgroup_comm(2, timeout=timeout)  # every rank must call it
    if comm is None:
        return None
    out = {}
    for n in sizes:
        rng = np.random.default_rng(n)
        src = rng.integers(0, 256, n, dtype=np.uint8)  # the same bytes on both ranks
        buf = np.zeros(n, np.uint8) if comm.rank == 1 else src
        staging = np.zeros(n, np.uint8)
        times, intact = {w: [] for w in WAYS}, True
        for _ in range(repeats):
            for way in WAYS:
                if comm.rank == 1:
                    buf[:] = 0  # what arrives must be the data, not the last repeat's
                comm.barrier()
                t0 = netem.start_together(comm)
                if comm.rank == 0:
                    (send_direct(comm, buf) if way == "direct" else
                     send_staged(comm, buf, staging) if way == "staged" else
                     send_pipelined(comm, buf, staging, chunk_bytes))
                else:
                    (recv_direct(comm, buf) if way == "direct" else
                     recv_staged(comm, buf, staging) if way == "staged" else
                     recv_pipelined(comm, buf, staging, chunk_bytes))
                    times[way].append(time.monotonic() - t0)
                    intact = intact and bool(np.array_equal(buf, src))
        out[n] = dict(times=times, intact=intact, memcpy_s=memcpy_seconds(n))
    return out if comm.rank == 1 else None


def measure(cluster: Cluster, sizes: Sequence[int] = (4 << 20, 16 << 20),
            link: str | netem.Link | None = None, chunk_bytes: int = 1 << 20, repeats: int = 5,
            timeout: float = 60.0) -> list[dict]:
    """Move each of ``sizes`` bytes from rank 0 to rank 1 of ``cluster`` directly, staged and
    pipelined in chunks of ``chunk_bytes``, ``repeats`` times each, on the emulated ``link``
    (text like "10Gbit/s,25us" or a netem preset; None: bare loopback), set for the run and
    then put back. Returns one row per size: the median seconds of each way, ``intact`` (every
    received byte equal to the sent one), the memcpy bandwidth measured on rank 1, and the
    model's seconds for the same paths (:func:`model_rows`). Introduced in
    notebooks/12_scaling_out.ipynb."""
    if cluster.n < 2:
        raise ValueError("staging.measure needs a cluster of at least 2 ranks")
    before = cluster.link
    emulated = cluster.set_link(link)
    try:
        results = cluster.run(_rank, list(sizes), int(chunk_bytes), int(repeats), timeout,
                              timeout=timeout + 60)
    finally:
        cluster.set_link(before)
    got = results[1]  # rank 1 received, so rank 1 timed
    rows = []
    for n in sizes:
        r = got[n]
        median = {w: float(np.median(r["times"][w])) for w in WAYS}
        memcpy = costmodel.Link("memcpy", alpha=0.0, beta=r["memcpy_s"] / n)
        # the wire: the emulated link's model, else loopback as measured by the direct send
        wire = (emulated.costmodel() if emulated is not None else
                costmodel.Link("loopback", alpha=0.0, beta=median["direct"] / n))
        rows.append(dict(bytes=n, chunk_bytes=int(chunk_bytes), repeats=int(repeats),
                         link=str(emulated) if emulated else "loopback (no emulation)",
                         intact=r["intact"], memcpy_gbps=n / r["memcpy_s"] / 1e9,
                         **{f"{w}_s": median[w] for w in WAYS},
                         **{f"model_{w}_s": t for w, t in
                            model_times(n, memcpy, wire, chunk_bytes).items()}))
    return rows


def model_times(n_bytes: int, copy: costmodel.Link, wire: costmodel.Link,
                chunk_bytes: int | None) -> dict[str, float]:
    """The model's seconds for the three ways: direct = the wire alone; staged = copy, wire,
    copy, store and forward; pipelined = the same stages in chunks of ``chunk_bytes``
    (:func:`course_lib.costmodel.path_time`). Introduced in notebooks/12_scaling_out.ipynb."""
    return {"direct": costmodel.path_time(n_bytes, [wire]),
            "staged": costmodel.path_time(n_bytes, [copy, wire, copy]),
            "pipelined": costmodel.path_time(n_bytes, [copy, wire, copy], chunk_bytes)}


def format_rows(rows: list[dict]) -> str:
    """The rows of :func:`measure` as text: each way's time, what staging added to the direct
    send (measured: staged - direct) and what the model says it adds.
    Introduced in notebooks/12_scaling_out.ipynb."""
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == link]
        out.append(f"# {link}; pipelined in chunks of {format_size(mine[0]['chunk_bytes'])}; "
                   f"median of {mine[0]['repeats']}; 'added' = that way - direct, in ms; the "
                   "model's copies run at the memcpy speed measured here")
        header = ["size", "memcpy GB/s", "direct ms", "staged ms", "added", "model",
                  "pipelined ms", "added", "model", "intact"]
        body = []
        for r in mine:
            cells = [format_size(r["bytes"]), f"{r['memcpy_gbps']:.1f}",
                     f"{r['direct_s'] * 1e3:.1f}"]
            for way in ("staged", "pipelined"):
                cells += [f"{r[f'{way}_s'] * 1e3:.1f}",
                          f"{(r[f'{way}_s'] - r['direct_s']) * 1e3:+.1f}",
                          f"{(r[f'model_{way}_s'] - r['model_direct_s']) * 1e3:+.1f}"]
            body.append(cells + ["yes" if r["intact"] else "NO"])
        out += text_table(header, body) + [""]
    return "\n".join(out).rstrip()
