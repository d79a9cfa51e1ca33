"""The daemon consumer's broker connection, as a file its supervisor's ``/readyz`` reads.

The consumer (a Celery worker, a child process) knows whether it is connected; the
supervisor (``drainctl daemon``, which serves the probes and must load no Celery) does
not. So the consumer's :class:`~worker_agent.consumer.BrokerWatch` thread writes
:data:`REPORT_FILE` in the metrics dir the supervisor handed it, every
:data:`CHECK_SECS` and on every change of its worker's connection: its pid and, when it
is not ready, why — its worker not connected yet, its worker's connection lost (Celery
reconnecting), or the broker not answering a fresh connection within
:data:`CHECK_TIMEOUT_SECS` (a broker gone without closing the connection, or lost while
a solo-pool task holds the worker's loop). The supervisor trusts a report for
:data:`STALE_SECS` and only from the consumer process running now.

Readiness only: a lost broker must never fail liveness (see ``worker_agent.probes``).

This module imports neither Celery nor ``prometheus_client``: both processes use it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Final

REPORT_FILE: Final = "consumer.broker"
"""In the metrics dir: ``{"pid": …, "problem": null | "why not ready"}``."""
CHECK_SECS: Final = 5.0
"""How often the consumer writes its report (and checks the broker answers)."""
CHECK_TIMEOUT_SECS: Final = 2.0
"""A broker that takes longer to accept a connection, or to answer on it, is lost."""
STALE_SECS: Final = 20.0
"""A report older than this is not trusted: the consumer is stopped or stuck (four
missed reports; a check takes at most twice its timeout, connect then answer)."""


class Connection(Enum):
    """What the consumer's Celery worker says of its broker connection."""

    NOT_YET = "is not connected to the broker yet"
    CONNECTED = "is connected"
    LOST = "lost its broker connection (Celery is reconnecting)"
    STOPPING = "is shutting down"


@dataclass(frozen=True)
class Report:
    pid: int
    problem: str | None
    """None: ready; else why not (logged when ``/readyz`` answers 503)."""


# ------------------------------------------------------------------------ pure parts


def problem(connection: Connection, check_error: str | None) -> str | None:
    """Why the consumer is not ready, or None: its worker is connected and the broker
    answered a fresh connection. The check's error says why a connection is down."""
    if connection is Connection.CONNECTED and check_error is None:
        return None
    if connection is Connection.CONNECTED:
        return f"the consumer's broker does not answer: {check_error}"
    why = f"the consumer {connection.value}"
    return why if check_error is None else f"{why}: {check_error}"


def verdict(report: Report | None, age: float, consumer_pid: int) -> str | None:
    """``/readyz``'s word on the broker, from the report read ``age`` seconds after it
    was written, for the consumer process ``consumer_pid`` running now."""
    if report is None or report.pid != consumer_pid:
        return "the consumer has not reported its broker connection yet"
    if age > STALE_SECS:
        return (
            f"the consumer's last broker report is {age:.0f}s old "
            f"(it writes one every {CHECK_SECS:.0f}s): the consumer is stuck"
        )
    return report.problem


# ------------------------------------------------------------------------ the file


def write(directory: Path, report: Report) -> None:
    """Replace the report at once, so a reader never sees half of one."""
    path = directory / REPORT_FILE
    partial = path.with_name(f"{REPORT_FILE}.{report.pid}.tmp")
    partial.write_text(json.dumps({"pid": report.pid, "problem": report.problem}))
    os.replace(partial, path)


def read(directory: Path) -> tuple[Report | None, float]:
    """The report and when it was written (wall clock); (None, 0) when there is none or
    it cannot be read."""
    path = directory / REPORT_FILE
    try:
        written = path.stat().st_mtime
        raw = json.loads(path.read_text())
        report = Report(pid=int(raw["pid"]), problem=raw["problem"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0.0
    if report.problem is not None and not isinstance(report.problem, str):
        return None, 0.0
    return report, written
