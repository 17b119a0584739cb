"""The timeline: recording, overlap arithmetic, Chrome-trace export and the Gantt chart."""

import json
import pickle
import threading

import matplotlib
import pytest

from course_lib.runtime import timeline

matplotlib.use("Agg")


def _two_ranks():
    a, b = timeline.Timeline(rank=0), timeline.Timeline(rank=1)
    a.add("backward", "backward", 1.0, 3.0)
    a.add("bucket 0", "allreduce", 2.0, 4.0, bytes=1024)
    a.add("bucket 1", "allreduce", 2.5, 5.0)
    a.add("backward", "backward", 6.0, 7.0)
    a.add("bucket 0", "allreduce", 8.0, 9.0)
    b.add("forward", "forward", 0.5, 1.0)
    return a, b


def test_overlap_counts_time_both_were_active_once():
    a, _ = _two_ranks()
    assert timeline.overlap(a, "backward", "allreduce") == pytest.approx(1.0)
    assert timeline.overlap(a, "allreduce", "backward") == pytest.approx(1.0)
    assert timeline.overlap(a, "backward", "step") == 0.0
    assert timeline.totals(a) == {"allreduce": pytest.approx(4.0), "backward": pytest.approx(3.0)}


def test_span_records_and_can_be_switched_off():
    tl = timeline.Timeline(rank=3)
    with tl.span("forward"):
        pass
    with pytest.raises(KeyError), tl.span("step", "step", n=1):
        raise KeyError("the span is recorded even when the block raises")
    assert [(e.name, e.cat, e.rank) for e in tl.events] == [("forward", "forward", 3),
                                                          ("step", "step", 3)]
    assert all(e.end >= e.start for e in tl.events) and tl.events[1].args == {"n": 1}
    off = timeline.Timeline(enabled=False)
    with off.span("forward"):
        pass
    assert len(off) == 0


def test_recording_from_threads_loses_nothing_and_pickles():
    tl = timeline.Timeline()

    def work(k):
        for i in range(500):
            tl.add(f"t{k}", "allreduce", i, i + 1)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pickle.loads(pickle.dumps(tl)).events) == 2000


def test_chrome_trace_is_valid_json_in_microseconds(tmp_path):
    a, b = _two_ranks()
    path = tmp_path / "trace" / "ddp.json"
    trace = timeline.chrome_trace([a, b], path)
    assert json.loads(path.read_text()) == trace
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 6 and {e["pid"] for e in events} == {0, 1}
    first = min(events, key=lambda e: e["ts"])
    assert first["ts"] == 0 and first["dur"] == pytest.approx(0.5e6)
    comm = [e for e in events if e["cat"] == "allreduce"]
    assert {e["tid"] for e in comm} == {1} and comm[0]["args"] == {"bytes": 1024}
    names = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [n["args"]["name"] for n in names] == ["rank 0", "rank 1"]


def test_gantt_draws_a_compute_and_a_comm_row_per_rank():
    a, b = _two_ranks()
    ax = timeline.gantt([a, b], title="two ranks")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]
    assert len(ax.collections) == 6 and ax.get_title() == "two ranks"
    with pytest.raises(ValueError, match="no events"):
        timeline.gantt(timeline.Timeline())


def test_the_gantt_legend_names_every_category_it_draws():
    tl = timeline.Timeline(rank=0)
    for cat in ("compute", "allreduce", "checksum"):  # a known, a communication, a new one
        with tl.span(cat):
            pass
    legend = timeline.gantt([tl]).get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["compute", "allreduce", "checksum"]
