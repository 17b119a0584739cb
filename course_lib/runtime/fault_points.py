"""Fault injection: named points in the code where a test, a notebook or a benchmark makes a
process die or hang on purpose.

Introduced in notebooks/11_fault_tolerance.ipynb. Code that can be interrupted calls
``fault_points.point("name")`` where a failure would hurt (in the middle of a checkpoint write, at a
training step); nothing happens unless that point is *armed* in this process::

    fault_points.arm("train-step", "kill", at=7)           # this process dies at its 7th step
    fault_points.arm("checkpoint-mid-write", "kill")       # ... or half-way through its next save

``"kill"`` is SIGKILL, as the kernel's out-of-memory killer or a lost node: no ``finally``,
no flush. ``"hang"`` sleeps (for ``hang_s`` seconds), as a process stuck in a collective whose
peer is gone: only a deadline notices. ``"stop"`` raises :class:`FaultStop`, for code that then
goes silent as a dead process would while its process lives on (a parameter-server worker).
``once=path`` fires only if ``path`` does not exist yet (and creates it first), so the restarted
process does not fail again at the same place. Points can be armed from the environment too, for
processes started by a launcher (``torchrun``)::

    COURSE_LIB_FAULTS="train-step:kill@7:rank=1:once=/tmp/fired"
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

ENV = "COURSE_LIB_FAULTS"
ACTIONS = ("kill", "hang", "stop")
_ARMED: dict[str, list[dict]] = {}  # name -> [plan, ...], each dict(action, at, once, hang_s, hits)


class FaultStop(Exception):
    """Raised by a point armed with ``"stop"``: the code there stops its work and goes silent.
    Introduced in notebooks/04_parameter_server.ipynb."""


class FaultSpecError(ValueError):
    """A fault specification that cannot be read. Introduced in
    notebooks/11_fault_tolerance.ipynb."""


def arm(name: str, action: str = "kill", at: int = 1, once: str | None = None,
        hang_s: float = 3600.0) -> None:
    """Make the ``at``-th time this process reaches point ``name`` (counted from now) fail with
    ``action``; a point may carry several such plans. Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    if action not in ACTIONS:
        raise FaultSpecError(f"action must be one of {ACTIONS}, not {action!r}")
    if not (isinstance(at, int) and at >= 1):
        raise FaultSpecError(f"at must be a count >= 1, not {at!r}")
    _ARMED.setdefault(name, []).append(
        {"action": action, "at": at, "once": once, "hang_s": hang_s, "hits": 0})


def disarm(name: str | None = None) -> None:
    """Disarm point ``name`` (every point if None). Introduced in
    notebooks/11_fault_tolerance.ipynb."""
    for key in [name] if name else list(_ARMED):
        _ARMED.pop(key, None)


def parse(spec: str, rank: int | None = None) -> list[str]:
    """Arm the points of ``spec`` ("name:action@at[:rank=r][:once=path]", comma-separated) that
    apply to ``rank``; returns the names armed. Introduced in notebooks/11_fault_tolerance.ipynb."""
    armed = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, rest = item.partition(":")
        fields = rest.split(":") if rest else []
        if not name or not fields:
            raise FaultSpecError(f"{item!r}: expected name:action@at[:rank=r][:once=path]")
        action, _, at = fields[0].partition("@")
        options = dict(f.split("=", 1) for f in fields[1:] if "=" in f)  # rank=..., once=...
        try:
            at = int(at or 1)
            target = int(options["rank"]) if "rank" in options else None
        except ValueError:
            raise FaultSpecError(f"{item!r}: at and rank must be integers") from None
        if target is None or target == rank:
            arm(name, action, at, options.get("once"))
            armed.append(name)
    return armed


def arm_once(specs: Sequence[str], directory: str | Path | None, rank: int | None = None) -> None:
    """Disarm every point, then arm ``specs`` for ``rank``, each firing once in the life of
    ``directory`` (a ``once=`` file there, unless the spec names its own; no such file when
    ``directory`` is None): a process restarted to resume from ``directory``'s checkpoint does
    not fail again at the same place.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    disarm()
    for i, spec in enumerate(specs):
        once = "once=" in spec or directory is None
        # one marker file per spec: the restarted process finds it there and passes this point
        parse(spec if once else f"{spec}:once={directory}/.fault-{i}", rank)


def arm_from_environment(rank: int | None = None) -> list[str]:
    """Arm what ``$COURSE_LIB_FAULTS`` says for this ``rank`` (default: ``$RANK``).
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    if rank is None and os.environ.get("RANK", "").isdigit():
        rank = int(os.environ["RANK"])
    return parse(os.environ.get(ENV, ""), rank)


def point(name: str) -> None:
    """A place where a failure is possible: fails here if ``name`` is armed and due.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    for plan in _ARMED.get(name, ()):
        plan["hits"] += 1
        if plan["hits"] == plan["at"]:  # ==, not >=: a plan fires once, at its at-th visit
            _fire(plan)


def _fire(plan: dict) -> None:
    if plan["once"] is not None:
        try:  # exclusive create: exactly one process, once, fires
            os.close(os.open(plan["once"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    if plan["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # the signal is delivered at once; never return from a kill
    if plan["action"] == "stop":
        raise FaultStop(f"fault point stopped here (pid {os.getpid()})")
    time.sleep(plan["hang_s"])
