"""Starting lifecycle operations: a ledger row first, then the Celery chain.

The operator and ``drainctl drain|resume`` both come through here. The order is what
makes a crash anywhere harmless: the operation row (unique by idempotency key) is
written first, the chain is sent, and only then is the row moved to ``draining`` /
``resuming``. Sending twice is safe (the daemon answers a repeated drain from its
journal; the ledger records one checkpoint per operation); never sending is caught by
the deadline sweeper, which fails the operation with the reason.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery, chain

from orchestrator.ledger import (
    CheckpointReason,
    Ledger,
    LedgerConflict,
    OperationKind,
    OperationState,
    OperationView,
)
from orchestrator.pipeline.tasks import RecordCheckpointArgs, RecordResumeArgs
from orchestrator.settings import Settings
from worker_agent.contract import (
    DAEMON_DRAIN,
    DAEMON_RESUME,
    DAEMON_SCALE_DOWN,
    DAEMON_SCALE_UP,
    ORCHESTRATOR_QUEUE,
    RECORD_CHECKPOINT,
    RECORD_RESUME,
    DrainRequest,
    ResumeAgent,
    ResumeRequest,
    ScaleDownRequest,
    ScaleUpRequest,
    daemon_queue,
)


def start_drain(
    app: Celery,
    ledger: Ledger,
    settings: Settings,
    *,
    namespace: str,
    name: str,
    task_uid: str | None = None,
    grace_secs: float | None = None,
    kind: OperationKind = OperationKind.DRAIN,
    reason: CheckpointReason = CheckpointReason.MANUAL,
    pvc_name: str | None = None,
    idempotency_key: str | None = None,
    keep_agents: int | None = None,
) -> OperationView:
    """Enqueue drain (daemon queue) → record_checkpoint (orchestrator queue).

    With ``keep_agents`` (a scale-down), the daemon keeps that many of its agents and
    drains only the others (``caliban.daemon.scale_down``), whose refs are the
    checkpoint."""
    queue = daemon_queue(namespace, name)
    grace = settings.default_grace_secs if grace_secs is None else grace_secs
    op = _begin(
        ledger, kind, namespace, name, task_uid, idempotency_key,
        within_secs=settings.drain_expires_secs + grace + settings.record_deadline_secs,
        grace_secs=grace,
    )  # fmt: skip
    if op.state is not OperationState.PENDING:
        return op  # already started by an earlier call with the same key
    request: DrainRequest | ScaleDownRequest = DrainRequest(
        op_id=op.id, grace_secs=grace, task_uid=task_uid
    )
    if keep_agents is not None:
        request = ScaleDownRequest(
            op_id=op.id, agents=keep_agents, grace_secs=grace, task_uid=task_uid
        )
    drain = app.signature(
        DAEMON_DRAIN if keep_agents is None else DAEMON_SCALE_DOWN,
        kwargs=request.model_dump(mode="json"),
        queue=queue,
        expires=settings.drain_expires_secs,
    ).set(task_id=f"{op.id}.drain")
    record = app.signature(
        RECORD_CHECKPOINT,
        kwargs=RecordCheckpointArgs(op_id=op.id, reason=reason, pvc_name=pvc_name).model_dump(
            mode="json"
        ),
        queue=ORCHESTRATOR_QUEUE,
    ).set(task_id=f"{op.id}.record")
    chain(drain, record).apply_async()
    # The record's arguments are kept on the operation too, so that the deadline sweeper
    # can record the checkpoint from the drain's stored result if the record message
    # itself never arrives (``tasks.sweep_overdue``).
    return _advance(
        ledger,
        op,
        OperationState.DRAINING,
        {"drain": f"{op.id}.drain", "record": f"{op.id}.record"},
        detail={"record": record.kwargs},
    )


def start_resume(
    app: Celery,
    ledger: Ledger,
    settings: Settings,
    *,
    namespace: str,
    name: str,
    checkpoint_ref: str | None,
    task_uid: str | None = None,
    kind: OperationKind = OperationKind.RESUME,
    idempotency_key: str | None = None,
    provider: str | None = None,
    model: str | None = None,
) -> OperationView:
    """Enqueue resume (daemon queue; waits there for the pod) → record_resume.

    ``provider``/``model``: the agents continue with these (a restore into a task whose
    spec names them) instead of the ones they were spawned with.

    ``checkpoint_ref=None`` resumes every agent the daemon's store holds (a daemon that
    restarted with agents no longer running, outside any pause)."""
    queue = daemon_queue(namespace, name)
    op = _begin(
        ledger, kind, namespace, name, task_uid, idempotency_key,
        within_secs=settings.resume_expires_secs + settings.record_deadline_secs,
        checkpoint_ref=checkpoint_ref,
    )  # fmt: skip
    if op.state is not OperationState.PENDING:
        return op
    agents: list[ResumeAgent] = []
    if checkpoint_ref is not None:
        checkpoint = ledger.get_checkpoint(checkpoint_ref)
        if checkpoint is None:
            return ledger.transition(
                op.id,
                OperationState.FAILED,
                error=f"unknown checkpoint ref {checkpoint_ref!r}: not in the ledger",
            )
        # The checkpoint's own turns and sha256 go along: a workspace that moved on since
        # (a newer checkpoint of it) is refused by the daemon, never resumed in its name.
        agents = [
            ResumeAgent(
                id=a.agent_id, session_dir=a.session_dir, turns=a.turns,
                session_sha256=a.session_sha256,
            )
            for a in checkpoint.agents
        ]  # fmt: skip
    request = ResumeRequest(
        op_id=op.id, agents=agents, task_uid=task_uid, provider=provider, model=model
    )
    return _send_to_resume(app, ledger, settings, op, queue, DAEMON_RESUME, request)


def start_scale_up(
    app: Celery,
    ledger: Ledger,
    settings: Settings,
    *,
    namespace: str,
    name: str,
    task_uid: str,
    agents: int,
    provider: str,
    model: str | None,
    prompt: str | None,
    idempotency_key: str,
    checkpoint_ref: str | None = None,
) -> OperationView:
    """Enqueue scale_up (daemon queue) → record_resume: the daemon brings the task to
    ``agents`` agents, resuming retired ones before it spawns new ones (with
    ``provider``, ``model`` and ``prompt``). ``checkpoint_ref``: the scale-down
    checkpoint whose retired agents it resumes, so the ledger says the workspace has
    moved on from it."""
    op = _begin(
        ledger, OperationKind.SCALE_UP, namespace, name, task_uid, idempotency_key,
        within_secs=settings.resume_expires_secs + settings.record_deadline_secs,
        checkpoint_ref=checkpoint_ref,
    )  # fmt: skip
    if op.state is not OperationState.PENDING:
        return op
    request = ScaleUpRequest(
        op_id=op.id, agents=agents, provider=provider, model=model, prompt=prompt,
        task_uid=task_uid,
    )  # fmt: skip
    queue = daemon_queue(namespace, name)
    return _send_to_resume(app, ledger, settings, op, queue, DAEMON_SCALE_UP, request)


def _send_to_resume(
    app: Celery,
    ledger: Ledger,
    settings: Settings,
    op: OperationView,
    queue: str,
    task: str,
    request: ResumeRequest | ScaleUpRequest,
) -> OperationView:
    """Send ``task`` (it waits in the daemon's queue for the pod) → ``record_resume``,
    then move the operation to ``resuming``."""
    resume = app.signature(
        task, kwargs=request.model_dump(mode="json"), queue=queue,
        expires=settings.resume_expires_secs,
    ).set(task_id=f"{op.id}.resume")  # fmt: skip
    record = app.signature(
        RECORD_RESUME,
        kwargs=RecordResumeArgs(op_id=op.id).model_dump(mode="json"),
        queue=ORCHESTRATOR_QUEUE,
    ).set(task_id=f"{op.id}.record")
    chain(resume, record).apply_async()
    return _advance(
        ledger,
        op,
        OperationState.RESUMING,
        {"resume": f"{op.id}.resume", "record": f"{op.id}.record"},
    )


def _begin(
    ledger: Ledger,
    kind: OperationKind,
    namespace: str,
    name: str,
    task_uid: str | None,
    idempotency_key: str | None,
    *,
    within_secs: float,
    grace_secs: float | None = None,
    checkpoint_ref: str | None = None,
) -> OperationView:
    """The operation's ledger row, due within ``within_secs`` (the sweeper's deadline)."""
    return ledger.begin_operation(
        kind,
        task_uid=task_uid or f"{namespace}/{name}",
        namespace=namespace,
        name=name,
        idempotency_key=idempotency_key or f"{kind}:{namespace}/{name}:{time.time_ns()}",
        grace_secs=grace_secs,
        checkpoint_ref=checkpoint_ref,
        deadline_at=datetime.now(UTC) + timedelta(seconds=within_secs),
    )


def _advance(
    ledger: Ledger,
    op: OperationView,
    state: OperationState,
    celery_ids: dict[str, str],
    detail: dict[str, Any] | None = None,
) -> OperationView:
    try:
        return ledger.transition(
            op.id, state, expect=(OperationState.PENDING,), celery_task_ids=celery_ids,
            detail=detail,
        )  # fmt: skip
    except LedgerConflict:
        # The chain already finished (or the sweeper failed it): the row is further on.
        current = ledger.get_operation(op.id)
        assert current is not None
        return current


def wait_for_operation(ledger: Ledger, op_id: str, timeout: float) -> OperationView:
    """Poll the ledger until the operation is terminal or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    interval = 0.01  # most operations finish in a fraction of a second
    while True:
        op = ledger.get_operation(op_id)
        if op is None:
            raise LookupError(f"operation {op_id} is not in the ledger")
        if op.state.terminal or time.monotonic() > deadline:
            return op
        time.sleep(interval)
        interval = min(interval * 1.5, 0.2)
