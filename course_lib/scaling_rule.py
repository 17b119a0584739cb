"""The linear scaling rule and its warmup (Goyal et al. 2017): a k times larger batch takes a k
times larger learning rate, reached gradually over the first epochs.

Introduced in notebooks/07_large_minibatch.ipynb; the schedule it returns is passed to
``gd.minibatch_sgd(..., update_schedule=...)`` (notebook 01's loop).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from course_lib.runtime.arguments import check_count, check_lr


def linear_scaling_warmup(base_lr: float, batch_size: int, base_batch_size: int,
                          warmup_epochs: float,
                          updates_per_epoch: int) -> Callable[[int], float]:
    """Per-update schedule ``update -> lr`` of Goyal et al. (2017): linear scaling + warmup.

    The target rate follows the linear scaling rule, ``target = base_lr * batch_size /
    base_batch_size``. Over the first ``W = warmup_epochs * updates_per_epoch`` updates
    (counted from 0 over the whole run) the rate rises linearly from ``base_lr`` to it:
    ``lr(u) = base_lr + (target - base_lr) * min(u / W, 1)``; ``warmup_epochs=0`` gives
    ``target`` from the first update (linear scaling alone). ``W`` need not be an integer.
    Use it as ``minibatch_sgd(..., update_schedule=...)``.

    Introduced in notebooks/07_large_minibatch.ipynb.
    """
    base_lr = check_lr(base_lr)
    for name, value in (("batch_size", batch_size), ("base_batch_size", base_batch_size),
                        ("updates_per_epoch", updates_per_epoch)):
        check_count(name, value)
    if not (isinstance(warmup_epochs, (int, float, np.number)) and math.isfinite(warmup_epochs)
            and warmup_epochs >= 0):
        raise ValueError(f"warmup_epochs must be a finite number >= 0, got {warmup_epochs!r}")
    target = base_lr * batch_size / base_batch_size
    warmup_updates = float(warmup_epochs) * int(updates_per_epoch)

    def schedule(update: int) -> float:
        check_count("the update index", update, least=0)
        if update >= warmup_updates:  # also warmup_updates == 0: no division by zero below
            return target
        return base_lr + (target - base_lr) * (update / warmup_updates)

    return schedule


# ---------------------------------------------------------------- update rules
