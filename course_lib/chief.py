"""The chief worker, and training that survives a killed worker.

Introduced in notebooks/11_fault_tolerance.ipynb. In data-parallel training one rank, the
*chief* (rank 0), has the duties no other rank has: it initialises the model and broadcasts it,
counts the steps, writes the log (and TensorBoard's event files), and saves the checkpoints
from which the job restarts. Every rank runs :func:`train`; the notebook's process runs
:func:`supervise`, which restarts the engines when one dies and calls :func:`train` again,
which resumes from the last checkpoint::

    run = supervise(cluster, "ckpt", steps=40, checkpoint_every=5,
                    faults=["train-step:kill@17:rank=1"])      # rank 1 dies at its 17th step
    run.restarts, run.recomputed                               # 1, [2]  (steps 16-17 again)

The promise: at most ``checkpoint_every`` steps are computed twice per failure, and the final
parameters are those of an uninterrupted run, bit for bit: the data of step s depends only on
(seed, s), the checkpoint holds the parameters *and* the optimizer's momentum, and the sums of
the allreduce are taken in the same order.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import checkpoint
from course_lib.comm import get_comm, init_torch_from_launcher
from course_lib.runtime import fault_points
from course_lib.runtime.arguments import check_count

if TYPE_CHECKING:
    from course_lib.runtime.cluster import Cluster

LOG = "train.jsonl"


class RecoveryFailed(RuntimeError):
    """Training failed more times than the supervisor may restart it.
    Introduced in notebooks/11_fault_tolerance.ipynb."""


def make_model(seed: int = 0) -> nn.Sequential:
    """The model every run trains: a float64 MLP on 8 features. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).double()


def batch(step: int, rank: int, world_size: int, seed: int = 0, size: int = 32,
          pool: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch, drawn from a fixed data set of ``pool``
    rows (a teacher's targets) by a generator seeded with (seed, step): a function of the step
    alone, so a resumed run sees the data the uninterrupted one saw. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(pool, 8, generator=g, dtype=torch.float64)
    y = torch.tanh(X @ torch.randn(8, 1, generator=g, dtype=torch.float64) / 8 ** 0.5)
    # one seed per (seed, step) for any step below 1,000,002; + 1 keeps seed 0's step 0 apart
    # from the data set's generator (seeded with seed)
    order = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    rows = torch.randperm(pool, generator=order)[:size]
    # rank r's slice of the global batch: the slices tile it whatever size % world_size is
    mine = rows[rank * size // world_size:(rank + 1) * size // world_size]
    return X[mine], y[mine]


def _broadcast_state(model, optimizer, comm, momentum):
    """The chief's parameters (and, resuming, its momentum buffers) to every rank, in order."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0, group=getattr(comm, "group", None))
        if momentum:
            state = optimizer.state[p]
            if comm.rank != 0 and "momentum_buffer" not in state:  # a buffer to receive into
                state["momentum_buffer"] = torch.zeros_like(p)
            dist.broadcast(state["momentum_buffer"], src=0, group=getattr(comm, "group", None))


def _summary_writer(directory, start):
    """The chief's TensorBoard writer. Resuming after step ``start``, ``purge_step`` tells
    TensorBoard to drop what an earlier attempt logged after it: the steps computed twice show
    once, with the values of the attempt that went on."""
    from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard, on the chief only
    return SummaryWriter(str(Path(directory) / "tensorboard"),
                         purge_step=start + 1 if start else None, flush_secs=5)


def _log(directory, **record):
    with open(Path(directory) / LOG, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def train(directory: str | Path, steps: int = 40, checkpoint_every: int = 5, attempt: int = 0,
          fault_specs: Sequence[str] = (), lr: float = 0.02, seed: int = 0, timeout: float = 20.0,
          tensorboard: bool = True) -> torch.Tensor:
    """On every rank: data-parallel SGD with momentum for ``steps`` steps, resuming from the last
    checkpoint of ``directory``. The chief loads or initialises, broadcasts, logs every step
    (JSONL, and TensorBoard's event files in ``directory/tensorboard`` unless
    ``tensorboard=False``) and checkpoints every ``checkpoint_every`` steps. ``fault_specs``:
    fault points to arm (:func:`fault_points.parse`), each firing once in the life of ``directory``
    (unless it says ``once=`` itself). Returns this rank's parameters, flat.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    comm = get_comm("torch", timeout=timeout)
    rank, N = comm.rank, comm.world_size
    fault_points.arm_once(fault_specs, directory, rank)  # not again in the restarted process
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    start, board = torch.zeros(1, dtype=torch.int64), None
    if rank == 0:  # the chief: restore or initialise
        Path(directory).mkdir(parents=True, exist_ok=True)
        state, path = checkpoint.load_latest(directory)
        if state is not None:
            start[0] = checkpoint.restore(state, model, optimizer)[0]
        _log(directory, event="start", attempt=attempt, step=int(start), world_size=N,
             checkpoint=path.name if path else None, time=time.time())
        if tensorboard:
            board = _summary_writer(directory, int(start))
    dist.broadcast(start, src=0, group=getattr(comm, "group", None))
    # from step 0 only the parameters: the optimizer has no momentum yet on any rank
    _broadcast_state(model, optimizer, comm, momentum=start.item() > 0)
    for step in range(int(start), steps):
        fault_points.point("train-step")
        X, y = batch(step, rank, N, seed)
        loss = nn.functional.mse_loss(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # the mean gradient; the loss only to log it
            dist.all_reduce(p.grad, group=getattr(comm, "group", None))
            p.grad /= N
        optimizer.step()
        dist.all_reduce(loss.detach_(), group=getattr(comm, "group", None))
        if rank == 0:
            _log(directory, event="step", attempt=attempt, step=step + 1,
                 loss=loss.item() / N, time=time.time())
            if board:
                board.add_scalar("loss", loss.item() / N, step + 1)
            if (step + 1) % checkpoint_every == 0:
                checkpoint.save(checkpoint.training_state(model, optimizer, step + 1),
                                directory, step + 1)
                if board:
                    board.flush()  # what a kill loses of the logs is what is computed again
    if board:
        board.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@dataclass
class Run:
    """What :func:`supervise` saw: the final parameters of every rank, the failures, and the
    log. Introduced in notebooks/11_fault_tolerance.ipynb."""
    params: list[torch.Tensor]
    failures: list[str] = field(default_factory=list)
    log: list[dict] = field(default_factory=list)

    @property
    def restarts(self) -> int:
        """How many times training was started again."""
        return len(self.failures)

    @property
    def recomputed(self) -> list[int]:
        """Steps computed twice at each restart: the last step logged before it, minus the
        step it resumed from."""
        out, last = [], 0
        for record in self.log:
            if record["event"] == "start" and record["attempt"] > 0:
                out.append(last - record["step"])
            elif record["event"] == "step":
                last = record["step"]
        return out


def read_log(directory: str | Path) -> list[dict]:
    """The chief's log, one dict per line. Introduced in notebooks/11_fault_tolerance.ipynb."""
    path = Path(directory) / LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def supervise(cluster: Cluster, directory: str | Path, steps: int = 40, checkpoint_every: int = 5,
              faults: Sequence[str] = (), max_restarts: int = 3,
              report: Callable[[str], object] = print, **train_kwargs: Any) -> Run:
    """Run :func:`train` on ``cluster``; when an engine dies or a rank stops answering, restart
    and resume from the last checkpoint, at most ``max_restarts`` times.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    # only the notebook's process supervises: the ranks that import this module (engines, and
    # torchrun's ranks at every restart) need neither the cluster client nor ipyparallel
    from course_lib.runtime.cluster import ClusterTimeout, EngineDied
    check_count("steps", steps)
    check_count("checkpoint_every", checkpoint_every)
    check_count("max_restarts", max_restarts, least=0)
    failures = []
    for attempt in range(max_restarts + 1):
        try:
            params = cluster.run(train, str(directory), steps, checkpoint_every, attempt,
                                 tuple(faults), **train_kwargs)
            return Run(params, failures, read_log(directory))
        except (EngineDied, ClusterTimeout) as e:
            failures.append(str(e).splitlines()[0])
            report(f"attempt {attempt} failed: {failures[-1]}\n  -> restarting; the chief "
                   "resumes from the last checkpoint")
    raise RecoveryFailed(f"training failed {len(failures)} times, more than max_restarts = "
                         f"{max_restarts}: " + "; ".join(failures))


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node 2 --max-restarts 2 -m course_lib.chief --dir ckpt``: the same
    training under torchrun's elastic restarts (a rank that dies makes torchrun restart every
    rank, which resume from the last checkpoint). Faults come from ``$COURSE_LIB_FAULTS``; the
    chief writes the final parameters to ``--out``. Launch it with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (as ``launch.run_ranks`` does): with the store
    shared, a restarted rank can read its peer's address from the failed attempt.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.chief")
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every K steps")
    parser.add_argument("--out", help="the chief writes the final parameters here")
    args = parser.parse_args(argv)
    init_torch_from_launcher("gloo", timeout=20)
    torch.set_num_threads(1)  # as on the cluster's engines: the same sums, in the same order
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    specs = [s for s in os.environ.get(fault_points.ENV, "").split(",") if s.strip()]
    params = train(args.dir, args.steps, args.every, attempt, specs)
    if dist.get_rank() == 0 and args.out:
        checkpoint.save_file({"params": params, "attempts": attempt + 1}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
