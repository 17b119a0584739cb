"""Notebook 11's figures: the chief's two logs (JSONL and TensorBoard's), and the checkpoint
interval's axes, labelled without overlap."""

import itertools

import matplotlib

matplotlib.use("Agg")

from course_lib.figures import fault_tolerance as figures  # noqa: E402


def _killed_run_log(steps=30, killed_after=12, resumed_from=10):
    """A chief's log as ``chief.supervise`` reads it: attempt 0 logged steps 1..12, attempt 1
    resumed from step 10's checkpoint and logged 11..30."""
    log = [{"event": "start", "attempt": 0, "step": 0}]
    log += [{"event": "step", "attempt": 0, "step": s, "loss": 1 / s}
            for s in range(1, killed_after + 1)]
    log += [{"event": "start", "attempt": 1, "step": resumed_from}]
    log += [{"event": "step", "attempt": 1, "step": s, "loss": 1 / s}
            for s in range(resumed_from + 1, steps + 1)]
    return log


def test_tensorboard_and_log_counts_each_step_of_each_log():
    log = _killed_run_log()
    scalars = [(s, 1 / s) for s in range(1, 31)]  # what purge_step leaves: each step once
    left, right = figures.tensorboard_and_log(scalars, log)
    bars = {round(p.get_x() + p.get_width() / 2): p.get_height() for p in right.patches}
    assert bars == {s: 2 if s in (11, 12) else 1 for s in range(1, 31)}
    board = next(line for line in right.lines if line.get_label().startswith("TensorBoard"))
    assert set(board.get_ydata()) == {1}
    labels = [t.get_text() for t in right.get_legend().get_texts()]
    assert "JSONL log: 32 records" in labels and "TensorBoard: 30 points" in labels
    # left: the TensorBoard curve, and each attempt's records where they were logged
    attempts = {line.get_label(): list(line.get_xdata()) for line in left.lines}
    assert attempts["JSONL log, attempt 0"] == list(range(1, 13))
    assert attempts["JSONL log, attempt 1"] == list(range(11, 31))
    assert attempts["TensorBoard's event files"] == list(range(1, 31))


def _tick_labels_overlap(ax):
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    labels = [t for t in ax.get_xticklabels(which="both") if t.get_visible() and t.get_text()]
    extents = [t.get_window_extent(renderer) for t in labels]
    return [(a.get_text(), b.get_text()) for (a, ea), (b, eb)
            in itertools.combinations(zip(labels, extents, strict=True), 2) if ea.overlaps(eb)]


def test_measured_intervals_labels_each_k_once_with_its_failures():
    rows = [{"interval": k, "seconds": 1 + k / 50, "model_s": 1.0, "ideal_s": 0.7,
             "failures": f, "redone": r}
            for k, f, r in [(2, 6, 9), (5, 5, 11), (10, 5, 14), (20, 5, 23), (50, 8, 171)]]
    ax = figures.measured_intervals(rows, 11)
    assert not _tick_labels_overlap(ax)
    shown = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert shown[0].split("\n")[0] == "2" and shown[-1] == "50\n8 failures\n171 steps redone"
    assert all(t.get_text() == "" for t in ax.get_xticklabels(minor=True))


def test_checkpoint_interval_ticks_are_plain_minutes():
    ax = figures.checkpoint_interval()
    assert not _tick_labels_overlap(ax)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "5", "10", "20", "60",
                                                            "180"]


def test_resharding_labels_each_new_rank_with_the_files_it_reads():
    saved = [((16 * r, 0), (16, 256)) for r in range(4)]
    loaded = {0: ((0, 0), (32, 128)), 1: ((0, 128), (32, 128)), 2: ((32, 0), (32, 128)),
              3: ((32, 128), (32, 128))}
    left, right = figures.resharding((64, 256), saved, loaded, "2.weight", "as dp4 saved it",
                                     "on dp2 x tp2")
    assert len(left.patches) == 4 and len(right.patches) == 4 + 4  # the saved, then outlines
    labels = sorted(t.get_text() for t in right.texts)
    assert labels == ["rank 0\nreads 0, 1", "rank 1\nreads 0, 1", "rank 2\nreads 2, 3",
                      "rank 3\nreads 2, 3"]
    assert left.get_title() == "2.weight as dp4 saved it: 4 files"


def test_async_save_bars_add_up_to_what_each_way_cost_the_run():
    o = {"plain": 0.24, "save": 0.2, "blocked": 0.03, "during": 0.25, "wait": 0.0,
         "hidden": 0.16}
    (ax,) = figures.async_save({"disk": o})
    ends = sorted(round(p.get_x() + p.get_width()) for p in ax.patches)
    assert ends[-2:] == [280, 440]  # async: copy + steps + wait; blocking: save + steps
    assert ax.get_title() == "disk: 160 of the save's 200 ms hidden"
