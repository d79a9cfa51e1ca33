"""The ledger's first schema: operations, checkpoints, checkpoint_agents, daemon_activity.

Revision ID: 0001
Revises:
Create Date: 2025-12-02

Hand-written and frozen: it spells out every type, name and allowed value instead of
importing them from ``orchestrator.ledger.models``, so later changes to the models need a
new revision (a test diffs the models against a database migrated to head). Portable:
the same DDL runs on PostgreSQL and SQLite.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = ("delete-drain", "pause", "resume", "restore", "force-delete", "drain")
STATES = ("pending", "draining", "drained", "recorded", "forced", "failed", "resuming", "resumed")
REASONS = ("delete", "pause", "manual", "forced")


def one_of(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(value) for value in values)})"


def timestamp() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "operations",
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
        sa.Column("created_at", timestamp(), nullable=False),
        sa.Column("updated_at", timestamp(), nullable=False),
        sa.Column("deadline_at", timestamp(), nullable=True),
        sa.Column("finished_at", timestamp(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_operations_idempotency_key")),
        sa.CheckConstraint(one_of("kind", KINDS), name=op.f("ck_operations_kind")),
        sa.CheckConstraint(one_of("state", STATES), name=op.f("ck_operations_state")),
    )
    op.create_index(op.f("ix_operations_namespace_name"), "operations", ["namespace", "name"])
    op.create_index(op.f("ix_operations_task_uid"), "operations", ["task_uid"])

    op.create_table(
        "checkpoints",
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
        sa.Column("created_at", timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("ref", name=op.f("uq_checkpoints_ref")),
        # One checkpoint per operation, enforced by the database: the exactly-once backstop.
        sa.UniqueConstraint("operation_id", name=op.f("uq_checkpoints_operation_id")),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["operations.id"],
            name=op.f("fk_checkpoints_operation_id_operations"),
        ),
        sa.CheckConstraint(one_of("reason", REASONS), name=op.f("ck_checkpoints_reason")),
    )
    op.create_index(op.f("ix_checkpoints_namespace_name"), "checkpoints", ["namespace", "name"])

    op.create_table(
        "checkpoint_agents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("agent_id", sa.String(64), nullable=False),
        sa.Column("session_dir", sa.Text(), nullable=False),
        sa.Column("turns", sa.Integer(), nullable=False),
        sa.Column("session_sha256", sa.String(64), nullable=True),
        sa.Column("clean", sa.Boolean(), nullable=False),
        sa.Column("exit", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_agents")),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_checkpoint_agents_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint(
            "checkpoint_id",
            "agent_id",
            name=op.f("uq_checkpoint_agents_checkpoint_id_agent_id"),
        ),
    )

    op.create_table(
        "daemon_activity",
        sa.Column("namespace", sa.String(63), nullable=False),
        sa.Column("name", sa.String(253), nullable=False),
        sa.Column("task_uid", sa.String(320), nullable=True),
        sa.Column("all_idle_since", timestamp(), nullable=True),
        sa.Column("agents_total", sa.Integer(), nullable=False),
        sa.Column("agents_live", sa.Integer(), nullable=False),
        sa.Column("agents_idle", sa.Integer(), nullable=False),
        sa.Column("reported_at", timestamp(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("namespace", "name", name=op.f("pk_daemon_activity")),
    )


def downgrade() -> None:
    op.drop_table("daemon_activity")
    op.drop_table("checkpoint_agents")
    op.drop_index(op.f("ix_checkpoints_namespace_name"), table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_index(op.f("ix_operations_task_uid"), table_name="operations")
    op.drop_index(op.f("ix_operations_namespace_name"), table_name="operations")
    op.drop_table("operations")
