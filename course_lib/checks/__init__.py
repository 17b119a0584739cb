"""Lab checks: the framework once (:mod:`course_lib.checks.framework`), then one module per lab,
named like the lab: ``lab05_allreduce.py`` checks ``labs/05_allreduce.ipynb``, including what its
checks run on the cluster's ranks. A lab imports its own module::

    from course_lib.checks import lab05_allreduce as checks
    ok = checks.check_ring_reduce_scatter(ring_reduce_scatter, cluster)
"""

from course_lib.checks.framework import (  # noqa: F401 - the framework, for the labs' checks
    Case,
    CheckFailed,
    compare,
    not_implemented,
    pack_function,
    run_check,
)
