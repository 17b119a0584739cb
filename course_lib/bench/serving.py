"""``python -m course_lib bench serving``: decoding on this machine's roofline, the course's
attention over the KV cache against torch's fused one, and continuous against static batching.

Introduced in notebooks/18_serving_across_devices.ipynb (:mod:`course_lib.decoding`,
:mod:`course_lib.paged_attention`). A model of ``--d-model`` and ``--layers`` (random weights:
speed does not depend on them) decodes one token for each of ``--batches`` sequences holding
``--context`` cached positions, with the course's written-out attention over the cache
(``decoding.cached_attention``) and with torch's ``scaled_dot_product_attention`` (the native
baseline), interleaved in one run::

    python -m course_lib bench serving                        # batches 1,4,16,64,256
    python -m course_lib bench serving --batches 1,8,64 --d-model 256 --csv serving.csv

Columns: each kernel's median step, the course's time over the native one's, tokens per second,
and the roofline's floor for the step (every weight read once at this machine's copy rate, or
the step's FLOPs at its matmul rate, whichever is longer), printed with both ceilings. Then
``--requests`` requests of mixed lengths, all waiting at the start, served by static batching
with a contiguous cache and by continuous batching with a paged one of the same memory: tokens
per second, steps, and whether the answers agree.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from course_lib import decoding, gpu, paged_attention
from course_lib.bench.common import argtype, parse_list, write_csv
from course_lib.runtime.tables import text_table
from course_lib.transformer import GPT, GPTConfig

HELP = "decode vs the roofline, the course's cached attention vs torch's, continuous vs static"


def arguments(parser):
    """The options of ``python -m course_lib bench serving``."""
    a = parser.add_argument
    a("--batches", type=argtype(lambda t: parse_list(t, what="batch sizes")),
      default=[1, 4, 16, 64, 256], help="sequences decoded together (default 1,4,16,64,256)")
    a("--d-model", type=int, default=512, help="the model's width (default 512: 51 MB, 4 layers)")
    a("--layers", type=int, default=4, help="its blocks (default 4)")
    a("--context", type=int, default=16, help="positions cached per sequence (default 16)")
    a("--requests", type=int, default=24, help="requests for the batching rows (default 24)")
    a("--repeats", type=int, default=5, help="steps timed per kernel and batch (default 5)")
    a("--csv", help="also write the decode rows to this CSV file")


def decode_rows(model: GPT, batches, context: int, repeats: int, flops: float,
                bandwidth: float) -> list[dict]:
    """One row per batch: both kernels' median step, interleaved batch by batch."""
    params, rows = model.num_parameters(), []
    for batch in batches:
        course, native = (decoding.time_decode(model, [batch], context, repeats, kernel=k)[0]
                          for k in (decoding.cached_attention, decoding.sdpa_cached_attention))
        floor = max(4 * params / bandwidth, 2 * params * batch / flops)
        rows.append({"batch": batch, "course_ms": course * 1e3, "native_ms": native * 1e3,
                     "ratio": course / native, "tokens_per_s": batch / course,
                     "roofline_ms": floor * 1e3})
    return rows


def batching_rows(model: GPT, n_requests: int) -> list[dict]:
    """Static (contiguous cache of 4 contexts) and continuous (paged, same memory) batching."""
    cfg, rng = model.cfg, np.random.default_rng(0)
    requests = [paged_attention.Request(rng.integers(0, 256, int(rng.integers(2, 12))).tolist(),
                                        int(rng.integers(2, cfg.context - 12)))
                for _ in range(n_requests)]
    runs = {"static, contiguous": paged_attention.serve(
                model, requests, paged_attention.contiguous(cfg, 4), policy="static"),
            "continuous, paged": paged_attention.serve(
                model, requests, paged_attention.PagedKVCache(cfg, 4 * cfg.context // 8, 8))}
    answers = [[r.tokens for r in served] for served, _ in runs.values()]
    return [{"policy": name, "tokens_per_s": paged_attention.summary(*run)["tokens_per_s"],
             "steps": len(run[1]), "same_answers": answers[0] == answers[1]}
            for name, run in runs.items()]


def main(args):
    if args.repeats < 1 or args.requests < 1 or args.d_model % 8:
        print("bench serving: --repeats and --requests must be at least 1, --d-model a "
              "multiple of 8", file=sys.stderr)
        return 1
    flops = gpu.matmul_rate(1024, torch.float32, repeats=5, device="cpu")
    bandwidth = gpu.copy_rate(2**27, repeats=5, device="cpu")
    cfg = GPTConfig(context=args.context + 1, d_model=args.d_model, n_heads=8,
                    n_layers=args.layers)
    model = GPT(cfg).eval()
    rows = decode_rows(model, args.batches, args.context, args.repeats, flops, bandwidth)
    print(f"# decode, {model.num_parameters() / 1e6:.1f} M parameters (float32), "
          f"{args.context} positions cached; native = torch's scaled_dot_product_attention")
    print("\n".join(text_table(
        ["batch", "course ms", "native ms", "course / native", "tokens/s", "roofline ms"],
        [[r["batch"], f"{r['course_ms']:.2f}", f"{r['native_ms']:.2f}", f"{r['ratio']:.2f}",
          f"{r['tokens_per_s']:.0f}", f"{r['roofline_ms']:.2f}"] for r in rows])))
    print(f"# ceilings: {flops / 1e9:.0f} GFLOP/s (float32 matmul, this thread), "
          f"{bandwidth / 1e9:.1f} GB/s (copy, read + write); critical batch "
          f"{flops * 4 / (2 * bandwidth):.1f}")
    print()
    small = GPT(GPTConfig(context=64)).eval()
    served = batching_rows(small, args.requests)
    print(f"# batching, {args.requests} requests waiting at the start, the course's GPT "
          f"(2 layers, d = 64), 4 contexts of cache memory either way")
    print("\n".join(text_table(["policy", "tokens/s", "steps", "same answers"],
                               [[r["policy"], f"{r['tokens_per_s']:.0f}", r["steps"],
                                 r["same_answers"]] for r in served])))
    if args.csv:
        write_csv(rows, args.csv)
    return 0
