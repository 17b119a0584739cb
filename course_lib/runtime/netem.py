"""An emulated cluster network: every message pays the time a real link would take.

Introduced in notebooks/05_allreduce.ipynb. On one laptop all ranks share the same cores and
"send" by copying memory, so a ring allreduce cannot show what it does on a cluster. With a link
switched on, each rank gets a full-duplex network interface of bandwidth ``B`` and latency
``alpha`` (the alpha-beta model of :mod:`course_lib.costmodel`)::

    cluster = start_cluster(n=8, link="1Gbit/s,50us")       # every rank's messages
    comm = get_comm("torch", link="1Gbit/s,50us")           # one communicator
    python -m course_lib bench allreduce --link 1Gbit/s,50us

The model. A message of n bytes occupies its sender's egress and its receiver's ingress for
``alpha + n / B`` seconds each, both at once (the bytes stream through). An interface carries
one message at a time: messages that share it queue. So a rank sending to 3 peers at once takes
``3 (alpha + n/B)``, a root receiving from N-1 ranks at once takes ``(N-1)(alpha + n/B)``, and a
ring step where every rank sends n/N to its right and receives n/N from its left takes
``alpha + n/(N B)``: exactly the costs behind ``costmodel.allreduce_time``.

How. The sender stamps each message with the moment its egress starts sending it; the receiver
books its ingress from that moment on. The real transfer runs as usual; the wait then sleeps
until the emulated transfer would end, so a message never arrives before the model allows
(and a real transfer slower than the link shows as a measured time above the model). Sleeping
costs no CPU: 8 ranks run on 2 cores. Ranks must share one machine (the stamps are readings of
its monotonic clock). It is a model: no congestion control, no packet loss, no switch.

Where it applies: every message of :mod:`course_lib.comm` (torch/Gloo and MPI), hence every
from-scratch collective, the labs' code and ``ddp`` with ``algorithm="ring"``, and the
parameter server's ZeroMQ messages. Native collectives (``dist.all_reduce``, ``MPI.Allreduce``)
run inside Gloo or MPI and are not slowed down.

One file a little over a lesson's length: the link's text, one rank's interface and what to
expect of it are one model, read top to bottom. It imports no torch (``course_lib.comm`` and
``course_lib.runtime.engine`` import it, and must import without torch: it takes seconds).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from course_lib import costmodel


@dataclass(frozen=True)
class Link:
    """An emulated link: bandwidth in bytes/s per direction, latency in seconds per message.

    ``slowdown`` > 1 marks a preset slowed down to what loopback can carry: every emulated time
    is ``slowdown`` times the real network's (alpha and n/B alike, so every curve keeps its shape).
    Introduced in notebooks/05_allreduce.ipynb."""

    bandwidth: float
    latency: float
    name: str = ""
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency >= 0):
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got "
                             f"{self.bandwidth} B/s and {self.latency} s")

    def seconds(self, n_bytes: float) -> float:
        """How long one message of ``n_bytes`` occupies an interface: alpha + n / B."""
        return self.latency + n_bytes / self.bandwidth

    @property
    def text(self) -> str:
        """The link as ``make_link`` reads it back: '1e+09bit/s,50us'."""
        return f"{self.bandwidth * 8:g}bit/s,{self.latency * 1e6:g}us"

    def costmodel(self) -> costmodel.Link:
        """The same link as a :class:`costmodel.Link`, to predict with."""
        return costmodel.Link(str(self), alpha=self.latency, beta=1 / self.bandwidth)

    def __str__(self) -> str:
        text = f"{format_rate(self.bandwidth)}, {self.latency * 1e6:g} us"
        if self.name:
            text = f"{self.name} ({text}" + (f", {self.slowdown:g}x slower than real"
                                              if self.slowdown != 1 else "") + ")"
        return text


# What loopback between processes on one small machine keeps up with, per rank, when all ranks
# send at once (measured: 8 ranks on 2 cores move ~2 GB/s in total). Faster networks are
# emulated slowed down, latency and bandwidth alike, until they fit under this.
LOOPBACK_LIMIT = 250e6


def _preset(name):
    real = costmodel.LINKS[name]
    slowdown = max(1.0, real.bandwidth / LOOPBACK_LIMIT)  # 1: slow enough already
    # bandwidth divided and latency multiplied by the same factor: every time alpha + n/B grows
    # by it, so the curves keep their shape (a ring's ratio to the naive one, crossovers)
    return Link(real.bandwidth / slowdown, real.alpha * slowdown, name, slowdown)


# costmodel's networks, plus 1 Gigabit Ethernet (what loopback carries as it is).
PRESETS = {"1GbE": Link(125e6, 50e-6, "1GbE"), **{name: _preset(name) for name in costmodel.LINKS}}

# "1Gbit/s" -> ("1", "G", "bit/s"); "2.5e9B/s" -> ("2.5e9", "", "B/s")
_RATE = re.compile(r"^\s*([0-9.]+(?:e[-+]?\d+)?)\s*([kmgt]?)(bit/s|bps|b/s|B/s)\s*$", re.I)
_TIME = re.compile(r"^\s*([0-9.]+(?:e[-+]?\d+)?)\s*(s|ms|us|µs|ns)?\s*$")
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, None: 1}


def parse_rate(text: str) -> float:
    """'1Gbit/s' -> 125e6 bytes/s; also '1Gbps', '250MB/s' (bytes), decimal prefixes k M G T.

    Introduced in notebooks/05_allreduce.ipynb."""
    m = _RATE.match(str(text))
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected a number with a unit like 1Gbit/s, "
                         "10Gbps or 250MB/s")
    value = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    return value if m.group(3) == "B/s" else value / 8  # bits to bytes


def parse_time(text: str | float) -> float:
    """'50us' -> 5e-5 seconds; also s, ms, ns, or a bare number of seconds.

    Introduced in notebooks/05_allreduce.ipynb."""
    m = _TIME.match(str(text))
    if not m:
        raise ValueError(f"latency {text!r}: expected a time like 50us, 1ms or 0")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def format_rate(bytes_per_s: float) -> str:
    """125e6 -> '1 Gbit/s' (bits, as networks are sold).

    Introduced in notebooks/05_allreduce.ipynb."""
    bits = bytes_per_s * 8
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {prefix}bit/s"
    return f"{bits:.3g} bit/s"


def make_link(link: str | Link | dict | None = None,
              latency: str | float | None = None) -> Link | None:
    """A :class:`Link` from what a user writes, or None (no emulation).

    ``link``: a Link, a preset name (``PRESETS``: "1GbE", "10GbE", "100GbE", "InfiniBand HDR",
    "NVLink"), a bandwidth ("1Gbit/s", then ``latency`` or 0) or "bandwidth,latency"
    ("1Gbit/s,50us"). ``latency`` overrides the latency either way.
    Introduced in notebooks/05_allreduce.ipynb."""
    if link is None or link is False or link == "":
        if latency is not None:
            raise ValueError("latency= needs a link= (a bandwidth or a preset)")
        return None
    if isinstance(link, Link):
        spec = link
    elif isinstance(link, dict):  # a Link's fields by name
        spec = Link(**link)
    elif link in PRESETS:
        spec = PRESETS[link]
    else:
        rate, _, lat = str(link).partition(",")
        try:
            spec = Link(parse_rate(rate), parse_time(lat) if lat.strip() else 0.0)
        except ValueError as e:
            raise ValueError(f"{e}; or a preset: {', '.join(PRESETS)}") from None
    if latency is not None:
        spec = Link(spec.bandwidth, parse_time(latency) if isinstance(latency, str)
                    else float(latency), spec.name, spec.slowdown)
    return spec


# ---------------------------------------------------------------- this rank's interface
class Interface:
    """One rank's network interface: when its egress is free, and its ingress's bookings.

    Times are ``time.monotonic()`` readings, shared by every process on the machine.
    Introduced in notebooks/05_allreduce.ipynb."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.egress_free = 0.0
        self.ingress = []  # booked (begin, end) intervals, sorted, none overlapping

    def depart(self, n_bytes: int, now: float | None = None) -> tuple[float, float]:
        """Queue a message on the egress: (start, end) of its sending. Start is its stamp.
        ``now``: when it is sent (default: the clock's now; a model passes its own time)."""
        # one message at a time: it starts when the previous one has left the egress
        start = max(time.monotonic() if now is None else now, self.egress_free)
        self.egress_free = start + self.link.seconds(n_bytes)
        return start, self.egress_free

    def arrive(self, start: float, n_bytes: int) -> float:
        """Book the ingress for a message whose sending started at ``start``; its end time.

        The message takes the first gap from ``start`` on that is long enough, so a message the
        rank waits for late still takes its place in the order messages arrived."""
        length, begin = self.link.seconds(n_bytes), start
        keep = start - 60.0  # bookings older than any message in flight
        self.ingress = [b for b in self.ingress if b[1] > keep]
        i = 0
        # walk the bookings in time order: skip those that end before ``begin``, stop at the
        # first that starts after the message would end (it fits in the gap before it, at i),
        # and past any that overlaps move ``begin`` to its end
        for i, (b, e) in enumerate(self.ingress):  # noqa: B007 - i is used after the loop
            if e <= begin:
                continue
            if b >= begin + length:
                break
            begin = e
        else:
            i = len(self.ingress)  # after every booking
        self.ingress.insert(i, (begin, begin + length))
        return begin + length


_STATE = {"link": None, "interface": None}
_LATE = {"s": 100e-6}  # how late time.sleep wakes up here, learned as it runs


def set_link(link: str | Link | dict | None = None,
             latency: str | float | None = None) -> Link | None:
    """Switch this process's emulated link on (see :func:`make_link`) or off (None); returns it.

    Every communicator made afterwards uses it (unless given its own ``link=``).
    Introduced in notebooks/05_allreduce.ipynb."""
    spec = make_link(link, latency)
    _STATE["link"] = spec
    _STATE["interface"] = Interface(spec) if spec else None
    return spec


def current() -> Link | None:
    """This process's emulated link, or None.

    Introduced in notebooks/05_allreduce.ipynb."""
    return _STATE["link"]


def interface(link: Link) -> Interface:
    """This process's interface for ``link`` (one per rank, shared by all its communicators).

    Introduced in notebooks/05_allreduce.ipynb."""
    nic = _STATE["interface"]
    if nic is None or nic.link != link:
        nic = _STATE["interface"] = Interface(link)
    return nic


def sleep_until(t: float | None) -> None:
    """Sleep until monotonic time ``t``. ``time.sleep`` wakes up late (~0.1 ms here), so it asks
    for that much less, as learned from its last wake-ups. No spinning: the CPU stays free for
    the other ranks' real work.
    Introduced in notebooks/05_allreduce.ipynb."""
    asked = t - time.monotonic() - _LATE["s"]
    if asked > 0:
        t0 = time.monotonic()
        time.sleep(asked)
        late = time.monotonic() - t0 - asked
        # a running average (weight 0.2 on the newest wake-up), kept within 0 and 2 ms so that
        # one descheduled wake-up cannot make every later sleep end early
        _LATE["s"] = min(max(0.8 * _LATE["s"] + 0.2 * late, 0.0), 2e-3)


# ---------------------------------------------------------------- for transports
def send_stamp(link: Link, n_bytes: int) -> tuple[float, float]:
    """Queue an outgoing message of ``n_bytes``: (stamp to send with it, when the send ends).

    Introduced in notebooks/05_allreduce.ipynb."""
    return interface(link).depart(n_bytes)


def receive(link: Link, stamp: float | None, n_bytes: int) -> None:
    """A message stamped ``stamp`` (its sender's start) has arrived for real: wait until the
    emulated link would have delivered it.
    Introduced in notebooks/05_allreduce.ipynb."""
    if stamp:  # 0 or None: the sender had no emulated link
        sleep_until(interface(link).arrive(stamp, n_bytes))


# ---------------------------------------------------------------- what to expect
AGREEMENT_BYTES = 120  # the record each rank sends every other before a checked collective


def predict_allreduce(algorithm: str, n_bytes: float, p: int, link: Link, check: bool = True,
                      segment_bytes: int = 1 << 20) -> float:
    """Seconds an allreduce of :mod:`course_lib.collectives` should take on emulated ``link``:
    ``costmodel.allreduce_time`` on it, plus, with ``check``, the agreement round (every rank
    sends a small record to every other: p-1 messages queue on each interface). The pipelined
    ring sends each reduce-scatter chunk as ceil(chunk / segment_bytes) messages, so it pays
    alpha that many times per step. Introduced in notebooks/05_allreduce.ipynb."""
    model = link.costmodel()
    if algorithm == "ring_pipelined":
        chunk = n_bytes / p
        segments = max(1, -(-int(chunk) // segment_bytes))  # ceil(chunk / segment_bytes)
        # alpha: p-1 reduce-scatter steps of ``segments`` messages, then p-1 all-gather steps of
        # one; the bytes: the lower bound 2 (p-1)/p n / B, which the ring meets
        t = (p - 1) * (segments + 1) * link.latency + costmodel.lower_bound(n_bytes, p, model)
    else:
        t = costmodel.allreduce_time(algorithm, n_bytes, p, model)
    if check and p > 1:
        t += (p - 1) * link.seconds(AGREEMENT_BYTES)
    return float(t)


def start_clock(comm: Any) -> float:
    """Where a rank starts timing a collective: after a barrier, the instant all ranks agreed on
    (:func:`start_together`) on an emulated link, else this rank's now. Time the end with
    ``time.monotonic()``. ``comm``: a :mod:`course_lib.comm` communicator (not annotated as
    one: ``comm`` imports this module). Introduced in notebooks/05_allreduce.ipynb."""
    comm.barrier()
    return start_together(comm) if comm.link else time.monotonic()


def start_together(comm: Any, margin: float = 0.02) -> float:
    """Agree on a start instant a little ahead, sleep until it and return it (time.monotonic).

    For timing on an emulated link (one machine, one monotonic clock): a barrier releases ranks
    milliseconds apart on a busy laptop, so each rank's own clock would start at a different
    moment. Uses the transport's native allreduce (Gloo's or MPI's), off the emulated link.
    Introduced in notebooks/05_allreduce.ipynb."""
    mine = time.monotonic() + margin
    if comm.transport == "mpi":
        start = comm.mpi.allreduce(mine, op=comm.MPI.MAX)
    else:
        import torch  # a torch comm's process: torch is loaded; this module imports none
        t = torch.tensor([mine], dtype=torch.float64)
        comm.dist.all_reduce(t, op=comm.dist.ReduceOp.MAX, group=comm.group)
        start = float(t[0])
    sleep_until(start)
    return start

