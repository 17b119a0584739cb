"""Two real hosts on one machine: Linux network namespaces, each with its own hostname and
network interface, joined by a virtual cable.

Introduced in notebooks/12_scaling_out.ipynb. Multi-host code paths (``torchrun --nnodes 2``,
rendezvous across machines, Gloo choosing an interface) never run on ``127.0.0.1``. A network
namespace has its own interfaces, addresses and routes; a UTS namespace its own hostname. Two
of each, and a veth pair between them, are two hosts as far as the software can tell::

    with hosts.two_hosts() as (a, b):                  # needs root (CAP_NET_ADMIN)
        a.run(["hostname", "-I"])                      # hostA 10.23.0.1
        hosts.shape(a, delay="5ms", rate="100mbit")    # tc netem: the kernel's emulated link

``tc netem`` on the veth is the real kernel's counterpart of :mod:`course_lib.netem`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.23.0"


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says what is missing and how to get it.
    Introduced in notebooks/12_scaling_out.ipynb."""


def unavailable_reason():
    """None if two hosts can be made here, else why not (and how to fix it).
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
    """One namespace: its name (also its hostname), address and interface.
    Introduced in notebooks/12_scaling_out.ipynb."""
    name: str
    address: str
    interface: str

    def command(self, argv):
        """``argv`` as run inside this host: its network namespace, its own hostname."""
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c",
                f'hostname {self.name} && exec "$@"', "sh", *argv]

    def popen(self, argv, **kwargs):
        """Start ``argv`` on this host (``subprocess.Popen`` arguments pass through)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv, timeout=60, **kwargs):
        """Run ``argv`` on this host and return its completed process (text output)."""
        return subprocess.run(self.command(argv), capture_output=True, text=True,
                              timeout=timeout, **kwargs)


def _ip(*args):
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise HostsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def two_hosts(names=("hostA", "hostB"), subnet=SUBNET):
    """Make two hosts joined by a veth pair (``subnet``.1 and .2), yield them, and remove
    them (with every process still inside) at the end.
    Introduced in notebooks/12_scaling_out.ipynb."""
    reason = unavailable_reason()
    if reason:
        raise HostsUnavailable(reason)
    made = []
    try:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", f"veth-{names[0]}", "type", "veth", "peer", "name",
            f"veth-{names[1]}")
        hosts, table = [], "".join(f"{subnet}.{i + 1} {n}\n" for i, n in enumerate(names))
        for i, name in enumerate(names):
            # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts: the hosts' DNS
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{table}")
            interface = f"veth-{name}"
            _ip("link", "set", interface, "netns", name)
            _ip("-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", interface)
            _ip("-n", name, "link", "set", interface, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            hosts.append(Host(name, f"{subnet}.{i + 1}", interface))
        yield hosts
    finally:
        for name in made:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True, timeout=10).stdout.split()
            for pid in pids:  # nothing outlives its host
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def shape(host, delay="0ms", rate=None):
    """Give ``host``'s interface a latency and a rate with ``tc netem`` (the kernel's emulated
    link); returns the tc command's error text, empty when it worked.
    Introduced in notebooks/12_scaling_out.ipynb."""
    argv = ["tc", "qdisc", "replace", "dev", host.interface, "root", "netem", "delay", delay]
    if rate:
        argv += ["rate", rate]
    done = subprocess.run(["ip", "netns", "exec", host.name, *argv], capture_output=True,
                          text=True, timeout=10)
    return done.stderr.strip()
