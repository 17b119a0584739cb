"""Notebook 09's schedule figure: each panel readable on its own axis, no label over another."""

import itertools

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from course_lib import pipeline  # noqa: E402
from course_lib.figures import model_parallelism as figures  # noqa: E402


def _labels(ax):
    """The window extents of the micro-batch numbers written in ``ax``'s boxes."""
    renderer = ax.figure.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in ax.texts if t.get_text().isdigit()]


def _boxes(ax):
    return [p for collection in ax.collections for p in collection.get_paths()]


@pytest.mark.parametrize("M", [4, 8, 16, 32])
def test_no_label_overlaps_another(M):
    fig = figures.schedules_figure(num_stages=4, num_microbatches=M)
    fig.canvas.draw()
    for ax in fig.axes:
        boxes = _labels(ax)
        overlapping = [(a, b) for a, b in itertools.combinations(boxes, 2) if a.overlaps(b)]
        assert not overlapping, f"{ax.get_title()}: {len(overlapping)} labels overlap"


def test_each_panel_has_a_readable_scale():
    N, M = 4, 8
    fig = figures.schedules_figure(num_stages=N, num_microbatches=M)
    naive, gpipe, one_f_one_b, interleaved = fig.axes
    sims = {s: pipeline.simulate(s, N, M, virtual_stages=2)
            for s in ("gpipe", "1f1b", "interleaved")}
    assert naive.get_xlim() == (0, pipeline.simulate("naive", N, M, M * 1.0, M * 2.0).makespan)
    streamed = max(sim.makespan for sim in sims.values())
    assert streamed < naive.get_xlim()[1] / 2  # the naive run would squash the others
    for ax in (gpipe, one_f_one_b, interleaved):
        assert ax.get_xlim() == (0, streamed)
    # the other schedules' ends are marked on the naive run's axis
    assert sorted(line.get_xdata()[0] for line in naive.lines) == sorted(
        {sims["gpipe"].makespan, sims["interleaved"].makespan})
    # at the default size every box of the streamed schedules carries its number
    for ax, sim in zip((gpipe, one_f_one_b, interleaved), sims.values(), strict=True):
        assert len(_labels(ax)) == sum(len(row) for row in sim.intervals)
    # each panel's title states its own length
    for ax, sim in zip((gpipe, one_f_one_b, interleaved), sims.values(), strict=True):
        assert f"{sim.makespan:g} units" in ax.get_title()


def test_interleaved_chunks_are_told_apart():
    fig = figures.schedules_figure(num_stages=4, num_microbatches=8)
    interleaved = fig.axes[-1]
    faces = [tuple(c.get_facecolor()[0]) for c in interleaved.collections]
    light = {matplotlib.colors.to_rgba(c) for c in figures.LIGHT.values()}
    assert sum(f in light for f in faces) == len(faces) // 2  # one chunk of two is light


def test_save_all_writes_the_schedules(tmp_path):
    paths = figures.save_all(tmp_path)
    assert [p.name for p in paths] == ["09_pipeline_schedules.png", "09_zero_bubble.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_zero_bubble_figure_draws_every_w_and_a_v():
    fig = figures.zero_bubble_figure(num_stages=4, num_microbatches=8)
    one, h1, v = fig.axes
    gold = matplotlib.colors.to_rgba(figures.COLOURS["W"])
    faces = [[tuple(c.get_facecolor()[0]) for c in ax.collections] for ax in fig.axes]
    assert gold not in faces[0] and faces[1].count(gold) == 4 * 8  # a W per micro-batch
    assert len(faces[2]) == 4 * 8 * 3 * 2  # F, B and W of two chunks on every rank
    assert "11%" in h1.get_title() and "rank 3" in [t.get_text() for t in v.get_yticklabels()]
    assert "27%" in one.get_title()
