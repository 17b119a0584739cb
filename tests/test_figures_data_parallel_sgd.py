"""Notebook 06's figures (course_lib/figures/data_parallel_sgd.py) draw and check their input."""

import pytest

from course_lib.figures import data_parallel_sgd as figures_ddp


def test_figures_draw_and_check_their_input():
    fig = figures_ddp.bucket_figure(["a", "b", "c"], [400, 4000, 40], 1000)
    assert "2 buckets" in fig.axes[0].get_title()
    with pytest.raises(ValueError):
        figures_ddp.bucket_figure(["a"], [1, 2], 10)
    assert len(figures_ddp.sync_step_figure(2).axes) == 1
