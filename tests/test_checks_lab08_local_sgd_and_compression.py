"""Lab 08's checks (course_lib/checks/lab08_local_sgd_and_compression.py): the reference passes,
typical mistakes fail with their hint."""

import pytest
import torch

from course_lib import compression
from course_lib.checks import CheckFailed
from course_lib.checks import lab08_local_sgd_and_compression as checks_compression

CLUSTER_SIZE = 2  # the shared cluster of tests/conftest.py
CLUSTER_BACKEND = "gloo"


def _wrong_topk(no_residual=False, signed=False, keep_sent=False, clamp=True, check_k=True):
    def topk_compress(grad, residual, k):
        if check_k and k < 1:
            raise ValueError("k")
        corrected = grad if (residual is None or no_residual) else grad + residual
        k = min(k, len(grad)) if clamp else k
        indices = torch.topk(corrected if signed else corrected.abs(), k).indices
        new_residual = corrected.clone()
        if not keep_sent:
            new_residual[indices] = 0
        return corrected[indices], indices, new_residual
    return topk_compress


@pytest.mark.parametrize("wrong,hint", [
    (_wrong_topk(no_residual=True), "add the residual first"),
    (_wrong_topk(signed=True), "by magnitude"),
    (_wrong_topk(keep_sent=True), "set the sent entries of the residual to zero"),
    (_wrong_topk(clamp=False), r"k = min\(k, len\(grad\)\)"),
    (_wrong_topk(check_k=False), "raise ValueError for k < 1"),
])
def test_lab_compress_check_catches_mistakes(wrong, hint):
    from course_lib.checks import CheckFailed
    with pytest.raises(CheckFailed, match=hint):
        checks_compression.check_topk_compress(wrong)


def topk_with(corrected_in="a new tensor", residual_from="a copy", values="signed",
              residual_holds="what was not sent", largest=True, order="values first"):
    """topk_compress with knobs for more of the usual mistakes."""
    def topk_compress(grad, residual, k):
        if k < 1:
            raise ValueError("k")
        if residual is None:
            corrected = grad
        elif corrected_in == "grad":
            grad += residual  # the caller's grad
            corrected = grad
        else:
            corrected = grad + residual
        k = min(k, len(grad))
        indices = torch.topk(corrected.abs(), k, largest=largest).indices
        new_residual = corrected if residual_from == "corrected itself" else corrected.clone()
        if residual_holds == "grad only":
            new_residual = grad.clone()
        if residual_holds == "what was sent":
            new_residual = torch.zeros_like(corrected)
            new_residual[indices] = corrected[indices]
        else:
            new_residual[indices] = 0
        sent = {"signed": corrected[indices], "magnitudes": corrected[indices].abs(),
                "of grad": grad[indices]}[values]
        return (indices, sent, new_residual) if order == "indices first" else \
            (sent, indices, new_residual)
    return topk_compress


@pytest.mark.parametrize("wrong,hint", [
    (topk_with(corrected_in="grad"), r"changed its input grad or residual in place\.\nHint: grad "
                                     r"now holds grad \+ residual"),
    (topk_with(residual_from="corrected itself"), r"case 1/9 [\s\S]*Hint: the sent entries of "
                                                  r"grad itself were set to zero"),
    (topk_with(values="magnitudes"), r"Hint: send the signed values"),
    (topk_with(values="of grad"), r"Hint: send grad \+ residual at those positions"),
    (topk_with(residual_holds="grad only"), r"Hint: your new residual leaves the old residual "
                                            r"out"),
    (topk_with(residual_holds="what was sent"), r"Hint: your new residual holds the entries that "
                                                r"WERE sent"),
    (topk_with(largest=False), r"Hint: you picked the k SMALLEST magnitudes"),
    (topk_with(order="indices first"), r"Hint: the three come back in the order \(values, "
                                       r"indices, new_residual\)"),
], ids=["grad += residual", "residual is grad", "magnitudes sent", "grad's values sent",
        "old residual left out", "residual of the sent entries", "smallest k",
        "indices first"])
def test_more_compress_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks_compression.check_topk_compress(wrong)
    assert "torch.topk(corrected.abs(), k)" not in str(failed.value)


def test_lab_compress_check_passes_the_reference():
    assert checks_compression.check_topk_compress(compression.topk_compress) is True

    def unfinished(grad, residual, k):
        raise NotImplementedError
    assert checks_compression.check_topk_compress(unfinished) is False


def _assign_instead_of_add(flat_grad, residual, k):
    import torch
    values, indices, new_residual = compression.topk_compress(flat_grad, residual, k)
    dense = torch.zeros_like(flat_grad)
    for v, i in zip(compression.all_gather(values), compression.all_gather(indices.int()),
                    strict=True):
        dense[i.long()] = v
    return dense / 2, new_residual


def _int64_indices(flat_grad, residual, k):
    import torch
    values, indices, new_residual = compression.topk_compress(flat_grad, residual, k)
    dense = torch.zeros_like(flat_grad)
    for v, i in zip(compression.all_gather(values), compression.all_gather(indices),
                    strict=True):
        dense.index_add_(0, i, v)
    return dense / 2, new_residual


def test_lab_exchange_check_passes_the_reference_and_catches_mistakes(cluster):
    assert checks_compression.check_topk_allreduce(compression.topk_allreduce, cluster) is True
    with pytest.raises(CheckFailed, match="must be added, not assigned"):
        checks_compression.check_topk_allreduce(_assign_instead_of_add, cluster)
    with pytest.raises(CheckFailed, match="int32"):
        checks_compression.check_topk_allreduce(_int64_indices, cluster)


def exchange_with(divide="world size", gather="values and indices", place="their indices",
                  returns="new residual", value_dtype=None):
    """topk_allreduce with knobs for more of the usual mistakes."""
    def topk_allreduce(flat_grad, residual, k):
        import torch
        import torch.distributed as dist
        values, indices, new_residual = compression.topk_compress(flat_grad, residual, k)
        world = dist.get_world_size()
        dense = torch.zeros_like(flat_grad)
        if gather == "own only":
            dense.index_add_(0, indices, values)
        elif gather == "dense allreduce":
            dense[indices] = values
            dist.all_reduce(dense)
        elif gather == "dense vector":
            dense[indices] = values
            dense = sum(compression.all_gather(dense))
        else:
            sent = values if value_dtype is None else values.to(value_dtype)
            every = zip(compression.all_gather(sent),
                        compression.all_gather(indices.to(torch.int32)), strict=True)
            for vals, idx in every:
                at = indices if place == "own indices" else idx.long()
                dense.index_add_(0, at, vals.to(dense.dtype))
        mean = dense / {"world size": world, "k": k, "nothing": 1}[divide]
        kept = {"new residual": new_residual, "zeros": torch.zeros_like(flat_grad),
                "the one given": residual if residual is not None
                else torch.zeros_like(flat_grad)}[returns]
        return mean, kept
    return topk_allreduce


@pytest.mark.parametrize("wrong,hint", [
    (exchange_with(divide="nothing"), r"Hint: your result is the SUM over the ranks"),
    (exchange_with(divide="k"), r"Hint: you divided the sum by k"),
    (exchange_with(gather="own only"), r"Hint: your result holds rank 0's own top-k only"),
    (exchange_with(place="own indices"), r"Hint: every rank's values were placed at rank 0's "
                                         r"OWN indices"),
    (exchange_with(gather="dense allreduce"), r"handed 4000 bytes to \['all_reduce'\][\s\S]*"
                                              r"Hint: an allreduce of the whole vector"),
    (exchange_with(gather="dense vector"), r"Hint: you gathered the whole vector"),
    (exchange_with(value_dtype=torch.float64), r"handed 120 bytes[\s\S]*Hint: one of your "
                                               r"collectives is handed 8 bytes per entry"),
    (exchange_with(returns="the one given"), r"new_residual differs\nHint: you returned the "
                                             r"residual you were given"),
    (exchange_with(returns="zeros"), r"Hint: you returned a residual of zeros"),
], ids=["no division", "divided by k", "own values only", "at its own indices",
        "dense allreduce", "dense all_gather", "float64 values", "residual given back",
        "zero residual"])
def test_more_exchange_mistakes(cluster, wrong, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks_compression.check_topk_allreduce(wrong, cluster)
    assert "index_add_" not in str(failed.value)


def test_training_check_passes_the_reference_and_fails_an_exchange_that_forgets(cluster, capsys):
    assert checks_compression.check_training(compression.topk_allreduce, cluster) is True
    assert "✓ check_training: with error feedback loss" in capsys.readouterr().out
    # a residual of zeros loses the error feedback: both runs train alike
    with pytest.raises(CheckFailed, match=r"without error feedback the loss is .*, not clearly "
                                          r"worse than with it"):
        checks_compression.check_training(exchange_with(returns="zeros"), cluster)


# ---------------------------------------------------------------- exercise 3: DiLoCo's outer step
def outer_with(flip=False, nesterov=True, momentum_kept=True, in_place=True):
    """DiLoCo's outer step written out, with knobs for the usual mistakes."""
    def outer_step(shared, local_mean, momentum, lr=0.7, mu=0.9):
        delta = local_mean - shared if flip else shared - local_mean
        new = mu * momentum + delta
        if momentum_kept:
            momentum.copy_(new)
        step = lr * (delta + mu * new) if nesterov else lr * new
        if in_place:
            shared.sub_(step)
        else:
            shared = shared - step  # noqa: F841  (rebinds the name only)
    return outer_step


def average_only(shared, local_mean, momentum, lr=0.7, mu=0.9):
    shared.copy_(local_mean)


def changes_local_mean(shared, local_mean, momentum, lr=0.7, mu=0.9):
    local_mean.sub_(shared)  # Δ computed in the caller's tensor, negated
    momentum.mul_(mu).sub_(local_mean)
    shared.add_(lr * (local_mean - mu * momentum))


@pytest.mark.parametrize("wrong,hint", [
    (outer_with(flip=True), "points the wrong way"),
    (outer_with(nesterov=False), "that is plain momentum"),
    (outer_with(momentum_kept=False), "momentum is not what it should be"),
    (outer_with(in_place=False), "shared did not change: update it in place"),
    (average_only, "that is local SGD"),
    (changes_local_mean, "local_mean is the ranks' average, read only"),
])
def test_outer_step_check_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks_compression.check_outer_step(wrong)


def test_outer_step_check_passes_the_reference_and_trains_diloco_with_it(cluster, capsys):
    assert checks_compression.check_outer_step(outer_with(), cluster) is True
    out = capsys.readouterr().out
    assert "DiLoCo H=10 on 2 ranks" in out and "4/4 cases" in out
