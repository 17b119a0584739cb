"""The transformer on meshes of 8 ranks (three dimensions at once, experts, pipeline stages,
ZeRO-1 and ZeRO-3) against one process: loss after every step and every parameter, float64."""

import pytest

from course_lib.testing.mesh import mesh_training_on_rank, plan_differences

CLUSTER_SIZE = 8  # a shared cluster of tests/conftest.py, started for this module


@pytest.mark.parametrize("shape, experts", [
    ({"dp": 8}, 0), ({"dp": 4, "tp": 2}, 0), ({"dp": 2, "cp": 2, "tp": 2}, 0),
    ({"dp": 2, "ep": 4}, 4)], ids=["dp8", "dp4-tp2", "dp2-cp2-tp2", "dp2-ep4"])
def test_the_transformer_on_a_mesh_of_8_trains_as_one_process(cluster, shape, experts):
    rows = cluster.run(mesh_training_on_rank, shape, 3, experts)
    assert max(r["loss_error"] for r in rows) < 1e-10
    assert max(r["param_error"] for r in rows) < 1e-10
    assert max(r["grad_error"] for r in rows) < 1e-10  # Adam would hide a scale
    assert len({tuple(r["coords"].values()) for r in rows}) == 8  # each rank its own place
    assert plan_differences(rows, shape, experts) == []  # the planner's bytes, kind by kind


@pytest.mark.parametrize("shape, zero, microbatches", [
    ({"pp": 2, "dp": 2, "tp": 2}, 0, 4), ({"pp": 2, "dp": 2, "tp": 2}, 1, 3),
    ({"dp": 4, "tp": 2}, 1, 1), ({"dp": 4, "tp": 2}, 3, 1)],
    ids=["pp2-dp2-tp2", "pp2-dp2-tp2-zero1-uneven", "zero1-dp4-tp2", "zero3-dp4-tp2"])
def test_pipeline_and_zero_on_a_mesh_of_8_train_as_one_process(cluster, shape, zero,
                                                               microbatches):
    rows = cluster.run(mesh_training_on_rank, shape, 3, zero=zero, microbatches=microbatches)
    assert max(r["loss_error"] for r in rows) < 1e-10
    assert max(r["param_error"] for r in rows) < 1e-10  # ZeRO-3: gathered over dp
    assert max(r["grad_error"] for r in rows) < 1e-10  # ZeRO-3: each rank's shards
    assert rows[0]["losses"][-1] < rows[0]["losses"][0]  # and it learns
    # held and sent, kind by kind: 1F1B's activations, the tied gradient, ZeRO's shares
    assert plan_differences(rows, shape, zero=zero, microbatches=microbatches) == []
