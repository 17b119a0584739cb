"""Local SGD and compressed SGD on real ranks: k=1 is synchronous SGD, k steps send k times
fewer bytes, error feedback makes top-k train, torch's hooks send what their shapes say."""

import numpy as np
import pytest

from course_lib import compression, local_sgd
from course_lib.checks import lab08_local_sgd_and_compression as checks_compression
from course_lib.testing import local_sgd as torch_hooks

SHORT = dict(steps=40, eval_every=10)


CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py
CLUSTER_BACKEND = "gloo"


def test_k1_and_uncompressed_equal_single_process_sgd_on_the_global_batch(cluster):
    kw = dict(steps=5, lr=0.1, dtype="float64", eval_every=5)
    expected = local_sgd.single_process_sgd(2, steps=5, lr=0.1, dtype="float64")
    start = local_sgd.Replica(0, 1, 32, (64,), 0, "float64").theta.numpy()
    assert np.abs(expected - start).max() > 1e-3  # five steps moved the parameters
    for run in (local_sgd.run_local_sgd(cluster, 1, **kw),
                local_sgd.run_compressed(cluster, "none", **kw)):
        assert np.abs(run["theta"] - expected).max() < 1e-10, run["name"]
    k2 = local_sgd.run_local_sgd(cluster, 2, **kw)  # k=2 is a different algorithm
    assert np.abs(k2["theta"] - expected).max() > 1e-6


def test_local_sgd_with_k_steps_sends_k_times_fewer_bytes(cluster):
    runs = {k: local_sgd.run_local_sgd(cluster, k, **SHORT) for k in (1, 4, None)}
    per_sync = compression.ring_allreduce_bytes(4 * runs[1]["theta"].size, 2)
    assert runs[1]["bytes_total"] == 40 * per_sync and runs[1]["syncs"] == 40
    assert runs[1]["bytes_total"] == 4 * runs[4]["bytes_total"]
    assert runs[None]["syncs"] == 1 and runs[None]["bytes_total"] == per_sync  # one-shot average
    assert list(runs[4]["step"]) == [0, 10, 20, 30, 40]
    assert list(runs[4]["bytes"]) == [step // 4 * per_sync for step in runs[4]["step"]]
    with pytest.raises(ValueError, match="sync_every"):
        local_sgd.run_local_sgd(cluster, 0)


def test_k_matters_when_shards_are_not_iid(cluster):
    kw = dict(steps=100, eval_every=50, by_label=True)
    sync, never = (local_sgd.run_local_sgd(cluster, k, **kw) for k in (1, None))
    assert never["loss"][-1] > 2 * sync["loss"][-1]
    assert never["local_loss"][1] > 2 * sync["local_loss"][1]  # each model knows half the digits


def test_topk_with_error_feedback_trains_and_without_it_does_not(cluster):
    assert checks_compression.check_training(compression.topk_allreduce, cluster, steps=120)


def test_fp16_matches_float32_and_torch_fp16_hook(cluster):
    for res in cluster.run(torch_hooks.fp16_against_torch_hook_on_rank):
        scale = np.abs(res["float32"]).max()
        assert np.abs(res["ours"] - res["float32"]).max() <= 2 ** -10 * scale
        assert np.abs(res["ours"] - res["float32"]).max() > 0  # it did round
        assert np.abs(res["ours"] - res["torch"]).max() <= 2 ** -11 * scale


def test_torch_hooks_send_what_their_shapes_say(cluster):
    shapes = [(64, 64), (64,), (10, 64), (10,)]
    assert local_sgd.powersgd_elements(shapes, 1) == 128 + 64 + 74 + 10
    assert local_sgd.powersgd_elements(shapes, 2) == 256 + 64 + 148 + 10
    ours = local_sgd.run_compressed(cluster, "fp16", **SHORT)
    fp16 = torch_hooks.run_torch_ddp(cluster, "fp16", **SHORT)
    assert fp16["bytes_per_step"] == ours["bytes_per_step"] == 4810 * 2
    assert abs(fp16["loss"][-1] - ours["loss"][-1]) < 1e-3 * ours["loss"][-1]
    power = torch_hooks.run_torch_ddp(cluster, "powersgd", 1, **SHORT)
    assert power["hook_elements_per_step"] == 276  # the hook's own count
    assert power["bytes_total"] == 2 * 4810 * 4 + 38 * 276 * 4  # 2 plain steps, then PowerSGD
    assert power["loss"][-1] < 0.5 * power["loss"][0]


def test_the_outer_step_is_torchs_nesterov_sgd_on_the_pseudo_gradient():
    import torch
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(10, generator=g, dtype=torch.float64)
    momentum = torch.zeros(10, dtype=torch.float64)
    param = torch.nn.Parameter(shared.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(3):
        local_mean = shared + torch.randn(10, generator=g, dtype=torch.float64)
        param.grad = param.detach() - local_mean  # Δ: the way back to the shared model
        sgd.step()
        local_sgd.outer_step(shared, local_mean, momentum, lr=0.7, mu=0.9)
        torch.testing.assert_close(shared, param.detach(), rtol=0, atol=1e-15)


def test_fragments_sync_in_turn_and_one_at_a_time():
    assert local_sgd.fragment_sync_steps(10, 5) == [2, 4, 6, 8, 0]
    assert local_sgd.fragment_sync_steps(8, 1) == [0]
    with pytest.raises(ValueError, match="multiple of fragments"):
        local_sgd.fragment_sync_steps(10, 4)


def test_diloco_sends_one_h_th_of_ddp_and_streaming_a_fragment_at_a_time(cluster):
    ddp = local_sgd.run_diloco(cluster, None, steps=40, eval_every=40)
    diloco = local_sgd.run_diloco(cluster, 10, steps=40, eval_every=40)
    streaming = local_sgd.run_diloco(cluster, 10, 5, steps=40, eval_every=40)
    assert ddp["bytes_total"] == 10 * diloco["bytes_total"]  # counted by the communicator
    assert ddp["peak_sync_bytes"] == diloco["peak_sync_bytes"]  # one allreduce of the model
    # a fifth of the parameters per sync (up to how fragments split into ring chunks)
    assert streaming["peak_sync_bytes"] * 5 == pytest.approx(diloco["peak_sync_bytes"],
                                                             rel=0.01)
    assert streaming["bytes_total"] == pytest.approx(diloco["bytes_total"], rel=0.01)
    for run in (ddp, diloco, streaming):
        assert run["loss"][-1] < 0.5 * run["loss"][0], run["name"]
    with pytest.raises(ValueError, match="multiple of fragments"):
        local_sgd.run_diloco(cluster, 10, 3)
