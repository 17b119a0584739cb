"""Tensor parallelism from scratch: equal to one process and to torch's ColwiseParallel /
RowwiseParallel, one allreduce forward and one backward per MLP block, clear errors for sizes
that do not split."""

import pytest
import torch
from torch import nn

from course_lib import tensor_parallel as TP
from course_lib.comm import Comm
from course_lib.testing import tensor_parallel as K

CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py
EXACT = 1e-10  # float64: the split sums in another order, nothing more


class FakeRanks:
    """A communicator of ``world_size`` ranks that fails the test if anything is sent."""

    transport, timeout = "none", 1.0

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def __getattr__(self, name):
        raise AssertionError(f"splitting a layer must not call comm.{name}")


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("kw", [{}, {"blocks": 2}, {"kind": "gather"}, {"activation": "relu"}])
def test_world_size_one_equals_the_unsplit_model_and_sends_nothing(kw):
    diffs = K.compare_with_one_process(Comm(0, 1), **kw)
    assert diffs["max"] <= EXACT, diffs
    assert diffs["counts"] == {"forward": 0, "backward": 0}


def test_shards_are_the_right_slices_of_an_existing_layer():
    linear = nn.Linear(6, 8).double()
    for rank in range(2):
        tp = TP.TensorParallel(FakeRanks(rank, 2))
        col, row = TP.ColumnParallelLinear.from_linear(linear, tp), \
            TP.RowParallelLinear.from_linear(linear, tp)
        assert col.rows == (4 * rank, 4 * rank + 4) and row.cols == (3 * rank, 3 * rank + 3)
        assert torch.equal(col.weight, linear.weight[4 * rank:4 * rank + 4])
        assert torch.equal(col.bias, linear.bias[4 * rank:4 * rank + 4])
        assert torch.equal(row.weight, linear.weight[:, 3 * rank:3 * rank + 3])
        assert torch.equal(row.bias, linear.bias)  # the whole bias, added once after the sum
        assert col.weight.data_ptr() != linear.weight.data_ptr()  # copied, not shared
    fresh = TP.ParallelMLP(TP.ColumnParallelLinear(6, 8, tp), nn.GELU(),
                           TP.RowParallelLinear(8, 6, tp))
    assert [tuple(p.shape) for p in fresh.parameters()] == [(4, 6), (4,), (6, 4), (6,)]


@pytest.mark.parametrize("layer, args, words", [
    (TP.ColumnParallelLinear, (12, 10), "out_features=10 is not divisible by the world size 4"),
    (TP.RowParallelLinear, (10, 12), "in_features=10 is not divisible by the world size 4"),
])
def test_a_size_the_world_size_does_not_divide_is_named(layer, args, words):
    with pytest.raises(ValueError, match=words):
        layer(*args, FakeRanks(0, 4))
    with pytest.raises(ValueError, match=words):
        layer.from_linear(nn.Linear(*args), FakeRanks(3, 4))
    with pytest.raises(ValueError, match="hidden|in_features=10|out_features=10"):
        TP.ParallelMLP.from_mlp(nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 12)),
                                FakeRanks(0, 4))


def test_from_mlp_names_what_it_cannot_split():
    with pytest.raises(ValueError, match=r"not Sequential\(Linear, ReLU\)"):
        TP.ParallelMLP.from_mlp(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), FakeRanks(0, 2))


# ---------------------------------------------------------------- a cluster of 4 ranks (Gloo)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_one_block_equals_one_process_with_one_allreduce_each_way(cluster, world_size):
    runs = cluster.run(K.tp_matches_one_process, world_size)
    assert runs[world_size:] == [None] * (CLUSTER_SIZE - world_size)  # outside the subgroup
    collectives = 1 if world_size > 1 else 0
    for rank, diffs in enumerate(runs[:world_size]):
        assert diffs["max"] <= EXACT, (rank, diffs)
        assert diffs["counts"] == {"forward": collectives, "backward": collectives}, rank


def test_two_blocks_cost_two_allreduces_each_way(cluster):
    for diffs in cluster.run(K.tp_matches_one_process, 4, blocks=2, activation="relu"):
        assert diffs["max"] <= EXACT, diffs
        assert len(diffs["param_grads"]) == 8
        assert diffs["counts"] == {"forward": 2, "backward": 2}


def test_an_input_without_gradient_skips_the_backward_allreduce(cluster):
    # a network's first layer: nobody needs dL/dx, so f has nothing to sum
    for diffs in cluster.run(K.tp_matches_one_process, 4, blocks=2, input_grad=False):
        assert diffs["max"] <= EXACT and diffs["input_grad"] is None, diffs
        assert diffs["counts"] == {"forward": 2, "backward": 1}


def test_gather_output_equals_the_unsplit_layer(cluster):
    for diffs in cluster.run(K.tp_matches_one_process, 2, kind="gather")[:2]:
        assert diffs["max"] <= EXACT, diffs
        # f's gradient allreduce, and the all-gather; its backward keeps a slice: no message
        assert diffs["counts"] == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("world_size", [2, 4])
def test_equals_torch_colwise_rowwise_parallel(cluster, world_size):
    runs = cluster.run(K.tp_matches_torch, world_size)
    for rank, diffs in enumerate(runs[:world_size]):
        assert diffs["max"] <= EXACT, (rank, diffs)
        assert set(diffs["param_grads"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
