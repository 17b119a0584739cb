"""Lab 10's checks (course_lib/checks/lab10_sharded_data_parallelism.py): the reference passes,
typical mistakes fail with their hint."""

import pytest
import torch

from course_lib import collectives
from course_lib.checks import CheckFailed
from course_lib.checks import lab10_sharded_data_parallelism as checks
from course_lib.sharding import shard_bounds

CLUSTER_SIZE = 4  # world sizes 2, 3 and 4 on the first ranks of one cluster
CLUSTER_BACKEND = "gloo"  # CPU tensors, as in the lab



def reduce_scatter(buf, comm):
    """Lab 05's ring reduce-scatter, as a student writes it (on comm.sendrecv)."""
    rank, N = comm.rank, comm.world_size
    chunks = [shard_bounds(len(buf), c, N) for c in range(N)]
    for s in range(N - 1):
        s0, s1 = chunks[(rank - s - 1) % N]
        r0, r1 = chunks[(rank - s - 2) % N]
        tmp = torch.empty_like(buf[r0:r1])
        comm.sendrecv(buf[s0:s1], (rank + 1) % N, tmp, (rank - 1) % N)
        buf[r0:r1] += tmp
    return chunks[rank]


def all_gather(buf, comm):
    """Lab 05's ring all-gather, as a student writes it."""
    rank, N = comm.rank, comm.world_size
    chunks = [shard_bounds(len(buf), c, N) for c in range(N)]
    for s in range(N - 1):
        s0, s1 = chunks[(rank - s) % N]
        r0, r1 = chunks[(rank - s - 1) % N]
        comm.sendrecv(buf[s0:s1], (rank + 1) % N, buf[r0:r1], (rank - 1) % N)
    return buf


# ---------------------------------------------------------------- exercise 1
def test_ring_collectives_check_runs_lab05s_checks(cluster, capsys):
    assert checks.check_ring_collectives(reduce_scatter, all_gather, cluster) is True
    out = capsys.readouterr().out
    assert "check_ring_reduce_scatter" in out and "check_ring_allgather" in out

    def unfinished(buf, comm):
        raise NotImplementedError
    assert checks.check_ring_collectives(unfinished, all_gather, cluster) is False

    def gathers_nothing(buf, comm):
        return buf
    with pytest.raises(CheckFailed, match="holds only what it started with: nothing was received"):
        checks.check_ring_collectives(reduce_scatter, gathers_nothing, cluster)


# ---------------------------------------------------------------- exercise 2
def reference(params, grads, momentum_shard, comm, lr, momentum, reduce_scatter, all_gather):
    g = grads.clone()
    start, stop = reduce_scatter(g, comm)
    g = g[start:stop] / comm.world_size
    if momentum_shard is None:
        momentum_shard = torch.zeros_like(g)
    momentum_shard = momentum * momentum_shard + g
    params[start:stop] -= lr * momentum_shard
    all_gather(params, comm)
    return momentum_shard


def make_step(mistake):
    """The reference step with one typical mistake."""
    def step(params, grads, momentum_shard, comm, lr, momentum, reduce_scatter, all_gather):
        rank, N, n = comm.rank, comm.world_size, len(params)
        g = grads if mistake == "grads in place" else grads.clone()
        if mistake == "rank 0 skips the collectives" and rank == 0:  # rank 1 waits for it
            a, b = shard_bounds(n, rank, N)
            return torch.zeros(b - a, dtype=params.dtype)
        if mistake == "all-gather first":
            all_gather(params, comm)
        if mistake == "reduce-scatter params":
            g = params
        start, stop = reduce_scatter(g, comm)
        if mistake == "reduce-scatter params":
            g = grads.clone()  # (the chunk's gradient, unreduced: the values are wrong anyway)
        if mistake == "torch.chunk":
            sizes = [len(c) for c in torch.arange(n).chunk(N)]
            start = sum(sizes[:rank])
            stop = start + (sizes[rank] if rank < len(sizes) else 0)
        if mistake == "another rank's chunk":
            start, stop = shard_bounds(n, (rank + 1) % N, N)
        if mistake == "equal chunks":
            start, stop = rank * (n // N), (rank + 1) * (n // N)
        if mistake == "allreduce the gradient":
            all_gather(g, comm)
        if mistake == "whole vector":  # DDP's update on every rank, DDP's momentum
            start, stop = 0, n
        mine = (grads if mistake == "local gradient" else g)[start:stop]
        if mistake not in ("sum", "no all-gather, sum"):
            mine = mine / N
        if mistake == "dampened momentum":  # m = momentum * m + (1 - momentum) * g
            mine = (1 - momentum) * mine
        if mistake in ("momentum reset every step", "plain SGD"):
            momentum_shard = None
        if mistake == "plain SGD":
            momentum = 0.0
        if momentum_shard is None:
            size = {"momentum one too long": stop - start + 1, "momentum of DDP's size": n,
                    "momentum one too long, all of it": stop - start + 1}
            momentum_shard = torch.zeros(size.get(mistake, stop - start), dtype=params.dtype)
        old = momentum_shard
        if mistake == "momentum one too long":
            momentum_shard[:stop - start] = momentum * momentum_shard[:stop - start] + mine
            update = momentum_shard[:stop - start]
        else:
            momentum_shard = momentum * momentum_shard + mine
            update = momentum_shard
        if mistake == "update a copy":
            params = params.clone()
        params[start:stop] -= lr * update
        if mistake == "all-gather the gradient instead":
            all_gather(g, comm)
        elif mistake == "all-gather the chunk":
            all_gather(params[start:stop], comm)
        elif not mistake.startswith("no all-gather") and mistake != "all-gather first":
            all_gather(params, comm)
        if mistake == "raises":
            raise ValueError("something went wrong on purpose")
        return {"returns None": None, "returns params": params,
                "returns the old momentum": old}.get(mistake, momentum_shard)
    return step


@pytest.mark.parametrize("mistake,hint", [
    ("sum", r"update is N = 2 times DDP's: the reduce-scatter leaves the SUM"),
    ("no all-gather", r"only rank 0's own chunk params\[0:4\] is right \(your step never "
                      r"called all_gather\)"),
    ("another rank's chunk", r"rank 0 had changed params\[4:7\] \(rank 1's chunk\), but its "
                             r"chunk is params\[0:4\] = shard_bounds\(7, 0, 2\)"),
    ("equal chunks", r"rank 0 had changed params\[0:3\], but its chunk is params\[0:4\]"),
    ("local gradient", r"updated with its own local gradient \(divided by N\), not with the sum"),
    ("update a copy", r"params did not change: the caller sees only what happens to the tensor"),
    ("returns the old momentum", r"step 1 was right, but step 2 is plain SGD"),
    ("whole vector", r"keeps a momentum of 7 numbers, one per parameter: that is DDP's memory"),
    ("momentum of DDP's size", r"The size of tensor a \(7\) must match.*\nHint: a tensor of "
                               r"len\(params\) = 7 numbers met one of rank 0's chunk.*A "
                               r"momentum of 7 numbers would be DDP's memory"),
    ("momentum one too long", r"momentum shard has shape \(5,\); its chunk"),
    ("returns None", r"returned None: return the momentum shard"),
    ("returns params", r"returned params: return the momentum shard"),
    ("grads in place", r"changed the caller's grads\nHint: reduce-scatter a copy"),
    ("allreduce the gradient", r"1 reduce-scatter\(s\) \['a copy'\] and 2 all-gather\(s\) "
                               r"\['a copy', 'params'\]\. You also all-gathered the gradient"),
    ("raises", r"raised on rank 0: ValueError: something went wrong on purpose"),
    ("no all-gather, sum", r"your step never called all_gather; and rank 0's update is N = 2 "
                           r"times DDP's"),
    ("all-gather the gradient instead", r"own chunk params\[0:4\] is right \(your step "
                                        r"all-gathered a copy, not params\)"),
    ("dampened momentum", r"Hint: your momentum is dampened \(the gradient weighted by 1 - "
                          r"momentum\)"),
    ("momentum one too long, all of it", r"size of tensor a \(5\).*\nHint: two tensors of "
                                         r"different lengths met"),
    ("rank 0 skips the collectives", r"raised on rank 1: CommTimeout.*\nHint: the ranks "
                                     r"waited for each other past their deadline"),
    ("all-gather first", r"rank 0: params differ from DDP's .*\nHint: your step all-gathered "
                         r"params before updating them: the all-gather sent every rank the old "
                         r"values"),
    ("momentum reset every step", r"after step 2\n.*\nHint: step 1 was right, but step 2 is plain "
                                  r"SGD"),
    ("plain SGD", r"after step 2\n.*\nHint: step 1 was right, but step 2 is plain SGD"),
    ("reduce-scatter params", r"Hint: your step reduce-scattered params: what the ranks must sum "
                              r"is their gradients"),
    ("torch.chunk", r"case 2/4 .*\n.*\nHint: before its all-gather rank 1 had changed "
                    r"params\[4:8\], but its chunk is params\[4:7\] = shard_bounds\(10, 1, 3\)"),
    ("all-gather the chunk", r"Hint: your step called all_gather on a slice of params: the ring "
                             r"cuts the tensor it is given into N chunks"),
])
def test_zero1_check_names_the_mistake(cluster, mistake, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_zero1_step(make_step(mistake), reduce_scatter, all_gather, cluster)
    hint_text = str(failed.value).split("Hint:", 1)[-1]
    assert not [code for code in RECIPES if code in hint_text], hint_text  # the what, not the how


RECIPES = ("Divide it by N", "g[start:stop]", "all_gather(params", "-= ...", "torch.zeros(",
           "update params[")


def test_zero1_check_passes_the_reference(cluster, capsys):
    assert checks.check_zero1_step(reference, reduce_scatter, all_gather, cluster) is True
    assert "4/4 cases (3 steps each, on 2, 3 and 4 ranks) match DDP" in capsys.readouterr().out
    # the library's ring (the lab's way out for a student who skipped lab 05) works too
    assert checks.check_zero1_step(reference, collectives.ring_reduce_scatter,
                                   collectives.ring_allgather, cluster) is True


def test_zero1_check_returns_false_until_implemented(cluster, capsys):
    def unfinished(params, grads, momentum_shard, comm, lr, momentum, rs, ag):
        raise NotImplementedError
    assert checks.check_zero1_step(unfinished, reduce_scatter, all_gather, cluster) is False
    assert "not implemented yet" in capsys.readouterr().out

    def ring_unfinished(buf, comm):
        raise NotImplementedError
    assert checks.check_zero1_step(reference, ring_unfinished, all_gather, cluster) is False
    assert "your ring_unfinished (exercise 1) is not implemented" in capsys.readouterr().out


def test_ddp_reference_is_the_mean_gradient_with_momentum():
    ref = checks.ddp_reference(5, 3, steps=2, lr=0.1, momentum=0.9)
    g0, g1 = (sum(step["grads"]) / 3 for step in ref)
    assert ref[0]["after"] == pytest.approx(checks.case_params(5) - 0.1 * g0)
    assert ref[1]["after"] == pytest.approx(ref[0]["after"] - 0.1 * (0.9 * g0 + g1))


# ---------------------------------------------------------------- exercise 3
def memory(num_params, world_size, stage, optimizer_bytes=12, bytes_per_number=2):
    psi, N, K = num_params, world_size, optimizer_bytes
    params = bytes_per_number * psi / (N if stage >= 3 else 1)
    grads = bytes_per_number * psi / (N if stage >= 2 else 1)
    return params + grads + K * psi / (N if stage >= 1 else 1)


def stage_off_by_one(num_params, world_size, stage, optimizer_bytes=12, bytes_per_number=2):
    return memory(num_params, world_size, min(stage + 1, 3), optimizer_bytes, bytes_per_number)


def stage1_shards_gradients(num_params, world_size, stage, optimizer_bytes=12,
                            bytes_per_number=2):
    if stage != 1:
        return memory(num_params, world_size, stage, optimizer_bytes, bytes_per_number)
    b, psi = bytes_per_number, num_params
    return b * psi + b * psi / world_size + optimizer_bytes * psi


def optimizer_bytes_times_bytes(num_params, world_size, stage, optimizer_bytes=12,
                                bytes_per_number=2):
    return memory(num_params, world_size, stage, optimizer_bytes * bytes_per_number,
                  bytes_per_number)


@pytest.mark.parametrize("wrong,hint", [
    (stage_off_by_one, r"that is stage 1's accounting, 4Ψ \+ KΨ/N.*; stage 0 is \(2·2 \+ K\)Ψ"),
    (stage1_shards_gradients, r"you divided the parameters or the gradients by N but not the "
                              r"optimizer state"),
    (optimizer_bytes_times_bytes, r"optimizer_bytes = 12 is already bytes per parameter"),
])
def test_memory_check_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_zero_memory_per_rank(wrong)


def memory_with(**change):
    """The paper's accounting with one of the usual slips."""
    def fn(num_params, world_size, stage, optimizer_bytes=12, bytes_per_number=2):
        psi, N, K, b = num_params, world_size, optimizer_bytes, bytes_per_number
        b = change.get("b", b)
        K = K / bytes_per_number if change.get("k_in_numbers") else K
        n = N - 1 if change.get("n_minus_one") and N > 1 else N
        params = b * psi / (n if stage >= 3 else 1)
        grads = 0 if change.get("no_gradients") else b * psi / (n if stage >= 2 else 1)
        total = params + grads + K * psi / (n if stage >= 1 else 1)
        return total / change.get("unit", 1)
    return fn


@pytest.mark.parametrize("wrong,hint", [
    (memory_with(no_gradients=True), r"you left out the gradients: b bytes for each parameter"),
    (memory_with(b=2), r"case 7/9 [\s\S]*Hint: bytes_per_number is 4 here: you counted 2 bytes a "
                       r"number"),
    (memory_with(k_in_numbers=True), r"optimizer_bytes = 12 is bytes per parameter already: you "
                                     r"divided it by bytes_per_number"),
    (memory_with(n_minus_one=True), r"case 2/9 [\s\S]*Hint: you divided by N - 1 = 63"),
    (memory_with(unit=1e9), r"that is the total in GB \(1e9 bytes\): return it in bytes"),
    (memory_with(unit=2 ** 30), r"that is the total in GiB"),
], ids=["no gradients", "2 bytes a number", "K in numbers", "N - 1", "GB", "GiB"])
def test_more_memory_mistakes(wrong, hint):
    with pytest.raises(CheckFailed, match=hint) as failed:
        checks.check_zero_memory_per_rank(wrong)
    assert "stage 1 divides the optimizer state by N" not in str(failed.value)  # no recipe


def returns_the_lectures_dict(num_params, world_size, stage, optimizer_bytes=12,
                              bytes_per_number=2):
    from course_lib.zero import zero_memory
    return zero_memory(num_params, world_size, stage, optimizer_bytes / bytes_per_number,
                       bytes_per_number)


def test_memory_check_wants_one_number():
    with pytest.raises(CheckFailed, match="expected a number.*got dict\nHint: return the total"):
        checks.check_zero_memory_per_rank(returns_the_lectures_dict)


def test_memory_check_passes_the_paper_and_waits_for_an_answer(capsys):
    assert checks.check_zero_memory_per_rank(memory) is True
    assert "9/9 cases" in capsys.readouterr().out
    assert checks.zero_memory_reference(7.5e9, 64, 0) == pytest.approx(120e9)
    assert checks.zero_memory_reference(7.5e9, 64, 3) == pytest.approx(120e9 / 64)

    def unfinished(num_params, world_size, stage, optimizer_bytes=12, bytes_per_number=2):
        raise NotImplementedError
    assert checks.check_zero_memory_per_rank(unfinished) is False


# ---------------------------------------------------------------- exercise 4: FSDP's rows
def gather_rows(pieces, shapes, comm, all_gather, pad=True, by_rank=True):
    import math
    N, r = comm.world_size, comm.rank
    if pad:
        padded = [math.ceil((s[0] if len(s) else 1) / N) * math.prod(s[1:]) for s in shapes]
    else:  # this rank's pieces as they are: the chunks differ from rank to rank if uneven
        padded = [piece.numel() for piece in pieces]
    chunk = sum(padded)
    flat = torch.zeros(N * chunk, dtype=pieces[0].dtype)
    at = r * chunk
    for piece, size in zip(pieces, padded, strict=True):
        flat[at:at + piece.numel()] = piece.reshape(-1)
        at += size
    all_gather(flat, comm)
    table, at, whole = flat.view(N, chunk), 0, []
    for shape, size in zip(shapes, padded, strict=True):
        part = table[:, at:at + size] if by_rank else flat[N * at:N * (at + size)].view(N, size)
        whole.append(part.reshape(-1)[:math.prod(shape)].view(shape))
        at += size
    return whole


def reduce_scatter_rows(grads, comm, reduce_scatter, mean=True):
    import math
    N, r = comm.world_size, comm.rank
    per = [math.ceil(g.shape[0] / N) for g in grads]
    padded = [p * g[0].numel() for p, g in zip(per, grads, strict=True)]
    chunk = sum(padded)
    table, at = torch.zeros(N, chunk, dtype=grads[0].dtype), 0
    for g, size in zip(grads, padded, strict=True):
        rows = torch.zeros(N * size, dtype=g.dtype)
        rows[:g.numel()] = g.reshape(-1)
        table[:, at:at + size] = rows.view(N, size)
        at += size
    flat = table.reshape(-1)
    reduce_scatter(flat, comm)
    mine, out, at = flat[r * chunk:(r + 1) * chunk] / (N if mean else 1), [], 0
    for g, p, size in zip(grads, per, padded, strict=True):
        n = max(0, min(p, g.shape[0] - r * p)) * (size // p)
        out.append(mine[at:at + n].view(-1, *g.shape[1:]))
        at += size
    return out


def one_gather_per_parameter(pieces, shapes, comm, all_gather):
    return [gather_rows([p], [s], comm, all_gather)[0] for p, s in zip(pieces, shapes,
                                                                        strict=True)]


def test_fsdp_rows_check_passes_the_reference(cluster, capsys):
    assert checks.check_fsdp_rows(gather_rows, reduce_scatter_rows, reduce_scatter, all_gather,
                                  cluster) is True
    assert "✓ check_fsdp_rows: 3/3 units" in capsys.readouterr().out


@pytest.mark.parametrize("gather, reduce, hint", [
    (lambda *a: gather_rows(*a, pad=False), reduce_scatter_rows, "pad each piece"),
    (lambda *a: gather_rows(*a, by_rank=False), reduce_scatter_rows,
     "the buffer is rank by rank"),
    (one_gather_per_parameter, reduce_scatter_rows, "you called the all-gather 2 times"),
    (gather_rows, lambda *a: reduce_scatter_rows(*a, mean=False), "divide the sum by N"),
])
def test_fsdp_rows_check_names_the_mistake(cluster, gather, reduce, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_fsdp_rows(gather, reduce, reduce_scatter, all_gather, cluster)


def test_fsdp_rows_check_waits_for_an_answer(cluster, capsys):
    def gather(pieces, shapes, comm, all_gather):
        raise NotImplementedError
    assert checks.check_fsdp_rows(gather, reduce_scatter_rows, reduce_scatter, all_gather,
                                  cluster) is False
