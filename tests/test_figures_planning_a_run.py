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
