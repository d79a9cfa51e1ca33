"""Ending a pod's process without the interpreter's teardown.

When a daemon, its Celery consumer or an agent is done (everything saved, acknowledged
and logged), what is left of its life is CPython's finalization: every module and object
freed one by one. That costs CPU and nothing else (the kernel closes the files, sockets
and locks; shared-memory metrics are already in their files), and it is paid at the
worst moment: a node drain or a fan-out of deletions stops hundreds of pods at once, on
the same cores as the drains still running. Measured here for this module: finalizing a
consumer's interpreter takes 65 ms of CPU, a daemon's 36 ms (``bench/RESULTS.md``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush the log handlers and the standard streams, then end the process with
    ``code`` at once (``os._exit``: no ``atexit`` hooks, no module teardown)."""
    logging = sys.modules.get("logging")  # an agent never loads it: nothing to flush
    if logging is not None:
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # Closed, or a broken pipe: nothing is left to lose.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
