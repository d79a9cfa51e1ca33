"""What the audit can find: one kind per claim that reality can contradict.

Each kind is also the reason of the Warning event and of the ``Consistent=False``
condition it raises, and the ``kind`` label of ``caliban_drain_audit_findings``;
``docs/audit.md`` gives the runbook for each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


class FindingKind(StrEnum):
    # checkpoints
    WORKSPACE_MISSING = "WorkspaceMissing"
    """A restorable checkpoint whose workspace (its ready snapshot or its retained PVC)
    does not exist: a restore of it would fail, or find nothing."""
    SNAPSHOT_MISSING = "SnapshotMissing"
    """The ledger says the checkpoint's VolumeSnapshot is ready; there is no such snapshot
    (its retained PVC still exists)."""
    SNAPSHOT_OVERDUE = "SnapshotOverdue"
    """The ledger still says a checkpoint's snapshot is on its way (not cut, or cut and not
    ready) long past its deadline: it never came, and the operator did not record it
    failed."""
    RELEASE_STALLED = "ReleaseStalled"
    """A checkpoint ``drainctl ledger prune`` marked as being released long ago and never
    released or kept: a prune stopped half-way; a restore of it waits."""
    SESSION_MISMATCH = "SessionMismatch"
    """An agent's session in the checkpoint's workspace is not the turns and sha256 the
    ledger recorded (edited, truncated, rolled back or unreadable)."""
    # tasks
    DAEMON_SILENT = "DaemonSilent"
    """A task that should have a daemon (Running, Provisioning, Resuming) has had no
    heartbeat from it for longer than three heartbeat intervals."""
    STATUS_DISAGREES = "StatusDisagrees"
    """A Running task's ``status.agents`` is not what its daemon's settled heartbeat
    says is live."""
    SUSPENDED_NOT_STOPPED = "SuspendedNotStopped"
    """A Suspended task whose Sandbox is not suspended, whose pod still exists, or whose
    daemon still reports live agents."""
    TASK_CHILD_GONE = "TaskChildGone"
    """A task that runs (or is kept to run again) on a workspace PVC that no longer exists
    or is being deleted, or a Running task whose Sandbox does not exist."""
    UNKNOWN_CHECKPOINT = "CheckpointRefUnknown"
    """``status.checkpointRef`` names a checkpoint the ledger does not hold."""
    RESTORE_STUCK = "RestoreStuck"
    """A task still restoring from ``spec.resumeFrom`` (not yet Running on it) whose
    checkpoint the ledger holds no more, or holds as unavailable (released): the restore
    can only fail, and nothing said so."""
    # operations
    OPERATION_OVERDUE = "OperationOverdue"
    """An operation not finished long after its deadline: the deadline sweeper did not
    close it."""
    DRAIN_RECORD = "DrainRecord"
    """One checkpoint per drain broken: a recorded drain without its checkpoint, a
    failed one with one, or a deletion recorded twice."""
    # daemons
    DUPLICATE_DAEMON = "DuplicateDaemon"
    """More than one pod mounts one workspace PVC: two daemons on one store."""
    QUEUE_MISMATCH = "QueueMismatch"
    """A daemon bound to another task than the one it serves: its Sandbox's ``--queue``
    or ``--task-uid`` is not its task's, or its heartbeats come with another uid."""
    # orphans
    ORPHAN_PVC = "OrphanPVC"
    """A workspace PVC no live task owns and no restorable checkpoint names."""
    ORPHAN_SNAPSHOT = "OrphanSnapshot"
    """A checkpoint VolumeSnapshot no restorable checkpoint names."""


@dataclass(frozen=True, order=True)
class Finding:
    kind: FindingKind
    subject: str
    """What is inconsistent, as ``<what> <namespace>/<name>`` (or the ledger's id)."""
    message: str
    namespace: str | None = None
    task: str | None = None
    """The CalibanTask the finding is raised on (its event and condition), if it exists."""
    lost_turns: int = 0
    """Completed turns the checkpoint recorded and its workspace no longer holds
    (``SessionMismatch`` of a session that went back); in the JSON only when not 0."""

    @property
    def key(self) -> tuple[str, str]:
        return self.kind.value, self.subject

    def line(self) -> str:
        return f"{self.kind.value} {self.subject}: {self.message}"

    def as_json(self) -> dict[str, Any]:
        document = {**asdict(self), "kind": self.kind.value}
        if not self.lost_turns:
            del document["lost_turns"]
        return document
