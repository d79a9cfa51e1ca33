"""The VolumeSnapshot of each checkpoint's workspace, as a pass sees it: asked for once
the checkpoint is recorded (its class looked up while the drain runs) and followed until
it is **cut** (``status.creationTime`` set, bound to its content: its point in time fixed),
failed, or none to take; each step recorded in the ledger so any pass of any replica
carries on from the last. Until then a pause does not suspend the pod and a deletion
does not release it; from the cut on they go on, and the operator's snapshot follower
(``snapshot_follower``) takes the snapshot to ready or failed.

``reflect_snapshot`` keeps a task's ``Snapshotted`` condition in step with what the
follower recorded of its newest checkpoint's snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import kopf

from orchestrator import metrics
from orchestrator.operator import children, kube
from orchestrator.operator.lifecycle import (
    FollowedSnapshot,
    SnapshotOutcome,
    choose_snapshot_class,
    snapshot_state,
    snapshot_step,
)
from orchestrator.operator.taskpass import (
    TaskPass,
    iso,
    ledger_call,
    utc_now,
)

log = logging.getLogger(__name__)

SNAPSHOTTED = "Snapshotted"
"""The condition that says how the task's newest checkpoint's snapshot is doing."""
SNAPSHOT_CUT = "SnapshotCut"
"""Its reason (status ``Unknown``) while the snapshot is cut and not ready yet."""


async def snapshot_cut(p: TaskPass, ref: str) -> bool:
    """Whether checkpoint ``ref``'s workspace snapshot is cut (its point in time fixed),
    or settled without one: failed, or not to be taken (no CSI snapshots). Until then
    the drained pod must stay (a pause does not suspend it, a deletion does not release
    it), so the snapshot holds the workspace exactly as the drain left it; once cut, its
    data may upload as long as it takes. Asks for the snapshot on the first call; the
    ledger records each step, so any pass, of any operator replica, carries on from
    where the last one was."""
    if not (p.settings.manage_sandbox and p.settings.snapshots):
        return True
    checkpoint = await ledger_call(p.ledger.get_checkpoint, ref)
    if checkpoint is None or checkpoint.pvc_name is None:
        return True
    if (
        checkpoint.snapshot_cut_at is not None
        or checkpoint.snapshot_ready_at is not None
        or checkpoint.snapshot_error is not None
    ):
        return True  # cut (the follower has it from here), ready or failed
    pvc, name = checkpoint.pvc_name, checkpoint.snapshot_name
    if name is None:
        if await kube.get_pvc(p.namespace, pvc) is None:
            # Deleted under the task: a snapshot of it would wait for ever for its source,
            # and a checkpoint only that PVC held is gone with it.
            why = f"workspace PVC {pvc} is gone: nothing to copy"
            await ledger_call(p.ledger.mark_workspace_gone, p.namespace, pvc, why)
            await snapshot_failed(p, ref, None, why, kept="nothing holds it: marked unavailable")
            return True
        class_name, problem = await _snapshot_class_of(p, pvc)
        if problem is not None:
            await snapshot_failed(p, ref, None, problem)
            return True
        if class_name is None:
            return True  # the cluster offers no snapshots: the retained PVC it is
        snapshot = children.workspace_snapshot(p.task, ref, pvc, class_name)
        name = snapshot["metadata"]["name"]  # one snapshot per checkpoint, named by it
        await kube.create_snapshot(snapshot)
        await ledger_call(p.ledger.record_snapshot, ref, name)
    state = snapshot_state(await kube.get_snapshot(p.namespace, name))
    p.now = utc_now()
    step = snapshot_step(
        FollowedSnapshot(name, pvc, checkpoint.created_at),
        state,
        p.now,
        cut_timeout_secs=p.settings.snapshot_cut_timeout_secs,
        ready_timeout_secs=p.settings.snapshot_ready_timeout_secs,
    )
    if step.outcome is SnapshotOutcome.WAIT:
        return False
    if step.outcome is SnapshotOutcome.FAILED:
        await snapshot_failed(p, ref, name, str(step.error))
        return True
    await ledger_call(
        p.ledger.record_snapshot, ref, name, cut_at=step.cut_at, ready_at=step.ready_at
    )
    if step.outcome is SnapshotOutcome.READY:
        metrics.SNAPSHOTS_SETTLED.labels("ready", "pass").inc()
        message = f"checkpoint {ref}: workspace PVC {pvc} copied to VolumeSnapshot {name}"
        kopf.info(p.body, reason=SNAPSHOTTED, message=message)
        p.set_condition(SNAPSHOTTED, True, "SnapshotReady", message)
        return True
    message = (
        f"checkpoint {ref}: VolumeSnapshot {name} of workspace PVC {pvc} cut at "
        f"{iso(step.cut_at)} (its point in time is fixed); its data is still being copied, "
        "and it can be restored once readyToUse"
    )
    kopf.info(p.body, reason=SNAPSHOT_CUT, message=message)
    p.set_condition(SNAPSHOTTED, None, SNAPSHOT_CUT, message)
    return True


async def reflect_snapshot(p: TaskPass) -> None:
    """While the task's ``Snapshotted`` condition says its snapshot is cut and not ready,
    look up what the follower has recorded of it since (the task's newest checkpoint is
    the one the condition speaks of): ready or failed becomes the condition. The event
    was the follower's to post. A task without a pending snapshot reads nothing here."""
    said = next((c for c in p.status.conditions or [] if c.get("type") == SNAPSHOTTED), None)
    if said is None or said.get("reason") != SNAPSHOT_CUT:
        return
    checkpoint = await ledger_call(p.ledger.latest_checkpoint, p.namespace, p.name)
    if checkpoint is None or checkpoint.task_uid != p.uid or checkpoint.snapshot_pending:
        return
    name, pvc = checkpoint.snapshot_name, checkpoint.pvc_name
    if checkpoint.snapshot is not None:
        message = (
            f"checkpoint {checkpoint.ref}: workspace PVC {pvc} copied to VolumeSnapshot {name}"
        )
        p.set_condition(SNAPSHOTTED, True, "SnapshotReady", message)
    elif checkpoint.snapshot_error is not None:
        message = (
            f"checkpoint {checkpoint.ref} has no snapshot: {checkpoint.snapshot_error}; it is "
            "kept as the retained workspace PVC only"
        )
        p.set_condition(SNAPSHOTTED, False, "SnapshotFailed", message)


def look_up_snapshot_class_ahead(p: TaskPass) -> None:
    """While the workspace's drain runs, look up its snapshot class (four API reads),
    so the checkpoint's snapshot is asked for the moment the checkpoint is recorded.
    A lookup that fails is made again then, where its error is reported."""
    if p._class_ahead is not None or not p.status.pvc_name:
        return
    if not (p.settings.manage_sandbox and p.settings.snapshots):
        return
    lookup = asyncio.create_task(snapshot_class(p, p.pvc_name), name="snapshot class")
    lookup.add_done_callback(lambda done: done.cancelled() or done.exception())
    p._class_ahead = (p.pvc_name, lookup)


async def _snapshot_class_of(p: TaskPass, pvc_name: str) -> tuple[str | None, str | None]:
    ahead = p._class_ahead
    if ahead is not None and ahead[0] == pvc_name:
        with contextlib.suppress(Exception):
            return await ahead[1]
    return await snapshot_class(p, pvc_name)


async def snapshot_class(p: TaskPass, pvc_name: str) -> tuple[str | None, str | None]:
    """The VolumeSnapshotClass for the workspace (None: the cluster offers none that
    fits), or a problem to report: a configured class that does not exist."""
    if not await kube.snapshots_served():
        return None, None
    classes = await kube.snapshot_classes()
    configured = p.settings.snapshot_class
    if configured is not None:
        if any(c.name == configured for c in classes):
            return configured, None
        return None, (
            f"DRAIN_SNAPSHOT_CLASS names VolumeSnapshotClass {configured}, which does not "
            f"exist (there are: {', '.join(c.name for c in classes) or 'none'})"
        )
    driver = await kube.storage_driver(await kube.get_pvc(p.namespace, pvc_name))
    return choose_snapshot_class(classes, driver), None


async def snapshot_failed(
    p: TaskPass,
    ref: str,
    name: str | None,
    why: str,
    kept: str = "it is kept as the retained workspace PVC only",
) -> None:
    """The checkpoint goes without a snapshot, loudly: it is kept as the retained PVC
    only, restorable while it is that workspace's newest, by one task at a time (or,
    ``kept`` says, nothing holds it)."""
    await ledger_call(p.ledger.record_snapshot, ref, name, error=why)
    metrics.SNAPSHOTS_SETTLED.labels("failed", "pass").inc()
    message = f"checkpoint {ref} has no snapshot: {why}; {kept}"
    kopf.warn(p.body, reason="SnapshotFailed", message=message)
    p.set_condition(SNAPSHOTTED, False, "SnapshotFailed", message)
