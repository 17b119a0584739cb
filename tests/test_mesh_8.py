"""The transformer on meshes of 8 ranks (three dimensions at once, and experts) against one
process: loss after every step and every parameter, float64."""

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
