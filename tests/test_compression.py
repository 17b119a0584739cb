"""Compression: top-k keeps the k largest magnitudes and loses nothing with error feedback; its
exchange averages every rank's top-k; the bytes counted are the bytes handed to the collectives
and the bytes the kernel saw cross loopback. fp16 against torch's hook: tests/test_local_sgd.py.
"""

import numpy as np
import pytest
import torch

from course_lib import compression
from course_lib.checks import lab08_local_sgd_and_compression as checks_compression
from course_lib.runtime.cluster import RemoteError

CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py
CLUSTER_BACKEND = "gloo"


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    g = torch.Generator().manual_seed(0)
    grad, residual = torch.randn(500, generator=g), torch.randn(500, generator=g)
    values, indices, new_residual = compression.topk_compress(grad, residual, 20)
    corrected = grad + residual
    expected = np.argsort(-corrected.abs().numpy())[:20]
    assert sorted(indices.tolist()) == sorted(expected.tolist())
    assert torch.equal(values, corrected[indices])
    sent = torch.zeros(500)
    sent[indices] = values
    assert torch.equal(new_residual + sent, grad + residual)  # exactly: nothing lost
    assert int((new_residual != 0).sum()) == 480


def test_topk_edge_cases():
    x = torch.tensor([3.0, -1.0, 2.0])
    values, indices, residual = compression.topk_compress(x, None, 5)  # k > n: all of it
    assert sorted(indices.tolist()) == [0, 1, 2] and not residual.any()
    values, indices, _ = compression.topk_compress(-x, None, 1)
    assert indices.tolist() == [0] and values.tolist() == [-3.0]  # magnitude, not sign
    for bad_k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="k must be"):
            compression.topk_compress(x, None, bad_k)
    with pytest.raises(ValueError, match="1-D"):
        compression.topk_compress(x.reshape(3, 1), None, 1)
    with pytest.raises(ValueError, match="residual must match"):
        compression.topk_compress(x, torch.zeros(4), 1)


def _simulate(error_feedback, steps=400, n=200, k=4):
    """Sum over steps of what top-k sends vs the sum of the gradients (one rank, no network)."""
    g = torch.Generator().manual_seed(1)
    mean = torch.linspace(0.1, 1.0, n)  # every coordinate matters, most are small
    residual, sent_total, grad_total = None, torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        grad = mean + 0.3 * torch.randn(n, generator=g)
        values, indices, new_residual = compression.topk_compress(grad, residual, k)
        sent_total[indices] += values
        grad_total += grad
        residual = new_residual if error_feedback else None
    return sent_total, grad_total, residual


def test_error_feedback_sends_the_sum_of_the_gradients_eventually():
    errors = {}
    for steps in (400, 1600):
        sent, total, residual = _simulate(error_feedback=True, steps=steps)
        assert torch.allclose(sent + residual, total, rtol=1e-4, atol=1e-2)  # the invariant
        errors[steps] = float((sent - total).norm() / total.norm())
    assert errors[1600] < 0.4 * errors[400] and errors[1600] < 0.03  # the residual is bounded
    sent_off, total_off, _ = _simulate(error_feedback=False, steps=1600)
    assert (sent_off - total_off).norm() / total_off.norm() > 0.5  # small coordinates never go
    assert sent_off[:20].sum() < 0.01 * total_off[:20].sum()  # the smallest: almost never


def test_bytes_formulas():
    assert compression.ring_allreduce_bytes(4000, 2) == 4000
    assert compression.ring_allreduce_bytes(4000, 4) == 6000
    assert compression.allgather_bytes(80, 4) == 240
    top = compression.TopK(0.01)
    assert top.k_for(4810) == 49 and top.k_for(10) == 1
    assert top.step_bytes(4810, 4, 2) == 49 * 8
    assert compression.FP16().step_bytes(1000, 4, 2) == 2000
    with pytest.raises(ValueError, match="ratio"):
        compression.TopK(0.0)
    with pytest.raises(ValueError, match="name \\(the compression\\) must be one of"):
        compression.make_compressor("int8")


def test_bytes_counted_match_what_is_handed_to_the_collectives(cluster):
    results = cluster.run(checks_compression.count_scheme_bytes, 1000)
    for counted, calls in results:
        for name, steps in counted.items():
            ops = calls[name]
            if name == "topk":
                assert {op for op, _ in ops} == {"all_gather"}
                wire = sum(compression.allgather_bytes(b, 2) for _, b in ops)
            else:
                assert {op for op, _ in ops} == {"all_reduce"}
                wire = sum(compression.ring_allreduce_bytes(b, 2) for _, b in ops)
            assert steps == wire, name
    assert results[0][0] == {"none": 3 * 4000, "fp16": 3 * 2000, "topk": 3 * 10 * 8}


def test_topk_allreduce_is_the_average_of_every_ranks_topk(cluster):
    results = cluster.run(checks_compression.exchange_on_rank, None, 300, 7, 0, True, False)
    inputs = [checks_compression.exchange_inputs(300, 0, r, True, False) for r in range(2)]
    dense = torch.zeros(300)
    for r, (grad, residual) in enumerate(inputs):
        values, indices, new_residual = compression.topk_compress(grad, residual, 7)
        dense[indices] += values
        assert np.array_equal(results[r]["residual"], new_residual.numpy())
    for res in results:
        assert np.allclose(res["mean"], dense.numpy() / 2, rtol=1e-6, atol=1e-7)
    assert np.array_equal(results[0]["mean"], results[1]["mean"])


def test_ranks_that_disagree_on_the_gradient_get_a_clear_error(cluster):
    with pytest.raises(RemoteError, match=r"ranks disagree on the gradient: rank 0: topk n=100"):
        cluster.run(checks_compression.disagree_on_rank, 100)


def test_wire_bytes_measured_on_loopback(cluster):
    counted, loopback, idle = compression.measure_wire_bytes(cluster, "fp16", 500_000, repeats=3)
    assert counted == 3 * 2 * 1_000_000
    if loopback is not None:  # the kernel saw at least that much cross loopback
        assert loopback >= 0.99 * counted and idle >= 0


def test_an_exchange_pays_the_emulated_link_and_counts_its_bytes(cluster):
    from course_lib.runtime import netem
    n, link = 2**16, cluster.set_link("200Mbit/s,1ms")
    try:
        timed = {name: cluster.run(compression.exchange_time_on_rank, name, n, 0.01, 1)
                 for name in ("none", "fp16", "topk")}
    finally:
        cluster.set_link(None)
    for results in timed.values():
        assert results[0] == results[1]  # the slowest rank's time, on every rank
    (none, sent_none), (fp16, sent_fp16), (_, sent_topk) = (timed[k][0] for k in timed)
    assert (sent_none, sent_fp16, sent_topk) == (4 * n, 2 * n, 655 * 8)  # N = 2: (N-1)/N * 2
    # the emulation never delivers early: at least the model's time for the float32 ring
    assert none >= netem.predict_allreduce("ring", 4 * n, 2, link) - 3e-3
    assert fp16 >= netem.predict_allreduce("ring", 2 * n, 2, link) - 3e-3
