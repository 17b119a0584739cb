"""A notebook run headless waits for each cell's reply in short polls, not one long one.

nbclient (behind ``jupyter nbconvert --execute``, ``make slides``, ``make site`` through myst-nb,
and nbgrader's autograde) waits for a cell's ``execute_reply`` with one asyncio poll of the
kernel's shell socket, as long as the cell's timeout. ZeroMQ signals a socket's readiness
by edge, and pyzmq's asyncio poll can miss the edge of a reply that arrives while other
messages of the cell (a widget's, for one) are being handled: the reply then sits unread until
the poll's timeout expires, and the notebook goes on as if nothing happened (nbclient issue
#312). Measured here: notebook 16, whose explorer cell is an ``ipywidgets.interact``, took
680 s under nbconvert, its stall the whole 600 s cell timeout (three runs of three); with
``--ExecutePreprocessor.timeout=120``, 207 s; with the polls below, 77 s.

``poll_in_slices()`` makes every wait of jupyter_client's asyncio channels a loop of polls of
at most :data:`SLICE_S`: a reply that is already there is read within a quarter of a second,
and the timeout is kept. ``python -m course_lib.runtime.kernel_replies ARGS`` is
``jupyter nbconvert ARGS`` with it. Introduced in notebooks/16_planning_a_run.ipynb.
"""

from __future__ import annotations

import sys
import time
from queue import Empty

SLICE_S = 0.25  # the longest a reply already received waits to be read


async def get_msg_in_slices(self, timeout: float | None = None) -> dict:
    """jupyter_client's ``AsyncZMQSocketChannel.get_msg``, polling at most ``SLICE_S`` at once.
    Introduced in notebooks/16_planning_a_run.ipynb."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = SLICE_S if deadline is None else min(SLICE_S, max(0.0, deadline - time.monotonic()))
        if await self.socket.poll(int(left * 1000)):
            return await self._recv()
        if deadline is not None and time.monotonic() >= deadline:
            raise Empty


def poll_in_slices() -> None:
    """Make jupyter_client's asyncio channels wait for messages in polls of at most
    ``SLICE_S`` (idempotent). Introduced in notebooks/16_planning_a_run.ipynb."""
    from jupyter_client.channels import AsyncZMQSocketChannel
    AsyncZMQSocketChannel.get_msg = get_msg_in_slices


def main(argv: list[str] | None = None) -> int:
    """``jupyter nbconvert`` with :func:`poll_in_slices`. Introduced in
    notebooks/16_planning_a_run.ipynb."""
    poll_in_slices()
    from nbconvert.nbconvertapp import NbConvertApp
    NbConvertApp.launch_instance(argv=sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
