"""A pass that fails backs off, per task, and says so in one line: the dev stack on its
embedded broker with a real PostgreSQL ledger, the real operator and kubectl.

What was tried: the ledger made unreachable under three Running tasks (its database
refuses new connections and its connections are ended) for 25 s. Without a backoff each
task's pass would fail at every look (every ``DRAIN_RECONCILE_INTERVAL_SECS``, 0.5 s in
this stack, 2 s by default) with a traceback; with it, a task's failures come at 1, 2, 4,
8, 16 s, a line each, no traceback. Once the ledger answers, the tasks go on: a pause is
recorded and every agent resumes at turns + 1 on the wake.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import PG_URL, fresh_postgres

pytestmark = pytest.mark.slow

OUTAGE_SECS = 25.0
TASKS = ("fail-a", "fail-b", "fail-c")


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-backoff-", dir="/tmp"))
    dev = DevStack(root, None, fresh_postgres())
    try:
        yield dev
    finally:
        dev.close()


def set_connections(allowed: bool) -> None:
    """The ledger's database takes new connections (or not, its present ones ended)."""
    url = make_url(PG_URL)
    admin = create_engine(url.set(database="postgres"), poolclass=NullPool,
                          isolation_level="AUTOCOMMIT")  # fmt: skip
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{url.database}" ALLOW_CONNECTIONS '
                              f"{'true' if allowed else 'false'}"))  # fmt: skip
            if not allowed:
                conn.execute(
                    text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = :db AND pid <> pg_backend_pid()"),
                    {"db": url.database},
                )  # fmt: skip
    finally:
        admin.dispose()


def operator_log(stack: DevStack) -> str:
    return (stack.state / "logs" / "operator.log").read_text(errors="replace")


def test_passes_failing_on_the_ledger_back_off_one_line_each(stack: DevStack) -> None:
    for name in TASKS:
        assert stack.apply(task_manifest(name, agents=1)).returncode == 0
    for name in TASKS:
        stack.wait_phase("default", name, "Running", timeout=120)
    before = len(operator_log(stack))
    set_connections(False)
    try:
        time.sleep(OUTAGE_SECS)
    finally:
        set_connections(True)
    during = operator_log(stack)[before:]

    failures = {
        name: len(re.findall(rf"pass_failed attempt=\d+ .*name={name}\b", during)) for name in TASKS
    }
    # Passes fail (the heartbeats stop, deadlines fall due), and back off: at 1, 2, 4, 8,
    # 16 s from the first, at most 5 in 25 s, where 0.5 s looks would have made 50.
    assert all(1 <= n <= 6 for n in failures.values()), failures
    attempts = [int(a) for a in re.findall(r"pass_failed attempt=(\d+)", during)]
    assert max(attempts) >= 3, attempts
    assert "Traceback" not in during

    # The ledger answers again: the tasks go on as before.
    for name in TASKS:
        body = json.dumps({"spec": {"lifecycle": {"suspend": True}}})
        stack.kubectl("patch", "ctask", name, "--type=merge", "-p", body)
    for name in TASKS:
        stack.wait_phase("default", name, "Suspended", timeout=400)
        [pause] = [op for op in stack.ledger.list_operations("default", name)
                   if op.kind == "pause"]  # fmt: skip
        assert pause.state == "recorded", pause
