"""The wire of the parameter server: ZeroMQ sockets, one message format, and the two loops.

Introduced in notebooks/04_parameter_server.ipynb; :mod:`course_lib.ps` drives it. Each server
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

On an emulated network (``start_cluster(link=...)``, :mod:`course_lib.netem`) the header carries
the sender's stamp and every message pays the link's time: a server's single link carries every
worker's push, one after another, which is why sharding the parameters over more servers helps.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from course_lib import faults, netem
from course_lib.engine import ENGINE


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
    *identity, header, payload = sock.recv_multipart(copy=True)
    header = json.loads(header)
    _arrived(header, payload)
    return (identity[0] if identity else None), header, payload


# ---------------------------------------------------------------- the server
_BOUND: dict = {}  # on a server rank: its ROUTER socket between bind and serve


def bind_server(spec, host="127.0.0.1"):
    """On a ps rank: bind a ROUTER socket to a free port; return ``tcp://host:port`` (else None).

    Introduced in notebooks/04_parameter_server.ipynb."""
    import zmq
    if ENGINE["rank"] not in spec["ps"]:
        return None
    close_server()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port(f"tcp://{host}")
    _BOUND.update(sock=sock, address=f"tcp://{host}:{port}")
    return _BOUND["address"]


def close_server(linger=0):
    """Close the socket :func:`bind_server` bound, if any (``linger`` ms to deliver what is
    queued). Introduced in notebooks/04_parameter_server.ipynb."""
    sock = _BOUND.pop("sock", None)
    if sock is not None:
        sock.close(linger=linger)


def serve(spec, n_params, cfg, apply_push):
    """Serve this rank's shard until every worker said done (or went silent in async mode).

    Sync: wait for one push from every worker still running, apply ``lr * sum / count`` once,
    answer them all. With ``backup_workers = b > 0`` the step goes on with the first N - b
    gradients of the current version; a later push of an old version is dropped and answered
    with the current parameters (Chen et al. 2016). Async: apply each push at once with
    ``apply_push`` (staleness-aware if asked; pushes staler than ``max_staleness`` are
    rejected). Returns the statistics. Introduced in notebooks/04_parameter_server.ipynb.
    """
    from course_lib.data import shard_bounds
    sock = _BOUND["sock"]
    s = spec["ps"].index(ENGINE["rank"])
    start, stop = shard_bounds(n_params, s, len(spec["ps"]))
    workers, timeout, sync = list(spec["worker"]), cfg["timeout"], cfg["mode"] == "sync"
    backup = cfg.get("backup_workers", 0)
    theta, version, waiting_init = None, 0, []
    stats = dict(server=ENGINE["rank"], shard=(start, stop), staleness=[], pushes=0, pulls=0,
                 bytes_in=0, bytes_out=0, rejected=0, lost=[], per_worker={w: 0 for w in workers},
                 used=[], step_ends=[], dropped=[], restored_from=None, from_lost=0, skipped=[],
                 duplicates=0)
    done, heard = set(), {w: time.monotonic() for w in workers}
    applied = {}  # worker -> the number of its last push applied: a resend is answered, not applied
    every, directory = cfg.get("checkpoint_every"), cfg.get("checkpoint_dir")
    directory = directory and Path(directory) / f"server-{s}"
    if directory:
        theta, version, done, applied = _restore(directory, stats)
    stats["ready"] = time.monotonic()  # restored (if need be): serving from now on
    finished_before = bool(workers) and done >= set(workers)

    def save():
        if directory:
            _save(directory, theta, version, done, applied)
    pending = {}  # sync: worker -> (identity, grad_sum, count) of the current step
    step_started = time.monotonic()
    t0, deadline = time.monotonic(), time.monotonic() + cfg["time_limit"]

    def reply(identity, op="ok", **extra):
        stats["bytes_out"] += _send(sock, dict(op=op, version=version, **extra), theta, identity)

    def fail(message):
        for identity, _, _ in pending.values():
            _send(sock, dict(op="error", message=message), None, identity)
        close_server()
        raise PSError(message)

    while len(done) + len(stats["lost"]) < len(workers):
        now = time.monotonic()
        if now > deadline:
            fail(f"server rank {ENGINE['rank']}: time limit {cfg['time_limit']:g}s passed with "
                 f"workers {sorted(set(workers) - done)} still running")
        if sync and pending and now - step_started > timeout:
            missing = sorted(set(workers) - done - set(pending))
            fail(f"server rank {ENGINE['rank']}, sync step {version}: no gradient from worker "
                 f"rank(s) {missing} within {timeout:g}s (got {sorted(pending)})")
        if not sync or backup:  # a worker silent past the deadline is lost; the rest go on
            stats["lost"] += [w for w in workers if w not in done and w not in stats["lost"]
                              and now - heard[w] > timeout]
        if not sock.poll(100):
            continue
        identity, header, payload = sock.recv_multipart(copy=True)
        header = json.loads(header)
        _arrived(header, payload)
        w, op = header["worker"], header["op"]
        heard[w] = time.monotonic()
        if w in stats["lost"]:  # only slow, not dead
            stats["lost"].remove(w)
        stats["bytes_in"] += len(payload)
        if op == "init":
            if theta is None:  # a restarted server keeps what it restored
                theta = np.frombuffer(payload, np.float64).copy()
                save()
            for ident in waiting_init:
                reply(ident)
            reply(identity)
        elif op == "pull":
            stats["pulls"] += 1
            if theta is None:
                waiting_init.append(identity)
            else:
                reply(identity)
        elif op == "done":
            done.add(w)
            save()  # a restarted server must not wait for a worker that has finished
            if header.get("ack"):
                reply(identity)
        elif op == "push":
            grad, count = np.frombuffer(payload, np.float64), header["count"]
            if "seq" in header and applied.get(w) == header["seq"]:
                # sent again by a worker that heard no reply in time (its socket, and the reply,
                # are gone): applying it twice would count one gradient twice
                stats["duplicates"] += 1
                reply(identity)
                continue
            applied[w] = header.get("seq")
            stats["pushes"] += 1
            stats["per_worker"][w] += 1
            if sync and backup and header["version"] != version:  # late: the step went on
                stats["dropped"].append((w, header["version"]))
                reply(identity, dropped=True)
                continue
            if sync:
                if not pending:
                    step_started = time.monotonic()
                pending[w] = (identity, grad, count)
            else:
                pulled = header["version"]
                if pulled > version:  # computed on versions a killed server lost: fresh now
                    stats["from_lost"] += 1
                    pulled = version
                staleness = version - pulled
                if cfg["max_staleness"] is not None and staleness > cfg["max_staleness"]:
                    stats["rejected"] += 1
                    reply(identity, rejected=True)
                    continue
                if count:
                    theta, version, staleness = apply_push(
                        theta, version, grad / count, pulled, cfg["lr"], cfg["staleness_aware"])
                    stats["staleness"].append(staleness)
                    if every and version % every == 0:
                        save()
                reply(identity)
                faults.point("ps-server-update")  # e.g. killed after its n-th update
        running = set(workers) - done
        if sync and pending and (len(pending) >= min(len(workers) - backup, len(running))
                                 if backup else set(pending) >= running):
            total = sum(c for _, _, c in pending.values())
            if total:
                grad = sum(g for _, g, _ in pending.values())
                theta, version = theta - cfg["lr"] * (grad / total), version + 1
                stats["staleness"] += [0] * len(pending)
            elif backup:  # the first gradients held no sample: an empty step, still a step
                version += 1
            if every and version % every == 0:
                save()
            stats["used"].append(sorted(pending))
            stats["step_ends"].append(time.monotonic() - t0)
            for identity, _, _ in pending.values():
                reply(identity)
            pending = {}
            step_started = time.monotonic()
    if finished_before:
        # restored with every worker done: the last one may not have heard its reply (the
        # server was killed after it saved the 'done') and will send it again
        answer_late_dones(sock, quiet=16 * cfg["retry"], reply=reply)
    close_server(linger=2000)  # the last replies still go out
    stats["elapsed"] = time.monotonic() - t0
    stats["version"], stats["theta"] = version, theta
    return stats


def answer_late_dones(sock, quiet, reply):
    """Answer every ``done`` that comes until none came for ``quiet`` s."""
    while sock.poll(int(quiet * 1000)):
        identity, header, payload = sock.recv_multipart(copy=True)
        header = json.loads(header)
        _arrived(header, payload)
        if header["op"] == "done" and header.get("ack"):
            reply(identity)


def _restore(directory, stats):
    """(theta, version, done, applied) of the server's last good checkpoint, or
    (None, 0, set(), {})."""
    from course_lib import checkpoint
    state, _ = checkpoint.load_latest(directory, report=stats["skipped"].append)
    if state is None:
        return None, 0, set(), {}
    stats["restored_from"] = int(state["version"])
    return (state["theta"].numpy().copy(), int(state["version"]), set(state["done"]),
            {int(w): int(seq) for w, seq in state.get("applied", [])})


def _save(directory, theta, version, done, applied):
    import torch

    from course_lib import checkpoint
    checkpoint.save({"theta": torch.from_numpy(theta), "version": version, "done": sorted(done),
                     "applied": sorted((w, seq) for w, seq in applied.items() if seq is not None)},
                    directory, version, keep=2)


def serve_restarting(spec, n_params, cfg, apply_push):
    """:func:`serve` in a child process that is started again, on the same address, each time
    it is killed (at most ``cfg["server_restarts"]`` times); the new one resumes from the
    shard's last checkpoint. Returns the last child's statistics (``ready``: when it began to
    serve) with ``restarts``: one record (attempt, signal, time it was seen dead) per restart;
    times are ``time.monotonic()``, the clock of the workers' ``t0``.
    Introduced in notebooks/11_fault_tolerance.ipynb."""
    rank, address = ENGINE["rank"], _BOUND["address"]
    close_server()  # the child binds the address
    job = dict(rank=rank, link=netem.current(), address=address, spec=spec, n_params=n_params,
               cfg=cfg, apply_push=apply_push)
    deadline, restarts = time.monotonic() + cfg["time_limit"] + 10, []
    with tempfile.TemporaryDirectory(prefix="course_lib-ps-") as tmp:
        out, err = Path(tmp, "stats.pkl"), Path(tmp, "stderr.txt")
        for attempt in range(cfg["server_restarts"] + 1):
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
                                  f"{cfg['time_limit']:g}s (attempt {attempt})") from None
            if code == 0:
                return dict(pickle.loads(out.read_bytes()), restarts=restarts)
            if code > 0:  # an error, not a kill: restarting would fail again
                tail = err.read_text(errors="replace").strip().splitlines()[-1:]
                raise PSError(f"server rank {rank} failed (exit status {code}): {tail}")
            restarts.append(dict(attempt=attempt, signal=-code, time=time.monotonic()))
    raise PSError(f"server rank {rank} was killed {len(restarts)} times, more than "
                  f"server_restarts = {cfg['server_restarts']}")


def _serve_child(out):
    """``python -m course_lib.ps_server OUT``: one life of a restartable server (its job is
    pickled on stdin, its statistics are pickled to OUT)."""
    job = pickle.loads(sys.stdin.buffer.read())
    ENGINE.update(rank=job["rank"])
    netem.set_link(job["link"])
    cfg = job["cfg"]
    faults.arm_once(cfg["faults"], cfg["checkpoint_dir"], job["rank"])
    import zmq
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
    stats = serve(job["spec"], job["n_params"], cfg, job["apply_push"])
    Path(out).write_bytes(pickle.dumps(dict(stats, attempt=job["attempt"])))


# ---------------------------------------------------------------- the worker
class ServerConnections:
    """A worker's DEALER sockets, one per server, and the shard bounds of each.

    Introduced in notebooks/04_parameter_server.ipynb."""

    def __init__(self, addresses, n_params, timeout, retry=None):
        from course_lib.data import shard_bounds
        self.rank, self.timeout, self.retry = ENGINE["rank"], timeout, retry
        self.addresses = list(addresses)
        self.socks = [self._connect(address) for address in addresses]
        self.bounds = [shard_bounds(n_params, s, len(addresses)) for s in range(len(addresses))]
        self.n_params, self.bytes, self.resent = n_params, 0, 0
        self.seq = 0  # numbers this worker's pushes, so a server applies a resent one once

    @staticmethod
    def _connect(address):
        import zmq
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

    def init(self, theta0):
        return self._exchange("init", np.asarray(theta0, np.float64))[:2]

    def pull(self):
        return self._exchange("pull")[:2]

    def push(self, grad_sum, count, versions):
        self.seq += 1
        return self._exchange("push", np.asarray(grad_sum, np.float64), count=count,
                              version=list(versions), seq=self.seq)

    def done(self):
        if self.retry is not None:  # a server that may be restarted must have heard it
            return self._exchange("done", ack=True)
        for sock in self.socks:
            _send(sock, dict(op="done", worker=self.rank))

    def close(self, linger=2000):
        for sock in self.socks:
            sock.close(linger=linger)


if __name__ == "__main__":
    _serve_child(sys.argv[1])
