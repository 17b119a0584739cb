"""``python -m course_lib ...`` run inside the test's own process.

Every new Python that imports PyTorch costs about three seconds of CPU before it does anything.
A test of what the command line refuses, or prints without running anything, learns the same from
:func:`course_lib.__main__.main` called here: the same parser, the same checks, the same exit
code and messages. Each benchmark keeps one real run through a new process
(``python -m course_lib bench ...``), which is where the entry point itself is tested.
"""

from __future__ import annotations

import contextlib
import io
import subprocess


def run(*argv: str) -> subprocess.CompletedProcess:
    """``python -m course_lib *argv`` in this process: its exit code, stdout and stderr, as
    :func:`subprocess.run` with ``capture_output=True, text=True`` gives them."""
    from course_lib.__main__ import main
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(argv))
        except SystemExit as exit_:  # argparse's errors (2), --help (0), sys.exit("message")
            code = exit_.code
            if isinstance(code, str):
                print(code, file=stderr)
                code = 1
    return subprocess.CompletedProcess(["python", "-m", "course_lib", *argv],
                                       0 if code is None else code, stdout.getvalue(),
                                       stderr.getvalue())
