"""Speculative decoding: the acceptance rule keeps the target's distribution, greedy output is
the target's own (course_lib/speculative.py, notebook 18)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from course_lib import decoding, speculative
from course_lib import transformer as tf

TARGET = tf.GPT(tf.GPTConfig(context=48, d_model=32, n_heads=4), seed=0).double().eval()
DRAFT = tf.GPT(tf.GPTConfig(context=48, d_model=16, n_heads=2, n_layers=1), seed=1).double().eval()
PROMPT = torch.tensor([[84, 104, 101, 32, 108, 105, 115, 116]])


def distributions(seed=0, size=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.softmax(torch.randn(size, generator=g, dtype=torch.float64) * 1.5, 0)
            for _ in range(2))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_step_of_the_rule_is_distributed_as_the_target(seed):
    p, q = distributions(seed)
    tokens = speculative.one_step(p, q, 100_000, seed=seed)
    counts = torch.bincount(tokens, minlength=6).numpy()
    assert chisquare(counts, p.numpy() * 100_000).pvalue > 1e-4
    # the draft's own proposals, unchecked, are not: the test can tell the two apart
    assert chisquare(counts, q.numpy() * 100_000).pvalue < 1e-6


def test_the_rule_written_the_wrong_way_round_is_caught():
    p, q = distributions(0)
    g = torch.Generator().manual_seed(0)
    proposed = torch.multinomial(q, 100_000, replacement=True, generator=g)
    kept = speculative.accept(q.expand(100_000, -1), p.expand(100_000, -1), proposed,
                              torch.rand(100_000, generator=g))  # p and q swapped
    fallback = torch.multinomial(speculative.residual(p, q), 100_000, replacement=True,
                                 generator=g)
    counts = torch.bincount(torch.where(kept, proposed, fallback), minlength=6).numpy()
    assert chisquare(counts, p.numpy() * 100_000).pvalue < 1e-6


def test_accept_and_residual_on_single_tokens():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.25, 0.6, 0.15])
    assert speculative.accept(p, q, 0, 0.99)  # p > q: always kept
    assert speculative.accept(p, q, 1, 0.49) and not speculative.accept(p, q, 1, 0.51)  # 0.3/0.6
    torch.testing.assert_close(speculative.residual(p, q), torch.tensor([0.25, 0.0, 0.05]) / 0.3)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_decoding_is_the_targets_greedy_decoding(k):
    want = decoding.generate(TARGET, PROMPT, 30)
    out, stats = speculative.speculative_generate(TARGET, DRAFT, PROMPT, 30, k=k)
    assert torch.equal(out, want)
    assert stats["rounds"] * 1 + stats["accepted"] == 30  # each round: its kept tokens + 1
    bigram = speculative.NGramDraft(tf.encode(tf.load_text()[:20_000]), 2)
    assert torch.equal(speculative.speculative_generate(TARGET, bigram, PROMPT, 30, k=k)[0], want)
    # the draft as its own target accepts everything: k + 1 tokens a round
    _, stats = speculative.speculative_generate(TARGET, TARGET, PROMPT, 30, k=k)
    assert stats["accepted"] == stats["proposed"] and stats["alpha"] == pytest.approx(1.0)


def test_sampled_speculative_decoding_draws_the_first_token_from_the_target():
    """The token after the prompt, over many seeds: distributed as the target's softmax (at a
    temperature that makes the target and the draft disagree often)."""
    runs, temperature = 2000, 0.1
    first = [int(speculative.speculative_generate(TARGET, DRAFT, PROMPT, 2, k=1,
                                                  temperature=temperature, seed=s)[0][0, -2])
             for s in range(runs)]
    p = torch.softmax(TARGET(PROMPT)[0][0, -1] / temperature, 0).detach().numpy()
    q = torch.softmax(DRAFT(PROMPT)[0][0, -1] / temperature, 0).detach().numpy()
    assert np.minimum(p, q).sum() < 0.9  # the draft is often rejected: the rule is exercised
    likely = p > 5 / runs  # chi-square on the tokens drawn often enough, the rest pooled
    counts = np.bincount(first, minlength=256)
    observed, expected = counts[likely], p[likely] * runs
    if (~likely).any():
        observed = np.append(observed, counts[~likely].sum())
        expected = np.append(expected, p[~likely].sum() * runs)
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-4


def test_expected_tokens_and_speedup():
    assert speculative.expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert speculative.expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert speculative.expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert speculative.expected_speedup(0.5, 2, 0.25, verify=1.5) == pytest.approx(0.875)


def test_an_ngram_draft_gives_log_probabilities_and_forgets():
    draft = speculative.NGramDraft(np.array([1, 2, 1, 2, 1, 3]), n=2, vocab_size=4)
    logits = draft.feed(torch.tensor([[1, 2]]))
    assert logits.shape == (1, 2, 4) and draft.length == 2
    torch.testing.assert_close(logits.exp().sum(-1), torch.ones(1, 2))
    # after 1: seen 2 twice and 3 once, add-one smoothed over 4 tokens: (1, 1, 3, 2) / 7
    torch.testing.assert_close(logits[0, 0].exp(), torch.tensor([1, 1, 3, 2]) / 7.0)
    draft.truncate(1)
    assert draft.length == 1
    with pytest.raises(ValueError, match="n=1"):
        speculative.NGramDraft(np.array([1, 2]), n=1)
