"""A timeline of what each rank did and when: compute and communication, side by side.

Introduced in notebooks/06_data_parallel_sgd.ipynb. Overlap of gradient allreduce with the
backward pass is the whole point of bucketed data parallelism, and it can only be seen on a
timeline, one row per rank and lane, like Horovod's timeline or the PyTorch profiler's::

    from course_lib.runtime import timeline
    tl = timeline.Timeline(rank=0)
    with tl.span("forward", "forward"):
        out = model(x)
    tl.add("bucket 0", "allreduce", start, end, bytes=4 << 20)   # from another thread: fine
    timeline.chrome_trace([tl0, tl1], "trace.json")              # open in ui.perfetto.dev
    timeline.gantt([tl0, tl1])                                   # the same as a matplotlib chart
    timeline.overlap(tl, "backward", "allreduce")                # seconds both were active

Recording costs one ``time.perf_counter()`` and one list append per event. ``perf_counter``
is one clock for all processes of a host, so ranks on one machine line up without correction.
"""

from __future__ import annotations

import json
import time
from collections import namedtuple
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the annotations only: matplotlib is imported when a chart is drawn
    from matplotlib.axes import Axes

Event = namedtuple("Event", "name cat start end rank args")

# Which lane of the Gantt chart a category is drawn in, and its colour.
COMM_CATEGORIES = ("allreduce", "broadcast", "send", "recv", "all-gather", "reduce-scatter")
COLOURS = {"compute": "tab:pink", "forward": "tab:blue", "backward": "tab:orange",
           "step": "tab:green", "wait": "tab:red", "allreduce": "tab:purple",
           "broadcast": "tab:brown", "data": "tab:gray", "recv": "tab:olive", "send": "tab:cyan",
           "weight": "goldenrod",  # a split backward's W, as in the simulated charts
           "all-gather": "tab:purple", "reduce-scatter": "tab:brown"}  # FSDP's


@contextmanager
def cpu_seconds(stats: dict, key: str) -> Iterator[None]:
    """Add the calling thread's CPU seconds inside the block to ``stats[key]``: CPU time, fair
    even when ranks share cores (wall time would count the others' turns). Introduced in
    notebooks/14_transformers_and_long_sequences.ipynb."""
    start = time.thread_time()
    try:
        yield
    finally:
        stats[key] = stats.get(key, 0.0) + time.thread_time() - start


class Timeline:
    """Events of one rank: ``(name, category, start, end, rank, args)`` in perf_counter seconds.

    Introduced in notebooks/06_data_parallel_sgd.ipynb.
    """

    def __init__(self, rank: int = 0, enabled: bool = True) -> None:
        self.rank, self.enabled = rank, enabled
        self.events: list[Event] = []

    now = staticmethod(time.perf_counter)

    def add(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        """Record one finished interval (thread-safe: a single list append)."""
        if self.enabled:
            self.events.append(Event(name, cat, start, end, self.rank, args))

    @contextmanager
    def span(self, name: str, cat: str | None = None, **args: Any) -> Iterator[None]:
        """Record the time the ``with`` block takes, under ``cat`` (default: ``name``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat or name, start, time.perf_counter(), **args)

    def clear(self) -> None:
        """Forget every event (a new step, say)."""
        self.events = []

    def of(self, cat: str) -> list[Event]:
        """The events of one category, by start time."""
        return sorted((e for e in self.events if e.cat == cat), key=lambda e: e.start)

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"<Timeline rank {self.rank}: {len(self.events)} events>"


# Records nothing (its ``add`` does nothing): the default of whatever fills a timeline when given
# one, so that it calls ``timeline.add(...)`` either way. Pass ``Timeline(rank)`` to record.
DISABLED = Timeline(enabled=False)


def _events(timelines):
    if isinstance(timelines, Timeline):
        timelines = [timelines]
    return [e for tl in timelines for e in tl.events]


def _intervals(events):
    """Merge ``(start, end)`` intervals into disjoint ones."""
    merged = []
    for s, e in sorted((e.start, e.end) for e in events):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def overlap(tl: Timeline, cat_a: str = "backward", cat_b: str = "allreduce") -> float:
    """Seconds during which some event of ``cat_a`` and some of ``cat_b`` were both running.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    a, b = _intervals(tl.of(cat_a)), _intervals(tl.of(cat_b))
    total, i, j = 0.0, 0, 0
    # two sorted lists of disjoint intervals, walked as merge sort does: add the overlap of the
    # current pair, then step past whichever interval ends first (it overlaps nothing later)
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def totals(tl: Timeline) -> dict[str, float]:
    """``{category: seconds}``, overlapping events of one category counted once.

    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    return {cat: sum(e - s for s, e in _intervals(tl.of(cat)))
            for cat in sorted({e.cat for e in tl.events})}


def chrome_trace(timelines: Timeline | Sequence[Timeline],
                 path: str | Path | None = None) -> dict:
    """The events as Chrome-trace JSON (``ph: "X"`` complete events, microseconds, one process
    per rank, compute and communication on separate threads); opens in ui.perfetto.dev or
    chrome://tracing. Written to ``path`` when given; the dict is returned either way.
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    events = _events(timelines)
    t0 = min((e.start for e in events), default=0.0)
    trace = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
             for r in sorted({e.rank for e in events})]
    for e in events:
        tid = 1 if e.cat in COMM_CATEGORIES else 0  # thread 1: communication, 0: compute
        trace.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": e.rank, "tid": tid,
                      "ts": round((e.start - t0) * 1e6, 3),
                      "dur": round((e.end - e.start) * 1e6, 3),
                      "args": {k: v for k, v in e.args.items()
                               if isinstance(v, (int, float, str, bool))}})  # JSON's kinds
    out = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out))
    return out


def gantt(timelines: Timeline | Sequence[Timeline], ax: Axes | None = None,
          title: str | None = None, since: float | None = None) -> Axes:
    """A Gantt chart: per rank a compute row and a communication row, time in milliseconds from
    the first event (or ``since``). Returns the matplotlib Axes.
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    # here, not at the top: ranks record timelines on engines and never draw
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = _events(timelines)
    if not events:
        raise ValueError("no events to draw: was the timeline enabled and passed to the run?")
    ranks = sorted({e.rank for e in events})
    t0 = min(e.start for e in events) if since is None else since
    rows = [(r, lane) for r in ranks for lane in ("compute", "comm")]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(rows)))
    for e in events:
        lane = "comm" if e.cat in COMM_CATEGORIES else "compute"
        y = rows.index((e.rank, lane))
        # at least 1 us wide, so that an instant event is still drawn
        ax.broken_barh([((e.start - t0) * 1e3, max((e.end - e.start) * 1e3, 1e-3))],
                       (y - 0.4, 0.8), facecolors=COLOURS.get(e.cat, "tab:olive"),
                       edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"rank {r} {lane}" for r, lane in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    drawn = {e.cat for e in events}  # every category drawn is named, the known ones first
    cats = [c for c in COLOURS if c in drawn] + sorted(drawn - set(COLOURS))
    ax.legend(handles=[Patch(color=COLOURS.get(c, "tab:olive"), label=c) for c in cats],
              loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize="small")
    if title:
        ax.set_title(title)
    from course_lib.runtime.slide_text import raise_small_text  # here: engines never draw
    raise_small_text(ax.figure)
    return ax
