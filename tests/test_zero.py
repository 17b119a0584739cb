"""ZeRO stages 0-3: equal to one process on the global batch at world sizes 1-4, with Adam and
SGD with momentum, over the course's ring and the native collectives; equal to torch FSDP2, in
float32 and in mixed precision (ZeRO-3); the memory each stage holds follows the ZeRO paper's
accounting."""

import pytest
import torch

from course_lib import zero
from course_lib.testing import zero as K

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py


def test_one_rank_is_one_process():
    from course_lib.comm import Comm
    for stage in zero.STAGES:
        model = zero.ZeroDataParallel(K.make_model(), K.OPTIMIZERS["adam"], Comm(0, 1), stage)
        x, y = K.make_data()
        for _ in range(3):
            torch.nn.functional.mse_loss(model(x), y).backward()
            model.step()
        for p, q in zip(model.full_parameters(), K.one_process(), strict=True):
            assert torch.allclose(p, q, rtol=0, atol=1e-12)


FROZEN_MODELS = ["frozen-first", "frozen-middle"]  # a whole layer and one tensor frozen


def frozen_bytes(name):
    """Bytes of the trainable and of the frozen parameters of a model of K.MODELS (float64)."""
    params = list(K.MODELS[name][0]().parameters())
    return (sum(p.numel() * 8 for p in params if p.requires_grad),
            sum(p.numel() * 8 for p in params if not p.requires_grad))


@pytest.mark.parametrize("name", FROZEN_MODELS)
def test_frozen_parameters_on_one_rank(name):
    """Frozen parameters (a whole layer, and one bias of another) stay exactly as they were at
    every stage, the others equal one process's (torch, no sharding), and the frozen ones
    count as parameters only: no gradient, no optimizer state."""
    from course_lib.comm import Comm
    make, sizes = K.MODELS[name]
    trainable, frozen = frozen_bytes(name)
    for stage in zero.STAGES:
        for optimizer in K.OPTIMIZERS:
            model = zero.ZeroDataParallel(make(), K.OPTIMIZERS[optimizer], Comm(0, 1), stage)
            x, y = K.make_data(sizes=sizes)
            for _ in range(3):
                torch.nn.functional.mse_loss(model(x), y).backward()
                model.step()
            reference = K.one_process(optimizer, model=name)  # torch, every parameter given
            for p, q, start in zip(model.full_parameters(), reference, make().parameters(),
                                   strict=True):
                assert torch.allclose(p, q, rtol=0, atol=1e-12), (stage, optimizer)
                assert start.requires_grad or torch.equal(p, start), (stage, optimizer)
            held = model.memory()
            assert held["parameters"] == (trainable if stage < 3 else 0) + frozen, held
            numbers = {"adam": 2, "sgd": 1}[optimizer]  # Adam's two moments; the momentum
            assert held["optimizer"] == numbers * trainable and held["gradients"] == 0, held
        plan = zero.planned_memory(make(), 1, stage)
        assert plan["parameters"] >= frozen and plan["optimizer"] == 2 * trainable, plan
        assert plan["gradients"] <= 2 * trainable, plan


@pytest.mark.parametrize("stage", zero.STAGES)
@pytest.mark.parametrize("name", FROZEN_MODELS)
def test_frozen_parameters_on_three_ranks(cluster, stage, name):
    """The same on 3 ranks (which do not divide the units): equal to one process, the frozen
    parameters unchanged, kept whole on every rank and counted as parameters only; the peak
    held is the plan."""
    reports = [r for r in cluster.run(K.zero_matches_one_process, stage, "adam", world_size=3,
                                      model=name) if r]
    assert len(reports) == 3
    trainable, frozen = frozen_bytes(name)
    for r in reports:
        assert r["diff"] < 1e-10 and r["frozen_changed"] == 0, r
        held = r["memory"]
        assert held["parameters"] == (trainable if stage < 3 else 0) + frozen, held
        assert held["optimizer"] == 2 * (held["shards"] if stage else trainable), held
        assert held["gradients"] == 0, held
        assert 0.9 * r["plan"]["total"] <= r["peak"]["total"] <= r["plan"]["total"], r
    assert sum(r["memory"]["shards"] for r in reports) == (trainable if stage else 0)


@pytest.mark.parametrize("stage", zero.STAGES)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_stage_equals_one_process_with_adam(cluster, stage, world_size):
    reports = [r for r in cluster.run(K.zero_matches_one_process, stage, "adam",
                                      world_size=world_size) if r]
    assert len(reports) == world_size
    assert max(r["diff"] for r in reports) < 1e-10, reports


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_sgd_with_momentum_and_native_collectives(cluster, stage, algorithm):
    reports = cluster.run(K.zero_matches_one_process, stage, "sgd", algorithm=algorithm)
    assert max(r["diff"] for r in reports) < 1e-10, reports


def test_same_parameters_as_torch_fsdp2(cluster):
    assert max(cluster.run(K.fsdp2_matches, 3, "adam")) < 1e-10


def test_each_stage_holds_what_the_paper_says(cluster):
    """Bytes held after a step, per rank, on 4 ranks: Adam's two numbers per parameter sharded
    from stage 1, gradients from stage 2 (freed), parameters from stage 3 (freed)."""
    psi = sum(p.numel() for p in K.make_model().parameters()) * 8  # float64 bytes
    held = {s: cluster.run(K.zero_matches_one_process, s, "adam")[0]["memory"]
            for s in zero.STAGES}
    assert held[0]["parameters"] == psi and held[0]["optimizer"] == 2 * psi
    shard = psi / 4 + 2 * 8  # a quarter, plus at most one element for each of the 2 units
    assert held[1]["optimizer"] <= 2 * shard
    assert held[1]["parameters"] == held[2]["parameters"] == psi
    assert held[2]["gradients"] == 0 and held[3]["gradients"] == 0  # freed after the step
    assert held[3]["parameters"] == 0 and held[3]["shards"] <= shard
    peak = {s: cluster.run(K.zero_matches_one_process, s, "adam")[0]["peak_parameters_in_forward"]
            for s in (1, 3)}
    assert peak[1] == psi and peak[3] == 42 * 8  # stage 3: one layer (the larger) at a time


def test_bad_arguments_are_clear():
    from course_lib.comm import Comm
    with pytest.raises(ValueError, match="stage must be one of"):
        zero.ZeroDataParallel(K.make_model(), K.OPTIMIZERS["adam"], Comm(0, 1), stage=4)
    with pytest.raises(ValueError, match="algorithm must be"):
        zero.ZeroDataParallel(K.make_model(), K.OPTIMIZERS["adam"], Comm(0, 1), 1, "tree")


def test_the_papers_accounting():
    for N in (1, 2, 4):
        ddp, s1, s2, s3 = (zero.zero_memory(1000, N, s, optimizer_numbers=12,
                                            bytes_per_number=1) for s in zero.STAGES)
        assert ddp["total"] == (1 + 1 + 12) * 1000
        assert s1["total"] == 2 * 1000 + 12 * 1000 / N
        assert s2["total"] == 1000 + (1 + 12) * 1000 / N
        assert s3["total"] == (1 + 1 + 12) * 1000 / N


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_peak_held_is_the_plan(cluster, world_size):
    """What a rank held at its peak, counted from its tensors, equals planned_memory: the plan
    that the memory budget is checked against before training."""
    for stage in zero.STAGES:
        reports = [r for r in cluster.run(K.zero_matches_one_process, stage, "adam",
                                          world_size=world_size) if r]
        for r in reports:
            assert r["peak"]["total"] <= r["plan"]["total"], (stage, r["peak"], r["plan"])
            assert r["peak"]["total"] >= 0.9 * r["plan"]["total"], (stage, r["peak"], r["plan"])


def test_a_model_that_does_not_fit_is_refused_before_training():
    from course_lib.comm import Comm
    model = K.make_model()
    need = zero.planned_memory(model, 1, 0)["total"]
    with pytest.raises(zero.DoesNotFit, match=r"(?s)ZeRO stage 0 on 1 rank.*budget.*would fit"):
        zero.ZeroDataParallel(model, K.OPTIMIZERS["adam"], Comm(0, 1), 0, memory_budget=need - 1)
    assert all(p.untyped_storage().size() for p in model.parameters())  # nothing was freed
    plan3 = zero.planned_memory(model, 4, 3)
    assert plan3["total"] < need  # 2 units: the larger one, gathered, dominates
    tiny = zero.does_not_fit_message(model, 4, 3, budget=100)
    assert "Even sharding" in tiny and "largest unit" in tiny


def test_bench_counts_what_each_stage_sends_and_holds(cluster):
    """bench zero on 1 and 2 ranks of a small model: the bytes counted equal the formula (DDP,
    stages 1-2: 2(N-1)/N x params; stage 3: 3(N-1)/N), and what a rank held is the plan and
    within 10% of the paper's accounting."""
    from course_lib.bench import zero as bench
    rows = bench.measure(cluster, ranks=(1, 2), layers=16, width=16, batch=8, steps=2)
    assert len(rows) == 2 * len(bench.IMPLEMENTATIONS)
    for r in rows:
        if r["implementation"] in ("torch-ddp", "fsdp2"):
            assert r["sent_mib"] is None and r["held_mib"] is None
            continue
        assert r["sent_mib"] == pytest.approx(r["formula_sent_mib"], rel=1e-9, abs=1e-12), r
        assert r["held_mib"] <= r["planned_mib"]
        assert r["held_mib"] == pytest.approx(r["paper_mib"], rel=0.1), r
    zero3 = next(r for r in rows if r["implementation"] == "zero3" and r["ranks"] == 2)
    ddp = next(r for r in rows if r["implementation"] == "ddp" and r["ranks"] == 2)
    assert zero3["sent_mib"] == pytest.approx(1.5 * ddp["sent_mib"])
    text = bench.format_table(rows)
    assert "ZeRO-3 (ring)" in text and "torch FSDP2" in text and "# ceiling" in text


def test_bench_refuses_bad_options(capsys):
    from course_lib.__main__ import main
    assert main(["bench", "zero", "--implementations", "zero4"]) == 2
    assert "zero4" in capsys.readouterr().err
    assert main(["bench", "zero", "--ranks", "1,4", "--batch", "2"]) == 2


def test_zero3_trains_under_a_budget_one_process_cannot(cluster):
    """A budget of 40% of what one process needs: refused on 1 rank (before training, with the
    numbers); ZeRO-3 on 4 ranks trains under it, equal to one process without a budget; a
    budget below one gathered layer is refused even on 4 ranks."""
    one = zero.planned_memory(K.deep_model(), 1, 0)["total"]
    budget = int(0.4 * one)
    alone = cluster.run(K.train_under_budget, budget, 0, world_size=1)[0]
    assert alone["refused"] and "more than the budget" in alone["refused"], alone
    sharded = [r for r in cluster.run(K.train_under_budget, budget, 3) if r]
    assert all(r["refused"] is None for r in sharded), sharded
    assert max(r["peak"]["total"] for r in sharded) <= budget
    assert max(r["diff"] for r in sharded) < 1e-10
    tiny = cluster.run(K.train_under_budget, 2000, 3)
    assert all("Even sharding" in r["refused"] for r in tiny), tiny


@pytest.mark.parametrize("param_dtype", ["bf16", "fp16"])
def test_mixed_precision_equals_fsdp2_with_a_float32_reduce(cluster, param_dtype):
    """ZeRO-3 with ZeroPrecision(16 bits, reduce_dtype=float32) and FSDP2 with the same
    MixedPrecisionPolicy, 3 Adam steps on 4 ranks over Gloo: the same losses and float32
    parameters, bit for bit. Both gather the same 16-bit copies of the same float32 shards and
    compute the same forward and backward in 16 bits; the reduce then sums four 16-bit numbers
    (8 or 11 significant bits) in float32 (24), which is exact in any order, and divides by 4,
    which is exact too: so the ring and Gloo, summing in different orders, agree. The float32
    run, 1e-2 away after 3 steps, shows the check can fail."""
    reports = cluster.run(K.fsdp2_precision_matches, param_dtype, "fp32")
    name = str(K.DTYPES[param_dtype]).removeprefix("torch.")
    for r in reports:
        assert r["losses"] == r["torch_losses"] and r["diff"] == 0, r
        assert r["fp32_diff"] > 1e-2, r
        assert r["dtypes"] == r["torch_dtypes"] == {
            "parameters": [name], "input": [name], "output": [name],  # the forward: 16 bits
            "gradients": ["float32"], "shards": ["float32"], "optimizer": ["float32"]}, r
        # gathered in 16 bits (two gathers a step), reduced in 32: the float32 run sends 2x the
        # 16-bit bytes (its gathers) plus the same float32 bytes (its reduce-scatter)
        assert set(r["sent"]) == {name, "float32"}, r
        assert r["fp32_sent"] == 2 * r["sent"][name] + r["sent"]["float32"], r


@pytest.mark.parametrize("param_dtype", ["bf16", "fp16"])
def test_mixed_precision_reducing_in_16_bits_as_fsdp2(cluster, param_dtype):
    """ZeroPrecision(16 bits) alone reduces in 16 bits too, as FSDP2's default: every byte sent
    is 16-bit, half the float32 run's; the optimizer still sees float32 gradients and shards.
    The parameters can no longer agree bit for bit: a 16-bit sum rounds after each addition,
    and Gloo orders an element's additions by its place in the buffer (FSDP2 lays it out per
    parameter, padded; ZeRO per unit), the ring by its chunk. The first loss, before any
    update, is the same. For bf16 the rest stay within lr / 10 = 5e-3 (Adam moves a parameter
    by at most about lr = 0.05 a step, and a last-bit change of a gradient changes that update
    by a small fraction of it; 7e-4 measured), while the float32 run is 4e-2 away. For fp16
    that distance is no larger than the two sums' own difference (Adam turns the last bits of
    gradients near zero into updates of up to lr; 2e-2 measured against 4e-2), so for fp16
    only the bytes and dtypes are compared here; the float32 reduce above compares it exactly."""
    reports = cluster.run(K.fsdp2_precision_matches, param_dtype)
    name = str(K.DTYPES[param_dtype]).removeprefix("torch.")
    for r in reports:
        assert r["losses"][0] == r["torch_losses"][0], r
        assert r["dtypes"] == r["torch_dtypes"] == {
            "parameters": [name], "input": [name], "output": [name],
            "gradients": ["float32"], "shards": ["float32"], "optimizer": ["float32"]}, r
        assert r["sent"] == {name: r["fp32_sent"] / 2}, r
        if param_dtype == "bf16":
            assert r["diff"] < 5e-3 and r["fp32_diff"] > 2e-2, r
            closest = max(abs(a - b) for a, b in zip(r["losses"], r["torch_losses"], strict=True))
            assert closest < 5e-3, r


def test_a_bad_precision_is_refused():
    from course_lib.comm import Comm
    for bad in (torch.int32, "bf16", None):
        with pytest.raises(ValueError, match="param_dtype must be a floating-point torch.dtype"):
            zero.ZeroPrecision(bad)
    with pytest.raises(ValueError, match="reduce_dtype must be a floating-point torch.dtype"):
        zero.ZeroPrecision(torch.bfloat16, torch.int64)
    with pytest.raises(ValueError, match="at stage 3 only"):
        zero.ZeroDataParallel(K.make_model(), K.OPTIMIZERS["adam"], Comm(0, 1), 2,
                              precision=zero.ZeroPrecision(torch.bfloat16))
    with pytest.raises(ValueError, match="precision takes a ZeroPrecision"):
        zero.ZeroDataParallel(K.make_model(), K.OPTIMIZERS["adam"], Comm(0, 1), 3,
                              precision=torch.bfloat16)
