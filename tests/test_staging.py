"""Staging through host memory against a direct send (notebook 12): the data arrives intact every
way, on loopback and on the emulated link, where no way beats the link's own time (a lower bound
the emulation guarantees); the model's times for the same paths by hand."""

import pytest

from course_lib import costmodel, staging
from course_lib.runtime import netem

CLUSTER_SIZE = 2
LINK = "200Mbit/s,50us"  # 25 MB/s: every transfer below takes tens of ms on the link
SLACK = 3e-3             # how early time.sleep may wake after netem's late-wake compensation
SIZES = (1 << 20, (3 << 19) + 12345)  # the second is no whole number of chunks
CHUNK = 256 << 10


@pytest.fixture(scope="module")
def rows(cluster):
    return staging.measure(cluster, SIZES, link=LINK, chunk_bytes=CHUNK, repeats=2)


def test_every_way_delivers_the_bytes_intact(rows, cluster):
    assert [r["bytes"] for r in rows] == list(SIZES)
    assert all(r["intact"] for r in rows)
    loop = staging.measure(cluster, (1 << 20,), link=None, chunk_bytes=CHUNK, repeats=1)
    assert loop[0]["intact"] and loop[0]["link"].startswith("loopback")
    assert cluster.link is None  # the link is put back


def test_no_way_beats_the_link_and_staging_adds_to_the_direct_send(rows):
    """The emulated link delivers a message no earlier than alpha + n / B after its sending
    started, so the direct send takes at least that, and so does the staged one, which sends the
    same bytes after a copy: measured staged is never below the direct send's own lower bound.
    Chunks pay alpha each: k alpha + n / B."""
    link = netem.make_link(LINK)
    for r in rows:
        n, k = r["bytes"], -(-r["bytes"] // CHUNK)
        assert r["direct_s"] >= link.seconds(n) - SLACK  # holds under load: never early
        assert r["staged_s"] >= link.seconds(n) - SLACK  # holds under load: never early
        # holds under load: never early
        assert r["pipelined_s"] >= k * link.latency + n / link.bandwidth - SLACK


def test_the_model_beside_each_row(rows):
    link = netem.make_link(LINK)
    for r in rows:
        n = r["bytes"]
        copy = n / (r["memcpy_gbps"] * 1e9)  # one staging copy at this machine's memcpy rate
        assert r["model_direct_s"] == pytest.approx(link.seconds(n))
        assert r["model_staged_s"] == pytest.approx(2 * copy + link.seconds(n))
        wire = costmodel.Link("w", alpha=link.latency, beta=1 / link.bandwidth)
        mem = costmodel.Link("m", alpha=0.0, beta=copy / n)
        assert r["model_pipelined_s"] == pytest.approx(
            costmodel.path_time(n, [mem, wire, mem], CHUNK))
    text = staging.format_rows(rows)
    assert "200 Mbit/s" in text and "staged ms" in text and "NO" not in text


def test_a_one_rank_cluster_is_refused():
    class One:
        n = 1
    with pytest.raises(ValueError, match="at least 2 ranks"):
        staging.measure(One())
