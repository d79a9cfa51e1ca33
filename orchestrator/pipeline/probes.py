"""The orchestrator worker's ``/metrics``, ``/healthz`` and ``/readyz`` (9101).

``drainctl worker`` runs Celery's ``threads`` pool: one process, so its metrics are an
ordinary registry (``orchestrator.metrics.REGISTRY``), recorded by the tasks' threads and
served from a thread of the same process.

- ``/healthz``: the process answers (the HTTP thread runs in it);
- ``/readyz``: a connection to the broker can be made and the ledger answers a query;
  each probe opens its own, bounded by :data:`PROBE_TIMEOUT_SECS`.

Queue wait is recorded on ``task_prerun`` for every task this worker starts.
"""

from __future__ import annotations

from typing import Any, Final

from celery import Celery
from celery.signals import task_prerun

from orchestrator import metrics
from orchestrator.ledger import Ledger
from worker_agent.metrics import MetricsServer, observe_queue_wait, serve

PROBE_TIMEOUT_SECS: Final = 2.0


def _queue_wait(task: Any = None, **_: Any) -> None:
    if task is not None:
        observe_queue_wait(metrics.QUEUE_WAIT, task)


def broker_problem(app: Celery) -> str | None:
    try:
        with app.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1, timeout=PROBE_TIMEOUT_SECS)  # type: ignore[arg-type]
    except Exception as exc:  # any failure to connect: not ready
        return f"the broker is unreachable: {type(exc).__name__}: {exc}"
    return None


def ledger_problem(ledger: Ledger) -> str | None:
    try:
        ledger.get_operation("readyz-probe")
    except Exception as exc:  # any failure to query: not ready
        return f"the ledger is unreachable: {type(exc).__name__}"
    return None


def serve_worker(app: Celery, ledger: Ledger, host: str, port: int) -> MetricsServer | None:
    """Count outcomes and queue waits in this process and serve them (port 0: only count)."""
    metrics.count_outcomes()
    task_prerun.connect(_queue_wait, weak=False)
    if not port:
        return None

    def readyz() -> str | None:
        return broker_problem(app) or ledger_problem(ledger)

    return serve(
        host, port, metrics.REGISTRY, {"/healthz": lambda: None, "/readyz": readyz}, "worker"
    )
