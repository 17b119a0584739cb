"""Argument checks the lessons share: a clear ValueError that names the argument, before any work
(or any message) starts. Introduced in notebooks/01_gradient_descent.ipynb."""

from __future__ import annotations

import math

import numpy as np


def check_lr(lr: float) -> float:
    """``lr`` as a float, or a ValueError unless it is a finite number > 0.
    Introduced in notebooks/01_gradient_descent.ipynb."""
    # np.number too: a rate read from an array (np.float32(0.1)) is a number as well
    if not (isinstance(lr, (int, float, np.number)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr (the learning rate) must be a finite number > 0, got {lr!r}")
    return float(lr)


def check_choice(name: str, value: object, allowed: tuple) -> object:
    """``value``, or a ValueError naming ``name`` unless it is one of ``allowed``.
    Introduced in notebooks/06_data_parallel_sgd.ipynb."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, not {value!r}")
    return value


def check_count(name: str, value: int, least: int = 1) -> int:
    """``value`` as an int, or a ValueError naming ``name`` unless it is an integer >= ``least``.
    Introduced in notebooks/01_gradient_descent.ipynb."""
    if not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)
