"""A checkpoint's VolumeSnapshot: which class takes it, how far it has come
(``snapshot_state``), and what to record of it next (``snapshot_step``).

The external-snapshotter's semantics, which every decision here follows: a snapshot is
**cut** once its ``status.creationTime`` is set and it is bound to its
VolumeSnapshotContent (``status.boundVolumeSnapshotContentName``): its point in time is
fixed, whatever the volume does next, though its data may still be uploading. It is
**ready** (restorable) only at ``status.readyToUse: true``, which on a real driver may
come minutes later. ``status.error`` is the last error the snapshotter met; it retries
and clears it on success, so an error is reported, never final by itself.

A pause and a deletion wait for the cut (``cut_timeout_secs`` from the checkpoint), a
restore for ready (``ready_timeout_secs`` from the checkpoint); both deadlines are counted
from the checkpoint, so any process can tell them from the ledger alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from orchestrator.operator.crd import Manifest
from orchestrator.operator.lifecycle.conditions import parse_time


@dataclass(frozen=True)
class SnapshotClass:
    """A VolumeSnapshotClass as far as choosing one goes."""

    name: str
    driver: str
    default: bool


def choose_snapshot_class(classes: Sequence[SnapshotClass], driver: str | None) -> str | None:
    """The VolumeSnapshotClass for a workspace whose StorageClass provisions with CSI
    ``driver`` (None: unknown, e.g. no StorageClass API or no default class), or None
    when none fits: the cluster cannot snapshot that workspace.

    A class of another driver cannot snapshot the volume. Among the fitting ones the
    default-annotated class wins, then the only one; several and no default is
    ambiguous, so none is chosen (``DRAIN_SNAPSHOT_CLASS`` names one)."""
    fitting = [c for c in classes if driver is None or c.driver == driver]
    defaults = [c for c in fitting if c.default]
    if len(defaults) == 1:
        return defaults[0].name
    if len(fitting) == 1:
        return fitting[0].name
    return None


class SnapshotProgress(StrEnum):
    READY = "ready"
    """``readyToUse``: restorable."""
    CUT = "cut"
    """``creationTime`` set and bound to its content: its point in time is fixed, its data
    may still be uploading; not restorable yet."""
    PENDING = "pending"
    """Asked for, not cut yet."""
    MISSING = "missing"
    """No such VolumeSnapshot (or it is being deleted)."""


@dataclass(frozen=True)
class SnapshotState:
    progress: SnapshotProgress
    error: str | None = None
    """The snapshotter's ``status.error.message`` while it is not ready."""
    restore_size: str | None = None
    cut_at: datetime | None = None
    """``status.creationTime``: the snapshot's point in time."""

    @property
    def cut(self) -> bool:
        return self.progress in (SnapshotProgress.CUT, SnapshotProgress.READY)


def snapshot_state(snapshot: Manifest | None) -> SnapshotState:
    """What a VolumeSnapshot object (None: it does not exist) says about its copy."""
    if snapshot is None or snapshot.get("metadata", {}).get("deletionTimestamp"):
        return SnapshotState(SnapshotProgress.MISSING)
    status = snapshot.get("status") or {}
    error = (status.get("error") or {}).get("message")
    size = status.get("restoreSize")
    ready = status.get("readyToUse") is True
    cut_at = parse_time(status.get("creationTime"))
    if cut_at is not None and cut_at.tzinfo is None:
        cut_at = cut_at.replace(tzinfo=UTC)
    if ready:
        progress = SnapshotProgress.READY
    elif cut_at is not None and status.get("boundVolumeSnapshotContentName"):
        progress = SnapshotProgress.CUT
    else:
        progress = SnapshotProgress.PENDING
    return SnapshotState(
        progress,
        None if ready else (str(error) if error else None),
        None if size is None else str(size),
        cut_at if progress is not SnapshotProgress.PENDING else None,
    )


def snapshot_timed_out(created_at: datetime, now: datetime, timeout_secs: float) -> bool:
    """Whether a checkpoint recorded at ``created_at`` waited more than ``timeout_secs``."""
    return (now - created_at).total_seconds() > timeout_secs


def snapshot_deadline(created_at: datetime, timeout_secs: float) -> datetime:
    """The moment after which ``snapshot_timed_out`` holds."""
    return created_at + timedelta(seconds=timeout_secs)


ORPHANED_ASK_GRACE_SECS = 60.0
"""How long past its cut deadline a snapshot not cut yet is left to the pass that waits
for it (a pause's, a deletion's), before the operator's snapshot follower settles it
itself: only a task gone without its finalizer leaves one that long."""


class SnapshotOutcome(StrEnum):
    WAIT = "wait"
    """Nothing new to record: not cut yet (or cut as recorded), within its deadline."""
    CUT = "cut"
    """Newly seen cut: record when."""
    READY = "ready"
    """Ready: record it (and its cut, if not recorded yet)."""
    FAILED = "failed"
    """Record it failed, for ``error``: the checkpoint is its retained PVC only."""


@dataclass(frozen=True)
class SnapshotStep:
    """What to record of a checkpoint's snapshot next (``snapshot_step``)."""

    outcome: SnapshotOutcome
    cut_at: datetime | None = None
    ready_at: datetime | None = None
    error: str | None = None


WAIT = SnapshotStep(SnapshotOutcome.WAIT)


@dataclass(frozen=True)
class FollowedSnapshot:
    """A checkpoint's snapshot as the ledger knows it."""

    name: str
    pvc_name: str
    checkpointed_at: datetime
    """The checkpoint's ``created_at``: both deadlines count from it."""
    cut_at: datetime | None = None
    """When the ledger recorded it cut; None: not yet."""


def snapshot_step(
    followed: FollowedSnapshot,
    state: SnapshotState,
    now: datetime,
    *,
    cut_timeout_secs: float,
    ready_timeout_secs: float,
) -> SnapshotStep:
    """What the ledger should record next of ``followed``, seen as ``state`` at ``now``.

    Ready is recorded as soon as it is seen (with its cut, if the ledger missed it); a
    cut likewise. Not cut within ``cut_timeout_secs`` of the checkpoint, or cut and not
    ready within ``ready_timeout_secs`` of it, it failed, with what the snapshotter last
    said. A snapshot the ledger knows was cut and that is gone failed at once (nothing
    will bring it back); one gone before its cut is waited for like one not cut yet, as
    it may be one the ledger records a moment before creating it."""
    name, pvc = followed.name, followed.pvc_name
    if state.progress is SnapshotProgress.READY:
        cut_at = followed.cut_at or state.cut_at or now
        return SnapshotStep(SnapshotOutcome.READY, cut_at=cut_at, ready_at=now)
    said = f" (the snapshotter says: {state.error})" if state.error else ""
    if followed.cut_at is not None or state.cut:
        cut_at = followed.cut_at or state.cut_at or now
        cut = f"VolumeSnapshot {name} of PVC {pvc}, cut at {cut_at:%Y-%m-%dT%H:%M:%SZ},"
        if state.progress is SnapshotProgress.MISSING:
            return SnapshotStep(
                SnapshotOutcome.FAILED,
                error=f"{cut} no longer exists: it was deleted before it was readyToUse",
            )
        if snapshot_timed_out(followed.checkpointed_at, now, ready_timeout_secs):
            return SnapshotStep(
                SnapshotOutcome.FAILED,
                error=(
                    f"{cut} was not readyToUse within {ready_timeout_secs:g}s of the "
                    f"checkpoint{said}"
                ),
            )
        if followed.cut_at is None:
            return SnapshotStep(SnapshotOutcome.CUT, cut_at=cut_at)
        return WAIT
    if not snapshot_timed_out(followed.checkpointed_at, now, cut_timeout_secs):
        return WAIT
    why = f"VolumeSnapshot {name} of PVC {pvc} was not cut within {cut_timeout_secs:g}s"
    if state.progress is SnapshotProgress.MISSING:
        why += " and no longer exists"
    return SnapshotStep(SnapshotOutcome.FAILED, error=why + said)
