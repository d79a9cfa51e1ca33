"""One pass over one CalibanTask, as the concern modules share it: the object read
once, the status patch the pass writes, what it learnt (the heartbeat, how it left the
task), and the reads every concern makes (the last operation, the daemon's heartbeat,
the recovery history). ``reconcile`` runs the pass; ``provisioning``, ``running``,
``recovery``, ``scaling``, ``suspended``, ``completion``, ``restore`` and ``snapshots``
are its steps, each a function of a ``TaskPass``; the drain finalizer makes one too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, Unpack

import kopf

from orchestrator.ledger import (
    ActivityView,
    CheckpointReason,
    OperationKind,
    OperationState,
    OperationView,
)
from orchestrator.operator import blocking, crd
from orchestrator.operator.children import TaskRef
from orchestrator.operator.crd import Manifest
from orchestrator.operator.lifecycle import (
    AgentCounts,
    AvailabilityDecision,
    ConditionChange,
    Phase,
    RecoveryHistory,
    TaskSpec,
    admit_spec,
    as_stored,
    availability,
    condition,
    merge_conditions,
    parse_time,
    readiness,
    status_patch,
)
from orchestrator.operator.pacing import Heartbeat, Requeue, heartbeat_of, newer
from orchestrator.operator.status import LastOperation, StatusWrite, TaskStatus, aliased
from orchestrator.pipeline import start as pipeline
from orchestrator.pipeline.start import DrainStart
from worker_agent.logformat import bind_log_context, set_log_context

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from orchestrator.operator.context import OperatorContext

_PHASES = frozenset(Phase)
_P = ParamSpec("_P")
_R = TypeVar("_R")


async def ledger_call(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """A blocking ledger (or pipeline) call in a thread, so kopf's event loop never waits
    on the database; typed through, so every call and its result are checked."""
    return await blocking.in_thread(fn, *args, **kwargs)


def utc_now() -> datetime:
    return datetime.now(UTC)


def iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def arrived(activity: ActivityView) -> datetime:
    """When the orchestrator received the heartbeat (its clock); the daemon's stamp only
    for a row stored before the ledger kept receive stamps."""
    return activity.received_at or activity.reported_at


def counts_of(activity: ActivityView) -> AgentCounts:
    return AgentCounts(
        total=activity.agents_total,
        live=activity.agents_live,
        interrupted=activity.agents_interrupted,
        done=activity.agents_done,
    )


_E = TypeVar("_E", OperationKind, OperationState)


def member_of(enum: type[_E], value: object) -> _E | None:
    """``status.lastOperation``'s kind or state as the ledger's enum (None: unset, or a
    value this operator does not know)."""
    if not isinstance(value, str):
        return None
    try:
        return enum(value)
    except ValueError:
        return None


def operation_status(op: OperationView) -> LastOperation:
    """``status.lastOperation``: a field without a value is left out, as the API stores it
    (a merge patch drops a null), so an operation that has not moved writes nothing."""
    written: LastOperation = {"id": op.id, "kind": str(op.kind), "state": str(op.state)}
    if op.error is not None:
        written["error"] = op.error
    if (started := iso(op.created_at)) is not None:
        written["startedAt"] = started
    if (finished := iso(op.finished_at)) is not None:
        written["finishedAt"] = finished
    return written


class TaskPass:
    """One pass over one task: everything it decides is written to ``patch``."""

    def __init__(self, body: kopf.Body, patch: kopf.Patch, ctx: OperatorContext) -> None:
        self.body = body
        self.patch = patch
        self.ctx = ctx
        self.ledger = ctx.ledger
        self.settings = ctx.settings
        self.meta = body.meta
        self._stored: Manifest = dict(body.status or {})
        """The status as stored, with what this pass set: what a change is judged by."""
        self.status = TaskStatus.read(self._stored)
        recorded = body.meta.annotations.get(crd.PHASE_ANNOTATION)
        self.phase: str | None = recorded if recorded in _PHASES else self.status.phase
        """The phase this operator decided last (``crd.PHASE_ANNOTATION``; a task from
        before it was kept there: ``status.phase``); what every decision reads."""
        self.annotations: dict[str, str] = {}
        """Annotations this pass changes (the phase), written before its status."""
        if recorded != self.phase and self.phase is not None:
            self.annotations[crd.PHASE_ANNOTATION] = self.phase
        self.namespace = str(self.meta.namespace)
        self.name = str(self.meta.name)
        self.uid = str(self.meta.uid)
        self.task = TaskRef(self.namespace, self.name, self.uid)
        # Every record of this pass (ours, kopf's, the ledger's in its threads) names
        # the task; an operation id is bound once the pass knows it.
        set_log_context(namespace=self.namespace, name=self.name, task_uid=self.uid)
        self.now = utc_now()
        self.counts: AgentCounts | None = None
        """The daemon's latest heartbeat as this pass read it, for ``Ready``."""
        self.beat: Heartbeat | None = None
        """The newest heartbeat this pass read, for its steward's deadlines."""
        self.requeue: Requeue | None = None
        """How the pass left the task (``pacing``): None while something is on its way."""
        self._class_ahead: tuple[str, asyncio.Task[tuple[str | None, str | None]]] | None = None
        """A workspace PVC and its snapshot class, looked up while its drain runs."""
        self.post_events = True
        """False in a namespace being deleted, which takes no new events."""

    def set_status(self, **fields: Unpack[StatusWrite]) -> None:
        """Set status fields (None removes one); only what differs from the stored
        status goes into the pass's patch."""
        changed = status_patch(self._stored, aliased(fields))
        if not changed:
            return
        self.patch.status.update(changed)
        self._stored.update(as_stored(changed))
        self.status = TaskStatus.read(self._stored)

    def set_phase(self, phase: Phase, message: str) -> None:
        if self.phase != phase:
            if self.post_events:
                kopf.info(self.body, reason=phase.value, message=message)
            self.phase = phase.value
            self.annotations[crd.PHASE_ANNOTATION] = phase.value
            self.set_status(phase=phase.value, phase_since=iso(self.now))
        self.set_status(message=message)

    def correct_status(self) -> None:
        """``status.phase`` as this operator decided it: another writer's value (a
        controller writing its own phase, a hand edit) is put right and said so."""
        written = self.status.phase
        if self.phase is None or written == self.phase:
            return
        message = (
            f"status.phase was {written!r}, written by another writer; this operator's phase "
            f"is {self.phase}: corrected (decisions never read status.phase)"
        )
        log.warning("status_corrected field=phase written=%s phase=%s", written, self.phase)
        if self.post_events:
            kopf.warn(self.body, reason="StatusCorrected", message=message)
        self.set_status(phase=self.phase)

    def set_condition(self, type_: str, ok: bool | None, reason: str, message: str) -> None:
        new = condition(type_, ok, reason, message, self.now, self.meta.get("generation"))
        # Merged into the conditions as stored: another writer's are kept whole.
        merged = merge_conditions(list(self._stored.get("conditions") or []), new)
        self.set_status(conditions=merged)

    def apply_condition(self, change: ConditionChange) -> None:
        self.set_condition(change.type, change.status, change.reason, change.message)

    def record_operation(self, op: OperationView) -> None:
        self.set_status(last_operation=operation_status(op))
        bind_log_context(operation_id=op.id)

    async def begin_drain(
        self, spec: TaskSpec, kind: OperationKind, reason: CheckpointReason, key: str
    ) -> None:
        """Begin the drain → record chain of a pause, a roll or a completion under
        ``key`` (batched with other tasks' by ``ctx.drains``), on its status; the phase
        is the caller's to set."""
        op = await self.ctx.drains.begin(
            DrainStart(
                self.namespace,
                self.name,
                task_uid=self.uid,
                grace_secs=spec.drain_grace_secs,
                kind=kind,
                reason=reason,
                pvc_name=self.pvc_name,
                idempotency_key=key,
            )
        )
        self.record_operation(op)

    async def start_resume(
        self,
        checkpoint_ref: str | None,
        idempotency_key: str,
        *,
        kind: OperationKind = OperationKind.RESUME,
        provider: str | None = None,
        model: str | None = None,
    ) -> OperationView:
        """A resume of this task's agents (a recovery's, a wake's, a restore's: ``kind``)
        begun through the pipeline (``pipeline.start.start_resume``), on its status."""
        op = await ledger_call(
            pipeline.start_resume,
            self.ctx.app,
            self.ledger,
            self.settings,
            namespace=self.namespace,
            name=self.name,
            checkpoint_ref=checkpoint_ref,
            task_uid=self.uid,
            kind=kind,
            idempotency_key=idempotency_key,
            provider=provider,
            model=model,
        )
        self.record_operation(op)
        return op

    def set_ready(self) -> None:
        """``Ready`` from where the pass left the task (its phase, the heartbeat read)."""
        phase = self.phase
        why = None if phase == Phase.RUNNING else self.status.message
        self.apply_condition(readiness(phase, self.counts, why, self.status.paused_by))

    @property
    def pvc_name(self) -> str:
        # The uid is part of the name: a task re-created under a deleted task's name is a
        # new task and must not pick up the old one's retained workspace (that is what
        # resumeFrom is for).
        return str(self.status.pvc_name or f"{self.name[:200]}-ws-{self.uid[:8]}")

    def waiting_for_daemon(self) -> Requeue:
        """The requeue of a pass that waits for the daemon: a heartbeat newer than the
        ones it read wakes it (``steward.one_pass`` fills in the newest it read)."""
        return Requeue(waiting=True)

    def owner(self) -> Manifest:
        return self.task.owner()

    def parse(self, spec: Any) -> TaskSpec:
        """The task's spec as the operator runs it (``lifecycle.admit_spec``)."""
        return admit_spec(
            dict(spec or {}),
            self.name,
            images=self.settings.runnable_images,
            existing_sandboxes=self.settings.existing_sandboxes,
        )

    def sandbox_of(self, spec: TaskSpec) -> str:
        """The name of the Sandbox this task drains, suspends and resumes."""
        return crd.sandbox_name(self.name, spec.sandbox_name)

    def wake_value(self) -> str | None:
        value = self.meta.annotations.get(crd.WAKE_ANNOTATION)
        return None if value is None else str(value)

    def consume_wake(self) -> None:
        """A wake that arrives while the task runs, or while it comes back, asks for
        nothing more than it has: it is spent here, so it cannot resume the task the
        moment it next pauses. (A crash-looping task is not Available: a wake then still
        re-arms its recoveries.)"""
        wake = self.wake_value()
        if wake:
            self.set_status(last_wake=wake)

    async def fresh_activity(self) -> ActivityView | None:
        """The daemon's latest heartbeat, if it is from this task and this phase.

        "This phase" is judged by when the orchestrator received it, never by the
        daemon's own clock, which may be any distance from this one (a row stored before
        the ledger kept receive stamps has only the daemon's)."""
        activity = await self.latest_activity()
        if activity is None:
            return None
        since = parse_time(self.status.phase_since)
        if since is not None and arrived(activity) < since:
            return None
        return activity

    async def latest_activity(self) -> ActivityView | None:
        """The daemon's latest heartbeat, if it is from this task."""
        activity = await ledger_call(self.ledger.get_activity, self.namespace, self.name)
        if activity is None or (activity.task_uid not in (None, self.uid)):
            return None
        self.beat = newer(self.beat, heartbeat_of(activity))
        return activity

    def recovery_history(self) -> RecoveryHistory:
        return RecoveryHistory(
            count=int(self.status.recoveries or 0),
            streak=int(self.status.recovery_streak or 0),
            last_at=parse_time(self.status.last_recovery_at),
        )

    def heartbeat_age(self, activity: ActivityView | None) -> float | None:
        if activity is None:
            return None
        return max(0.0, (self.now - arrived(activity)).total_seconds())

    async def since_last_operation(self, activity: ActivityView) -> bool:
        """Whether the heartbeat reached the ledger after the last operation finished, so
        it shows what that operation left (a recovery's agents live), not what it found."""
        op = await self.last_operation()
        if op is None or op.finished_at is None:
            return op is None
        return arrived(activity) > op.finished_at

    async def last_operation(self) -> OperationView | None:
        """The operation ``status.lastOperation`` names, if the ledger has it as this
        task's (an id written by another writer, another task's, names nothing)."""
        last = self.status.last_operation or {}
        op_id = last.get("id")
        if not op_id:
            return None
        op = await ledger_call(self.ledger.get_operation, op_id)
        return op if op is not None and op.task_uid == self.uid else None

    def availability(self, counts: AgentCounts, activity: ActivityView) -> AvailabilityDecision:
        return availability(
            counts,
            self.heartbeat_age(activity),
            self.settings.heartbeat_interval_secs,
            self.recovery_history(),
            self.now,
        )

    def fail_before_start(self, message: str) -> None:
        """``Failed`` with nothing created for the task (a spec it cannot run, a checkpoint
        it cannot restore): the generation is kept in ``status.failedGeneration``, so a
        changed spec tries again (``retries_failure``)."""
        self.set_status(failed_generation=self.meta.get("generation"))
        self.set_phase(Phase.FAILED, message)
        self.requeue = Requeue()
