"""Notebook 13's figures: the live plot says what it shows, and the best-so-far curve is read
where it first reaches a target."""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from course_lib.figures import hyperparameter_search as figures  # noqa: E402


class _Result:
    def __init__(self, curve):
        self.curve = np.array(curve, dtype=float)

    def best_so_far(self):
        return self.curve


def test_time_to_reach_is_the_first_crossing():
    result = _Result([(0.1, 1, 0.80), (0.2, 2, 0.93), (0.4, 5, 0.95), (0.5, 9, 0.97)])
    assert figures.time_to_reach(result, 0.95) == (0.4, 5)
    assert figures.time_to_reach(result, 0.5) == (0.1, 1)
    assert figures.time_to_reach(result, 0.99) is None
    assert figures.time_to_reach(_Result(np.empty((0, 3))), 0.5) is None


def test_live_plot_has_a_legend_and_starts_at_the_search():
    live = figures.LivePlot("random search")
    jobs = [SimpleNamespace(end=live.started + t, acc=a)
            for t, a in [(3.5, 0.9), (3.6, 0.4), (3.9, 0.97)]]
    fig = live.draw(jobs)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "best so far", "each job, when it finished"]
    assert ax.get_xlim()[0] == 0
    best = next(line for line in ax.lines if line.get_label() == "best so far")
    assert list(best.get_ydata()) == [0.9, 0.9, 0.97]
    assert "3 jobs done, best 0.970" in ax.get_title()
