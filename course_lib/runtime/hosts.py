"""Real hosts on one machine: Linux network namespaces, each with its own hostname and network
interface, plugged into one virtual switch.

Introduced in notebooks/12_scaling_out.ipynb. Multi-host code paths (``torchrun --nnodes 2``,
rendezvous across machines, Gloo choosing an interface) never run on ``127.0.0.1``. A network
namespace has its own interfaces, addresses and routes; a UTS namespace its own hostname. One of
each per host, an ``eth0`` per host and a bridge joining them are hosts as far as the software
can tell; this machine itself sits on the bridge too (``.254``), like a login node::

    with hosts.make_hosts() as (a, b):                 # needs root (CAP_NET_ADMIN)
        a.run(["hostname", "-I"])                      # hostA 10.23.0.1
        hosts.shape(a, rate="200Mbit/s")               # tc: the kernel's own slow link

``tc`` on those interfaces is the real kernel's counterpart of :mod:`course_lib.runtime.netem`.

ipyparallel and the cluster are imported by :func:`start_cluster` alone, not at the top: every
rank of ``python -m course_lib.train`` imports this module, and ipyparallel takes a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from course_lib.runtime.launch import finish_within, stop_and_reap
from course_lib.runtime.netem import parse_rate, parse_time

if TYPE_CHECKING:  # for the annotations only (see the module docstring)
    from course_lib.runtime.cluster import Cluster

SUBNET = "10.23.0"  # the first free one of 10.23.0-255 is used: two sets of hosts never share
_COUNT = itertools.count()


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says what is missing and how to get it.
    Introduced in notebooks/12_scaling_out.ipynb."""


def unavailable_reason() -> str | None:
    """None if hosts can be made here, else why not (and how to fix it).
    Introduced in notebooks/12_scaling_out.ipynb."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN): run as root, e.g. in CI"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: apt-get install -y {package}"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True,
                           text=True, timeout=10)
    if probe.returncode != 0:
        return f"namespaces are not allowed here: {probe.stderr.strip()}"
    return None


@dataclass
class Host:
    """One host: its hostname, address and interface (``eth0``), the network namespace it lives
    in (named after the hostname and this process, so that two runs never share one), the
    switch port its cable plugs into (``port``, in this machine's namespace) and the address
    this machine has on the switch (``gateway``). Introduced in notebooks/12_scaling_out.ipynb."""
    name: str
    address: str
    interface: str
    netns: str
    port: str = ""
    gateway: str = ""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside this host: its network namespace, its own hostname."""
        # a new UTS namespace per command: the hostname set inside it is this host's alone;
        # sh -c '... exec "$@"' sh ARGV runs ARGV as given, no shell quoting of its words
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.name} && exec "$@"', "sh", *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on this host (``subprocess.Popen`` arguments pass through)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 60,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host and return its completed process (text output)."""
        return subprocess.run(self.command(argv), capture_output=True, text=True,
                              timeout=timeout, **kwargs)


def _ip(*args):
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise HostsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _free_subnet():
    """The first 10.23.k that no interface of this machine has an address in."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                          timeout=10).stdout
    taken = set(re.findall(r"inet 10\.23\.(\d+)\.", used))
    for k in range(256):
        if str(k) not in taken:
            return f"10.23.{k}"
    raise HostsUnavailable("every subnet 10.23.0-255 is in use: remove stale bridges "
                           "(ip link show type bridge)")


@contextlib.contextmanager
def make_hosts(names: Sequence[str] = ("hostA", "hostB")) -> Iterator[list[Host]]:
    """Make one host per name, ``SUBNET``.1, .2, ... on one bridge (this machine is .254),
    each with an ``/etc/hosts`` that knows every name; yield them; remove them (with every
    process still inside) at the end. Introduced in notebooks/12_scaling_out.ipynb."""
    reason = unavailable_reason()
    if reason:
        raise HostsUnavailable(reason)
    tag = f"{os.getpid() % 100000}-{next(_COUNT)}"
    bridge, made = f"cb{tag}"[:15], []  # an interface name has at most 15 characters
    try:
        with open("/run/course-hosts.lock", "w") as lock:  # one subnet per set of hosts
            fcntl.flock(lock, fcntl.LOCK_EX)
            subnet = _free_subnet()
            hosts = [Host(name, f"{subnet}.{i + 1}", "eth0", f"{name}-{tag}",
                          f"cp{tag}-{i}"[:15], f"{subnet}.254") for i, name in enumerate(names)]
            _ip("link", "add", bridge, "type", "bridge")
            made.append(bridge)
            _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        table = "".join(f"{h.address} {h.name}\n" for h in hosts)
        for h in hosts:
            _ip("netns", "add", h.netns)
            made.append(h.netns)
            # `ip netns exec NS` mounts /etc/netns/NS/hosts over /etc/hosts: the hosts' DNS
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{table}")
            inside = f"ch{tag}-{len(made)}"[:15]
            _ip("link", "add", inside, "type", "veth", "peer", "name", h.port)
            _ip("link", "set", h.port, "master", bridge)
            _ip("link", "set", h.port, "up")
            _ip("link", "set", inside, "netns", h.netns)
            _ip("-n", h.netns, "link", "set", inside, "name", "eth0")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for name in made[1:]:  # made[0] is the bridge, the rest namespaces
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True, timeout=10).stdout.split()
            for pid in pids:  # nothing outlives its host
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        if made:  # the bridge; the cables went with their namespaces
            subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=10)


def run_each(machines: Sequence[Host], argvs: Sequence[Sequence[str]],
             envs: Sequence[Mapping[str, str]], timeout: float = 180.0,
             interface: str | None = None) -> list[str]:
    """Start ``argvs[i]`` on ``machines[i]`` with the environment ``envs[i]`` (Gloo told to use
    that host's interface, or ``interface`` on every host) and wait for all, each within
    ``timeout`` s. Returns their outputs (stdout and stderr together); raises RuntimeError
    naming the first host that failed or ran late, with its last lines.
    Introduced in notebooks/12_scaling_out.ipynb."""
    procs = [h.popen(argv, env={**env, "GLOO_SOCKET_IFNAME": interface or h.interface},
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h, argv, env in zip(machines, argvs, envs, strict=True)]
    outputs = []
    for host, proc in zip(machines, procs, strict=True):
        output, _, late = finish_within(proc, timeout)
        outputs.append(output)
        if late or proc.returncode:
            raise RuntimeError(f"{host.name} failed (status {proc.returncode}"
                               f"{', late' if late else ''}): {output.strip()[-1500:]}")
    return outputs


def rsh(hosts: Sequence[Host], directory: str | Path) -> Path:
    """Write an executable that does what ``rsh HOST COMMAND`` does, for these hosts: run the
    command inside that host (its namespaces, its hostname). MPICH's launcher starts its proxy
    on each remote host that way (``mpiexec -launcher rsh -launcher-exec PATH``), where a real
    cluster uses ssh. Returns its path. Introduced in notebooks/12_scaling_out.ipynb."""
    cases = "\n".join(f"  {h.name}) ns={h.netns} ;;" for h in hosts)
    path = Path(directory) / "rsh"
    path.write_text(f"""#!/bin/sh
host=$1; shift
case "$host" in
{cases}
  *) echo "rsh: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $host && exec sh -c \\"\\$0\\"" "$*"
""")
    path.chmod(0o755)
    return path


def shape(host: Host, rate: str | None = None, delay: str | None = None) -> None:
    """Slow ``host``'s cable in both directions with ``tc``: at most ``rate`` each way (e.g.
    "200Mbit/s", as :mod:`course_lib.runtime.netem` writes it) and ``delay`` more latency each
    way (e.g. "1ms"); neither: back to a bare cable. A rate alone uses the token-bucket filter
    (tbf), a delay needs netem (the kernel module sch_netem; some kernels lack it: a RuntimeError
    then says so). Introduced in notebooks/12_scaling_out.ipynb."""
    bits = f"{parse_rate(rate) * 8:.0f}bit" if rate else None
    if delay:
        qdisc = ["netem", "delay", f"{parse_time(delay) * 1e6:.0f}us"]
        qdisc += ["rate", bits] if bits else []
    elif rate:  # the bucket holds at least two 64 KiB segments, and 5 ms at the rate
        burst = max(128 * 1024, int(parse_rate(rate) / 200))
        qdisc = ["tbf", "rate", bits, "burst", str(burst), "latency", "200ms"]
    sides = [["ip", "netns", "exec", host.netns], []]  # its egress; its ingress (the port's)
    for prefix, dev in zip(sides, [host.interface, host.port], strict=True):
        argv = ["tc", "qdisc", "replace", "dev", dev, "root", *qdisc] if rate or delay else \
            ["tc", "qdisc", "del", "dev", dev, "root"]
        done = subprocess.run(prefix + argv, capture_output=True, text=True, timeout=10)
        if done.returncode and (rate or delay):
            hint = " (this kernel has no sch_netem: modprobe sch_netem)" if delay else ""
            raise RuntimeError(f"{' '.join(argv)} on {host.name}: {done.stderr.strip()}{hint}")


def start_cluster(machines: Sequence[Host], per_host: int = 1, timeout: float = 60,
                  pg_timeout: float = 30) -> Cluster:
    """The course's cluster with its engines on ``machines`` (``per_host`` each; ranks host by
    host). Its controller listens on this machine's address on the switch (``gateway``), as on
    a cluster's login node; each engine starts on its host and connects to it; the process
    group meets over TCP at rank 0's host (one machine uses a file). Stop it before the hosts
    go. Its engines are not ipyparallel's to restart: after one dies, start a new cluster.
    Introduced in notebooks/12_scaling_out.ipynb."""
    import ipyparallel as ipp  # not at the top (see the module docstring)

    from course_lib.runtime.cluster import CONTROLLER_ARGS, PROFILE, Cluster, ClusterError
    cluster_id = f"{os.getpid()}-hosts-{uuid.uuid4().hex[:6]}"
    ipp_cluster = ipp.Cluster(n=0, profile=PROFILE, cluster_id=cluster_id, log_level=40,
                              controller_ip=machines[0].gateway, controller_args=CONTROLLER_ARGS)
    logs = Path(tempfile.mkdtemp(prefix="course-hosts-"))
    argv = [sys.executable, "-m", "ipyparallel.engine", f"--profile-dir={ipp_cluster.profile_dir}",
            f"--cluster-id={cluster_id}", "--log-level=40"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        ipp_cluster.start_controller_sync()
        client = ipp_cluster.connect_client_sync()
        for i, host in enumerate(machines):  # one host after the other: ranks in host order
            for k in range(per_host):
                with open(logs / f"{host.name}-{k}.log", "w") as log:
                    host.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                client.wait_for_engines((i + 1) * per_host, timeout=timeout, interactive=False)
            except TimeoutError:
                last = (logs / f"{host.name}-0.log").read_text()[-1500:]
                raise ClusterError(f"{host.name}'s engines did not connect to the controller at "
                                   f"{host.gateway} within {timeout}s: {last}") from None
        return Cluster(ipp_cluster, client, len(machines) * per_host, "gloo", timeout,
                       pg_timeout, 1)
    except BaseException:
        stop_and_reap(ipp_cluster)  # the engines go with their hosts
        raise
