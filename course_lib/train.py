"""One training script, whatever launched it: the local cluster, torchrun, mpiexec or SLURM.

Introduced in notebooks/12_scaling_out.ipynb. Notebooks 02-11 hide ``init_process_group``
behind ``start_cluster``. A script meant for a real cluster finds its rank, the world size
and the address of rank 0 in its environment, and each launcher writes them differently:

===========  ==========================================  ===================================
launcher     rank, world size                            where rank 0 listens
===========  ==========================================  ===================================
torchrun     ``RANK``, ``WORLD_SIZE``                    ``MASTER_ADDR``, ``MASTER_PORT``
mpiexec      ``PMI_RANK``/``OMPI_COMM_WORLD_RANK``, MPI  rank 0 picks a port, MPI tells all
SLURM srun   ``SLURM_PROCID``, ``SLURM_NTASKS``          first host of ``SLURM_JOB_NODELIST``
the cluster  set up by ``start_cluster``                 (already connected)
===========  ==========================================  ===================================

Everything after the set-up is the same: data-parallel SGD on the digits (float64), each rank a
slice of every global batch, the gradients summed by an allreduce. For the same world size and
seed, every launcher gives the same losses, bit for bit::

    torchrun --nproc-per-node 2 -m course_lib.train --steps 20 --out run.json
    mpiexec -n 2 python -m course_lib.train --steps 20 --out run.json
    srun -n 2 python -m course_lib.train --steps 20 --out run.json

torch is imported by the functions that train, not at the top: a notebook reads
:func:`command` and calls :func:`launch` (which starts other processes) without paying torch's
seconds of import.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from datetime import timedelta

from course_lib import data, models
from course_lib.comm import init_torch_from_launcher
from course_lib.runtime import hosts
from course_lib.runtime.engine import ENGINE
from course_lib.runtime.launch import mpiexec_path, run_ranks

LAUNCHERS = ("cluster", "torchrun", "mpiexec", "slurm", "single")


def detect_launcher(environ: Mapping[str, str] | None = None) -> str:
    """Which launcher started this process, from its environment (and the cluster's engine
    state). Introduced in notebooks/12_scaling_out.ipynb."""
    env = os.environ if environ is None else environ
    if environ is None and "rank" in ENGINE:  # setup_engine ran here: a cluster's engine
        return "cluster"
    if "RANK" in env and "MASTER_PORT" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return "slurm"
    if any(k in env for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        return "mpiexec"
    return "single"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"node[03-05,09],gpu1"`` -> ``"node03"``.
    Introduced in notebooks/12_scaling_out.ipynb."""
    # a prefix up to the first "," or "[", then an optional [ranges]: "node" + "03-05,09"
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")  # "03-05" -> "03"


def hostnames(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in order and zero padding kept, as ``scontrol show
    hostnames`` prints them: ``"node[01-03,07],gpu1"`` -> ``node01 node02 node03 node07 gpu1``;
    the first is :func:`first_host`. Introduced in notebooks/12_scaling_out.ipynb."""
    names = []
    # items are separated by the commas outside brackets: a prefix, then optional [ranges]
    for prefix, ranges in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip()):
        if not ranges:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            # "08-10": node08 node09 node10, as wide as the lower bound is written
            names += [f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high or low) + 1)]
    return names


def slurm_rendezvous(env: Mapping[str, str] | None = None) -> tuple[int, int, str, int]:
    """(rank, world size, MASTER_ADDR, MASTER_PORT) of a task started by ``srun``: the port is
    derived from the job id so every task of the job computes the same one.
    Introduced in notebooks/12_scaling_out.ipynb."""
    env = os.environ if env is None else env
    rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    # 10000-19999: below the ports Linux hands out to outgoing connections (32768-60999),
    # which could already hold a port in that range on a busy node
    port = int(env.get("MASTER_PORT") or 10000 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
    return rank, world_size, addr, port


def init_from_launcher(timeout: float = 30.0) -> tuple[int, int, str]:
    """Create the default process group (Gloo) from what the launcher put in the environment;
    returns ``(rank, world_size, launcher)``. Every wait has the deadline ``timeout`` s.
    Introduced in notebooks/12_scaling_out.ipynb."""
    import torch.distributed as dist  # not at the top (see the module docstring)

    launcher = detect_launcher()
    deadline = timedelta(seconds=timeout)
    if launcher == "cluster" or dist.is_initialized():
        pass
    elif launcher in ("torchrun", "mpiexec"):
        init_torch_from_launcher("gloo", timeout=timeout)
    elif launcher == "slurm":
        rank, world_size, addr, port = slurm_rendezvous()
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world_size, timeout=deadline)
    else:  # one process, no launcher: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=deadline)
    return dist.get_rank(), dist.get_world_size(), launcher


def train(steps: int = 20, seed: int = 0, batch_size: int = 64, lr: float = 0.1,
          hidden: int = 32, timeout: float = 30.0) -> dict:
    """On every rank: data-parallel SGD on the digits for ``steps`` steps. The global batch of
    step s is drawn by a generator seeded with (seed, s); each rank takes its slice, sums the
    gradients with an allreduce and divides by the global batch. Returns the losses (the same
    on every rank), a SHA-256 of the final parameters, and where it ran.
    Introduced in notebooks/12_scaling_out.ipynb."""
    import torch  # not at the top (see the module docstring)
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world_size, launcher = init_from_launcher(timeout)
    torch.set_num_threads(1)  # the same sums in the same order, whoever launched it
    X, y, _, _ = data.load_digits()
    X, y = torch.from_numpy(X), torch.from_numpy(y)
    model = models.mlp(X.shape[1], hidden, 10, seed=seed).double()
    losses = []
    for step in range(steps):
        # every rank draws the same global batch (same seed), then keeps its contiguous slice:
        # rows [r B / W, (r+1) B / W), which also covers B not divisible by W
        rows = torch.randperm(len(X), generator=torch.Generator().manual_seed(
            seed * 1_000_003 + step))[:batch_size]
        mine = rows[rank * batch_size // world_size:(rank + 1) * batch_size // world_size]
        loss_sum = F.cross_entropy(model(X[mine]), y[mine], reduction="sum")
        model.zero_grad()
        loss_sum.backward()
        for p in model.parameters():  # the sum of the slices' gradients: the global batch's
            dist.all_reduce(p.grad)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad / batch_size
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / batch_size)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "params_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "rank": rank, "world_size": world_size, "launcher": launcher,
            "host": socket.gethostname()}


WAYS = ("torchrun", "mpiexec", "srun", "two hosts", "mpiexec, two hosts")


def command(way: str, world_size: int = 2, args: Sequence[object] = ()) -> list[str]:
    """The command line that launches the script ``world_size`` ways by ``way`` (one of
    ``WAYS``; for "two hosts", the command of host 0 of ``world_size`` hosts, one rank each).
    Introduced in notebooks/12_scaling_out.ipynb."""
    script = ["-m", "course_lib.train", *map(str, args)]
    if way == "torchrun":
        return ["torchrun", "--standalone", "--nproc-per-node", str(world_size), *script]
    if way == "mpiexec":
        return ["mpiexec", "-n", str(world_size), "python", *script]
    if way == "srun":
        return ["srun", "-n", str(world_size), "--time", "5", "python", *script]
    if way == "two hosts":
        return ["torchrun", "--nnodes", str(world_size), "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "hostA:29400",
                "--rdzv-id", "course", *script]
    if way == "mpiexec, two hosts":  # run on hostA; hostB's proxy is started through rsh
        return ["mpiexec", "-launcher", "rsh", "-launcher-exec", "./rsh", "-hosts",
                "hostA,hostB", "-n", str(world_size), "-ppn", "1", "-genv", "MASTER_ADDR",
                "hostA", "python", *script]
    raise ValueError(f"way must be one of {WAYS}, not {way!r}")


def two_hosts_argv(args: Sequence[object]) -> tuple[list[str], dict[str, str]]:
    """The command each of two hosts runs (torchrun, rendezvous on hostA) and its environment.
    Introduced in notebooks/12_scaling_out.ipynb."""
    argv = [sys.executable, "-m", "torch.distributed.run", *command("two hosts", 2, args)[1:]]
    return argv, {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launch(way: str, world_size: int = 2, steps: int = 20, out: str | None = None,
           timeout: float = 180.0, interface: str | None = None) -> dict:
    """Run the script under ``way`` (``WAYS``) and return rank 0's result (the JSON it wrote to
    ``out``, a temporary file by default). Raises RuntimeError with the launcher's last lines
    when it fails or runs past ``timeout`` s. ``interface`` ("two hosts"): the one Gloo is told
    to use on both hosts (default: each host's own ``eth0``).
    Introduced in notebooks/12_scaling_out.ipynb."""
    out = out or os.path.join(tempfile.mkdtemp(prefix="course-train-"), "result.json")
    # every wait of a rank: the launcher's deadline, a minute at most
    args = ["--steps", steps, "--out", out, "--timeout", min(timeout, 60)]
    if "two hosts" in way and world_size != 2:
        raise ValueError(f"two hosts run one rank each: world_size must be 2, not {world_size}")
    if way in ("torchrun", "mpiexec"):
        run_ranks(way, world_size, ["-m", "course_lib.train", *map(str, args)], timeout=timeout)
    elif way == "srun":
        argv = command(way, world_size, args)
        argv[argv.index("python")] = sys.executable
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"srun exited with status {done.returncode}: "
                               f"{done.stderr.strip()[-2000:]}")
    elif way == "mpiexec, two hosts":
        with hosts.make_hosts() as machines:
            argv = command(way, world_size, args)
            argv[0] = mpiexec_path(required=True)
            argv[argv.index("./rsh")] = str(hosts.rsh(machines, os.path.dirname(out)))
            argv[argv.index("python")] = sys.executable
            done = machines[0].run(argv, timeout=timeout,
                                   env={**os.environ, "MPIEXEC_TIMEOUT": str(int(timeout))})
        if done.returncode:
            raise RuntimeError(f"mpiexec across two hosts exited with status "
                               f"{done.returncode}: {done.stderr.strip()[-1500:]}")
    elif way == "two hosts":
        argv, env = two_hosts_argv(args)
        with hosts.make_hosts() as machines:
            hosts.run_each(machines, [argv, argv], [env, env], timeout, interface)
    else:
        raise ValueError(f"way must be one of {WAYS}, not {way!r}")
    with open(out) as f:
        return json.load(f)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m course_lib.train``: train under any launcher; rank 0 writes the result to
    ``--out`` (JSON: losses, the parameters' SHA-256, the launcher and every rank's host).
    Introduced in notebooks/12_scaling_out.ipynb."""
    import torch.distributed as dist  # not at the top (see the module docstring)
    parser = argparse.ArgumentParser(prog="python -m course_lib.train")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds for every wait")
    parser.add_argument("--out", help="rank 0 writes its result here (JSON)")
    args = parser.parse_args(argv)
    result = train(args.steps, args.seed, args.batch_size, args.lr, timeout=args.timeout)
    every_host = [None] * result["world_size"]
    dist.all_gather_object(every_host, result["host"])
    result["hosts"] = every_host
    if result["rank"] == 0:
        text = json.dumps(result)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
