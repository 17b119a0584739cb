"""ZeRO-1 as a torch optimizer: against torch's ZeroRedundancyOptimizer on a cluster (the same
partition, parameters and saved state), and its state saved and loaded across world sizes."""

import copy

import pytest
import torch
from torch import nn

from course_lib.comm import run_ranks
from course_lib.testing.zero import make_data, make_model, sharded_optimizer_against_torch
from course_lib.zero_optimizer import ShardedOptimizer, partition

CLUSTER_SIZE = 3  # the shared cluster of tests/conftest.py


def test_it_partitions_updates_and_saves_as_torchs_zero_redundancy_optimizer(cluster):
    rows = cluster.run(sharded_optimizer_against_torch)
    for r in rows:
        assert r["owners"] == r["torch_owners"] and sorted(set(r["owners"])) == [0, 1, 2]
        assert r["params"] == 0.0
    assert rows[0]["state"] == 0.0       # the consolidated Adam state, moment for moment
    assert rows[0]["continued"] == 0.0   # a plain Adam loads it and takes the same step
    assert rows[0]["continued_torch"] == 0.0


def test_the_partition_is_greedy_largest_first():
    sizes = [torch.zeros(n) for n in (3, 10, 4, 4, 1)]
    assert partition([{"params": sizes}], 2) == [1, 0, 1, 1, 0]  # 10 | 4 + 4 + 3, then 1


def test_a_plain_optimizers_state_loads_on_three_ranks_and_continues_alike():
    model = make_model(0, (5, 16, 3))
    x, y = make_data(12, (5, 16, 3))
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        plain.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        plain.step()
    saved, start = copy.deepcopy(plain.state_dict()), copy.deepcopy(model)
    plain.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    plain.step()

    def rank(_, comm):
        mine = copy.deepcopy(start)
        opt = ShardedOptimizer(mine.parameters(), torch.optim.Adam, comm, lr=0.01)
        opt.load_state_dict(saved)
        nn.functional.mse_loss(mine(x), y).backward()
        opt.step()
        return max(float((a - b).detach().abs().max())
                   for a, b in zip(mine.parameters(), model.parameters(), strict=True))

    results, _ = run_ranks(rank, [None] * 3, check_sizes=False, timeout=10)
    assert results == [0.0] * 3


def test_state_dict_needs_consolidation_and_a_scheduler_reaches_every_rank():
    def rank(_, comm):
        model = make_model(0, (5, 16, 3))
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, comm, lr=1.0)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(2):  # the second step runs at the halved rate, on every rank's share
            nn.functional.mse_loss(model(make_data(12, (5, 16, 3))[0]),
                                   torch.zeros(12, 3, dtype=torch.float64)).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
        with pytest.raises(RuntimeError, match="call consolidate_state_dict"):
            opt.state_dict()
        return [g["lr"] for g in opt.local.param_groups]

    results, _ = run_ranks(rank, [None] * 2, check_sizes=False, timeout=10)
    assert results == [[0.5], [0.5]]  # the second step ran at the rate halved once
