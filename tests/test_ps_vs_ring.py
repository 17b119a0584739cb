"""Scaling out (notebook 12): the PS and ring formulas in their limits, the PS formula against the
emulated protocol played message by message, a small measured run on the emulated link (checked
only for what the link guarantees and for margins the model leaves wide), the model to
thousands, the bench and the figures."""

import contextlib
import csv
import io
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from course_lib import costmodel, ps_vs_ring  # noqa: E402
from course_lib.bench import ps as bench_ps  # noqa: E402
from course_lib.runtime import netem
from course_lib.testing import command_line  # noqa: E402

CLUSTER_SIZE = 6  # the PS with 4 workers and 2 servers (tests/conftest.py's shared cluster)
B = 8 * 2**17     # 1 MiB: the measured model
LINK = netem.make_link(ps_vs_ring.LINK)  # 200 Mbit/s, 50 us: 1 MiB takes 42 ms


def test_num_servers_reads_a_count_all_or_one_per_k():
    assert ps_vs_ring.num_servers(3, 8) == 3 and ps_vs_ring.num_servers("2", 8) == 2
    assert ps_vs_ring.num_servers("N", 8) == 8 and ps_vs_ring.num_servers("n", 5) == 5
    assert ps_vs_ring.num_servers("N/4", 8) == 2 and ps_vs_ring.num_servers("N/4", 2) == 1
    assert ps_vs_ring.num_servers("N/4", 9) == 3  # rounded up: no server takes more than 4
    for bad in [0, "0", "many", "N/0", "N*2"]:
        with pytest.raises(ValueError, match="servers"):
            ps_vs_ring.num_servers(bad, 8)


def test_one_server_time_grows_linearly_in_the_workers():
    link = costmodel.LINKS["10GbE"]
    ns = np.arange(1, 65)
    t = ps_vs_ring.ps_step_time(B, ns, 1, link)
    np.testing.assert_allclose(np.diff(t), link.alpha + B * link.beta)  # one message more per N
    assert t[0] == pytest.approx(2 * (link.alpha + B * link.beta))     # push, then the reply
    assert t[63] / t[31] == pytest.approx(2, rel=0.02)
    # its link carries N B in and N B out each step
    assert ps_vs_ring.busiest_bytes("ps1", B, 64) == 2 * 64 * B


def test_ring_time_is_flat_in_the_workers_up_to_the_latency_terms():
    link = costmodel.LINKS["100GbE"]
    ns = 2 ** np.arange(1, 13)
    t = np.array([ps_vs_ring.ring_step_time(B, n, link) for n in ns])
    bandwidth_term = t - 2 * (ns - 1) * link.alpha
    np.testing.assert_allclose(bandwidth_term, 2 * (ns - 1) / ns * B * link.beta)
    assert np.all(np.diff(bandwidth_term) > 0) and bandwidth_term.max() < 2 * B * link.beta
    assert ps_vs_ring.ring_step_time(B, 1, link, compute_s=0.1) == 0.1  # nothing to send alone
    assert ps_vs_ring.busiest_bytes("ring", B, 4096) < 4 * B
    assert ps_vs_ring.ring_step_time(B, 8, link) == costmodel.allreduce_time("ring", B, 8, link)


def test_as_many_servers_as_workers_balance_the_server_links():
    link = costmodel.LINKS["10GbE"]
    for n in (2, 8, 64):
        # each server's link carries N B / S = B each way: as much as a worker's
        assert ps_vs_ring.busiest_bytes("ps", B, n, "N") == 2 * B
        assert ps_vs_ring.ps_step_time(B, n, n, link) == pytest.approx(
            2 * B * link.beta + 2 * n * link.alpha)
        # fewer servers: the servers' links are the busiest, N/S times a worker's
        assert ps_vs_ring.busiest_bytes("ps", B, n, 1) == 2 * n * B
    # more servers than workers: the workers' links are the busiest (B out, B in)
    assert ps_vs_ring.busiest_bytes("ps", B, 2, 4) == 2 * B
    fixed = [ps_vs_ring.ps_step_time(B, n, 4, link) for n in (8, 16, 32)]
    assert fixed[2] - fixed[1] == pytest.approx(2 * (fixed[1] - fixed[0]))  # linear in N


@pytest.mark.parametrize("servers", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 4, 5])
def test_the_ps_formula_is_the_protocol_played_through_the_link_model(workers, servers):
    """bench.ps.predicted_sync_steps plays every push and reply through netem.Interface."""
    n_params = 3 * 2**14
    played = 1 / bench_ps.predicted_sync_steps(n_params, servers, workers, LINK)
    assert ps_vs_ring.ps_step_time(8 * n_params, workers, servers, LINK) == pytest.approx(played)


def test_the_model_to_thousands_against_horovod():
    rows = ps_vs_ring.model_rows(ps_vs_ring.RESNET50)
    assert ps_vs_ring.RESNET50.n_bytes == pytest.approx(102.4e6)

    def eff(link, method, n):
        (row,) = [r for r in rows if r["link"] == link and r["method"] == method
                  and r["workers"] == n]
        return row["efficiency"]

    assert all(eff(link, "ring", 1) == 1 for link in costmodel.LINKS)
    assert 0.85 < eff("100GbE", "ring", 512) < 0.95  # Horovod's README: 90% at 512 GPUs
    for link in ("10GbE", "100GbE", "InfiniBand HDR"):
        assert eff(link, "ps1", 512) < 0.12 < eff(link, "ring", 512)
        assert eff(link, "ps1", 512) < eff(link, "ps", 512) < eff(link, "ring", 512)
    assert eff("10GbE", "ring", 4096) < eff("10GbE", "ring", 64)  # 2(N-1) alpha takes over
    text = ps_vs_ring.format_model(rows)
    assert all(f"# {link}" in text for link in costmodel.LINKS.values())
    assert "PS, N/4 servers" in text
    assert "4096" in text and "ms/step" in text


# ---------------------------------------------------------------- measured
@pytest.fixture(scope="module")
def measured_and_shown(cluster):
    """The measured rows, and what the progress bar wrote (tqdm.auto: text on stderr here)."""
    assert cluster.link is None
    shown = io.StringIO()
    with contextlib.redirect_stderr(shown):
        rows = ps_vs_ring.measure(cluster, workers=(2, 4), servers=2, n_params=2**17,
                               compute_s=0.01, steps=4, progress=True)
    assert cluster.link is None  # put back
    return {(r["method"], r["workers"]): r for r in rows}, shown.getvalue()


def test_progress_bars_can_be_widgets_in_jupyter():
    """tqdm.auto draws a widget in a notebook only with ipywidgets; without it, importing it
    (as Optuna does, notebook 13) prints a red TqdmWarning and bars fall back to text."""
    from tqdm.notebook import IProgress
    assert IProgress is not None, "pip install -c constraints.txt ipywidgets"


@pytest.fixture(scope="module")
def measured(measured_and_shown):
    return measured_and_shown[0]


def test_measure_shows_each_run_as_it_starts(measured_and_shown):
    rows, shown = measured_and_shown
    labels = ["1 worker alone"] + [f"{m}, N = {n}" for m in ("ps1", "ps", "ring") for n in (2, 4)]
    where = [shown.find(label) for label in labels]
    assert -1 not in where and where == sorted(where), shown
    assert shown.startswith("\r") and f"/{len(rows)} [" in shown, shown  # a bar of 7 runs


def test_measured_rows_never_beat_the_link(measured):
    """The emulated link never delivers a message early: no run is faster than its formula
    (5% for sleeps that wake a little early); every byte count is the protocol's."""
    assert set(measured) == {("one", 1), ("ps1", 2), ("ps1", 4), ("ps", 2), ("ps", 4),
                             ("ring", 2), ("ring", 4)}
    for r in measured.values():
        assert 0 < r["ratio"] < 1.05 and r["link"] == LINK.text
        assert r["busiest_bytes"] == pytest.approx(r["model_busiest_bytes"])
        assert r["efficiency"] < 1.05
    assert measured["ps1", 4]["busiest_bytes"] == 2 * 4 * B  # the server: N B in, N B out
    assert measured["ring", 4]["busiest_bytes"] == 2 * 2 * 3 / 4 * B
    assert measured["one", 1]["efficiency"] == 1


def test_measure_refuses_too_small_a_cluster(cluster):
    with pytest.raises(ValueError, match="start_cluster"):
        ps_vs_ring.measure(cluster, workers=(4,), servers="N")  # 8 ranks needed


# ---------------------------------------------------------------- bench and figures
def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "course_lib", "bench", "scaling", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_bench_model_only_prints_the_model_to_thousands():
    out = command_line.run("bench", "scaling", "--model-only")
    assert out.returncode == 0, out.stderr
    for text in ["ResNet-50", "Goyal", "10GbE", "NVLink", "PS, 1 server", "ring-allreduce",
                 "4096"]:
        assert text in out.stdout


def test_bench_at_its_smallest_prints_measurement_model_and_ceiling(tmp_path):
    path = tmp_path / "ps_vs_ring.csv"
    out = _bench("--workers", "2", "--servers", "1", "--params", "16K", "--steps", "2",
                 "--compute-ms", "5", "--csv", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    for text in ["1 worker, no network", "PS, 1 server", "PS, S servers", "ring-allreduce",
                 "meas/model", "busiest MB/step", "efficiency", "emulated link 200 Mbit/s",
                 "ceiling: memcpy", "bare loopback", "the model to thousands"]:
        assert text in out.stdout
    rows = list(csv.DictReader(open(path)))
    assert [(r["method"], r["workers"]) for r in rows] == [
        ("one", "1"), ("ps1", "2"), ("ps", "2"), ("ring", "2")]
    assert all(float(r["model_steps_per_s"]) > 0 and r["params"] == "16384" for r in rows)


def test_bench_refuses_bad_options():
    assert command_line.run("bench", "scaling", "--servers", "N/0").returncode == 2
    out = command_line.run("bench", "scaling", "--steps", "1")
    assert out.returncode == 1 and "--steps" in out.stderr


def test_figures(tmp_path, measured):
    from course_lib.figures import scaling_out
    paths = scaling_out.save_all(tmp_path)
    assert paths[0].name == "12_ps_vs_ring.png" and paths[0].stat().st_size > 20_000
    ax = scaling_out.measured_throughput(list(measured.values()))
    assert len(ax.lines) == 3 * 2 + 2  # measured and formula per method, ideal, one worker
    axes = scaling_out.efficiency_vs_workers(links=("10GbE", "NVLink"))
    assert len(axes) == 2 and len(axes[0].lines) == 4
    # one legend for the figure, readable (>= 8 pt), below the panels: it covers no curve
    legend, = axes[0].figure.legends
    assert all(t.get_fontsize() >= 8 for t in legend.get_texts()) and len(legend.get_texts()) == 4
    assert not any(ax.get_legend() for ax in axes)
    axes[0].figure.canvas.draw()
    box = legend.get_window_extent()
    assert all(box.y1 <= ax.get_window_extent().y0 for ax in axes)
