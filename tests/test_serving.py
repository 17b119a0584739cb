"""Tensor-parallel decoding against one process, and the deployment planned on paper
(course_lib/serving.py, notebook 18)."""

import pytest
import torch

from course_lib import costmodel, decoding, serving
from course_lib import transformer as tf
from course_lib.comm.recording import run_ranks

CFG = tf.GPTConfig(context=48, d_model=32, n_heads=4)
MODEL = tf.GPT(CFG, seed=2).double().eval()
PROMPTS = torch.tensor([[84, 104, 101, 32, 108], [65, 32, 99, 108, 97]])


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_decoding_is_one_process_and_holds_what_the_planner_says(world_size):
    ranks, _ = run_ranks(lambda _, comm: serving.tensor_parallel_generate(MODEL, PROMPTS, 20, comm),
                         [None] * world_size, check_sizes=False)
    want = decoding.generate(MODEL, PROMPTS, 20)
    planned = serving.course_memory_per_rank(CFG, world_size, 2, 5 + 20 - 1, itemsize=8)
    for r in ranks:
        assert torch.equal(r["tokens"], want)
        assert r["allreduces_per_step"] == 2 * CFG.n_layers
        assert r["weight_bytes"] == planned["weights"] and r["cache_bytes"] == planned["kv_cache"]
        assert len(r["step_seconds"]) == len(r["allreduce_seconds"]) == 20
        assert r["hop_seconds"] > 0
    one = serving.course_memory_per_rank(CFG, 1, 2, 24, itemsize=8)
    assert one["weights"] == 8 * MODEL.num_parameters()
    assert one["kv_cache"] == world_size * planned["kv_cache"]  # the cache divides exactly


def test_the_alpha_beta_price_of_a_token():
    latency_only = costmodel.Link("latency", alpha=1e-4, beta=0.0)
    # two allreduces a block, 2 (p - 1) ring steps each
    assert serving.allreduce_seconds_per_token(CFG, 2, 4, latency_only) == pytest.approx(
        2 * 2 * 6 * 1e-4)


def test_the_scaling_books_llama_3_70b_on_eight_v5e():
    held = serving.serving_memory(serving.LLAMA3_70B, 32, 8192, itemsize=1)
    assert held["weights"] == 70e9
    assert held["kv_cache"] == 32 * 8192 * 163_840  # 42.9 GB (the book rounds to 160 kB a token)
    assert serving.serving_memory(serving.LLAMA3_70B, 32, 8192, tp=8, itemsize=1)["kv_cache"] \
        * 8 == held["kv_cache"]
    step = serving.decode_step_time(serving.LLAMA3_70B, 32, 8192, serving.TPU_V5E, tp=8,
                                    itemsize=1)
    assert step == pytest.approx((70e9 + 32 * 8192 * 163_840) / (8 * 8.1e11))  # 17.4 ms
    assert 32 / step / 8 == pytest.approx(229, abs=1)  # tokens per second per chip
    assert serving.critical_batch(serving.TPU_V5E) == pytest.approx(1.97e14 / 8.1e11)
    assert serving.critical_batch(serving.TPU_V5E, 1) == pytest.approx(1.97e14 / 8.1e11 / 2)
    # past the critical batch the FLOPs take longer than the reads
    big = serving.decode_step_time(serving.LLAMA3_70B, 4096, 16, serving.TPU_V5E, tp=8,
                                   itemsize=1)
    assert big == pytest.approx(2 * 70e9 * 4096 / (8 * 1.97e14))


def test_pipeline_stages_divide_the_memory_not_the_time_and_tp_past_the_kv_heads_replicates():
    tp8 = serving.serving_memory(serving.LLAMA3_70B, 32, 8192, tp=8, itemsize=1)
    pp8 = serving.serving_memory(serving.LLAMA3_70B, 32, 8192, pp=8, itemsize=1)
    assert tp8 == pp8  # 8 key/value heads over 8 chips, or 80 layers over 8 stages
    step = {name: serving.decode_step_time(serving.LLAMA3_70B, 32, 8192, serving.TPU_V5E,
                                           itemsize=1, **{name: 8}) for name in ("tp", "pp")}
    assert step["pp"] == pytest.approx(8 * step["tp"])  # a token crosses the stages in turn
    # 16 chips of tensor parallelism for 8 key/value heads: each head on 2 chips
    tp16 = serving.serving_memory(serving.LLAMA3_70B, 32, 8192, tp=16, itemsize=1)
    assert tp16["weights"] == tp8["weights"] / 2 and tp16["kv_cache"] == tp8["kv_cache"]
