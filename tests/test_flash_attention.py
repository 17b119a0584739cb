"""FlashAttention, tile by tile, against torch's scaled_dot_product_attention: outputs, the saved
log-denominators and the gradients of q, k and v, causal and not, lengths that no tile divides;
its saved bytes grow as T where the written-out attention's grow as T^2."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.flash_attention import causal_flash, flash_attention
from course_lib.transformer import GPT, GPTConfig, activation_bytes_of, causal_attention


def reference_lse(q, k, causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1),
                          float("-inf"))
    return torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("T, S, block", [(37, 37, 8), (64, 64, 64), (50, 50, 16), (20, 33, 7),
                                         (33, 20, 7), (5, 5, 64)])
def test_outputs_lse_and_gradients_equal_torchs_attention(dtype, tol, causal, T, S, block):
    gen = torch.Generator().manual_seed(T * S + block)
    q, k = (torch.randn(2, 3, n, 16, dtype=dtype, generator=gen, requires_grad=True)
            for n in (T, S))
    v = torch.randn(2, 3, S, 12, dtype=dtype, generator=gen, requires_grad=True)
    out, lse = flash_attention(q, k, v, causal, block)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert (out - ref).abs().max() <= tol
    assert (lse - reference_lse(q, k, causal)).abs().max() <= tol
    dout = torch.randn(ref.shape, dtype=dtype, generator=gen)
    ours = torch.autograd.grad(out, (q, k, v), dout)
    torchs = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", ours, torchs, strict=True):
        assert (a - b).abs().max() <= tol, name


def saved_bytes(attention, T):
    q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(3))
    return activation_bytes_of(lambda: attention(q, k, v), nn.Module())


def test_saved_bytes_grow_as_T_where_the_written_out_attentions_grow_as_T_squared():
    for T in (128, 256, 512):  # q, k, v, the output and one log-denominator per query
        assert saved_bytes(causal_flash, T) == 4 * (4 * 2 * T * 16 + 2 * T)
    written = [saved_bytes(causal_attention, T) for T in (128, 256, 512)]
    # the T x T tensors: doubling T multiplies the bytes by nearly 4 (by 2 for flash)
    assert all(b > 3.4 * a for a, b in zip(written, written[1:], strict=False)), written


def test_the_transformer_trains_the_same_with_it():
    cfg = GPTConfig(context=40, d_model=16, n_heads=2)
    idx = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(0))
    grads = []
    for attention in (causal_attention, causal_flash):
        model = GPT(cfg).double()
        _, loss = model(idx[:, :-1], idx[:, 1:], attention=attention)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-12)
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_bad_arguments_are_named():
    q = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="the same head size"):
        flash_attention(q, torch.randn(1, 4, 6), torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match="block must be a positive integer"):
        flash_attention(q, q, q, block=0)


INTERPRETED = """
import torch, torch.nn.functional as F
from course_lib.flash_attention import triton_flash_forward
from tests.test_flash_attention import reference_lse
gen = torch.Generator().manual_seed(0)
for T, block in [(40, 16), (64, 32), (5, 16)]:  # tiles that do not divide T too
    q, k, v = (torch.randn(2, 2, T, 16, generator=gen) for _ in range(3))
    out, lse = triton_flash_forward(q, k, v, block=block)
    print(T, block, float((out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs()
                          .max()), float((lse - reference_lse(q, k, causal=True)).abs().max()))
"""


def test_the_triton_kernel_equals_torchs_attention_on_cpu_in_the_interpreter():
    """The forward as a Triton kernel, run by Triton's interpreter on CPU tensors at a toy size
    (on a GPU it is a kernel: tests/test_gpu.py times it beside torch's). The interpreter is set
    up as Triton is imported: a Python of its own, started with TRITON_INTERPRET=1."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("triton", reason="Triton is optional: pip install -e '.[triton]'")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=root, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 3 and all(float(e) < 1e-5 for row in rows for e in row[2:]), done.stdout
    from course_lib.flash_attention import triton_flash_forward
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):  # this Python has no interpreter
        triton_flash_forward(*(torch.randn(1, 16, 16) for _ in range(3)))
