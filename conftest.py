"""Every pytest run of this repository: when it executes notebooks (nbval), their clusters are
kept running from one notebook to the next (``course_lib.runtime.cluster.SHARED_ENV``) and
stopped at the end. The library's own tests (``tests/``) start real clusters, as a student does."""

import os

from course_lib.runtime.cluster import SHARED_ENV


def pytest_configure(config):
    if getattr(config.option, "nbval_lax", False) or getattr(config.option, "nbval", False):
        os.environ[SHARED_ENV] = str(os.getpid())  # the notebooks' kernels inherit it


def pytest_unconfigure(config):
    if os.environ.get(SHARED_ENV) == str(os.getpid()):
        from course_lib.runtime.launch import clean_clusters
        clean_clusters(shared_by=os.getpid())
        del os.environ[SHARED_ENV]
