"""Results printed as text: fixed-width tables and sizes in binary units.

Used by the lessons that print tables of measurements (notebook 12) and by the benchmarks
(``python -m course_lib bench ...``)."""

from __future__ import annotations

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}  # binary units, as nccl-tests' -b / -e


def format_size(n_bytes: int) -> str:
    """4194304 -> '4 MiB', 1536 -> '1536 B': the largest binary unit that divides it exactly.
    Introduced in notebooks/12_scaling_out.ipynb."""
    for unit in ("GiB", "MiB", "KiB"):
        if n_bytes >= UNITS[unit[0]] and n_bytes % UNITS[unit[0]] == 0:
            return f"{n_bytes // UNITS[unit[0]]} {unit}"
    return f"{n_bytes} B"


def text_table(header: list[str] | list[list[str]], rows: list[list | None],
               align: str | None = None) -> list[str]:
    """Lines of a fixed-width table: ``header`` is one or more rows of column titles (printed
    as comments, starting with '#'), ``rows`` lists of cells; ``None`` in ``rows`` is a blank
    line. ``align`` holds '<' or '>' per column (default: first left, the rest right).
    Introduced in notebooks/12_scaling_out.ipynb."""
    header = [header] if header and isinstance(header[0], str) else header
    n = len(header[0])
    align = align or "<" + ">" * (n - 1)
    cells = [[str(c) for c in r] for r in rows if r is not None]
    widths = [max(len(r[i]) for r in header + cells) for i in range(n)]

    def line(r):
        return " ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths, strict=True))

    titles = [line(h) for h in header]
    out = ["#" + (t[1:] if t.startswith(" ") else t) for t in titles]  # '#' marks comments
    out += ["" if r is None else line([str(c) for c in r]) for r in rows]
    return out
