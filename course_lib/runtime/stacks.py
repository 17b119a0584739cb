"""Where is every rank? The stack of every rank of a cluster, taken while a call hangs, merged into
one view: which ranks wait in which collective, for which peer.

Introduced in notebooks/17_debugging_clinic.ipynb. Each engine serves its own stacks on a Unix
socket of its own (:func:`serve`, started when the engine gets its rank): a thread of the engine
answers while the main thread is blocked inside Gloo (which releases the GIL), so no signal and no
debugger is needed. The course's waits say what they wait for (a :class:`comm.Request`, a native
collective's ``what``), and :func:`snapshot` reads that from the frames. ``Cluster.run`` takes the
stacks itself when a call passes its deadline and puts them in the ``ClusterTimeout``; any time::

    print(stacks.summary(cluster.stacks()))
    # from a shell: python -m course_lib cluster stacks

py-spy (``py-spy dump --pid PID``) shows the same stacks from outside, and with ``--native``
the C and C++ frames beneath them.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterable
from pathlib import Path

from course_lib.runtime.launch import private_dir

ENTRY = "call_and_report"  # engine.call_and_report: what a cluster call runs; frames below it


def directory() -> Path:
    """Where the engines of this user keep their sockets (only this user may read them).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    return private_dir(Path(tempfile.gettempdir()) / f"course_lib-stacks-{os.getuid()}")


def socket_path(pid: int) -> Path:
    """The socket of the engine whose process id is ``pid``.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    return directory() / f"{pid}.sock"


def _waiting(frame) -> str | None:
    """What ``frame`` waits for, when it is one of the course's waits."""
    name, local = frame.f_code.co_name, frame.f_locals
    request = local.get("self")
    if name == "wait" and hasattr(request, "what") and hasattr(request, "peer"):
        return request.what()  # comm.Request.wait: op, peer, size, transport
    if name == "barrier" and hasattr(request, "transport"):
        return (f"rank {request.rank}: barrier over {request.transport} (world size "
                f"{request.world_size})")  # comm's barrier: a native one, with a deadline
    if name == "wait_work" and isinstance(local.get("what"), str):
        return f"a native {local['what']}"  # comm.wait_work / dist_checks.wait_work
    return None


def snapshot(identity: dict | None = None) -> dict:
    """This process's threads, each a list of ``[file, line, function, source]`` frames from
    the cluster call down (outermost first), what the main thread waits for, and the rank,
    world size and process group of ``identity`` (an engine's ``engine.ENGINE``).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    identity = identity or {}
    main = threading.main_thread().ident
    threads = []
    waiting = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # this thread, answering
        frames, f = [], frame
        while f is not None:
            frames.append(f)
            f = f.f_back
        frames.reverse()
        names = [f.f_code.co_name for f in frames]
        start = names.index(ENTRY) + 1 if ENTRY in names else 0
        rows = [[f.f_code.co_filename, f.f_lineno, f.f_code.co_name,
                 traceback.extract_stack(f, limit=1)[0].line or ""] for f in frames[start:]]
        if ident == main:
            waiting = [w for w in (_waiting(f) for f in frames[start:]) if w]
        thread = next((t for t in threading.enumerate() if t.ident == ident), None)
        threads.append({"name": thread.name if thread else str(ident), "main": ident == main,
                        "in_call": ENTRY in names, "frames": rows})
    return dict(rank=identity.get("rank"), world_size=identity.get("world_size"),
                group=identity.get("group"), host=socket.gethostname(), pid=os.getpid(),
                threads=threads,
                waiting=waiting[-1] if waiting else None)


def serve(identity: dict | None = None) -> Path:
    """Start answering :func:`snapshot` (of ``identity``, read at each answer) on this
    process's socket (once per process); returns the socket's path. Runs on every engine
    (``engine.setup_engine``, with its ``ENGINE``).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    path = socket_path(os.getpid())
    if getattr(serve, "path", None) == path:
        return path
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)

    def answer():
        while True:
            conn, _ = listener.accept()
            with conn:
                try:
                    conn.sendall(json.dumps(snapshot(identity), default=str).encode())
                except Exception as e:  # never let a bad frame kill the thread
                    conn.sendall(json.dumps({"pid": os.getpid(), "error": repr(e)}).encode())
    threading.Thread(target=answer, name="course_lib-stacks", daemon=True).start()
    serve.path = path
    return path


def ask(pid: int, timeout: float = 2.0) -> dict:
    """The snapshot of the engine ``pid`` (on this host), or ``{"pid", "error"}``.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(socket_path(pid)))
            data = b"".join(iter(lambda: s.recv(1 << 16), b""))
        return json.loads(data)
    except (OSError, ValueError) as e:
        return {"pid": pid, "error": f"no answer ({e.__class__.__name__}: {e})"}


def gather(pids: Iterable[int], timeout: float = 2.0) -> list[dict]:
    """Every engine's snapshot, asked at once (a blocked engine's thread still answers).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    pids = list(pids)
    out: list[dict] = [{}] * len(pids)

    def one(i, pid):
        out[i] = ask(pid, timeout)
    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(pids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1)
    return out


def live_pids() -> list[int]:
    """The engines of this user on this host that serve their stacks (the CLI's view).
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    pids = []
    for path in directory().glob("*.sock"):
        try:
            pid = int(path.stem)
            os.kill(pid, 0)
            pids.append(pid)
        except (ValueError, ProcessLookupError):
            path.unlink(missing_ok=True)  # a socket its engine left behind
        except PermissionError:
            pass
    return sorted(pids)


def _where(snap: dict) -> str:
    """One line: the main thread's frames from the cluster call in, outermost first; the
    frames of libraries left out and the course's transport shown by its entry alone (``recv``,
    not the four functions under it)."""
    main = next((t for t in snap.get("threads", []) if t["main"]), None)
    if main is None or not main["in_call"]:
        return "idle (not in a cluster call)"
    shown = []
    for file, line, function, _ in main["frames"]:
        if "site-packages" in file or file.startswith("<frozen"):
            continue
        inside = f"{os.sep}comm{os.sep}" in file  # course_lib/comm: its entry is enough
        if inside and shown and shown[-1][0]:
            continue
        shown.append((inside, f"{function} ({Path(file).name}:{line})"))
    texts = [text for _, text in shown]
    if len(texts) > 5:  # the job's own entry, then the innermost: where it waits
        texts = texts[:2] + ["..."] + texts[-3:]
    return " > ".join(texts) or "in a library"


def summary(snaps: list[dict]) -> str:
    """The snapshots merged: ranks grouped by where they are, each with what it waits for.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    groups: dict[str, list] = {}
    for snap in sorted(snaps, key=lambda s: (s.get("rank") is None, s.get("rank") or 0)):
        if "error" in snap:
            key = f"pid {snap['pid']}: {snap['error']}"
        else:
            key = _where(snap)
        groups.setdefault(key, []).append(snap)
    lines = []
    for where, members in groups.items():
        ranks = ", ".join(str(s.get("rank", "?")) for s in members)
        lines.append(f"rank(s) {ranks}: {where}")
        for s in members:
            if s.get("waiting"):
                lines.append(f"    waiting: {s['waiting']}")
    return "\n".join(lines)


def main() -> int:
    """``python -m course_lib cluster stacks``: every live engine of this user on this host.
    Introduced in notebooks/17_debugging_clinic.ipynb."""
    pids = live_pids()
    if not pids:
        print("no live engines of this user on this host")
        return 1
    snaps = gather(pids)
    clusters: dict = {}  # by process group: one cluster's ranks together
    for s in snaps:
        clusters.setdefault(s.get("group"), []).append(s)
    for group, members in clusters.items():
        print(f"# a cluster of {members[0].get('world_size')} rank(s), process group {group}")
        print(summary(members))
    return 0
