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
import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.23.0"
_COUNT = itertools.count()


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
    """One host: its hostname, address and interface, and the network namespace it lives in
    (named after the hostname and this process, so that two runs never share one).
    Introduced in notebooks/12_scaling_out.ipynb."""
    name: str
    address: str
    interface: str
    netns: str

    def command(self, argv):
        """``argv`` as run inside this host: its network namespace, its own hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
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
    """Make two hosts named ``names`` joined by a veth pair (``subnet``.1 and .2), each with an
    ``/etc/hosts`` that knows both names; yield them; remove them (with every process still
    inside) at the end. Introduced in notebooks/12_scaling_out.ipynb."""
    reason = unavailable_reason()
    if reason:
        raise HostsUnavailable(reason)
    tag = f"{os.getpid()}-{next(_COUNT)}"
    hosts = [Host(name, f"{subnet}.{i + 1}", f"ve{tag}-{i}"[-15:], f"{name}-{tag}")
             for i, name in enumerate(names)]  # an interface name has at most 15 characters
    table = "".join(f"{h.address} {h.name}\n" for h in hosts)
    made = []
    try:
        for h in hosts:
            _ip("netns", "add", h.netns)
            made.append(h.netns)
            # `ip netns exec NS` mounts /etc/netns/NS/hosts over /etc/hosts: the hosts' DNS
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{table}")
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name",
            hosts[1].interface)
        for h in hosts:
            _ip("link", "set", h.interface, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.interface)
            _ip("-n", h.netns, "link", "set", h.interface, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for netns in made:
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True,
                                  text=True, timeout=10).stdout.split()
            for pid in pids:  # nothing outlives its host
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)


def run_each(machines, argvs, envs, timeout=180.0):
    """Start ``argvs[i]`` on ``machines[i]`` with the environment ``envs[i]`` (Gloo told to use
    that host's interface) and wait for all, each within ``timeout`` s. Returns their outputs
    (stdout and stderr together); raises RuntimeError naming the first host that failed or ran
    late, with its last lines. Introduced in notebooks/12_scaling_out.ipynb."""
    from course_lib.launch import finish_within
    procs = [h.popen(argv, env={**env, "GLOO_SOCKET_IFNAME": h.interface},
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


def rsh(hosts, directory):
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


def shape(host, delay="0ms", rate=None):
    """Give ``host``'s interface a latency and a rate with ``tc netem`` (the kernel's emulated
    link); returns the tc command's error text, empty when it worked.
    Introduced in notebooks/12_scaling_out.ipynb."""
    argv = ["tc", "qdisc", "replace", "dev", host.interface, "root", "netem", "delay", delay]
    if rate:
        argv += ["rate", rate]
    done = subprocess.run(["ip", "netns", "exec", host.netns, *argv], capture_output=True,
                          text=True, timeout=10)
    return done.stderr.strip()
