"""Pausing and paused: a pause's drain → record → snapshot cut → Sandbox suspend, and a
suspended task's answer to ``spec.lifecycle.suspend`` and the wake annotation (resume,
start a task created suspended, or hold a wake the spec overrides).
"""

from __future__ import annotations

import logging

import kopf

from orchestrator.ledger import (
    CheckpointReason,
    OperationKind,
    OperationState,
    OperationView,
)
from orchestrator.ledger.models import CHECKPOINTED_STATES
from orchestrator.operator import kube, provisioning, rolling, snapshots
from orchestrator.operator.lifecycle import (
    ROLLED,
    Phase,
    Purpose,
    TaskSpec,
    Wanted,
    operation_key,
    sandbox_suspension_patch,
    wanted_transition,
)
from orchestrator.operator.pacing import Requeue
from orchestrator.operator.taskpass import (
    TaskPass,
    ledger_call,
)

log = logging.getLogger(__name__)


async def start_pause(p: TaskPass, spec: TaskSpec, paused_by: str) -> None:
    count = int(p.status.pauses or 0) + 1
    await p.begin_drain(
        spec,
        OperationKind.PAUSE,
        CheckpointReason.PAUSE,
        operation_key(p.uid, Purpose.PAUSE, count),
    )
    p.set_status(pauses=count, paused_by=paused_by)
    why = "every agent idle" if paused_by == "idle" else "spec.lifecycle.suspend is true"
    p.set_phase(Phase.DRAINING, f"pausing: {why}; draining agents")


async def suspend_checkpointed(p: TaskPass, spec: TaskSpec, ref: str, doing: str) -> bool:
    """Once checkpoint ``ref``'s snapshot is cut (its point in time fixed; it may go on
    uploading), suspend the Sandbox (compute released, the workspace PVC kept) and write
    ``ref`` to the task; False until then (phase Draining, ``doing`` says what for)."""
    if not await snapshots.snapshot_cut(p, ref):
        p.set_phase(
            Phase.DRAINING, f"{doing}: agents drained; snapshotting the workspace for {ref}"
        )
        return False
    if p.settings.manage_sandbox:
        sandbox = p.sandbox_of(spec)
        there = await kube.patch_sandbox_if_there(
            spec.sandbox_version,
            p.namespace,
            sandbox,
            sandbox_suspension_patch(spec.sandbox_version, True),
        )
        if not there:
            # Deleted by hand while the task paused: nothing runs, which is what the
            # suspension is for, and the checkpoint holds the agents; a wake makes the
            # Sandbox again (``while_suspended``).
            kopf.info(
                p.body,
                reason="SandboxGone",
                message=f"Sandbox {p.namespace}/{sandbox} was deleted while {doing}: "
                f"checkpoint {ref} holds the agents; a wake makes the Sandbox again",
            )
    # Nothing is live once suspended: status.agents says so, and the checkpoint's own
    # count (what a wake brings back) has its own field.
    checkpoint = await ledger_call(p.ledger.get_checkpoint, ref)
    held = None if checkpoint is None else len(checkpoint.agents)
    p.set_status(checkpoint_ref=ref, checkpoint_agents=held, idle_since=None, agents=0)
    p.set_condition("Checkpointed", True, "Recorded", f"checkpoint {ref}")
    return True


async def finish_pause(p: TaskPass, spec: TaskSpec, op: OperationView) -> None:
    """The pause's drain recorded: once its snapshot is cut, the Sandbox suspended and
    the task Suspended; failed: back to Running, saying why."""
    if op.state is OperationState.RECORDED and op.checkpoint_ref:
        if not await suspend_checkpointed(p, spec, op.checkpoint_ref, "pausing"):
            return
        p.set_phase(Phase.SUSPENDED, f"suspended with checkpoint {op.checkpoint_ref}")
    elif op.state is OperationState.FAILED:
        message = f"pause abandoned, agents keep running: {op.error}"
        kopf.warn(p.body, reason="PauseFailed", message=message)
        p.set_condition("Checkpointed", False, "PauseFailed", message)
        p.set_status(paused_by=None)
        p.set_phase(Phase.RUNNING, message)


def wake_held(p: TaskPass, wake: str | None) -> None:
    """A wake on a task whose spec says ``suspend: true``: the spec wins, so the wake
    is spent saying what would resume it; an idle pause is the spec's from here on."""
    message = (
        f"wake {wake!r} not applied: spec.lifecycle.suspend is true and holds the task "
        "paused; set it to false (drainctl wake sets both) to resume"
    )
    kopf.warn(p.body, reason="WakeHeld", message=message)
    if p.status.paused_by == "idle":
        p.set_status(paused_by="manual")
    p.set_status(last_wake=wake)
    p.set_status(message=message)


async def while_suspended(p: TaskPass, spec: TaskSpec) -> None:
    wake = p.wake_value()
    wanted = wanted_transition(spec, Phase.SUSPENDED, p.status.paused_by, wake, p.status.last_wake)
    if wanted is Wanted.START:
        p.set_status(paused_by=None, last_wake=wake)
        await provisioning.provision(p, spec)
        return
    if wanted is not Wanted.RESUME:
        p.requeue = Requeue()
    if wanted is Wanted.WAKE_HELD:
        wake_held(p, wake)
        return
    if wanted is Wanted.ADOPT:
        p.set_status(paused_by="manual")
        p.set_status(
            message="paused, and spec.lifecycle.suspend is true: it stays "
            "paused until suspend is false (drainctl wake)"
        )
        return
    if wanted is not Wanted.RESUME:
        return
    rolling_pod = p.status.paused_by == ROLLED
    # The paused pod may still be Terminating, its daemon exiting: woken now, that daemon
    # could take the resume and start the agents in a pod about to go. Any wake waits.
    doing = "rolling the pod" if rolling_pod else "waking"
    if (waiting := await rolling.old_pod_going(p, doing)) is not None:
        p.set_status(message=waiting)
        p.requeue = Requeue()  # the pod's going is an event
        return
    ref = await checkpoint_to_resume(p)
    if (
        p.settings.manage_sandbox
        and spec.sandbox_name is None
        and await provisioning.workspace_gone(p, f"workspace PVC {p.pvc_name} is")
    ):
        return
    if p.settings.manage_sandbox:
        there = await kube.patch_sandbox_if_there(
            spec.sandbox_version,
            p.namespace,
            p.sandbox_of(spec),
            sandbox_suspension_patch(spec.sandbox_version, False),
        )
        if not there:
            # Deleted while the task was paused: made again from the spec on the
            # workspace PVC (or the task fails, WorkspaceGone, when that is gone too).
            await provisioning.ensure_sandbox(p, spec)
            if p.phase == Phase.FAILED:
                return
            if (
                await kube.get_sandbox(spec.sandbox_version, p.namespace, p.sandbox_of(spec))
                is None
            ):
                return  # its old pod still going: the next pass makes it
    if ref:
        await p.start_resume(ref, operation_key(p.uid, Purpose.RESUME, ref))
        resumed = await ledger_call(p.ledger.get_checkpoint, ref)
        if resumed is not None:
            # The agents follow what the wake brings back: a spec count the checkpoint
            # holds fewer of (an agent a pause drained before it saved anything is left
            # out of it) grows back with new agents once Running, as a scale-up.
            p.set_status(applied_agents=len(resumed.agents))
    if rolling_pod:
        rolling.rolled(p, ref)
    p.set_status(paused_by=None, last_wake=wake)
    p.set_phase(Phase.RESUMING, f"resuming from checkpoint {ref}")


async def checkpoint_to_resume(p: TaskPass) -> str | None:
    """The checkpoint a paused task resumes from: its last pause's, as the ledger recorded
    it for this task's uid. ``status.checkpointRef`` only shows it: one another writer
    set (another task's checkpoint) is corrected, never resumed from."""
    last = await ledger_call(p.ledger.last_lifecycle_operation, p.uid)
    paused = last is not None and last.kind is OperationKind.PAUSE
    ref = (
        last.checkpoint_ref
        if paused and last is not None and last.state in CHECKPOINTED_STATES
        else None
    )
    shown = p.status.checkpoint_ref
    if ref is not None and shown != ref:
        log.warning("status_corrected field=checkpointRef written=%s checkpoint=%s", shown, ref)
        p.set_status(checkpoint_ref=ref)
    return ref
