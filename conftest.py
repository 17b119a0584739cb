"""Every pytest run of this repository: the notebooks it executes (nbval) keep their clusters
running from one notebook to the next (``course_lib.cluster.SHARED_ENV``), stopped at the end.
The library's own tests (``tests/``), even in the same session, start real clusters, as a
student does."""

import os

import pytest

from course_lib.cluster import SHARED_ENV


def _is_notebook(item):
    return item.path.suffix == ".ipynb"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before the item's set-up: a notebook's kernel starts there and inherits the variable
    if _is_notebook(item):
        os.environ[SHARED_ENV] = str(os.getpid())
        item.config.stash[_SHARED] = True
    else:
        os.environ.pop(SHARED_ENV, None)


_SHARED = pytest.StashKey[bool]()


def pytest_unconfigure(config):
    os.environ.pop(SHARED_ENV, None)
    if config.stash.get(_SHARED, False):
        from course_lib.launch import clean_clusters
        clean_clusters(shared_by=os.getpid())
