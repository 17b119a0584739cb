"""Checkpoints that survive the crash they are written for.

Introduced in notebooks/11_fault_tolerance.ipynb. ``torch.save(state, path)`` writes in place:
a process killed in the middle leaves a truncated file, and the checkpoint that was there
before is gone. Here every file is written atomically, the way databases do::

    write to a temporary file in the same directory, flush, fsync it
    os.replace(temporary, final)        # atomic on POSIX: old or new, never half of one
    fsync the directory                 # the rename itself survives a power cut

and carries a SHA-256 of its contents, checked on load, so a file damaged anyway (a full disk,
a copy cut short) is reported with its path and the previous good checkpoint is used::

    save(state, "ckpt", step=120)                 # ckpt/step-00000120.pt, then ckpt/latest
    state, path = load_latest("ckpt")             # the newest good one, or (None, None)

A training state (``training_state``) holds everything a bit-exact resume needs: model and
optimizer, step and epoch, the position in the data, and every random generator. A sharded
state (one part per rank) is written as one directory per step, every rank's file first and a
commit marker last (as ``torch.distributed.checkpoint`` writes its ``.metadata`` last): a
directory without its marker is a crash between ranks' writes, and is never loaded. PyTorch's
DCP is used the same way (``dcp_save``, one directory per step, ``dcp_latest``); what it adds is
loading onto another layout, each rank reading the boxes its new shard shares with the saved
ones (``reshard_reads``).

One file, read top to bottom: one file written safely, numbered checkpoints of it, what a resume
puts in them, the same per rank with a commit marker, DCP used the same way, and how often to
write them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import torch

from course_lib.runtime import fault_points

if TYPE_CHECKING:
    from course_lib.comm import Comm

MAGIC = b"course-checkpoint sha256="
LATEST = "latest"
COMMIT = "COMMITTED"
_STEP_FILE = re.compile(r"^step-(\d{8})\.pt$")
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used; the message names its path and why.
    Introduced in notebooks/11_fault_tolerance.ipynb."""


# ---------------------------------------------------------------- one file
def naive_save(state: Any, path: str | Path) -> None:
    """What ``torch.save(state, path)`` does, for comparison: open ``path`` for writing (which
    empties the checkpoint that was there) and write into it; a crash half-way leaves half a
    file. Introduced in notebooks/11_fault_tolerance.ipynb."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
        f.flush()
        fault_points.point("checkpoint-mid-write")
        f.write(data[len(data) // 2:])


def _fsync_directory(directory):
    # a rename is an entry of the directory: it is durable only once the directory is synced
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes, fault_point: str = "checkpoint-mid-write") -> None:
    """Write ``data`` (bytes) to ``path`` so that ``path`` holds either its old contents or all
    of ``data``, whenever the process dies (``fault_point``: where :mod:`fault_points` can kill it,
    half-way). Introduced in notebooks/11_fault_tolerance.ipynb."""
    path = Path(path)
    # in the same directory (os.replace is atomic within one file system), hidden, named after
    # its writer's pid: remove_orphans can tell a dead writer's leftover from a live one's file
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            fault_points.point(fault_point)  # a crash here must cost nothing
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())  # the data on disk before the name points at it
        os.replace(tmp, path)  # the atomic step: path is the old file or the new, never half
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def to_bytes(state: Any) -> bytes:
    """``state`` serialised by ``torch.save``, behind a header with the SHA-256 of the rest.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def from_bytes(data: bytes, path: str | Path = "<bytes>") -> Any:
    """The state in ``data``, after checking its SHA-256 (``torch.load(weights_only=True)``:
    tensors, numbers, strings and containers only, never code). Raises
    :class:`CheckpointError` naming ``path``. Introduced in notebooks/11_fault_tolerance.ipynb."""
    header, _, payload = data.partition(b"\n")
    if not header.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a course checkpoint (no checksum header; "
                              f"{len(data)} bytes)")
    expected = header[len(MAGIC):].decode(errors="replace")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != expected:
        raise CheckpointError(f"{path}: checksum mismatch ({len(payload)} bytes of payload, "
                              f"sha256 {actual[:12]}..., expected {expected[:12]}...): truncated "
                              "or damaged")
    return torch.load(io.BytesIO(payload), weights_only=True)


def save_file(state: Any, path: str | Path) -> Path:
    """``state`` into ``path``, atomically, with its checksum. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    atomic_write(path, to_bytes(state))
    return Path(path)


def load_file(path: str | Path) -> Any:
    """The state saved in ``path`` by :func:`save_file`, checked. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from e
    return from_bytes(data, path)


# ---------------------------------------------------------------- numbered checkpoints
def _steps(directory, pattern):
    found = []
    for entry in Path(directory).iterdir() if Path(directory).is_dir() else []:
        match = pattern.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def save(state: Any, directory: str | Path, step: int, keep: int = 3) -> Path:
    """``state`` as ``directory/step-{step:08d}.pt`` (atomic, checksummed), then the ``latest``
    pointer (atomic too), then all but the ``keep`` newest checkpoints removed. Returns the path.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1 (the newest checkpoints kept), got "
                         f"{keep!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_orphans(directory)
    path = save_file(state, directory / f"step-{step:08d}.pt")
    atomic_write(directory / LATEST, path.name.encode(),  # written last: names a whole file
                 fault_point="latest-mid-write")
    _keep_newest(directory, keep, _STEP_FILE)
    return path


def remove_orphans(directory: str | Path) -> list[Path]:
    """Remove the temporary files of writers that died (their process is gone); returns them.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    removed = []
    for tmp in Path(directory).rglob(".*.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _keep_newest(directory, keep, pattern):
    for _, old in _steps(directory, pattern)[:-keep] if keep else []:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def load_latest(directory: str | Path,
                report: Callable[[str], object] = print) -> tuple[Any, Path | None]:
    """The newest checkpoint of ``directory`` that loads and checks: ``(state, path)``, or
    ``(None, None)`` when there is none. A damaged one is reported (``report``, one line naming
    its path and why) and the one before it is tried. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    for _, path in reversed(_steps(directory, _STEP_FILE)):
        try:
            return load_file(path), path
        except CheckpointError as e:
            report(f"skipping a damaged checkpoint: {e}")
    return None, None


@dataclass(frozen=True)
class Store:
    """A folder of numbered checkpoints (:func:`save`, :func:`load_latest`), for code that
    checkpoints without knowing how: notebook 04's parameter servers, restarted in notebook 11,
    are handed one (``ps.train(..., checkpoints=Store(folder))``).
    Introduced in notebooks/11_fault_tolerance.ipynb."""

    directory: str | Path
    keep: int = 3

    def save(self, state: Any, step: int) -> Path:
        return save(state, self.directory, step, self.keep)

    def load_latest(self, report: Callable[[str], object] = print) -> tuple[Any, Path | None]:
        return load_latest(self.directory, report)

    def inside(self, name: str, keep: int | None = None) -> Store:
        """The store of the folder ``name`` inside this one."""
        return Store(os.path.join(self.directory, name), self.keep if keep is None else keep)


# ---------------------------------------------------------------- what a resume needs
def rng_states() -> dict:
    """Every random generator's state: Python's, numpy's and torch's.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    # numpy's state as a tensor and plain numbers: torch.load(weights_only=True) reads no numpy
    # arrays (its 624 uint32 keys become int64, which holds them without a sign flip)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}}


def set_rng_states(states: dict) -> None:
    """Put back what :func:`rng_states` returned. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                   epoch: int = 0, position: int = 0, **extra: Any) -> dict:
    """Everything a bit-exact resume needs: parameters and buffers, the optimizer's state, the
    step, the epoch and the position in it, the random generators, and ``extra``.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "epoch": epoch, "position": position, "rng": rng_states(), "extra": extra}


def restore(state: dict, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """Load a :func:`training_state` into ``model`` and ``optimizer`` and the generators;
    returns ``(step, epoch, position)``. Introduced in notebooks/11_fault_tolerance.ipynb."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"])
    return state["step"], state["epoch"], state["position"]


# ---------------------------------------------------------------- one part per rank
def save_sharded(part: Any, directory: str | Path, step: int, comm: Comm, keep: int = 3,
                 timeout: float | None = None) -> Path:
    """This rank's ``part`` of a distributed state into ``directory/step-{step:08d}/rank-{r}.pt``;
    once every rank has written (a barrier with a deadline), rank 0 writes the commit marker
    (the ranks' checksums) and the ``latest`` pointer. Every rank must call it.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    folder = Path(directory) / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    data = to_bytes(part)
    atomic_write(folder / f"rank-{comm.rank}.pt", data)
    # the digest travels as 32 uint8 values: what send/recv carry on either transport
    digest = torch.tensor(list(hashlib.sha256(data).digest()), dtype=torch.uint8)
    digests = _gather_digests(digest, comm, timeout)
    if comm.rank == 0:
        marker = {"step": step, "world_size": comm.world_size,
                  "sha256": [bytes(d.tolist()).hex() for d in digests]}
        atomic_write(folder / COMMIT, json.dumps(marker).encode(),  # the commit: written last
                     fault_point="commit-mid-write")
        atomic_write(Path(directory) / LATEST, folder.name.encode(), fault_point="latest-mid-write")
        _keep_newest(directory, keep, _STEP_DIR)
    comm.barrier(timeout)  # nobody goes on before the checkpoint is committed
    return folder


def _gather_digests(digest, comm, timeout):
    """Every rank's 32-byte digest on rank 0 (point to point, with the comm's deadlines)."""
    if comm.rank != 0:
        comm.send(digest, 0, timeout=timeout)
        return None
    digests = [digest]
    for r in range(1, comm.world_size):
        buf = torch.empty(32, dtype=torch.uint8)
        comm.recv(buf, r, timeout=timeout)
        digests.append(buf)
    return digests


def load_sharded(directory: str | Path, rank: int, world_size: int,
                 report: Callable[[str], object] = print) -> tuple[Any, Path | None]:
    """This rank's part of the newest *committed* step of ``directory``: ``(part, folder)``, or
    ``(None, None)``. A step without its marker (a crash before every rank had written), saved
    by another world size, or with any rank's file failing its checksum is reported and skipped;
    every rank checks every file, so all ranks choose the same step.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    for _, folder in reversed(_steps(directory, _STEP_DIR)):
        marker = folder / COMMIT
        if not marker.exists():
            report(f"skipping {folder}: no {COMMIT} marker (a crash before every rank wrote)")
            continue
        info = json.loads(marker.read_bytes())
        if info["world_size"] != world_size:
            report(f"skipping {folder}: saved by {info['world_size']} ranks, not {world_size}")
            continue
        try:
            mine = None
            for r in range(world_size):
                path = folder / f"rank-{r}.pt"
                data = path.read_bytes()
                if hashlib.sha256(data).hexdigest() != info["sha256"][r]:
                    raise CheckpointError(f"{path}: not the file the commit marker names")
                mine = data if r == rank else mine
            return from_bytes(mine, folder / f"rank-{rank}.pt"), folder
        except (OSError, CheckpointError) as e:
            report(f"skipping {folder}: {e}")
    return None, None


# ---------------------------------------------------------------- PyTorch's DCP, one step each
DCP_COMMIT = ".metadata"  # what torch.distributed.checkpoint writes last, on rank 0


def dcp_save(state: dict, directory: str | Path, step: int, asynchronous: bool = False,
             process_group=None, storage_bytes_per_s: float | None = None):
    """``torch.distributed.checkpoint.save`` (``asynchronous``: ``async_save``, which returns a
    future once the state is copied) of ``state`` into a directory of its own,
    ``directory/step-{step:08d}``, so that a save that dies never touches an older one; DCP
    commits it by writing ``.metadata`` last. Every rank calls it. The fault point
    ``dcp-before-metadata`` sits between the data files and the commit.
    ``storage_bytes_per_s`` emulates a slower storage (a shared file system's share): each
    rank's write then lasts at least its bytes at that rate, waiting, not computing.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    import time
    import warnings

    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            start = time.monotonic()
            written = super().write_data(plan, planner)  # done when it returns (one IO thread)
            if storage_bytes_per_s:
                size = sum(result.storage_data.length for result in written.value())
                time.sleep(max(0.0, size / storage_bytes_per_s - (time.monotonic() - start)))
            return written

        def finish(self, metadata, results):
            fault_points.point("dcp-before-metadata")
            return super().finish(metadata, results)

    folder = Path(directory) / f"step-{step:08d}"
    save = dcp.async_save if asynchronous else dcp.save
    alone = not torch.distributed.is_initialized()  # one process: no group to plan with
    with warnings.catch_warnings():  # DCP warns that it saves "in a single process": we know
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return save(state, storage_writer=Writer(folder), process_group=process_group,
                    no_dist=alone)


def dcp_latest(directory: str | Path, report: Callable[[str], object] = print) -> Path | None:
    """The newest ``step-*`` directory of ``directory`` that DCP committed (its ``.metadata``
    is there), or None; the ones without it (a save that died) are reported and skipped.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    for _, folder in reversed(_steps(directory, _STEP_DIR)):
        if (folder / DCP_COMMIT).exists():
            return folder
        report(f"skipping {folder}: no {DCP_COMMIT} (a save that died before its commit)")
    return None


def _ints(values):
    return tuple(int(v) for v in values)


def reshard_reads(saved: list[tuple[tuple[int, ...], tuple[int, ...]]],
                  wanted: tuple[tuple[int, ...], tuple[int, ...]]) -> list[dict]:
    """What a rank reads to fill its shard ``wanted`` = (offsets, sizes) of a tensor that was
    saved as the chunks ``saved`` (one (offsets, sizes) box per writer): for every saved chunk
    that overlaps the shard, the box they share, given as ``storage_offsets`` (inside the saved
    chunk), ``dest_offsets`` (inside the shard) and ``lengths`` -- the fields of DCP's
    ``ReadItem``. Loading on another layout is this intersection of boxes, per tensor.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    start, size = np.array(wanted[0]), np.array(wanted[1])
    reads = []
    for index, (chunk_start, chunk_size) in enumerate(saved):
        chunk_start, chunk_size = np.array(chunk_start), np.array(chunk_size)
        if chunk_start.shape != start.shape:
            raise ValueError(f"saved chunk {index} has {len(chunk_start)} dimensions, the "
                             f"shard {len(start)}")
        low = np.maximum(start, chunk_start)                       # the shared box, per
        high = np.minimum(start + size, chunk_start + chunk_size)  # dimension, ends excluded
        if (low < high).all():                                     # touching is no overlap
            reads.append({"chunk": index, "storage_offsets": _ints(low - chunk_start),
                          "dest_offsets": _ints(low - start), "lengths": _ints(high - low)})
    return reads


# ---------------------------------------------------------------- how often
def young_interval(cost: float, mtbf: float) -> float:
    """Young's checkpoint interval sqrt(2 C M), in the unit of ``cost`` and ``mtbf`` (J. W.
    Young 1974, "A first order approximation to the optimum checkpoint interval").
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    return (2 * cost * mtbf) ** 0.5


def time_to_finish(interval: float, work: float = 200.0, mtbf: float = 3.0, cost: float = 1 / 60,
                   restart: float = 5 / 60, runs: int = 100, seed: int = 0) -> float:
    """Mean time to finish ``work`` units of work, checkpointing every ``interval`` at ``cost``
    each, with failures at random (exponential, mean ``mtbf``), each costing ``restart`` and
    the work since the last checkpoint (a simulation, hours by default).
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    rng = np.random.default_rng(seed)
    totals = []
    for _ in range(runs):
        done = clock = 0.0
        next_failure = rng.exponential(mtbf)  # failures as a Poisson process: memoryless gaps
        while done < work:
            segment = min(interval, work - done) + cost      # work, then save
            if clock + segment <= next_failure:
                clock += segment
                done += segment - cost
            else:                                           # lost since the last checkpoint
                clock = next_failure + restart
                next_failure = clock + rng.exponential(mtbf)
        totals.append(clock)
    return float(np.mean(totals))
