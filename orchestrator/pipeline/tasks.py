"""Orchestrator-side Celery tasks, run by ``drainctl worker`` on queue ``orchestrator``.

They are the second half of each chain (``record_checkpoint`` after a daemon's drain,
``record_resume`` after its resume) and the intake of daemon heartbeats. Every one is
idempotent by the lifecycle operation id: the ledger's ``record_checkpoint`` answers the
existing checkpoint for an operation that already has one, so a redelivered message
never creates a second. Database outages are retried with backoff; a transaction
either records a whole checkpoint or nothing.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, TypeVar

from celery import Task
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.exc import DBAPIError, OperationalError

from orchestrator import metrics
from orchestrator.ledger import (
    CheckpointReason,
    Ledger,
    LedgerConflict,
    OperationKind,
    OperationState,
    OperationView,
    OtherTask,
    other_task,
)
from orchestrator.pipeline.app import ACTIVITY, RECORD_CHECKPOINT, RECORD_RESUME, app
from orchestrator.settings import get_settings
from worker_agent import signing
from worker_agent.contract import (
    ActivityReport,
    DrainResult,
    JsonObject,
    Payload,
    ResumeResult,
    malformed,
)

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)

DB_ERRORS = (OperationalError, DBAPIError)
DB_BACKOFF_MAX_SECS = 15


def db_max_retries(retry_window_secs: float) -> int:
    """Backoff 1, 2, 4, 8, then 15 s: a ledger outage (a PostgreSQL restart) is waited out
    for ``retry_window_secs`` (``DRAIN_DB_RETRY_WINDOW_SECS``) before a task gives up,
    which the record deadline covers."""
    return 4 + int((retry_window_secs - 15) // DB_BACKOFF_MAX_SECS)


class LedgerTask(Task):  # type: ignore[type-arg]
    """The base of every task that writes the ledger: retried through a ledger outage
    with a backoff, for as long as the settings say (read when the worker registers the
    task, not when this module is imported)."""

    autoretry_for = DB_ERRORS
    retry_backoff = 1
    retry_backoff_max = DB_BACKOFF_MAX_SECS
    retry_jitter = False

    def __init__(self) -> None:
        self.max_retries = db_max_retries(get_settings().db_retry_window_secs)


@lru_cache(maxsize=1)
def get_ledger() -> Ledger:
    return Ledger.from_url(get_settings().database_url)


# ------------------------------------------------------------- orchestrator payloads


class RecordCheckpointArgs(Payload):
    """kwargs of ``record_checkpoint`` (sent by ``pipeline.start``; the drain result
    comes first, as the chain's argument)."""

    model_config = ConfigDict(strict=False)  # the reason arrives as its JSON string
    op_id: str = Field(min_length=1)
    reason: CheckpointReason
    pvc_name: str | None = None


class RecordResumeArgs(Payload):
    """kwargs of ``record_resume``."""

    op_id: str = Field(min_length=1)


class RecordCheckpointOutcome(Payload):
    """What ``record_checkpoint`` answers (Flower and ``AsyncResult`` show it)."""

    op_id: str
    checkpoint_ref: str | None
    agents: int | None = None
    error: str | None = None


class RecordResumeOutcome(Payload):
    """What ``record_resume`` answers."""

    op_id: str
    state: OperationState | None
    failed: int | None = None
    error: str | None = None


def _received(model: type[_M], payload: object, what: str) -> _M | str:
    """``payload`` validated as ``model``, or the reason it is not one."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        return malformed(what, exc)


def _fail(ledger: Ledger, op_id: str, error: str) -> None:
    """Fail the operation with ``error`` unless it has finished already."""
    try:
        ledger.transition(op_id, OperationState.FAILED, error=error)
    except LedgerConflict as exc:
        log.warning("failure_after_terminal op=%s detail=%s", op_id, exc)


class Unproven(enum.StrEnum):
    """Why a daemon-side message does not prove that the task it is for sent it."""

    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad-signature"
    UNKNOWN_OPERATION = "unknown-operation"
    OTHER_TASK = "other-task"
    """Signed for another task uid, or another operation, than the one it answers."""


_said: set[tuple[str, str, Unproven]] = set()
"""What was refused and logged already (``refuse``), so a flood logs once per sender."""


def unproven(body: object, namespace: str, name: str, bound_uid: str | None) -> Unproven | None:
    """Why ``body`` is not proven to come from the daemon of task ``namespace/name`` (the
    ledger's, never the body's), or None: it is, or this orchestrator signs nothing
    (``DRAIN_MESSAGE_KEY`` unset). ``bound_uid`` is the uid the ledger bound the
    operation to; without one, the uid the signed body names selects the task's key,
    which only that task's daemon holds."""
    key = get_settings().message_key_bytes
    if key is None:
        return None
    if not isinstance(body, dict) or not isinstance(body.get(signing.SIGNATURE), str):
        return Unproven.UNSIGNED
    claimed = body.get("task_uid")
    if bound_uid is not None and claimed != bound_uid:
        return Unproven.OTHER_TASK
    if not isinstance(claimed, str) or not claimed:
        return Unproven.UNSIGNED  # no uid to find the task's key by
    if not signing.signed_by(signing.task_key(key, namespace, name, claimed), body):
        return Unproven.BAD_SIGNATURE
    return None


def refuse(kind: str, subject: str, reason: Unproven) -> None:
    """Count a refused message, and log the first of its kind and subject."""
    metrics.UNPROVEN_MESSAGES.labels(kind=kind, reason=reason.value).inc()
    if (kind, subject, reason) not in _said:
        if len(_said) < 10_000:
            _said.add((kind, subject, reason))
        log.warning("message_refused kind=%s subject=%s reason=%s", kind, subject, reason)


def _bound_uid(op: OperationView) -> str | None:
    """The Kubernetes uid ``op`` was begun for; None for a ``namespace/name`` stand-in."""
    return None if "/" in op.task_uid else op.task_uid


def _proof_of(op: OperationView | None, op_id: str, body: object, kind: str) -> Unproven | None:
    """Why a result for operation ``op_id`` (``op`` as the ledger has it) is refused."""
    if get_settings().message_key_bytes is None:
        return None
    if op is None:
        reason: Unproven | None = Unproven.UNKNOWN_OPERATION
    elif isinstance(body, dict) and body.get("op_id") != op_id:
        reason = Unproven.OTHER_TASK
    else:
        reason = unproven(body, op.namespace, op.name, _bound_uid(op))
    if reason is not None:
        refuse(kind, op_id, reason)
    return reason


# --------------------------------------------------------------------------- tasks


@app.task(
    name=RECORD_CHECKPOINT,
    bind=True,
    base=LedgerTask,
)
def record_checkpoint(
    self: Task[Any, Any], /, drain_result: object, **kwargs: object
) -> JsonObject:
    """Write the drained refs as one checkpoint and mark the operation recorded.

    Both inputs are validated here, where they are received: a malformed drain result
    fails the operation with the reason (never a crash loop); malformed kwargs, which
    only a mismatched orchestrator sends, are logged and dropped (there may be no
    operation id to fail)."""
    args = _received(RecordCheckpointArgs, kwargs, "record_checkpoint kwargs")
    if isinstance(args, str):
        log.error("record_checkpoint_refused reason=%s", args)
        return RecordCheckpointOutcome(
            op_id=str(kwargs.get("op_id", "")), checkpoint_ref=None, error=args
        ).model_dump(mode="json")
    ledger = get_ledger()
    if get_settings().message_key is not None:
        # Proven first (one read more on each drain's path, where messages are signed);
        # recorded with what the orchestrator kept when it began the operation, not with
        # what came back through the daemon's side.
        op = ledger.get_operation(args.op_id)
        if (refused := _proof_of(op, args.op_id, drain_result, "drain-result")) is not None:
            return RecordCheckpointOutcome(
                op_id=args.op_id, checkpoint_ref=None, error=f"refused: {refused}"
            ).model_dump(mode="json")
        if op is not None and (kept := (op.detail or {}).get("record")):
            args = RecordCheckpointArgs.model_validate({**kept, "op_id": op.id})
    result = _received(DrainResult, drain_result, "drain result from the daemon")
    error = result if isinstance(result, str) else result.error
    if error is not None:
        _fail(ledger, args.op_id, f"drain failed: {error}")
        return RecordCheckpointOutcome(
            op_id=args.op_id, checkpoint_ref=None, error=error
        ).model_dump(mode="json")
    assert not isinstance(result, str)
    # One transaction takes the operation from pending/draining (or drained, left so by
    # the sweeper) straight to recorded with its checkpoint; a redelivery is answered
    # with the checkpoint already recorded. No separate ``drained`` write: it would be a
    # second commit on every drain's path, and nothing reads it in between.
    try:
        checkpoint = ledger.record_checkpoint(
            args.op_id,
            result.refs,
            reason=args.reason,
            pvc_name=args.pvc_name,
            answered_by=result.task_uid,
        )
    except OtherTask as exc:
        _fail(ledger, args.op_id, str(exc))
        return RecordCheckpointOutcome(
            op_id=args.op_id, checkpoint_ref=None, error=str(exc)
        ).model_dump(mode="json")
    except ValueError as exc:
        # Refs the model accepted but the ledger cannot hold (a session dir outside the PVC).
        _fail(ledger, args.op_id, f"drain result not recordable: {exc}")
        return RecordCheckpointOutcome(
            op_id=args.op_id, checkpoint_ref=None, error=str(exc)
        ).model_dump(mode="json")
    except LedgerConflict as exc:
        log.warning("checkpoint_not_recorded op=%s reason=%s", args.op_id, exc)
        return RecordCheckpointOutcome(
            op_id=args.op_id, checkpoint_ref=None, error=str(exc)
        ).model_dump(mode="json")
    log.info(
        "checkpoint_recorded op=%s ref=%s agents=%d verified=%s",
        args.op_id,
        checkpoint.ref,
        len(checkpoint.agents),
        checkpoint.verified,
    )
    return RecordCheckpointOutcome(
        op_id=args.op_id, checkpoint_ref=checkpoint.ref, agents=len(checkpoint.agents)
    ).model_dump(mode="json")


@app.task(
    name=RECORD_RESUME,
    bind=True,
    base=LedgerTask,
)
def record_resume(self: Task[Any, Any], /, resume_result: object, **kwargs: object) -> JsonObject:
    """Close a resume operation: ``resumed`` if any agent came back, else ``failed``."""
    args = _received(RecordResumeArgs, kwargs, "record_resume kwargs")
    if isinstance(args, str):
        log.error("record_resume_refused reason=%s", args)
        return RecordResumeOutcome(
            op_id=str(kwargs.get("op_id", "")), state=None, error=args
        ).model_dump(mode="json")
    ledger = get_ledger()
    if get_settings().message_key is not None:
        op = ledger.get_operation(args.op_id)
        if (refused := _proof_of(op, args.op_id, resume_result, "resume-result")) is not None:
            return RecordResumeOutcome(
                op_id=args.op_id, state=None, error=f"refused: {refused}"
            ).model_dump(mode="json")
    result = _received(ResumeResult, resume_result, "resume result from the daemon")
    if isinstance(result, str):
        _fail(ledger, args.op_id, result)
        return RecordResumeOutcome(op_id=args.op_id, state=None, error=result).model_dump(
            mode="json"
        )
    failures = [r for r in result.results if not r.ok]
    summary = "; ".join(f"{r.id}: {r.error}" for r in failures) or None
    if result.error:
        summary = f"{result.error}; {summary}" if summary else result.error
    # Resumed if the daemon answered and at least one agent (or the empty set) came back.
    every_agent_failed = bool(result.results) and len(failures) == len(result.results)
    state = OperationState.FAILED if result.error or every_agent_failed else OperationState.RESUMED
    detail = {"results": [r.model_dump(mode="json") for r in result.results]}
    try:
        view = ledger.transition(args.op_id, state, detail=detail, error=summary)
    except LedgerConflict as exc:
        log.warning("resume_not_recorded op=%s reason=%s", args.op_id, exc)
        return RecordResumeOutcome(op_id=args.op_id, state=None, error=str(exc)).model_dump(
            mode="json"
        )
    log.info("resume_recorded op=%s state=%s failed=%d", args.op_id, view.state, len(failures))
    return RecordResumeOutcome(op_id=args.op_id, state=view.state, failed=len(failures)).model_dump(
        mode="json"
    )


@app.task(
    name=ACTIVITY,
    bind=False,
    base=LedgerTask,
    # A heartbeat is most of the worker's messages and its record is the ledger's row:
    # no result stored (each one was kept a week, two writes to the backend), no task
    # events (three more publishes). Under a burst on 2 cores that overhead let the
    # heartbeats fall a minute behind, expire, and healthy daemons look silent.
    ignore_result=True,
    send_events=False,
)
def activity(**kwargs: object) -> None:
    """Keep the latest heartbeat per daemon (an older one never overwrites a newer),
    stamped with this worker's clock when it arrived: the operator bridges the time since
    then (bounded, ``lifecycle.idle_secs``) onto the daemon's monotonic ``idle_for_secs``.

    A malformed heartbeat is logged and dropped: the next one replaces it."""
    report = _received(ActivityReport, kwargs, "activity heartbeat")
    if isinstance(report, str):
        log.error("activity_refused reason=%s", report)
        return
    if (refused := unproven(kwargs, report.namespace, report.name, None)) is not None:
        refuse("heartbeat", f"{report.namespace}/{report.name}", refused)
        return
    received_at = datetime.now(UTC)
    try:
        get_ledger().record_activity(
            report.namespace,
            report.name,
            task_uid=report.task_uid,
            all_idle_since=_utc(report.all_idle_since),
            agents_total=report.agents_total,
            agents_live=report.agents_live,
            agents_idle=report.agents_idle,
            agents_interrupted=report.agents_interrupted,
            agents_done=report.agents_done,
            seq=report.seq,
            reported_at=_utc(report.reported_at) or received_at,
            idle_for_secs=report.idle_for_secs,
            received_at=received_at,
        )
    except ValueError as exc:  # counts that contradict each other, names too long
        log.error("activity_refused task=%s/%s reason=%s", report.namespace, report.name, exc)


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


class StoredDrain(enum.Enum):
    """What the result backend says of an operation's drain task when it is overdue."""

    NOT_FINISHED = "not-finished"
    UNKNOWN = "unknown"
    """The backend could not be asked (a broker outage): decide at the next sweep."""


def stored_drain_result(op: OperationView) -> DrainResult | StoredDrain:
    """The daemon's drain result as the result backend kept it, if the drain finished
    (and, where messages are signed, its task signed it)."""
    try:
        stored = app.AsyncResult(f"{op.id}.drain")
        if stored.state != "SUCCESS":
            return StoredDrain.NOT_FINISHED
        value = stored.result
    except Exception as exc:  # any backend failure means "ask again later"
        log.warning("stored_result_unreadable op=%s error=%s", op.id, exc)
        return StoredDrain.UNKNOWN
    if _proof_of(op, op.id, value, "drain-result") is not None:
        return StoredDrain.NOT_FINISHED
    try:
        return DrainResult.model_validate(value)
    except ValidationError:
        return StoredDrain.NOT_FINISHED


def sweep_overdue(
    ledger: Ledger,
    now: datetime | None = None,
    stored_drain: Callable[[OperationView], DrainResult | StoredDrain] = stored_drain_result,
) -> list[str]:
    """Close every operation past its deadline; answer the ids of those it failed.

    A drain whose daemon answered but whose ``record_checkpoint`` never arrived (its
    message lost with a broker restart) is not failed: the daemon's refs are in the
    result backend, and the checkpoint is recorded from them. An operation whose agents
    were drained is never failed for want of a record.
    """
    failed = []
    for op in ledger.overdue_operations(now or datetime.now(UTC)):
        if op.kind.records_checkpoint:
            found = stored_drain(op)
            if found is StoredDrain.UNKNOWN:
                continue
            recovered = isinstance(found, DrainResult) and found.error is None
            if recovered and _record_from_stored(ledger, op, found):  # type: ignore[arg-type]
                continue
        view = ledger.expire_operation(op.id, _overdue_reason(op))
        if view.state is OperationState.FAILED:
            failed.append(op.id)
            log.warning(
                "operation_expired op=%s kind=%s task=%s/%s", op.id, op.kind, op.namespace, op.name
            )
    return failed


_REASON_OF_KIND = {
    OperationKind.DELETE_DRAIN: CheckpointReason.DELETE,
    OperationKind.PAUSE: CheckpointReason.PAUSE,
    OperationKind.SCALE_DOWN: CheckpointReason.SCALE_DOWN,
    OperationKind.COMPLETE: CheckpointReason.COMPLETED,
}


def _record_from_stored(ledger: Ledger, op: OperationView, result: DrainResult) -> bool:
    if (refused := other_task(op.id, op.task_uid, result.task_uid)) is not None:
        log.warning("checkpoint_not_recovered op=%s reason=%s", op.id, refused)
        return False
    kept = (op.detail or {}).get("record") or {}
    try:
        args = RecordCheckpointArgs.model_validate({**kept, "op_id": op.id})
    except ValidationError:
        args = RecordCheckpointArgs(
            op_id=op.id, reason=_REASON_OF_KIND.get(op.kind, CheckpointReason.MANUAL)
        )
    with contextlib.suppress(LedgerConflict):
        ledger.transition(
            op.id, OperationState.DRAINED, expect=(OperationState.PENDING, OperationState.DRAINING)
        )
    try:
        checkpoint = ledger.record_checkpoint(
            op.id,
            result.refs,
            reason=args.reason,
            pvc_name=args.pvc_name,
            answered_by=result.task_uid,
        )
    except (LedgerConflict, ValueError) as exc:
        log.warning("checkpoint_not_recovered op=%s reason=%s", op.id, exc)
        return False
    log.warning(
        "checkpoint_recorded_by_sweeper op=%s ref=%s agents=%d: its record message was lost",
        op.id,
        checkpoint.ref,
        len(checkpoint.agents),
    )
    return True


def _overdue_reason(op: OperationView) -> str:
    if op.state is OperationState.DRAINED:
        return (
            f"deadline passed in state drained: the daemon of {op.namespace}/{op.name} "
            "drained its agents but the checkpoint was not recorded in time"
        )
    return (
        f"deadline passed in state {op.state}: the daemon of {op.namespace}/{op.name} did "
        "not answer (its message expires unrun) or the broker lost the chain"
    )
