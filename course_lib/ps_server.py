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

On an emulated network (``start_cluster(link=...)``, :mod:`course_lib.netem`) the header carries
the sender's stamp and every message pays the link's time: a server's single link carries every
worker's push, one after another, which is why sharding the parameters over more servers helps.
"""

from __future__ import annotations

import json
import time

import numpy as np

from course_lib import netem
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
    _BOUND["sock"] = sock
    return f"tcp://{host}:{port}"


def close_server():
    """Close the socket :func:`bind_server` bound, if any. Introduced in
    notebooks/04_parameter_server.ipynb."""
    sock = _BOUND.pop("sock", None)
    if sock is not None:
        sock.close(linger=0)


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
                 used=[], step_ends=[], dropped=[])
    done, heard = set(), {w: time.monotonic() for w in workers}
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
            theta = np.frombuffer(payload, np.float64).copy()
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
        elif op == "push":
            grad, count = np.frombuffer(payload, np.float64), header["count"]
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
                staleness = version - header["version"]
                if cfg["max_staleness"] is not None and staleness > cfg["max_staleness"]:
                    stats["rejected"] += 1
                    reply(identity, rejected=True)
                    continue
                if count:
                    theta, version, staleness = apply_push(
                        theta, version, grad / count, header["version"], cfg["lr"],
                        cfg["staleness_aware"])
                    stats["staleness"].append(staleness)
                reply(identity)
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
            stats["used"].append(sorted(pending))
            stats["step_ends"].append(time.monotonic() - t0)
            for identity, _, _ in pending.values():
                reply(identity)
            pending = {}
            step_started = time.monotonic()
    close_server()
    stats["elapsed"] = time.monotonic() - t0
    stats["version"], stats["theta"] = version, theta
    return stats


# ---------------------------------------------------------------- the worker
class ServerConnections:
    """A worker's DEALER sockets, one per server, and the shard bounds of each.

    Introduced in notebooks/04_parameter_server.ipynb."""

    def __init__(self, addresses, n_params, timeout):
        import zmq

        from course_lib.data import shard_bounds
        self.rank, self.timeout = ENGINE["rank"], timeout
        ctx = zmq.Context.instance()
        self.socks = []
        for address in addresses:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 2000  # a closing worker still delivers its 'done'
            sock.connect(address)
            self.socks.append(sock)
        self.bounds = [shard_bounds(n_params, s, len(addresses)) for s in range(len(addresses))]
        self.n_params, self.bytes = n_params, 0

    def _exchange(self, op, vectors=None, **header):
        """Send ``op`` to every server (its slice of ``vectors``); gather the replies."""
        for s, sock in enumerate(self.socks):
            a, b = self.bounds[s]
            extra = {k: (v[s] if isinstance(v, list) else v) for k, v in header.items()}
            self.bytes += _send(sock, dict(op=op, worker=self.rank, **extra),
                                None if vectors is None else vectors[a:b])
        theta, versions, rejected, self.dropped = np.empty(self.n_params), [], False, False
        for s, sock in enumerate(self.socks):
            _, reply, payload = _recv(sock, self.timeout,
                                      f"{op} sent by worker rank {self.rank} to server {s}")
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
        return self._exchange("push", np.asarray(grad_sum, np.float64), count=count,
                              version=list(versions))

    def done(self):
        for sock in self.socks:
            _send(sock, dict(op="done", worker=self.rank))

    def close(self, linger=2000):
        for sock in self.socks:
            sock.close(linger=linger)
