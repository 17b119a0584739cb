"""Allreduce from scratch: every algorithm against the native one, mismatches, missing ranks."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from course_lib import collectives as C
from course_lib.runtime import cluster as CL
from course_lib.runtime.launch import mpiexec_path
from course_lib.testing import collectives as K
from course_lib.testing.timing import assert_no_hang

MPIEXEC = mpiexec_path() or "mpiexec"
needs_mpiexec = pytest.mark.skipif(not os.path.exists(MPIEXEC),
                                   reason="no mpiexec (pip install mpi4py mpich)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


CLUSTER_SIZE = 4  # the shared cluster of tests/conftest.py


class OneRank:
    """A communicator of world size 1 that fails the test if anything is sent."""

    rank, world_size, transport, timeout = 0, 1, "none", 1.0

    def __getattr__(self, name):
        raise AssertionError(f"world size 1 must not call comm.{name}")


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_world_size_one_sends_nothing_and_keeps_the_values(kind):
    for dtype in K.DTYPES:
        x = K.rank_input(0, 0, (4, 5), dtype)
        for op in C.OPS:
            for algorithm in K.ALL:
                buf = x.copy() if kind == "numpy" else torch.from_numpy(x.copy())
                assert K.run_algorithm(algorithm, buf, OneRank(), op) is buf
                np.testing.assert_array_equal(np.asarray(buf), x)
            buf = x.copy()
            assert C.ring_reduce_scatter(buf, OneRank(), op) == (0, 20)


def test_bad_arguments_are_named():
    buf = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match=r"op must be one of \('sum', 'average', 'max', 'min'\)"):
        C.ring_allreduce(buf, OneRank(), op="avg")
    with pytest.raises(ValueError, match="algorithm must be one of .*'ring_pipelined'"):
        C.allreduce(buf, OneRank(), algorithm="butterfly")
    with pytest.raises(ValueError, match="must be contiguous"):
        C.tree_allreduce(np.zeros((4, 4))[:, 0], OneRank())
    with pytest.raises(ValueError, match="must be contiguous"):
        C.naive_allreduce(torch.zeros(4, 4).t(), OneRank())
    with pytest.raises(ValueError, match="segment_bytes must be a positive integer"):
        C.ring_allreduce_pipelined(buf, OneRank(), segment_bytes=0)


def test_integer_average_rounds_down():
    a = np.array([7, -7, 8], np.int64)
    C.divide(a, 2)
    t = torch.tensor([7, -7, 8])
    C.divide(t, 2)
    assert a.tolist() == t.tolist() == [3, -4, 4]


# ---------------------------------------------------------------- a cluster of 4 ranks (Gloo)
def test_every_algorithm_matches_dist_all_reduce(cluster):
    results = cluster.run(K.compare_with_native, list(K.ALL), timeout=150)
    problems = [p for rank in results for p in rank]
    assert problems == [], "\n".join(problems[:10])


@pytest.mark.parametrize("algorithm, odd, words", [
    ("ring", {"odd_n": 999}, "rank 0: (1000,) float32, rank 1: (999,) float32, rank 2: (1000,)"),
    ("ring_pipelined", {"odd_dtype": "float64"}, "rank 1: (1000,) float64"),
    ("tree", {"odd_op": "max"}, "ops differ across ranks: rank 0: (1000,) float32 op='sum', "
                                "rank 1: (1000,) float32 op='max'"),
    ("naive", {"op": "avg"}, "op must be one of"),
], ids=["length", "dtype", "op", "unknown-op"])
def test_mismatch_raises_on_every_rank_and_the_cluster_goes_on(cluster, algorithm, odd, words):
    pids = list(cluster.pids)
    with pytest.raises(CL.RemoteError) as info:
        cluster.run(K.mismatched_allreduce, algorithm, **odd, timeout=30)
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2, 3]
    for text in errors.values():
        assert text.startswith("ValueError") and words in text, text
    assert cluster.pids == pids  # nobody died
    assert cluster.run(CL.allreduce_ranks) == [6.0] * 4


def test_rank_that_never_calls_is_named_by_the_others(cluster):
    t = time.monotonic()
    with pytest.raises(CL.RemoteError) as info:
        cluster.run(K.allreduce_without, 2, "ring", timeout=30)
    assert_no_hang(time.monotonic() - t, 0, instead=30)  # told at once, not at the deadline
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 3]
    for rank, text in errors.items():
        assert text.startswith("CommTimeout") and f"rank {rank}: " in text, text
        assert "from rank 2" in text and "did not complete within" in text, text
    assert cluster.run(CL.allreduce_ranks) == [6.0] * 4
    assert cluster.run(K.compare_with_native, "ring", [5], ["float32"], ["sum"]) == [[]] * 4


# ---------------------------------------------------------------- under mpiexec
def _launch(n, args, tmp_path, timeout=600):
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(timeout - 15), OMP_NUM_THREADS="1")
    command = [MPIEXEC, "-n", str(n), sys.executable, "-m", "course_lib.testing.collectives", *args,
               "--timeout", "20", "--out", str(tmp_path)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert out.returncode == 0 and len(reports) == n, out.stdout[-3000:] + out.stderr[-3000:]
    assert [r["rank"] for r in reports] == list(range(n))
    return [p for r in reports for p in r["problems"]]


@needs_mpiexec
@pytest.mark.parametrize("n, args", [
    (1, []),
    (2, ["--containers", "numpy,torch", "--mismatch", "--all-to-all"]),
    (3, ["--mismatch", "--all-to-all"]),
    (4, ["--dtypes", "float16,float32,int64", "--mismatch", "--all-to-all"]),
    (8, ["--lengths", "0,1,7,9,100", "--dtypes", "float16,float64,int32", "--ops",
         "sum,average,max", "--containers", "numpy"]),  # 8 ranks on few cores: short cases
], ids=["n1", "n2", "n3", "n4", "n8"])
def test_every_algorithm_matches_mpi_allreduce(n, args, tmp_path):
    problems = _launch(n, ["--transport", "mpi", *args], tmp_path)
    assert problems == [], "\n".join(problems[:10])


@needs_mpiexec
def test_torch_transport_under_mpiexec(tmp_path):
    problems = _launch(3, ["--transport", "torch", "--dtypes", "float32,int64", "--ops",
                           "sum,average", "--mismatch", "--all-to-all"], tmp_path)
    assert problems == [], "\n".join(problems[:10])


# ---------------------------------------------------------------- NCCL
@needs_gpu
def test_nccl_world_size_one_on_one_gpu(tmp_path):
    script = f"""
import torch, torch.distributed as dist
from course_lib import collectives as C
from course_lib.comm import get_comm
dist.init_process_group("nccl", store=dist.FileStore({str(tmp_path / "store")!r}, 1),
                        rank=0, world_size=1)
comm = get_comm("torch", timeout=30)
for algorithm in C.ALGORITHMS:
    for op in C.OPS:
        x = torch.randn(1000, device="cuda")
        y = x.clone()
        assert C.allreduce(x, comm, algorithm, op) is x and torch.equal(x, y), (algorithm, op)
dist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_under_torchrun(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "course_lib.testing.collectives", "--transport", "torch", "--backend", "nccl",
         "--mismatch", "--timeout", "30", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert out.returncode == 0 and len(reports) == 2, out.stdout[-3000:] + out.stderr[-3000:]
    problems = [p for r in reports for p in r["problems"]]
    assert problems == [], "\n".join(problems[:10])
