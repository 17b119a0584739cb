"""The figures of notebook 12 draw what they are given: Uber's published numbers (each with its
source), this machine's measurements beside them, the GPU paths' model, a job's observed phases."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from course_lib import costmodel, ps_vs_ring  # noqa: E402
from course_lib.figures import scaling_out as figures  # noqa: E402
from course_lib.k8s.watch import JobRun, PodRun  # noqa: E402


def _rows():
    """Rows shaped like ps_vs_ring.measure's, at N = 2 and 4: ring 2x the PS with 2 servers."""
    rows = []
    for n in (2, 4):
        for method, servers, rate in (("ps1", 1, 1.0), ("ps", 2, 2.0), ("ring", 0, 4.0)):
            rows.append(dict(method=method, workers=n, servers=servers, samples_per_s=rate * n,
                             model_samples_per_s=1.1 * rate * n, efficiency=rate / 10))
    return rows


def test_uber_numbers_carry_their_sources():
    for r in ps_vs_ring.UBER_128:
        assert r["source"] and 0 < r["efficiency"] <= 1 and r["gpus"] == 128
    approx = [r for r in ps_vs_ring.UBER_128 if r["approx"]]
    assert [r["system"] for r in approx] == ["standard distributed TensorFlow"]
    assert ps_vs_ring.RDMA_SPEEDUP["VGG-16"] == (0.30, 0.30)
    assert ps_vs_ring.PARAMETERS["VGG-16"] > 5 * ps_vs_ring.PARAMETERS["ResNet-50"]


def test_ring_over_ps_at_the_largest_n():
    ratio = ps_vs_ring.ring_over_ps(_rows())
    assert ratio["workers"] == 4 and ratio["servers"] == 2
    assert ratio["ps"] == pytest.approx(2.0) and ratio["ps1"] == pytest.approx(4.0)
    assert ratio["model_ps"] == pytest.approx(2.0)
    assert ps_vs_ring.ring_over_ps(_rows(), workers=2)["workers"] == 2
    with pytest.raises(ValueError, match="no ring row"):
        ps_vs_ring.ring_over_ps(_rows(), workers=8)


def test_horovod_figure_draws_uber_then_this_machine():
    left, right = figures.horovod_vs_tensorflow(_rows())
    widths = [p.get_width() for p in left.patches]
    assert widths == pytest.approx([50, 88, 90, 79, 10, 20, 40])
    assert [p.get_height() for p in right.patches] == pytest.approx([4, 4, 30])
    alone, _ = figures.horovod_vs_tensorflow()
    assert len(alone.patches) == len(ps_vs_ring.UBER_128)
    plt.close("all")


def test_gpu_transfer_model_panels_follow_path_time():
    across, inside = figures.gpu_transfer()
    rdma = [line for line in across.lines if line.get_label() == "GPUDirect RDMA"][0]
    x, y = rdma.get_data()
    link = costmodel.LINKS["InfiniBand HDR"]
    assert y == pytest.approx(x * 1e6 / (link.alpha + x * 1e6 * link.beta) / 1e9)
    assert len(inside.lines) == 4 and len(across.lines) == 3
    rows = [dict(bytes=n, link=link, direct_s=t, staged_s=2 * t, pipelined_s=1.5 * t,
                 model_direct_s=t, model_staged_s=1.8 * t, model_pipelined_s=1.2 * t)
            for n, t, link in ((1 << 20, 0.01, "loopback (no emulation)"),
                               (1 << 22, 0.04, "10 Gbit/s, 25 us"))]
    measured, *_ = figures.gpu_transfer(rows)
    heights = [p.get_height() * 1e-3 for p in measured.patches]
    assert heights == pytest.approx([0.01, 0.04, 0.02, 0.08, 0.015, 0.06])
    plt.close("all")


def test_job_timeline_draws_each_observed_phase():
    pods = {"j-master-0": PodRun("j-master-0", "Master", [(0.0, "Pending"), (0.1, "Running"),
                                                         (5.0, "Succeeded")]),
            "j-worker-0": PodRun("j-worker-0", "Worker", [(0.0, "Pending"), (0.2, "Running"),
                                                         (4.0, "Failed")])}
    run = JobRun("j", "default", 0.0, pods)
    run.set_condition("Created", "True", 0.0)
    run.update(5.0)  # the worker Failed: the job is Failed
    ax = figures.job_timeline(run)
    lefts = sorted(round(p.get_x(), 3) for p in ax.patches)
    assert lefts.count(0.0) == 3  # both pods Pending and the job Created from 0
    assert {0.1, 0.2, 4.0, 5.0} <= set(lefts)
    labels = ax.get_legend_handles_labels()[1]
    assert set(labels) == {"Pending", "Running", "Succeeded", "Failed", "Created"}
    plt.close("all")


def test_save_all_writes_three_images(tmp_path):
    paths = figures.save_all(tmp_path)
    assert [p.name for p in paths] == ["12_ps_vs_ring.png", "12_horovod_vs_tensorflow.png",
                                       "12_gpudirect.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    assert np.all([p.exists() for p in paths])
