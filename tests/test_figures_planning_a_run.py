"""Notebook 16's figures: the plans of a model (what fits with its MFU, what does not with the
number that breaks) and the plan beside published runs, both written for the site."""

import matplotlib

matplotlib.use("Agg")

from course_lib.figures import planning_a_run as figures  # noqa: E402


def test_the_plans_say_what_fits_and_what_breaks():
    fig = figures.plans_figure("GPT 145B", devices=1024, shown=4)
    texts = [t.get_text() for t in fig.axes[1].texts]
    assert sum("MFU" in t for t in texts) == 4
    assert all("GiB > 80 GiB" in t for t in texts if "does not fit" in t)
    assert any("does not fit" in t for t in texts)


def test_save_all_writes_both_figures(tmp_path):
    paths = figures.save_all(tmp_path)
    assert [p.name for p in paths] == ["16_plans.png", "16_published_runs.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_fp8_figure_draws_each_format_and_marks_the_saturated_step():
    from course_lib.figures.planning_a_run import fp8_figure
    errors = {"bf16": [0.002, 0.002], "e4m3, a scale per tensor": [0.03, 0.4],
              "e4m3, a scale per 128": [0.03, 0.05]}
    scaling = {"current": [0.03] * 4, "delayed": [0.03, 0.03, 0.8, 0.03],
               "saturated": [0.0, 0.0, 0.78, 0.001]}
    left, right = fp8_figure([1, 1e5], errors, scaling)
    assert [line.get_label() for line in left.lines] == list(errors)
    assert [t.get_text() for t in right.texts] == ["step 2: 78% of the numbers saturated"]
    assert list(right.lines[1].get_ydata()) == scaling["delayed"]


def test_dry_run_figure_labels_each_kind_with_its_count():
    from course_lib.dry_run import Collective
    calls = 4 * [Collective("allreduce", "tp", 2**28)] + [Collective("all-gather", "dp", 2**28)]
    held = dict(parameters=2**20, gradients=2**20, optimizer=2**21, activations=2**33)
    left, right = figures.dry_run_figure(dict(collectives=calls, held=held), calls[:4], held)
    assert [t.get_text() for t in left.texts] == ["1 call", "4 calls"]
    assert [round(b.get_height(), 6) for b in left.patches] == [1.0, 4.0]  # GiB, float32
    assert list(left.lines[0].get_ydata()) == [0.0, 4.0]  # the plan has no all-gather
    assert right.get_yscale() == "log" and right.patches[3].get_height() == 8.0
