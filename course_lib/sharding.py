"""Which part of ``n`` items a rank holds: one contiguous slice each, sizes differing by at most
one.

Introduced in notebooks/01_gradient_descent.ipynb and used wherever work is split over ranks: a
global batch over data-parallel workers (02, 06), parameters over servers (04), a buffer into the
ring's chunks (05), parameters and optimizer state over ZeRO ranks (10), micro-batches and
layers over pipeline stages (09).
"""

from __future__ import annotations

import numpy as np


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, stop)`` of rank's contiguous slice of ``n`` items.

    The first ``n % world_size`` ranks get one extra item (as ``np.array_split`` does), so sizes
    differ by at most one; with ``n < world_size`` the last ranks get empty slices.

    Introduced in notebooks/01_gradient_descent.ipynb.
    """
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size - 1}], got {rank!r}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)  # ranks before this one: min(rank, extra) extras
    return start, start + base + (1 if rank < extra else 0)
