"""A pod's Celery consumer and ``drainctl worker`` start their workers without Celery's
command line (``worker_agent.celery_worker``): ``celery``'s click program imports every
command it could offer (Flower and tornado through the ``celery.commands`` entry
points, ``celery shell``'s REPL), 272 modules and 12 MB of memory that every pod paid.

Seen through a ``sitecustomize`` on ``PYTHONPATH`` that every Python process loads: its
``atexit`` hook (which both processes run, ``test_pod_exit``) writes which of those
modules the process had loaded. A ``python -c`` that imports Celery's command line with
the same environment writes them, so the check can fail. The drain through both
workers shows they still work as workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.pipeline_support import Stack, fresh_sqlite, pipeline_broker
from tests.support import sitecustomize_env

SITECUSTOMIZE = """
import atexit, os, sys

_OUT = os.environ["LOADED_FILE"]
_WATCHED = ("celery.bin.celery", "flower", "tornado", "click_repl", "prompt_toolkit")


def _loaded(argv=" ".join(sys.orig_argv)):
    found = [name for name in _WATCHED if name in sys.modules]
    with open(_OUT, "a") as out:
        out.write(f"{','.join(found) or '-'} {argv}\\n")


atexit.register(_loaded)
"""

CLI_MODULES = "celery.bin.celery,flower,tornado,click_repl,prompt_toolkit"


def loaded_by(lines: list[str], process: str) -> list[str]:
    return [line.split()[0] for line in lines if process in line]


def test_the_consumer_and_the_orchestrator_worker_do_not_load_celerys_command_line(
    tmp_short: Path,
) -> None:
    loaded = tmp_short / "loaded.txt"
    env = sitecustomize_env(tmp_short / "hooks", SITECUSTOMIZE, LOADED_FILE=str(loaded))
    control = subprocess.run(
        [sys.executable, "-c", "import celery.bin.celery as c; c.celery.list_commands(None)"],
        env={**os.environ, **env}, check=False,
    )  # fmt: skip
    assert control.returncode == 0
    assert loaded_by(loaded.read_text().splitlines(), "celery.bin.celery") == [CLI_MODULES]
    loaded.unlink()

    with pipeline_broker("redis") as broker:
        stack = Stack(tmp_short, broker.url, fresh_sqlite(tmp_short), results=broker.results,
                      **env)  # fmt: skip
        try:
            stack.start_worker()
            daemon = stack.start_daemon("team-a", "imports")
            daemon.spawn_working(1, "turns=100000,turn_ms=50", 1)
            drained = stack.drainctl("drain", "team-a/imports", "--wait", "--timeout", "90")
            assert drained.returncode == 0, drained.stderr
            daemon.stop(60)
        finally:
            stack.close()

    lines = loaded.read_text().splitlines()
    assert loaded_by(lines, "-m worker_agent.consumer ") == ["-"], lines
    assert loaded_by(lines, " worker --concurrency ") == ["-"], lines
