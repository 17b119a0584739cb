"""Every pytest run of this repository: the notebooks it executes (nbval) keep their clusters
running from one notebook to the next (``course_lib.cluster.SHARED_ENV``), stopped at the end.
The library's own tests (``tests/``), even in the same session, start real clusters, as a
student does."""

import os

import pytest

from course_lib.cluster import SHARED_ENV

# The longest units of a whole run (a notebook or a test file; measured with --junitxml), started
# first so that no pytest worker is left alone with one at the end
LONGEST_FIRST = ("tests/test_faults.py", "notebooks/12_scaling_out.ipynb", "tests/test_browser.py",
                 "notebooks/11_fault_tolerance.ipynb", "tests/test_cli.py", "tests/test_train.py",
                 "notebooks/05_allreduce.ipynb", "tests/test_bench_allreduce.py",
                 "tests/test_chief.py", "tests/test_site.py")


def pytest_collection_modifyitems(config, items):
    root = config.rootpath

    def rank(item):
        where = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return LONGEST_FIRST.index(where) if where in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: every file keeps its order inside


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
