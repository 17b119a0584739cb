"""The wire of the parameter server: ZeroMQ sockets, one message format, the server loop and the
worker's connections.

Introduced in notebooks/04_parameter_server.ipynb; :mod:`course_lib.ps` drives it and hands each
server a policy (what to do with a push); the loop here keeps the sockets, the deadlines, the
checkpoints, the restarts and the statistics. Each server
rank binds one ROUTER socket (127.0.0.1 and a free port unless ``host=`` says otherwise); each
worker opens one DEALER socket per server. A message is two frames: a small JSON header and the
raw bytes of a float64 vector (no pickle on the hot path). Why ZeroMQ and not Gloo send/recv: a
server answers whichever worker is ready (any source), a worker that dies is simply not heard
from any more (a Gloo pair would error or hang), and every wait is a ``poll`` with a deadline.

Operations (worker -> server, the reply carries the server's shard and version):
``init`` (the chief worker sets the starting shard), ``pull``, ``push`` (a gradient sum over
``count`` samples, computed on the shard of version ``version``; the reply is the updated shard,
so a push is also the next pull) and ``done``.

A server that dies can come back (``ps.train(..., server_restarts=1)``, notebook 11): the
server runs in a child process of its rank that checkpoints its shard (at ``init``, every
``checkpoint_every`` updates and when a worker finishes); when the child is killed, the rank
starts another on the same address, which resumes from the last checkpoint, as Kubernetes
restarts a failed container in place. A worker that hears nothing within ``retry`` s closes its
socket, opens a new one and sends the same request again (the "lazy pirate" of the ZeroMQ
guide), until the deadline. A push carries its worker's sequence number: a server that already
applied it (its reply came too late for the closed socket) answers the copy without applying
the gradient twice.

On an emulated network (``start_cluster(link=...)``, :mod:`course_lib.runtime.netem`) the header
carries the sender's stamp and every message pays the link's time: a server's single link carries
every worker's push, one after another, which is why sharding the parameters over more servers
helps.

It stays one file: the server and the worker speak one message format over one pair of sockets,
and each side reads best beside the other.

The server is handed its ``cfg`` (a ``ps.PSConfig``) and ``policy`` (a ``ps.Policy``) and hints
them as ``Any``: :mod:`course_lib.ps` imports this module, so naming its classes here, even for
the type checker only, would make the two modules import each other.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import zmq
from numpy.typing import ArrayLike

from course_lib.runtime import fault_points, netem
from course_lib.runtime.engine import ENGINE
from course_lib.sharding import shard_bounds


class PSError(RuntimeError):
    """A parameter-server step failed; the message names the server, the worker and the step.

    Introduced in notebooks/04_parameter_server.ipynb."""


def _send(sock, header, payload=None, identity=None):
    data = memoryview(b"" if payload is None else np.ascontiguousarray(payload, np.float64))
    link, end = netem.current(), None
    if link is not None:  # on an emulated network: stamp it, and send for as long as it takes
        header["stamp"], end = netem.send_stamp(link, data.nbytes)
    frames = [] if identity is None else [identity]
    frames += [json.dumps(header).encode(), data]
    sock.send_multipart(frames, copy=False)
    if end is not None:
        netem.sleep_until(end)
    return data.nbytes  # bytes (len() of a float64 memoryview counts elements)


def _arrived(header, payload):
    """A message is here for real; on an emulated network, wait until the link delivers it."""
    link = netem.current()
    if link is not None:
        netem.receive(link, header.get("stamp"), len(payload))


def _recv(sock, timeout, what):
    """One message within ``timeout`` s, else PSError naming ``what``."""
    if not sock.poll(int(timeout * 1000)):
        raise PSError(f"rank {ENGINE.get('rank')}: no reply to {what} within {timeout:g}s")
    # a ROUTER socket puts the sender's identity frame first; a DEALER receives none
    *identity, header, payload = sock.recv_multipart(copy=True)
    header = json.loads(header)
    _arrived(header, payload)
    return (identity[0] if identity else None), header, payload


# ---------------------------------------------------------------- the server
@dataclass
class Shard:
    """One server's slice of the parameters, and its version: the updates applied so far.
    Introduced in notebooks/04_parameter_server.ipynb."""

    theta: np.ndarray
    version: int = 0


_BOUND: dict = {}  # on a server rank: its ROUTER socket between bind and serve


def bind_server(spec: dict, host: str = "127.0.0.1") -> str | None:
    """On a ps rank: bind a ROUTER socket to a free port; return ``tcp://host:port`` (else None).

    Introduced in notebooks/04_parameter_server.ipynb."""
    if ENGINE["rank"] not in spec["ps"]:
        return None
    close_server()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port(f"tcp://{host}")
    _BOUND.update(sock=sock, address=f"tcp://{host}:{port}")
    return _BOUND["address"]


def close_server(linger: int = 0) -> None:
    """Close the socket :func:`bind_server` bound, if any (``linger`` ms to deliver what is
    queued). Introduced in notebooks/04_parameter_server.ipynb."""
    sock = _BOUND.pop("sock", None)
    if sock is not None:
        sock.close(linger=linger)


def serve(spec: dict, n_params: int, cfg: Any, policy: Any,
          sock: zmq.Socket | None = None) -> dict:
    """Serve this rank's shard until every worker said done (or went silent in async mode),
    doing with each push what ``policy`` (:class:`course_lib.ps.Synchronous` or
    ``Asynchronous``) decides; ``cfg`` is a :class:`course_lib.ps.PSConfig`. Returns the
    statistics. Introduced in notebooks/04_parameter_server.ipynb."""
    return ShardServer(spec, n_params, cfg, policy, _BOUND["sock"] if sock is None else sock).run()


class ShardServer:
    """One server's loop: messages in, the policy's decisions, replies out, every wait with a
    deadline; checkpoints, restores and statistics around it.
    Introduced in notebooks/04_parameter_server.ipynb."""

    def __init__(self, spec: dict, n_params: int, cfg: Any, policy: Any,
                 sock: zmq.Socket) -> None:
        self.sock, self.cfg, self.policy, self.rank = sock, cfg, policy, ENGINE["rank"]
        s = spec["ps"].index(self.rank)  # this server's index among the servers: its shard
        start, stop = shard_bounds(n_params, s, len(spec["ps"]))
        self.workers = list(spec["worker"])
        self.stats = dict(server=self.rank, shard=(start, stop), pushes=0, pulls=0, bytes_in=0,
                          bytes_out=0, lost=[], per_worker={w: 0 for w in self.workers},
                          used=[], step_ends=[], restored_from=None, skipped=[], duplicates=0)
        self.shard, self.waiting_init = None, []
        self.done, self.heard = set(), {w: time.monotonic() for w in self.workers}
        self.applied = {}  # worker -> highest number of its pushes applied: a resend is answered
        self.held = {}     # sync: worker -> identity to answer once the step is taken
        # notebook 11: a checkpoint.Store, handed in (this lesson does not know how it saves)
        self.store = cfg.checkpoints and cfg.checkpoints.inside(f"server-{s}", keep=2)
        if self.store:
            theta, version, self.done, self.applied = _restore(self.store, self.stats)
            self.shard = None if theta is None else Shard(theta, version)
        self.stats["ready"] = time.monotonic()  # restored (if need be): serving from now on

    @property
    def version(self) -> int:
        return 0 if self.shard is None else self.shard.version

    def save(self) -> None:
        if self.store:
            _save(self.store, None if self.shard is None else self.shard.theta, self.version,
                  self.done, self.applied)

    def reply(self, identity: bytes, op: str = "ok", **extra: Any) -> None:
        theta = None if self.shard is None else self.shard.theta
        self.stats["bytes_out"] += _send(self.sock, dict(op=op, version=self.version, **extra),
                                         theta, identity)

    def fail(self, message: str) -> NoReturn:
        for identity in self.held.values():
            _send(self.sock, dict(op="error", message=message), None, identity)
        close_server()
        raise PSError(message)

    def run(self) -> dict:
        finished_before = bool(self.workers) and self.done >= set(self.workers)
        t0 = self.t0 = time.monotonic()
        self.deadline, self.step_started = t0 + self.cfg.time_limit, t0
        while len(self.done) + len(self.stats["lost"]) < len(self.workers):
            self.check_deadlines()
            if self.sock.poll(100):  # at most 100 ms without a look at the deadlines
                self.handle(*self.sock.recv_multipart(copy=True))
            running = set(self.workers) - self.done
            if self.policy.ready(running):
                used = self.policy.step(self.shard)
                if self.cfg.checkpoint_every and self.version % self.cfg.checkpoint_every == 0:
                    self.save()
                self.stats["used"].append(used)
                self.stats["step_ends"].append(time.monotonic() - t0)
                for w in used:
                    self.reply(self.held.pop(w))
                self.step_started = time.monotonic()
        if finished_before:
            # restored with every worker done: the last one may not have heard its reply (the
            # server was killed after it saved the 'done') and will send it again: listen until
            # quiet for two of a worker's longest waits between resends (8 x retry)
            answer_late_dones(self.sock, quiet=16 * (self.cfg.retry or 0.5), reply=self.reply)
        close_server(linger=2000)  # the last replies still go out
        theta = None if self.shard is None else self.shard.theta
        self.stats.update(self.policy.counts(), elapsed=time.monotonic() - t0,
                          version=self.version, theta=theta)
        return self.stats

    def check_deadlines(self) -> None:
        """Fail past the run's time limit or a sync step's; mark silent workers lost where the
        policy can go on without them."""
        now, timeout = time.monotonic(), self.cfg.timeout
        if now > self.deadline:
            self.fail(f"server rank {self.rank}: time limit {self.cfg.time_limit:g}s passed with "
                      f"workers {sorted(set(self.workers) - self.done)} still running")
        if self.held and now - self.step_started > timeout:
            missing = sorted(set(self.workers) - self.done - set(self.held))
            self.fail(f"server rank {self.rank}, sync step {self.version}: no gradient from "
                      f"worker rank(s) {missing} within {timeout:g}s (got {sorted(self.held)})")
        if self.policy.can_lose_workers:  # a worker silent past the deadline is lost
            self.stats["lost"] += [w for w in self.workers if w not in self.done and
                                   w not in self.stats["lost"] and now - self.heard[w] > timeout]

    def handle(self, identity: bytes, header: bytes, payload: bytes) -> None:
        header = json.loads(header)
        _arrived(header, payload)
        w, op = header["worker"], header["op"]
        self.heard[w] = time.monotonic()
        if w in self.stats["lost"]:  # only slow, not dead
            self.stats["lost"].remove(w)
        self.stats["bytes_in"] += len(payload)
        if op == "init":
            if self.shard is None:  # a restarted server keeps what it restored
                self.shard = Shard(np.frombuffer(payload, np.float64).copy())
                self.save()
            for waiting in self.waiting_init + [identity]:  # early pulls, then the init
                self.reply(waiting)
            self.waiting_init = []
        elif op == "pull":
            self.stats["pulls"] += 1
            if self.shard is None:
                self.waiting_init.append(identity)
            else:
                self.reply(identity)
        elif op == "done":
            self.done.add(w)
            self.save()  # a restarted server must not wait for a worker that has finished
            if header.get("ack"):
                self.reply(identity)
        elif op == "push":
            self.push(identity, w, header, np.frombuffer(payload, np.float64))

    def push(self, identity: bytes, w: int, header: dict, grad_sum: np.ndarray) -> None:
        seq = header.get("seq")
        if seq is not None and seq <= self.applied.get(w, 0):
            # sent again by a worker that heard no reply in time (its socket, and the reply,
            # are gone): applying it twice would count one gradient twice. A copy can even
            # come after the worker's next push (ZeroMQ reads its sockets in turn, and the
            # closed socket's copy was still queued), hence <=, not ==
            self.stats["duplicates"] += 1
            self.reply(identity)
            return
        self.applied[w] = seq
        self.stats["pushes"] += 1
        self.stats["per_worker"][w] += 1
        if not self.held:
            self.step_started = time.monotonic()
        before = self.version
        decision = self.policy.push(self.shard, w, grad_sum, header["count"], header["version"])
        if decision == "held":  # answered when the step is taken
            self.held[w] = identity
            return
        every = self.cfg.checkpoint_every
        if every and self.version != before and self.version % every == 0:
            self.save()
        self.reply(identity, **({decision: True} if decision != "applied" else {}))
        if decision == "applied":
            fault_points.point("ps-server-update")  # e.g. killed after its n-th update


def answer_late_dones(sock: zmq.Socket, quiet: float, reply: Callable[[bytes], None]) -> None:
    """Answer every ``done`` that comes until none came for ``quiet`` s (a restored server whose
    workers had all finished). Introduced in notebooks/11_fault_tolerance.ipynb."""
    while sock.poll(int(quiet * 1000)):
        identity, header, payload = sock.recv_multipart(copy=True)
        header = json.loads(header)
        _arrived(header, payload)
        if header["op"] == "done" and header.get("ack"):
            reply(identity)


def _restore(store, stats):
    """(theta, version, done, applied) of the server's last good checkpoint, or
    (None, 0, set(), {})."""
    state, _ = store.load_latest(report=stats["skipped"].append)
    if state is None:
        return None, 0, set(), {}
    stats["restored_from"] = int(state["version"])
    return (state["theta"].numpy().copy(), int(state["version"]), set(state["done"]),
            {int(w): int(seq) for w, seq in state.get("applied", [])})


def _save(store, theta, version, done, applied):
    store.save({"theta": torch.from_numpy(theta), "version": version, "done": sorted(done),
                "applied": sorted((w, seq) for w, seq in applied.items() if seq is not None)},
               version)


def serve_restarting(spec: dict, n_params: int, cfg: Any, policy: Any) -> dict:
    """:func:`serve` in a child process that is started again, on the same address, each time
    it is killed (at most ``cfg.server_restarts`` times); the new one resumes from the
    shard's last checkpoint. Returns the last child's statistics (``ready``: when it began to
    serve) with ``restarts``: one record (attempt, signal, time it was seen dead) per restart;
    times are ``time.monotonic()``, the clock of the workers' ``t0``.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    rank, address = ENGINE["rank"], _BOUND["address"]
    close_server()  # the child binds the address
    job = dict(rank=rank, link=netem.current(), address=address, spec=spec, n_params=n_params,
               cfg=cfg, policy=policy)
    # the run's time limit and a margin: a server past its limit normally fails by itself first
    deadline, restarts = time.monotonic() + cfg.time_limit + 10, []
    with tempfile.TemporaryDirectory(prefix="course_lib-ps-") as tmp:
        out, err = Path(tmp, "stats.pkl"), Path(tmp, "stderr.txt")
        for attempt in range(cfg.server_restarts + 1):
            with open(err, "wb") as stderr:
                child = subprocess.Popen([sys.executable, "-m", "course_lib.ps_server", str(out)],
                                         stdin=subprocess.PIPE, stderr=stderr)
                child.stdin.write(pickle.dumps(dict(job, attempt=attempt)))
                child.stdin.close()
                try:
                    code = child.wait(timeout=max(deadline - time.monotonic(), 1.0))
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                    raise PSError(f"server rank {rank}: no end within the time limit "
                                  f"{cfg.time_limit:g}s (attempt {attempt})") from None
            if code == 0:
                return dict(pickle.loads(out.read_bytes()), restarts=restarts)
            if code > 0:  # an error, not a kill: restarting would fail again
                tail = err.read_text(errors="replace").strip().splitlines()[-1:]
                raise PSError(f"server rank {rank} failed (exit status {code}): {tail}")
            # a negative return code -N: the child was killed by signal N
            restarts.append(dict(attempt=attempt, signal=-code, time=time.monotonic()))
    raise PSError(f"server rank {rank} was killed {len(restarts)} times, more than "
                  f"server_restarts = {cfg.server_restarts}")


def _serve_child(out):
    """``python -m course_lib.ps_server OUT``: one life of a restartable server (its job is
    pickled on stdin, its statistics are pickled to OUT)."""
    job = pickle.loads(sys.stdin.buffer.read())
    ENGINE.update(rank=job["rank"])
    netem.set_link(job["link"])
    cfg = job["cfg"]
    fault_points.arm_once(cfg.faults, cfg.checkpoints.directory, job["rank"])
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    for _ in range(50):  # the killed server's port can take a moment to be free again
        try:
            sock.bind(job["address"])
            break
        except zmq.ZMQError:
            time.sleep(0.1)
    else:
        sock.bind(job["address"])  # raises, naming the address
    _BOUND.update(sock=sock, address=job["address"])
    stats = serve(job["spec"], job["n_params"], cfg, job["policy"])
    Path(out).write_bytes(pickle.dumps(dict(stats, attempt=job["attempt"])))


# ---------------------------------------------------------------- the worker
class ServerConnections:
    """A worker's DEALER sockets, one per server, and the shard bounds of each.

    Introduced in notebooks/04_parameter_server.ipynb."""

    def __init__(self, addresses: Sequence[str], n_params: int, timeout: float,
                 retry: float | None = None) -> None:
        self.rank, self.timeout, self.retry = ENGINE["rank"], timeout, retry
        self.addresses = list(addresses)
        self.socks = [self._connect(address) for address in addresses]
        self.bounds = [shard_bounds(n_params, s, len(addresses)) for s in range(len(addresses))]
        self.n_params, self.bytes, self.resent = n_params, 0, 0
        self.seq = 0  # numbers this worker's pushes, so a server applies a resent one once

    @staticmethod
    def _connect(address):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 2000  # a closing worker still delivers its 'done'
        sock.connect(address)
        return sock

    def _reply(self, s, message, what, new_socket=True):
        """Server ``s``'s reply to ``message``. With ``retry``: when none came within ``retry``
        s, a new socket (a late reply to the old one is never mistaken for this one) sends
        ``message`` again, waiting twice as long each time (at most 8 x ``retry``: a reply
        slower than ``retry`` still gets through), until ``timeout`` s have passed.
        ``new_socket=False`` resends on the same socket: for ``done``, whose every reply means
        the same, and whose first reply may be the last thing the server sends before it exits."""
        deadline, patience = time.monotonic() + self.timeout, self.retry
        while self.retry is not None:
            wait = min(patience, deadline - time.monotonic())
            patience = min(2 * patience, 8 * self.retry)
            if wait <= 0 or self.socks[s].poll(int(wait * 1000)):
                break
            if new_socket:
                self.socks[s].close(linger=0)
                self.socks[s] = self._connect(self.addresses[s])
            self.bytes += _send(self.socks[s], *message)
            self.resent += 1
        return _recv(self.socks[s], max(deadline - time.monotonic(), 0.001), what)[1:]

    def _exchange(self, op, vectors=None, **header):
        """Send ``op`` to every server (its slice of ``vectors``); gather the replies."""
        messages = []
        for s, sock in enumerate(self.socks):
            a, b = self.bounds[s]
            extra = {k: (v[s] if isinstance(v, list) else v) for k, v in header.items()}
            messages.append((dict(op=op, worker=self.rank, **extra),
                             None if vectors is None else vectors[a:b]))
            self.bytes += _send(sock, *messages[-1])
        theta, versions, rejected, self.dropped = np.empty(self.n_params), [], False, False
        for s in range(len(self.socks)):
            reply, payload = self._reply(s, messages[s],
                                         f"{op} sent by worker rank {self.rank} to server {s}",
                                         new_socket=op != "done")
            if reply["op"] == "error":
                raise PSError(f"worker rank {self.rank}: server {s} failed: {reply['message']}")
            a, b = self.bounds[s]
            theta[a:b] = np.frombuffer(payload, np.float64)
            versions.append(reply["version"])
            rejected |= bool(reply.get("rejected"))
            self.dropped |= bool(reply.get("dropped"))
        return theta, versions, rejected

    def init(self, theta0: ArrayLike) -> tuple[np.ndarray, list[int]]:
        """Set the servers' shards to ``theta0``; ``(theta, versions)`` as a pull returns."""
        return self._exchange("init", np.asarray(theta0, np.float64))[:2]

    def pull(self) -> tuple[np.ndarray, list[int]]:
        """``(theta, each server's version)``: every shard, assembled."""
        return self._exchange("pull")[:2]

    def push(self, grad_sum: ArrayLike, count: int,
             versions: Sequence[int]) -> tuple[np.ndarray, list[int], bool]:
        """Send each server its slice of ``grad_sum`` (over ``count`` samples, computed at
        ``versions``); ``(theta, versions, rejected)`` after it (a push is also a pull)."""
        self.seq += 1
        return self._exchange("push", np.asarray(grad_sum, np.float64), count=count,
                              version=list(versions), seq=self.seq)

    def done(self) -> tuple[np.ndarray, list[int], bool] | None:
        """Tell every server this worker has finished (and hear it acknowledged, with retry)."""
        if self.retry is not None:  # a server that may be restarted must have heard it
            return self._exchange("done", ack=True)
        for sock in self.socks:
            _send(sock, dict(op="done", worker=self.rank))

    def close(self, linger: int = 2000) -> None:
        for sock in self.socks:
            sock.close(linger=linger)


if __name__ == "__main__":
    _serve_child(sys.argv[1])
