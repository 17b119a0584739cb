"""What every benchmark shares: sizes and lists from the command line, text tables, CSV files.

Each benchmark module in this package offers ``HELP`` (one line), ``arguments(parser)`` (its
options) and ``main(args)`` (run, print, return an exit code); ``python -m course_lib bench``
finds them by name, so adding ``bench/<name>.py`` adds ``bench <name>``.
"""

from __future__ import annotations

import argparse
import csv
import re

from course_lib.runtime.tables import UNITS, format_size, text_table  # noqa: F401  (the benchmarks' too)
from course_lib.staging import memcpy_seconds


class BenchError(RuntimeError):
    """A benchmark could not run (bad setting, missing GPU, a launcher that failed)."""


# ---------------------------------------------------------------- the command line
def parse_size(text):
    """'4K' -> 4096: bytes with an optional binary unit K, M or G (nccl-tests' -b / -e)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise ValueError(f"bad size {text!r}: use bytes with an optional unit, like 512, 4K, 64M")
    return int(m.group(1)) * UNITS[m.group(2)]


def parse_sizes(text):
    """'1K-64M' -> 1K, 2K, 4K, ..., 64M (doubling, like ``-b 1K -e 64M -f 2``); '1M,16M' -> both."""
    sizes = []
    for item in text.split(","):
        lo, dash, hi = item.partition("-")
        lo = parse_size(lo)
        hi = parse_size(hi) if dash else lo
        if lo < 1 or hi < lo:
            raise ValueError(f"bad size range {item!r}: need 1 <= first <= last")
        while lo <= hi:
            sizes.append(lo)
            lo *= 2
    return sizes


def parse_list(text, convert=int, minimum=1, what="values", example="1,2,4"):
    """'1,2,4' -> [1, 2, 4]: a comma list of numbers, each at least ``minimum`` (``minimum``
    excluded for floats), or a ValueError that names ``what`` and shows ``example``."""
    try:
        values = [convert(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    low = bool(values) and (min(values) <= minimum if convert is float else min(values) < minimum)
    if not values or low:
        bound = f"> {minimum:g}" if convert is float else f">= {minimum}"
        raise ValueError(f"{what}: expected a comma list of numbers {bound} like {example}, "
                         f"not {text!r}")
    return values


def argtype(parse):
    """``parse`` as an argparse ``type=``: its ValueError becomes a usage error."""
    def parse_arg(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse_arg.__name__ = getattr(parse, "__name__", "value")
    return parse_arg


# ---------------------------------------------------------------- measurements and output
def memcpy_bandwidth(n_bytes=64 * 2**20, repeats=9):
    """Single-core memcpy bandwidth in GB/s: bytes copied per second, median of ``repeats``
    (:func:`course_lib.staging.memcpy_seconds`). Every benchmark prints it as the machine's
    ceiling."""
    return n_bytes / memcpy_seconds(n_bytes, repeats) / 1e9


def write_csv(rows, path, columns=None, extra=None):
    """Write ``rows`` (dicts) to ``path``, one per line, with ``columns`` (default: the keys of
    the first row) plus ``extra`` fields in every row; prints where they went."""
    columns = columns or (list(rows[0]) if rows else [])
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(dict(r, **(extra(r) if extra else {})))
    print(f"# {len(rows)} rows written to {path}")
