"""Hosts made of network namespaces: the course's own cluster with its engines on two hosts, and
tc's slow cables against the emulated network. Needs root (skipped otherwise, saying why)."""

import contextlib
import io
import socket
import subprocess

import pytest

from course_lib import train
from course_lib.bench import allreduce as bench_allreduce
from course_lib.runtime import hosts

CLUSTER_SIZE = 2
STEPS = 6

pytestmark = pytest.mark.skipif(hosts.unavailable_reason() is not None,
                                reason=f"hosts: {hosts.unavailable_reason()}")


def _addresses():
    return subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout


def test_hosts_share_a_switch_with_this_machine_and_leave_nothing():
    with hosts.make_hosts(["n1", "n2", "n3"]) as machines, hosts.make_hosts() as (a, _):
        first = machines[0].address.rsplit(".", 1)[0]
        assert [m.address for m in machines] == [f"{first}.{i}" for i in (1, 2, 3)]
        assert a.address.rsplit(".", 1)[0] != first  # a second set gets its own subnet
        assert f"inet {first}.254/24" in _addresses()  # this machine, on the switch
        out = machines[2].run(["python3", "-c", "import socket; print(socket.gethostname(), "
                               "socket.gethostbyname('n1'))"]).stdout.split()
        assert out == ["n3", machines[0].address]
        stray = machines[1].popen(["sleep", "60"])
    assert stray.wait(timeout=10) != 0  # killed with its host
    assert f"inet {first}.254/24" not in _addresses()  # the switch is gone too


def test_the_course_cluster_runs_on_two_hosts(cluster):
    reference = cluster.run(train.train, STEPS)[0]
    with hosts.make_hosts() as machines, hosts.start_cluster(machines) as wide:
        assert wide.run(socket.gethostname) == ["hostA", "hostB"]
        assert wide.backend == "gloo"
        result = wide.run(train.train, STEPS)[0]
        assert result["host"] == "hostA" and result["params_sha256"] == \
            reference["params_sha256"]  # the same run, bit for bit, over TCP between hosts

        shown = io.StringIO()
        with contextlib.redirect_stderr(shown):  # the progress bar: text on stderr here
            rows = bench_allreduce.tc_versus_emulated(machines, wide, cluster,
                                                      world_sizes=(2,), progress=True)
        assert 0 < shown.getvalue().find("tc, N = 2") < shown.getvalue().find("emulated, N = 2")
        # the kernel's tbf and netem's model agree with the alpha-beta model: neither sends
        # faster than its rate (the floor is the shaper's); above it a busy machine adds what it
        # likes, so the ceiling only catches a link set up several times too slow. How close
        # they come, and the naive one's 2x, are figures: notebook 12 plots them
        for row in rows:
            assert 0.85 < row["tc"] / row["model"] < 4, row  # holds under load: a floor
            assert 0.85 < row["emulated"] / row["model"] < 4, row  # holds under load: ditto
        assert cluster.link is None  # the local cluster's link is back as it was


def test_a_delay_needs_netem():
    with hosts.make_hosts() as (a, b):
        try:
            hosts.shape(a, delay="20ms")
        except RuntimeError as e:  # a kernel without the module says so
            assert "sch_netem" in str(e) and "hostA" in str(e)
            return
        # a refused connection is one round trip: through hostA's cable in and out, 2 x 20 ms
        probe = ("import socket, time; t = time.monotonic()\ntry: socket.create_connection("
                 "('hostA', 9), timeout=5)\nexcept OSError: pass\nprint(time.monotonic() - t)")
        assert float(b.run(["python3", "-c", probe]).stdout) > 0.035
