"""Checks for labs/15_mixture_of_experts.ipynb: the all-to-all from ``comm.sendrecv`` and the
top-k dispatch with capacity (notebook 15).

In the lab, right under each exercise::

    from course_lib.checks import lab15_mixture_of_experts as checks
    checks.check_all_to_all(my_all_to_all, cluster)   # on the cluster, against Gloo's own
    checks.check_dispatch(my_dispatch)                # against moe.route

The first sends the student's ``my_all_to_all(send, recv, comm, send_counts, recv_counts)`` to
every engine (cloudpickle, by value) and runs it on the first N ranks, N = 2 .. the cluster's
size, on uneven blocks (some empty, a rank that sends nothing), right after
``dist.all_to_all_single`` on the same rows. Every row sent is marked with its sender, its
destination and its place in its block, so a row that lands in the wrong place is named. The
student's comm records each call, so a deadlock (every rank waiting at its deadline, never a
hang) is told apart by where each rank stood, and a right result reached by another schedule
than the pairwise exchange is told so. The second compares ``my_dispatch(logits, top_k,
capacity_factor) -> (expert, gate, kept, dropped)`` with ``moe.route`` on seeded logits, and
matches a wrong answer against the usual mistakes (no softmax, gates not renormalised, a
capacity rounded the wrong way or before top_k multiplies it, second choices first, slots not in
token order, a miscounted drop).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from course_lib import moe
from course_lib.checks.framework import Case, CheckFailed, not_implemented, pack_function, run_check

# seconds each wait of the student's comm may take: a deadlock comes back as a hint in seconds
STUDENT_TIMEOUT = 5.0
FILL = -1.0  # what recv holds before the call: a row still holding it was never written

SCHEDULE = ("Compare with the pairwise exchange as the exercise describes it: the own block "
            "copied, then N - 1 steps of one comm.sendrecv each, every offset from its own "
            "counts.")


# ---------------------------------------------------------------- the rows every rank sends
def mark(src: int, dst: int, row: int) -> int:
    """The mark of row ``row`` of the block rank ``src`` sends rank ``dst``."""
    return 10_000 * (src + 1) + 100 * dst + row


def case_send(counts: list[list[int]], rank: int, dtype: str = "float64",
              width: int = 2) -> np.ndarray:
    """Rank ``rank``'s send buffer for ``counts`` (row p: what rank p sends each rank): every
    row marked by :func:`mark` (column j adds j / 4), ``width`` 0 for 1-D rows."""
    marks = np.array([mark(rank, q, i) for q, c in enumerate(counts[rank]) for i in range(c)],
                     dtype=np.float64)
    rows = marks if width == 0 else marks[:, None] + np.arange(width) / 4
    return rows.astype(dtype)


def case_recv(counts: list[list[int]], rank: int, dtype: str = "float64",
              width: int = 2) -> np.ndarray:
    """What rank ``rank`` must hold after the all-to-all: the blocks for it, in sender order."""
    parts = [case_send(counts, p, dtype, width) for p in range(len(counts))]
    at = [np.cumsum([0, *counts[p]]) for p in range(len(counts))]
    return np.concatenate([parts[p][at[p][rank]:at[p][rank + 1]] for p in range(len(counts))])


# ---------------------------------------------------------------- on every rank
def row_offset(buf: Any, base: Any) -> int | None:
    """The row of ``base`` at which ``buf`` starts when ``buf`` is a slice of it, else None."""
    if not (isinstance(buf, torch.Tensor) and isinstance(base, torch.Tensor)) or base.ndim == 0:
        return None
    row = math.prod(base.shape[1:])  # elements per row (the buffers are contiguous)
    if row == 0 or buf.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return None
    at, rest = divmod(buf.storage_offset() - base.storage_offset(), row)
    return at if rest == 0 else None


class TracingComm:
    """Forwards everything to ``comm`` and records each send, receive and sendrecv: op, the
    peers, the rows, where in ``send`` / ``recv`` they start (for slices of them), and whether
    it returned (a deadlock shows where each rank stood)."""

    def __init__(self, comm: Any, send: Any = None, recv: Any = None) -> None:
        self._comm, self.calls, self._send, self._recv = comm, [], send, recv

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    @staticmethod
    def _plain(x):
        """A rank as an int and a buffer as its rows (None if neither): what pickles back."""
        try:
            return int(x) if not hasattr(x, "shape") else (int(x.shape[0]) if x.ndim else 1)
        except (TypeError, ValueError):
            return None

    def _traced(self, op, to, frm, sendbuf, recvbuf, call, *args, **kwargs):
        p = self._plain
        entry = {"op": op, "to": p(to), "frm": p(frm), "out": p(sendbuf), "in": p(recvbuf),
                 "out_at": row_offset(sendbuf, self._send),
                 "in_at": row_offset(recvbuf, self._recv), "done": False}
        self.calls.append(entry)
        result = call(*args, **kwargs)
        entry["done"] = True
        return result

    def send(self, buf: Any, dst: int, *args: Any, **kwargs: Any) -> Any:
        return self._traced("send", dst, None, buf, None, self._comm.send, buf, dst, *args,
                            **kwargs)

    def isend(self, buf: Any, dst: int, *args: Any, **kwargs: Any) -> Any:
        return self._traced("isend", dst, None, buf, None, self._comm.isend, buf, dst, *args,
                            **kwargs)

    def recv(self, buf: Any, src: int, *args: Any, **kwargs: Any) -> Any:
        return self._traced("recv", None, src, None, buf, self._comm.recv, buf, src, *args,
                            **kwargs)

    def irecv(self, buf: Any, src: int, *args: Any, **kwargs: Any) -> Any:
        return self._traced("irecv", None, src, None, buf, self._comm.irecv, buf, src, *args,
                            **kwargs)

    def sendrecv(self, sendbuf: Any, dst: int, recvbuf: Any, src: int, *args: Any,
                 **kwargs: Any) -> Any:
        return self._traced("sendrecv", dst, src, sendbuf, recvbuf, self._comm.sendrecv,
                            sendbuf, dst, recvbuf, src, *args, **kwargs)


def run_student_all_to_all(payload: bytes, counts: list[list[int]], dtype: str, width: int,
                           timeout: float = STUDENT_TIMEOUT) -> dict | None:
    """On every rank: on the first ``len(counts)`` ranks, ``dist.all_to_all_single`` of this
    case's rows, then the student's function (cloudpickled) on the same rows over a
    :class:`TracingComm`. Returns {"recv", "native", "returned", "calls"} or, when the student's
    function raised, {"error", "lines", "calls"}; None on the ranks outside."""
    import traceback

    import cloudpickle
    import torch.distributed as dist

    from course_lib.comm import TorchComm, wait_work
    from course_lib.comm.subgroups import subgroup
    n = len(counts)
    group = subgroup(n)  # every rank makes it, even those left outside
    if dist.get_rank() >= n:
        return None
    r = dist.get_rank()
    send = torch.from_numpy(case_send(counts, r, dtype, width))
    recv_counts = [counts[p][r] for p in range(n)]
    native = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype)
    work = dist.all_to_all_single(native, send.clone(), recv_counts, list(counts[r]),
                                  group=group, async_op=True)
    wait_work(work, timeout, "the native all_to_all_single")
    recv = torch.full_like(native, FILL)
    fn = cloudpickle.loads(payload)
    comm = TracingComm(TorchComm(group, timeout=timeout), send, recv)
    try:
        out = fn(send, recv, comm, list(counts[r]), recv_counts)
    except NotImplementedError:
        return {"not_implemented": True}
    except Exception as e:  # noqa: BLE001 - the student's mistake, reported to the client
        mine = getattr(getattr(fn, "__code__", None), "co_filename", None)
        lines = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(e.__traceback__)
                 if f.filename == mine]  # the client reads these lines from its own cells
        return {"error": f"{type(e).__name__}: {e}", "lines": lines, "calls": comm.calls}
    if out is recv or out is None:
        returned = None if out is None else "recv"
    elif isinstance(out, torch.Tensor):
        returned = out.detach().cpu().numpy().copy()
    else:
        returned = f"a {type(out).__name__}"
    return {"recv": recv.numpy().copy(), "native": native.numpy().copy(), "returned": returned,
            "calls": comm.calls}


# ---------------------------------------------------------------- on the client: all-to-all
def _cases(world_size: int) -> list[tuple[str, list[list[int]], str, int]]:
    """(label, counts, dtype, width): N = 3 with equal blocks first (with 3 ranks a wrong order
    of peers shows; with 2 every order is right), then N = 2, uneven blocks, a rank that sends
    nothing, empty own blocks, and every larger size up to the cluster's."""
    two = ("N=2, rank 1 sends rank 0 nothing", [[1, 3], [0, 2]], "float64", 2)
    cases = [two]
    if world_size >= 3:
        cases = [("N=3, equal blocks", [[2, 2, 2] for _ in range(3)], "float64", 2), two,
                 ("N=3, uneven blocks, some empty", [[1, 0, 3], [2, 2, 0], [0, 4, 1]],
                  "float64", 2),
                 ("N=3, rank 0 sends nothing, own blocks empty",
                  [[0, 0, 0], [3, 0, 2], [1, 2, 0]], "float64", 2)]
    for n in range(4, world_size + 1):
        rng = np.random.default_rng(n)
        counts = rng.integers(0, 4, size=(n, n))
        counts[0, 1] = counts[n - 1, 0] = 0  # some empty blocks, whatever the draw
        cases.append((f"N={n}, uneven blocks, some empty", counts.tolist(), "float64", 2))
    n = world_size
    cases.append((f"N={n}, 1-D float32 rows", [[(p + 2 * q) % 4 for q in range(n)]
                                               for p in range(n)], "float32", 0))
    return cases


def describe_rows(labels: list) -> str:
    """Runs of row labels in words: "rank 1's rows 0-2 for rank 0, 2 row(s) never written"."""
    runs: list[list] = []  # [(sender, destination) or None or "?", first row, last row, rows]
    for lab in labels:
        key, row = (lab[:2], lab[2]) if isinstance(lab, tuple) else (lab, None)
        if runs and runs[-1][0] == key and (row is None or row == runs[-1][2] + 1):
            runs[-1][2], runs[-1][3] = row, runs[-1][3] + 1
        else:
            runs.append([key, row, row, 1])
    words = []
    for key, first, last, k in runs:
        if key is None:
            words.append(f"{k} row(s) never written (still {FILL:g})")
        elif key == "?":
            words.append(f"{k} row(s) that no rank sent")
        else:
            rows = f"row {first}" if first == last else f"rows {first}-{last}"
            words.append(f"rank {key[0]}'s {rows} for rank {key[1]}")
    return ", ".join(words) or "nothing (0 rows)"


def row_labels(buf: np.ndarray) -> list:
    """Each row's (sender, destination, row) read from its :func:`mark`, None for a row never
    written, "?" for anything else."""
    out: list = []
    for v in (buf if buf.ndim == 1 else buf[:, 0]).astype(np.float64):
        m = int(v)
        if v == FILL:
            out.append(None)
        elif v == m and m >= 10_000:
            out.append((m // 10_000 - 1, m % 10_000 // 100, m % 100))
        else:
            out.append("?")
    return out


def _skipped_receive(results: list[dict], counts: list[list[int]]) -> str | None:
    """A rank that returned without asking for a block it had to receive, at the step where
    its own block to send was empty (the step skipped for it), in words."""
    n = len(counts)
    for r, res in enumerate(results):
        if not res or "calls" not in res or "error" in res:
            continue
        asked = {c["frm"] for c in res["calls"]}
        for p in range(n):
            to = (2 * r - p) % n  # rank r's partner to send to at the step it receives from p
            if p != r and counts[p][r] and p not in asked and counts[r][to] == 0 and to != r:
                return (f"rank {r} never called a receive from rank {p}, whose block for it "
                        f"has {counts[p][r]} row(s). At that step rank {r}'s own block for "
                        f"rank {to} is empty: the step was skipped because of it, but the "
                        f"receive in it is not empty. An empty block still makes its step (a "
                        f"slice of 0 rows).")
    return None


def _received_elsewhere(rank: int, p: int, calls: list[dict]) -> bool:
    """Whether ``rank`` completed a receive from ``p`` into a buffer outside recv."""
    return any(c["frm"] == p and c["done"] and c["in_at"] is None and c["in"] for c in calls)


def _diagnose_rows(rank: int, counts: list[list[int]], got: np.ndarray,
                   returned: Any, calls: list[dict] = ()) -> str:
    """What landed where on ``rank``, and what that says about the offsets."""
    n = len(counts)
    recv_counts = [counts[p][rank] for p in range(n)]
    at = np.cumsum([0, *recv_counts]).tolist()
    labels = row_labels(got)
    if all(lab is None for lab in labels):
        if isinstance(returned, np.ndarray):
            return (f"rank {rank}'s recv was never written (it still holds {FILL:g} "
                    f"everywhere); your function returned another tensor. Write the blocks "
                    f"into recv itself (recv[a:b] = ..., or receive straight into a slice of "
                    f"recv), then return recv.")
        return (f"rank {rank}'s recv was never written: receive straight into its slices "
                f"(a slice of a tensor is a view) and copy the own block into it. {SCHEDULE}")
    for p in range(n):
        a, b = at[p], at[p + 1]
        want = [(p, rank, i) for i in range(recv_counts[p])]
        have = labels[a:b]
        if have == want:
            continue
        where = (f"on rank {rank}, recv[{a}:{b}] must hold rank {p}'s block for it "
                 f"({recv_counts[p]} rows); it holds {describe_rows(have)}")
        if all(lab is None for lab in have):
            if p == rank:
                return (f"{where}: the own block is not there (never copied, or copied "
                        f"elsewhere and overwritten). Rank r's block for itself does not "
                        f"travel: recv[recv_at[r]:recv_at[r + 1]] = send[send_at[r]:"
                        f"send_at[r + 1]], both offsets from their own counts (recv_counts = "
                        f"{recv_counts}: the offsets {at}).")
            if _received_elsewhere(rank, p, calls):
                return (f"{where}: rank {rank} did receive rank {p}'s block, but into a buffer "
                        f"that is not part of recv (a new tensor, a .clone() of a slice, or "
                        f"rows picked by a list: copies, not views), and the rows never "
                        f"reached recv.")
            return (f"{where}: rank {p}'s block never arrived. Every rank exchanges with every "
                    f"other once: N - 1 = {n - 1} steps, s in range(1, N). {SCHEDULE}")
        mine = [i for i, lab in enumerate(labels) if lab in want]
        if mine and sorted(labels[i] for i in mine) == want and a < b:
            return (f"{where}: rank {p}'s block landed at recv[{mine[0]}:{mine[-1] + 1}] "
                    f"instead. Received blocks go in sender order: the block from rank p "
                    f"starts at recv_at[p] = sum(recv_counts[:p]) (here recv_counts = "
                    f"{recv_counts}: the offsets {at}).")
        other = sorted({lab[1] for lab in have if isinstance(lab, tuple) and lab[1] != rank})
        if other:
            return (f"{where}: rows rank {p} meant for rank(s) {other}, not for rank {rank}. "
                    f"The sender cut the wrong block out of send: the block for rank to "
                    f"starts at send_at[to] = sum(send_counts[:to]) and has "
                    f"send_counts[to] rows.")
        senders = sorted({lab[0] for lab in have if isinstance(lab, tuple)} - {p})
        if senders:
            return (f"{where}: the block from rank {senders[0]} landed where rank {p}'s "
                    f"belongs. Received blocks go in sender order: the block from rank p "
                    f"starts at recv_at[p] = sum(recv_counts[:p]) (here the offsets "
                    f"{at}).")
        return f"{where}. {SCHEDULE}"
    return SCHEDULE


def _diagnose_slices(results: list[dict], counts: list[list[int]]) -> str | None:
    """The first send or receive, on any rank, whose slice of send / recv is not its block."""
    n = len(counts)
    for r, res in enumerate(results):
        send_at = np.cumsum([0, *counts[r]]).tolist()
        recv_counts = [counts[p][r] for p in range(n)]
        recv_at = np.cumsum([0, *recv_counts]).tolist()
        for c in res.get("calls", []):
            to, frm = c["to"], c["frm"]
            if isinstance(to, int) and 0 <= to < n and to != r and c["out_at"] is not None:
                a, b = send_at[to], send_at[to + 1]
                if (c["out_at"], c["out"]) != (a, b - a):
                    used = f"send[{c['out_at']}:{c['out_at'] + c['out']}]"
                    return (f"rank {r} sent {used} to rank {to}; its block for rank {to} is "
                            f"send[{a}:{b}] ({b - a} rows: send_counts[{to}]). The block for "
                            f"rank to starts at send_at[to] = sum(send_counts[:to]) (here "
                            f"send_counts = {counts[r]}: the offsets {send_at}).")
            if isinstance(frm, int) and 0 <= frm < n and frm != r:
                a, b = recv_at[frm], recv_at[frm + 1]
                at = c["in_at"]
                if c["in"] != b - a or (at is not None and at != a):
                    used = (f"recv[{at}:{at + c['in']}]" if at is not None
                            else f"a buffer of {c['in']} rows")
                    why = ""
                    if c["in"] == counts[r][frm] != b - a:
                        why = (f" Its size is send_counts[{frm}] = {counts[r][frm]}: what rank "
                               f"{r} sends rank {frm}, not what it receives from it. ")
                    elif at is not None and at == send_at[frm] != a:
                        why = (f" It starts at the offset send_counts would give, "
                               f"{send_at[frm]}: receives are placed by recv_counts. ")
                    elif c["in"] == sum(recv_counts) // n != b - a:
                        why = " That is an equal share of recv, but the blocks are uneven. "
                    return (f"counts or offsets do not match: rank {r} received rank {frm}'s "
                            f"block into {used}; it is recv[{a}:{b}] ({b - a} rows: "
                            f"recv_counts[{frm}]).{why or ' '}The block from rank frm starts "
                            f"at recv_at[frm] = sum(recv_counts[:frm]) (here recv_counts = "
                            f"{recv_counts}: the offsets {recv_at}).")
    return None


# "rank 1: sendrecv from rank 0 of 6 x float64 (48 bytes) over torch (world size 3): rank 0
# sent 32 bytes (4 x float64) but the receive buffer holds 48 bytes" (course_lib.comm's words)
MISFIT = re.compile(r"rank (\d+): \w+ from rank (\d+) of .*?: rank \d+ sent (\d+) bytes .*?"
                    r"holds (\d+) bytes")


def _diagnose_misfit(match: re.Match, counts: list[list[int]], row_bytes: int) -> str:
    """A message that did not fit its receive: which count each side used."""
    q, p, sent, holds = (int(g) for g in match.groups())
    n, want = len(counts), counts[p][q]
    sent_rows, held_rows = sent // row_bytes, holds // row_bytes
    told = (f"counts do not match: rank {p} sent rank {q} {sent_rows} row(s), and rank {q} "
            f"received them into a slice of {held_rows} row(s); the block is {want} row(s) "
            f"(send_counts[{q}] on rank {p} = recv_counts[{p}] on rank {q} = {want})")
    if held_rows != want:
        if held_rows == counts[q][p]:
            return (f"{told}. Rank {q} sized its receive with send_counts[{p}] = "
                    f"{counts[q][p]}: what it sends rank {p}, not what it receives from it. "
                    f"Receives use recv_counts (and offsets from recv_counts).")
        equal = sum(counts[s][q] for s in range(n)) // n
        if held_rows == equal:
            return (f"{told}. {held_rows} rows is an equal share of recv: the blocks are "
                    f"uneven, use recv_counts[frm] rows from rank frm.")
        return (f"{told}. Rank {q}'s slice for rank {p}'s block is off: it is recv[recv_at[{p}]:"
                f"recv_at[{p + 1}]], recv_at the running sum of recv_counts.")
    return (f"{told}. Rank {p} cut the wrong block out of send: its block for rank to is "
            f"send[send_at[to]:send_at[to + 1]], send_at the running sum of send_counts.")


def _stuck(results: list[dict]) -> dict[int, dict]:
    """Each rank's call that never returned."""
    return {r: next(c for c in res["calls"] if not c["done"]) for r, res in enumerate(results)
            if res and any(not c["done"] for c in res.get("calls", []))}


def _diagnose_deadlock(results: list[dict]) -> str:
    """Where each rank stood at the deadline, and the order that put it there."""
    n = len(results)
    stuck = _stuck(results)
    where = "; ".join(f"rank {r} in {c['op']}" + (f" to rank {c['to']}" if c["to"] is not None
                                                 else "")
                      + (f" from rank {c['frm']}" if c["frm"] is not None else "")
                      for r, c in sorted(stuck.items()))
    stood = f"At the deadline: {where}." if where else ""
    first = {r: next((c["to"] for c in res["calls"] if c["to"] is not None), None)
             for r, res in enumerate(results) if res}
    if any(c["op"] == "send" for c in stuck.values()):
        peers = {r: [c["to"] for c in res["calls"] if c["to"] is not None]
                 for r, res in enumerate(results) if res}
        ascending = n > 2 and all(to and to == [q for q in range(n) if q != r][:len(to)]
                                  for r, to in peers.items())
        if ascending:
            return (f"{stood} Every rank goes through its peers in the same order (0, 1, 2, "
                    f"...): ranks 1 .. N-1 all send to rank {first.get(1)} first, and a blocking "
                    f"send waits until its peer receives, which rank 0, sending itself, never "
                    f"does. Give every rank a different partner at each step: send to (r + s) "
                    f"mod N and receive from (r - s) mod N in one comm.sendrecv. {SCHEDULE}")
        return (f"{stood} Blocking sends in a cycle: comm.send waits until the peer posts its "
                f"receive, and every rank sent before receiving, so nobody received. Use "
                f"comm.sendrecv(block for to, to, slice for frm, frm): it posts the receive "
                f"first. {SCHEDULE}")
    if any(c["op"] == "sendrecv" and c["to"] == c["frm"] for c in stuck.values()) and n > 2:
        return (f"{stood} Each rank received from the rank it sent to, (r + s) mod N: that rank "
                f"sends to (r + 2s) mod N at step s and reaches rank r only later, so every "
                f"rank waits. At step s receive from (r - s) mod N, the rank whose (r + s) is "
                f"you. {SCHEDULE}")
    return (f"{stood} The ranks waited for each other until the deadline: at some step a rank "
            f"waited for a peer that was not sending to it then. {SCHEDULE}")


def _remote_failure(where: str, results: list[dict], counts: list[list[int]],
                    row_bytes: int) -> None:
    """Raise CheckFailed for a case in which the student's function raised on some rank."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    errors = {r: res["error"] for r, res in enumerate(results) if res and "error" in res}
    lines = "\n  ".join(f"rank {r}: {text.splitlines()[0]}" for r, text in errors.items())
    told = f"{where}\n  your function raised on rank(s) {sorted(errors)}:\n  {lines}"
    own = _student_lines(results)
    if own:
        told += "\n  " + own
    misfits = [m for m in (MISFIT.search(t) for t in errors.values()) if m]
    # a rank whose own code failed (not a wait): the others then wait for it in vain
    crashed = [t for t in errors.values() if not t.startswith(("CommTimeout", "CommError"))]
    if misfits:
        hint = _diagnose_slices(results, counts) or _diagnose_misfit(misfits[0], counts,
                                                                     row_bytes)
    elif any("must match the existing size" in t or "must match the size" in t
             for t in crashed):
        hint = ("a slice of recv and a slice of send differ in rows. The blocks are uneven: "
                "every offset and size comes from the counts (the own block has send_counts[r] "
                "= recv_counts[r] rows; an equal share, len(send) // N, is not a block). "
                + SCHEDULE)
    elif any("to itself" in t for t in crashed):
        hint = (f"a rank does not send to itself: its own block is a copy, recv[recv_at[r]:"
                f"recv_at[r + 1]] = send[send_at[r]:send_at[r + 1]], and the steps run "
                f"s = 1 .. N-1. {SCHEDULE}")
    elif any(t.startswith(("NameError", "PicklingError")) for t in crashed):
        hint = ("your function runs on the engines: define or import everything it uses in "
                "the notebook's cells, and do not use the cluster object in it.")
    elif crashed:
        hint = (f"read the error of the rank that raised it first (the others, if they timed "
                f"out, were waiting for it). {SCHEDULE}")
    elif any(t.startswith("CommTimeout") for t in errors.values()):
        hint = _skipped_receive(results, counts) or _diagnose_deadlock(results)
    else:
        hint = SCHEDULE
    raise CheckFailed(f"{told}\nHint: {hint}")


def _student_lines(results: list[dict]) -> str:
    """The student's own line where the first failing rank raised (read from this kernel's
    cells, where the function was defined)."""
    import linecache
    for r, res in enumerate(results):
        for file, lineno, name in (res or {}).get("lines", [])[-1:]:
            text = linecache.getline(file, lineno).strip()
            return f"rank {r}, in {name}, line {lineno}" + (f": {text}" if text else "")
    return ""


def _check_schedule(where: str, results: list[dict], counts: list[list[int]]) -> None:
    """The right rows, by the pairwise exchange: N - 1 messages per rank, one to each other
    rank, and at each step every rank a different partner."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    n = len(counts)
    sends = [[c["to"] for c in res["calls"] if c["to"] is not None] for res in results]
    if n > 1 and not any(sends) and any(counts[p][q] for p in range(n) for q in range(n)
                                        if p != q):
        raise CheckFailed(f"{where}\n  the rows are right, but no rank sent a message over "
                          f"comm.\nHint: write the exchange with comm.sendrecv (not a "
                          f"torch.distributed collective). {SCHEDULE}")
    for r, to in enumerate(sends):
        needed = [q for q in range(n) if q != r]
        if sorted(to) != needed and sorted(to) != [q for q in needed if counts[r][q]]:
            raise CheckFailed(f"{where}\n  the rows are right, but rank {r} sent messages to "
                              f"ranks {to}: the pairwise exchange sends one block to each "
                              f"other rank, {needed}.\nHint: {SCHEDULE}")
    if any(len(to) != n - 1 for to in sends):
        return  # empty blocks skipped on both sides: no step structure to compare
    for s in range(n - 1):
        peers = [to[s] for to in sends]
        if len(set(peers)) < n:
            busy = next(q for q in peers if peers.count(q) > 1)
            who = [r for r, q in enumerate(peers) if q == busy]
            raise CheckFailed(
                f"{where}\n  the rows are right, but this is not the pairwise exchange: at step "
                f"{s + 1} ranks {who} all send to rank {busy}, which takes one at a time while "
                f"others idle (message order per rank: {sends}).\nHint: every rank sends to "
                f"the same peer first when all go through the peers in the same order. Give "
                f"each a different partner at every step. {SCHEDULE}")


def check_all_to_all(student_fn: Callable, cluster: Any,
                     timeout: float = STUDENT_TIMEOUT) -> bool:
    """Lab 15, exercise 1: ``my_all_to_all(send, recv, comm, send_counts, recv_counts)`` fills
    ``recv`` exactly as ``dist.all_to_all_single`` does, on N = 2 .. ``cluster.n`` ranks with
    uneven blocks, by the pairwise exchange. A deadlock ends after ``timeout`` seconds with a
    hint. Prints a pass line and returns True, returns False while the function raises
    NotImplementedError, raises ``CheckFailed`` otherwise."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    from course_lib.runtime.cluster import ClusterError, ClusterTimeout, RemoteError
    if cluster.n < 2:
        raise ValueError(f"check_all_to_all needs a cluster of at least 2 engines, this one has "
                         f"{cluster.n}")
    try:
        payload = pack_function(student_fn)
    except Exception as e:
        raise CheckFailed(f"check_all_to_all: your function cannot be sent to the engines "
                          f"({e}).\nHint: do not refer to the cluster or open files in it."
                          ) from None
    cases = _cases(cluster.n)
    for number, (label, counts, dtype, width) in enumerate(cases, start=1):
        where = f"check_all_to_all: case {number}/{len(cases)} ({label}; counts {counts})"
        n = len(counts)
        try:
            results = cluster.run(run_student_all_to_all, payload, counts, dtype, width,
                                  timeout, timeout=timeout + 30)[:n]
        except ClusterTimeout as err:
            raise CheckFailed(f"{where}\n  {err}\nHint: your function did not return: an "
                              f"endless loop, or a wait without a deadline? {SCHEDULE}"
                              ) from None
        except RemoteError as err:  # not the student's code: it is caught on the engines
            raise CheckFailed(f"{where}\n  {err}\nHint: the native all_to_all_single failed "
                              f"before your function ran; run the cell again (the next call "
                              f"repairs the cluster).") from None
        except ClusterError as err:  # an engine died
            raise CheckFailed(f"{where}\n  {err}\nHint: an engine process died while running "
                              f"your function (the next call restarts it). {SCHEDULE}") from None
        if any(res and res.get("not_implemented") for res in results):
            return not_implemented("check_all_to_all")
        row_bytes = np.dtype(dtype).itemsize * max(width, 1)
        if any("error" in res for res in results):
            _remote_failure(where, results, counts, row_bytes)
        for rank, res in enumerate(results):
            if np.array_equal(res["recv"], res["native"]):
                continue
            problem = (f"rank {rank}'s recv differs from dist.all_to_all_single's: expected "
                       f"{describe_rows(row_labels(res['native']))}; got "
                       f"{describe_rows(row_labels(res['recv']))}")
            hint = _diagnose_slices(results, counts) or _skipped_receive(results, counts) or \
                _diagnose_rows(rank, counts, res["recv"], res["returned"], res["calls"])
            raise CheckFailed(f"{where}\n  {problem}\nHint: {hint}")
        for rank, res in enumerate(results):  # the reference itself, row for row
            if not np.array_equal(res["native"], case_recv(counts, rank, dtype, width)):
                raise RuntimeError(f"rank {rank}: dist.all_to_all_single disagrees with the "
                                   f"marks the check expects")
        _check_schedule(where, results, counts)
    print(f"✓ check_all_to_all: {len(cases)}/{len(cases)} cases match dist.all_to_all_single "
          f"on every rank, by the pairwise exchange")
    return True


# ---------------------------------------------------------------- exercise 2: the dispatch
DISPATCH_CASES = [  # (label, tokens, experts, top_k, capacity_factor, seed)
    ("top-1, no capacity", 12, 4, 1, None, 0),
    ("top-2, no capacity", 12, 4, 2, None, 1),
    ("top-1, capacity factor 1.0: 3.75 slots", 30, 8, 1, 1.0, 2),
    # ceil(f k T / E) = 5; ceil(f T / E) k = 6 and floor = 4: where the rounding goes matters
    ("top-2, capacity factor 1.0: 4.5 slots", 18, 8, 2, 1.0, 3),
    ("top-2, capacity factor 1.0: exactly 5 slots", 20, 8, 2, 1.0, 6),  # int(x) + 1 = 6
    ("top-2, capacity factor 0.75: 7.5 slots", 20, 4, 2, 0.75, 4),
    ("top-1, capacity factor 0.5: 2.25 slots", 18, 4, 1, 0.5, 5),
    ("top-1, capacity factor 1.25: exactly 5 slots", 16, 4, 1, 1.25, 7),
]  # factors exact in binary: a float product and moe.capacity's decimal one agree


def dispatch_logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    """Seeded router logits (float64) that favour the first experts, so capacity binds."""
    gen = torch.Generator().manual_seed(seed)
    skew = torch.linspace(1.5, 0.0, experts, dtype=torch.float64)
    return torch.randn(tokens, experts, dtype=torch.float64, generator=gen) + skew


def reference_dispatch(logits: torch.Tensor, top_k: int,
                       capacity_factor: float | None) -> tuple:
    """``moe.route``'s answer as the lab asks for it: (expert, gate, kept, dropped)."""
    r = moe.route(logits, top_k, capacity_factor)
    return r.expert, r.gate, r.kept, r.dropped


def keep_in_order(expert: torch.Tensor, experts: int, limit: int, order: str,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """(T, k) booleans: each expert takes its first ``limit`` choices in ``order``:
    "choices first" (GShard: every first choice in token order, then the second ones),
    "tokens first" (token 0's choices, then token 1's), "later choices first", "tokens
    reversed", "by gate" (the most confident choices first). The right one and the usual
    wrong ones, written as plain loops."""
    T, k = expert.shape
    if order == "choices first":
        seq = [(t, j) for j in range(k) for t in range(T)]
    elif order == "tokens first":
        seq = [(t, j) for t in range(T) for j in range(k)]
    elif order == "later choices first":
        seq = [(t, j) for j in reversed(range(k)) for t in range(T)]
    elif order == "tokens reversed":
        seq = [(t, j) for j in range(k) for t in reversed(range(T))]
    elif order == "by gate":
        seq = sorted(((t, j) for t in range(T) for j in range(k)),
                     key=lambda tj: -float(gate[tj]))
    else:
        raise ValueError(f"unknown order {order!r}")
    kept = torch.zeros(T, k, dtype=torch.bool)
    used = [0] * experts
    for t, j in seq:
        e = int(expert[t, j])
        if used[e] < limit:
            kept[t, j], used[e] = True, used[e] + 1
    return kept


ORDER_HINTS = {
    "tokens first": "second choices took slots before first choices: a token's second choice "
                    "was queued right after its first, ahead of later tokens' first choices. "
                    "Give every first choice its slot (in token order) before any second choice.",
    "later choices first": "second choices were served before first choices. Go through the "
                           "first choices of all tokens first, then the second ones.",
    "tokens reversed": "slots went to the last tokens first: token order was not respected "
                       "(an expert keeps its earliest tokens, as they come).",
    "by gate": "slots went to the most confident choices first: that is a different policy "
               "(batch prioritised routing). Here slots go in token order, first choices "
               "before second ones.",
}


def _diagnose_dispatch(expected: tuple, got: Any, args: tuple) -> str | None:
    """Match a wrong dispatch against the usual mistakes, in the order they would show."""
    logits, k, factor = args
    T, E = logits.shape
    try:
        expert, gate, kept, dropped = got
        expert, gate, kept = (torch.as_tensor(x) for x in (expert, gate, kept))
    except (TypeError, ValueError):
        return "return four things: expert, gate, kept (each (T, top_k)) and dropped (an int)."
    if any(x.shape != (T, k) for x in (expert, gate, kept)):
        return (f"expert, gate and kept are ({T}, {k}) here: one row per token, one column per "
                f"choice, even for top-1 (topk keeps that dimension).")
    e_exp, g_exp, k_exp, d_exp = expected
    probs = torch.softmax(logits, dim=-1)
    over_tokens = torch.softmax(logits, dim=0)
    if not torch.equal(expert.long(), e_exp):
        if torch.equal(expert.long().sort(1).values, e_exp.sort(1).values):
            return ("the right experts, in the wrong order: the most probable first (topk "
                    "returns them so; a sort by index does not).")
        if torch.equal(expert.long(), over_tokens.topk(k, dim=-1).indices):
            return ("the softmax went over the tokens (dim=0): each token's probabilities are "
                    "a softmax over the experts, dim=-1.")
        t = int((expert.long() != e_exp).any(1).nonzero()[0])
        return (f"token {t} chose experts {expert[t].tolist()}; its {k} most probable are "
                f"{e_exp[t].tolist()} (probabilities {[round(p, 4) for p in probs[t].tolist()]}).")
    if not torch.allclose(gate.to(torch.float64), g_exp, rtol=1e-6, atol=1e-9):
        g = gate.to(torch.float64)
        close = lambda a: a.shape == g.shape and torch.allclose(g, a, rtol=1e-6, atol=1e-9)
        top_logits = logits.gather(1, e_exp)
        if close(top_logits) or (k > 1 and close(top_logits / top_logits.sum(1, keepdim=True))):
            return ("the gates are the raw logits: take the softmax over the experts first "
                    "(probs = torch.softmax(logits, dim=-1)); the gates are probabilities.")
        if close(over_tokens.gather(1, e_exp)):
            return ("the softmax went over the tokens (dim=0): each token's probabilities are "
                    "a softmax over the experts, dim=-1.")
        if k > 1 and close(probs.gather(1, e_exp)):
            return (f"the gates are the probabilities themselves (token 0's add up to "
                    f"{float(g[0].sum()):.4f}); with top-2 each token's gates are renormalised "
                    f"to add up to 1.")
        if k == 1 and close(torch.ones_like(g)):
            return ("every gate is 1: with top-1 the gate is the expert's probability itself "
                    "(Switch), not renormalised (one value over itself is 1).")
        return ("the gates are the chosen experts' probabilities (softmax over the experts), "
                "renormalised over the top-k for top-2 only.")
    if not torch.equal(kept.bool(), k_exp):
        return _diagnose_kept(kept.bool(), k_exp, e_exp, g_exp, k, factor, T, E)
    try:
        d = int(dropped)
    except (TypeError, ValueError):
        return "dropped is one number: how many choices found their expert full."
    if d != d_exp:
        return _diagnose_dropped(d, k_exp, k, factor, T, E)
    return None


def _diagnose_kept(kept, k_exp, expert, gate, k, factor, T, E) -> str:
    t, j = (kept != k_exp).nonzero()[0].tolist()
    example = (f" (Token {t}'s choice {j + 1}, expert {int(expert[t, j])}: "
               f"{'kept' if k_exp[t, j] else 'dropped'} by the reference, "
               f"{'kept' if kept[t, j] else 'dropped'} by yours.)")
    return _kept_mistake(kept, k_exp, expert, gate, k, factor, T, E) + example


def _kept_mistake(kept, k_exp, expert, gate, k, factor, T, E) -> str:
    limit = moe.capacity(T, E, k, factor)
    if factor is None:
        return ("capacity_factor None means no capacity: every choice is kept (kept all True, "
                "dropped 0).")
    x = factor * k * T / E
    # the capacities under which the right order gives the student's kept
    took = [c for c in range(T * k + 1)
            if torch.equal(kept, moe.keep_within_capacity(expert, E, c))]
    share = factor * T / E
    wrong = [  # (their capacity, what it says), first match wins
        (math.floor(x) + 1, f"your experts took up to {math.floor(x) + 1} choices, one more "
                            f"than {x:g} slots: int(x) + 1 is the ceiling only when x is not "
                            f"whole; the ceiling of a whole number is the number itself."),
        (math.ceil(share) * k, f"your capacity is {math.ceil(share) * k} = ceil({share:g}) x "
                               f"{k}: rounded before it was multiplied by top_k. The ceiling "
                               f"is of the whole product, capacity_factor x top_k x T / E = "
                               f"{x:g}, which rounds up to {limit}."),
        (math.ceil(share), f"your capacity is {math.ceil(share)}, which leaves out top_k: every "
                           f"token makes {k} choices, so an expert's fair share of them is "
                           f"top_k x T / E."),
        (math.floor(x), f"your experts took at most {math.floor(x)} choices: {x:g} rounded "
                        f"down (int(), floor(), //, round()). A fractional slot rounds up."),
        (math.ceil(factor * k * E / T), f"your capacity is {math.ceil(factor * k * E / T)}: "
                                        f"E / T upside down. An expert's fair share is the "
                                        f"k x T choices over the E experts."),
    ]
    for value, text in wrong:
        if value != limit and value in took:
            return text
    for order, text in ORDER_HINTS.items():
        if torch.equal(kept, keep_in_order(expert, E, limit, order, gate)):
            return text
    counts = torch.bincount(expert[kept], minlength=E).tolist()
    over = [e for e in range(E) if counts[e] > limit]
    if over:
        return (f"expert {over[0]} kept {counts[over[0]]} choices, over its capacity of "
                f"{limit} (each expert has its own capacity: the slots are not pooled).")
    if k > 1 and not kept[:, 1:].any() and k_exp[:, 1:].any():
        return ("no second choice was ever kept, but experts with free slots are there for "
                "them: after the first choices, the second choices take the slots left.")
    for e in range(E):
        mine = [(int(t), int(j) + 1) for t, j in ((expert == e) & kept).nonzero().tolist()]
        right = [(int(t), int(j) + 1) for t, j in ((expert == e) & k_exp).nonzero().tolist()]
        if sorted(mine) != sorted(right):
            return (f"expert {e} (capacity {limit}) kept (token, choice) {sorted(mine)}; it "
                    f"keeps {sorted(right)}: its first {limit} choices, first choices in token "
                    f"order, then second choices in token order.")
    return f"each expert keeps its first {limit} choices: first choices, then second ones."


def _diagnose_dropped(d, kept, k, factor, T, E) -> str:
    right = int((~kept).sum())
    limit = moe.capacity(T, E, k, factor)
    if d == int((~kept).any(1).sum()) and k > 1:
        return (f"you counted the tokens that lost a choice ({d}); dropped counts the choices "
                f"that found their expert full ({right}).")
    if d == int((~kept).all(1).sum()) and k > 1:
        return (f"you counted the tokens that lost every choice ({d}); dropped counts the "
                f"choices that found their expert full ({right}).")
    if d == int(kept.sum()):
        return f"that is the number of kept choices; dropped is the rest, {right}."
    if d == max(T * k - E * limit, 0):
        return (f"max(T * k - E * capacity, 0) = {d} assumes every slot is used; an expert "
                f"that few tokens chose leaves slots empty. Count the choices that were not "
                f"kept ({right} here).")
    return f"dropped counts the choices that were not kept ({right} here), yours {d}."


def check_dispatch(student_fn: Callable) -> bool:
    """Lab 15, exercise 2: ``my_dispatch(logits, top_k, capacity_factor) -> (expert, gate,
    kept, dropped)`` equals ``moe.route``'s on 8 cases, top-1 and top-2, with and without
    capacity (fractional and whole numbers of slots); a wrong answer is matched against the
    usual mistakes."""
    __tracebackhide__ = True  # IPython shows the hint, not the check's frames
    cases = [Case(label, lambda c=(T, E, k, f, seed): (dispatch_logits(c[0], c[1], c[4]),
                                                       c[2], c[3]))
             for label, T, E, k, f, seed in DISPATCH_CASES]
    return run_check("check_dispatch", student_fn, reference_dispatch, cases,
                     output_names=("expert", "gate", "kept", "dropped"), rtol=1e-6, atol=1e-9,
                     inputs_unchanged=True, arg_names=("logits",), diagnose=_diagnose_dispatch,
                     hint="the first difference is above: which of the exercise's six steps "
                          "made it?")
