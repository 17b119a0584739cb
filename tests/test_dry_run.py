"""The dry run of a 1,024-rank mesh in one process: torch's fake process group, FSDP2 and tensor
parallelism issue exactly the collectives the planner lists, and each rank holds exactly the
bytes it plans; a layout that cannot fit is refused before anything is built."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import dry_run as D
from course_lib import planner
from course_lib import scale_plan as S
from course_lib import transformer as tf

# every tensor's first dimension divides by dp = 128 (FSDP2 pads the others): 3 d / tp, 4 d / tp,
# d, the vocabulary and the context
SMALL = tf.GPTConfig(vocab_size=256, context=128, d_model=1024, n_heads=8, n_layers=2)
LAYOUT = planner.Layout(dp=128, tp=8, zero=3)  # 1,024 ranks
BATCH, LENGTH = 256, 128


@pytest.fixture(scope="module")
def runs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's notes on views and backward hooks
        return {rank: D.dry_run(SMALL, LAYOUT, BATCH, LENGTH, rank=rank)
                for rank in (0, 517, 1023)}


def test_every_recorded_collective_is_planned(runs):
    planned = D.planned_collectives(SMALL, LAYOUT, BATCH, LENGTH)
    kinds = {(c.kind, c.dim) for c in planned}
    assert kinds == {("allreduce", "tp"), ("all-gather", "dp"), ("reduce-scatter", "dp")}
    for rank, run in runs.items():
        assert run["coords"] == {"dp": rank // 8, "tp": rank % 8}
        assert D.compare(run["collectives"], planned) == dict(same=True, unplanned={},
                                                               missing={}), rank
        assert len(run["collectives"]) == 4 * 2 + 1 + 1 + 3 * 2  # tp; root; two blocks


def test_every_rank_holds_what_the_planner_counts(runs):
    planned = planner.memory_per_rank(SMALL, LAYOUT, BATCH, LENGTH, itemsize=4)
    for run in runs.values():
        assert run["held"] == planned


def test_a_missing_or_extra_collective_is_named(runs):
    planned = D.planned_collectives(SMALL, LAYOUT, BATCH, LENGTH, ends_gathered=4)
    found = D.compare(runs[0]["collectives"], planned)
    ends = D.Collective("all-gather", "dp", sum(planner.tensor_units(SMALL, LAYOUT)[0]))
    assert not found["same"] and found["missing"] == {ends: 3} and not found["unplanned"]


@pytest.mark.parametrize("layout", [planner.Layout(dp=4, tp=2, zero=3),
                                    planner.Layout(dp=128, tp=8, zero=3)])
def test_the_course_rings_of_the_planned_collectives_are_bytes_per_step(layout):
    """The course's ZeroDataParallel gathers the ends four times: its ring bytes are
    planner.bytes_per_step's, on every rank."""
    planned = D.planned_collectives(SMALL, layout, BATCH, LENGTH, ends_gathered=4)
    for rank in (0, 1, layout.world_size - 1):
        coords = dict(zip(("dp", "tp"), divmod(rank, layout.tp), strict=True))
        assert D.ring_bytes(planned, layout, coords) == planner.bytes_per_step(
            SMALL, layout, BATCH, LENGTH, coords, itemsize=4)


def test_a_layout_that_cannot_fit_is_refused_before_anything_runs():
    """GPT 18B's global batch of 1,024 sequences at once: 117 GiB a rank, the activations."""
    cfg = D.gpt_config(S.MODELS["GPT 18B"])
    with pytest.raises(ValueError, match=r"dp128 x tp8, ZeRO-3 \(1,024 ranks\) does not fit: "
                                         r"117 GiB > 80 GiB \(activations 117 GiB\) per rank"):
        D.dry_run(cfg, LAYOUT, 1024, 2048, memory=80 * 2**30)
    assert D.check_fits(cfg, LAYOUT, 128, 2048, 80 * 2**30)["total"] < 16 * 2**30
    assert not dist.is_initialized()


def test_what_the_dry_run_does_not_build_is_refused():
    for layout in (planner.Layout(dp=4, tp=2), planner.Layout(dp=2, pp=2, zero=3)):
        with pytest.raises(ValueError, match="the dry run splits dp x tp with ZeRO-3"):
            D.dry_run(SMALL, layout, 8, 16)
    with pytest.raises(ValueError, match="rank 8 is not in a world of 8"), D.fake_world(8, 8):
        pass
    with pytest.raises(ValueError, match="tied head"):
        D.gpt_config(S.MODELS["Llama 3 405B"])


def test_the_reordered_rows_give_each_rank_its_heads():
    """ColwiseParallel gives rank t its contiguous rows: after qkv_rows_by_rank those compute
    exactly t's heads of the whole attention."""
    cfg, tp = tf.GPTConfig(context=8, d_model=32, n_heads=4), 2
    attn, x = tf.CausalSelfAttention(cfg).double(), torch.randn(2, 8, 32, dtype=torch.float64)
    heads = []
    attn.proj = nn.Identity()  # the heads side by side, before the projection mixes them
    rows = D.qkv_rows_by_rank(attn.qkv.weight.detach(), tp)
    bias = D.qkv_rows_by_rank(attn.qkv.bias.detach(), tp)
    share = rows.shape[0] // tp
    for t in range(tp):
        local = tf.CausalSelfAttention(cfg).double()
        local.proj = nn.Identity()
        local.qkv = nn.Linear(32, share).double()
        with torch.no_grad():
            local.qkv.weight.copy_(rows[t * share:(t + 1) * share])
            local.qkv.bias.copy_(bias[t * share:(t + 1) * share])
        heads.append(local(x))
    torch.testing.assert_close(torch.cat(heads, dim=-1), attn(x), rtol=0, atol=1e-12)
