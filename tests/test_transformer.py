"""The small transformer: its attention is torch's, it learns the shipped text, its head is
tied, its activations grow faster than the sequence, and bad sizes are refused."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from course_lib import transformer as tf


@pytest.fixture(scope="module")
def data():
    text = tf.load_text()
    assert len(text) > 100_000 and "list" in text  # the documentation, shipped with Python
    return tf.encode(text)


def test_attention_equals_torch_scaled_dot_product_attention():
    q, k, v = (torch.randn(2, 4, 10, 16, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (tf.causal_attention(q, k, v) - ref).abs().max() < 1e-14


def test_the_model_learns_the_text_and_its_head_is_tied(data):
    model = tf.GPT(tf.GPTConfig())
    assert model.tok.weight.data_ptr() not in {p.data_ptr() for n, p in model.named_parameters()
                                               if n != "tok.weight"}  # no separate head matrix
    losses = tf.train(model, data, steps=150)
    assert losses[0] == pytest.approx(np.log(256), abs=0.3)  # uniform over bytes at first
    assert np.mean(losses[-20:]) < losses[0] - 2.0           # then well below
    assert tf.sample(model, "The ", 20, seed=1) == tf.sample(model, "The ", 20, seed=1)


def test_every_rank_builds_the_same_model_and_the_global_rng_is_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = tf.GPT(tf.GPTConfig(), seed=3), tf.GPT(tf.GPTConfig(), seed=3)
    assert torch.rand(1) == before
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_activations_grow_faster_than_the_sequence(data):
    model = tf.GPT(tf.GPTConfig(context=512))
    small, big = (tf.activation_bytes(model, torch.from_numpy(data[:T + 1])[None])
                  for T in (128, 512))
    assert big / small > 4 * 1.3  # more than linear: the T^2 scores


def test_bad_sizes_are_refused(data):
    with pytest.raises(ValueError, match="multiple of n_heads"):
        tf.GPTConfig(d_model=30, n_heads=4)
    model = tf.GPT(tf.GPTConfig(context=16))
    with pytest.raises(ValueError, match="beyond the model's context 16"):
        model(torch.from_numpy(data[:20])[None])
    assert tf.decode(tf.encode("héllo")) == "héllo"


def test_a_recomputation_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="recompute='some': one of"):
        tf.GPTConfig(recompute="some")
