"""The plan of a run at scale: FLOPs against torch's own counter, Korthikanti's activations
against the course's measured block, the step time's terms, the search over splits and the
published runs; the step-time check on a mesh runs and respects the emulated link."""

import math
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib import costmodel, planner
from course_lib import scale_plan as S
from course_lib import transformer as tf
from course_lib.sequence_parallel import block_activation_bytes
from course_lib.testing import step_time as timing

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py
FREE = costmodel.Link("free", alpha=0.0, beta=0.0)


@pytest.mark.parametrize("recompute", [None, "attention", "full"])
def test_the_flops_are_what_torch_counts(recompute):
    cfg = tf.GPTConfig(context=32, d_model=32, n_heads=4, recompute=recompute)
    model, idx = tf.GPT(cfg).double(), torch.randint(0, 256, (3, 32))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    planned = 3 * sum(S.flops_per_sequence(S.Model.of(cfg), 32, recompute).values())
    assert counter.get_total_flops() == planned


def test_korthikanti_is_the_course_block_without_dropout_and_statistics():
    s, b, h, a = 2048, 1, 12288, 96  # 16 bits with dropout: s b h (34 + 5 a s / h)
    assert S.layer_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert S.layer_activation_bytes(s, b, h, a, recompute="attention") == 34 * s * b * h
    for T in (16, 64):  # the course's block keeps also LayerNorm statistics and the mask
        exact = block_activation_bytes(4, T, 64, 8, itemsize=8)
        assert exact - S.layer_activation_bytes(T, 4, 64, 8, itemsize=8, dropout=False) \
            == 2 * 2 * 4 * T * 8 + T * T


def test_the_step_time_adds_its_terms():
    model, cluster = S.MODELS["GPT 145B"], replace(S.CLUSTERS["A100 (Selene)"], devices=64)
    run = S.Run(64, 2048, planner.Layout(dp=1, tp=8, pp=8), micro_batch=1)
    t = S.step_time(model, run, cluster)
    assert math.isclose(t["total"], sum(v for k, v in t.items() if k != "total"))
    micro = (t["compute"] + t["tp"] + t["cp"] + t["pp"]) / run.micro_batches
    assert math.isclose(t["bubble"], 7 * micro)  # (pp - 1) micro-batches' time
    assert math.isclose(S.step_time(model, replace(run, virtual=7), cluster)["bubble"], micro)
    free = replace(cluster, inside=FREE, between=FREE)
    quiet = S.step_time(model, run, free)
    assert quiet["tp"] == quiet["pp"] == quiet["dp"] == 0 and quiet["compute"] == t["compute"]
    blocks = replace(model, vocab=0)  # the head sits on the last stage, whole over pp
    one = S.step_time(blocks, replace(run, layout=planner.Layout()), free)
    assert math.isclose(one["compute"], 64 * S.step_time(blocks, run, free)["compute"])
    assert S.group_link(run, "tp", cluster) is cluster.inside   # 8 neighbours: one node
    assert S.group_link(run, "pp", cluster) is cluster.between  # across nodes


def test_the_plan_orders_what_fits_and_says_what_breaks():
    cluster = replace(S.CLUSTERS["A100 (Selene)"], devices=64)
    rows = S.plan(S.MODELS["GPT 18B"], 64, 2048, cluster)
    fits = [r for r in rows if r["fits"]]
    assert fits and all(r["memory"]["total"] <= cluster.memory for r in fits)
    assert [r["time"]["total"] for r in fits] == sorted(r["time"]["total"] for r in fits)
    broken = next(r for r in rows if not r["fits"])
    assert "GiB > 80 GiB" in broken["breaks"] and broken["memory"]["total"] > cluster.memory
    plain = next(r for r in rows if r["run"].layout.zero == 0)
    zero3 = S.memory_16bit(S.MODELS["GPT 18B"], replace(
        plain["run"], layout=replace(plain["run"].layout, zero=3)))
    dp = plain["run"].layout.dp
    for kind in ("parameters", "gradients", "optimizer"):
        assert math.isclose(zero3[kind], plain["memory"][kind] / dp)


def test_models_have_their_published_sizes_and_runs_their_numbers():
    assert abs(S.MODELS["GPT 1T"].parameters / 1008.0e9 - 1) < 1e-3
    assert abs(S.MODELS["GPT 145B"].parameters / 145.6e9 - 1) < 1e-3
    assert abs(S.MODELS["Llama 3 405B"].parameters / 405e9 - 1) < 0.01
    rows = S.predict_published()
    assert len(rows) == len(S.PUBLISHED)
    for r in rows:
        p = r["published"]
        assert p.run.layout.world_size == p.devices  # the split uses every GPU
        assert 0 < r["mfu"] < 1 and 0 < r["published_mfu"] < 1


def test_measured_steps_respect_the_emulated_link(cluster):
    cfg = tf.GPTConfig(context=32, d_model=32, n_heads=4)
    link = timing.measured_link(cluster.run, "100Mbit/s,1ms", 4, sizes=(2**12, 2**16, 2**18))
    machine = timing.this_machine(cluster.run, cfg, 8, 4, link)
    assert machine.cores >= 1 and not machine.overlap and machine.efficiency > 0
    rows = timing.predicted_and_measured(cluster.run, [{"dp": 4}, {"dp": 2, "tp": 2}],
                                         "100Mbit/s,1ms", cfg, 8, machine, steps=3)
    for r in rows:
        layout = planner.Layout.from_shape(r["shape"])
        assert (r["plan"]["tp"] > 0) == (layout.tp > 1)
        # the emulator holds every message to its link: a step is never faster than the
        # gradient allreduce's 2 (p - 1) latencies and its bytes on 100 Mbit/s
        n = planner.parameters_per_rank(cfg, layout) * 4
        floor = costmodel.allreduce_time("ring", n, layout.dp,
                                         costmodel.Link("", alpha=1e-3, beta=8 / 100e6))
        assert r["measured"] >= floor
