"""fully_shard per module with an ordinary optimizer: the transformer trained on 2 and 4 ranks
(threads, the recording transport) equals one process; the bytes each rank sends are the
planner's; replicated norms and uneven rows padded as FSDP2 pads; beside torch's fully_shard
(a cluster), in float32 and bf16; prefetch; and the cases of CS336's FSDP tests through a thin
adapter (correctness in float32 and fp16, gradient sync)."""

import numpy as np
import pytest
import torch
from torch import nn

from course_lib import dry_run, fsdp, planner
from course_lib import transformer as tf
from course_lib.comm.recording import run_ranks
from course_lib.testing import fsdp as K

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py

CFG = tf.GPTConfig(context=16, d_model=32, n_heads=4, n_layers=2)
B, T, STEPS = 8, 16, 3


def batches():
    data, rng = tf.encode(tf.load_text()[:20_000]), np.random.default_rng(0)
    return [tf.get_batch(data, B, T, rng) for _ in range(STEPS)]


def one_process(make, batches, loss_of):
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def gpt_loss(model, x, y):
    return model(x, y)[1] / y.numel()


def sharded_run(_, comm, make, wrap, batches, loss_of):
    """On one rank: ``wrap(model, comm)``, AdamW over model.parameters(), its share of each
    batch; the losses, the bytes sent in the first step and the whole parameters after."""
    model = wrap(make(), comm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, sent = [], []
    n, r = comm.world_size, comm.rank
    for x, y in batches:
        share = slice(r * len(x) // n, (r + 1) * len(x) // n)
        before = comm.bytes_sent
        loss = loss_of(model, x[share], y[share])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sent.append(comm.bytes_sent - before)
        losses.append(loss.item())
    return losses, sent, fsdp.full_state_dict(model)


def blocks_then_root(model, comm):
    for block in model.blocks:
        fsdp.fully_shard(block, comm)
    return fsdp.fully_shard(model, comm)


@pytest.mark.parametrize("n", [2, 4])
def test_the_transformer_sharded_per_block_trains_as_one_process(n):
    data = batches()
    losses, want = one_process(lambda: tf.GPT(CFG).double(), data, gpt_loss)
    out, _ = run_ranks(sharded_run, [None] * n, lambda: tf.GPT(CFG).double(),
                       blocks_then_root, data, gpt_loss, check_sizes=False)
    for _, _, whole in out:
        assert whole.keys() == want.keys()
        assert max(float((whole[k] - v).abs().max()) for k, v in want.items()) < 1e-10
    mean = np.mean([o[0] for o in out], axis=0)  # each rank's mean over its equal share
    assert np.abs(mean - losses).max() < 1e-12


def test_the_optimizer_sees_this_ranks_pieces_and_a_step_sends_what_the_planner_counts():
    n, data = 4, batches()

    def check(_, comm):
        model = blocks_then_root(tf.GPT(CFG).double(), comm)
        pieces = list(model.parameters())
        rows = [p.shape[0] for p in tf.GPT(CFG).parameters()]
        assert [p.shape[0] for p in pieces] == [r // n for r in rows]  # dimension 0 / N
        return sharded_run(None, comm, lambda: tf.GPT(CFG).double(), blocks_then_root,
                           data, gpt_loss)[1]
    sent, _ = run_ranks(check, [None] * n, check_sizes=False)
    layout = planner.Layout(dp=n, zero=3)
    planned = dry_run.planned_collectives(CFG, layout, B, T)  # the root gathered once
    for r, bytes_per_step in enumerate(sent):
        want = dry_run.ring_bytes(planned, layout, {"dp": r}, itemsize=8)["dp"]
        assert bytes_per_step == [want] * STEPS


class Net(nn.Module):
    """Linear layers to shard and a LayerNorm to replicate, as CS336's assignment splits them."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(12, 10), nn.LayerNorm(10), nn.Linear(10, 3)
        gen = torch.Generator().manual_seed(0)  # its own: the ranks' threads share the global
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))

    def forward(self, x):
        return self.down(torch.tanh(self.norm(self.up(x))))


def net_loss(model, x, y):
    return nn.functional.mse_loss(model(x).double(), y)


def linears_sharded_norm_replicated(model, comm, policy=None):
    for layer in (model.up, model.down):  # 10 rows over 4 ranks: 3, 3, 3, 1 (padded to 3)
        fsdp.fully_shard(layer, comm, mp_policy=policy)
    return fsdp.replicate(model, comm)


def test_replicated_norms_and_uneven_rows_train_as_one_process():
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 12, generator=gen, dtype=torch.float64),
             torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(STEPS)]
    losses, want = one_process(lambda: Net().double(), data, net_loss)
    out, _ = run_ranks(sharded_run, [None] * 4, lambda: Net().double(),
                       linears_sharded_norm_replicated, data, net_loss, check_sizes=False)
    for _, _, whole in out:
        assert max(float((whole[k] - v).abs().max()) for k, v in want.items()) < 1e-10


def ring_bytes_of(torch_collectives, itemsize, reduce_itemsize, n=4):
    """What the course's ring sends on rank 0 for torch's collectives: the all-gathers in the
    parameters' dtype, the reduce-scatters in the reduce dtype."""
    layout = planner.Layout(dp=n, zero=3)
    sent = 0
    for kind, size in (("all-gather", itemsize), ("reduce-scatter", reduce_itemsize)):
        calls = [c for c in torch_collectives if c.kind == kind]
        sent += dry_run.ring_bytes(calls, layout, {"dp": 0}, itemsize=size).get("dp", 0)
    return sent


def test_beside_torchs_fully_shard_in_float32(cluster):
    """The same transformer, blocks and root sharded by the course and by torch on 4 ranks over
    Gloo, 3 AdamW steps: the same first loss, then losses and parameters within float32's
    rounding of the gradients' sums (the ring adds in another order than Gloo, and an update
    from a sum rounded otherwise moves the next loss in its 7th digit); the same collectives of
    the same sizes, which the course's ring sends as the planner counts."""
    for r in cluster.run(K.fully_shard_beside_torch):
        assert r["losses"][0] == r["torch_losses"][0], r
        # a mistake in the sums (a sum for a mean, a piece missed) moves them by 1e-2 or more
        assert r["losses"] == pytest.approx(r["torch_losses"], rel=1e-6), r
        assert r["diff"] < 1e-4, r
        assert r["sent"] == [ring_bytes_of(calls, 4, 4) for calls in r["torch"]], r


def test_beside_torchs_fully_shard_in_bf16_reducing_in_float32(cluster):
    """With MixedPrecisionPolicy(bf16, reduce float32) on both: bit for bit the same parameters
    (both gather the same bf16 copies of the same float32 pieces, and a float32 sum of four bf16
    numbers is exact unless their magnitudes lie more than about 2^13 apart, which these
    gradients' do not); the gathers send half the bytes of float32's."""
    for r in cluster.run(K.fully_shard_beside_torch, "bf16", "fp32"):
        assert r["losses"] == r["torch_losses"] and r["diff"] == 0, r
        assert r["sent"] == [ring_bytes_of(calls, 2, 4) for calls in r["torch"]], r


def test_a_module_with_nothing_left_to_shard_is_refused():
    def run(_, comm):
        layer = fsdp.fully_shard(nn.Linear(4, 4), comm)
        fsdp.fully_shard(layer, comm)
    with pytest.raises(ValueError, match="Linear has no trainable parameter"):
        run_ranks(run, [None] * 2, check_sizes=False)


def test_prefetch_trains_the_same_and_holds_one_block_more():
    """Prefetching the next unit's gather (forward and backward): the same parameters and bytes
    as without, and at most one block more held at once: the root stays gathered through the
    step, then one block (two with prefetch: the one computing and the next)."""
    n, data = 4, batches()
    losses, want = one_process(lambda: tf.GPT(CFG).double(), data, gpt_loss)

    def run(_, comm, prefetch):
        def wrap(model, comm):
            for block in model.blocks:
                fsdp.fully_shard(block, comm, prefetch=prefetch)
            return fsdp.fully_shard(model, comm, prefetch=prefetch)
        out = sharded_run(None, comm, lambda: tf.GPT(CFG).double(), wrap, data, gpt_loss)
        return out, fsdp.shared(comm)["peak"]
    root, block = 8 * 8768, 8 * 12704  # bytes of the whole root and of one whole block
    sent = {}
    for prefetch, peak in ((False, root + block), (True, root + 2 * block)):
        out, _ = run_ranks(run, [None] * n, prefetch, check_sizes=False)
        sent[prefetch] = [o[0][1] for o in out]
        for (_, _, whole), held in out:
            assert max(float((whole[k] - v).abs().max()) for k, v in want.items()) < 1e-10
            assert held == peak, (prefetch, held)
    assert sent[True] == sent[False]


# ------------------------------------------------- the cases of CS336's FSDP tests, by adapter
class Toy(nn.Module):
    """Embeddings and Linear layers to shard, RMSNorms to replicate (CS336's test model)."""

    def __init__(self, vocab=100, d=64, hidden=128):
        super().__init__()
        self.embedding, self.norm1 = nn.Embedding(vocab, d), nn.RMSNorm(d)
        self.linear1, self.norm2 = nn.Linear(d, hidden, bias=False), nn.RMSNorm(hidden)
        self.linear2 = nn.Linear(hidden, d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        gen = torch.Generator().manual_seed(42)  # its own: the ranks' threads share the global
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)

    def forward(self, x):
        x = self.norm1(self.embedding(x))
        x = self.norm2(torch.relu(self.linear1(x)))
        return self.lm_head(self.linear2(x))


def get_fsdp(model, comm, compute_dtype=None):
    """The adapter: Linear and Embedding layers sharded (computing in ``compute_dtype``,
    reducing in float32), everything else replicated."""
    policy = fsdp.MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for m in list(model.modules()):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            fsdp.fully_shard(m, comm, mp_policy=policy)
    return fsdp.replicate(model, comm)


class HalfCompute(nn.Module):
    """One process's reference for a compute dtype: the layer's float32 weight cast for the
    product (its gradient cast back by autograd), as the units compute."""

    def __init__(self, layer, dtype):
        super().__init__()
        self.layer, self.dtype = layer, dtype

    def forward(self, x):
        w = self.layer.weight.to(self.dtype)
        if isinstance(self.layer, nn.Embedding):
            return nn.functional.embedding(x, w)
        return nn.functional.linear(x.to(self.dtype), w)


def reference(compute_dtype):
    model = Toy()
    if compute_dtype is not None:
        for name in ("embedding", "linear1", "linear2", "lm_head"):
            setattr(model, name, HalfCompute(getattr(model, name), compute_dtype))
    return model


def cs336_batches(steps=3):
    """20 sequences of 8 tokens and a label each, shuffled after every step (the same on every
    rank)."""
    gen = torch.Generator().manual_seed(123)
    x, y = torch.randint(0, 100, (20, 8), generator=gen), torch.randint(0, 100, (20,),
                                                                        generator=gen)
    out = []
    for step in range(steps):
        out.append((x, y))
        perm = torch.randperm(20, generator=torch.Generator().manual_seed(42 + step))
        x, y = x[perm], y[perm]
    return out


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # RMSNorm: fp16 input, float32 weight
@pytest.mark.parametrize("compute_dtype", [None, torch.float16], ids=["fp32", "fp16"])
def test_cs336_correctness_case(compute_dtype):
    """Three SGD steps on 2 ranks, each its half of 20 sequences, equal to one process on all
    of them after every step (CS336's tolerances: 1e-6 in float32, 1e-4 computing in fp16)."""
    data = cs336_batches()

    def run(_, comm):
        model = get_fsdp(Toy(), comm, compute_dtype)
        one = reference(compute_dtype)
        opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, one)]
        rows, worst = slice(comm.rank * 10, (comm.rank + 1) * 10), 0.0
        for x, y in data:
            for m, opt, xs, ys in ((model, opts[0], x[rows], y[rows]), (one, opts[1], x, y)):
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(m(xs)[:, -1, :].float(), ys).backward()
                opt.step()
            whole = fsdp.full_state_dict(model)
            for name, p in one.named_parameters():
                error = (whole[name.replace(".layer", "")] - p.detach()).abs().max()
                worst = max(worst, float(error))
        return worst
    worst, _ = run_ranks(run, [None] * 2, check_sizes=False)
    assert max(worst) < (1e-6 if compute_dtype is None else 1e-4), worst


@pytest.mark.filterwarnings("ignore:Mismatch dtype")
@pytest.mark.parametrize("compute_dtype", [None, torch.float16], ids=["fp32", "fp16"])
def test_cs336_gradient_sync_case(compute_dtype):
    """After backward on different data per rank: every parameter has a gradient of its own
    shape in float32, and the replicated ones (the RMSNorms) are the same on both ranks."""
    def run(_, comm):
        model = get_fsdp(Toy(), comm, compute_dtype)
        x = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(comm.rank))
        model(x).float().sum().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape, name
            assert p.grad.dtype == p.dtype == torch.float32, name
        return {name: p.grad.clone() for name, p in model.named_parameters() if "norm" in name}
    grads, _ = run_ranks(run, [None] * 2, check_sizes=False)
    assert grads[0].keys() == {"norm1.weight", "norm2.weight"}
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_the_whole_parameters_held_at_most_are_what_torchs_memory_tracker_sees():
    """torch's FSDPMemTracker on its fully_shard (rank 0 of 4 on the fake process group, the
    float32 transformer, two AdamW steps): at its peak it holds the root's whole parameters and
    one block's, as the course's units hold at most without prefetch, and shards of the same
    bytes."""
    import warnings

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with dry_run.fake_world(0, 4), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's notes on hooks
        mesh, theirs = init_device_mesh("cpu", (4,)), tf.GPT(K.CONFIG)
        for block in theirs.blocks:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(theirs, mesh=mesh)
        opt = torch.optim.AdamW(theirs.parameters())
        tracker = FSDPMemTracker(theirs, opt)
        tracker.track_inputs((x, x))
        with tracker:
            for _ in range(2):
                theirs(x, x)[1].backward()
                opt.step()
                opt.zero_grad()
                tracker.reset_mod_stats()
        (by_kind,) = tracker.get_tracker_snapshot("peak").values()  # one device: the CPU
        peak = {getattr(kind, "value", kind): n for kind, n in by_kind.items()}

    def ours(_, comm):
        model = blocks_then_root(tf.GPT(K.CONFIG), comm)
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(x[:, :16], x)[1].backward()
            opt.step()
            opt.zero_grad()
        return fsdp.shared(comm)["peak"], sum(p.numel() * 4 for p in model.parameters())
    (held, pieces), *_ = run_ranks(ours, [None] * 4, check_sizes=False)[0]
    assert peak["Unsharded Param"] == held == 4 * (8768 + 12704)
    assert peak["Sharded Param"] == pieces
