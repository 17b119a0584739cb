"""What tests and notebook 11 run on every rank: sharded checkpoints written and read back.
Introduced in notebooks/11_fault_tolerance.ipynb."""

from __future__ import annotations

import torch

from course_lib import checkpoint
from course_lib.comm import get_comm


def save_and_load_sharded(directory, steps=(10, 20), timeout=20.0):
    """Each rank saves its part ``step + rank`` (3 numbers) at each of ``steps``, then loads the
    newest committed step back. Introduced in notebooks/11_fault_tolerance.ipynb."""
    comm = get_comm("torch", timeout=timeout)
    for step in steps:
        checkpoint.save_sharded(torch.full((3,), float(step + comm.rank)), directory, step, comm)
    part, folder = checkpoint.load_sharded(directory, comm.rank, comm.world_size)
    return {"rank": comm.rank, "part": part, "loaded_step": int(folder.name.split("-")[1])}


def save_killed_mid_write(path, naive=False, step=2, numbers=100_000):
    """Save a checkpoint of ``numbers`` float64 into ``path`` in a new Python process that is
    SIGKILLed half-way through the write (the fault point ``checkpoint-mid-write``): with
    ``naive=True`` by :func:`checkpoint.naive_save` into the file ``path``, else by
    :func:`checkpoint.save` into the directory ``path``. Returns the process's exit code.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    import subprocess
    import sys
    save = (f"checkpoint.naive_save(state, {str(path)!r})" if naive
            else f"checkpoint.save(state, {str(path)!r}, step={step})")
    code = ("import torch\n"
            "from course_lib import checkpoint\n"
            "from course_lib.runtime import fault_points\n"
            "fault_points.arm('checkpoint-mid-write', 'kill')\n"
            f"state = {{'w': torch.arange({numbers}, dtype=torch.float64), 'step': {step}}}\n"
            f"{save}\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                          text=True).returncode


def dcp_round_trip(directory, timeout=20.0):
    """On every rank: a state sharded over the ranks (a DTensor, rows split) and the step, saved
    by ``torch.distributed.checkpoint`` (DCP) and loaded into a fresh state; then saved again
    *into the same directory* by a writer that dies after the data files and before
    ``.metadata`` (DCP's commit), and loaded once more. Returns the files DCP wrote, whether
    the first load was exact, and what the second load read: the step the metadata describes
    beside whose numbers came back. Introduced in notebooks/11_fault_tolerance.ipynb."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    comm = get_comm("torch", timeout=timeout)
    mesh = init_device_mesh("cpu", (comm.world_size,))

    def state(step):
        full = torch.full((4 * comm.world_size, 3), float(step), dtype=torch.float64)
        return {"w": distribute_tensor(full, mesh, [Shard(0)]),
                "step": torch.tensor(step)}

    def load():
        target = state(0)
        dcp.load(target, checkpoint_id=directory)
        return target["w"].full_tensor(), int(target["step"])

    dcp.save(state(10), checkpoint_id=directory)
    files = sorted(p.name for p in Path(directory).iterdir())
    w, step = load()
    exact = bool(torch.equal(w, state(10)["w"].full_tensor())) and step == 10

    class DiesBeforeMetadata(FileSystemWriter):
        def finish(self, metadata, results):  # the data files are written; the commit is not
            raise RuntimeError("killed before .metadata")
    try:
        dcp.save(state(20), storage_writer=DiesBeforeMetadata(directory))
    except CheckpointException:  # every rank hears of the coordinator's failure
        pass
    w, step = load()
    values = sorted({float(v) for v in w.unique()})
    return {"files": files, "exact": exact, "step_after_crash": step,
            "values_after_crash": values}


# ---------------------------------------------------------------- DCP on another layout
RESHARD_WIDTH = 64  # the resharded MLP: Linear(W, 4W), ReLU, Linear(4W, W)


def reshard_model(seed, width=RESHARD_WIDTH):
    """The MLP saved on one layout and loaded on others (float32, seeded)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(),
                               torch.nn.Linear(4 * width, width))


def _quiet_dtensor():
    """DTensor logs a warning for each 2-D redistribution and DCP a deprecation: not the
    lesson's."""
    import logging
    import warnings
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torch.distributed")


def _sharded(model, dp, tp=1):
    """``model`` on a dp x tp mesh of this process group: the first Linear column-parallel and
    the second row-parallel over tp (Megatron's pair, notebook 09), then FSDP2's
    ``fully_shard`` per Linear and on the whole over dp. An Adam over its parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model, optimizer, steps, rank, width=RESHARD_WIDTH):
    for step in range(steps):
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def full_state(model, optimizer):
    """Model and optimizer state as full, named tensors (what every layout must agree on)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": model_state, "optim": optim_state["state"]}


def _layout(model):
    """Each parameter's placements and this rank's box (offsets, sizes) of it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    boxes = {}
    for name, p in model.named_parameters():
        sizes, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                               p.placements)
        boxes[name] = {"placements": [str(x) for x in p.placements],
                       "box": (tuple(offsets), tuple(sizes))}
    return boxes


def dcp_save_trained(directory, steps=3, step=3, timeout=20.0):
    """On every rank: the MLP sharded by FSDP2 over all ranks (dp = world size), ``steps``
    steps of Adam, then model and optimizer saved with :func:`checkpoint.dcp_save` as step
    ``step`` of ``directory``. Rank 0 returns the full state; every rank its layout.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    _quiet_dtensor()
    comm = get_comm("torch", timeout=timeout)
    model, optimizer = _sharded(reshard_model(0), comm.world_size)
    _train(model, optimizer, steps, comm.rank)
    model_state, optim_state = get_state_dict(model, optimizer)
    checkpoint.dcp_save({"model": model_state, "optim": optim_state}, directory, step)
    full = full_state(model, optimizer)
    return {"rank": comm.rank, "layout": _layout(model), "full": full if comm.rank == 0 else None}


def _load(model, optimizer, folder, no_dist=False, plan_of=None):
    """``folder``'s DCP checkpoint loaded into ``model`` and ``optimizer`` (any layout): the
    shapes to fill come from their own state dicts. Returns the reads DCP planned for tensor
    ``plan_of`` of the model, if one is named."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(model, optimizer)
    reads = plan_of and dcp_read_plan({"model": model_state}, folder, f"model.{plan_of}")
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder,
             no_dist=no_dist)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return reads


def dcp_load_resharded(directory, dp, tp, plan_of="2.weight", timeout=20.0):
    """On every rank: a fresh MLP (other numbers) on a dp x tp mesh, its state loaded by DCP
    from the newest committed step of ``directory``, whatever layout saved it. Rank 0 returns
    the full state; every rank its layout and the reads DCP planned for ``plan_of``.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    _quiet_dtensor()
    comm = get_comm("torch", timeout=timeout)
    model, optimizer = _sharded(reshard_model(1), dp, tp)
    reads = _load(model, optimizer, checkpoint.dcp_latest(directory), plan_of=plan_of)
    full = full_state(model, optimizer)
    return {"rank": comm.rank, "layout": _layout(model), "reads": reads,
            "full": full if comm.rank == 0 else None}


def dcp_load_one_process(directory):
    """The same load in this process alone, with no process group: a plain MLP and Adam."""
    _quiet_dtensor()
    model = reshard_model(2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _load(model, optimizer, checkpoint.dcp_latest(directory), no_dist=True)
    return full_state(model, optimizer)


def differences(a, b):
    """The names of the tensors where two full states differ (not bitwise equal): [] if none."""
    names = [("model", k) for k in a["model"]]
    names += [("optim", (k, n)) for k, entry in a["optim"].items() for n in entry]
    def get(state, part, key):
        return state[part][key] if part == "model" else state[part][key[0]][key[1]]
    return [f"{part} {key}" for part, key in names
            if not torch.equal(get(a, part, key), get(b, part, key))]


def saved_chunks(folder, name):
    """The boxes (offsets, sizes) of tensor ``name`` as its writers saved them, and the file
    each box is in, read from DCP's ``.metadata``: ``(boxes, files)``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex
    metadata = FileSystemReader(folder).read_metadata()
    chunks = metadata.state_dict_metadata[name].chunks
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
    files = [metadata.storage_data[MetadataIndex(name, c.offsets)].relative_path for c in chunks]
    return boxes, files


def dcp_read_plan(state_dict, folder, name):
    """The reads DCP's own load planner makes for tensor ``name`` of this rank's
    ``state_dict`` (sharded, as ``dcp.load`` takes it): dicts like
    :func:`checkpoint.reshard_reads`'s, each with the saved chunk's offsets."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    metadata = FileSystemReader(folder).read_metadata()
    flat, _ = flatten_state_dict(state_dict)
    plan = create_default_local_load_plan(flat, metadata)
    return [{"chunk_offsets": tuple(item.storage_index.offset),
             "storage_offsets": tuple(item.storage_offsets),
             "dest_offsets": tuple(item.dest_offsets), "lengths": tuple(item.lengths)}
            for item in plan.items if item.dest_index.fqn == name]


def plan_matches(boxes, box, dcp_reads):
    """Whether :func:`checkpoint.reshard_reads` of the saved ``boxes`` for the shard ``box``
    gives the reads DCP planned (``dcp_reads``, from :func:`dcp_read_plan`), in any order."""
    ours = {(boxes[r["chunk"]][0], r["storage_offsets"], r["dest_offsets"], r["lengths"])
            for r in checkpoint.reshard_reads(boxes, box)}
    theirs = {(r["chunk_offsets"], r["storage_offsets"], r["dest_offsets"], r["lengths"])
              for r in dcp_reads}
    return ours == theirs and len(dcp_reads) == len(ours)


def async_save_overlap(directory, mib_per_rank=8, step_s=0.06, steps=4, cpu_bound=False,
                       storage_mb_s=None, repeats=3, timeout=20.0):
    """On every rank: how much of a DCP save ``async_save`` hides behind the next ``steps``
    training steps, against ``save``. The state is ``mib_per_rank`` MiB of float32 per rank (a
    DTensor sharded by rows) and the step number. A step lasts ``step_s`` and ends in an
    allreduce: asleep, as a GPU job's CPU is while the device computes, or (``cpu_bound``)
    multiplying matrices on this CPU the whole time, as a CPU job's does. ``storage_mb_s``:
    each rank writes to an emulated storage of that many MB/s (None: this machine's disk).
    Medians over
    ``repeats``, in seconds, of: ``plain`` (the steps alone), ``save`` (a blocking save),
    ``blocked`` (until ``async_save`` returns: the copy of the state), ``during`` (the steps
    while the write runs), ``wait`` (for the write's end after them); ``hidden`` = save + plain -
    (blocked + during + wait). Introduced in notebooks/11_fault_tolerance.ipynb."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    _quiet_dtensor()
    comm = get_comm("torch", timeout=timeout)
    mesh = init_device_mesh("cpu", (comm.world_size,))
    writer_group = dist.new_group(backend="gloo")  # the writer's collectives, off training's
    rows = mib_per_rank * 256  # rows of 1,024 float32 = 4 KiB each
    local = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(comm.rank))
    state = {"w": DTensor.from_local(local, mesh, [Shard(0)]), "step": torch.tensor(0)}
    a = torch.randn(256, 256)
    bandwidth = storage_mb_s * 1e6 if storage_mb_s else None

    def train():
        start = time.perf_counter()
        for _ in range(steps):
            end = time.perf_counter() + step_s
            if cpu_bound:
                while time.perf_counter() < end:
                    a @ a
            else:
                time.sleep(step_s)
            dist.all_reduce(torch.zeros(1))
        return time.perf_counter() - start

    found = []
    for r in range(repeats):
        plain = train()
        dist.barrier()
        start = time.perf_counter()
        checkpoint.dcp_save(state, directory, 2 * r, storage_bytes_per_s=bandwidth)
        save = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        future = checkpoint.dcp_save(state, directory, 2 * r + 1, asynchronous=True,
                                     process_group=writer_group, storage_bytes_per_s=bandwidth)
        blocked = time.perf_counter() - start
        during = train()
        start = time.perf_counter()
        future.result()
        wait = time.perf_counter() - start
        found.append({"plain": plain, "save": save, "blocked": blocked, "during": during,
                      "wait": wait, "hidden": save + plain - (blocked + during + wait)})
    dist.destroy_process_group(writer_group)
    return sorted(found, key=lambda row: row["hidden"])[len(found) // 2]
