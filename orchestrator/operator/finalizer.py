"""The drain finalizer (``crd.FINALIZER``): a CalibanTask being deleted is drained,
its checkpoint recorded (and its snapshot cut, ``snapshots``), ``status.checkpointRef``
written and the workspace PVC retained before kopf releases it; or, past
``drainTimeout``, with no daemon left to answer, or after a failed drain, a forced
checkpoint and a Warning event. Deletion never wedges: in a namespace being deleted
nothing is created (no drain guard, no snapshot, no events) and the namespace's
checkpoints are marked gone with it. ``lifecycle.decide_delete`` takes each decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import kopf

from orchestrator import metrics
from orchestrator.ledger import CheckpointReason, OperationKind, OperationState, OperationView
from orchestrator.operator import kube, provisioning, running, snapshots
from orchestrator.operator.context import DELETE_POLL_SECS, OperatorContext
from orchestrator.operator.crd import Manifest
from orchestrator.operator.lifecycle import (
    DeleteAction,
    DeletionObserved,
    Phase,
    Purpose,
    SpecError,
    adopts_drain,
    decide_delete,
    operation_key,
    snapshot_state,
)
from orchestrator.operator.taskpass import TaskPass, arrived, ledger_call, utc_now
from orchestrator.pipeline.start import DrainStart

log = logging.getLogger(__name__)

DELETE_FOLLOW_SECS = 10.0
"""How long a deletion's handler follows its drain itself before kopf's retry does."""
DAEMON_LOOK_SECS = 2.0
"""How often a deletion's drain looks whether a daemon is left to answer it."""
SNAPSHOT_LOOK_SECS = 1.0
"""How long a deletion waits on the shared snapshot poll before it asks again itself."""


async def drain_on_delete(ctx: OperatorContext, body: kopf.Body, patch: kopf.Patch) -> None:
    """The drain finalizer's pass over a task being deleted: what ``decide_delete`` says
    next, followed for a while (most drains take well under a second), then handed back
    to kopf's retry."""
    r = TaskPass(body, patch, ctx)
    try:
        spec = r.parse(body.spec)
    except SpecError:
        spec = r.parse({})  # whatever ran is drained as the defaults say
    spec = await provisioning.resolve_sandbox_version(r, spec)  # looked at while it drains
    # A namespace being deleted takes the workspace with it and accepts nothing new: the
    # drain still runs (the daemon lives until its pod goes), nothing is created there.
    terminating = await kube.namespace_terminating(r.namespace)
    r.post_events = not terminating
    observed, last = await _observe(r)
    key = operation_key(r.uid, Purpose.DELETE)
    op = await ledger_call(r.ledger.find_operation, key)
    if op is None and last is not None and adopts_drain(observed):
        op = last  # deleted mid-pause: one drain, one checkpoint
    # The handler follows the drain itself for a while (most drains take well under a
    # second) and only then hands back to kopf's retry, so deletion is not paced by it.
    follow_until = time.monotonic() + DELETE_FOLLOW_SECS
    next_daemon_look = time.monotonic()
    while True:
        action = decide_delete(
            spec,
            observed=observed,
            op_state=op.state if op else None,
            drain_started=op.created_at if op else None,
            now=utc_now(),
        )
        if action is DeleteAction.RELEASE:
            if terminating:
                await _namespace_goes(r, None)
                return
            kopf.info(body, reason="Released", message="onDelete: delete; not checkpointed")
            await _workspace_goes_with(r, "onDelete: delete")
            return
        if action is DeleteAction.NOTHING_TO_DRAIN:
            if terminating:
                await _namespace_goes(r, None)
                return
            await _nothing_to_drain(r)
            return
        if action in (DeleteAction.KEEP_PAUSE_CHECKPOINT, DeleteAction.KEEP_COMPLETED_CHECKPOINT):
            await _release_with_checkpoint(r, str(observed.last_ref), terminating)
            return
        if action is DeleteAction.START_DRAIN:
            op = await ctx.drains.begin(
                DrainStart(
                    r.namespace,
                    r.name,
                    task_uid=r.uid,
                    grace_secs=spec.drain_grace_secs,
                    kind=OperationKind.DELETE_DRAIN,
                    reason=CheckpointReason.DELETE,
                    pvc_name=r.pvc_name,
                    idempotency_key=key,
                )
            )
            r.record_operation(op)
            if r.settings.manage_sandbox and not terminating:  # gone with the task
                try:
                    await kube.guard_against_eviction(r.namespace, r.name, r.owner(), True)
                except kube.NamespaceTerminating:
                    terminating, r.post_events = True, False  # began since it was read
            r.set_phase(Phase.DRAINING, "deleting: draining agents before the pod goes")
            r.set_ready()
            # Written now rather than when the handler returns, so kubectl shows
            # Draining while the handler follows the drain.
            await kube.patch_task_status(r.namespace, r.name, dict(r.patch.status))
            continue
        assert op is not None
        r.record_operation(op)
        if not terminating:
            snapshots.look_up_snapshot_class_ahead(r)
        if action is DeleteAction.RECORDED and op.checkpoint_ref:
            await _release_with_checkpoint(r, op.checkpoint_ref, terminating)
            return
        if action is DeleteAction.FORCE:
            await _force_delete(r, op, terminating=terminating)
            return
        if time.monotonic() >= next_daemon_look:
            next_daemon_look = time.monotonic() + DAEMON_LOOK_SECS
            if (cause := await running.no_daemon_to_answer(r, spec)) is not None:
                await _force_delete(r, op, cause, terminating=terminating)
                return
        left = follow_until - time.monotonic()
        if left < 0:
            raise kopf.TemporaryError(f"drain {op.id} is {op.state}", delay=0.5)
        # Woken when the drain's state moves (one ledger read per poll for every deletion
        # followed at once), or at the next look for a daemon, whichever is first.
        within = min(left, max(next_daemon_look - time.monotonic(), 0.0) + DELETE_POLL_SECS)
        state = await ctx.drain_states.until(op.id, _moved_from(op.state), within)
        if state is not None and state is not op.state:
            op = await ledger_call(r.ledger.get_operation, op.id) or op


def _moved_from(state: OperationState) -> Callable[[OperationState | None], bool]:
    return lambda seen: seen is not None and seen is not state


def _snapshot_cut(snapshot: Manifest | None) -> bool:
    return snapshot_state(snapshot).cut


async def _observe(r: TaskPass) -> tuple[DeletionObserved, OperationView | None]:
    """What the ledger and the cluster say of the task (``DeletionObserved``), and its
    last lifecycle operation."""
    last = await ledger_call(r.ledger.last_lifecycle_operation, r.uid)
    activity = await r.latest_activity()
    live_since = (
        activity is not None
        and activity.agents_live > 0
        and last is not None
        and last.finished_at is not None
        and arrived(activity) > last.finished_at
    )
    ran = activity is not None
    if not ran:
        # Without the pods to look at (another controller provisions), what ran is unknown.
        manage = r.settings.manage_sandbox
        ran = not manage or await kube.daemon_ran_on(r.namespace, r.pvc_name)
    observed = DeletionObserved(
        last_kind=last.kind if last else None,
        last_state=last.state if last else None,
        last_ref=last.checkpoint_ref if last else None,
        live_since=live_since,
        ran=ran,
    )
    return observed, last


async def _nothing_to_drain(r: TaskPass) -> None:
    """The task's daemon never ran: released at once, no drain, no forced checkpoint. A
    workspace that holds an earlier checkpoint (a restore's claimed PVC) is kept for it;
    any other goes with the task."""
    message = (
        "its daemon never ran (no heartbeat, no daemon container started on its "
        "workspace): nothing to drain; not checkpointed"
    )
    kopf.info(r.body, reason="NothingToDrain", message=message)
    if r.settings.manage_sandbox and r.status.pvc_name:
        held = await ledger_call(r.ledger.newest_checkpoint_of_pvc, r.namespace, r.pvc_name)
        if held is not None and held.available:
            await kube.retain_pvc(r.namespace, r.pvc_name, held.ref)
            return
    await _workspace_goes_with(r, "its daemon never ran")


async def _workspace_goes_with(r: TaskPass, why: str) -> None:
    """A task released without a checkpoint takes its workspace PVC with it (it owns it):
    the earlier checkpoints that PVC was the only copy of (pauses without a snapshot, or
    the checkpoint it was restored from) say so in the ledger, so nothing claims them
    restorable any more."""
    if not r.settings.manage_sandbox or not r.status.pvc_name:
        return
    pvc = await kube.get_pvc(r.namespace, r.pvc_name)
    if pvc is None or not any(o.uid == r.uid for o in pvc.metadata.owner_references or []):
        return
    gone = await ledger_call(
        r.ledger.mark_workspace_gone,
        r.namespace,
        r.pvc_name,
        f"its workspace PVC {r.pvc_name} was deleted with task {r.namespace}/{r.name} ({why})",
    )
    if gone:
        kopf.info(
            r.body,
            reason="CheckpointsReleased",
            message=(
                f"workspace PVC {r.pvc_name} goes with the task: checkpoint {', '.join(gone)} "
                "can no longer be restored"
            ),
        )


async def _namespace_goes(r: TaskPass, ref: str | None) -> None:
    """The task's namespace is being deleted: every workspace PVC and VolumeSnapshot in
    it goes too, so no checkpoint of a task there can be restored any more, this task's
    (``ref``) included; the ledger says so at once. Said in the log, not in events: the
    API takes no new events in that namespace either."""
    why = (
        f"namespace {r.namespace} was deleted: the workspace PVCs and VolumeSnapshots of "
        "its tasks went with it"
    )
    gone = await ledger_call(r.ledger.mark_namespace_gone, r.namespace, why)
    log.info(
        "namespace_terminating checkpoint=%s released_checkpoints=%s: nothing is created in "
        "a namespace being deleted (no drain guard, no snapshot)",
        ref or "-",
        ",".join(gone) or "-",
    )


async def _release_with_checkpoint(r: TaskPass, ref: str, terminating: bool = False) -> None:
    r.set_status(checkpoint_ref=ref)
    # Written now, not with the finalizer's removal: a task that goes at once would
    # otherwise never show the checkpoint it was released with.
    await kube.patch_task_status(r.namespace, r.name, dict(r.patch.status))
    if terminating:
        await _namespace_goes(r, ref)
        return
    follow_until = time.monotonic() + DELETE_FOLLOW_SECS
    for each in [*await _missed_snapshots(r, ref), ref]:
        while not await snapshots.snapshot_cut(r, each):
            left = follow_until - time.monotonic()
            if left < 0:
                raise kopf.TemporaryError(
                    f"waiting for the snapshot of checkpoint {each}", delay=0.5
                )
            # Its snapshot is named by the checkpoint (``snapshot_cut``); asked again at
            # once when the shared poll sees it cut, else after a bounded wait. Its
            # readiness is the snapshot follower's: the task goes as soon as its point in
            # time is fixed.
            await r.ctx.snapshot_states.until(
                (r.namespace, each), _snapshot_cut, min(left, SNAPSHOT_LOOK_SECS)
            )
    retained = await kube.retain_pvc(r.namespace, r.pvc_name, ref)
    where = f"PVC {r.pvc_name} retained" if retained else "no PVC to retain"
    if not retained:
        # Deleted under the task: a checkpoint only that PVC held is gone with it.
        gone = await ledger_call(
            r.ledger.mark_workspace_gone,
            r.namespace,
            r.pvc_name,
            f"workspace PVC {r.pvc_name} was deleted under task {r.namespace}/{r.name}",
        )
        if gone:
            where += f": marked unavailable in the ledger: {', '.join(gone)}"
    if r.ctx.first_release(r.uid, ref):
        kopf.info(r.body, reason="Checkpointed", message=f"checkpoint {ref}; {where}")


async def _missed_snapshots(r: TaskPass, ref: str) -> list[str]:
    """The scale-down checkpoints of this task whose snapshot no pass saw cut: the scale
    was still following it when the deletion stopped the task's passes. The deletion
    takes them over, asking for each (``snapshot_cut``) and going once each is cut, as
    it does for its own. Their agents were retired, and a retired agent runs again only
    through a later scale-up (or a resume or restore of the task): with none since, the
    workspace still holds them as the checkpoint recorded them, so a snapshot cut now
    is theirs."""
    if not (r.settings.manage_sandbox and r.settings.snapshots):
        return []
    ops = await ledger_call(r.ledger.list_operations, r.namespace, r.name, 50)
    ran_since = max(
        (op.created_at for op in ops if op.task_uid == r.uid and op.kind in _RUN_AGENTS),
        default=None,
    )
    earlier = await ledger_call(r.ledger.list_checkpoints, r.namespace, r.name, 20)
    return [
        c.ref
        for c in reversed(earlier)  # oldest first
        if c.ref != ref
        and c.reason is CheckpointReason.SCALE_DOWN
        and c.task_uid == r.uid
        and (ran_since is None or c.created_at > ran_since)
        and c.available
        and c.pvc_name == r.pvc_name
        and c.snapshot_cut_at is None
        and c.snapshot_ready_at is None
        and c.snapshot_error is None
    ]


_RUN_AGENTS = frozenset({OperationKind.RESUME, OperationKind.RESTORE, OperationKind.SCALE_UP})
"""Operations that run agents on a workspace again."""


async def _force_delete(
    r: TaskPass, op: OperationView, cause: str | None = None, *, terminating: bool = False
) -> None:
    """Past drainTimeout, a failed drain, or no daemon left to answer it (``cause``):
    record what the PVC holds, warn, release.

    The abandoned drain is closed first, as superseded: if its daemon answers after all,
    its record finds the operation finished and records nothing, so the deleted task
    keeps exactly one checkpoint, the forced one.
    """
    if not op.terminal:
        op = await ledger_call(
            r.ledger.expire_operation,
            op.id,
            f"{metrics.SUPERSEDED_BY_FORCE}: {cause}"
            if cause
            else f"{metrics.SUPERSEDED_BY_FORCE}: the drain did not finish within drainTimeout "
            f"({op.state} after the timeout)",
        )
    forced = await ledger_call(
        r.ledger.begin_operation,
        OperationKind.FORCE_DELETE,
        task_uid=r.uid,
        namespace=r.namespace,
        name=r.name,
        idempotency_key=operation_key(r.uid, Purpose.FORCE),
    )
    checkpoint = await ledger_call(
        r.ledger.record_checkpoint,
        forced.id,
        [],
        reason=CheckpointReason.FORCED,
        pvc_name=r.pvc_name,
        forced=True,
    )
    if forced.state is not OperationState.FORCED:
        metrics.FORCED_DELETES.inc()  # recorded by this call, not by a re-run's
    why = op.error or f"drain {op.id} did not finish within drainTimeout"
    message = (
        f"deleting without a clean drain ({why}); forced checkpoint {checkpoint.ref} of PVC "
        f"{r.pvc_name}"
    )
    if terminating:
        log.warning("forced_checkpoint %s", message)
    else:
        kopf.warn(r.body, reason="ForcedCheckpoint", message=message)
    await _release_with_checkpoint(r, checkpoint.ref, terminating)
