"""Orchestrator-side Celery tasks, run by ``drainctl worker`` on queue ``orchestrator``.

They are the second half of each chain (``record_checkpoint`` after a daemon's drain,
``record_resume`` after its resume) and the intake of daemon heartbeats. Every one is
idempotent by the lifecycle operation id: the ledger's ``record_checkpoint`` answers the
existing checkpoint for an operation that already has one, so a redelivered message
never creates a second. Database outages are retried with backoff; a transaction
either records a whole checkpoint or nothing.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from celery import Task
from sqlalchemy.exc import DBAPIError, OperationalError

from orchestrator.ledger import Ledger, LedgerConflict
from orchestrator.pipeline.app import ACTIVITY, RECORD_CHECKPOINT, RECORD_RESUME, app
from orchestrator.settings import get_settings

log = logging.getLogger(__name__)

DB_ERRORS = (OperationalError, DBAPIError)
DB_MAX_RETRIES = 60
"""With backoff capped at 15 s, a ledger outage (a PostgreSQL restart) is waited out
for about a quarter of an hour before a task gives up."""


@lru_cache(maxsize=1)
def get_ledger() -> Ledger:
    return Ledger.from_url(get_settings().database_url)


@app.task(
    name=RECORD_CHECKPOINT,
    bind=True,
    autoretry_for=DB_ERRORS,
    retry_backoff=1,
    retry_backoff_max=15,
    retry_jitter=False,
    max_retries=DB_MAX_RETRIES,
)
def record_checkpoint(
    self: Task[Any, Any],
    drain_result: dict[str, Any],
    op_id: str,
    reason: str,
    pvc_name: str | None = None,
) -> dict[str, Any]:
    """Write the drained refs as one checkpoint and mark the operation recorded."""
    ledger = get_ledger()
    error = drain_result.get("error")
    if error:
        try:
            ledger.transition(op_id, "failed", error=f"drain failed: {error}")
        except LedgerConflict as exc:
            log.warning("drain_failure_after_terminal op=%s detail=%s", op_id, exc)
        return {"op_id": op_id, "checkpoint_ref": None, "error": error}
    try:
        checkpoint = ledger.record_checkpoint(
            op_id, drain_result.get("refs", []), reason=reason, pvc_name=pvc_name
        )
    except LedgerConflict as exc:
        log.warning("checkpoint_not_recorded op=%s reason=%s", op_id, exc)
        return {"op_id": op_id, "checkpoint_ref": None, "error": str(exc)}
    log.info(
        "checkpoint_recorded op=%s ref=%s agents=%d verified=%s",
        op_id, checkpoint.ref, len(checkpoint.agents), checkpoint.verified,
    )  # fmt: skip
    return {"op_id": op_id, "checkpoint_ref": checkpoint.ref, "agents": len(checkpoint.agents)}


@app.task(
    name=RECORD_RESUME,
    bind=True,
    autoretry_for=DB_ERRORS,
    retry_backoff=1,
    retry_backoff_max=15,
    retry_jitter=False,
    max_retries=DB_MAX_RETRIES,
)
def record_resume(
    self: Task[Any, Any], resume_result: dict[str, Any], op_id: str
) -> dict[str, Any]:
    """Close a resume operation: ``resumed`` if any agent came back, else ``failed``."""
    ledger = get_ledger()
    results: list[dict[str, Any]] = resume_result.get("results", [])
    failures = [r for r in results if not r.get("ok")]
    error = resume_result.get("error")
    summary = "; ".join(f"{r.get('id')}: {r.get('error')}" for r in failures) or None
    if error:
        summary = f"{error}; {summary}" if summary else error
    # Resumed if the daemon answered and at least one agent (or the empty set) came back.
    every_agent_failed = bool(results) and len(failures) == len(results)
    state = "failed" if error or every_agent_failed else "resumed"
    try:
        view = ledger.transition(op_id, state, detail={"results": results}, error=summary)
    except LedgerConflict as exc:
        log.warning("resume_not_recorded op=%s reason=%s", op_id, exc)
        return {"op_id": op_id, "state": None, "error": str(exc)}
    log.info("resume_recorded op=%s state=%s failed=%d", op_id, view.state, len(failures))
    return {"op_id": op_id, "state": view.state, "failed": len(failures)}


@app.task(
    name=ACTIVITY,
    bind=False,
    autoretry_for=DB_ERRORS,
    retry_backoff=1,
    retry_backoff_max=15,
    retry_jitter=False,
    max_retries=DB_MAX_RETRIES,
)
def activity(
    namespace: str,
    name: str,
    task_uid: str | None,
    seq: int,
    reported_at: float,
    agents_total: int,
    agents_live: int,
    agents_idle: int,
    all_idle_since: float | None,
) -> None:
    """Keep the latest heartbeat per daemon (an older one never overwrites a newer)."""
    get_ledger().record_activity(
        namespace,
        name,
        task_uid=task_uid,
        all_idle_since=_utc(all_idle_since),
        agents_total=agents_total,
        agents_live=agents_live,
        agents_idle=agents_idle,
        seq=seq,
        reported_at=_utc(reported_at) or datetime.now(UTC),
    )


def _utc(ts: float | None) -> datetime | None:
    return datetime.fromtimestamp(ts, UTC) if ts is not None else None


class DeadlineSweeper(threading.Thread):
    """Fails operations past their deadline, straight against the ledger, so an
    operation whose messages the broker lost (or whose daemon is gone and whose drain
    expired unrun) is reported instead of waiting forever."""

    def __init__(self, ledger: Ledger, interval: float) -> None:
        super().__init__(name="caliban-deadline-sweeper", daemon=True)
        self.ledger = ledger
        self.interval = interval
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                sweep_overdue(self.ledger)
            except (OperationalError, DBAPIError) as exc:
                log.warning("sweep_failed error=%s", exc)


def sweep_overdue(ledger: Ledger, now: datetime | None = None) -> list[str]:
    failed = []
    for op in ledger.overdue_operations(now or datetime.now(UTC)):
        reason = (
            f"deadline passed in state {op.state}: the daemon of {op.namespace}/{op.name} did "
            "not answer (its message expires unrun) or the broker lost the chain"
        )
        view = ledger.expire_operation(op.id, reason)
        if view.state == "failed":
            failed.append(op.id)
            log.warning(
                "operation_expired op=%s kind=%s task=%s/%s", op.id, op.kind, op.namespace, op.name
            )
    return failed
