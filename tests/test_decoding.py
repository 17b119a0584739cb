"""The KV cache against recomputing the whole prefix, grouped-query attention, the timings' shapes
(course_lib/decoding.py, notebook 18)."""

import pytest
import torch
import torch.nn.functional as F

from course_lib import decoding
from course_lib import transformer as tf

CFG = tf.GPTConfig(context=48, d_model=32, n_heads=4)


def model(seed=0):
    return tf.GPT(CFG, seed=seed).double().eval()


def prompt(batch=3, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g)


def test_cached_generation_is_the_whole_prefix_recomputed():
    m, p = model(), prompt()
    assert torch.equal(decoding.generate(m, p, 30), decoding.generate(m, p, 30, cache=False))
    sampled = decoding.generate(m, p, 30, temperature=1.0, seed=3)
    assert torch.equal(sampled, decoding.generate(m, p, 30, cache=False, temperature=1.0, seed=3))


def test_feeding_in_pieces_gives_the_full_forwards_logits():
    m, p = model(), prompt(length=20)
    decoder = decoding.Decoder(m, batch=3)
    pieces = [decoder.feed(p[:, :9]), decoder.feed(p[:, 9:10]), decoder.feed(p[:, 10:])]
    torch.testing.assert_close(torch.cat(pieces, 1), m(p)[0], rtol=0, atol=1e-12)
    assert decoder.length == 20
    assert decoder.cache.used_bytes == 20 * 3 * decoding.kv_bytes_per_token(2, 4, 8, 8)


def test_cached_attention_is_causal_attention_and_sdpas_grouped_query_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(decoding.cached_attention(q, k, v, 0), tf.causal_attention(q, k, v))
    keys, values = k[:, :2], v[:, :2]  # 2 key/value heads for 4 query heads
    want = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(decoding.cached_attention(q, keys, values, 0), want)
    # the last 2 queries over all 6 keys: rows 4 and 5 of the whole
    torch.testing.assert_close(decoding.cached_attention(q[:, :, 4:], k, v, 4),
                               tf.causal_attention(q, k, v)[:, :, 4:])
    for args in ((q, k, v, 0), (q[:, :, 4:], k, v, 4), (q[:, :, 3:], keys, values, 3)):
        torch.testing.assert_close(decoding.sdpa_cached_attention(*args),
                                   decoding.cached_attention(*args))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_a_grouped_model_caches_one_head_per_group_and_decodes_as_its_full_forward(kv_heads):
    g = decoding.grouped(model(), kv_heads)
    p = prompt(batch=2)
    assert torch.equal(decoding.generate(g, p, 20, kv_heads=kv_heads),
                       decoding.generate(g, p, 20, cache=False))
    decoder = decoding.Decoder(g, batch=2, kv_heads=kv_heads)
    decoder.feed(p)
    assert decoder.cache.used_bytes == 2 * 7 * decoding.kv_bytes_per_token(2, kv_heads, 8, 8)
    weight = g.blocks[0].attn.qkv.weight
    k_heads = weight[32:64].view(4, 8, 32)
    group = 4 // kv_heads
    for h in range(4):  # every query head of a group sees the same key head
        torch.testing.assert_close(k_heads[h], k_heads[h - h % group])


def test_grouping_every_head_alone_changes_nothing_and_bad_groups_are_refused():
    m = model()
    grouped = decoding.grouped(m, 4).state_dict().values()
    for (name, a), b in zip(m.state_dict().items(), grouped, strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="do not split"):
        decoding.grouped(m, 3)
    with pytest.raises(ValueError, match="do not split"):
        decoding.Decoder(m, kv_heads=3)


def test_the_cache_refuses_what_does_not_fit_and_truncates():
    m = model()
    decoder = decoding.Decoder(m, batch=1, capacity=10)
    decoder.feed(prompt(batch=1, length=8))
    with pytest.raises(ValueError, match="holds 10 positions: 8 stored, 3 more"):
        decoder.feed(prompt(batch=1, length=3))
    decoder.truncate(5)
    assert decoder.length == 5
    with pytest.raises(ValueError, match="truncate to 6"):
        decoder.truncate(6)
    with pytest.raises(ValueError, match="exceed the model's context"):
        decoding.generate(m, prompt(length=40), 10)


def test_bytes_per_token_and_intensity():
    assert decoding.kv_bytes_per_token(40, 40, 128) == 800 * 1024  # OPT-13B, Kwon et al.
    assert decoding.kv_bytes_per_token(80, 8, 128, itemsize=1) == 163_840  # Llama 3 70B, int8
    assert decoding.decode_intensity(10**6, 8, itemsize=2) == 8.0  # 2 B / itemsize
    assert decoding.decode_intensity(10**6, 8, 2, cache_bytes=2 * 10**6) == pytest.approx(4.0)


def test_the_timings_have_one_entry_per_size():
    m = tf.GPT(CFG).eval()
    assert len(decoding.time_decode(m, [1, 4], context=4, repeats=2)) == 2
    assert len(decoding.time_prefill(m, [2, 8], repeats=2)) == 2
    report = decoding.decode_report("cpu", small=True, batches=(1, 2))
    assert report["batches"] == [1, 2] and len(report["tokens_per_s"]) == 2
    # the roof for batch b is b times batch 1's
    assert report["roof_tokens_per_s"][1] == pytest.approx(2 * report["roof_tokens_per_s"][0])
