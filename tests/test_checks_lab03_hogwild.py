"""Lab 03 checks (course_lib/checks/lab03_hogwild.py): the reference loop and worker pass; the
usual mistakes of the loop, of the worker process on shared memory (a private copy, the wrong
dtype, the wrong rows or order, unlinking, closing too early, a copy written back, a crash, a
hang) and of the collision probability fail with a hint that says what the code did; a template
is a notice, not a failure."""

import math
import os
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest

from course_lib.checks import CheckFailed
from course_lib.checks import lab03_hogwild as checks_hogwild
from course_lib.sharding import shard_bounds
from course_lib.sparse_problem import collision_probability, sparse_sgd_epoch
from course_lib.testing.timing import assert_no_hang


def _row(indptr, indices, values, i):
    return indices[indptr[i]:indptr[i + 1]], values[indptr[i]:indptr[i + 1]]


def add_at(w, indptr, indices, values, y, order, lr):  # another correct style
    for i in order:
        idx, v = _row(indptr, indices, values, i)
        g = -y[i] / (1 + np.exp(y[i] * np.dot(w[idx], v)))
        np.add.at(w, idx, -lr * g * v)


def dense_update(w, indptr, indices, values, y, order, lr):
    for i in order:
        idx, v = _row(indptr, indices, values, i)
        g = np.zeros_like(w)
        g[idx] = -y[i] / (1 + math.exp(y[i] * float(w[idx] @ v))) * v
        w -= lr * g  # writes every coordinate


def stale_copy(w, indptr, indices, values, y, order, lr):
    for i in order:
        local = w.copy()
        idx, v = _row(indptr, indices, values, i)
        local[idx] -= lr * (-y[i] / (1 + math.exp(y[i] * float(local[idx] @ v)))) * v
        w[:] = local  # writes a stale copy of all parameters back


def stale_copyto(w, indptr, indices, values, y, order, lr):
    local = np.array(w)
    sparse_sgd_epoch(local, indptr, indices, values, y, order, lr)
    np.copyto(w, local)


def no_lr(w, indptr, indices, values, y, order, lr):
    sparse_sgd_epoch(w, indptr, indices, values, y, order, 1.0)


def uphill(w, indptr, indices, values, y, order, lr):
    sparse_sgd_epoch(w, indptr, indices, values, y, order, -lr)


def returns_copy(w, indptr, indices, values, y, order, lr):
    return sparse_sgd_epoch(w.copy(), indptr, indices, values, y, order, lr)


def todo(*args):
    raise NotImplementedError


def test_reference_and_other_correct_styles_pass(capsys):
    assert checks_hogwild.check_lockfree_epoch(sparse_sgd_epoch)
    assert checks_hogwild.check_lockfree_epoch(add_at)
    assert "lower the loss" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (dense_update, "none of its samples touches"),
    (stale_copy, "none of its samples touches"),
    (stale_copyto, "none of its samples touches"),
    (no_lr, "as if lr were 1"),
    (uphill, "uphill"),
    (returns_copy, "in place"),
])
def test_mistakes_fail_with_a_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        checks_hogwild.check_lockfree_epoch(wrong)


def test_not_implemented_returns_false(capsys):
    assert checks_hogwild.check_lockfree_epoch(todo) is False
    assert checks_hogwild.check_collision_probability(todo) is False
    assert "not implemented" in capsys.readouterr().out


def test_collision_probability_check():
    def comb(nnz, d):
        return 1 - math.comb(d - nnz, nnz) / math.comb(d, nnz)
    assert checks_hogwild.check_collision_probability(comb)
    assert checks_hogwild.check_collision_probability(collision_probability)
    with pytest.raises(CheckFailed):
        checks_hogwild.check_collision_probability(lambda nnz, d: nnz * nnz / d)


def loop_with(rows="order", g="right", values_in_step=True, row_end=0, margins="each row",
              lr_is=lambda lr, order: lr):
    """The lock-free loop with knobs for the usual mistakes."""
    def lockfree_epoch(w, indptr, indices, values, y, order, lr):
        visit = {"order": order, "range": range(len(order)), "every row": range(len(y))}[rows]
        later = []
        for i in visit:
            idx = indices[indptr[i]:indptr[i + 1] + row_end]
            v = values[indptr[i]:indptr[i + 1] + row_end]
            m = float(w[idx] @ v)
            scale = {"right": -y[i] / (1 + math.exp(y[i] * m)),
                     "positive": y[i] / (1 + math.exp(y[i] * m)),
                     "exp sign": -y[i] / (1 + math.exp(-y[i] * m)),
                     "no y": -1 / (1 + math.exp(y[i] * m)),
                     "0/1 labels": 1 / (1 + math.exp(-m)) - y[i]}[g]
            step = lr_is(lr, order) * scale * (v if values_in_step else 1.0)
            if margins == "all first":
                later.append((idx, step))
            else:
                w[idx] -= step
        for idx, step in later:
            w[idx] -= step
    return lockfree_epoch


@pytest.mark.parametrize("wrong, message", [
    (loop_with(g="positive"), r"Hint: your steps go uphill \(the loss grows\)"),
    (loop_with(g="exp sign"), r"Hint: your g has the wrong sign inside the exponential"),
    (loop_with(g="no y"), r"Hint: your g leaves y out of the numerator"),
    (loop_with(g="0/1 labels"), r"Hint: your g is the gradient for labels 0 and 1"),
    (loop_with(values_in_step=False), r"Hint: your update leaves out the row's values"),
    (loop_with(rows="range"), r"wrote \d+ coordinates that none of the rows in order touches "
                              r".*: your loop visited rows 0, 1, \.\.\., len\(order\) - 1"),
    (loop_with(rows="every row"), r"none of the rows in order touches .*: your loop visited "
                                  r"every row of the data"),
    (loop_with(row_end=1), r"your loop read one entry past each row"),
    (loop_with(margins="all first"), r"Hint: your loop read every row's margin before any "
                                     r"update"),
    (loop_with(lr_is=lambda lr, order: lr / len(order)),
     r"Hint: your steps are divided by the number of rows in order"),
], ids=["g positive", "exp sign", "no y", "0/1 labels", "no values", "range(len(order))",
        "every row", "one past the row", "margins first", "lr / len(order)"])
def test_more_loop_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        checks_hogwild.check_lockfree_epoch(wrong)
    assert "w[idx] -= lr" not in str(failed.value)


@pytest.mark.parametrize("wrong, message", [
    (lambda k, d: math.comb(d - k, k) / math.comb(d, k), r"share NO feature"),
    (lambda k, d: 1 - (1 - k / d) ** k, r"independent draws \(with replacement\)"),
    (lambda k, d: k * k / d, r"the approximation nnz\^2 / n_features"),
    (lambda k, d: 1 - math.exp(-k * k / d), r"an approximation \(exp"),
    (lambda k, d: k / d, r"the chance that ONE given feature"),
    (lambda k, d: 1 - math.prod((d - k - j) / (d - j) for j in range(k + 1)),
     r"one step short \(a product of nnz \+ 1 factors"),
    (lambda k, d: 1 - math.prod((d - k - j) / (d - j) for j in range(1, k)),
     r"your product has nnz - 1 factors"),
    (lambda k, d: 1 - math.comb(d - k, k) // math.comb(d, k), r"rounded down to a whole number"),
    (lambda k, d: 100 * (1 - math.comb(d - k, k) / math.comb(d, k)), r"that is a percentage"),
], ids=["no collision", "with replacement", "nnz^2 / d", "exp approximation", "one feature",
        "nnz + 1 factors", "nnz - 1 factors", "floor division", "percentage"])
def test_collision_probability_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        checks_hogwild.check_collision_probability(wrong)
    assert "C(d - nnz, nnz)" not in str(failed.value)


# ---------------------------------------------------------------- exercise 2: the worker process
def worker(view="ndarray", rows="shard", key="rank", per_epoch_rng=False, step=1.0, epochs=0,
           unlink=False, close_first=False, use_after_close=False, write_back=False,
           shuffle=True, lr_is=None, zero_first=False, create=False):
    """A Hogwild worker, right by default, or with one of the usual mistakes."""
    def hogwild_worker(rank, world_size, shm_name, data, lr, num_epochs, seed):
        shm = SharedMemory(name=shm_name, create=create, size=8 if create else 0)
        if view == "ndarray":
            w = np.ndarray((data.n_features,), dtype=np.float64, buffer=shm.buf)
        elif view == "frombuffer":
            w = np.frombuffer(shm.buf, dtype=np.float64, count=data.n_features)
        elif view == "copy":
            w = np.array(np.frombuffer(shm.buf, dtype=np.float64))  # a private copy
        else:
            w = np.frombuffer(shm.buf, dtype=np.float32)  # the wrong dtype
        shared = w
        if zero_first:
            w[:] = 0.0
        if write_back:
            w = w.copy()
            time.sleep(0.3)  # slow enough that the other worker starts meanwhile
        start, stop = shard_bounds(len(data), rank, world_size)
        if rows == "floor split":
            start, stop = rank * (len(data) // world_size), (rank + 1) * (len(data) // world_size)
        order_rows = {"shard": lambda r: start + r, "all": None, "no offset": lambda r: r,
                      "inclusive": lambda r: start + r, "floor split": lambda r: start + r,
                      "strided": lambda r: np.arange(rank, len(data), world_size)[r],
                      "filtered": lambda r: r[(r >= start) & (r < stop)]}[rows]
        size = {"all": len(data), "inclusive": stop - start + 1, "filtered": len(data),
                "strided": len(range(rank, len(data), world_size))}.get(rows, stop - start)
        seed_key = {"rank": [seed, rank], "seed + rank": seed + rank, "seed": seed}[key]
        rng = np.random.default_rng(seed_key)
        for _ in range(num_epochs + epochs):
            if per_epoch_rng:
                rng = np.random.default_rng(seed_key)
            order = rng.permutation(size) if shuffle else np.arange(size)
            if order_rows is not None:
                order = order_rows(order)
            sparse_sgd_epoch(w, data.indptr, data.indices, data.values, data.y, order,
                             lr * step if lr_is is None else lr_is(lr, world_size))
        if write_back:
            shared[:] = w
        if unlink:
            shm.unlink()
        if close_first:
            shm.close()  # np.frombuffer's view refuses it (BufferError), np.ndarray's does not
        if use_after_close:
            w[0] = 1.0  # the block is unmapped: a segmentation fault
        del w, shared
        shm.close()
    return hogwild_worker


def raises_in_worker(rank, world_size, shm_name, data, lr, num_epochs, seed):
    shm = SharedMemory(name=shm_name)
    w = np.ndarray((data.n_features,), dtype=np.float64, buffer=shm.buf)
    w[data.indices[:3]] -= data.values[:4]  # shapes (3,) and (4,): a ValueError here


def dies(rank, world_size, shm_name, data, lr, num_epochs, seed):
    os._exit(3)


def hangs(rank, world_size, shm_name, data, lr, num_epochs, seed):
    while True:
        time.sleep(0.05)


def test_the_right_worker_passes(capsys):
    assert checks_hogwild.check_hogwild_worker(worker())
    assert checks_hogwild.check_hogwild_worker(worker(view="frombuffer"))
    out = capsys.readouterr().out
    assert "4/4 launches" in out and "serial SGD" in out


@pytest.mark.parametrize("wrong, did, fix", [
    (worker(view="copy"), "updated a private copy", "buffer=shm.buf"),
    (worker(view="float32"), "as float32", "dtype=np.float64"),
    (worker(rows="all"), "visited all the rows", "shard_bounds"),
    (worker(rows="no offset"), "the first rows of the data", "add start"),
    (worker(rows="inclusive"), "raised IndexError", "stop - 1"),
    (worker(key="seed + rank"), "default_rng(seed", "default_rng([seed, rank])"),
    (worker(per_epoch_rng=True), "same order in every epoch", "create the generator once"),
    (worker(epochs=1), "one epoch more", "range(num_epochs)"),
    (worker(step=-1.0), "uphill", "w[idx] -= lr"),
    (worker(unlink=True), "was gone", "the parent unlinks"),
    (worker(view="frombuffer", close_first=True), "BufferError", "del w"),
    (worker(close_first=True, use_after_close=True), "exited with code -11", "del w first"),
    (worker(write_back=True), "every update of worker", "writes it back"),
    (raises_in_worker, "worker 0 raised ValueError", "w[data.indices[:3]]"),
    (dies, "exited with code 3", "ended without an exception"),
])
def test_worker_mistakes_fail_with_a_hint(wrong, did, fix):
    with pytest.raises(CheckFailed) as failed:
        checks_hogwild.check_hogwild_worker(wrong)
    message = str(failed.value)
    assert did in message and fix in message, message


@pytest.mark.parametrize("wrong, said", [
    # default_rng(seed) is default_rng([seed, 0]): rank 0's stream on every rank
    (worker(key="seed"), r"case 3/4 \(worker 1 of 2, alone[\s\S]*came from "
                         r"np.random.default_rng\(seed\), whatever its rank \(the stream of "
                         r"default_rng\(\[seed, 0\]\)\)"),
    (worker(rows="strided"), r"case 2/4 [\s\S]*visited rows rank, rank \+ world_size, \.\.\. \(a "
                             r"strided split\)"),
    (worker(rows="filtered"), r"case 2/4 [\s\S]*a permutation of ALL the rows with the rows "
                              r"outside its shard left out"),
    (worker(rows="floor split"), r"case 2/4 [\s\S]*the last rows \(len\(data\) % world_size of "
                                 r"them\) belong to no worker"),
    (worker(shuffle=False), r"visited its rows in their stored order, without shuffling"),
    (worker(epochs=-1), r"ran one epoch fewer than num_epochs"),
    (worker(lr_is=lambda lr, world_size: 1.0), r"stepped as if lr were 1"),
    (worker(lr_is=lambda lr, world_size: lr / world_size), r"case 2/4 [\s\S]*stepped with lr / "
                                                           r"world_size\.\nHint: every worker"),
    (worker(zero_first=True), r"set the shared vector to zeros before its epochs"),
    (worker(create=True), r"raised FileExistsError[\s\S]*Hint: your worker asked for a NEW block"),
], ids=["seed only", "strided", "filtered permutation", "floor split",
        "not shuffled", "one epoch short", "lr 1", "lr / world_size", "zeros first",
        "create=True"])
def test_more_worker_mistakes(wrong, said):
    with pytest.raises(CheckFailed, match=said):
        checks_hogwild.check_hogwild_worker(wrong)


def test_a_worker_that_never_returns_is_killed_at_the_deadline():
    began = time.monotonic()
    with pytest.raises(CheckFailed, match="did not return within 2 s"):
        checks_hogwild.check_hogwild_worker(hangs, timeout=2)
    assert_no_hang(time.monotonic() - began, 2, timed_out=True)
    import multiprocessing
    assert not [p for p in multiprocessing.active_children() if "hogwild-worker" in p.name]


def test_worker_template_is_a_notice(capsys):
    def hogwild_worker(rank, world_size, shm_name, data, lr, num_epochs, seed):
        raise NotImplementedError("fill in hogwild_worker")
    assert checks_hogwild.check_hogwild_worker(hogwild_worker) is False
    assert "not implemented" in capsys.readouterr().out


def test_run_workers_leaves_no_block_behind():
    from course_lib.sparse_problem import make_sparse_classification, serial_sgd

    def blocks():  # SharedMemory's names on Linux (only lab 03 creates them)
        return {f for f in os.listdir("/dev/shm") if f.startswith("psm_")}
    linux = os.path.isdir("/dev/shm")
    before = blocks() if linux else set()
    data = make_sparse_classification(300, 200, 5, seed=2)
    w = checks_hogwild.run_workers(worker(), data, world_size=1, lr=0.5, num_epochs=2, seed=4)
    np.testing.assert_array_equal(w, serial_sgd(data, lr=0.5, num_epochs=2, seed=4)[0])
    with pytest.raises(CheckFailed):
        checks_hogwild.check_hogwild_worker(worker(unlink=True))
    with pytest.raises(CheckFailed):
        checks_hogwild.check_hogwild_worker(dies)
    if linux:
        assert blocks() <= before
