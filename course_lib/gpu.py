"""What only a GPU can show: the roofline's two ceilings measured on the card, the model FLOPs
utilisation of the course's transformer, and the memory models of notebooks 10 and 16 against
what CUDA's allocator really held (``torch.cuda.max_memory_allocated``).

Introduced in notebooks/16_planning_a_run.ipynb. ``python -m course_lib gpu-check`` (or
``scripts/gpu-check.sh``) measures all of it on a machine with a GPU and writes a report; the
notebooks show that stored report (:func:`reference`: its card and date) where there is no GPU,
and measure live where there is one::

    gpu.matmul_rate()                  # FLOP/s of a bf16 8192^3 product, vs gpu.card().bf16
    gpu.transformer_step(cfg, 8, 1024) # seconds per step, model FLOPs, MFU
    gpu.transformer_memory(cfg, 4, 1024)  # planner.memory_per_rank vs the allocator, by kind

Every function takes ``device``: the same code runs on the CPU with small sizes (the tests do).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from course_lib import planner, scale_plan
from course_lib.transformer import GPT, GPTConfig, activation_bytes_of, causal_attention

REFERENCE = Path(__file__).with_name("reference") / "gpu.json"


@dataclass(frozen=True)
class Card:
    """A GPU's datasheet ceilings (SXM parts, dense): 16-bit tensor-core FLOP/s, float32 FLOP/s
    without tensor cores, and memory bandwidth in bytes/s.
    Introduced in notebooks/16_planning_a_run.ipynb."""

    name: str
    bf16: float
    fp32: float
    memory_bandwidth: float


CARDS = {"H200": Card("H200 SXM", 989e12, 67e12, 4.8e12),
         "H100": Card("H100 SXM", 989e12, 67e12, 3.35e12),
         "A100": Card("A100 SXM", 312e12, 19.5e12, 2.04e12)}


def card(name: str | None = None) -> Card | None:
    """The datasheet of GPU ``name`` (default: this machine's first), None if not listed.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((c for key, c in CARDS.items() if key in name), None)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int = 10, device: str = "cuda") -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up, the device
    synchronised around each run (GPU work is queued: a clock read without it times nothing).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def matmul_rate(n: int = 8192, dtype: torch.dtype = torch.bfloat16, repeats: int = 10,
                device: str = "cuda") -> float:
    """FLOP/s of an n x n by n x n matrix product (2 n^3 FLOPs): the roofline's flat ceiling.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / timed(lambda: a @ b, repeats, device)


def copy_rate(n_bytes: int = 2**30, repeats: int = 10, device: str = "cuda") -> float:
    """Bytes/s of a device-to-device copy, bytes read plus bytes written: the roofline's
    sloped ceiling (memory bandwidth).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / timed(lambda: dst.copy_(src), repeats, device)


def fp8_matmul(n: int = 8192, repeats: int = 10, device: str = "cuda") -> dict:
    """An n x n by n x n product in FP8 (e4m3, one scale per tensor, ``torch._scaled_mm``,
    bf16 out) against bf16: the FLOP/s of each and each result's error relative to float32.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    from course_lib import precision
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    (qa, sa), (qb, sb) = precision.to_fp8(a), precision.to_fp8(b)
    a16, b16 = a.bfloat16(), b.bfloat16()
    ways = {"fp8": lambda: torch._scaled_mm(qa, qb.T, scale_a=sa, scale_b=sb,  # b column-major
                                            out_dtype=torch.bfloat16),
            "bf16": lambda: a16 @ b16.T}
    exact = a @ b.T
    return {name: {"flops_per_s": 2 * n**3 / timed(fn, repeats, device),
                   "error": precision.relative_error(fn(), exact)} for name, fn in ways.items()}


def warm_up(device: str = "cuda") -> None:
    """Multiply matrices forward and backward once, so that cuBLAS has made its workspaces
    (32 MiB each on a Hopper GPU: one for this thread, more for autograd's backward thread):
    the caching allocator holds them from their first use on, and a count of the model's bytes
    made before them would find them mixed in. Introduced in notebooks/16_planning_a_run.ipynb."""
    w = torch.ones(16, 16, device=device, requires_grad=True)
    (w @ w).sum().backward()
    _sync(device)


def _batch(cfg: GPTConfig, batch: int, length: int, device: str):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(cfg.vocab_size, (batch, length + 1), generator=g).to(device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's fused causal attention (flash attention on a GPU): the same result as
    :func:`transformer.causal_attention`, without keeping the T x T scores.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def transformer_step(cfg: GPTConfig, batch: int, length: int, device: str = "cuda",
                     autocast: torch.dtype | None = torch.bfloat16,
                     attention: Callable = causal_attention, repeats: int = 5) -> dict:
    """Time one training step (forward, backward, Adam) of the course's GPT, in ``autocast``'s
    dtype (None: float32); returns seconds, the model FLOPs of the step
    (:func:`scale_plan.model_flops`), FLOP/s and, on a listed card, the model FLOPs utilisation
    against its 16-bit peak (float32: its float32 peak).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    model = GPT(cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = _batch(cfg, batch, length, device)

    def step():
        with torch.autocast(torch.device(device).type, dtype=autocast or torch.float32,
                            enabled=autocast is not None):
            _, loss = model(x, y, attention=attention)
        (loss / y.numel()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = timed(step, repeats, device)
    flops = scale_plan.model_flops(scale_plan.Model.of(cfg), batch, length)
    spec = card() if torch.device(device).type == "cuda" else None
    peak = None if spec is None else spec.bf16 if autocast else spec.fp32
    return {"seconds": seconds, "model_flops": flops, "flops_per_s": flops / seconds,
            "mfu": None if peak is None else flops / seconds / peak,
            "parameters": model.num_parameters(), "batch": batch, "length": length,
            "dtype": str(autocast or torch.float32).replace("torch.", ""),
            "attention": getattr(attention, "__name__", str(attention))}


def transformer_memory(cfg: GPTConfig, batch: int, length: int, device: str = "cuda") -> dict:
    """The planner's bytes by kind (:func:`planner.memory_per_rank`, one rank, float32, Adam)
    against what the allocator held: parameters after the model moved in, activations kept by
    one forward (the allocation it left behind, and the tensors autograd saved), gradients
    after the backward, optimizer state after the first step, and the peak of the whole step
    (less than the plan's total: the activations are freed as the gradients appear, before
    Adam's state exists).
    On the CPU only the saved tensors are measured (no allocator to ask).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    cuda = torch.device(device).type == "cuda"

    def allocated():
        _sync(device)
        return torch.cuda.memory_allocated() if cuda else 0
    warm_up(device)  # cuBLAS's workspaces are not the model's
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = allocated()
    model = GPT(cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = _batch(cfg, batch, length, device)
    params = allocated() - base - x.nbytes - y.nbytes
    before = allocated()
    losses = []  # the logits go: only what backward needs stays
    saved = activation_bytes_of(lambda m=model: losses.append(m(x, y)[1]), model)
    forward_left = allocated() - before
    loss = losses.pop()
    loss.backward()
    del loss
    grads = allocated() - before
    opt.step()
    state = allocated() - before - grads
    measured = {"parameters": params, "gradients": grads, "optimizer": state,
                "activations": forward_left,
                "peak": torch.cuda.max_memory_allocated() - base if cuda else None}
    if not cuda:  # no allocator to ask
        measured = dict.fromkeys(measured)
    measured["activations_saved"] = saved
    plan = planner.memory_per_rank(cfg, planner.Layout(), batch, length, itemsize=4)
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"planned": plan, "measured": measured, "batch": batch, "length": length,
            "config": asdict(cfg)}


def environment() -> dict:
    """Versions and the device: what a report is about.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    info = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": "cpu", "card": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), memory=props.total_memory,
                    multiprocessors=props.multi_processor_count,
                    nccl=".".join(map(str, torch.cuda.nccl.version())),
                    card=asdict(card()) if card() else None)
    return info


def reference() -> dict | None:
    """The stored report of the last run on a GPU (its ``environment`` says which card and
    when), or None if none was stored.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    return json.loads(REFERENCE.read_text()) if REFERENCE.exists() else None


def live_or_stored(measure_live: Callable[[], object], part: Callable[[dict], object]
                   ) -> tuple[object | None, str]:
    """What a notebook's GPU cell shows: ``measure_live()`` where this machine has a GPU, else
    ``part(reference())``, the same figures from the stored run; and a line saying which.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    if torch.cuda.is_available():
        return measure_live(), f"measured now on {torch.cuda.get_device_name(0)}"
    stored = reference()
    if stored is None:
        return None, "no GPU here, and no GPU run stored (python -m course_lib gpu-check)"
    env = stored["environment"]
    return part(stored), (f"no GPU here: stored from a run on one {env['device']} on "
                          f"{env['date']} (torch {env['torch']}, CUDA {env['cuda']})")


# sizes of the stored report: a few GB on an 80 GB card, seconds each
STEP_CONFIG = GPTConfig(vocab_size=256, context=1024, d_model=2048, n_heads=16, n_layers=8)
MEMORY_CONFIG = GPTConfig(vocab_size=256, context=1024, d_model=1024, n_heads=16, n_layers=8)


def measure(device: str = "cuda", small: bool = False) -> dict:
    """Everything above in one report (``small``: sizes for a CPU, to try the code).
    Introduced in notebooks/16_planning_a_run.ipynb."""
    step_cfg = GPTConfig(context=64, d_model=32, n_heads=2) if small else STEP_CONFIG
    memory_cfg = GPTConfig(context=64, d_model=32, n_heads=2) if small else MEMORY_CONFIG
    b, T, bm, Tm = (2, 32, 2, 32) if small else (8, 1024, 4, 1024)
    report = {"environment": environment(),
              "matmul": {str(d).replace("torch.", ""): matmul_rate(
                  256 if small else 8192, d, device=device) for d in (torch.bfloat16,
                                                                      torch.float32)},
              "copy": copy_rate(2**20 if small else 2**30, device=device),
              "fp8": fp8_matmul(256 if small else 8192, device=device)}
    report["steps"] = [transformer_step(step_cfg, b, T, device, autocast, attention)
                       for autocast, attention in ((torch.bfloat16, causal_attention),
                                                   (torch.bfloat16, sdpa_attention),
                                                   (None, causal_attention))]
    report["memory"] = transformer_memory(memory_cfg, bm, Tm, device)
    return report


def _ratio(measured: float | None, planned: float) -> float | None:
    """measured / planned, None when nothing was measured."""
    return None if measured is None or not planned else measured / planned


def summary(report: dict) -> str:
    """The report as a few lines a person reads: each figure beside its ceiling or plan.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    env, spec = report["environment"], report["environment"].get("card")
    lines = [f"{env['device']} · torch {env['torch']} · CUDA {env['cuda']} · {env['date']}"]
    for dtype, rate in report["matmul"].items():
        peak = spec and (spec["bf16"] if dtype == "bfloat16" else spec["fp32"])
        lines.append(f"matrix product {dtype}: {rate / 1e12:7.1f} TFLOP/s"
                     + (f" ({rate / peak:.0%} of the datasheet's {peak / 1e12:.0f})" if peak
                        else ""))
    if "fp8" in report:  # reports stored before FP8 was measured have none
        fp8, bf16 = report["fp8"]["fp8"], report["fp8"]["bf16"]
        lines.append(f"matrix product fp8 (torch._scaled_mm): {fp8['flops_per_s'] / 1e12:.1f} "
                     f"TFLOP/s, {fp8['flops_per_s'] / bf16['flops_per_s']:.2f}x bf16's; error "
                     f"{fp8['error']:.1%} against float32, bf16's {bf16['error']:.2%}")
    peak = spec and spec["memory_bandwidth"]
    lines.append(f"copy: {report['copy'] / 1e12:.2f} TB/s read + written"
                 + (f" ({report['copy'] / peak:.0%} of {peak / 1e12:.2f})" if peak else ""))
    for s in report["steps"]:
        mfu = f", MFU {s['mfu']:.0%}" if s["mfu"] is not None else ""
        lines.append(f"GPT step ({s['parameters'] / 1e6:.0f}M parameters, {s['batch']}x"
                     f"{s['length']} tokens, {s['dtype']}, {s['attention']}): "
                     f"{s['seconds'] * 1e3:.1f} ms, {s['flops_per_s'] / 1e12:.1f} TFLOP/s{mfu}")
    mem = report["memory"]
    for kind in ("parameters", "gradients", "optimizer", "activations"):
        got, plan = mem["measured"][kind], mem["planned"][kind]
        lines.append(f"memory {kind:<11}: planned {plan / 2**20:9.1f} MiB" + (
            "" if got is None else
            f", allocator {got / 2**20:9.1f} MiB ({_ratio(got, plan):.3f}x)"))
    peak = mem["measured"]["peak"]
    if peak is not None:
        lines.append(f"memory peak       : planned total {mem['planned']['total'] / 2**20:.1f} "
                     f"MiB, allocator's peak {peak / 2**20:.1f} MiB "
                     f"({_ratio(peak, mem['planned']['total']):.2f}x)")
    return "\n".join(lines)


def cluster_summary(clusters: dict) -> str:
    """The clusters' part of a report (:func:`testing.gpu.cluster_report`) in a few lines.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    lines = []
    for n, row in clusters.items():
        lines.append(f"{n} rank(s): {row['reason']}.\n  The course's collectives on "
                     f"{row['tensors']} tensors: "
                     + (f"{len(row['collectives'])} mismatches" if row["collectives"]
                        else "all agree with the native ones"))
        for rank, diffs in enumerate(row.get("parallelism", [])):
            worst = max(diffs, key=diffs.get)
            lines.append(f"  rank {rank}: DDP, ZeRO 1-3, tensor and pipeline parallelism on "
                         f"{row['tensors']} tensors, largest difference from one process "
                         f"{diffs[worst]:.1e} ({worst})")
        if row.get("zero_memory"):
            lines.append(zero_table([per_rank[0] for per_rank in row["zero_memory"]]))
    return "\n".join(lines)


def zero_table(rows: list[dict]) -> str:
    """ZeRO's memory per stage (one rank's :func:`testing.gpu.zero_memory_on_rank` each): the
    plan, ZeRO's own count and the allocator's, after the step and at the peak.
    Introduced in notebooks/10_sharded_data_parallelism.ipynb."""
    lines = [f"{'':8}{'planned':>10}{'after the step':>30}{'at the peak':>30}",
             f"{'':8}{'(MiB)':>10}{'ZeRO counts':>15}{'allocator':>15}"
             f"{'ZeRO counts':>15}{'allocator':>15}"]
    for r in rows:
        lines.append(f"ZeRO-{r['stage']:<3}{_mib(r['planned']['total']):>10}"
                     f"{_mib(r['held']['total']):>15}{_mib(r['allocated']):>15}"
                     f"{_mib(r['held_peak']['total']):>15}{_mib(r['allocated_peak']):>15}")
    r = rows[0]
    lines.append(f"rank {r['rank']} of {r['world_size']}, {r['parameters'] / 1e6:.0f}M float32 "
                 "parameters, Adam")
    return "\n".join(lines)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"
