"""Ring attention equals one process (output and every gradient, float64), for the attention alone
and for the whole transformer; zig-zag balances the causal work; bad layouts and a silent rank
end in clear errors. Ranks run as threads of one process (the recording transport), then on the
cluster's real Gloo transport."""

import functools
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from course_lib import context_parallel as cp
from course_lib import costmodel
from course_lib import transformer as tf
from course_lib.comm import CommTimeout, run_ranks
from course_lib.testing.context_parallel import ring_attention_error_on_rank

CLUSTER_SIZE = 2


def random_qkv(T=16, B=2, H=3, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, dtype=torch.float64, generator=gen).requires_grad_()
            for _ in range(3)]


def test_the_merge_of_two_blocks_is_one_softmax_over_both():
    q, k, v = (t.detach() for t in random_qkv(T=12))
    pos = torch.arange(12)
    whole, whole_lse = cp.block_attention(q, k, v, pos, pos)
    a, b = pos[:5], pos[5:]  # keys split in two; early queries see none of the second part
    merged, lse = cp.merge(*cp.block_attention(q, k[..., :5, :], v[..., :5, :], pos, a),
                           *cp.block_attention(q, k[..., 5:, :], v[..., 5:, :], pos, b))
    assert torch.allclose(merged, whole, atol=1e-14, rtol=0)
    assert torch.allclose(lse, whole_lse, atol=1e-14, rtol=0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(merged, ref, atol=1e-14, rtol=0)
    assert torch.allclose(tf.causal_attention(q, k, v), ref, atol=1e-14, rtol=0)


def ring_on_threads(layout, N, T=16, overlap=True):
    """Each thread-rank attends its positions; returns (outputs and grads assembled, stats)."""
    q, k, v = random_qkv(T)
    ref = tf.causal_attention(q, k, v)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    pos = layout(T, N)

    def rank(_, comm):
        mine = [t.detach()[..., pos[comm.rank], :].clone().requires_grad_() for t in (q, k, v)]
        stats = {}
        out = cp.ring_attention(*mine, comm, pos, stats, overlap=overlap)
        out.backward(dout[..., pos[comm.rank], :])
        return [out.detach()] + [t.grad for t in mine], stats

    results, _ = run_ranks(rank, [None] * N, check_sizes=False, timeout=20)
    got = [torch.empty_like(ref) for _ in range(4)]
    for r, (tensors, _) in enumerate(results):
        for g, t in zip(got, tensors, strict=True):
            g[..., pos[r], :] = t
    return got, [ref.detach(), q.grad, k.grad, v.grad], [s for _, s in results]


@pytest.mark.parametrize("N", [2, 4])
@pytest.mark.parametrize("layout", [cp.contiguous_positions, cp.zigzag_positions])
def test_ring_attention_equals_one_process_forward_and_backward(layout, N):
    got, want, stats = ring_on_threads(layout, N)
    for name, g, w in zip(["output", "dq", "dk", "dv"], got, want, strict=True):
        assert (g - w).abs().max() < 1e-12, name
    blocks = [s["blocks"] for s in stats]
    if layout is cp.contiguous_positions:
        assert blocks == list(range(1, N + 1))  # rank r attends to r + 1 blocks: imbalanced
    else:
        assert blocks == [N] * N                 # every rank the same work


def test_the_naive_ring_that_sends_after_computing_gives_the_same_result():
    got, want, _ = ring_on_threads(cp.zigzag_positions, 4, overlap=False)
    for name, g, w in zip(["output", "dq", "dk", "dv"], got, want, strict=True):
        assert (g - w).abs().max() < 1e-12, name


def test_the_ring_model_hides_a_transfer_shorter_than_a_step():
    link = costmodel.Link("test", alpha=1e-4, beta=1e-8)  # 1e5 bytes: 1.1 ms
    hidden = costmodel.ring_attention_time(1e5, 4, 0.008, link)      # steps of 2 ms
    assert hidden == pytest.approx(0.008)
    exposed = costmodel.ring_attention_time(1e5, 4, 0.002, link)     # steps of 0.5 ms
    assert exposed == pytest.approx(3 * 1.1e-3 + 0.5e-3)
    assert costmodel.ring_attention_time(1e5, 4, 0.008, link, overlap=False) == pytest.approx(
        0.008 + 3 * 1.1e-3)


def test_zigzag_gives_every_rank_the_same_causal_work():
    for N in (2, 4, 8):
        work = [sum(cp.causal_pairs(p, k) for k in cp.zigzag_positions(64, N))
                for p in cp.zigzag_positions(64, N)]
        contiguous = [sum(cp.causal_pairs(p, k) for k in cp.contiguous_positions(64, N))
                      for p in cp.contiguous_positions(64, N)]
        assert len(set(work)) == 1 and sum(work) == sum(contiguous) == 64 * 65 // 2
        assert max(contiguous) / np.mean(contiguous) > 1.5 if N >= 4 else True


@pytest.mark.parametrize("N, T", [(2, 20), (3, 18), (3, 30), (4, 40)])
def test_ring_attention_computes_the_counted_pairs_of_chunks_on_every_rank(N, T, monkeypatch):
    """Zig-zag: 2N + 1 pairs of chunks of T/2N on every rank (the last rank, whose two chunks are
    adjacent, too); contiguous: 4(r + 1), its diagonal block whole. Counted at the kernel."""
    chunk = T // (2 * N)
    computed = {}  # thread id -> query-key scores dense_attention computed
    dense = cp.dense_attention

    def counting(q, k, v, q_pos, k_pos):
        ident = threading.get_ident()
        computed[ident] = computed.get(ident, 0) + len(q_pos) * len(k_pos)
        return dense(q, k, v, q_pos, k_pos)

    monkeypatch.setattr(cp, "dense_attention", counting)
    for layout, want in ((cp.zigzag_positions, [2 * N + 1] * N),
                         (cp.contiguous_positions, [4 * (r + 1) for r in range(N)])):
        pos = layout(T, N)

        def rank(_, comm, pos=pos):
            q, k, v = (t.detach()[..., pos[comm.rank], :].clone().requires_grad_()
                       for t in random_qkv(T, B=1, H=1, d=4))
            stats = {}
            cp.ring_attention(q, k, v, comm, pos, stats).sum().backward()
            return threading.get_ident(), stats

        computed.clear()
        results, _ = run_ranks(rank, [None] * N, check_sizes=False, timeout=20)
        assert [computed[ident] // chunk**2 for ident, _ in results] == want, layout.__name__
        assert [s["scores"] // chunk**2 for _, s in results] == want
        assert [s["backward_scores"] // chunk**2 for _, s in results] == want


def test_ring_attention_on_one_rank_is_attention_and_sends_nothing_back_to_itself():
    q, k, v = random_qkv(T=6)
    ref = tf.causal_attention(q, k, v)
    dout = torch.randn_like(ref)
    ref.backward(dout)

    def rank(_, comm):
        mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = cp.ring_attention(*mine, comm, [torch.arange(6)])
        out.backward(dout)
        return [out.detach()] + [t.grad for t in mine]

    (got,), _ = run_ranks(rank, [None], check_sizes=False, timeout=5)
    for name, g, w in zip(["output", "dq", "dk", "dv"], got,
                          [ref.detach(), q.grad, k.grad, v.grad], strict=True):
        assert (g - w).abs().max() < 1e-12, name


def test_the_whole_transformer_on_split_sequences_equals_one_process():
    """Every rank runs the model on its positions (ring attention inside); the loss sums and
    the parameters' gradients summed over the ranks equal one process on the whole sequence."""
    cfg = tf.GPTConfig(context=32, d_model=32, n_heads=4, n_layers=2)
    data = tf.encode(tf.load_text()[:5000])
    x, y = tf.get_batch(data, 2, 32, np.random.default_rng(0))
    one = tf.GPT(cfg).double()
    _, loss = one(x, y)
    loss.backward()
    for layout in (cp.contiguous_positions, cp.zigzag_positions):
        pos = layout(32, 4)
        # made here: the threads share torch's random generator, which seeding uses
        models = [tf.GPT(cfg).double() for _ in range(4)]

        def rank(_, comm, pos=pos, models=models):
            model = models[comm.rank]
            p = pos[comm.rank]
            attention = functools.partial(cp.ring_attention, comm=comm, positions=pos)
            _, part = model(x[:, p], y[:, p], positions=p, attention=attention)
            part.backward()
            return part.item(), [q.grad for q in model.parameters()]

        results, _ = run_ranks(rank, [None] * 4, check_sizes=False, timeout=30)
        assert abs(sum(r[0] for r in results) - loss.item()) < 1e-9
        for i, q in enumerate(one.parameters()):
            summed = sum(r[1][i] for r in results)  # what an allreduce of the gradients gives
            assert (summed - q.grad).abs().max() < 1e-10


def test_bad_layouts_are_refused_before_any_message():
    with pytest.raises(ValueError, match="divisible by 2N = 8"):
        cp.zigzag_positions(20, 4)
    q, k, v = random_qkv(T=8)
    pos = cp.contiguous_positions(8, 2)

    def rank(_, comm):
        mine = [t.detach()[..., : 3 + comm.rank, :] for t in (q, k, v)]  # 3 and 4 positions
        return cp.ring_attention(*mine, comm, pos)

    with pytest.raises(ValueError, match=r"rank \d: q, k, v hold 3, 3, 3 positions"):
        run_ranks(rank, [None] * 2, check_sizes=False, timeout=5)
    with pytest.raises(ValueError, match="as many positions"):
        run_ranks(lambda _, comm: cp.ring_attention(
            *(t.detach()[..., :3 + 2 * comm.rank, :] for t in (q, k, v)), comm,
            [torch.arange(3), torch.arange(3, 8)]), [None] * 2, check_sizes=False, timeout=5)


def test_a_rank_that_stops_sending_ends_the_others_within_the_deadline():
    q, k, v = random_qkv(T=8)
    pos = cp.contiguous_positions(8, 2)

    def rank(_, comm):
        if comm.rank == 1:
            return None  # never sends its keys and values
        return cp.ring_attention(*(t.detach()[..., pos[0], :] for t in (q, k, v)), comm, pos)

    with pytest.raises(CommTimeout, match=r"ring attention, forward step 0: rank 0: .*rank 1"):
        run_ranks(rank, [None] * 2, check_sizes=False, timeout=1)


def test_ring_attention_on_the_cluster_over_gloo(cluster):
    for layout in ("zigzag", "contiguous"):
        rows = cluster.run(ring_attention_error_on_rank, 16, 3, layout)
        assert max(r["error"] for r in rows) < 1e-12
        assert [r["blocks"] for r in rows] == ([2, 2] if layout == "zigzag" else [1, 2])


def test_a_sequence_over_one_process_budget_trains_split_over_the_ranks(cluster):
    from course_lib.runtime.cluster import RemoteError
    from course_lib.testing.context_parallel import long_sequence_training_on_rank
    one = tf.activation_bytes(tf.GPT(tf.GPTConfig(context=256)),
                              torch.from_numpy(tf.encode(tf.load_text()[:300]))[None, :257])
    budget = one // 2
    with pytest.raises(cp.DoesNotFit, match="over the budget"):
        cp.check_budget(one, budget, "one process")
    rows = cluster.run(long_sequence_training_on_rank, 256, budget, 3)
    assert all(r["kept"] <= budget for r in rows) and rows[0]["losses"][-1] < rows[0]["losses"][0]
    with pytest.raises(RemoteError, match=r"rank \d of 2, 256 tokens split keeps .* budget"):
        cluster.run(long_sequence_training_on_rank, 256, rows[0]["kept"] // 2, 1)
