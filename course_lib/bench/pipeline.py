"""``python -m course_lib bench pipeline``: the pipeline bubble measured against its formula.

Introduced in notebooks/09_model_parallelism.ipynb. Every stage is a layer that sleeps a fixed
time per micro-batch (forward, then twice that in backward: B and W half each when the backward
is split), so N stages fit on a 2-core laptop and each stage's work is known exactly;
``--compute`` uses real Linear layers instead. For N stages and M micro-batches the table shows
the measured bubble (the busiest stage's idle share of the step, from every stage's timeline)
beside the schedule's formula (:func:`pipeline.schedule_bubble`: (N-1)/(M+N-1) for GPipe and
1F1B, a third of the idle slots for ZB-H1, a sixth for ZB-V), the step time beside the schedule
simulator's, and the live micro-batches and activation bytes each schedule keeps::

    python -m course_lib bench pipeline                      # N = 2, 4; M = 1..16, ~1 min
    python -m course_lib bench pipeline --schedules 1f1b,zb-h1,zb-v --stages 4 --microbatches 8
    python -m course_lib bench pipeline --stages 4 --microbatches 8 --link 1Gbit/s
    python -m course_lib bench pipeline --schedules 1f1b,zb-h1,zb-v --stages 4 --microbatches 8 \
        --compute 2 --width 512 --batch 64 --torch     # beside torch.distributed.pipelining

The machine's ceiling printed beside: the fixed cost of one pipeline slot on this machine (a
message between stages plus Python), (measured - simulated step) / (M + N - 1).
"""

import sys

from course_lib import pipeline
from course_lib.bench.common import BenchError, argtype, parse_list, text_table, write_csv
from course_lib.runtime import netem

HELP = "pipeline bubble and live activations vs micro-batches: GPipe, 1F1B, zero bubble"
SCHEDULES = (*pipeline.SCHEDULES, "zb-v")

COLUMNS = ["stages", "schedule", "microbatches", "step_ms", "simulated_ms", "bubble",
           "formula_bubble", "peak_live", "simulated_peak_live", "peak_activation_kib",
           "slot_overhead_ms", "forward_ms", "backward_ms", "weight_ms", "stage", "link",
           "torch_ms", "vs_torch"]


def measure(cluster, stages=(2, 4), schedules=("gpipe", "1f1b"), microbatches=(1, 2, 4, 8, 16),
            forward_s=0.04, backward_s=0.08, compute_layers=0, width=16, link=None,
            batch=None, torch_too=False):
    """One row per (N, schedule, M), measured on ``cluster`` (its first N ranks for each N).
    ``batch``: rows of the whole batch (default: one row per micro-batch). ``torch_too`` (with
    ``compute_layers``, and no link): the same step run by ``torch.distributed.pipelining``'s
    schedule of that name, timed in the same run (``torch_ms``, ``vs_torch`` = ours / torch's).

    Introduced in notebooks/09_model_parallelism.ipynb."""
    from course_lib.testing.pipeline import measured_bubble, timed_step, torch_timed_step
    if max(stages) > cluster.n or min(stages) < 2:
        raise BenchError(f"stages must be in 2..{cluster.n} (the cluster's ranks)")
    _check_torch_too(torch_too, compute_layers, link, schedules)
    rows = []
    for N in stages:
        for schedule in schedules:
            for M in microbatches:
                reports = cluster.run(timed_step, schedule, M, forward_s, backward_s,
                                      compute_layers, batch, width,
                                      world_size=N if N < cluster.n else None, link=link)
                bubble, seconds = measured_bubble(reports)
                reports = [r for r in reports if r is not None]
                chunks = 2 if schedule == "zb-v" else 1  # each span is one chunk's
                f_ms, b_ms, w_ms = (chunks * _mean_span(reports, cat)
                                    for cat in ("forward", "backward", "weight"))
                sim = pipeline.simulate(schedule, N, M, f_ms, b_ms + w_ms, t_weight=w_ms)
                # slots on the critical path, in units of the shortest pass
                slots = {"naive": 2 * N, "zb-h1": 3 * M + N - 1,
                         "zb-v": 6 * M + N - 1}.get(schedule, 2 * (M + N - 1))
                try:
                    formula = pipeline.schedule_bubble(schedule, N, M)
                except ValueError:  # too few micro-batches for a zero-bubble formula
                    formula = float("nan")
                rows.append(dict(
                    stages=N, schedule=schedule, microbatches=M, step_ms=seconds * 1e3,
                    simulated_ms=sim.makespan, bubble=bubble, formula_bubble=formula,
                    peak_live=max(r["peak_live"] for r in reports),
                    simulated_peak_live=max(sim.peak_live),
                    peak_activation_kib=max(r["peak_bytes"] for r in reports) / 1024,
                    slot_overhead_ms=(seconds * 1e3 - sim.makespan) / slots,
                    forward_ms=f_ms, backward_ms=b_ms + w_ms, weight_ms=w_ms,
                    stage=f"{compute_layers} x Linear({width})" if compute_layers else "sleep",
                    link=str(netem.make_link(link)) if link else ""))
                if torch_too:
                    theirs = cluster.run(torch_timed_step, schedule, M, compute_layers, width,
                                         batch, world_size=N if N < cluster.n else None)
                    torch_ms = 1e3 * max(r["seconds"] for r in theirs if r is not None)
                    rows[-1].update(torch_ms=torch_ms, vs_torch=seconds * 1e3 / torch_ms)
    return rows


def _check_torch_too(torch_too, compute_layers, link, schedules):
    if torch_too and (not compute_layers or link or "naive" in schedules):
        raise BenchError("--torch times torch's schedules on real layers (--compute) without "
                         "--link, and torch has no naive schedule")


def _mean_span(reports, cat):
    """Mean duration in ms of one micro-batch's ``cat`` span, over every stage (0 if none)."""
    spans = [e.end - e.start for r in reports for e in r["timeline"].events if e.cat == cat]
    return 1e3 * sum(spans) / len(spans) if spans else 0.0


def format_table(rows):
    """The rows as text: measured beside predicted."""
    r0 = rows[0]
    out = [f"# pipeline, stages: {r0['stage']}; forward {r0['forward_ms']:.1f} ms, backward "
           f"{r0['backward_ms']:.1f} ms per micro-batch (measured means)"
           + (f"; emulated link {r0['link']}" if r0["link"] else ""),
           "# bubble = idle share of the busiest stage; formula: (N-1)/(M+N-1) for GPipe and 1F1B, "
           "(N-1)/(3M+N-1) for ZB-H1, (N-1)/(6M+N-1) for ZB-V (F = B = W); simulated = the "
           "schedule played with the measured stage times and free messages"]
    out += text_table(
        [["N", "schedule", "M", "step", "simulated", "bubble", "formula", "live", "simulated",
          "activations", "overhead"],
         ["", "", "", "(ms)", "(ms)", "", "", "(peak)", "live", "(KiB, peak)", "(ms/slot)"]],
        [[r["stages"], r["schedule"], r["microbatches"], f"{r['step_ms']:.1f}",
          f"{r['simulated_ms']:.1f}", f"{r['bubble']:.3f}",
          "-" if r["formula_bubble"] != r["formula_bubble"] else f"{r['formula_bubble']:.3f}",
          r["peak_live"], r["simulated_peak_live"], f"{r['peak_activation_kib']:.1f}",
          f"{r['slot_overhead_ms']:.2f}"] for r in rows], "><>>>>>>>>>")
    if "torch_ms" in r0:
        out.append("# ours vs torch.distributed.pipelining, the same layers, batch and schedule,"
                   " one after the other in this run:")
        out += text_table([["N", "schedule", "M", "ours (ms)", "torch (ms)", "ours / torch"]],
                          [[r["stages"], r["schedule"], r["microbatches"], f"{r['step_ms']:.1f}",
                            f"{r['torch_ms']:.1f}", f"{r['vs_torch']:.2f}"] for r in rows],
                          "><>>>>")
    overhead = sorted(r["slot_overhead_ms"] for r in rows)[len(rows) // 2]
    out.append(f"# ceiling: each pipeline slot costs this machine ~{overhead:.2f} ms of its own "
               "(median; a message between stages plus Python): it adds to the bubble")
    return "\n".join(out)


def arguments(parser):
    """The options of ``python -m course_lib bench pipeline``."""
    a = parser.add_argument
    a("--stages", type=argtype(lambda t: parse_list(t, what="--stages", example="2,4")),
      default=[2, 4], help="pipeline depths N, a comma list (default 2,4)")
    a("--microbatches", type=argtype(lambda t: parse_list(t, what="--microbatches",
                                                          example="1,4,16")),
      default=[1, 2, 4, 8, 16], help="M, a comma list (default 1,2,4,8,16)")
    a("--schedules", default="gpipe,1f1b", help=f"comma list of {', '.join(SCHEDULES)}")
    # 40 ms per forward: the machine's ~1 ms per pipeline slot stays under 5 points of bubble
    a("--forward-ms", type=float, default=40.0, help="each stage's sleep per forward (40)")
    a("--backward-ms", type=float, default=80.0, help="each stage's sleep per backward (80)")
    a("--compute", type=int, default=0, metavar="LAYERS",
      help="real compute instead of sleeping: this many Linear layers per stage")
    a("--width", type=int, default=16, help="features per layer and activation (default 16)")
    a("--batch", type=int, default=None,
      help="rows of the batch, cut into M micro-batches (default: M, one row each)")
    a("--link", type=argtype(netem.make_link), default=None,
      help="an emulated network between stages, like 1Gbit/s,50us (default none)")
    a("--torch", action="store_true",
      help="with --compute: also time torch.distributed.pipelining's schedule of each name")
    a("--csv", help="also write one row per (N, schedule, M) to this file")


def main(args):
    """Run ``bench pipeline`` with parsed ``args``."""
    from course_lib.runtime.cluster import start_cluster
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules or min(args.microbatches) < 1 or min(args.stages) < 2:
        print(f"bench pipeline: schedules must be among {SCHEDULES}, stages >= 2 and "
              "micro-batches >= 1", file=sys.stderr)
        return 2
    try:
        _check_torch_too(args.torch, args.compute, args.link, schedules)  # before any engine
        with start_cluster(n=max(args.stages), timeout=600) as cluster:
            rows = measure(cluster, args.stages, schedules, args.microbatches,
                           args.forward_ms / 1e3, args.backward_ms / 1e3, args.compute,
                           args.width, args.link.text if args.link else None, args.batch,
                           torch_too=args.torch)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"bench pipeline: {e}", file=sys.stderr)
        return 1
    print(format_table(rows))
    if args.csv:
        write_csv(rows, args.csv, COLUMNS)
    return 0
