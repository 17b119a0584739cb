"""What the GPU tests (``pytest -m gpu``) and ``python -m course_lib gpu-check`` run on a machine
with a GPU: the course's collectives and parallelisms handed CUDA tensors, against the native
collectives and one process in float64; NCCL on a cluster of one rank; Gloo's fallback when
ranks outnumber GPUs; ZeRO's accounting against CUDA's allocator.

Introduced in notebooks/16_planning_a_run.ipynb. The functions ending in ``_on_rank`` run on
every rank of a cluster; ``device="cpu"`` runs the same code without a GPU (the CPU tests do,
so that the GPU run finds no mistake a CPU could have found)::

    with start_cluster(n=2) as cluster:                 # 1 GPU, 2 ranks: Gloo
        cluster.run(testing.gpu.collectives_on_rank)    # [] when all agree
        cluster.run(testing.gpu.parallelism_on_rank)    # {"DDP (ring)": 1e-16, ...} per rank
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from course_lib import decoding, gpu
from course_lib.comm import get_comm
from course_lib.testing import ddp as ddp_testing
from course_lib.testing import pipeline as pipeline_testing
from course_lib.testing import tensor_parallel as tp_testing
from course_lib.testing import zero as zero_testing
from course_lib.testing.collectives import (
    ALL,
    compare_all_to_all_with_native,
    compare_with_native,
)
from course_lib.zero import ZeroDataParallel, planned_memory


def collectives_on_rank(container: str = "cuda") -> list[str]:
    """Every allreduce of the course (and the all-to-alls) on ``container`` buffers ("cuda",
    "torch": CPU tensors, or on NCCL CUDA ones) against the native collective: five dtypes,
    four ops, lengths 0 to 1001. Returns the mismatches (none: ``[]``)."""
    return (compare_with_native(ALL, containers=(container,))
            + compare_all_to_all_with_native(container=container))


def ddp_on_rank(device: str = "cuda") -> dict[str, float]:
    """The course's DDP (overlapping buckets; Gloo's allreduce and the course's ring) trained
    with its model and data on ``device``: the largest difference (float64) from one process
    on the CPU."""
    reference = ddp_testing.single_process()
    diffs = {}
    for algorithm in ("native", "ring"):
        run = ddp_testing.train_on_rank("overlap", algorithm, device=device)
        diffs[f"DDP ({algorithm})"] = ddp_testing.max_difference([run], reference)
    return diffs


def parallelism_on_rank(device: str = "cuda") -> dict[str, float]:
    """DDP, ZeRO stages 1-3, tensor and pipeline parallelism, each trained with its model and
    data on ``device``: the largest difference (float64) from one process on the CPU."""
    diffs = ddp_on_rank(device)
    for stage in (1, 2, 3):
        for algorithm in ("ring", "native"):
            diffs[f"ZeRO-{stage} ({algorithm})"] = zero_testing.zero_matches_one_process(
                stage, algorithm=algorithm, device=device)["diff"]
    diffs["tensor parallel"] = tp_testing.tp_matches_one_process(device=device)["max"]
    for schedule, name in (("1f1b", "1F1B"), ("zb-h1", "ZB-H1, B and W apart"),
                           ("zb-v", "ZB-V")):
        step = pipeline_testing.pipeline_matches_one_process(
            schedule, 8, num_layers=8 if schedule == "zb-v" else 6, device=device)
        if step is not None:  # zb-v's loss is on rank 0, 1F1B's on the last rank
            diffs[f"pipeline ({name})"] = max(step["grad"], step["loss"] or 0.0)
    return diffs


def zero_memory_on_rank(stage: int, layers: int = 6, width: int = 6144, batch: int = 8,
                        algorithm: str = "native", device: str = "cuda") -> dict:
    """One step of ZeRO ``stage`` on a float32 MLP of ``layers`` Linear(width, width) (226M
    parameters at the defaults: 3.6 GB of state per rank without ZeRO) built on ``device``.
    Returns the plan (:func:`zero.planned_memory`), ZeRO's own count of what it held (now and
    at its peak) and, on a GPU, what the allocator held beyond what it held before (now and
    at its peak)."""
    comm = get_comm("torch")
    cuda = torch.device(device).type == "cuda"

    def allocated():
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return None
    if cuda:
        gpu.warm_up(device)  # cuBLAS's workspaces are not ZeRO's
        torch.cuda.empty_cache()
    base = allocated()
    torch.manual_seed(0)
    with torch.device(device):
        module = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width),
                                                                     nn.Tanh())])
        x, y = torch.randn(batch, width), torch.randn(batch, width)
    plan = planned_memory(module, comm.world_size, stage)
    model = ZeroDataParallel(module, zero_testing.OPTIMIZERS["adam"], comm, stage, algorithm)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    data = x.nbytes + y.nbytes
    nn.functional.mse_loss(model(x), y).backward()
    model.step()
    out = {"stage": stage, "world_size": comm.world_size, "rank": comm.rank,
           "parameters": sum(p.numel() for p in module.parameters()), "planned": plan,
           "held": model.memory(), "held_peak": model.peak,
           "allocated": None if base is None else allocated() - base - data,
           "allocated_peak": None if base is None
           else torch.cuda.max_memory_allocated() - base - data}
    del model, module, x, y
    if cuda:
        torch.cuda.empty_cache()
    return out



def cluster_report(sizes: tuple[int, ...] = (1, 2, 4), device: str = "cuda",
                   zero_sizes: dict | None = None, parallelism: bool = True,
                   zero: bool = True) -> dict:
    """Start a cluster of each size (the backend as ``start_cluster`` picks it) and run the
    checks above; returns, per size, the backend and why, each rank's device, the
    collectives' mismatches, each parallelism's differences per rank and (on 2 ranks) ZeRO's
    memory per stage (``parallelism``, ``zero``: whether to run those; ``zero_sizes``: keyword
    arguments of :func:`zero_memory_on_rank`)."""
    from course_lib.runtime.cluster import start_cluster
    from course_lib.runtime.engine import engine_info
    report = {}
    for n in sizes:
        with start_cluster(n=n, timeout=120) as cluster:
            row = {"backend": cluster.backend, "reason": cluster.backend_reason,
                   "devices": [i["device"] for i in cluster.run(engine_info)]}
            kind = "torch" if cluster.backend == "nccl" or device == "cpu" else "cuda"
            row["tensors"] = "CPU" if device == "cpu" else "CUDA"
            row["collectives"] = sum(cluster.run(collectives_on_rank, kind), [])
            if n > 1 and parallelism:
                row["parallelism"] = cluster.run(parallelism_on_rank, device)
            if n == 2 and zero:
                row["zero_memory"] = [cluster.run(zero_memory_on_rank, stage, device=device,
                                                  **(zero_sizes or {}))
                                      for stage in (0, 1, 2, 3)]
        report[str(n)] = row
    return report


def decode_summary(decode: dict) -> str:
    """One line per batch of :func:`decoding.decode_report`: tokens/s and its share of the
    bandwidth roof. Introduced in notebooks/18_serving_across_devices.ipynb."""
    lines = [f"decode ({decode['parameters'] / 1e9:.2f}B parameters, bf16, roof at "
             f"{decode['bandwidth'] / 1e12:.2f} TB/s):"]
    for b, got, roof in zip(decode["batches"], decode["tokens_per_s"],
                            decode["roof_tokens_per_s"], strict=True):
        lines.append(f"  batch {b:>4}: {got:10.0f} tokens/s, {got / roof:.0%} of the roof")
    return "\n".join(lines)


def main(out: Path, small: bool = False, clusters: bool = True) -> int:
    """``python -m course_lib gpu-check``: measure, run the cluster checks, write
    ``out/gpu.json`` (what :func:`gpu.reference` reads once copied to ``course_lib/reference``)
    and ``out/gpu-report.md``; print the summary.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    device = "cuda" if torch.cuda.is_available() and not small else "cpu"
    report = gpu.measure(device, small=small or device == "cpu")
    # notebook 18's decode tokens/s against the bandwidth roof
    report["decode"] = decoding.decode_report(device, small=small or device == "cpu")
    text = gpu.summary(report) + "\n" + decode_summary(report["decode"])
    print(text, flush=True)
    if clusters:
        zero = {"layers": 3, "width": 64} if device == "cpu" else None
        report["clusters"] = cluster_report(device=device, zero_sizes=zero)
        text += "\n" + gpu.cluster_summary(report["clusters"])
        print(gpu.cluster_summary(report["clusters"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu-report.md").write_text(f"# GPU check\n\n```\n{text}\n```\n")
    print(f"# written: {out / 'gpu.json'}, {out / 'gpu-report.md'}")
    return 0
