"""Operations that scale a task and complete it; heartbeats count finished agents.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05

``operations.kind`` admits ``scale-down`` (drain the agents a smaller ``spec.task.agents``
removes into a checkpoint), ``scale-up`` (bring agents back or start new ones) and
``complete`` (every agent finished its work: its checkpoint is recorded and kept);
``checkpoints.reason`` admits ``scale-down`` and ``completed``.
``daemon_activity.agents_done``: agents whose worker exited 0 by itself, its work over (a
row written before this revision reads 0, which is what a daemon that does not send the
count means).

Hand-written and frozen like 0001; batch mode, so SQLite recreates the tables whose check
constraints change.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATES = ("pending", "draining", "drained", "recorded", "forced", "failed", "resuming", "resumed")
KINDS_BEFORE = ("delete-drain", "pause", "resume", "restore", "force-delete", "drain")
KINDS = (*KINDS_BEFORE, "scale-down", "scale-up", "complete")
REASONS_BEFORE = ("delete", "pause", "manual", "forced")
REASONS = (*REASONS_BEFORE, "scale-down", "completed")


def one_of(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(value) for value in values)})"


def _timestamp() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def _tables(kinds: Sequence[str], reasons: Sequence[str]) -> tuple[sa.Table, sa.Table]:
    """``operations`` and ``checkpoints`` as revision 0006 left them, with ``kinds`` and
    ``reasons`` allowed: what SQLite's batch mode copies the rows into. Spelled out, not
    reflected, so the same migration also writes offline SQL (``--sql``)."""
    meta = sa.MetaData()
    operations = sa.Table(
        "operations", meta,
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("task_uid", sa.String(320), nullable=False),
        sa.Column("namespace", sa.String(63), nullable=False),
        sa.Column("name", sa.String(253), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=False),
        sa.Column("checkpoint_ref", sa.String(63), nullable=True),
        sa.Column("grace_secs", sa.Double(), nullable=True),
        sa.Column("celery_task_ids", sa.JSON(), nullable=False),
        sa.Column("detail", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("updated_at", _timestamp(), nullable=False),
        sa.Column("deadline_at", _timestamp(), nullable=True),
        sa.Column("finished_at", _timestamp(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_operations"),
        sa.UniqueConstraint("idempotency_key", name="uq_operations_idempotency_key"),
        sa.CheckConstraint(one_of("kind", kinds), name="ck_operations_kind"),
        sa.CheckConstraint(one_of("state", STATES), name="ck_operations_state"),
        sa.Index("ix_operations_namespace_name", "namespace", "name"),
        sa.Index("ix_operations_task_uid", "task_uid"),
        sa.Index("ix_operations_checkpoint_ref", "checkpoint_ref"),
        sa.Index("ix_operations_deadline_at", "deadline_at"),
    )  # fmt: skip
    checkpoints = sa.Table(
        "checkpoints", meta,
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("ref", sa.String(63), nullable=False),
        sa.Column("operation_id", sa.String(36), nullable=False),
        sa.Column("task_uid", sa.String(320), nullable=False),
        sa.Column("namespace", sa.String(63), nullable=False),
        sa.Column("name", sa.String(253), nullable=False),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("pvc_name", sa.String(253), nullable=True),
        sa.Column("forced", sa.Boolean(), nullable=False),
        sa.Column("verified", sa.Boolean(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("unavailable", sa.String(500), nullable=True),
        sa.Column("snapshot_name", sa.String(253), nullable=True),
        sa.Column("snapshot_ready_at", _timestamp(), nullable=True),
        sa.Column("snapshot_error", sa.String(500), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.UniqueConstraint("ref", name="uq_checkpoints_ref"),
        sa.UniqueConstraint("operation_id", name="uq_checkpoints_operation_id"),
        sa.ForeignKeyConstraint(["operation_id"], ["operations.id"],
                                name="fk_checkpoints_operation_id_operations"),
        sa.CheckConstraint(one_of("reason", reasons), name="ck_checkpoints_reason"),
        sa.Index("ix_checkpoints_namespace_name", "namespace", "name"),
        sa.Index("ix_checkpoints_namespace_pvc_name", "namespace", "pvc_name"),
    )  # fmt: skip
    return operations, checkpoints


def _checks(
    from_: tuple[Sequence[str], Sequence[str]], to: tuple[Sequence[str], Sequence[str]]
) -> None:
    operations, checkpoints = _tables(*from_)
    with op.batch_alter_table("operations", copy_from=operations) as batch:
        batch.drop_constraint(op.f("ck_operations_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_operations_kind"), one_of("kind", to[0]))
    with op.batch_alter_table("checkpoints", copy_from=checkpoints) as batch:
        batch.drop_constraint(op.f("ck_checkpoints_reason"), type_="check")
        batch.create_check_constraint(op.f("ck_checkpoints_reason"), one_of("reason", to[1]))


def upgrade() -> None:
    _checks((KINDS_BEFORE, REASONS_BEFORE), (KINDS, REASONS))
    with op.batch_alter_table("daemon_activity") as batch:
        batch.add_column(sa.Column("agents_done", sa.Integer(), nullable=False,
                                   server_default="0"))  # fmt: skip


def downgrade() -> None:
    with op.batch_alter_table("daemon_activity") as batch:
        batch.drop_column("agents_done")
    _checks((KINDS, REASONS), (KINDS_BEFORE, REASONS_BEFORE))
