"""Megatron tensor parallelism for a whole transformer block, and sequence parallelism on top:
output, input gradient and every parameter gradient equal one process (float64); the same
bytes as tensor parallelism's allreduces; fewer activation bytes kept per rank."""

import pytest
import torch

from course_lib import sequence_parallel as sp
from course_lib import transformer as tf
from course_lib.comm import run_ranks
from course_lib.tensor_parallel import TensorParallel
from course_lib.testing.context_parallel import block_split_on_rank

B, T, D = 2, 16, 32
CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    block = tf.Block(tf.GPTConfig(d_model=D, n_heads=4)).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)  # LayerNorms and biases far from 1 and 0
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(B, T, D, dtype=torch.float64)
    out = block(x)
    out.backward(dout)
    return block, x, dout, out.detach()


def run_block(reference, N, sequence_parallel):
    block, x, dout, _ = reference

    def rank(_, comm):
        tp = TensorParallel(comm)
        part = sp.ParallelBlock(block, tp, sequence_parallel)
        tokens = slice(comm.rank * T // N, (comm.rank + 1) * T // N) if sequence_parallel \
            else slice(None)
        mine = x.detach()[:, tokens].clone().requires_grad_()
        outputs = []  # the forward measured is the one that backward then runs through
        kept = tf.activation_bytes_of(lambda: outputs.append(part(mine)), part)
        out = outputs[0]
        out.backward(dout[:, tokens])
        sp.allreduce_replicated_grads([part])
        grads = {name: dict(part.named_parameters())[sp.SHARD_NAMES[name]].grad
                 for name, _ in block.named_parameters()}
        return dict(out=out.detach(), dx=mine.grad, grads=grads, counts=dict(tp.counts),
                    tokens=tokens, part=part, kept=kept)

    return run_ranks(rank, [None] * N, check_sizes=False, timeout=20)


@pytest.mark.parametrize("N", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_split_block_equals_one_process(reference, N, sequence_parallel):
    block, x, _, out = reference
    results, _ = run_block(reference, N, sequence_parallel)
    for r in results:
        assert (r["out"] - out[:, r["tokens"]]).abs().max() < 1e-12
        assert (r["dx"] - x.grad[:, r["tokens"]]).abs().max() < 1e-12
        for name, p in block.named_parameters():
            assert (r["grads"][name] - sp.shard_of(r["part"], name, p.grad)).abs().max() < 1e-12
    # two allreduces each way (TP), or their all-gather and reduce-scatter halves (SP); SP's
    # backward gathers the two column-parallel inputs again (not kept) and allreduces each
    # replicated tensor's gradient (two LayerNorms' weight and bias, two biases)
    assert results[0]["counts"] == ({"forward": 4, "backward": 4 + 2 + 6} if sequence_parallel
                                    else {"forward": 2, "backward": 2})
    assert [r["kept"] for r in results] == [sp.activation_bytes_formula(
        B, T, D, 4, N, "tp+sp" if sequence_parallel else "tp")] * N  # tensor by tensor


def test_sequence_parallelism_sends_the_same_bytes_and_keeps_fewer(reference):
    """The all-gather and reduce-scatter move what the allreduce moved, plus backward's
    re-gathers of what it did not keep."""
    N = 4
    _, tp_messages = run_block(reference, N, False)
    sp_results, sp_messages = run_block(reference, N, True)
    tp_results, _ = run_block(reference, N, False)
    replicated = 6 * 2 * (N - 1) * N  # the replicated gradients' allreduces: tiny messages
    regather = 2 * (N - 1) * N        # backward's two all-gathers of the kept inputs
    collectives = sorted(m.nbytes for m in sp_messages)[replicated:]
    assert sum(collectives) == sum(m.nbytes for m in tp_messages) + regather * B * T * D * 8 // N
    # the LayerNorm and residual regions hold T/N tokens: fewer activation bytes per rank
    assert max(r["kept"] for r in sp_results) < 0.8 * min(r["kept"] for r in tp_results)


def test_heads_that_do_not_split_are_refused(reference):
    block = reference[0]
    with pytest.raises(ValueError, match="4 heads do not split over 3 ranks"):
        run_ranks(lambda _, comm: sp.ParallelBlock(block, TensorParallel(comm)), [None] * 3,
                  check_sizes=False, timeout=5)



def test_every_split_of_the_block_on_the_cluster_over_gloo(cluster):
    """TP, TP + SP, ring attention and Ulysses: one process's output and gradients, and the
    bytes their formula counts; ring attention keeps the fewest, no T x T tensor."""
    kept = {}
    for split in sp.SPLITS:
        rows = cluster.run(block_split_on_rank, split)
        assert max(r["error"] for r in rows) < 1e-12, split
        assert [r["kept"] for r in rows] == [sp.activation_bytes_formula(
            2, 64, 32, 4, 2, split)] * 2, split
        kept[split] = rows[0]["kept"]
    assert kept["ring"] < kept["ulysses"] == kept["tp+sp"] < kept["tp"] < rows[0]["one_process"]


def test_with_flash_attention_every_split_keeps_no_T_squared_tensor(cluster):
    """TP, TP + SP and Ulysses computing their heads with FlashAttention: still one process's
    numbers, and the bytes kept as the formula counts them, growing as T like the ring's."""
    kept = {}
    for split in sp.SPLITS:
        for length, heads in ((64, 4), (128, 4), (64, 2)):  # 2 heads: one a rank with TP
            rows = cluster.run(block_split_on_rank, split, length=length, heads=heads,
                               flash=True)
            assert max(r["error"] for r in rows) < 1e-12, split
            assert [r["kept"] for r in rows] == [sp.activation_bytes_formula(
                2, length, 32, heads, 2, split, flash=True)] * 2, (split, length, heads)
            kept[split, length, heads] = rows[0]["kept"]
        assert kept[split, 128, 4] == 2 * kept[split, 64, 4], split


def test_the_memory_formula_names_its_splits():
    with pytest.raises(ValueError, match="one of"):
        sp.activation_bytes_formula(1, 8, 4, 1, 2, "zigzag")
    # ring attention's bytes grow as T, the head-split ones' faster
    ring = [sp.activation_bytes_formula(1, t, 32, 4, 4, "ring") for t in (256, 512)]
    ulysses = [sp.activation_bytes_formula(1, t, 32, 4, 4, "ulysses") for t in (256, 512)]
    assert ring[1] == 2 * ring[0] and ulysses[1] > 3 * ulysses[0]


@pytest.mark.parametrize("N", [2, 3, 4])
def test_the_collective_matmul_equals_the_layer_after_its_all_gather(N):
    from course_lib.runtime.timeline import Timeline
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4 * N, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(8, 6, generator=g, dtype=torch.float64)
    bias = torch.randn(8, generator=g, dtype=torch.float64)

    def rank(_, comm):
        tp, tl = TensorParallel(comm), Timeline(comm.rank)
        mine = x[:, 4 * comm.rank:4 * (comm.rank + 1)]
        return sp.collective_matmul(mine, weight, bias, tp, timeline=tl), tp.counts, tl
    results, messages = run_ranks(rank, [None] * N, check_sizes=False, timeout=20)
    for out, counts, tl in results:
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=0,
                                   atol=1e-12)
        assert counts == {"forward": 1, "backward": 0}
        cats = [e.cat for e in tl.events]
        assert cats.count("compute") == N and cats.count("wait") == N - 1
    assert len(messages) == N * (N - 1)  # the ring all-gather's: N - 1 blocks per rank


def test_the_collective_linear_equals_the_gathered_one_on_the_cluster(cluster):
    from course_lib.testing.tensor_parallel import collective_matmul_matches
    for report in cluster.run(collective_matmul_matches):
        assert report["output"] < 1e-12 and report["grads"] < 1e-12, report
        assert report["counts"][0] == report["counts"][1] == {"forward": 1, "backward": 2}


def test_the_hidden_fraction_is_measured_beside_its_model(cluster):
    from course_lib.testing import tensor_parallel as T
    reports = cluster.run(T.collective_matmul_times, "100Mbit/s,100us", tokens=64, d_model=32,
                          hidden=64, repeats=1)
    result = T.hidden_fraction(reports)
    block = 1 * 32 * 32 * 4  # 32 tokens per rank, 32 features, float32
    assert result["message"] == pytest.approx(100e-6 + block / 12.5e6)
    assert result["model"] == pytest.approx(min(1, result["product"] / result["message"]))
    # holds under load: the emulated link sleeps until a block's modelled end, never less
    assert result["gather"] >= result["message"] and result["measured"] <= 1


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_at_world_size_1_nothing_is_sent_and_nothing_counted(reference, sequence_parallel):
    block, x, _, out = reference
    (r,), _ = run_block(reference, 1, sequence_parallel)
    assert (r["out"] - out).abs().max() < 1e-12 and (r["dx"] - x.grad).abs().max() < 1e-12
    assert r["counts"] == {"forward": 0, "backward": 0}
