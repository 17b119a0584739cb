"""Mixture of experts: the router against a loop written token by token, the layer against the
sum of its experts' outputs, and expert and tensor parallelism against one process (float64:
output, loss, every gradient, the same tokens dropped)."""

import itertools
import math
import time

import pytest
import torch

from course_lib import moe as M
from course_lib import transformer as tf
from course_lib.collectives import allreduce
from course_lib.comm import CommTimeout, run_ranks
from course_lib.moe import MoEConfig
from course_lib.tensor_parallel import TensorParallel
from course_lib.testing import moe as on_ranks
from course_lib.testing.timing import assert_no_hang

D, HIDDEN, TOKENS = 8, 16, 12  # tokens per rank


def loop_route(logits, top_k, capacity_factor, groups=1):
    """The routing, one token and one choice at a time: the reference for :func:`moe.route`."""
    T, E = logits.shape
    probs = torch.softmax(logits, -1)
    chosen = [sorted(range(E), key=lambda e: -probs[t, e])[:top_k] for t in range(T)]
    gates = [[probs[t, e] / (1 if top_k == 1 else sum(probs[t, c] for c in chosen[t]))
              for e in chosen[t]] for t in range(T)]
    size = T // groups
    limit = T * top_k if capacity_factor is None else math.ceil(
        capacity_factor * top_k * size / E)
    kept = [[False] * top_k for _ in range(T)]
    for g in range(groups):
        used = [0] * E
        for j in range(top_k):                        # first choices first
            for t in range(g * size, (g + 1) * size):  # in token order
                e = chosen[t][j]
                if used[e] < limit:
                    used[e] += 1
                    kept[t][j] = True
    return chosen, gates, kept


@pytest.mark.parametrize("top_k, capacity_factor, groups",
                         [(1, None, 1), (1, 1.0, 1), (2, 1.0, 1), (2, 0.5, 3), (1, 1.25, 2)])
def test_the_router_matches_a_loop_token_by_token(top_k, capacity_factor, groups):
    logits = torch.randn(24, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits[:, 0] += 1.0  # a popular expert: some tokens dropped when capacity is short
    r = M.route(logits, top_k, capacity_factor, groups)
    chosen, gates, kept = loop_route(logits, top_k, capacity_factor, groups)
    assert r.expert.tolist() == chosen and r.kept.tolist() == kept
    assert torch.allclose(r.gate, torch.tensor(gates, dtype=torch.float64))
    assert r.load.tolist() == [sum(c.count(e) for c in chosen) for e in range(4)]
    assert r.dropped == sum(row.count(False) for row in kept)
    if capacity_factor == 1.0:
        assert r.dropped > 0


def test_capacity_is_the_ceiling_of_the_decimal_factor_times_the_fair_share():
    """ceil(cf k T / E) in integers, cf = m / 100: no binary rounding of 1.1 * 50 / 5 above 11."""
    assert M.capacity(50, 5, 1, 1.1) == 11 and M.capacity(10, 3, 3, 0.8) == 8
    for m, T, E, k in itertools.product(range(5, 305, 5), range(1, 41), (1, 2, 3, 4, 5, 8),
                                        (1, 2, 3)):
        if k <= E:
            want = -(-m * k * T // (100 * E))  # the ceiling, in integers
            assert M.capacity(T, E, k, m / 100) == want, (T, E, k, m / 100)
    assert M.capacity(7, 4, 2, None) == 14


def test_the_router_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="top_k=5: between 1 and the 4 experts"):
        M.route(torch.zeros(4, 4), top_k=5)
    with pytest.raises(ValueError, match="10 tokens do not split into 4 equal groups"):
        M.route(torch.zeros(10, 4), groups=4)


def test_the_balance_loss_is_one_when_even_and_grows_when_it_collapses():
    T, E = 64, 4
    even = torch.full((T, E), 1 / E)
    assert float(M.balance_loss_sum(even, torch.full((E,), T // E), T, 1)) == pytest.approx(T)
    collapsed = torch.tensor([[1.0, 0, 0, 0]]).repeat(T, 1)
    assert float(M.balance_loss_sum(collapsed, torch.tensor([T, 0, 0, 0]), T, 1)) == \
        pytest.approx(E * T)


def test_the_layer_is_the_gated_sum_of_its_experts():
    torch.manual_seed(0)
    layer = M.MoE(D, 4, top_k=2, capacity_factor=1.0, hidden=HIDDEN).double()
    x = torch.randn(2, 10, D, dtype=torch.float64)
    y = layer(x).reshape(-1, D)
    r, h = layer.routing, x.reshape(-1, D)
    for t in range(h.shape[0]):
        want = sum(r.gate[t, j] * layer.experts[int(r.expert[t, j])](h[t])
                   for j in range(2) if r.kept[t, j])
        assert torch.allclose(y[t], torch.as_tensor(want, dtype=torch.float64) + 0 * y[t])


def reference(N, E, top_k, capacity_factor, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ref = M.MoE(D, E, top_k, capacity_factor, hidden=HIDDEN).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.5 * torch.randn(p.shape, dtype=p.dtype, generator=gen))
    x = torch.randn(N * TOKENS, D, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(N * TOKENS, D, dtype=torch.float64, generator=gen)
    ref.groups = N  # one group per rank: capacity counted as the ranks count it
    y = ref(x)
    ((y * dy).sum() + ref.aux_sum).backward()
    return ref, x, dy, y.detach()


@pytest.mark.parametrize("N, E, top_k, capacity_factor",
                         list(itertools.product([2, 4], [4, 8], [1, 2], [None, 1.0])))
def test_expert_parallelism_equals_one_process(N, E, top_k, capacity_factor):
    ref, x, dy, y = reference(N, E, top_k, capacity_factor)

    def rank(_, comm):
        ep = M.ExpertParallelMoE(ref, comm)
        t = slice(comm.rank * TOKENS, (comm.rank + 1) * TOKENS)
        mine = x.detach()[t].clone().requires_grad_()
        out = ep(mine)
        ((out * dy[t]).sum() + ep.aux_sum).backward()
        router_grad = allreduce(ep.router.weight.grad.clone(), comm, check=False)
        aux = allreduce(ep.aux_sum.detach().reshape(1).clone(), comm, check=False)
        errors = [(out - y[t]).abs().max(), (mine.grad - x.grad[t]).abs().max(),
                  (router_grad - ref.router.weight.grad).abs().max(),
                  (aux - ref.aux_sum).abs().max()]
        for e, mlp in enumerate(ep.experts):  # each expert's gradient, on its rank alone
            for a, b in zip(mlp.parameters(), ref.experts[ep.first + e].parameters(),
                            strict=True):
                errors.append((a.grad - b.grad).abs().max())
        same_dropped = torch.equal(ep.routing.kept, ref.routing.kept[t])
        return float(torch.stack(errors).max().detach()), same_dropped

    results, _ = run_ranks(rank, [None] * N, check_sizes=False, timeout=20)
    assert max(r[0] for r in results) < 1e-10
    assert all(r[1] for r in results)
    if capacity_factor is not None:
        assert ref.routing.dropped > 0  # the case drops tokens, the same on both sides


@pytest.mark.parametrize("N", [2, 4])
def test_tensor_parallel_experts_equal_one_process(N):
    ref, x, dy, y = reference(1, 4, 2, 1.0)
    ref.groups = 1

    def rank(_, comm):
        tp = TensorParallel(comm)
        layer = M.TensorParallelMoE(ref, tp)
        mine = x.detach().clone().requires_grad_()
        out = layer(mine)
        ((out * dy).sum() + layer.aux_sum).backward()
        cut = slice(comm.rank * HIDDEN // N, (comm.rank + 1) * HIDDEN // N)
        errors = [(out - y).abs().max(), (mine.grad - x.grad).abs().max(),
                  (layer.router.weight.grad - ref.router.weight.grad).abs().max()]
        for e, mlp in enumerate(ref.experts):
            errors += [(layer.w1[e].grad - mlp[0].weight.grad[cut]).abs().max(),
                       (layer.w2[e].grad - mlp[2].weight.grad[:, cut]).abs().max(),
                       (layer.b2[e].grad - mlp[2].bias.grad).abs().max()]
        return float(torch.stack(errors).max().detach()), dict(tp.counts)

    results, _ = run_ranks(rank, [None] * N, check_sizes=False, timeout=20)
    assert max(r[0] for r in results) < 1e-10
    assert results[0][1] == {"forward": 1, "backward": 1}


def test_experts_that_do_not_split_are_refused():
    ref = M.MoE(D, 6, hidden=HIDDEN)
    with pytest.raises(ValueError, match="6 experts do not split over 4 ranks"):
        run_ranks(lambda _, comm: M.ExpertParallelMoE(ref, comm), [None] * 4,
                  check_sizes=False, timeout=5)


def test_a_rank_whose_expert_raises_ends_the_others_within_the_deadline():
    ref, x, _, _ = reference(2, 4, 1, None)
    raised = []

    def rank(_, comm):
        ep = M.ExpertParallelMoE(ref, comm)
        if comm.rank == 1:
            def broken(_):
                raise MemoryError("expert 2 ran out of memory")
            ep.experts[0].forward = broken
        try:
            return ep(x.detach()[comm.rank * TOKENS:(comm.rank + 1) * TOKENS])
        except MemoryError as e:  # rank 1's own error; it leaves, as a dead process would
            raised.append(str(e))

    start = time.monotonic()
    with pytest.raises(CommTimeout, match=r"expert parallelism, rank 0, combine: .*rank 1"):
        run_ranks(rank, [None] * 2, check_sizes=False, timeout=1)
    assert raised == ["expert 2 ran out of memory"]
    assert_no_hang(time.monotonic() - start, 1, timed_out=True)


def test_a_rank_that_never_sends_its_counts_is_named():
    ref, x, _, _ = reference(2, 4, 1, None)

    def rank(_, comm):
        if comm.rank == 1:
            return None  # never joins the exchange
        return M.ExpertParallelMoE(ref, comm)(x.detach()[:TOKENS])

    start = time.monotonic()
    with pytest.raises(CommTimeout, match=r"expert parallelism, rank 0, the load's allreduce"):
        run_ranks(rank, [None] * 2, check_sizes=False, timeout=2)
    assert_no_hang(time.monotonic() - start, 2, timed_out=True)


def test_the_transformer_with_experts_splits_over_ranks_as_one_process():
    """The MoE transformer: each rank its own sequences, experts split; summed over the ranks,
    the loss and every gradient equal one process on the whole batch."""
    N = 2
    cfg = MoEConfig(context=16, d_model=16, n_heads=2, experts=4, top_k=2, capacity_factor=1.0)
    one = tf.GPT(cfg).double()
    M.count_groups(one, N)
    idx = torch.randint(0, 256, (2 * N, 17), generator=torch.Generator().manual_seed(0))
    _, loss = one(idx[:, :-1], idx[:, 1:])
    loss.backward()
    grads = dict(one.named_parameters())

    def rank(_, comm):
        model = tf.GPT(cfg).double()
        M.parallelize_experts(model, comm)
        mine = idx[comm.rank * 2:(comm.rank + 1) * 2]
        _, part = model(mine[:, :-1], mine[:, 1:])
        part.backward()
        total = allreduce(part.detach().reshape(1).clone(), comm, check=False)
        errors = [abs(float(total) - loss.item())]
        for name, p in model.named_parameters():
            if ".experts." in name:  # local expert e is global expert first + e
                block, e, rest = name.split(".mlp.experts.")[0], *name.split(
                    ".mlp.experts.")[1].split(".", 1)
                first = model.get_submodule(block + ".mlp").first
                want = grads[f"{block}.mlp.experts.{first + int(e)}.{rest}"].grad
                errors.append(float((p.grad - want).abs().max()))
            else:  # replicated: the gradients of the ranks' sequences add up
                g = allreduce(p.grad.clone(), comm, check=False)
                errors.append(float((g - grads[name].grad).abs().max()))
        return max(errors)

    results, _ = run_ranks(rank, [None] * N, check_sizes=False, timeout=30)
    assert max(results) < 1e-10


def test_expert_parallelism_on_the_cluster_over_gloo(cluster):
    rows = cluster.run(on_ranks.expert_parallel_error_on_rank, 4, 2, 1.0)
    assert max(r["error"] for r in rows) < 1e-10
    assert all(r["same_dropped"] for r in rows) and sum(r["dropped"] for r in rows) > 0
