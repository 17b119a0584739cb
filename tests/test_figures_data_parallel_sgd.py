"""Notebook 06's figures (course_lib/figures/data_parallel_sgd.py) draw and check their input."""

import pytest

from course_lib.figures import data_parallel_sgd as figures_ddp


def test_figures_draw_and_check_their_input():
    fig = figures_ddp.bucket_figure(["a", "b", "c"], [400, 4000, 40], 1000)
    assert "2 buckets" in fig.axes[0].get_title()
    with pytest.raises(ValueError):
        figures_ddp.bucket_figure(["a"], [1, 2], 10)
    assert len(figures_ddp.sync_step_figure(2).axes) == 1


def test_last_step_figure_has_one_panel_per_strategy_from_the_last_forward():
    from course_lib.runtime import timeline
    tls = {}
    for strategy, shift in (("bucketed", 0.0), ("overlap", 0.5)):
        ranks = []
        for rank in range(2):
            tl = timeline.Timeline(rank)
            for step in range(2):
                t = step * 10.0 + shift
                tl.add("forward", "forward", t, t + 1)
                tl.add("backward", "backward", t + 1, t + 3)
                tl.add("bucket 0", "allreduce", t + 2, t + 5)
            ranks.append(tl)
        tls[strategy] = ranks
    fig = figures_ddp.last_step_figure(tls, title="emulated")
    assert [ax.get_title() for ax in fig.axes] == [
        "bucketed: the last step on every rank", "overlap: the last step on every rank"]
    assert fig.axes[0].get_xlim() == pytest.approx((0, 5000 * 1.02))  # ms since the last forward
    assert fig.get_suptitle() == "emulated"


def test_bucket_sweep_figure_draws_each_series_and_the_two_references():
    fig = figures_ddp.bucket_sweep_figure([0.25, 1], {"overlap": ([90, 80], [5, 2]),
                                                      "bucketed": ([100, 95], [5, 2])}, 50, 30,
                                          title="t")
    ax = fig.axes[0]
    assert [list(line.get_ydata()) for line in ax.lines[:2]] == [[90, 80], [100, 95]]
    assert [line.get_ydata()[0] for line in ax.lines[2:]] == [50, 80]
    assert "buckets: [5, 2]" in ax.get_legend().get_texts()[0].get_text()
