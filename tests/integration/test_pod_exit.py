"""A pod's processes end without the interpreter's teardown once their work is done
(``worker_agent.exiting``): the daemon and its Celery consumer, stopped with SIGTERM,
drain, log their last lines and exit 0, and no ``atexit`` hook of theirs runs.

The hook is planted with a ``sitecustomize`` on ``PYTHONPATH`` (every Python process of
the pod loads it), which writes the process's command line to a file when the
interpreter finalizes; a plain ``python -c pass`` with the same environment shows that
the hook does run in a process that ends the ordinary way, so the check can fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.pipeline_support import Stack, consumer_pid, fresh_sqlite, pipeline_broker
from tests.support import wait_until

SITECUSTOMIZE = """
import atexit, os, sys

def _finalized():
    with open(os.environ["EXIT_HOOKS_FILE"], "a") as out:
        out.write(" ".join(sys.orig_argv) + "\\n")

atexit.register(_finalized)
"""


def test_the_daemon_and_its_consumer_end_without_the_interpreters_teardown(
    tmp_short: Path,
) -> None:
    hooks = tmp_short / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    finalized = tmp_short / "finalized.txt"
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])),
        "EXIT_HOOKS_FILE": str(finalized),
    }
    control = subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, **env},
                             check=True)  # fmt: skip
    assert control.returncode == 0
    assert finalized.read_text().split("\n")[0].endswith("-c pass")
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
    ran = finalized.read_text().splitlines() if finalized.exists() else []
    assert [line for line in ran if "worker_agent.consumer" in line] == []
    assert [line for line in ran if " daemon " in line] == []
