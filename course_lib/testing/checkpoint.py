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
            "from course_lib import checkpoint, faults\n"
            "faults.arm('checkpoint-mid-write', 'kill')\n"
            f"state = {{'w': torch.arange({numbers}, dtype=torch.float64), 'step': {step}}}\n"
            f"{save}\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                          text=True).returncode
