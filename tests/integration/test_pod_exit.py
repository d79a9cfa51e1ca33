"""A pod's processes end without the interpreter's teardown once their work is done
(``worker_agent.exiting``): the daemon and its Celery consumer, stopped with SIGTERM,
drain, log their last lines and exit 0; their ``atexit`` hooks run (kombu hands unacked
messages back there), the freeing of their modules does not.

Both are seen through a ``sitecustomize`` on ``PYTHONPATH``, which every Python process
of the pod loads: it registers an ``atexit`` hook and keeps an object in its module
globals whose ``__del__`` only the teardown calls; each writes a line naming the
process. A plain ``python -c pass`` with the same environment writes both lines, so the
check can fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.pipeline_support import Stack, consumer_pid, fresh_sqlite, pipeline_broker
from tests.support import sitecustomize_env, wait_until

SITECUSTOMIZE = """
import atexit, os, sys

_OUT = os.open(os.environ["EXIT_HOOKS_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
_ARGV = " ".join(sys.orig_argv)


def _atexit_ran(write=os.write, out=_OUT, argv=_ARGV):
    write(out, f"atexit {argv}\\n".encode())


class _TornDown:
    def __del__(self, write=os.write, out=_OUT, argv=_ARGV):
        write(out, f"teardown {argv}\\n".encode())


atexit.register(_atexit_ran)
_torn_down = _TornDown()
"""


def test_the_daemon_and_its_consumer_end_without_the_interpreters_teardown(
    tmp_short: Path,
) -> None:
    finalized = tmp_short / "finalized.txt"
    env = sitecustomize_env(tmp_short / "hooks", SITECUSTOMIZE, EXIT_HOOKS_FILE=str(finalized))
    control = subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, **env},
                             check=False)  # fmt: skip
    assert control.returncode == 0
    assert [line.split()[0] for line in finalized.read_text().splitlines()] == [
        "atexit", "teardown"
    ]  # fmt: skip
    finalized.unlink()

    with pipeline_broker("redis") as broker:
        stack = Stack(tmp_short, broker.url, fresh_sqlite(tmp_short), results=broker.results,
                      **env)  # fmt: skip
        try:
            daemon = stack.start_daemon("team-a", "exit")
            daemon.spawn_working(2, "turns=100000,turn_ms=50", 1)
            wait_until(lambda: consumer_pid(daemon) is not None, 60, "the consumer")
            wait_until(lambda: " ready." in daemon.log_text(), 60, "the consumer ready")

            daemon.signal(signal.SIGTERM)
            code = daemon.wait(90)
        finally:
            stack.close()

    log = daemon.log_text()
    assert code == 0, daemon.log_tail()
    assert "drained agents=2" in log
    assert "event=daemon_stopped" in log.rstrip().splitlines()[-1], daemon.log_tail()
    ran = finalized.read_text().splitlines()
    for process in ("-m worker_agent.consumer ", " daemon --store "):
        assert [line.split()[0] for line in ran if process in line] == ["atexit"], ran
