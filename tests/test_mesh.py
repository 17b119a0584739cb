"""The device mesh: coordinates and groups as torch's ``init_device_mesh`` lays them out, the
course's collectives over groups that are not the first ranks, and the transformer trained on
meshes of 4 and 8 ranks against one process (losses and parameters, float64); pipeline stages
and ZeRO's shares as the planner counts them."""

from dataclasses import replace

import pytest
import torch

from course_lib import mesh as M
from course_lib import planner
from course_lib import transformer as tf
from course_lib.moe import MoEConfig
from course_lib.testing.mesh import (
    groups_beside_torch,
    mesh_training_on_rank,
    plan_differences,
    threads_after_meshes,
)
from course_lib.zero_optimizer import partition

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py


def test_groups_and_coordinates_are_row_major():
    groups = M.mesh_groups({"dp": 2, "tp": 2})
    assert groups == {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}
    assert M.mesh_groups({"pp": 2, "dp": 2, "tp": 2})["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert M.coordinates(6, {"pp": 2, "dp": 2, "tp": 2}) == {"pp": 1, "dp": 1, "tp": 0}


def test_a_shape_that_does_not_fill_the_world_is_refused():
    with pytest.raises(ValueError, match=r"holds 6 ranks; the world has 8"):
        M.check_shape({"dp": 2, "tp": 3}, 8)
    with pytest.raises(ValueError, match="at least 1"):
        M.check_shape({"dp": 0}, 8)


@pytest.mark.parametrize("shape", [{"dp": 2, "tp": 2}, {"a": 2, "b": 1, "c": 2}])
def test_the_groups_are_torchs_and_collectives_run_on_them(cluster, shape):
    for rank, out in enumerate(cluster.run(groups_beside_torch, shape)):
        for name, g in out.items():
            assert g["ours"] == g["torch"] == g["group"] and rank in g["group"], (rank, name)
            assert g["total"] == sum(g["group"])  # the sum over its group, not the world


def test_a_mesh_made_again_makes_no_new_process_group(cluster):
    # each Gloo group keeps threads and sockets for the engine's life: a kept engine that makes
    # a mesh per cell (notebook 16) must reuse the groups of the same ranks
    shapes = [{"dp": 2, "tp": 2}, {"tp": 2, "dp": 2}, {"dp": 2, "tp": 2}, {"dp": 4}]
    for rank, counts in enumerate(cluster.run(threads_after_meshes, shapes)):
        assert counts[1:] == [counts[0]] * 3, (rank, counts)


@pytest.mark.parametrize("shape, experts", [
    ({"dp": 4}, 0), ({"dp": 2, "tp": 2}, 0), ({"cp": 2, "tp": 2}, 0), ({"dp": 2, "cp": 2}, 0),
    ({"dp": 2, "ep": 2}, 4)], ids=["dp4", "dp2-tp2", "cp2-tp2", "dp2-cp2", "dp2-ep2"])
def test_the_transformer_on_a_mesh_of_4_trains_as_one_process(cluster, shape, experts):
    rows = cluster.run(mesh_training_on_rank, shape, 3, experts)
    assert max(r["loss_error"] for r in rows) < 1e-10
    assert max(r["param_error"] for r in rows) < 1e-10
    assert max(r["grad_error"] for r in rows) < 1e-10  # Adam would hide a scale
    assert rows[0]["losses"][-1] < rows[0]["losses"][0]  # and it learns
    assert plan_differences(rows, shape, experts) == []  # the planner's bytes, kind by kind


def test_zero_divides_the_state_over_dp_and_experts_count_on_their_rank():
    cfg = tf.GPTConfig(context=16, d_model=16, n_heads=4)
    whole = planner.memory_per_rank(cfg, planner.Layout(dp=4), 8, 16)
    for stage, divided in [(1, ["optimizer"]), (2, ["optimizer", "gradients"]),
                           (3, ["optimizer", "gradients", "parameters"])]:
        plan = planner.memory_per_rank(cfg, planner.Layout(dp=4, zero=stage), 8, 16)
        for kind in ("parameters", "gradients"):
            assert plan[kind] == whole[kind] / (4 if kind in divided else 1)
    moe = MoEConfig(context=16, d_model=16, n_heads=4, experts=4)
    one = planner.parameters_per_rank(moe, planner.Layout())
    split = planner.parameters_per_rank(moe, planner.Layout(ep=4))
    assert one - split == 2 * 3 * (2 * 16 * 64 + 64 + 16)  # 3 of 4 experts elsewhere, 2 blocks
    assert one == tf.GPT(moe).num_parameters()
    assert planner.parameters_per_rank(cfg, planner.Layout()) == tf.GPT(cfg).num_parameters()
    with pytest.raises(ValueError, match="expert blocks"):
        planner.activation_bytes_per_rank(moe, planner.Layout(), 8, 16)


def test_tensor_parallelism_of_expert_blocks_is_refused(cluster):
    with pytest.raises(Exception, match="split experts by ep"):
        cluster.run(mesh_training_on_rank, {"dp": 2, "tp": 2}, 1, 4)


@pytest.mark.parametrize("shape", [{"dp": 2, "tp": 2}, {"cp": 2, "tp": 2}, {"pp": 2, "dp": 2}],
                         ids=["dp2-tp2", "cp2-tp2", "pp2-dp2"])
@pytest.mark.parametrize("recompute", ["full", "attention"])
def test_recomputation_keeps_what_the_plan_says_and_changes_no_number(cluster, shape, recompute):
    rows = cluster.run(mesh_training_on_rank, shape, 2, 0, recompute=recompute)
    assert max(r["loss_error"] for r in rows) < 1e-10  # against one process without it
    assert max(r["param_error"] for r in rows) < 1e-10
    assert max(r["grad_error"] for r in rows) < 1e-10  # Adam would hide a scale
    assert plan_differences(rows, shape, recompute=recompute) == []
    whole = planner.activation_bytes_per_rank(tf.GPTConfig(context=16, d_model=16, n_heads=4),
                                              planner.Layout.from_shape(shape), 8, 16)
    assert rows[0]["memory"]["activations"] < whole  # it keeps less


def test_pipeline_stages_chained_are_the_model_and_the_planner_counts_each():
    cfg = tf.GPTConfig(context=16, d_model=16, n_heads=4, n_layers=3)
    model = tf.GPT(cfg).double()
    x = torch.randint(0, cfg.vocab_size, (4, 16))
    stages = [M.PipelineStage(model, s, 2) for s in range(2)]  # blocks 0-1, then block 2
    assert torch.equal(stages[1](stages[0](x)), model(x)[0])
    assert torch.equal(M.PipelineStage(model)(x), model(x)[0])  # one stage: all of it
    names = [stage.global_name(n) for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted([n for n, _ in model.named_parameters()] + ["tok.weight"])
    layout = planner.Layout(pp=2, dp=2, microbatches=4)
    assert layout.world_size == 4
    for s, stage in enumerate(stages):  # the last stage holds the head's own copy of tok
        assert planner.tensor_sizes(cfg, layout, s) == [p.numel() for p in stage.parameters()]
    # 1F1B: stage 0 keeps 2 micro-batches of 4 at most, stage 1 one; the tokens (targets) once
    def kept(batch, microbatches, stage):
        plan = replace(layout, microbatches=microbatches)
        return planner.activation_bytes_per_rank(cfg, plan, batch, 16, stage=stage) - 8 * 16 * (
            batch // 2)
    assert kept(16, 4, 0) == 2 * kept(4, 1, 0) and kept(16, 4, 1) == kept(4, 1, 1)
    with pytest.raises(ValueError, match="expert blocks"):
        moe = tf.GPT(MoEConfig(**vars(cfg), experts=4))
        M.pipeline_stage(moe, M.Mesh({"pp": 1}, 0, {"pp": 0}, {}))


def test_the_zero_shares_are_the_course_optimizers():
    cfg = tf.GPTConfig(context=16, d_model=16, n_heads=4)
    model = tf.GPT(cfg)
    sizes = planner.tensor_sizes(cfg, planner.Layout())
    owners = partition([{"params": list(model.parameters())}], 3)
    owned = planner.owned_tensors(sizes, 3)
    for r in range(3):  # what ShardedOptimizer's rule gives each rank
        mine = sorted(p.numel() for p, o in zip(model.parameters(), owners, strict=True) if o == r)
        assert sorted(owned[r]) == mine
    plans = [planner.memory_per_rank(cfg, planner.Layout(dp=3, zero=3), 6, 16, coords={"dp": r})
             for r in range(3)]  # ZeRO-3: shard_bounds of each unit, uneven over 3 ranks
    assert sum(p["parameters"] for p in plans) == 8 * model.num_parameters()
    assert len({p["parameters"] for p in plans}) > 1
