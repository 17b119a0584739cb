"""Notebook 07's figures (course_lib/figures/large_minibatch.py) draw, without a cluster."""

from matplotlib.figure import Figure

from course_lib import large_batch, stragglers
from course_lib.figures import large_minibatch as figures


def test_save_all_draws_the_order_statistics(tmp_path):
    paths = figures.save_all(tmp_path)
    assert [p.name for p in paths] == ["07_order_statistics.png"]
    assert paths[0].stat().st_size > 10_000


def test_order_statistics_lines_follow_the_formula():
    ax = figures.plot_order_statistics(workers=(1, 4, 16), backups=(0, 2), num_steps=200,
                                       ax=Figure().subplots())
    formula = [line for line in ax.get_lines() if line.get_label() == "b = 2"][0]
    assert list(formula.get_xdata()) == [4, 16]
    assert list(formula.get_ydata()) == [stragglers.expected_step_time(n, 2) for n in (4, 16)]


def test_accuracy_and_straggler_figures_draw_measured_rows():
    rows = [dict(variant=v, batch_size=b, mean=0.9, accuracies=[0.85, 0.95])
            for v in large_batch.VARIANTS for b in (32, 256)]
    ax = figures.plot_accuracy_vs_batch(rows, ax=Figure().subplots())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "fixed lr", "linear scaling", "scaling + warmup"]
    table = [dict(delay=d, rank=r, compute_s=0.05 + (d if r == 1 else 0.0), wait_s=0.01,
                  slowed=bool(d) and r == 1) for d in (0.0, 0.2) for r in range(2)]
    ax = figures.plot_straggler_table(table, ax=Figure().subplots())
    assert len(ax.patches) == 2 * len(table)  # a compute bar and a waiting bar per rank


def test_the_plots_left_the_lesson_modules():
    assert not hasattr(large_batch, "plot_accuracy_vs_batch")
    assert not hasattr(stragglers, "plot_straggler_table")
    assert not hasattr(stragglers, "plot_order_statistics")
