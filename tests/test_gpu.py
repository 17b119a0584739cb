"""The GPU path on a real GPU (``pytest -m gpu``; ``scripts/gpu-check.sh`` runs these and writes
the report): skipped without CUDA. The CPU tests at the end run the same code with CPU tensors,
so that a GPU run finds no mistake a CPU could have found."""

import pytest
import torch

from course_lib import decoding, gpu, planner
from course_lib.runtime.engine import engine_info
from course_lib.testing import gpu as testing
from tests.conftest import shared_cluster

CUDA = torch.cuda.is_available()


def on_gpu(test):
    """Marked ``gpu`` (``pytest -m gpu``) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(
        not CUDA, reason="needs a CUDA GPU: run scripts/gpu-check.sh on a GPU machine")(test))


@pytest.mark.parametrize("n", [1, 2, 4])
@on_gpu
def test_backend_and_device(n):
    """One GPU: NCCL for one rank (pinned to it), Gloo with the reason for two or four (NCCL
    refuses two ranks on one GPU)."""
    cluster = shared_cluster(n)
    devices = [i["device"] for i in cluster.run(engine_info)]
    if n <= torch.cuda.device_count():
        assert cluster.backend == "nccl" and devices == [f"cuda:{r}" for r in range(n)]
    else:
        assert cluster.backend == "gloo" and devices == ["cpu"] * n
        assert "GPU" in cluster.backend_reason, cluster.backend_reason
    print(n, cluster.backend, cluster.backend_reason)


@pytest.mark.parametrize("n", [1, 2, 4])
@on_gpu
def test_collectives_on_cuda_tensors(n):
    """Naive, tree, ring (pipelined too), reduce-scatter + all-gather and the all-to-alls agree
    with the native collective: on NCCL with CUDA tensors, on Gloo with CUDA tensors staged
    through host memory."""
    cluster = shared_cluster(n)
    kind = "torch" if cluster.backend == "nccl" else "cuda"
    assert cluster.run(testing.collectives_on_rank, kind, timeout=300) == [[]] * n


@pytest.mark.parametrize("n", [2, 4])
@on_gpu
def test_parallelism_on_cuda_tensors(n):
    """DDP, ZeRO 1-3, tensor and pipeline parallelism on CUDA tensors over Gloo equal one
    process on the CPU in float64, as they do on CPU tensors."""
    cluster = shared_cluster(n)
    for rank, diffs in enumerate(cluster.run(testing.parallelism_on_rank, "cuda", timeout=300)):
        assert max(diffs.values()) < 1e-10, (rank, diffs)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@on_gpu
def test_zero_accounting_against_the_allocator(stage):
    """What ZeRO says it holds after a step is what CUDA's allocator holds (within 1%), and
    the plan bounds the state; the allocator's peak is ZeRO's peak plus the temporaries of
    the collectives and the optimizer."""
    for row in shared_cluster(2).run(testing.zero_memory_on_rank, stage, timeout=300):
        held, allocated = row["held"]["total"], row["allocated"]
        assert abs(allocated - held) <= 0.01 * held, row
        assert row["held_peak"]["total"] <= row["planned"]["total"], row
        assert row["allocated_peak"] >= row["held_peak"]["total"], row
        print(stage, row["rank"], {k: row[k] for k in ("allocated", "allocated_peak")},
              row["planned"]["total"])


@on_gpu
def test_planner_memory_against_the_allocator():
    """Notebook 16's memory model for the course's GPT on one GPU (several GB): parameters,
    gradients and optimizer state within 1% of the allocator's, the activations one forward
    leaves within 5%."""
    row = gpu.transformer_memory(gpu.MEMORY_CONFIG, 4, 1024)
    plan, got = row["planned"], row["measured"]
    print(gpu.summary({"environment": gpu.environment(), "matmul": {}, "copy": 0.0,
                       "steps": [], "memory": row}))
    assert plan["total"] > 4 * 2**30
    for kind in ("parameters", "gradients", "optimizer"):
        assert abs(got[kind] - plan[kind]) <= 0.01 * plan[kind], (kind, row)
    assert abs(got["activations"] - plan["activations"]) <= 0.05 * plan["activations"], row


@on_gpu
def test_roofline_and_model_flops_utilisation():
    """The two ceilings, measured, below the datasheet's; the GPT step's MFU between 0 and 1
    (its value is the report's, not the test's)."""
    spec = gpu.card()
    rate, copy = gpu.matmul_rate(), gpu.copy_rate()
    print(f"{torch.cuda.get_device_name(0)}: {rate / 1e12:.0f} TFLOP/s bf16, "
          f"{copy / 1e12:.2f} TB/s copy")
    if spec is not None:
        assert 0.2 * spec.bf16 < rate < 1.1 * spec.bf16
        assert 0.2 * spec.memory_bandwidth < copy < 1.1 * spec.memory_bandwidth
    step = gpu.transformer_step(gpu.STEP_CONFIG, 8, 1024, attention=gpu.sdpa_attention)
    print(step)
    assert step["mfu"] is None or 0 < step["mfu"] < 1


@on_gpu
def test_the_triton_flash_kernel_equals_torchs_attention_and_is_timed_beside_it():
    """The course's causal FlashAttention kernel (fp32 products, forward) against torch's
    scaled_dot_product_attention on the GPU: equal, and the time of each printed (the report's
    figure, not the test's)."""
    pytest.importorskip("triton", reason="pip install -e '.[triton]'")
    from course_lib.flash_attention import triton_flash_forward
    q, k, v = (torch.randn(4, 16, 2048, 64, device="cuda") for _ in range(3))
    out, _ = triton_flash_forward(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - ref).abs().max() < 1e-4
    ms = {name: gpu.timed(fn) * 1e3 for name, fn in [
        ("triton kernel", lambda: triton_flash_forward(q, k, v)),
        ("torch sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True))]}
    print(f"causal attention forward, 4 x 16 heads x 2048 x 64, fp32: {ms}")


@on_gpu
def test_decode_tokens_per_second_stay_under_the_bandwidth_roof():
    """Notebook 18's decode of a 6.4 B-parameter bf16 model: tokens/s at most the roof that
    reading every weight once a step sets (the share of the roof reached, and its rise with
    the batch, are the report's figures, not the test's)."""
    report = decoding.decode_report("cuda")
    print(testing.decode_summary(report))
    for got, roof in zip(report["tokens_per_s"], report["roof_tokens_per_s"], strict=True):
        # holds under load: load slows a step, it never reads the weights faster
        assert 0 < got <= 1.05 * roof


# ---------------------------------------------------------------- the same code, CPU tensors
def test_checks_run_on_cpu_tensors(cluster):
    """Every check above, with CPU tensors on the 2-rank test cluster: nothing differs."""
    assert cluster.run(testing.collectives_on_rank, "torch", timeout=120) == [[], []]
    for diffs in cluster.run(testing.parallelism_on_rank, "cpu", timeout=120):
        assert max(diffs.values()) < 1e-10, diffs
        assert {"pipeline (1F1B)", "pipeline (ZB-H1, B and W apart)", "pipeline (ZB-V)"} <= set(
            diffs)
    for row in cluster.run(testing.zero_memory_on_rank, 3, layers=3, width=64, device="cpu"):
        assert row["allocated"] is None and row["held_peak"]["total"] <= row["planned"]["total"]


def test_measurements_run_on_the_cpu():
    """The report's measurements on the CPU at small sizes; the saved activations are the
    planner's to the byte (float32), as notebook 16 shows in float64."""
    report = gpu.measure("cpu", small=True)
    memory = report["memory"]
    assert memory["measured"]["activations_saved"] == memory["planned"]["activations"]
    assert all(s["seconds"] > 0 and s["mfu"] is None for s in report["steps"])
    assert "matrix product bfloat16" in gpu.summary(report)
    fp8 = report["fp8"]  # e4m3 rounds to 1/16, bf16 to 1/256
    assert fp8["bf16"]["error"] < 1 / 256 < fp8["fp8"]["error"] < 1 / 16
    assert "matrix product fp8 (torch._scaled_mm)" in gpu.summary(report)
    del report["fp8"]  # a report stored before FP8 was measured still reads
    assert "fp8" not in gpu.summary(report)
    assert planner.Layout().world_size == 1
    decode = decoding.decode_report("cpu", small=True, batches=(1, 2))
    assert "batch    2" in testing.decode_summary(decode)
