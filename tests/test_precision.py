"""Mixed precision: the loss scaler against torch's own update rule, fp16 steps skipped on an
overflow, 16 bytes per parameter held, and bf16 and fp16 training that follows float32."""

import numpy as np
import pytest
import torch

from course_lib import precision as P


def test_the_scaler_follows_torchs_update_rule():
    ours = P.LossScaler(init_scale=1024.0, growth_interval=3)
    scale, tracker = torch.tensor([1024.0]), torch.tensor([0], dtype=torch.int32)
    for found in np.random.default_rng(0).random(40) < 0.3:
        ours.update(bool(found))
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found)]), 2.0, 0.5, 3)
        assert ours.scale == float(scale) and ours.good_steps == int(tracker)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_training_follows_float32_with_16_bytes_per_parameter(dtype):
    reference = P.train_transformer(torch.float32)["losses"]
    run = P.train_transformer(dtype)
    losses = run["losses"]
    assert abs(np.mean(losses[-5:]) - np.mean(reference[-5:])) < 0.1
    assert np.mean(losses[-5:]) < losses[0] - 1.5  # it learned
    assert run["bytes"] == {"parameters": 2, "gradients": 2, "master weights": 4, "optimizer": 8}


def test_an_fp16_overflow_skips_the_step_and_halves_the_scale():
    scaler = P.LossScaler(init_scale=2.0**20)  # far too large: the first gradients overflow
    taken = P.train_transformer(torch.float16, steps=16, scaler=scaler)["taken"]
    skipped = taken.index(True)
    assert skipped >= 2 and not any(taken[:skipped]) and all(taken[skipped:])
    assert scaler.scale == 2.0**20 / 2**skipped and scaler.skipped == skipped


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        P.MixedPrecision(torch.nn.Linear(2, 2), torch.optim.Adam, dtype=torch.float64)


# ---------------------------------------------------------------- FP8
def test_fp8_casts_scale_the_largest_magnitude_onto_the_formats_largest():
    x = torch.tensor([[-3.0, 0.5, 1.0, 2.0]])
    q, scale = P.to_fp8(x, "e4m3")
    assert q.dtype == torch.float8_e4m3fn and scale.item() == pytest.approx(3.0 / 448)
    assert q.float().abs().max().item() == 448.0
    assert torch.equal(P.from_fp8(q, scale), (x / scale).to(torch.float8_e4m3fn).float()
                       * scale)
    assert P.fp8_max("e5m2") == 57344.0
    with pytest.raises(ValueError, match="fmt 'e3m4'"):
        P.to_fp8(x, "e3m4")
    # delayed scaling: an amax from the past saturates what exceeds it
    q, scale = P.to_fp8(x, amax=1.0)
    assert P.from_fp8(q, scale).tolist() == [[-1.0, 0.5, 1.0, 1.0]]
    # per block: each block's own scale; an all-zero block stays zero
    y = torch.cat([torch.zeros(2, 4), torch.arange(8.0).reshape(2, 4) + 1], dim=1)
    q, scale = P.to_fp8(y, block=4)
    assert scale.shape == (2, 2) and torch.equal(P.from_fp8(q, scale, 4)[:, :4],
                                                 torch.zeros(2, 4))
    assert torch.allclose(P.from_fp8(q, scale, 4), y, rtol=1 / 16)
    with pytest.raises(ValueError, match="not a multiple of block 3"):
        P.to_fp8(y, block=3)


def test_fp8_matmul_is_torchs_scaled_mm_bitwise():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 128, generator=g), torch.randn(48, 128, generator=g)
    (qx, sx), (qw, sw) = P.to_fp8(x), P.to_fp8(w)
    ours = P.fp8_matmul(x, w)
    assert torch.equal(ours, torch._scaled_mm(qx, qw.T, scale_a=sx, scale_b=sw,
                                              out_dtype=torch.float32))
    assert 0.005 < P.relative_error(ours, x @ w.T) < 1 / 16
    # a scale per block of the whole row is torch's row-wise scaling
    (qx, sx), (qw, sw) = P.to_fp8(x, block=128), P.to_fp8(w, block=128)
    rowwise = torch._scaled_mm(qx, qw.T, scale_a=sx, scale_b=sw.T, out_dtype=torch.float32)
    assert torch.allclose(P.fp8_matmul(x, w, 128), rowwise, rtol=1e-6, atol=1e-5)


def test_fp8_linear_rounds_its_operands_and_gradients_and_trains():
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(4, 5, 64, generator=g, requires_grad=True)
    reference = layer(x)
    grad_out = torch.randn(4, 5, 32, generator=g)
    reference.backward(grad_out)
    want_w, want_x = layer.weight.grad.clone(), x.grad.clone()
    layer.weight.grad, x.grad = None, None
    P.fp8_linears(torch.nn.Sequential(layer))
    assert type(layer) is P.FP8Linear
    y = layer(x)
    y.backward(grad_out)
    e4m3 = P.from_fp8(*P.to_fp8(x.detach()))
    w4 = P.from_fp8(*P.to_fp8(layer.weight.detach()))
    assert torch.equal(y.detach(), e4m3 @ w4.T + layer.bias.detach())
    g5 = P.from_fp8(*P.to_fp8(grad_out, "e5m2"))
    assert torch.equal(layer.weight.grad, g5.flatten(0, 1).T @ e4m3.flatten(0, 1))
    assert torch.equal(x.grad, g5 @ w4)
    assert P.relative_error(layer.weight.grad, want_w) < 0.15
    assert P.relative_error(x.grad, want_x) < 0.15
    run = P.train_transformer(torch.float32, steps=12, fp8=True)
    assert run["losses"][-1] < run["losses"][0] - 0.5


def test_outliers_and_delayed_scaling_hurt_where_the_lesson_says():
    errors = P.outlier_errors([1, 1e5])
    per_tensor, per_block = errors["e4m3, a scale per tensor"], errors["e4m3, a scale per 128"]
    assert per_tensor[0] < 1 / 16 and per_tensor[1] > 5 * per_tensor[0]
    assert per_block[1] < 3 * per_block[0]
    assert errors["bf16"][1] < 1 / 256
    scaling = P.scaling_errors(steps=24, jump_at=20)
    assert max(scaling["current"]) < 1 / 16
    assert scaling["saturated"][20] > 0.5 and scaling["delayed"][20] > 0.5
    assert max(scaling["delayed"][21:]) < 1 / 16


def test_fp8_all_gather_halves_the_bytes_of_bf16(cluster):
    from course_lib.testing.precision import all_gather_fp8_on_rank
    rows = cluster.run(all_gather_fp8_on_rank, 1000, None, 1)
    for r in rows:
        assert r["bf16"]["bytes"] == 2 * 1000 * (cluster.n - 1)
        assert r["fp8"]["bytes"] == (1000 + 4) * (cluster.n - 1)
        assert r["fp8"]["error"] < 1 / 16 and r["bf16"]["error"] < 1 / 256
