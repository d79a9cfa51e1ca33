"""Starting lifecycle operations: a ledger row first, then the Celery chain.

The operator and ``drainctl drain|resume`` both come through here. The order is what
makes a crash anywhere harmless: the operation row (unique by idempotency key) is
written first, the chain is sent, and only then is the row moved to ``draining`` /
``resuming``. Sending twice is safe (the daemon answers a repeated drain from its
journal; the ledger records one checkpoint per operation); never sending is caught by
the deadline sweeper, which fails the operation with the reason.

``start_drains`` does the same for many tasks at once, each step once for all of them
(one ledger transaction, the chains published concurrently, one transaction to
``draining``): a fan-out costs three steps, not three per task. ``wait_for_operations``
follows many with one ledger read per poll.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery, chain

from orchestrator.ledger import (
    CheckpointReason,
    Ledger,
    LedgerConflict,
    NewOperation,
    OperationKind,
    OperationMove,
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


@dataclass(frozen=True, slots=True)
class DrainStart:
    """One drain for ``start_drains``: ``start_drain``'s arguments."""

    namespace: str
    name: str
    task_uid: str | None = None
    grace_secs: float | None = None
    kind: OperationKind = OperationKind.DRAIN
    reason: CheckpointReason = CheckpointReason.MANUAL
    pvc_name: str | None = None
    idempotency_key: str | None = None
    keep_agents: int | None = None


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
    drain = DrainStart(
        namespace,
        name,
        task_uid=task_uid,
        grace_secs=grace_secs,
        kind=kind,
        reason=reason,
        pvc_name=pvc_name,
        idempotency_key=idempotency_key,
        keep_agents=keep_agents,
    )
    return start_drains(app, ledger, settings, [drain])[0]


def start_drains(
    app: Celery, ledger: Ledger, settings: Settings, drains: Sequence[DrainStart]
) -> list[OperationView]:
    """``start_drain`` for many tasks at once, in the same order (ledger rows, then the
    chains, then ``draining``) but one step for all of them: one ledger transaction
    begins every operation, one producer sends every chain, one transaction moves them
    to ``draining``. Answers each drain's operation, in the order of ``drains``.

    Every name is checked before anything is written, so a bad one starts nothing. A
    drain whose key names an operation already sent is answered as it is, not sent
    again; one still ``pending`` (its caller died before sending) is sent."""
    queues = [daemon_queue(d.namespace, d.name) for d in drains]
    graces = [settings.default_grace_secs if d.grace_secs is None else d.grace_secs for d in drains]
    ops = ledger.begin_operations(
        [
            _new_operation(
                d.kind,
                d.namespace,
                d.name,
                d.task_uid,
                d.idempotency_key,
                within_secs=settings.drain_expires_secs + grace + settings.record_deadline_secs,
                grace_secs=grace,
            )
            for d, grace in zip(drains, graces, strict=True)
        ]
    )
    sends: dict[str, Callable[[], OperationMove]] = {}
    for drain, queue, grace, op in zip(drains, queues, graces, ops, strict=True):
        if op.state is not OperationState.PENDING or op.id in sends:
            continue  # already started by an earlier call (or earlier in this one)
        sends[op.id] = functools.partial(_send_drain, app, settings, drain, queue, grace, op.id)
    sent, failure = _send_all(list(sends.values()), settings.send_concurrency)
    moved = (
        ledger.advance_operations(sent, OperationState.DRAINING, expect=(OperationState.PENDING,))
        if sent
        else []
    )
    if failure is not None:
        # The ones sent are draining; the others stay pending, and a call with their
        # keys sends them.
        raise failure
    now = {op.id: op for op in moved}
    return [now.get(op.id, op) for op in ops]


def _send_all(
    sends: list[Callable[[], OperationMove]], concurrency: int
) -> tuple[list[OperationMove], Exception | None]:
    """Run every send, up to ``concurrency`` at once (each thread publishes through its
    own pooled broker connection and result backend: Celery keeps those per thread);
    answer what was sent and the first failure, if any."""
    if len(sends) <= 1 or concurrency <= 1:
        outcomes = [_attempt(send) for send in sends]
    else:
        workers = min(concurrency, len(sends))
        with ThreadPoolExecutor(workers, thread_name_prefix="caliban-send") as pool:
            outcomes = list(pool.map(_attempt, sends))
    sent = [o for o in outcomes if isinstance(o, OperationMove)]
    failures = [o for o in outcomes if isinstance(o, Exception)]
    return sent, failures[0] if failures else None


def _attempt(send: Callable[[], OperationMove]) -> OperationMove | Exception:
    try:
        return send()
    except Exception as exc:  # the broker refused or is gone: the caller re-raises it
        return exc


def _send_drain(
    app: Celery,
    settings: Settings,
    drain: DrainStart,
    queue: str,
    grace: float,
    op_id: str,
) -> OperationMove:
    """Send one drain → record chain; answer what ``draining``
    records with it."""
    request: DrainRequest | ScaleDownRequest = DrainRequest(
        op_id=op_id, grace_secs=grace, task_uid=drain.task_uid
    )
    if drain.keep_agents is not None:
        request = ScaleDownRequest(
            op_id=op_id, agents=drain.keep_agents, grace_secs=grace, task_uid=drain.task_uid
        )
    first = app.signature(
        DAEMON_DRAIN if drain.keep_agents is None else DAEMON_SCALE_DOWN,
        kwargs=request.model_dump(mode="json"),
        queue=queue,
        expires=settings.drain_expires_secs,
    ).set(task_id=f"{op_id}.drain")
    record_args = RecordCheckpointArgs(op_id=op_id, reason=drain.reason, pvc_name=drain.pvc_name)
    record = app.signature(
        RECORD_CHECKPOINT,
        kwargs=record_args.model_dump(mode="json"),
        queue=ORCHESTRATOR_QUEUE,
    ).set(task_id=f"{op_id}.record")
    chain(first, record).apply_async()
    # The record's arguments are kept on the operation too, so that the deadline sweeper
    # can record the checkpoint from the drain's stored result if the record message
    # itself never arrives (``tasks.sweep_overdue``).
    return OperationMove(
        op_id,
        celery_task_ids={"drain": f"{op_id}.drain", "record": f"{op_id}.record"},
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
        ledger,
        kind,
        namespace,
        name,
        task_uid,
        idempotency_key,
        within_secs=settings.resume_expires_secs + settings.record_deadline_secs,
        checkpoint_ref=checkpoint_ref,
    )
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
                id=a.agent_id,
                session_dir=a.session_dir,
                turns=a.turns,
                session_sha256=a.session_sha256,
            )
            for a in checkpoint.agents
        ]
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
        ledger,
        OperationKind.SCALE_UP,
        namespace,
        name,
        task_uid,
        idempotency_key,
        within_secs=settings.resume_expires_secs + settings.record_deadline_secs,
        checkpoint_ref=checkpoint_ref,
    )
    if op.state is not OperationState.PENDING:
        return op
    request = ScaleUpRequest(
        op_id=op.id,
        agents=agents,
        provider=provider,
        model=model,
        prompt=prompt,
        task_uid=task_uid,
    )
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
        task,
        kwargs=request.model_dump(mode="json"),
        queue=queue,
        expires=settings.resume_expires_secs,
    ).set(task_id=f"{op.id}.resume")
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
    return ledger.begin_operations(
        [
            _new_operation(
                kind,
                namespace,
                name,
                task_uid,
                idempotency_key,
                within_secs=within_secs,
                grace_secs=grace_secs,
                checkpoint_ref=checkpoint_ref,
            )
        ]
    )[0]


def _new_operation(
    kind: OperationKind,
    namespace: str,
    name: str,
    task_uid: str | None,
    idempotency_key: str | None,
    *,
    within_secs: float,
    grace_secs: float | None = None,
    checkpoint_ref: str | None = None,
) -> NewOperation:
    return NewOperation(
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
            op.id,
            state,
            expect=(OperationState.PENDING,),
            celery_task_ids=celery_ids,
            detail=detail,
        )
    except LedgerConflict:
        # The chain already finished (or the sweeper failed it): the row is further on.
        current = ledger.get_operation(op.id)
        assert current is not None
        return current


WAIT_POLL_SECS = 0.005
"""How often ``wait_for_operation`` reads the ledger while an operation is young: a
chain takes tens of milliseconds, and a read of one row well under one."""
WAIT_FAST_SECS = 2.0
"""For this long the poll stays at its first interval; then it backs off to 0.2 s."""


def wait_for_operation(ledger: Ledger, op_id: str, timeout: float) -> OperationView:
    """Poll the ledger until the operation is terminal or ``timeout`` passes."""
    return wait_for_operations(ledger, [op_id], timeout)[0]


def wait_for_operations(
    ledger: Ledger, op_ids: Sequence[str], timeout: float, *, poll_secs: float = WAIT_POLL_SECS
) -> list[OperationView]:
    """Poll the ledger, one read for all of them, until every operation of ``op_ids`` is
    terminal or ``timeout`` passes; answer each as last read, in the order given.

    The poll stays at ``poll_secs`` for the first ``WAIT_FAST_SECS`` (what a caller
    waits on is most often a chain of a fraction of a second, and a coarser poll would
    add most of an interval to it), then backs off to 0.2 s."""
    started = time.monotonic()
    views: dict[str, OperationView] = {}
    waiting = list(dict.fromkeys(op_ids))
    interval = poll_secs
    while True:
        found = ledger.get_operations(waiting)
        for op_id in waiting:
            if op_id not in found:
                raise LookupError(f"operation {op_id} is not in the ledger")
        views.update(found)
        waiting = [op_id for op_id in waiting if not found[op_id].state.terminal]
        elapsed = time.monotonic() - started
        if not waiting or elapsed > timeout:
            return [views[op_id] for op_id in op_ids]
        time.sleep(interval)
        if elapsed > WAIT_FAST_SECS:
            interval = min(max(interval, 0.01) * 1.5, 0.2)
