"""What the drain finalizer does next for a task being deleted (``decide_delete``),
whether a deletion takes over a pause's drain on its way, and whether a failed task is
tried again after its spec changed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from orchestrator.ledger import OperationKind, OperationState
from orchestrator.ledger.models import CHECKPOINTED_STATES
from orchestrator.operator.lifecycle.phase import Phase
from orchestrator.operator.lifecycle.spec import TaskSpec


class DeleteAction(StrEnum):
    RELEASE = "release"
    """Let the finalizer go now."""
    KEEP_PAUSE_CHECKPOINT = "keep-pause-checkpoint"
    """A suspended task was drained and checkpointed when it paused, and its daemon is
    stopped: keep that checkpoint (``status.checkpointRef``), retain the PVC, release."""
    KEEP_COMPLETED_CHECKPOINT = "keep-completed-checkpoint"
    """A Completed task's agents finished their work and it was checkpointed then, its
    daemon stopped: that checkpoint is the task's; keep it, retain the PVC, release —
    as after a pause, never a second drain of agents that are done."""
    NOTHING_TO_DRAIN = "nothing-to-drain"
    """The task's daemon never ran (no heartbeat, no daemon container started on its
    workspace): nothing was done that a drain could keep; release at once."""
    START_DRAIN = "start-drain"
    WAIT = "wait"
    RECORDED = "recorded"
    """The checkpoint is in the ledger: write checkpointRef, retain the PVC, release."""
    FORCE = "force"
    """Drain failed or timed out: record a forced checkpoint, warn, release."""


def retries_failure(phase: str | None, failed_generation: object, generation: object) -> bool:
    """Whether a ``Failed`` task starts again, from ``Pending``: only one that failed with
    nothing created (``status.failedGeneration`` set: an invalid spec, an unknown or
    unrestorable checkpoint, a Sandbox version the cluster cannot take), and only once
    its spec has changed since (a newer ``metadata.generation``), e.g. a corrected
    ``resumeFrom``. A task that failed after its agents ran (``WorkspaceGone``,
    ``CheckpointMismatch``) has no ``failedGeneration`` and stays ``Failed``: starting it
    again would start fresh agents where work was lost, or resume what the checkpoint
    does not hold."""
    if phase != Phase.FAILED:
        return False
    if not isinstance(failed_generation, int) or not isinstance(generation, int):
        return False
    return generation > failed_generation


@dataclass(frozen=True)
class DeletionObserved:
    """What the ledger and the cluster say of a task being deleted: its deletion decides
    from these alone, never from a status field another writer can set (caliban-operator
    writes ``phase`` from its own enum; anyone with status rights can write
    ``checkpointRef``)."""

    last_kind: OperationKind | None = None
    """The task's last lifecycle operation in the ledger (by its uid, its deletion's own
    excepted): its kind, state and checkpoint."""
    last_state: OperationState | None = None
    last_ref: str | None = None
    live_since: bool = False
    """A heartbeat of this task, received after that operation finished, reported live
    agents: whatever the operation left, the daemon runs again."""
    ran: bool = False
    """The task's daemon ever ran: a heartbeat of this task is in the ledger, or a pod's
    daemon container has started on its workspace."""


def decide_delete(
    spec: TaskSpec,
    *,
    observed: DeletionObserved,
    op_state: OperationState | None,
    drain_started: datetime | None,
    now: datetime,
) -> DeleteAction:
    """What the drain finalizer does next for a task being deleted.

    ``spec`` is the task's (the defaults' for a spec that does not parse); ``op_state``
    is the ledger state of this deletion's drain, None if not begun, and
    ``drain_started`` its start.
    """
    if spec.on_delete == "delete":
        return DeleteAction.RELEASE
    if op_state is None:
        last = observed.last_kind
        if (
            last in _KEEPING
            and observed.last_state in CHECKPOINTED_STATES
            and (observed.last_ref and not observed.live_since)
        ):
            return _KEEPING[last]
        if not observed.ran:
            return DeleteAction.NOTHING_TO_DRAIN
        return DeleteAction.START_DRAIN
    if op_state in CHECKPOINTED_STATES:
        return DeleteAction.RECORDED
    if op_state is OperationState.FAILED:
        return DeleteAction.FORCE
    timeout = spec.drain_timeout_secs
    if drain_started is not None and (now - drain_started).total_seconds() >= timeout:
        return DeleteAction.FORCE
    if op_state is OperationState.PENDING:
        # Begun in the ledger but never sent: the operator that began it died between the
        # ledger and the broker (a replica killed, a failover). Starting it again with the
        # same key sends that operation's messages; the daemon answers a second copy from
        # its journal and the record is per operation, so one checkpoint either way.
        return DeleteAction.START_DRAIN
    return DeleteAction.WAIT


_KEEPING = {
    OperationKind.PAUSE: DeleteAction.KEEP_PAUSE_CHECKPOINT,
    OperationKind.COMPLETE: DeleteAction.KEEP_COMPLETED_CHECKPOINT,
}
"""A task whose last operation checkpointed it and stopped its daemon keeps that
checkpoint: a second drain of agents already stopped would find nothing new."""

_ON_ITS_WAY = frozenset({OperationState.PENDING, OperationState.DRAINING, OperationState.DRAINED})


def adopts_drain(observed: DeletionObserved) -> bool:
    """Whether a deletion takes over the pause (or completion) drain on its way instead
    of starting its own: a second drain would record a second checkpoint of the same
    agents. The deletion waits for that drain and keeps its checkpoint (``decide_delete``
    with that operation's state), or forces one past ``drainTimeout``. One that failed
    drained nothing: the deletion drains anew."""
    return observed.last_kind in _KEEPING and observed.last_state in _ON_ITS_WAY
