"""The checkpoint ledger: the durable record of lifecycle operations and checkpoints.

It outlives the CalibanTask (``status.checkpointRef`` dies with the object; the ledger
does not), so a new task can be restored from a checkpoint of a deleted one. ``models``
holds the tables, ``repository`` the only code that reads and writes them (``Ledger``,
returning frozen views), and ``migrate`` runs the Alembic migrations in ``migrations/``.
SQLite is the embedded default; PostgreSQL serves the dev stack and production.

It takes the daemon's ``ResumeRef`` (``worker_agent.proto``) and nothing else from the
daemon side; it never imports the pipeline, the operator, the CLI or the embedded Kubernetes API.
"""

from orchestrator.ledger.migrate import current, downgrade, head, upgrade, upgrade_sql
from orchestrator.ledger.models import (
    TERMINAL_STATES,
    CheckpointReason,
    OperationKind,
    OperationState,
)
from orchestrator.ledger.repository import (
    ActivityView,
    CheckpointAgentView,
    CheckpointStorageView,
    CheckpointView,
    DrainRecordProblem,
    Ledger,
    LedgerConflict,
    LedgerError,
    NewOperation,
    OperationChange,
    OperationMove,
    OperationView,
    OtherTask,
    SnapshotMove,
    UnknownOperation,
    UnsettledSnapshotView,
    checkpoint_ref_for,
    create_ledger_engine,
    is_label_value,
    other_task,
)

__all__ = [
    "TERMINAL_STATES",
    "ActivityView",
    "CheckpointAgentView",
    "CheckpointReason",
    "CheckpointStorageView",
    "CheckpointView",
    "DrainRecordProblem",
    "Ledger",
    "LedgerConflict",
    "LedgerError",
    "NewOperation",
    "OperationChange",
    "OperationKind",
    "OperationMove",
    "OperationState",
    "OperationView",
    "OtherTask",
    "SnapshotMove",
    "UnknownOperation",
    "UnsettledSnapshotView",
    "checkpoint_ref_for",
    "create_ledger_engine",
    "current",
    "downgrade",
    "head",
    "is_label_value",
    "other_task",
    "upgrade",
    "upgrade_sql",
]
