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
    with pytest.raises(CheckFailed, match="add their values"):
        checks_compression.check_topk_allreduce(_assign_instead_of_add, cluster)
    with pytest.raises(CheckFailed, match="int32"):
        checks_compression.check_topk_allreduce(_int64_indices, cluster)
