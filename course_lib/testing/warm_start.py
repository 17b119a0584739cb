"""What a test runs on the engines of a warm cluster (:mod:`course_lib.runtime.warm_start`)."""

from __future__ import annotations

import os


def parent_and_draw() -> tuple[int, float]:
    """This engine's parent pid (its template's, when forked) and a draw of NumPy's global
    generator (each process its own seed)."""
    import numpy as np
    return os.getppid(), float(np.random.random())


def torch_was_loaded(results) -> None:
    """In a worker process: put whether PyTorch was imported before this function ran (it
    was, in a worker forked from the preloaded server)."""
    import sys
    results.put("torch" in sys.modules)
