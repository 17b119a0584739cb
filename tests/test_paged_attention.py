"""The paged KV cache and the two batching policies against decoding each request alone
(course_lib/paged_attention.py, notebook 18)."""

import numpy as np
import pytest
import torch

from course_lib import decoding
from course_lib import paged_attention as pa
from course_lib import transformer as tf

CFG = tf.GPTConfig(context=48, d_model=32, n_heads=4)
MODEL = tf.GPT(CFG, seed=1).double().eval()
D = torch.float64  # the caches hold what the model computes


def requests(n=10, seed=0, spacing=0.0):
    rng = np.random.default_rng(seed)
    return [pa.Request(rng.integers(0, 256, int(rng.integers(2, 10))).tolist(),
                       int(rng.integers(1, 30)), arrival=spacing * i) for i in range(n)]


def alone(r):
    prompt = torch.tensor(r.prompt)[None]
    return decoding.generate(MODEL, prompt, r.max_new_tokens)[0, len(r.prompt):].tolist()


def test_blocks_lookup_grow_and_release():
    assert [pa.blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert pa.slot_of([7, 3, 5], 0, 4) == (7, 0)
    assert pa.slot_of([7, 3, 5], 4, 4) == (3, 0)
    assert pa.slot_of([7, 3, 5], 11, 4) == (5, 3)
    table, free = [], [9, 8, 2, 1]
    pa.grow(table, free, 0, 5, 4)  # 5 positions: 2 blocks, from the end of the free list
    assert table == [1, 2] and free == [9, 8]
    pa.grow(table, free, 5, 3, 4)  # 8 positions fit in the 2 blocks: nothing taken
    assert table == [1, 2] and free == [9, 8]
    with pytest.raises(MemoryError, match="2 more blocks needed, 1 free"):
        pa.grow(table, [4], 8, 5, 4)
    assert table == [1, 2]  # nothing taken when they do not all fit
    pa.release(table, free)
    assert table == [] and free == [9, 8, 2, 1]  # the next grow hands out 1, then 2 again


@pytest.mark.parametrize("policy, cache", [
    ("continuous", lambda: pa.PagedKVCache(CFG, 24, block_size=8, dtype=D)),
    ("static", lambda: pa.contiguous(CFG, 3, dtype=D)),
    ("continuous", lambda: pa.PagedKVCache(CFG, 9, block_size=4, dtype=D)),  # tight: preemptions
])
def test_every_policy_answers_as_decoding_each_request_alone(policy, cache):
    todo, store = requests(), cache()
    served, log = pa.serve(MODEL, todo, store, policy=policy)
    assert [r.tokens for r in served] == [alone(r) for r in todo]
    assert sorted(store.free) == list(range(store.num_blocks))  # every block came back
    assert store.tables == {} and store.lengths == {}
    assert all(s["used"] <= s["allocated"] <= store.num_blocks * store.block_size for s in log)
    summary = pa.summary(served, log)
    assert 0 <= summary["wasted_cache"] < 1 and summary["steps"] == len(log)
    if store.num_blocks == 9:
        assert sum(s["preempted"] for s in log) > 0, "the tight cache preempted nobody"
    if policy == "static":  # a batch at a time: at most 3 (the cache holds 3 contexts)
        assert max(s["requests"] for s in log) <= 3


def test_continuous_batching_runs_more_requests_at_once_in_fewer_steps():
    todo = requests(16, seed=2)
    static = pa.serve(MODEL, todo, pa.contiguous(CFG, 4, dtype=D), policy="static")[1]
    paged = pa.serve(MODEL, todo, pa.PagedKVCache(CFG, 16 * 3, block_size=4, dtype=D))[1]
    assert max(s["requests"] for s in paged) > 4
    assert len(paged) < len(static)
    waste = [pa.summary(r, log)["wasted_cache"] for r, log in
             (pa.serve(MODEL, todo, pa.contiguous(CFG, 4, dtype=D), policy="static"),
              pa.serve(MODEL, todo, pa.PagedKVCache(CFG, 48, block_size=4, dtype=D)))]
    assert waste[1] < waste[0]


def test_arrivals_are_waited_for_and_bad_requests_refused():
    todo = requests(3, spacing=0.05)
    served, _ = pa.serve(MODEL, todo, pa.PagedKVCache(CFG, 12, block_size=8, dtype=D))
    # holds under load: a request is admitted only once the clock has passed its arrival
    assert all(r.admitted >= r.arrival for r in served)
    with pytest.raises(ValueError, match="exceeds the model's context 48"):
        pa.serve(MODEL, [pa.Request([1] * 40, 10)], pa.PagedKVCache(CFG, 12, dtype=D))
    with pytest.raises(MemoryError, match="does not fit in the whole cache"):
        pa.serve(MODEL, [pa.Request([1] * 20, 10)], pa.PagedKVCache(CFG, 2, block_size=4, dtype=D))
    with pytest.raises(ValueError, match="policy 'fifo'"):
        pa.serve(MODEL, todo, pa.PagedKVCache(CFG, 12, dtype=D), policy="fifo")
