"""From-scratch data parallelism against one process on the global batch and against torch DDP."""

import math

import numpy as np
import pytest

from course_lib import ddp
from course_lib.ddp import assign_buckets, bucket_groups
from course_lib.runtime import timeline
from course_lib.runtime.cluster import RemoteError
from course_lib.testing import ddp as ddp_check

WRAPPED = [(s, w, a) for s in ddp.STRATEGIES for w in ("ddp", "optimizer", "functional")
           for a in ddp.ALGORITHMS if not (s == "overlap" and w == "functional")]


CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py
CLUSTER_BACKEND = "gloo"


def test_buckets_fill_in_reverse_order_up_to_the_cap():
    assert assign_buckets([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert assign_buckets([4, 4, 4], 10) == [[2, 1, 0]]
    assert assign_buckets([2, 100, 2, 2], 8) == [[3, 2, 1], [0]]   # closed once it is full
    assert assign_buckets([100, 2, 2], 8) == [[2, 1, 0]]
    assert assign_buckets([1, 2, 3], 1e9) == [[2, 1, 0]]
    assert assign_buckets([], 8) == []
    assert assign_buckets([4, 4, 4, 4, 4], 8, first_cap_bytes=4) == [[4], [3, 2], [1, 0]]
    with pytest.raises(ValueError, match="cap"):
        assign_buckets([1], 0)


def test_the_first_bucket_is_1_mib_only_at_torchs_default_cap():
    mib = 2**20
    sizes = [(s, "float32") for s in (mib // 2, mib // 2, mib // 2, mib // 2, mib // 4, mib)]
    assert bucket_groups(sizes, "overlap") == [[5], [4, 3, 2, 1, 0]]        # 1 MiB, then 25
    assert bucket_groups(sizes, "overlap", 1.5) == [[5, 4, 3], [2, 1, 0]]    # 1.5 MiB, first too
    assert bucket_groups(sizes, "bucketed", 25) == [[5, 4, 3, 2, 1, 0]]      # 25 given: no 1 MiB
    assert bucket_groups(sizes, "overlap", 1.5, first_bucket_mb=0.5) == [[5], [4, 3, 2, 1], [0]]
    assert bucket_groups(sizes, "flat") == [[5, 4, 3, 2, 1, 0]]
    assert bucket_groups(sizes, "overlap", 0) == [[5], [4], [3], [2], [1], [0]]  # one a tensor
    assert bucket_groups(sizes, "bucketed", math.inf) == [[5, 4, 3, 2, 1, 0]]    # one for all
    with pytest.raises(ValueError, match="bucket_cap_mb must be >= 0"):
        bucket_groups(sizes, "overlap", -1)


def test_buckets_equal_torch_ddps_from_its_second_step(cluster):
    """torch DDP (2.13) reduces everything in one bucket in step 1, then rebuilds its buckets in
    the order the gradients became ready (reverse order for an MLP): from step 2 on they must
    be the course's, at the default cap (1 MiB first bucket) and at caps given."""
    caps = (None, 0.01, 2.0)
    seen = cluster.run(ddp_check.torch_ddp_buckets, caps=caps, steps=3)
    ours = cluster.run(ddp_check.course_ddp_buckets, caps=caps)
    names = [f"{layer}.{kind}" for layer in (0, 2, 4, 6) for kind in ("weight", "bias")]
    for rank in range(2):
        assert [(cap, step) for cap, step, _ in seen[rank]] == \
            [(cap, step) for cap in caps for step in (1, 2, 3)]
        for cap, step, buckets in seen[rank]:
            if step == 1:
                assert len(buckets) == 1 and sorted(buckets[0]) == sorted(names), cap
            else:
                assert buckets == ours[rank][cap], (cap, step)
    # the caps make different buckets (a given cap caps the first bucket too)
    assert [len(ours[0][cap]) for cap in caps] == [2, 4, 2]
    assert ours[0][None][0] == ["6.bias", "6.weight", "4.bias", "4.weight"]   # 1 MiB
    assert ours[0][2.0][0] == ["6.bias", "6.weight", "4.bias", "4.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("strategy,wrapper,algorithm", WRAPPED)
def test_n_ranks_equal_one_process_and_torch_ddp(cluster, strategy, wrapper, algorithm):
    reference = ddp_check.single_process(steps=3, batch=65)
    torch_ddp = cluster.run(ddp_check.train_on_rank, "torch", steps=3, batch=65)
    runs = cluster.run(ddp_check.train_on_rank, strategy, algorithm, steps=3, batch=65,
                       wrapper=wrapper)
    assert ddp_check.max_difference(runs, reference) < 1e-10
    assert ddp_check.max_difference(runs, torch_ddp[0]["params"]) < 1e-12
    assert not np.allclose(runs[0]["params"][0], runs[0]["params"][-1])   # it did train


def test_the_naive_version_equals_one_process_and_torch_ddp(cluster):
    reference = ddp_check.single_process(steps=3, batch=65)
    torch_ddp = cluster.run(ddp_check.train_on_rank, "torch", steps=3, batch=65)
    runs = cluster.run(ddp_check.train_on_rank, steps=3, batch=65, wrapper="naive")
    assert ddp_check.max_difference(runs, reference) < 1e-10
    assert ddp_check.max_difference(runs, torch_ddp[0]["params"]) < 1e-12
    assert not np.allclose(runs[0]["params"][0], runs[0]["params"][-1])   # it did train
    with pytest.raises(RemoteError, match="have no gradient"):  # no backward: named, not hung
        cluster.run(ddp_check.train_on_rank, steps=1, batch=8, variant="unused", wrapper="naive")


@pytest.mark.parametrize("strategy", ["per_parameter", "overlap"])
@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_batchnorm_buffers_equal_torch_ddp_every_step_on_every_rank(cluster, strategy,
                                                                     broadcast_buffers):
    kwargs = dict(variant="batchnorm", steps=4, batch=64, broadcast_buffers=broadcast_buffers)
    torch_ddp = cluster.run(ddp_check.train_on_rank, "torch", **kwargs)
    runs = cluster.run(ddp_check.train_on_rank, strategy, **kwargs)
    for ours, theirs in zip(runs, torch_ddp, strict=True):  # every rank, every step
        for name in ("params", "buffers"):
            for a, b in zip(ours[name], theirs[name], strict=True):
                assert np.abs(a - b).max() < 1e-12, (name, strategy)
    # after a step each rank's buffers hold its own slice's statistics on top of what it started
    # the step with: rank 0's (broadcast) or its own (not), as in torch DDP
    assert np.abs(runs[0]["buffers"][-1] - runs[1]["buffers"][-1]).max() > 1e-3


def test_buffers_follow_rank_0_with_gradient_accumulation(cluster):
    kwargs = dict(variant="batchnorm", steps=3, batch=64, accumulate=2)
    torch_ddp = cluster.run(ddp_check.train_on_rank, "torch", **kwargs)
    runs = cluster.run(ddp_check.train_on_rank, "overlap", **kwargs)
    for ours, theirs in zip(runs, torch_ddp, strict=True):
        for a, b in zip(ours["buffers"] + ours["params"], theirs["buffers"] + theirs["params"],
                        strict=True):
            assert np.abs(a - b).max() < 1e-12


def test_float32_equals_one_process_to_1e_5(cluster):
    reference = ddp_check.single_process(steps=4, batch=63, dtype="float32")
    for strategy in ("per_parameter", "overlap"):
        runs = cluster.run(ddp_check.train_on_rank, strategy, steps=4, batch=63,
                           dtype="float32")
        assert ddp_check.max_difference(runs, reference) < 1e-5


@pytest.mark.parametrize("variant", ["tied", "frozen", "unused"])
@pytest.mark.parametrize("wrapper", ["ddp", "optimizer"])
def test_corner_cases_equal_torch_ddp(cluster, variant, wrapper):
    torch_ddp = cluster.run(ddp_check.train_on_rank, "torch", variant=variant)
    runs = cluster.run(ddp_check.train_on_rank, "overlap", variant=variant, wrapper=wrapper)
    assert ddp_check.max_difference(runs, torch_ddp[0]["params"]) < 1e-12
    assert [r["no_grad"] for r in runs] == [r["no_grad"] for r in torch_ddp]
    if variant == "unused":
        assert runs[0]["no_grad"] == ["b.weight", "b.bias"]   # unused everywhere: grad None
    if variant != "unused":
        reference = ddp_check.single_process(variant=variant)
        assert ddp_check.max_difference(runs, reference) < 1e-10


def test_unused_parameters_need_the_flag(cluster):
    with pytest.raises(RemoteError, match="spare.weight.*got no gradient.*find_unused"):
        cluster.run(ddp_check.unused_without_flag)


def test_overlap_is_real_and_bucketed_is_not(cluster):
    kw = dict(steps=3, batch=64, hidden=(256, 256), dtype="float32", bucket_cap_mb=0.1,
              record=True)
    for strategy in ("overlap", "bucketed"):
        tl = cluster.run(ddp_check.train_on_rank, strategy, **kw)[0]["timeline"]
        backward = tl.of("backward")
        buckets = tl.of("allreduce")
        assert len(backward) == 3 and len(buckets) == 3 * 2    # closed once >= 0.1 MiB
        assert len(tl.of("forward")) == len(tl.of("step")) == len(tl.of("wait")) == 3
        launched_early = [b for b in buckets
                          if any(w.start <= b.start < w.end for w in backward)]
        if strategy == "overlap":
            assert launched_early and timeline.overlap(tl, "backward", "allreduce") > 0
        else:
            assert not launched_early and timeline.overlap(tl, "backward", "allreduce") == 0


def test_broadcasts_give_every_rank_rank_0s_state(cluster):
    out = cluster.run(ddp_check.broadcasts_on_rank)
    assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1])
    assert out[1][2] == 0.25   # the learning rate travelled too


@pytest.mark.parametrize("strategy", ["torch", "overlap", "bucketed"])
def test_gradient_accumulation_with_no_sync(cluster, strategy):
    reference = ddp_check.single_process(steps=3, batch=64)
    runs = cluster.run(ddp_check.train_on_rank, strategy, steps=3, batch=64, accumulate=3)
    assert ddp_check.max_difference(runs, reference) < 1e-10


@pytest.mark.parametrize("where,what,counts", [("wrapper", "tensors to broadcast", (4, 4)),
                                               ("reducer", "gradient buckets", (1, 1))])
def test_different_models_are_refused_before_any_gradient_moves(cluster, where, what, counts):
    pattern = (rf"(?s)raised on rank\(s\) \[0, 1\].*disagree on the {what}.*"
               rf"rank 0: \[{counts[0]}, 114, \d+\], rank 1: \[{counts[1]}, 121, \d+\]")
    with pytest.raises(RemoteError, match=pattern):
        cluster.run(ddp_check.mismatched_models, where)


def test_bad_arguments_are_clear(cluster):
    with pytest.raises(RemoteError, match="strategy must be one of"):
        cluster.run(ddp_check.train_on_rank, "fastest")
    with pytest.raises(RemoteError, match="algorithm must be one of"):
        cluster.run(ddp_check.train_on_rank, "overlap", "magic")


def test_a_missing_rank_fails_with_a_deadline_naming_the_bucket(cluster):
    (message, waited), _ = cluster.run(ddp_check.missing_rank, 2.0, timeout=30)
    assert message is not None and "rank 0" in message and "bucket 0" in message
    assert "elements, 4.7 KiB)" in message and "within 2s" in message
    assert waited < 15


@pytest.mark.parametrize("cap", [0, math.inf], ids=["a-bucket-per-tensor", "one-bucket"])
def test_the_two_extreme_caps_equal_torch_ddp(cluster, cap):
    """bucket_cap_mb=0: one allreduce per tensor, each launched from its gradient's hook;
    math.inf: one bucket. Both equal torch DDP."""
    torch_ddp = cluster.run(ddp_check.train_on_rank, "torch", steps=2, batch=64)
    runs = cluster.run(ddp_check.train_on_rank, "overlap", steps=2, batch=64, bucket_cap_mb=cap)
    assert ddp_check.max_difference(runs, torch_ddp[0]["params"]) < 1e-12
