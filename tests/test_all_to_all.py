"""The all-to-all by pairwise exchange (equal and uneven blocks) against what every rank sent and
against torch.distributed's own; Ulysses attention equal to one process."""

import numpy as np
import pytest
import torch

from course_lib import collectives, costmodel
from course_lib import context_parallel as cp
from course_lib import transformer as tf
from course_lib.comm import run_ranks
from course_lib.testing.context_parallel import all_to_all_against_torch_on_rank

CLUSTER_SIZE = 2


def exchange(counts):
    """Rank r sends counts[r][q] rows to rank q; returns what each rank sent and received."""
    n = len(counts)

    def rank(_, comm):
        r = comm.rank
        send = torch.arange(2 * sum(counts[r]), dtype=torch.float64).reshape(-1, 2) + 1000 * r
        recv = torch.full((sum(c[r] for c in counts), 2), -1.0, dtype=torch.float64)
        uneven = len({c for row in counts for c in row}) > 1
        collectives.all_to_all(send, recv, comm, counts[r] if uneven else None,
                               [c[r] for c in counts] if uneven else None)
        return send, recv

    return run_ranks(rank, [None] * n, check_sizes=True, timeout=10)


@pytest.mark.parametrize("counts", [[[2, 2], [2, 2]], [[1] * 3] * 3, [[3] * 4] * 4,
                                    [[1, 2, 0], [3, 0, 1], [2, 2, 2]], [[0, 5], [1, 0]]])
def test_every_block_lands_where_it_was_sent(counts):
    results, messages = exchange(counts)
    n = len(counts)
    for r in range(n):
        expected = [results[q][0][sum(counts[q][:r]):sum(counts[q][:r + 1])] for q in range(n)]
        assert torch.equal(results[r][1], torch.cat(expected))
    pairwise = [m for m in messages if m.tag == collectives.TAG_A2A]
    assert len(pairwise) == n * (n - 1)  # each ordered pair once, in N - 1 steps


def test_counts_that_disagree_are_refused_before_anything_moves():
    def rank(_, comm):
        send = torch.zeros(3, 2)
        recv = torch.zeros(3, 2)
        return collectives.all_to_all(send, recv, comm, [1, 2], [2, 1])  # both say [1, 2] sent

    with pytest.raises(ValueError, match=r"rank \d: recv_counts \[2, 1\], but the ranks send "
                                         r"it \[\d, \d\] rows"):
        run_ranks(rank, [None] * 2, check_sizes=True, timeout=5)
    with pytest.raises(ValueError, match="must give 2 blocks that add up to send's 3 rows"):
        run_ranks(lambda _, comm: collectives.all_to_all(torch.zeros(3, 2), torch.zeros(3, 2),
                                                         comm), [None] * 2, timeout=5)


def test_the_cost_model_counts_n_minus_one_messages_of_a_block():
    link = costmodel.Link("test", alpha=1e-5, beta=1e-9)
    assert costmodel.all_to_all_time(4e6, 4, link) == pytest.approx(3 * 1e-5 + 0.75 * 4e6 * 1e-9)
    assert costmodel.all_to_all_time(4e6, 1, link) == 0


@pytest.mark.parametrize("N", [2, 4])
def test_ulysses_attention_equals_one_process(N):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64, generator=gen).requires_grad_()
               for _ in range(3))
    ref = tf.causal_attention(q, k, v)
    dout = torch.randn_like(ref)
    ref.backward(dout)

    def rank(_, comm):
        t = slice(comm.rank * 16 // N, (comm.rank + 1) * 16 // N)
        mine = [x.detach()[:, :, t].clone().requires_grad_() for x in (q, k, v)]
        out = cp.ulysses_attention(*mine, comm)
        out.backward(dout[:, :, t])
        return max(float((a - b).abs().max()) for a, b in
                   [(out.detach(), ref.detach()[:, :, t]), (mine[0].grad, q.grad[:, :, t]),
                    (mine[1].grad, k.grad[:, :, t]), (mine[2].grad, v.grad[:, :, t])])

    results, _ = run_ranks(rank, [None] * N, check_sizes=False, timeout=10)
    assert max(results) < 1e-12
    with pytest.raises(ValueError, match="4 heads over 3 ranks"):
        run_ranks(lambda _, comm: cp.ulysses_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4],
                                                       comm), [None] * 3, timeout=5)


def test_all_to_all_against_torch_distributed_on_the_cluster(cluster):
    rows = cluster.run(all_to_all_against_torch_on_rank)
    assert all(r["equal"] for r in rows), rows
    assert np.isfinite([r["ulysses_error"] for r in rows]).all()
    assert max(r["ulysses_error"] for r in rows) < 1e-12


@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_the_naive_all_to_all_through_rank_0_gives_what_the_pairwise_one_gives(N):
    counts = np.random.default_rng(N).integers(0, 4, size=(N, N))  # some blocks empty

    def rank(_, comm):
        r = comm.rank
        x = torch.arange(counts[r].sum() * 2, dtype=torch.float64).reshape(-1, 2) + 100 * r
        out = [collectives.ALL_TO_ALL[a](x, torch.empty(counts[:, r].sum(), 2, dtype=x.dtype), comm,
                                         counts[r].tolist(), counts[:, r].tolist())
               for a in ("pairwise", "naive")]
        return out

    results, _ = run_ranks(rank, [None] * N, check_sizes=False, timeout=10)
    for r, (pairwise, naive) in enumerate(results):
        assert torch.equal(pairwise, naive)
        want = torch.cat([torch.arange(counts[s].sum() * 2, dtype=torch.float64).reshape(-1, 2)
                          [counts[s][:r].sum():counts[s][:r + 1].sum()] + 100 * s
                          for s in range(N)])
        assert torch.equal(naive, want)


def test_the_naive_all_to_all_costs_2n_times_more_on_its_root():
    link = costmodel.Link("test", alpha=1e-5, beta=1e-9)
    assert costmodel.all_to_all_time(4e6, 4, link, "naive") == pytest.approx(
        9 * 1e-5 + 6 * 4e6 * 1e-9)
    with pytest.raises(ValueError, match="unknown all-to-all 'ring'"):
        costmodel.all_to_all_time(4e6, 4, link, "ring")
