"""Distributed deep learning, built from scratch and run for real: the course library.

The process that imports it (a notebook's kernel, a test, a benchmark's driver) computes with one
thread, as every engine of a cluster does: the course's models are small enough that a second
thread gains nothing on an idle machine, and on a busy one the threads of each operation wait for
one another (notebook 14's training cell, 600 steps of a small transformer: 7 s alone, over 300 s
with two threads beside two CPU-bound processes, 13 s with one). Set ``OMP_NUM_THREADS`` before
the import to choose otherwise.

The top level holds the lessons, one module per idea, each introduced by a notebook. What runs
them lives in subpackages: ``comm`` (point-to-point messages with deadlines, the agreement
checks), ``runtime`` (the cluster, its engines and launchers, emulated links and hosts, the
timeline, the stacks, the course's own tools), ``k8s`` (Kubernetes manifests, checked and run
here), ``models``, and the scaffolding around the lessons: ``checks`` (the labs'), ``testing``,
``bench`` and ``figures``. The cluster is one import away::

    from course_lib import start_cluster
"""

import os as _os
import sys as _sys

if "OMP_NUM_THREADS" not in _os.environ:
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        _os.environ.setdefault(_name, "1")
    if "torch" in _sys.modules:  # imported first: its thread pool already read the environment
        _sys.modules["torch"].set_num_threads(1)


_CLUSTER = ("start_cluster", "Cluster", "ClusterError", "ClusterTimeout", "EngineDied",
            "RemoteError")


def __getattr__(name: str):
    """``from course_lib import start_cluster``: the runtime's cluster, imported on first use
    (ipyparallel takes a second to import; the lessons do not need it)."""
    if name in _CLUSTER:
        from course_lib.runtime import cluster
        return getattr(cluster, name)
    raise AttributeError(f"module 'course_lib' has no attribute {name!r}")


# runtime.slide_text.SLIDE_TEXT_ENV, spelt out: the module is imported only when it is set
if _os.environ.get("COURSE_LIB_SLIDE_TEXT"):  # each figure a cell shows, measured
    from course_lib.runtime.slide_text import watch_slide_text as _watch_slide_text
    _watch_slide_text()
