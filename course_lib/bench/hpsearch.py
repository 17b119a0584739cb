"""``python -m course_lib bench hpsearch``: the searches side by side, Optuna beside our ASHA,
and the speed-up of a search with engines.

Introduced in notebooks/13_hyperparameter_search.ipynb. Two tables, measured in one run on one
local cluster:

1. Random search, synchronous successive halving (SH), ASHA on SH's budget and Hyperband (ours)
   and Optuna (one shared study, its ``SuccessiveHalvingPruner``, i.e. ASHA, on the same budget)
   on ``--search-engines`` engines with real trials (the digits MLP): best validation accuracy,
   epochs spent, seconds, engines busy; mean and spread over ``--seeds`` seeds; each search's
   best accuracy and time over ASHA's; then ASHA and Optuna seed by seed.
2. The speed-up of SH and ASHA with 1, 2, 4, 8 engines, trials that *sleep* their training
   time (``hpsearch_loop.sleep_trial``, so 8 engines fit on 2 cores), against linear and against
   the same search on a simulated clock with no overhead (``hpsearch_loop.simulate``). Ceilings
   printed beside: the machine's cores, how many sleeping engines really run at once, and the
   time no number of engines beats (the search simulated on unlimited engines)::

    python -m course_lib bench hpsearch                   # about a minute on 2 cores
    python -m course_lib bench hpsearch --seeds 5         # the comparison the course reports
    python -m course_lib bench hpsearch --engines 1,2,4,8,16 --epoch-ms 50 --csv hp.csv
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from course_lib import hpsearch, hpsearch_loop
from course_lib.bench.common import BenchError, argtype, parse_list, text_table, write_csv

HELP = "random/SH/ASHA/Hyperband vs Optuna: best accuracy, epochs, time; speed-up vs engines"

NAMES = {"random": "random search", "sh": "successive halving", "asha": "ASHA",
         "hyperband": "Hyperband", "optuna": "Optuna (ASHA)",
         "optuna-hyperband": "Optuna (Hyperband)"}
SEARCHES = ["random", "sh", "asha", "hyperband", "optuna"]  # the default; optuna-hyperband too
COLUMNS = ["table", "search", "seed", "engines", "best", "epochs", "configs", "seconds", "busy",
           "simulated_s", "simulated_busy"]


def run_search(cluster, search, seed=0, configs=27, max_epochs=9, eta=3, ranks=None,
               trial=hpsearch_loop.train_trial, directory=None, **trial_kwargs):
    """One search by its short name (see ``NAMES``) on ``ranks`` of ``cluster``, on SH's
    budget over ``configs`` configurations (random search: that many epochs of full trials).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    from course_lib.testing.hpsearch import optuna_search
    budget = hpsearch.halving_budget(configs, 1, max_epochs, eta)
    common = dict(trial=trial, ranks=ranks, directory=directory, **trial_kwargs)
    if search == "random":
        return hpsearch.random_search(cluster, max(1, budget // max_epochs), max_epochs,
                                      seed=seed, **common)
    if search == "sh":
        return hpsearch.successive_halving(cluster, configs, 1, max_epochs, eta, seed=seed,
                                           **common)
    if search == "asha":
        return hpsearch.asha(cluster, min_epochs=1, max_epochs=max_epochs, eta=eta, seed=seed,
                             budget=budget, **common)
    if search == "hyperband":
        return hpsearch.hyperband(cluster, 1, max_epochs, eta, seed=seed, **common)
    if search in ("optuna", "optuna-hyperband"):
        pruner = "asha" if search == "optuna" else "hyperband"
        return optuna_search(cluster, budget, 1, max_epochs, eta, pruner=pruner, seed=seed,
                             **common)
    raise BenchError(f"unknown search {search!r}: one of {', '.join(NAMES)}")


def _row(table, search, seed, engines, result):
    return {"table": table, "search": search, "seed": seed, "engines": engines,
            "best": result.best[0], "epochs": result.epochs_spent,
            "configs": len({j.config_id for j in result.jobs}), "seconds": result.elapsed,
            "busy": result.busy_fraction()}


def _warm_trial(directory):
    """On an engine: one epoch of a real trial, so no search's clock times loading the data."""
    config = {"lr": 0.1, "batch_size": 128, "width": 8, "warmup": 0}
    hpsearch_loop.train_trial(config, 1, Path(directory) / f"warm-{os.getpid()}")


def compare(cluster, searches=SEARCHES, seeds=(0, 1), engines=4, configs=27, max_epochs=9,
            eta=3, trial=hpsearch_loop.train_trial, **trial_kwargs):
    """One row per (search, seed) on the first ``engines`` ranks, seeds outside, searches
    inside (a burst of load elsewhere hits every search alike).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    if engines > cluster.n:
        raise BenchError(f"--search-engines {engines}: the cluster has {cluster.n} ranks")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-hpsearch-") as tmp:
        if trial is hpsearch_loop.train_trial:
            cluster.run(_warm_trial, tmp)
        for i, (seed, search) in enumerate(itertools.product(seeds, searches)):
            result = run_search(cluster, search, seed, configs, max_epochs, eta,
                                ranks=list(range(engines)), trial=trial,
                                directory=Path(tmp) / f"{i}-{search}-{seed}", **trial_kwargs)
            rows.append(_row("search", search, seed, engines, result))
    return rows


def _policy(search, seed, configs, max_epochs, eta):
    """The policy ``run_search`` drives for SH or ASHA, for the simulated clock."""
    rng = np.random.default_rng(seed)
    if search == "sh":
        drawn = [hpsearch.sample(hpsearch.SPACE, rng) for _ in range(configs)]
        return hpsearch.SuccessiveHalving(drawn, 1, max_epochs, eta)
    endless = (hpsearch.sample(hpsearch.SPACE, rng) for _ in itertools.count())
    return hpsearch.ASHA(endless, 1, max_epochs, eta, hpsearch.halving_budget(configs, 1,
                                                                               max_epochs, eta))


def simulated(search, engines, seed=0, configs=27, max_epochs=9, eta=3, epoch_s=0.02):
    """The same search on ``engines`` simulated engines with no overhead at all.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    return hpsearch_loop.simulate(_policy(search, seed, configs, max_epochs, eta), engines, epoch_s)


def speedup(cluster, engines=(1, 2, 4, 8), searches=("sh", "asha"), seeds=(0,), configs=27,
            max_epochs=9, eta=3, epoch_s=0.02):
    """One row per (search, engines, seed): the search with sleeping trials on the first
    ``engines`` ranks, beside the same search simulated without overhead.
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    if max(engines) > cluster.n:
        raise BenchError(f"--engines up to {max(engines)}: the cluster has {cluster.n} ranks")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-hpsearch-") as tmp:
        for i, (seed, n, search) in enumerate(itertools.product(seeds, engines, searches)):
            result = run_search(cluster, search, seed, configs, max_epochs, eta,
                                ranks=list(range(n)), trial=hpsearch_loop.sleep_trial,
                                directory=Path(tmp) / f"{i}-{search}-{n}-{seed}",
                                epoch_s=epoch_s)
            ideal = simulated(search, n, seed, configs, max_epochs, eta, epoch_s)
            rows.append(dict(_row("speedup", search, seed, n, result),
                             simulated_s=ideal.elapsed, simulated_busy=ideal.busy_fraction()))
    return rows


def sleep_concurrency(cluster, engines, seconds=0.2):
    """How many of ``engines`` engines really sleep at once: each sleeps ``seconds`` through
    the load-balanced view, total sleep over the wall time (at most ``engines``).
    Introduced in notebooks/13_hyperparameter_search.ipynb."""
    view = cluster.balanced_view(list(range(engines)))
    start = time.perf_counter()
    calls = [view.apply_async(time.sleep, seconds) for _ in range(engines)]
    for call in calls:
        call.get(timeout=30 + 10 * seconds)
    return engines * seconds / (time.perf_counter() - start)


def _mean(rows, key):
    return statistics.fmean(r[key] for r in rows)


def _spread(rows, key, fmt):
    values = [r[key] for r in rows]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(statistics.fmean(values), fmt)} ± {format(spread, fmt)}"


def format_search_table(rows, engines, configs, max_epochs, eta, trial_name):
    """The comparison as text: mean ± standard deviation over seeds, ratios to ASHA, then
    ASHA and Optuna seed by seed."""
    names = list(dict.fromkeys(r["search"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    by = {n: [r for r in rows if r["search"] == n] for n in names}
    budget = hpsearch.halving_budget(configs, 1, max_epochs, eta)
    out = [f"# {len(names)} searches x {len(seeds)} seed(s) on {engines} engines, {trial_name} "
           f"trials up to {max_epochs} epochs, eta {eta}; budget {budget} epochs (SH's on "
           f"{configs} configurations); mean ± std over seeds"]
    asha = by.get("asha")
    table = []
    for n in names:
        rs = by[n]
        ratio_best = f"{_mean(rs, 'best') / _mean(asha, 'best'):.3f}x" if asha else "-"
        ratio_time = f"{_mean(rs, 'seconds') / _mean(asha, 'seconds'):.2f}x" if asha else "-"
        table.append([NAMES[n], _spread(rs, "best", ".3f"), f"{_mean(rs, 'epochs'):.0f}",
                      f"{_mean(rs, 'configs'):.0f}", _spread(rs, "seconds", ".2f"),
                      f"{_mean(rs, 'busy'):.0%}", ratio_best, ratio_time])
    out += text_table(["search", "best accuracy", "epochs", "configs", "seconds", "busy",
                       "best/ASHA", "time/ASHA"], table, "<>>>>>>>")
    if asha and "optuna" in by:
        out.append("# ASHA (ours) and Optuna's ASHA (SuccessiveHalvingPruner, one shared study) "
                   "on the same budget, seed by seed")
        pairs = []
        for a, o in zip(asha, by["optuna"], strict=True):
            pairs.append([a["seed"], f"{a['best']:.3f}", a["epochs"], f"{o['best']:.3f}",
                          o["epochs"], f"{o['best'] / a['best']:.3f}x", f"{a['seconds']:.2f}",
                          f"{o['seconds']:.2f}", f"{o['seconds'] / a['seconds']:.2f}x"])
        out += text_table(["seed", "ASHA best", "epochs", "Optuna best", "epochs",
                           "Optuna/ASHA", "ASHA s", "Optuna s", "time ratio"], pairs,
                          ">>>>>>>>>")
    return "\n".join(out)


def format_speedup_table(rows, epoch_s, concurrency, unlimited):
    """The speed-up as text: measured against linear and against the simulated search, with
    the ceilings underneath (``unlimited``: SH's simulated seconds on 1 and on unlimited
    engines)."""
    engines = sorted({r["engines"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    base = engines[0]
    out = [f"# speed-up with engines: trials sleep their training time ({1e3 * epoch_s:g} ms per "
           f"epoch at batch size 32), mean of {len(seeds)} seed(s); simulated = the same search "
           "on a clock with no overhead"]
    table = []
    for search in dict.fromkeys(r["search"] for r in rows):
        first = [r for r in rows if r["search"] == search and r["engines"] == base]
        for n in engines:
            rs = [r for r in rows if r["search"] == search and r["engines"] == n]
            speed = _mean(first, "seconds") / _mean(rs, "seconds")
            table.append([NAMES[search], n, f"{_mean(rs, 'seconds'):.3f}", f"{speed:.2f}x",
                          f"{n / base:.0f}x", f"{speed / (n / base):.0%}",
                          f"{_mean(rs, 'simulated_s'):.3f}",
                          f"{_mean(rs, 'seconds') / _mean(rs, 'simulated_s'):.2f}x",
                          f"{_mean(rs, 'busy'):.0%}", f"{_mean(rs, 'simulated_busy'):.0%}"])
    out += text_table(["search", "engines", "seconds", "speed-up", "linear", "efficiency",
                       "simulated s", "vs simulated", "busy", "sim. busy"], table,
                      "<>>>>>>>>>")
    n = max(engines)
    one, endless = unlimited
    out.append(f"# ceiling: {os.cpu_count()} CPU cores (real trials run at most that many at "
               f"once); {n} engines sleeping at once reach {concurrency:.1f}x of one (sleep "
               f"trials cannot scale past it); successive halving simulated on unlimited "
               f"engines takes {endless:.3f} s (each rung's slowest trial, seed 0): its "
               f"decisions cap its speed-up at {one / endless:.1f}x; ASHA's do not (it starts "
               "new trials instead of waiting)")
    return "\n".join(out)


def arguments(parser):
    """The options of ``python -m course_lib bench hpsearch``."""
    a = parser.add_argument
    a("--seeds", type=int, default=2, help="seeds per search, 0..N-1 (default 2; 5 for the "
      "course's comparison)")
    a("--searches", type=argtype(_searches), default=SEARCHES,
      help=f"a comma list of {','.join(NAMES)} (default: all but optuna-hyperband)")
    a("--search-engines", type=int, default=4, help="engines of the comparison (default 4)")
    a("--trial", choices=["real", "sleep"], default="real",
      help="the comparison's trials: the digits MLP (default) or sleeping stand-ins")
    a("--engines", type=argtype(lambda t: parse_list(t, minimum=0, what="--engines",
                                                     example="1,2,4,8")),
      default=[1, 2, 4, 8], help="engine counts of the speed-up (default 1,2,4,8; 0 skips it)")
    a("--speedup-seeds", type=int, default=1, help="seeds of the speed-up (default 1)")
    a("--epoch-ms", type=float, default=20.0,
      help="a sleeping trial's epoch at batch size 32 (default 20 ms)")
    a("--configs", type=int, default=27, help="SH's configurations: sets the budget "
      "(default 27: 63 epochs with --max-epochs 9, --eta 3)")
    a("--max-epochs", type=int, default=9, help="epochs of a full trial (default 9)")
    a("--eta", type=int, default=3, help="reduction factor (default 3)")
    a("--csv", help="also write every run's row to this file")


def _searches(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if not names or unknown:
        raise ValueError(f"--searches: expected a comma list of {', '.join(NAMES)}, not "
                         f"{text!r}")
    return names


def main(args):
    """Run ``bench hpsearch`` with parsed ``args``."""
    from course_lib.runtime.cluster import ClusterError, start_cluster
    if min(args.seeds, args.speedup_seeds, args.search_engines, args.configs,
           args.max_epochs) < 1 or args.epoch_ms <= 0 or args.eta < 2:
        print("bench hpsearch: --seeds, --speedup-seeds, --search-engines, --epoch-ms, "
              "--configs and --max-epochs must be positive, --eta at least 2", file=sys.stderr)
        return 2
    seeds, epoch_s = list(range(args.seeds)), args.epoch_ms / 1e3
    shape = dict(configs=args.configs, max_epochs=args.max_epochs, eta=args.eta)
    trial = hpsearch_loop.train_trial if args.trial == "real" else hpsearch_loop.sleep_trial
    extra = {} if args.trial == "real" else {"epoch_s": epoch_s}
    speed_engines = [n for n in args.engines if n > 0]
    try:
        with start_cluster(n=max([args.search_engines, *speed_engines]), timeout=600) as cluster:
            rows = compare(cluster, args.searches, seeds, args.search_engines, trial=trial,
                           **shape, **extra)
            print(format_search_table(rows, args.search_engines, trial_name=args.trial,
                                      **shape))
            if speed_engines:
                speed = speedup(cluster, speed_engines, ("sh", "asha"),
                                list(range(args.speedup_seeds)), epoch_s=epoch_s, **shape)
                concurrency = sleep_concurrency(cluster, max(speed_engines))
                unlimited = [simulated("sh", n, 0, epoch_s=epoch_s, **shape).elapsed
                             for n in (1, 10_000)]
                print(format_speedup_table(speed, epoch_s, concurrency, unlimited))
                rows += speed
    except (BenchError, ClusterError, hpsearch_loop.SearchError) as e:
        print(f"bench hpsearch: {e}", file=sys.stderr)
        return 1
    if args.csv:
        write_csv(rows, args.csv, COLUMNS)
    return 0
