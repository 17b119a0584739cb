"""Lab 09's checks (course_lib/checks/lab09_model_parallelism.py): the reference passes, typical
mistakes fail with their hint."""

import pytest

from course_lib import collectives, pipeline
from course_lib.checks import CheckFailed
from course_lib.checks import lab09_model_parallelism as checks

CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py


def reference_order(stage, num_stages, num_microbatches):
    return pipeline.schedule_order("1f1b", stage, num_stages, num_microbatches)


def gpipe_order(stage, num_stages, num_microbatches):
    return pipeline.schedule_order("gpipe", stage, num_stages, num_microbatches)


def warmup_one_too_many(stage, num_stages, num_microbatches):
    warmup = min(num_stages - stage, num_microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(warmup, num_microbatches):
        order += [("F", m), ("B", m - warmup)]
    return order + [("B", m) for m in range(num_microbatches - warmup, num_microbatches)]


def cool_down_newest_first(stage, num_stages, num_microbatches):
    order = reference_order(stage, num_stages, num_microbatches)
    warmup = min(num_stages - stage - 1, num_microbatches)
    return order[:len(order) - warmup] + order[len(order) - warmup:][::-1]


def backward_before_forward(stage, num_stages, num_microbatches):
    order = reference_order(stage, num_stages, num_microbatches)
    i, j = order.index(("F", 0)), order.index(("B", 0))
    order[i], order[j] = order[j], order[i]
    return order


def forgets_the_cool_down(stage, num_stages, num_microbatches):
    return [s for s in reference_order(stage, num_stages, num_microbatches)
            if s[0] == "F" or s[1] < num_microbatches - 1]


@pytest.mark.parametrize("wrong,hint", [
    (gpipe_order, "that is GPipe's order"),
    (warmup_one_too_many, r"warms up with min\(num_stages - stage - 1"),
    (cool_down_newest_first, "the oldest first"),
    (backward_before_forward, "comes before its forward"),
    (forgets_the_cool_down, r"missing \[\('B', 7\)\]"),
])
def test_order_check_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_1f1b_order(wrong)


def test_order_check_passes_the_reference_and_runs_it_on_the_ranks(cluster, capsys):
    assert checks.check_1f1b_order(reference_order, cluster) is True
    out = capsys.readouterr().out
    assert "bubble 0.273 (formula 0.273)" in out and "[4, 3, 2, 1]" in out
    assert "gradients equal one process's" in out

    def unfinished(stage, num_stages, num_microbatches):
        raise NotImplementedError
    assert checks.check_1f1b_order(unfinished) is False


def forward(x_shard, weight_shard, bias, comm):
    y = x_shard @ weight_shard.T
    collectives.allreduce(y, comm)
    return y + bias


def no_allreduce(x_shard, weight_shard, bias, comm):
    return x_shard @ weight_shard.T + bias


def bias_before_allreduce(x_shard, weight_shard, bias, comm):
    y = x_shard @ weight_shard.T + bias
    collectives.allreduce(y, comm)
    return y


def backward(grad_y, x_shard, weight_shard):
    return grad_y @ weight_shard, grad_y.T @ x_shard, grad_y.sum(0)


def weight_grad_transposed(grad_y, x_shard, weight_shard):
    return grad_y @ weight_shard, x_shard.T @ grad_y, grad_y.sum(0)


def bias_grad_averaged(grad_y, x_shard, weight_shard):
    return grad_y @ weight_shard, grad_y.T @ x_shard, grad_y.mean(0)


@pytest.mark.parametrize("fwd,bwd,hint", [
    (no_allreduce, backward, "your y is this rank's partial sum: allreduce it"),
    (bias_before_allreduce, backward, "the bias was added on every rank before the allreduce"),
    (forward, weight_grad_transposed, r"grad_weight_shard differs \(shape"),
    (forward, bias_grad_averaged, r"grad_bias = grad_y.sum\(0\)"),
])
def test_row_parallel_check_names_the_mistake(cluster, fwd, bwd, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_row_parallel(fwd, bwd, cluster)


def test_row_parallel_check_passes_the_reference(cluster):
    assert checks.check_row_parallel(forward, backward, cluster) is True

    def unfinished(x_shard, weight_shard, bias, comm):
        raise NotImplementedError
    assert checks.check_row_parallel(unfinished, backward, cluster) is False
