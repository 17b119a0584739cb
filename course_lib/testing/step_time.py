"""Step times measured on this machine, for the plan of :mod:`course_lib.scale_plan` to be
checked against: the machine's ceilings (matrix products, the model's step, the optimizer)
and the transformer's steps on a mesh over an emulated link."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from course_lib import costmodel, planner
from course_lib import mesh as M
from course_lib import scale_plan as S
from course_lib import transformer as tf
from course_lib.collectives import allreduce
from course_lib.comm import get_comm
from course_lib.runtime import netem


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs of ``fn``, in seconds (the least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def allreduce_seconds_on_rank(link: str, sizes: list[int], repeats: int = 5,
                              timeout: float = 30.0) -> list[float]:
    """The median seconds of the course's ring allreduce of each of ``sizes`` bytes (float32)
    over the whole world on the emulated ``link``, from an instant all ranks agreed on."""
    netem.set_link(link)
    try:
        comm = get_comm("torch", timeout=timeout)
        world = get_comm("torch", timeout=timeout, link=None)
        out = []
        for n in sizes:
            buf, times = torch.ones(n // 4), []
            for _ in range(repeats):
                world.barrier()
                start = netem.start_together(world)
                allreduce(buf, comm, check=False)
                times.append(time.monotonic() - start)
            out.append(statistics.median(times))
        return out
    finally:
        netem.set_link(None)


def measured_link(cluster_run: Callable, link: str, ranks: int,
                  sizes: tuple[int, ...] = (2**16, 2**20, 2**23)) -> costmodel.Link:
    """The alpha and beta the ranks really get on the emulated ``link``: fitted to the ring
    allreduce's times (slowest rank) over all ``ranks``. On a few cores a message also waits
    for its receiver to be scheduled: alpha comes out above the emulated latency."""
    rows = cluster_run(allreduce_seconds_on_rank, link, list(sizes))
    seconds = np.max(rows, axis=0)
    fitted = costmodel.fit_alpha_beta(sizes, seconds, "ring", ranks)
    return costmodel.Link(f"{link}, measured", fitted.alpha, fitted.beta)


def machine_on_rank(cfg: tf.GPTConfig, share: int, dtype: torch.dtype = torch.float32,
                    repeats: int = 5) -> dict:
    """On every rank at once (sharing the cores, as in a step): the seconds of the model's
    forward and backward on ``share`` sequences and of an AdamW update, ``repeats`` times
    each, every one started together; on rank 0 alone first, a core's peak FLOP/s (a
    512 x 512 matrix product, the fastest of 5)."""
    world = get_comm("torch", link=None)
    peak = 0.0
    if world.rank == 0:
        a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
        peak = 2 * 512**3 / best_of(lambda: a @ b)

    def together(fn: Callable[[], object]) -> list[float]:
        times = []
        for _ in range(repeats):
            world.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times

    model = tf.GPT(cfg).to(dtype)
    idx = torch.randint(0, cfg.vocab_size, (share, cfg.context),
                        generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world.barrier()
    return dict(peak=peak, step=together(lambda: model(idx, idx.roll(-1, 1))[1].backward()),
                update=together(opt.step), parameters=model.num_parameters())


def this_machine(cluster_run: Callable, cfg: tf.GPTConfig, batch: int, ranks: int,
                 link: costmodel.Link) -> S.Hardware:
    """This machine as a cluster of ``ranks`` ranks joined by ``link`` (:func:`measured_link`)
    that share its cores: a core's peak FLOP/s, the efficiency the model's step reaches on a
    rank's share of the batch (``batch / ranks`` sequences) while every rank computes (the
    slowest rank's, median of 5), Adam's seconds per parameter likewise; no overlap of
    messages and computation (moving a message takes the cores the ranks compute on).
    ``cluster_run``: ``cluster.run``."""
    share = max(1, batch // ranks)
    rows = cluster_run(machine_on_rank, cfg, share)

    def slowest(kind: str) -> float:  # each time, the slowest rank; then the median
        return statistics.median(map(max, zip(*(r[kind] for r in rows), strict=True)))

    cores = len(os.sched_getaffinity(0))
    flops = share * sum(S.flops_per_sequence(S.Model.of(cfg), cfg.context,
                                             cfg.recompute).values())
    peak, part = rows[0]["peak"], min(1, cores / ranks)  # the part of a core a rank gets
    return S.Hardware("this machine", devices=ranks, per_node=ranks, memory=24 * 2**30,
                     peak=peak, efficiency=flops / (slowest("step") * peak * part),
                     inside=link, between=link, overlap=False, cores=cores,
                     optimizer_seconds=slowest("update") * part / rows[0]["parameters"])


def timed_steps_on_rank(shape: dict[str, int], link: str, cfg: tf.GPTConfig, batch: int,
                        steps: int = 4, dtype: torch.dtype = torch.float32,
                        timeout: float = 60.0) -> dict:
    """The transformer trained ``steps`` steps on a mesh of ``shape`` over the emulated
    ``link`` (forward, backward, :func:`mesh.reduce_gradients`, AdamW), each step timed from an
    instant all ranks agreed on. Returns the seconds of each step and this rank's coordinates.
    The link is switched off again at the end."""
    netem.set_link(link)
    try:
        mesh = M.make_mesh(shape, timeout=timeout)
        model = M.parallelize(tf.GPT(cfg).to(dtype), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = tf.encode(tf.load_text()[:20_000])
        rng, seconds = np.random.default_rng(0), []
        world = get_comm("torch", timeout=timeout, link=None)  # to agree on each start
        for _ in range(steps):
            x, y = tf.get_batch(data, batch, cfg.context, rng)
            xi, yi, positions, attention = M.share_of_batch(mesh, x, y)
            world.barrier()
            start = netem.start_together(world)
            opt.zero_grad()
            _, loss = model(xi, yi, positions=positions, attention=attention)
            (loss / (batch * cfg.context)).backward()
            M.reduce_gradients(model, mesh)
            opt.step()
            seconds.append(time.monotonic() - start)
    finally:
        netem.set_link(None)
    return dict(seconds=seconds, coords=mesh.coords)


def predicted_and_measured(cluster_run: Callable, shapes: list[dict[str, int]], link: str,
                           cfg: tf.GPTConfig, batch: int, machine: S.Hardware,
                           steps: int = 4) -> list[dict]:
    """For each mesh shape: the plan's step time by term and the measured median step (the
    slowest rank's, first step left out: it warms up). ``cluster_run``: ``cluster.run``."""
    rows = []
    for shape in shapes:
        runs = cluster_run(timed_steps_on_rank, shape, link, cfg, batch, steps)
        measured = statistics.median(max(r["seconds"][i] for r in runs)
                                     for i in range(1, steps))
        layout = S.Layout.from_shape(shape)
        plan = S.step_time(S.Model.of(cfg), S.Run(batch, cfg.context, layout, itemsize=4),
                           machine, overlap_grads=False,
                           held=planner.parameters_per_rank(cfg, layout))
        rows.append(dict(shape=shape, plan=plan, measured=measured,
                         error=plan["total"] / measured - 1))
    return rows

