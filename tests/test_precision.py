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
