"""The ledger's tables as SQLAlchemy 2 typed declarative models, and their vocabularies.

Four tables: ``operations`` (one row per lifecycle operation, keyed for idempotency),
``checkpoints`` (at most one per operation) with their ``checkpoint_agents``, and
``daemon_activity`` (the latest heartbeat per daemon). ``repository`` is the only
module that opens sessions on them and it hands out plain views, never these objects;
``migrations/`` creates them (``versions/0001_initial.py`` and the revisions after it are
frozen steps to this schema, and a test compares the two with Alembic's autogenerate).

Vocabularies are ``StrEnum``s stored as short strings with a CHECK constraint, so a
row written by any client is one the repository can read back.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class OperationKind(StrEnum):
    DELETE_DRAIN = "delete-drain"
    PAUSE = "pause"
    RESUME = "resume"
    RESTORE = "restore"
    FORCE_DELETE = "force-delete"
    DRAIN = "drain"
    SCALE_DOWN = "scale-down"
    """Drain the agents a smaller ``spec.task.agents`` removes, into a checkpoint."""
    SCALE_UP = "scale-up"
    """Bring back agents a scale-down removed, or start new ones (no checkpoint)."""
    COMPLETE = "complete"
    """Every agent finished its work: record its checkpoint, which is kept."""

    @property
    def records_checkpoint(self) -> bool:
        """Whether this kind of operation produces a checkpoint (the others consume one)."""
        return self not in (OperationKind.RESUME, OperationKind.RESTORE, OperationKind.SCALE_UP)


class OperationState(StrEnum):
    """pending → draining → drained → recorded | forced | failed (drain kinds);
    pending → resuming → resumed | failed (resume kinds).

    ``drained`` is entered by the ``record_checkpoint`` task when it receives the
    daemon's successful drain result, in its own transaction before the checkpoint's:
    an operation seen in ``drained`` has its agents stopped and checkpointed on the PVC,
    and only the ledger's record is still to come. A force-delete goes from ``pending``
    straight to ``forced`` (nothing was drained)."""

    PENDING = "pending"
    DRAINING = "draining"
    DRAINED = "drained"
    RECORDED = "recorded"
    FORCED = "forced"
    FAILED = "failed"
    RESUMING = "resuming"
    RESUMED = "resumed"

    @property
    def terminal(self) -> bool:
        """A terminal state is final: the operation has finished and is never reopened."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {OperationState.RECORDED, OperationState.FORCED, OperationState.FAILED, OperationState.RESUMED}
)

CHECKPOINTED_STATES = frozenset({OperationState.RECORDED, OperationState.FORCED})
"""Only ``record_checkpoint`` enters these, in the transaction that writes the checkpoint,
so an operation in one of them always has exactly one checkpoint row."""


class CheckpointReason(StrEnum):
    DELETE = "delete"
    PAUSE = "pause"
    MANUAL = "manual"
    FORCED = "forced"
    SCALE_DOWN = "scale-down"
    COMPLETED = "completed"


# Kubernetes limits, so that what the ledger holds fits back into the objects it mirrors.
LABEL_VALUE_MAX = 63
NAMESPACE_MAX = 63
NAME_MAX = 253
TASK_UID_MAX = 320
"""A Kubernetes uid is 36 characters; callers without one use ``<namespace>/<name>``."""
AGENT_ID_MAX = 64
"""The daemon's agent ids are at most 64 characters (``worker_agent.store.AGENT_ID``)."""
IDEMPOTENCY_KEY_MAX = 255
UNAVAILABLE_MAX = 500

RELEASING = "releasing_since IS NOT NULL"
"""The checkpoints ``drainctl ledger prune`` has marked and not finished (a partial
index's condition, as SQL)."""
SNAPSHOT_UNSETTLED = (
    "snapshot_name IS NOT NULL AND snapshot_ready_at IS NULL AND snapshot_error IS NULL"
)
"""A checkpoint whose snapshot was asked for and is neither ready nor failed: one the
operator follows (``ix_checkpoints_snapshot_unsettled``, migration 0010)."""

# Every constraint and index has a deterministic name, so later migrations can address
# them, including SQLite's batch mode, which recreates tables by name.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    PostgreSQL keeps the zone (``timestamptz``); SQLite keeps none, so values are
    normalised to UTC on the way in and marked UTC on the way out. A naive datetime is
    refused: the ledger never guesses which clock a timestamp came from.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"timestamp {value.isoformat()} has no timezone; pass an aware UTC time"
            )
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _one_of(column: str, values: type[StrEnum]) -> str:
    quoted = ", ".join(f"'{member.value}'" for member in values)
    return f"{column} IN ({quoted})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(none_as_null=True),
    }


class Operation(Base):
    """One lifecycle operation. The idempotency key makes starting one safe to repeat."""

    __tablename__ = "operations"
    __table_args__ = (
        CheckConstraint(_one_of("kind", OperationKind), name="kind"),
        CheckConstraint(_one_of("state", OperationState), name="state"),
        Index("ix_operations_namespace_name", "namespace", "name"),
        Index("ix_operations_task_uid", "task_uid"),
        Index("ix_operations_checkpoint_ref", "checkpoint_ref"),
        Index("ix_operations_deadline_at", "deadline_at"),
        Index("ix_operations_updated_at", "updated_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    """A uuid4 in its canonical text form."""
    kind: Mapped[str] = mapped_column(String(16))
    task_uid: Mapped[str] = mapped_column(String(TASK_UID_MAX))
    namespace: Mapped[str] = mapped_column(String(NAMESPACE_MAX))
    name: Mapped[str] = mapped_column(String(NAME_MAX))
    state: Mapped[str] = mapped_column(String(16))
    idempotency_key: Mapped[str] = mapped_column(String(IDEMPOTENCY_KEY_MAX), unique=True)
    checkpoint_ref: Mapped[str | None] = mapped_column(String(LABEL_VALUE_MAX))
    """The checkpoint this operation produced, or (resume, restore) the one it resumes from."""
    grace_secs: Mapped[float | None] = mapped_column(Double())
    celery_task_ids: Mapped[dict[str, Any]] = mapped_column(JSON())
    """Step name → Celery task id, e.g. ``{"drain": …, "record": …}``; merged, never replaced."""
    detail: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text())
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    deadline_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    """Set exactly when the state becomes terminal."""


class Checkpoint(Base):
    """A recorded drain: where each agent's conversation is on the workspace, which is
    kept as an immutable VolumeSnapshot where the cluster offers one, and as the
    retained PVC in any case."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        CheckConstraint(_one_of("reason", CheckpointReason), name="reason"),
        # Every read of checkpoints is newest first (``created_at DESC, id DESC``): each
        # index ends in that order, so a read stops at its limit instead of sorting.
        Index("ix_checkpoints_created_at_id", "created_at", "id"),
        Index(
            "ix_checkpoints_namespace_name_created_at_id", "namespace", "name", "created_at", "id"
        ),
        Index(
            "ix_checkpoints_namespace_pvc_name_created_at_id",
            "namespace",
            "pvc_name",
            "created_at",
            "id",
        ),
        # The snapshots the operator still follows (asked for or cut, neither ready nor
        # failed): a few rows among millions, read every few seconds.
        Index(
            "ix_checkpoints_snapshot_unsettled",
            "id",
            postgresql_where=text(SNAPSHOT_UNSETTLED),
            sqlite_where=text(SNAPSHOT_UNSETTLED),
        ),
        # The checkpoints a prune is releasing: none at rest, read by every audit.
        Index(
            "ix_checkpoints_releasing",
            "releasing_since",
            postgresql_where=text(RELEASING),
            sqlite_where=text(RELEASING),
        ),
    )

    id: Mapped[int] = mapped_column(Integer(), primary_key=True, autoincrement=True)
    ref: Mapped[str] = mapped_column(String(LABEL_VALUE_MAX), unique=True)
    """Mirrored into ``status.checkpointRef`` and onto the PVC as a label value."""
    operation_id: Mapped[str] = mapped_column(ForeignKey("operations.id"), unique=True)
    """UNIQUE: the database itself guarantees one checkpoint per operation."""
    task_uid: Mapped[str] = mapped_column(String(TASK_UID_MAX))
    namespace: Mapped[str] = mapped_column(String(NAMESPACE_MAX))
    name: Mapped[str] = mapped_column(String(NAME_MAX))
    reason: Mapped[str] = mapped_column(String(16))
    pvc_name: Mapped[str | None] = mapped_column(String(NAME_MAX))
    forced: Mapped[bool]
    verified: Mapped[bool]
    """True when the checkpoint is not forced and every agent's ref is clean (vacuously
    so for a drained daemon with no agents); a forced checkpoint is never verified."""
    created_at: Mapped[datetime]
    unavailable: Mapped[str | None] = mapped_column(String(UNAVAILABLE_MAX))
    """Why the checkpoint can no longer be restored (its workspace is gone), or None."""
    snapshot_name: Mapped[str | None] = mapped_column(String(NAME_MAX))
    """The VolumeSnapshot of the workspace taken for this checkpoint (its namespace's)."""
    snapshot_cut_at: Mapped[datetime | None]
    """When the snapshot was cut (its ``creationTime``: its point in time fixed, its data
    perhaps still uploading); None before, or on a row recorded before migration 0010."""
    snapshot_ready_at: Mapped[datetime | None]
    """When the snapshot was seen ``readyToUse``; a restore uses only a ready snapshot."""
    snapshot_error: Mapped[str | None] = mapped_column(String(UNAVAILABLE_MAX))
    """Why the snapshot failed (not cut, or not ready, in time); the retained PVC is all
    there is."""
    releasing_since: Mapped[datetime | None]
    """When ``drainctl ledger prune`` began releasing it (its storage about to be
    deleted); None otherwise. A restore never claims a checkpoint being released: the
    claim and the release both take the row, so one of them sees the other."""
    restore_claimed_at: Mapped[datetime | None]
    """When a restore last claimed it (``Ledger.claim_for_restore``); None: never."""

    agents: Mapped[list[CheckpointAgent]] = relationship(
        order_by="CheckpointAgent.agent_id",
        cascade="all, delete-orphan",
        passive_deletes=True,
        lazy="raise",
    )


class CheckpointAgent(Base):
    """One agent of a checkpoint: a ``ResumeRef`` as the daemon answered it."""

    __tablename__ = "checkpoint_agents"
    __table_args__ = (UniqueConstraint("checkpoint_id", "agent_id"),)

    id: Mapped[int] = mapped_column(Integer(), primary_key=True, autoincrement=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    agent_id: Mapped[str] = mapped_column(String(AGENT_ID_MAX))
    session_dir: Mapped[str] = mapped_column(Text())
    """Relative to the PVC root, so the checkpoint stays valid wherever the PVC is mounted."""
    turns: Mapped[int] = mapped_column(Integer())
    session_sha256: Mapped[str | None] = mapped_column(String(64))
    clean: Mapped[bool]
    exit: Mapped[int | None] = mapped_column(Integer())
    error: Mapped[str | None] = mapped_column(Text())


class DaemonActivity(Base):
    """The newest heartbeat of one daemon (one Sandbox), by its sequence number."""

    __tablename__ = "daemon_activity"
    __table_args__ = (Index("ix_daemon_activity_received_at", "received_at"),)

    namespace: Mapped[str] = mapped_column(String(NAMESPACE_MAX), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_MAX), primary_key=True)
    task_uid: Mapped[str | None] = mapped_column(String(TASK_UID_MAX))
    all_idle_since: Mapped[datetime | None]
    agents_total: Mapped[int] = mapped_column(Integer())
    agents_live: Mapped[int] = mapped_column(Integer())
    agents_idle: Mapped[int] = mapped_column(Integer())
    agents_interrupted: Mapped[int] = mapped_column(Integer(), server_default="0")
    """Agents stopped with work left (drained, crashed, failed): the operator resumes them."""
    agents_done: Mapped[int] = mapped_column(Integer(), server_default="0")
    """Agents whose worker exited 0 by itself, its work over (0 from a daemon that does
    not say): when every agent is done, the task completes."""
    reported_at: Mapped[datetime]
    seq: Mapped[int] = mapped_column(BigInteger())
    """Monotonic per daemon, across its restarts; a heartbeat with seq <= this is stale."""
    idle_for_secs: Mapped[float | None] = mapped_column(Double())
    """How long every agent had been idle when the daemon sent it, on the daemon host's
    monotonic clock; None while not idle, or from a daemon too old to say."""
    received_at: Mapped[datetime | None]
    """When the orchestrator stored it, on the orchestrator's clock (the daemon's may
    differ): what the idle pause bridges from, how the operator tells a silent daemon
    and a heartbeat newer than an operation; None only on a row stored before 0002."""
