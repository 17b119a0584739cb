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
