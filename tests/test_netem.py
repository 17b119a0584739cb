"""The emulated network: parsing, the queueing of one rank's interface, and real messages that
never arrive before the link would have carried them (a lower bound the emulation guarantees,
so these checks cannot flake on a slow machine)."""

import csv
import shutil
import subprocess
import sys
import time

import pytest

from course_lib import costmodel
from course_lib.runtime import netem
from course_lib.testing.netem import timed

CLUSTER_SIZE = 4
LINK = "200Mbit/s,2ms"  # slow enough that every emulated time dwarfs loopback's own
SLACK = 3e-3            # how early time.sleep may wake after the late-wake compensation


def test_links_parse_from_what_people_write():
    link = netem.make_link("1Gbit/s,50us")
    assert (link.bandwidth, link.latency) == pytest.approx((125e6, 50e-6))
    assert netem.make_link("250MB/s").bandwidth == 250e6 and netem.make_link("10Gbps").latency == 0
    assert netem.make_link("1Gbit/s", latency="1ms").latency == pytest.approx(1e-3)
    assert netem.make_link(link.text) == link and netem.make_link(None) is None
    assert str(link) == "1 Gbit/s, 50 us"
    assert link.costmodel().beta == pytest.approx(1 / 125e6)
    for bad in ["fast", "1Gbit", "1Gbit/s,soon", "-1MB/s"]:
        with pytest.raises(ValueError, match="1Gbit/s|preset"):
            netem.make_link(bad)
    with pytest.raises(ValueError, match="needs a link"):
        netem.make_link(None, latency="1ms")


def test_presets_keep_their_shape_when_slowed_down():
    """A preset faster than loopback carries is slowed down, alpha and n/B by the same factor."""
    assert netem.PRESETS["1GbE"].slowdown == 1
    for name, real in costmodel.LINKS.items():
        emulated = netem.PRESETS[name]
        assert emulated.bandwidth <= netem.LOOPBACK_LIMIT
        assert emulated.latency * emulated.bandwidth == pytest.approx(real.alpha * real.bandwidth)
        assert "slower than real" in str(emulated) or emulated.slowdown == 1


def test_an_interface_queues_messages():
    link = netem.Link(1e6, 1e-3)          # a message of 1000 bytes occupies 2 ms
    nic = netem.Interface(link)
    t0 = time.monotonic() + 10             # the future: the clock does not get in the way
    nic.egress_free = t0
    ends = [nic.depart(1000)[1] for _ in range(3)]
    assert ends == pytest.approx([t0 + 0.002, t0 + 0.004, t0 + 0.006])
    # three messages sent at t0 reach one ingress: they are carried one after the other
    assert [nic.arrive(t0, 1000) for _ in range(3)] == pytest.approx(
        [t0 + 0.002, t0 + 0.004, t0 + 0.006])
    # one sent earlier but waited for last takes the gap before them, not a place behind them
    assert nic.arrive(t0 - 0.005, 1000) == pytest.approx(t0 - 0.003)
    assert nic.arrive(t0 - 0.0015, 1000) == pytest.approx(t0 + 0.008)  # no 2 ms gap left before


def test_predictions_are_the_cost_model_plus_the_agreement_round():
    link = netem.make_link("1Gbit/s,50us")
    for algorithm in ("naive", "tree", "ring"):
        bare = costmodel.allreduce_time(algorithm, 2**20, 4, link.costmodel())
        assert netem.predict_allreduce(algorithm, 2**20, 4, link, check=False) == bare
        assert netem.predict_allreduce(algorithm, 2**20, 4, link) == pytest.approx(
            bare + 3 * link.seconds(netem.AGREEMENT_BYTES))
    ring = netem.predict_allreduce("ring", 2**20, 4, link, check=False)
    assert netem.predict_allreduce("ring_pipelined", 2**20, 4, link, check=False) == \
        pytest.approx(ring)                                  # one segment per chunk: the same
    assert netem.predict_allreduce("ring_pipelined", 2**20, 4, link, check=False,
                                   segment_bytes=2**16) > ring  # 4 segments pay alpha 4 times


# ---------------------------------------------------------------- real ranks
@pytest.fixture()
def slow_link(cluster):
    link = cluster.set_link(LINK)
    assert "link 200 Mbit/s, 2000 us" in repr(cluster)
    yield link
    cluster.set_link(None)


def test_a_ring_step_takes_one_message_time_and_a_root_queues(cluster, slow_link):
    n, p = 2**18, cluster.n                       # 256 KiB: 12.5 ms on the link
    one = slow_link.seconds(n)
    results = cluster.run(timed, "ring_step", n)
    assert [r for _, r in results] == [(rank - 1) % p for rank in range(p)]
    assert min(t for t, _ in results) >= one - SLACK
    results = cluster.run(timed, "gather_to_root", n)
    assert results[0][1] == [1.0, 2.0, 3.0]
    assert results[0][0] >= (p - 1) * one - SLACK  # one ingress: the messages queue


def test_collectives_stay_exact_and_no_faster_than_the_model(cluster, slow_link):
    n, p = 2**20, cluster.n
    results = cluster.run(timed, "ring_allreduce", n)
    assert all(r == (p * (p + 1) / 2,) * 2 for _, r in results)
    predicted = netem.predict_allreduce("ring", n, p, slow_link)
    assert max(t for t, _ in results) >= predicted - SLACK


def test_a_cluster_without_a_link_is_loopback_again(cluster, slow_link):
    assert cluster.run(netem.current) == [slow_link] * cluster.n
    cluster.set_link(None)
    assert cluster.run(netem.current) == [None] * cluster.n and cluster.link is None
    assert [r for _, r in cluster.run(timed, "ring_step", 2**18)] == [
        (rank - 1) % cluster.n for rank in range(cluster.n)]
    assert "link" not in repr(cluster)


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "course_lib", "bench", "allreduce", *args],
                          capture_output=True, text=True, timeout=600)


def test_bench_reports_the_prediction_beside_each_time(tmp_path):
    path = tmp_path / "link.csv"
    out = _bench("--link", LINK, "--world-size", "2", "--sizes", "256K", "--iters", "1",
                 "--warmup", "0", "--csv", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "emulated link 200 Mbit/s, 2000 us" in out.stdout and "predicted" in out.stdout
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["algorithm"] for r in rows] == ["naive", "tree", "ring", "ring_pipelined"]
    for r in rows:
        assert r["wrong"] == "0" and r["link"] == netem.make_link(LINK).text
        # holds under load: never early
        assert float(r["time_us"]) >= float(r["predicted_us"]) - SLACK * 1e6
        assert float(r["predicted_us"]) == pytest.approx(1e6 * netem.predict_allreduce(
            r["algorithm"], 2**18, 2, netem.make_link(LINK)))


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (pip install mpich)")
def test_bench_over_mpi_on_the_link():
    out = _bench("--link", LINK, "--transport", "mpi", "--launcher", "mpiexec", "--world-size",
                 "3", "--sizes", "64K", "--iters", "1", "--algorithms", "naive,ring")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line and line[0] != "#"]
    assert [r[3] for r in rows] == ["naive", "ring"] and all(r[9] == "0" for r in rows)
    assert all(float(r[4]) >= float(r[5]) - SLACK * 1e6 for r in rows)


def test_bench_refuses_native_on_the_link():
    out = _bench("--link", LINK, "--algorithms", "native,ring")
    assert out.returncode == 1 and "native" in out.stderr and "off the" in out.stderr


def test_bad_link_text_fails_before_any_engine_starts():
    from course_lib.runtime.cluster import start_cluster
    with pytest.raises(ValueError, match="1Gbit/s"):
        start_cluster(n=2, link="fast")
    out = _bench("--link", "fast")
    assert out.returncode == 2 and "--link" in out.stderr



def test_one_cluster_measures_a_smaller_world_on_a_subgroup(cluster, slow_link):
    from course_lib.bench.allreduce import allreduce_rank_bench
    results = cluster.run(allreduce_rank_bench, "torch", ["ring"], [2**16], "float32", 1, 0,
                          world_size=2)
    assert results[2:] == [None] * (cluster.n - 2) and results[0] == results[1]
    (row,) = results[0]
    assert row["world_size"] == 2 and row["wrong"] == 0 and row["link"] == slow_link.text
    assert row["time_us"] >= row["predicted_us"] - SLACK * 1e6  # holds under load: never early


def test_parameter_server_messages_pay_the_link_too(cluster, slow_link):
    from course_lib.bench.ps import predicted_sync_steps, ps_bench
    rows = ps_bench(cluster, servers=(1,), workers=(1, 2), modes=("sync",), n_params=2**15,
                    steps=3)
    for r in rows:  # the emulation never delivers early: at most the model's pace
        assert r["steps_per_s"] <= 1.15 * r["predicted_steps_per_s"]  # holds under load: ditto
        assert r["predicted_steps_per_s"] == predicted_sync_steps(2**15, 1, r["workers"],
                                                                  slow_link)
