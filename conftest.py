"""Every pytest run of this repository: when it executes notebooks (nbval), their clusters are
kept running from one notebook to the next (``course_lib.runtime.cluster.SHARED_ENV``) and
stopped at the end, and every figure a cell shows must be readable on a slide (a cell whose
figure has text below 14 px at 1280 x 720 fails: ``course_lib.runtime.slide_text``). The
library's own tests (``tests/``) start real clusters, as a student does."""

import os

from course_lib.runtime.cluster import SHARED_ENV
from course_lib.runtime.slide_text import SLIDE_TEXT_ENV


def pytest_configure(config):
    if getattr(config.option, "nbval_lax", False) or getattr(config.option, "nbval", False):
        os.environ[SHARED_ENV] = str(os.getpid())  # the notebooks' kernels inherit it
        os.environ[SLIDE_TEXT_ENV] = "1"


def pytest_unconfigure(config):
    if os.environ.get(SHARED_ENV) == str(os.getpid()):
        from course_lib.runtime.launch import clean_clusters
        clean_clusters(shared_by=os.getpid())
        del os.environ[SHARED_ENV]
