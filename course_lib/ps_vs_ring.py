"""Scaling out: the parameter server against ring-allreduce, measured, then modelled to thousands.

Introduced in notebooks/12_scaling_out.ipynb. Uber's story (Sergeev & Del Balso 2018, "Horovod:
fast and easy distributed deep learning in TensorFlow"): parameter servers were hard to set up
(how many servers for how many workers?) and slow at scale; ring-allreduce, through MPI and then
Horovod, fixed both. Three ways to average the gradient of the same model (B bytes) over N
workers, each step being ``compute_s`` of compute (a sleep) and then the exchange:

    ps1   the parameter server with 1 server (course_lib.ps, synchronous)
    ps    the parameter server with S servers, the parameters sharded (S = 4, "N" or "N/4")
    ring  the from-scratch ring allreduce of the gradient (course_lib.collectives)

Measured on the emulated network (:mod:`course_lib.runtime.netem`: every message occupies its
sender's egress and its receiver's ingress for alpha + n/bw; one interface per rank, full duplex),
then priced by the same alpha-beta model, per step:

    ps (S servers)  compute + (N + S) (alpha + B / (S bw))
    ring            compute + 2 (N-1) (alpha + B / (N bw))       (costmodel.allreduce_time)

The PS formula is exact for the course's protocol on that link model: each worker sends its S
shards one after the other, in server order, so the N pushes of shard s queue on server s's
ingress; a server replies to the N workers one after the other once it has them all; a worker
pushes again after its last reply and its compute. 1 server: (N + 1) message times of B, linear
in N (its link carries N B in and N B out; replies overlap the next pushes, full duplex, hence
N + 1 and not 2N). S = N: 2 B / bw + 2N alpha, like the ring's 2 (N-1)/N B / bw + 2 (N-1) alpha,
but with N more machines. A fixed S: (N/S + 1) B / bw, still linear in N::

    from course_lib import ps_vs_ring
    rows = ps_vs_ring.measure(cluster, workers=(2, 4, 8), servers=4)   # on 200 Mbit/s, 50 us
    print(ps_vs_ring.format_measured(rows))
    print(ps_vs_ring.format_model(ps_vs_ring.model_rows(ps_vs_ring.RESNET50)))

Scaling efficiency as Horovod reports it: throughput(N) / (N x throughput(1 worker)), the one
worker computing alone with no network; here that is ``compute_s / step time``. The model goes
where the laptop cannot: ``model_rows(RESNET50)`` prices ResNet-50 (compute per step from Goyal
et al. 2017) on the networks of :data:`costmodel.LINKS` up to 4096 workers, with no overlap of
communication and compute; ``HOROVOD_512`` is what Horovod's README reports at 512 GPUs.

It stays one file: every measurement is printed beside the model's prediction for it, so the
formulas, the published figures they are set against and the measured runs are read together.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from course_lib import costmodel, ps
from course_lib.collectives import allreduce
from course_lib.comm.subgroups import subgroup_comm
from course_lib.models import Quadratic
from course_lib.runtime import netem
from course_lib.runtime.tables import text_table

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster

LinkLike = str | costmodel.Link | netem.Link  # what cost_link reads: a preset name, text, a Link

METHODS = ("ps1", "ps", "ring")
NAMES = {"ps1": "PS, 1 server", "ps": "PS, S servers", "ring": "ring-allreduce"}


@dataclass(frozen=True)
class Workload:
    """A model to price: parameters, bytes per parameter, compute per step and batch per worker.

    Introduced in notebooks/12_scaling_out.ipynb."""

    name: str
    params: float
    bytes_per_param: int
    compute_s: float
    batch: int
    source: str = ""

    @property
    def n_bytes(self) -> float:
        """Bytes of one gradient (and of the parameters): what every step moves."""
        return self.params * self.bytes_per_param


# ResNet-50 (He et al. 2016): 25.6M parameters, fp32 gradients (102 MB). Compute per step from
# Goyal et al. 2017 ("Accurate, large minibatch SGD: training ImageNet in 1 hour"): 90 epochs of
# ImageNet (1.28M images) in about one hour on 256 P100 GPUs at 32 images each, i.e. 14,000
# iterations of 8192 images, about 0.26 s per iteration. Their communication is included, so
# 0.256 s is an upper bound on one P100's compute for 32 images (about 125 images/s).
RESNET50 = Workload("ResNet-50", 25.6e6, 4, 0.256, 32,
                    "25.6M fp32 parameters; 0.256 s per step of 32 images on a P100 "
                    "(Goyal et al. 2017: 90 epochs on 256 GPUs in about 1 hour)")

# What Horovod's README reports (github.com/horovod/horovod, "Benchmarks"): 128 servers with 4
# Pascal GPUs each on a RoCE-capable 25 Gbit/s network, tf_cnn_benchmarks.
HOROVOD_512 = dict(gpus=512, efficiency=0.90, models="Inception V3 and ResNet-101",
                   vgg16_efficiency=0.68,
                   setup="128 servers x 4 Pascal GPUs, RoCE-capable 25 Gbit/s network",
                   source="Horovod README, Benchmarks (github.com/horovod/horovod)")


# Uber's published numbers, each with its source. Sergeev & Del Balso 2018 ("Horovod: fast and
# easy distributed deep learning in TensorFlow", arXiv:1802.05799, the paper of the "Meet
# Horovod" post of October 2017) plot them as curves and state a few in their text; only those
# stated in words or in Horovod's README are here. ``approx`` marks one said in words ("half").
# Setting of all: Pascal GPUs, 4 per server, 25 Gbit/s network, tf_cnn_benchmarks.
UBER_128 = [
    dict(system="standard distributed TensorFlow", models="Inception V3, ResNet-101", gpus=128,
         network="25GbE, TCP", efficiency=0.50, approx=True,
         source="Sergeev & Del Balso 2018, Fig. 1 and its text: about half of the resources "
                "unused at 128 GPUs"),
    dict(system="Horovod", models="Inception V3, ResNet-101", gpus=128, network="25GbE, TCP",
         efficiency=0.88, approx=False,
         source="Sergeev & Del Balso 2018, Sec. 8 (Fig. 6): 88 % at 128 GPUs, 'about twice as "
                "fast as standard distributed TensorFlow'"),
    dict(system="Horovod", models="Inception V3, ResNet-101", gpus=128,
         network="25 Gbit/s RoCE (RDMA)", efficiency=0.90, approx=False,
         source="Horovod README, Oct. 2017 (32 servers x 4 Pascal GPUs): 90 %"),
    dict(system="Horovod", models="VGG-16", gpus=128, network="25 Gbit/s RoCE (RDMA)",
         efficiency=0.79, approx=False,
         source="Horovod README, Oct. 2017 (32 servers x 4 Pascal GPUs): 79 % for VGG-16"),
]
# RDMA against TCP on the same 25 Gbit/s network, Horovod (Sergeev & Del Balso 2018, Sec. 8,
# Fig. 7): Inception V3 and ResNet-101 gained three to four percent, VGG-16 about 30 %.
RDMA_SPEEDUP = {"Inception V3": (0.03, 0.04), "ResNet-101": (0.03, 0.04), "VGG-16": (0.30, 0.30)}
# Parameters of each model (Keras Applications' table): the gradient every step sends.
PARAMETERS = {"Inception V3": 23.9e6, "ResNet-50": 25.6e6, "ResNet-101": 44.7e6,
              "VGG-16": 138.4e6}


# ---------------------------------------------------------------- the formulas
def cost_link(link: LinkLike) -> costmodel.Link:
    """A :class:`costmodel.Link` from a costmodel or netem Link, a costmodel preset name
    ("10GbE" ...: the real network) or link text ("1Gbit/s,50us").
    Introduced in notebooks/12_scaling_out.ipynb."""
    if isinstance(link, costmodel.Link):
        return link
    if isinstance(link, netem.Link):
        return link.costmodel()
    if isinstance(link, str) and link in costmodel.LINKS:
        return costmodel.LINKS[link]
    made = netem.make_link(link)
    if made is None:
        raise ValueError("a link is needed to price a step: a preset like '10GbE', text like "
                         "'1Gbit/s,50us', or a Link")
    return made.costmodel()


def num_servers(servers: int | str, workers: int) -> int:
    """How many servers ``servers`` means for ``workers`` workers: an int (fixed), "N" (as many
    as workers) or "N/k" (one per k workers, at least 1).
    Introduced in notebooks/12_scaling_out.ipynb."""
    if isinstance(servers, (int, np.integer)) and not isinstance(servers, bool):
        if servers < 1:
            raise ValueError(f"servers must be >= 1, not {servers}")
        return int(servers)
    text = str(servers).replace(" ", "").upper()
    if text == "N":
        return int(workers)
    if text.startswith("N/") and text[2:].isdigit() and int(text[2:]) >= 1:
        return max(1, math.ceil(workers / int(text[2:])))
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"servers: a number like 4, 'N' or 'N/4' (one server per 4 workers), "
                     f"not {servers!r}")


def ps_step_time(n_bytes: float, workers: int | np.ndarray, servers: int | np.ndarray = 1,
                 link: LinkLike = "10GbE", compute_s: float = 0.0) -> float | np.ndarray:
    """Seconds per synchronous parameter-server step: compute + (N + S)(alpha + B / (S bw)).

    Exact for the course's protocol on the emulated link (see the module docstring); one
    server gives (N + 1) message times of the whole model, linear in N.
    Introduced in notebooks/12_scaling_out.ipynb."""
    model = cost_link(link)
    n, s = np.asarray(workers, float), np.asarray(servers, float)
    t = compute_s + (n + s) * (model.alpha + np.asarray(n_bytes, float) / s * model.beta)
    return float(t) if np.ndim(t) == 0 else t


def ring_step_time(n_bytes: float, workers: int | np.ndarray, link: LinkLike = "10GbE",
                   compute_s: float = 0.0) -> float | np.ndarray:
    """Seconds per data-parallel step with the ring: compute + 2(N-1)(alpha + B / (N bw))
    (``costmodel.allreduce_time("ring", ...)``; nothing to send for one worker).
    Introduced in notebooks/12_scaling_out.ipynb."""
    t = compute_s + costmodel.allreduce_time("ring", n_bytes, workers, cost_link(link))
    return float(t) if np.ndim(t) == 0 else t


def step_time(method: str, n_bytes: float, workers: int | np.ndarray, link: LinkLike = "10GbE",
              compute_s: float = 0.0, servers: int | str = 4) -> float | np.ndarray:
    """Seconds per step of ``method`` ("ps1", "ps" with ``servers`` as in :func:`num_servers`,
    or "ring"). Introduced in notebooks/12_scaling_out.ipynb."""
    if method == "ring":
        return ring_step_time(n_bytes, workers, link, compute_s)
    if method in ("ps1", "ps"):
        s = 1 if method == "ps1" else num_servers(servers, workers)
        return ps_step_time(n_bytes, workers, s, link, compute_s)
    raise ValueError(f"method must be one of {METHODS}, not {method!r}")


def busiest_bytes(method: str, n_bytes: float, workers: int, servers: int | str = 4) -> float:
    """Bytes through the busiest interface in one step, in and out together. A PS server takes
    N B / S in and sends as much out; a worker sends B and receives B; a ring rank sends and
    receives 2 (N-1)/N B. Introduced in notebooks/12_scaling_out.ipynb."""
    n = int(workers)
    if method == "ring":
        return 2 * 2 * (n - 1) / n * n_bytes
    s = 1 if method == "ps1" else num_servers(servers, n)
    if method not in ("ps1", "ps"):
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    return 2 * max(n / s, 1.0) * n_bytes


def efficiency(throughput: float, workers: int, throughput_1: float) -> float:
    """Scaling efficiency as Horovod reports it: throughput(N) / (N x throughput(1 worker)).

    Introduced in notebooks/12_scaling_out.ipynb."""
    return throughput / (workers * throughput_1)


def predict(method: str, workers: int, n_bytes: float, link: LinkLike, compute_s: float,
            batch: int = 32, servers: int | str = 4) -> dict:
    """The model's numbers for one configuration: a dict of ``step_s``, ``steps_per_s``,
    ``samples_per_s`` (N x batch per step), ``efficiency`` (``compute_s / step_s``),
    ``busiest_bytes`` and ``servers``. Introduced in notebooks/12_scaling_out.ipynb."""
    t = step_time(method, n_bytes, workers, link, compute_s, servers)
    s = {"ps1": 1, "ring": 0}.get(method) if method != "ps" else num_servers(servers, workers)
    return dict(method=method, workers=int(workers), servers=s, step_s=t, steps_per_s=1 / t,
                samples_per_s=workers * batch / t,
                efficiency=compute_s / t if compute_s > 0 else float("nan"),
                busiest_bytes=busiest_bytes(method, n_bytes, workers, servers))


# ---------------------------------------------------------------- the model, to thousands
WORKERS = tuple(2 ** k for k in range(13))  # 1 .. 4096


def model_rows(workload: Workload = RESNET50, links: Sequence[LinkLike] = tuple(costmodel.LINKS),
               workers: Sequence[int] = WORKERS, servers: int | str = "N/4",
               methods: Sequence[str] = METHODS) -> list[dict]:
    """The model's rows for ``workload`` on each link (preset names are the real networks of
    :data:`costmodel.LINKS`; a :class:`costmodel.Link` of your own works too), every N of
    ``workers`` and every method; ``servers`` for the sharded PS (default one per 4 workers).
    No overlap of communication with compute. Introduced in notebooks/12_scaling_out.ipynb."""
    rows = []
    for link in links:
        model = cost_link(link)
        for method in methods:
            for n in workers:
                row = predict(method, n, workload.n_bytes, model, workload.compute_s,
                              workload.batch, servers)
                rows.append(dict(row, link=model.name, workload=workload.name))
    return rows


def format_model(rows: list[dict], at: Sequence[int] = (1, 8, 64, 512, 4096),
                 servers: int | str = "N/4") -> str:
    """The rows of :func:`model_rows` as text: per link, step time and efficiency of each method
    at the N of ``at``. Introduced in notebooks/12_scaling_out.ipynb."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    names = {**NAMES, "ps": f"PS, {servers} servers"}
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        out.append(f"# {costmodel.LINKS.get(link, link)}")
        header = [[""] + [c for m in methods for c in (names[m], "")],
                  ["N"] + ["ms/step", "eff"] * len(methods)]
        table = []
        for n in at:
            cells = [n]
            for m in methods:
                hit = [r for r in rows if r["link"] == link and r["method"] == m
                       and r["workers"] == n]
                cells += ([f"{hit[0]['step_s'] * 1e3:,.0f}", f"{hit[0]['efficiency']:.0%}"]
                          if hit else ["-", "-"])
            table.append(cells)
        out += text_table(header, table) + [""]
    return "\n".join(out).rstrip()


# ---------------------------------------------------------------- measured on the cluster
# The measured runs' link: 1 Gbit/s slowed down 5x in bandwidth. On a small shared machine every
# message also costs a few ms of scheduling (ranks share 2 cores); the ring sends 2(N-1) messages
# of B/N one after another, so each must take much longer than that on the link: 1 MiB / 8 at
# 200 Mbit/s is 5 ms. (At 1 Gbit/s the 8-rank ring measured at half the model or less.)
LINK = "200Mbit/s,50us"


def _ring_rank(n_params, workers, compute_s, steps, batch, lr, timeout):
    """Runs on every rank: the first ``workers`` ranks train with the ring for ``steps`` timed
    steps after one warm-up (sleep ``compute_s``, gradient, ring allreduce, update); returns
    (seconds, payload bytes this rank sent in the timed steps), None on the other ranks."""
    comm = subgroup_comm(workers, timeout=timeout)  # every rank must call it
    if comm is None:
        return None
    problem, theta = Quadratic(), np.zeros(n_params)
    X = np.zeros((batch, 1))

    def step():
        time.sleep(compute_s)
        grad = problem.grad_sum(theta, X, None)
        allreduce(grad, comm, algorithm="ring", check=False)
        theta[:] -= lr * grad / (workers * batch)  # grad sums N batches: / (N batch) is the mean

    step()  # warm-up: connections made, buffers touched
    sent = comm.bytes_sent
    t0 = netem.start_clock(comm)
    for _ in range(steps):
        step()
    return time.monotonic() - t0, comm.bytes_sent - sent


def _measure_ring(cluster, n_params, workers, compute_s, steps, batch, timeout):
    results = [r for r in cluster.run(_ring_rank, n_params, workers, compute_s, steps, batch,
                                      0.1, timeout, timeout=timeout + 60) if r is not None]
    seconds = max(t for t, _ in results)  # a synchronous step ends when its slowest rank does
    sent = max(b for _, b in results) / steps
    # a ring rank receives from its left what it sends to its right: in + out = 2 x sent
    return steps / seconds, 2 * sent


def _measure_ps(cluster, n_params, workers, servers, compute_s, steps, batch, timeout):
    spec = ps.make_spec(servers, workers, world_size=cluster.n)
    X = np.zeros((steps * batch * workers, 1))
    r = ps.train(cluster, spec, Quadratic(), X, np.zeros(len(X)), np.zeros(n_params), lr=0.1,
                 num_epochs=1, batch_size=batch * workers, mode="sync", timeout=timeout,
                 slow={w: compute_s for w in spec["worker"]} if compute_s > 0 else None)
    shard = 8 * n_params / servers
    # the start is not a step: the chief's init (a shard in, a shard out) and the other
    # workers' first pull (a shard out each) pass through every server once
    server = max(s["bytes_in"] + s["bytes_out"] - (workers + 1) * shard for s in r.servers)
    # a worker sends B per push (the chief also B once at init) and receives as much
    worker = 2 * max(w["bytes"] - (8 * n_params if k == 0 else 0)
                     for k, w in enumerate(r.workers))
    return r.step_rate, max(server, worker) / steps


def measure(cluster: Cluster, workers: Sequence[int] = (2, 4, 8), servers: int | str = 4,
            n_params: int = 2**17, compute_s: float = 0.05, steps: int = 6, batch: int = 32,
            link: str | netem.Link | None = LINK, methods: Sequence[str] = METHODS,
            timeout: float = 30.0, progress: bool = False) -> list[dict]:
    """Train the same model (``n_params`` float64 parameters, a quadratic whose gradient costs
    one pass over them) synchronously with each method for every N in ``workers``, each step
    ``compute_s`` of compute (a sleep) then the exchange, on the emulated ``link`` (set on the
    cluster for the run, then put back). One worker alone (no network) gives throughput(1).

    Returns rows (dicts): measured ``steps_per_s``, ``samples_per_s``, ``busiest_bytes`` (per
    step, in + out, the start excluded) and ``efficiency``, each beside the model's
    (``model_...``), and ``ratio`` = measured / model steps per second. The PS needs N + S
    ranks: the cluster must have them. ``progress=True`` shows a bar (``tqdm.auto``) naming
    the run under way, removed when done. Introduced in notebooks/12_scaling_out.ipynb."""
    if not workers or min(workers) < 1:
        raise ValueError(f"workers: a list of numbers >= 1, not {workers!r}")
    bad = set(methods) - set(METHODS)
    if bad:
        raise ValueError(f"methods must be among {METHODS}, not {sorted(bad)}")
    # a PS run takes N workers + S servers, each a rank of its own; the ring takes N
    need = max([n + num_servers(servers if m == "ps" else 1, n) for m in methods if m != "ring"
                for n in workers] + [max(workers)])
    if need > cluster.n:
        raise ValueError(f"the PS with {max(workers)} workers and its servers needs {need} "
                         f"ranks; this cluster has {cluster.n}: start_cluster(n={need})")
    before = cluster.link
    emulated = cluster.set_link(link) if link is not None else cluster.link
    if emulated is None:
        raise ValueError(f"measure() needs an emulated link (link={LINK!r}): on bare "
                         "loopback every method is bound by the machine, not the network")
    from tqdm.auto import tqdm  # optional: a progress bar, only when measuring
    n_bytes, rows = 8 * n_params, []
    bar = tqdm(total=1 + len(methods) * len(workers), desc="measuring", disable=not progress,
               leave=False)
    try:
        bar.set_postfix_str("1 worker alone")
        one, _ = _measure_ring(cluster, n_params, 1, compute_s, steps, batch, timeout)
        rows.append(_row("one", 1, 0, one, 0.0, one, batch, n_bytes, emulated, compute_s,
                         n_params, steps))
        bar.update()
        for method in methods:
            for n in workers:
                bar.set_postfix_str(f"{method}, N = {n}")
                if method == "ring":
                    rate, busiest = _measure_ring(cluster, n_params, n, compute_s, steps, batch,
                                                  timeout)
                    s = 0
                else:
                    s = 1 if method == "ps1" else num_servers(servers, n)
                    rate, busiest = _measure_ps(cluster, n_params, n, s, compute_s, steps,
                                                batch, timeout)
                rows.append(_row(method, n, s, rate, busiest, one, batch, n_bytes, emulated,
                                 compute_s, n_params, steps))
                bar.update()
    finally:
        bar.close()
        if link is not None:
            cluster.set_link(before)
    return rows


def ring_over_ps(rows: list[dict], workers: int | None = None) -> dict:
    """How many times the ring's throughput each parameter server's is, measured (rows of
    :func:`measure`) at ``workers`` (default: the largest N measured by both), beside the
    model's: {"workers", "servers", "ps1", "ps", "model_ps1", "model_ps"} (a method not
    measured is missing). What Uber's "about twice as fast" compares, here.
    Introduced in notebooks/12_scaling_out.ipynb."""
    by = {(r["method"], r["workers"]): r for r in rows}
    both = sorted(n for m, n in by if m == "ring" and any(k[1] == n and k[0] != "ring"
                                                          for k in by))
    n = workers if workers is not None else (both[-1] if both else None)
    ring = by.get(("ring", n))
    if ring is None:
        raise ValueError(f"no ring row at N = {n}: measure the ring and a PS at the same N")
    out = {"workers": n}
    for method in ("ps1", "ps"):
        ps = by.get((method, n))
        if ps is not None:
            out[method] = ring["samples_per_s"] / ps["samples_per_s"]
            out[f"model_{method}"] = ring["model_samples_per_s"] / ps["model_samples_per_s"]
            if method == "ps":
                out["servers"] = ps["servers"]
    return out


def machine_floor(cluster: Cluster, n_params: int = 2**17, workers: int = 8, steps: int = 5,
                  timeout: float = 30.0) -> dict:
    """The machine's own cost: seconds per ring step (no compute) on bare loopback, the emulated
    link switched off for it (then put back), and that time per message of the 2(N-1). What
    the cores add to every emulated step; a real cluster has cores per rank.
    Introduced in notebooks/12_scaling_out.ipynb."""
    before = cluster.link
    cluster.set_link(None)
    try:
        rate, _ = _measure_ring(cluster, n_params, workers, 0.0, steps, 1, timeout)
    finally:
        cluster.set_link(before)
    return dict(workers=workers, params=n_params, step_s=1 / rate,
                per_message_s=1 / rate / max(2 * (workers - 1), 1))


def _row(method, n, s, rate, busiest, one, batch, n_bytes, link, compute_s, n_params, steps):
    if method == "one":
        model = dict(step_s=compute_s, busiest_bytes=0.0)
    else:
        model = predict(method, n, n_bytes, link, compute_s, batch, max(s, 1))
    model_rate = 1 / model["step_s"] if model["step_s"] > 0 else float("inf")
    return dict(method=method, workers=n, servers=s, steps_per_s=rate,
                samples_per_s=n * batch * rate, busiest_bytes=busiest,
                efficiency=efficiency(n * batch * rate, n, batch * one),
                model_steps_per_s=model_rate, model_samples_per_s=n * batch * model_rate,
                model_busiest_bytes=model["busiest_bytes"],
                model_efficiency=compute_s * model_rate, ratio=rate / model_rate,
                params=n_params, compute_s=compute_s, batch=batch, steps=steps, link=link.text)


def format_measured(rows: list[dict]) -> str:
    """The rows of :func:`measure` as text, the model beside every measurement.
    Introduced in notebooks/12_scaling_out.ipynb."""
    if not rows:
        return "# no rows"
    r0 = rows[0]
    link = netem.make_link(r0["link"])
    names = {**NAMES, "one": "1 worker, no network"}
    title = (f"# {r0['params']} float64 parameters ({8 * r0['params'] / 2**20:g} MiB), "
             f"{r0['compute_s'] * 1e3:g} ms compute and {r0['batch']} samples per worker step, "
             f"emulated link {link}")
    header = ["method", "N", "S", "steps/s", "model", "meas/model", "samples/s", "model",
              "busiest MB/step", "model", "efficiency", "model"]
    body = [[names[r["method"]], r["workers"], r["servers"] or "-", f"{r['steps_per_s']:.2f}",
             f"{r['model_steps_per_s']:.2f}", f"{r['ratio']:.2f}", f"{r['samples_per_s']:.0f}",
             f"{r['model_samples_per_s']:.0f}", f"{r['busiest_bytes'] / 1e6:.2f}",
             f"{r['model_busiest_bytes'] / 1e6:.2f}", f"{r['efficiency']:.0%}",
             f"{r['model_efficiency']:.0%}"] for r in rows]
    return "\n".join([title] + text_table(header, body))
