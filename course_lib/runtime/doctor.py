"""``python -m course_lib doctor``: is this machine ready for the course?

Introduced in notebooks/00_welcome_and_cluster.ipynb. Prints versions, the MPI launcher, CUDA
devices and NCCL, the cores, then starts a live 2-engine cluster and checks a Gloo allreduce.
Ends with a one-line verdict; returns 0 when everything needed on a laptop works.

torch and the cluster (ipyparallel) are imported inside the checks that use them, not at the
top: the doctor starts and prints the versions first, also where one of them is missing or
broken, and their seconds of import come after the first lines.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Iterator
from importlib import metadata

from course_lib.runtime.launch import mpiexec_path


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _mpiexec():
    path = mpiexec_path()
    if path is None:
        return None, "not found (pip install mpi4py mpich)"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        lines = [" ".join(ln.split()) for ln in out.stdout.splitlines()]
        return path, next((ln for ln in lines if "Version" in ln), lines[0])  # MPICH's line
    except (OSError, subprocess.TimeoutExpired, IndexError) as e:
        return path, f"does not run: {e}"


def checks() -> Iterator[tuple[str, str, str]]:
    """Yield (name, status, detail) rows; status is 'ok', 'warn' or 'fail'.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    yield "python", "ok", platform.python_version()
    for pkg, needed in [("torch", True), ("ipyparallel", True), ("jupyterlab", True),
                        ("mpi4py", False), ("nbval", False)]:
        v = _version(pkg)
        yield pkg, "ok" if v else ("fail" if needed else "warn"), v or "not installed"
    path, detail = _mpiexec()
    yield "mpiexec", "ok" if path and "not" not in detail else "warn", f"{path or ''} {detail}"
    import torch  # here, after the versions are reported (see the module docstring)
    import torch.distributed as dist
    yield "cores", "ok", f"{os.cpu_count()} logical cores"
    yield "gloo", "ok" if dist.is_gloo_available() else "fail", str(dist.is_gloo_available())
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        yield "cuda", "ok", f"{len(names)} device(s): {', '.join(names)}"
        nccl = dist.is_nccl_available()
        version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "unavailable"
        yield "nccl", "ok" if nccl else "warn", version
    else:
        yield "cuda", "ok", "no GPU: the course runs on CPU with Gloo"
    yield from _live_cluster()


def _live_cluster():
    from course_lib.runtime.cluster import (  # see the module docstring
        allreduce_ranks,
        start_cluster,
    )
    t = time.perf_counter()
    try:
        with start_cluster(n=2, backend="gloo", timeout=30) as cluster:
            started = time.perf_counter() - t
            sums = cluster.run(allreduce_ranks)
        ok = sums == [1.0, 1.0]  # ranks 0 + 1, on both ranks
        yield "cluster", "ok", f"2 engines + Gloo process group up in {started:.1f}s"
        yield "allreduce", "ok" if ok else "fail", f"sum of ranks on each rank: {sums} (want 1.0)"
    except Exception as e:  # noqa: BLE001 - the doctor reports, it does not crash
        yield "cluster", "fail", f"{type(e).__name__}: {e}"


def main() -> int:
    """Print the report and a verdict; return the exit status.

    Introduced in notebooks/00_welcome_and_cluster.ipynb."""
    worst = "ok"
    for name, status, detail in checks():
        mark = {"ok": "✓", "warn": "!", "fail": "✗"}[status]
        print(f"  {mark} {name:<12} {detail}", flush=True)
        if status == "fail" or (status == "warn" and worst == "ok"):
            worst = status
    verdict = {"ok": "ready: every check passed",
               "warn": "ready for the CPU notebooks; see the '!' lines for the optional parts",
               "fail": "not ready: fix the '✗' lines above (README, Troubleshooting)"}[worst]
    print(f"doctor: {verdict}")
    return 1 if worst == "fail" else 0
