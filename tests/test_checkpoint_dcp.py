"""PyTorch's DCP on four ranks: a model sharded by FSDP2 over dp4 loads on dp2 x tp2 and in one
process, parameters and Adam's state bitwise equal, DCP's own load plan reading the boxes
``checkpoint.reshard_reads`` computes; ``async_save`` commits every step it writes."""

import torch
import torch.distributed.checkpoint as dcp

from course_lib import checkpoint
from course_lib.testing import checkpoint as runs

CLUSTER_SIZE = 4


def test_a_checkpoint_saved_on_dp4_loads_bitwise_on_dp2_x_tp2_and_one_process(cluster, tmp_path):
    saved = cluster.run(runs.dcp_save_trained, str(tmp_path))
    loaded = cluster.run(runs.dcp_load_resharded, str(tmp_path), 2, 2)
    alone = runs.dcp_load_one_process(tmp_path)
    reference = saved[0]["full"]
    assert runs.differences(reference, loaded[0]["full"]) == []
    assert runs.differences(reference, alone) == []
    untrained = runs.reshard_model(0)  # the same start: the steps moved every tensor
    assert all(not torch.equal(p, reference["model"][n]) for n, p in untrained.named_parameters())
    assert sorted(reference["optim"]["0.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    boxes, files = runs.saved_chunks(checkpoint.dcp_latest(tmp_path), "model.2.weight")
    assert boxes == [((16 * r, 0), (16, 256)) for r in range(4)]
    assert files == [f"__{r}_0.distcp" for r in range(4)]
    layouts = {r["rank"]: r["layout"]["2.weight"] for r in loaded}
    assert layouts[1] == {"placements": ["S(0)", "S(1)"], "box": ((0, 128), (32, 128))}
    for r in loaded:
        assert len(r["reads"]) == 2
        assert runs.plan_matches(boxes, layouts[r["rank"]]["box"], r["reads"])
    # a wrong box does not match DCP's plan: the check can fail
    assert not runs.plan_matches(boxes, ((0, 0), (32, 128)), loaded[1]["reads"])


def test_async_save_commits_every_step_and_reports_its_parts(cluster, tmp_path):
    result = cluster.run(runs.async_save_overlap, str(tmp_path), 1, 0.01, 2, False, 50, 1)
    steps = sorted(p.name for p in tmp_path.iterdir())
    assert steps == ["step-00000000", "step-00000001"]
    assert all((tmp_path / s / ".metadata").exists() for s in steps)
    state = {"w": torch.zeros(4 * 256, 1024), "step": torch.tensor(-1)}
    dcp.load(state, checkpoint_id=tmp_path / steps[1], no_dist=True)
    first_rows = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    assert torch.equal(state["w"][:256], first_rows) and int(state["step"]) == 0
    for r in result:
        assert set(r) == {"plain", "save", "blocked", "during", "wait", "hidden"}
        assert r["save"] > 0 and r["blocked"] > 0 and r["during"] > 0
        # the emulated storage's bytes at 50 MB/s: a floor the write cannot go under
        assert r["save"] >= (1 << 20) / 50e6  # 1 MiB per rank
