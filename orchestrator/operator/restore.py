"""Where a restoring task's workspace comes from, decided before anything is created:
a fresh PVC from the checkpoint's ready VolumeSnapshot, or the retained PVC claimed for
this task alone; or why it cannot be (another namespace, gone, superseded, in use), or
that it must wait: for the checkpoint's snapshot to be ready, or for the last pod on its
PVC to go. Never two daemons on one workspace.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from orchestrator.ledger import (
    CheckpointView,
)
from orchestrator.operator import crd, kube
from orchestrator.operator.lifecycle import (
    SnapshotProgress,
    SnapshotState,
    TaskSpec,
    snapshot_state,
)
from orchestrator.operator.taskpass import (
    TaskPass,
    iso,
    ledger_call,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreSource:
    """Where a restoring task's workspace comes from: a fresh PVC filled from the
    checkpoint's VolumeSnapshot (``snapshot``), or the retained PVC itself, claimed for
    this task alone."""

    pvc_name: str
    snapshot: str | None = None
    storage: str | None = None
    """At least the snapshot's restore size (a PVC from a snapshot may not be smaller)."""


@dataclass(frozen=True)
class Refused:
    """Why a restore cannot go ahead: the ``Resumed`` condition's reason and message."""

    reason: str
    message: str


@dataclass(frozen=True)
class NotYet:
    """A restore that must wait: the workspace's last pod is still terminating (looked
    at again every reconcile interval), or the checkpoint's snapshot is not ready yet
    (``quiet``: the snapshot follower wakes the task when it is ready or failed)."""

    why: str
    quiet: bool = False


def larger(storage: str, restore_size: str | None) -> str:
    """``storage``, or the snapshot's restore size when that is larger."""
    if restore_size is None:
        return storage
    try:
        return restore_size if parse_quantity(restore_size) > parse_quantity(storage) else storage
    except ValueError:
        return storage


async def restore_source(
    p: TaskPass, checkpoint: CheckpointView, spec: TaskSpec
) -> RestoreSource | Refused | NotYet:
    """Where this task's workspace comes from when it restores ``checkpoint``, or why
    it cannot. Decided before anything is created: a restore whose workspace is
    missing, moved on, or another task's must fail, never start agents on the wrong
    state or beside another task's daemon.

    With the checkpoint's VolumeSnapshot ready, the task gets a fresh PVC filled from
    it: any number of tasks can restore one checkpoint, each into its own copy, and
    an older checkpoint restores exactly its own state. A snapshot on its way (cut and
    not ready, or not cut yet) is waited for: a PVC cannot be filled from it yet, and the
    retained PVC may already hold a later state. Without one (no CSI snapshots, or the
    snapshot failed or is gone), the retained PVC is all there is: it holds only its
    newest checkpoint and serves one task at a time, claimed here atomically.

    The workspace is a namespaced object, reachable only by a task in its own
    namespace. The rest is checked where this operator manages the workspace
    (``DRAIN_MANAGE_SANDBOX``); elsewhere the Sandbox controller owns it."""
    ref = checkpoint.ref
    owner = f"{checkpoint.namespace}/{checkpoint.name}"
    if checkpoint.namespace != p.namespace:
        return Refused(
            "CheckpointInAnotherNamespace",
            (
                f"checkpoint {ref} is of task {owner}: its workspace PVC is in namespace "
                f"{checkpoint.namespace}, which a task in {p.namespace} cannot mount; "
                f"create the restoring task in {checkpoint.namespace}; no agents were started"
            ),
        )
    # Claimed before anything is created from it: a prune releasing it meanwhile either
    # sees this task name it when it looks again, or has marked it and refuses the claim.
    claimed = await ledger_call(p.ledger.claim_for_restore, ref)
    checkpoint = checkpoint if claimed is None else claimed
    if checkpoint.unavailable is None and checkpoint.releasing_since is not None:
        return NotYet(
            f"checkpoint {ref} is being released by drainctl ledger prune (since "
            f"{iso(checkpoint.releasing_since)}): the restore claims it if the prune keeps "
            "it, and fails if the prune releases it; no agents were started"
        )
    if checkpoint.unavailable is not None:
        return Refused(
            "CheckpointWorkspaceGone",
            (
                f"checkpoint {ref} cannot be restored: {checkpoint.unavailable}; no agents "
                "were started"
            ),
        )
    if not p.settings.manage_sandbox:
        return RestoreSource(checkpoint.pvc_name or p.pvc_name)
    snapshot_gone = None
    name = checkpoint.snapshot_name
    if name is not None and checkpoint.snapshot_error is None:
        state = snapshot_state(await kube.get_snapshot(p.namespace, name))
        if state.progress is SnapshotProgress.READY:
            return RestoreSource(p.pvc_name, name, larger(spec.storage, state.restore_size))
        if state.progress is SnapshotProgress.MISSING:
            snapshot_gone = f"its VolumeSnapshot {name} no longer exists"
        elif checkpoint.snapshot_pending:
            p.ctx.snapshot_follower.wait_for_ready(p.namespace, ref, (p.namespace, p.name))
            return NotYet(waiting_for_snapshot(ref, name, state), quiet=True)
        else:
            snapshot_gone = f"its VolumeSnapshot {name} is no longer readyToUse"
    elif checkpoint.snapshot_error is not None:
        snapshot_gone = f"its VolumeSnapshot failed ({checkpoint.snapshot_error})"
    return await claim_retained(p, checkpoint, snapshot_gone, spec)


def waiting_for_snapshot(ref: str, name: str, state: SnapshotState) -> str:
    """Why a restore of checkpoint ``ref`` waits for its VolumeSnapshot ``name``."""
    if state.progress is SnapshotProgress.CUT:
        where = f"cut at {iso(state.cut_at)}, its data still being copied"
    else:
        where = "not cut yet"
    said = f"; the snapshotter says: {state.error}" if state.error else ""
    return (
        f"waiting for VolumeSnapshot {name} of checkpoint {ref} to become readyToUse "
        f"({where}{said}) before restoring from it"
    )


async def claim_retained(
    p: TaskPass, checkpoint: CheckpointView, snapshot_gone: str | None, spec: TaskSpec
) -> RestoreSource | Refused | NotYet:
    """The checkpoint's retained PVC, claimed for this task, or why it cannot be."""
    ref, pvc = checkpoint.ref, checkpoint.pvc_name
    no_snapshot = snapshot_gone or "it has no VolumeSnapshot"
    for _ in range(3):  # a claim lost to a concurrent write is judged again
        found = None if pvc is None else await kube.get_pvc(p.namespace, pvc)
        if found is None or found.metadata.deletion_timestamp is not None:
            gone = (
                f"its workspace PVC {p.namespace}/{pvc} no longer exists (deleted with "
                "its namespace, or by hand)"
                if pvc is not None
                else "it names no workspace PVC"
            )
            if snapshot_gone is not None:
                gone = f"{snapshot_gone} and {gone}"
            await ledger_call(p.ledger.mark_checkpoint_unavailable, ref, gone)
            return Refused(
                "CheckpointWorkspaceGone",
                (f"checkpoint {ref} cannot be restored: {gone}; no agents were started"),
            )
        assert pvc is not None
        newest = await ledger_call(p.ledger.newest_checkpoint_of_pvc, p.namespace, pvc)
        if newest is not None and newest.ref != ref:
            return Refused(
                "CheckpointSuperseded",
                (
                    f"checkpoint {ref} cannot be restored: {no_snapshot}, and its workspace "
                    f"PVC {pvc} has moved on to the newer checkpoint {newest.ref} of task "
                    f"{newest.namespace}/{newest.name}; a workspace without snapshots holds "
                    f"only its newest checkpoint: restore {newest.ref}; no agents were started"
                ),
            )
        holder = await holder_of(p, found)
        if holder is not None:
            return Refused(
                "WorkspaceInUse",
                (
                    f"checkpoint {ref} cannot be restored: {no_snapshot}, and its workspace "
                    f"PVC {pvc} is held by task {holder}; without a snapshot a workspace "
                    "serves one task at a time (never two daemons on one workspace): delete "
                    "that task, then restore the checkpoint its drain records; no agents "
                    "were started"
                ),
            )
        if (waiting := await last_pod_on(p, pvc, spec)) is not None:
            return waiting
        if any(o.uid == p.uid for o in found.metadata.owner_references or []):
            return RestoreSource(pvc)
        claimed = await kube.claim_pvc(
            p.namespace,
            pvc,
            str(found.metadata.resource_version),
            p.owner(),
            p.name,
        )
        if claimed:
            return RestoreSource(pvc)
    return Refused(
        "WorkspaceInUse",
        (
            f"checkpoint {ref} cannot be restored: its workspace PVC {pvc} kept changing "
            "while this task claimed it; no agents were started"
        ),
    )


async def last_pod_on(p: TaskPass, pvc: str, spec: TaskSpec) -> NotYet | None:
    """Wait while a pod not of this task's Sandbox still mounts ``pvc``: the pod of
    a deleted task, Terminating while its daemon drains (an RWO volume can be
    mounted by two pods of one node). Starting another daemon on the workspace
    before it is gone would put two daemons on one store."""
    pods = await kube.pods_mounting(p.namespace, pvc)
    if not pods:
        return None
    ours = await kube.get_sandbox(spec.sandbox_version, p.namespace, p.sandbox_of(spec))
    owned = ours is not None and any(
        o.get("uid") == p.uid for o in ours["metadata"].get("ownerReferences") or []
    )
    mine = str(ours["metadata"]["uid"]) if ours is not None and owned else None
    others = sorted(name for name, controller in pods if controller is None or controller != mine)
    if not others:
        return None
    return NotYet(
        f"waiting for pod {', '.join(others)} to release workspace PVC {p.namespace}/"
        f"{pvc} before its agents start here (never two daemons on one workspace)"
    )


async def holder_of(p: TaskPass, pvc: Any) -> str | None:
    """The live task other than this one that owns ``pvc`` (``ns/name``, and its phase
    when it is not running), or None. An owner reference to a task that is gone, or
    was re-created under its name, holds nothing."""
    for ref in pvc.metadata.owner_references or []:
        if ref.kind != crd.KIND or ref.uid == p.uid:
            continue
        task = await kube.get_task(p.namespace, ref.name)
        if task is None or task["metadata"].get("uid") != ref.uid:
            continue
        phase = (task.get("status") or {}).get("phase")
        state = ", being deleted" if task["metadata"].get("deletionTimestamp") else ""
        return f"{p.namespace}/{ref.name} ({phase or 'Pending'}{state})"
    return None
