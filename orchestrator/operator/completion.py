"""A task whose agents all finished their work completes: drain → record →
snapshot → Sandbox suspend, phase Completed with its checkpoint kept; a failed completion
is retried after a backoff; a Completed task answers a wake or a suspend once.
"""

from __future__ import annotations

import logging

import kopf

from orchestrator.ledger import (
    ActivityView,
    CheckpointReason,
    OperationKind,
    OperationState,
    OperationView,
)
from orchestrator.operator import suspended
from orchestrator.operator.lifecycle import (
    AgentCounts,
    CompletedAnswer,
    CompletionStep,
    Phase,
    Purpose,
    TaskSpec,
    completed_request,
    completion_step,
    heartbeat_silent,
    operation_key,
    parse_time,
)
from orchestrator.operator.pacing import Requeue
from orchestrator.operator.taskpass import (
    TaskPass,
    member_of,
)

log = logging.getLogger(__name__)


async def complete_when_done(
    p: TaskPass, spec: TaskSpec, counts: AgentCounts | None, activity: ActivityView | None
) -> bool:
    """Begin a completion when every agent is done (``completion_step``), or wait out
    the backoff after a failed one; True when that is all this pass does."""
    last = p.status.last_operation or {}
    decision = completion_step(
        counts,
        silent=heartbeat_silent(p.heartbeat_age(activity), p.settings.heartbeat_interval_secs),
        attempts=int(p.status.completions or 0),
        last_kind=member_of(OperationKind, last.get("kind")),
        last_state=member_of(OperationState, last.get("state")),
        last_finished_at=parse_time(last.get("finishedAt")),
        now=p.now,
    )
    if decision.step is CompletionStep.NOT_DONE:
        return False
    assert counts is not None
    p.set_status(agents=counts.live, idle_since=None)
    if decision.step is CompletionStep.RETRY_LATER:
        p.set_status(
            message=(
                f"every agent finished its work; completion failed ({last.get('error')}), "
                f"trying again in {decision.wait_secs:.0f}s"
            )
        )
        return True
    await start_completion(p, spec, counts)
    return True


async def start_completion(p: TaskPass, spec: TaskSpec, counts: AgentCounts) -> None:
    """Drain (agents that are all stopped: the daemon answers verified refs of each)
    and record the completed checkpoint, as a pause does; ``finish_completion`` then
    suspends the Sandbox."""
    attempt = int(p.status.completions or 0) + 1
    await p.begin_drain(
        spec,
        OperationKind.COMPLETE,
        CheckpointReason.COMPLETED,
        operation_key(p.uid, Purpose.COMPLETE, attempt),
    )
    p.set_status(completions=attempt)
    p.set_phase(
        Phase.DRAINING,
        (f"completing: all {counts.total} agents finished their work; recording their checkpoint"),
    )


async def finish_completion(p: TaskPass, spec: TaskSpec, op: OperationView) -> None:
    """The completion's drain recorded: suspend the Sandbox (compute released, the
    workspace PVC kept), and the task is Completed with that checkpoint. Failed: back
    to Running, saying why; ``completion_step`` tries again after a backoff."""
    if op.state is OperationState.RECORDED and op.checkpoint_ref:
        ref = op.checkpoint_ref
        if not await suspended.suspend_checkpointed(p, spec, ref, "completing"):
            return
        # What kubectl asked until now is spent: only later requests are answered.
        p.set_status(agents=0, last_suspend=spec.suspend)
        if wake := p.wake_value():
            p.set_status(last_wake=wake)
        p.set_condition(
            "Completed",
            True,
            "AgentsDone",
            (
                f"every agent finished its work; checkpoint {ref} is kept (restore it with "
                "spec.resumeFrom.checkpointRef)"
            ),
        )
        p.set_phase(Phase.COMPLETED, (f"checkpoint {ref}; workspace PVC {p.pvc_name} kept"))
    elif op.state is OperationState.FAILED:
        message = f"completion abandoned, the task stays Running: {op.error}"
        kopf.warn(p.body, reason="CompletionFailed", message=message)
        p.set_condition("Completed", False, "CompletionFailed", message)
        p.set_phase(Phase.RUNNING, message)


def while_completed(p: TaskPass, spec: TaskSpec) -> None:
    """A wake, a change of ``spec.lifecycle.suspend`` or of ``spec.task.agents`` is
    answered once: there is nothing to resume, pause or scale (``completed_request``)."""
    p.requeue = Requeue()
    wake = p.wake_value()
    answer = completed_request(spec.suspend, p.status.last_suspend, wake, p.status.last_wake)
    p.set_status(last_suspend=spec.suspend)
    if wake:
        p.set_status(last_wake=wake)
    ref = p.status.checkpoint_ref
    if p.status.applied_agents is not None and spec.agents != p.status.applied_agents:
        # A scale of a Completed task, answered once: the change is spent.
        p.set_status(applied_agents=spec.agents)
        message = (
            f"nothing to scale (spec.task.agents is now {spec.agents}): the task completed "
            f"(every agent finished its work) with checkpoint {ref}; to run agents from it, "
            f"create a task with spec.resumeFrom.checkpointRef: {ref}"
        )
        kopf.info(p.body, reason="NothingToScale", message=message)
        p.set_status(message=message)
    if answer is CompletedAnswer.NOTHING:
        return
    reason = "NothingToResume"
    message = (
        f"nothing to resume: the task completed (every agent finished its work) with "
        f"checkpoint {ref}; to continue from it, create a task with "
        f"spec.resumeFrom.checkpointRef: {ref}"
    )
    if answer is CompletedAnswer.NOTHING_TO_PAUSE:
        reason = "AlreadyCompleted"
        message = (
            f"nothing to pause: the task completed with checkpoint {ref} and its "
            "Sandbox is suspended already"
        )
    kopf.info(p.body, reason=reason, message=message)
    p.set_status(message=message)
